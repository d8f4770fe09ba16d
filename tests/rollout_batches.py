"""Hand-built rollout batches for tests of what happens after generation (assembly, dumps):
the data worker's `Batch` of scored groups, with the payload keys the generate client and
scoring write."""

from __future__ import annotations

from collections.abc import Sequence

from data_worker.types import Batch, Group, Prompt, Sample
from data_worker.versions import VersionRuns


def scored_sample(
    index: int,
    output_ids: Sequence[int],
    *,
    reward: float,
    version: int = 0,
    finish: str = "stop",
    prompt_len: int = 3,
) -> Sample:
    """A finished, scored sample of one generate segment."""
    n = len(output_ids)
    payload = {
        "logprobs": [-0.1 * (i + 1) for i in range(n)],
        "nonfinite": [False] * n,
        "finish": finish,
        "prompt_len": prompt_len,
        "reward": reward,
        "reward_status": "ok",
    }
    return Sample(
        sample_index=index,
        output_ids=list(output_ids),
        token_versions=VersionRuns.constant(version, n),
        payloads=(payload,),
        min_version=version,
        attempts=1,
    )


def one_group_batch(samples: Sequence[Sample], *, version: int = 0, key: str = "p0") -> Batch:
    """A batch of one group (prompt [1, 5, 9]) of `samples`, taken at `version`."""
    prompt = Prompt(key=key, prompt_ids=[1, 5, 9], payload={"label": "7"})
    group = Group(
        seq=0,
        prompt=prompt,
        samples=tuple(samples),
        min_version=min(s.min_version for s in samples),
        max_version=max(s.min_version for s in samples),
        admitted_version=version,
        completed_at=0.0,
    )
    return Batch(groups=(group,), dropped=0, filtered=0, current_version=version, wait_s=0.0)
