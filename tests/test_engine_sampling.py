"""The engine's sampler as a pure function: it draws from the (filtered) temperature-scaled
distribution, reports log-probs before filtering, is reproducible per row, and rejects bad
sampling_params with a message."""

from __future__ import annotations

import pytest
import torch

from slime_async.engine.sampling import RequestError, SamplingParams, parse_sampling_params, sample


def _draws(logits: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    toks, _ = sample(logits.expand(n, -1), [p] * n, gens)
    return torch.tensor(toks)


def test_empirical_frequencies_match_tempered_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    p = SamplingParams(temperature=0.8)
    toks = _draws(logits, p, 20000)
    freq = torch.bincount(toks, minlength=5).float() / len(toks)
    want = torch.softmax(logits / 0.8, dim=-1)
    assert (freq - want).abs().max() < 0.015, (freq, want)


def test_topk_topp_minp_restrict_support_but_not_logprobs() -> None:
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -2.0])
    probs = torch.softmax(logits, -1)
    assert set(_draws(logits, SamplingParams(top_k=2), 3000).tolist()) == {0, 1}
    # smallest prefix with mass >= 0.8
    cum = probs.cumsum(0)
    keep = int((cum < 0.8).sum()) + 1
    assert set(_draws(logits, SamplingParams(top_p=0.8), 3000).tolist()) == set(range(keep))
    mp = _draws(logits, SamplingParams(min_p=0.5), 3000)
    assert set(mp.tolist()) == {i for i in range(6) if probs[i] >= 0.5 * probs.max()}
    gens = [torch.Generator().manual_seed(1)]
    tok, lp = sample(logits[None], [SamplingParams(top_k=1, temperature=0.5)], gens)
    assert tok == [0]
    assert lp[0] == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[0]), abs=1e-6)


def test_greedy_reports_t1_logprobs_and_rows_are_independent() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=2.0)]
    toks, lps = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)])
    assert toks[0] == int(logits[0].argmax())
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)
    # row 1 draws the same token alone as inside the batch (own generator)
    alone, _ = sample(logits[1:2], params[1:2], [torch.Generator().manual_seed(1)])
    assert alone[0] == toks[1]
    # banned ids are never drawn
    t, _ = sample(
        logits[:1],
        [SamplingParams(temperature=0.0)],
        [torch.Generator()],
        banned=[frozenset({toks[0]})],
    )
    assert t[0] != toks[0]


@pytest.mark.parametrize(
    ("d", "needle"),
    [
        ({"max_tokens": 1}, "unknown sampling_params keys"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"max_new_tokens": -2}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
        ({"n": 0}, "n must be"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 33}, "at most 32"),
        ({"regex": "a+"}, "not supported"),
        ({"sampling_seed": 1.5}, "integer"),
        ({"ignore_eos": 1}, "true or false"),
    ],
)
def test_bad_sampling_params(d: dict, needle: str) -> None:
    with pytest.raises(RequestError, match=needle):
        parse_sampling_params(d)


def test_neutral_values_and_nulls_accepted() -> None:
    p = parse_sampling_params(
        {
            "temperature": None,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "stop": "END",
            "stream_interval": 4,
            "stop_token_ids": [2, 3],
        }
    )
    assert p.temperature == 1.0 and p.stop == ("END",) and p.stop_token_ids == {2, 3}
