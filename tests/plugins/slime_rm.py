"""A reward function with slime's signature, as a slime user writes it (tests/test_e2e_slime.py)."""

from __future__ import annotations


async def rm(args, sample, **kwargs):
    """1.0 iff the response is the label's tokens then EOS (args and sample read as in slime)."""
    if args.n_samples_per_prompt < 1 or sample.status not in (
        sample.Status.COMPLETED,
        sample.Status.TRUNCATED,
    ):
        raise ValueError(f"unexpected args/sample: {args.n_samples_per_prompt}, {sample.status}")
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    return float(response == [*sample.label, 2])
