"""DAPO's soft over-long punishment as flags (`--overlong-buffer-len`,
`--overlong-penalty-factor`): the rewards of long responses are shaped in batch assembly, before
the advantages, and the shaping is reported."""

from __future__ import annotations

import pytest
import torch

from slime_async.config.cli import build_parser
from slime_async.rollout.config import rollout_config_from_args
from slime_async.rollout.generate.assemble import assemble, overlong_shaping
from tests.rollout_batches import one_group_batch, scored_sample


def _rollout(*argv: str):
    return rollout_config_from_args(build_parser().parse_args(list(argv)))


def test_long_responses_lose_reward_before_the_advantages():
    cfg = _rollout(
        "--rollout-max-response-len", "6", "--overlong-buffer-len", "2",
        "--overlong-penalty-factor", "0.5",
    )  # fmt: skip
    shaping = overlong_shaping(cfg)
    assert shaping is not None and (shaping.max_len, shaping.buffer_len) == (6, 2)
    samples = [scored_sample(i, [7] * n, reward=1.0) for i, n in enumerate([2, 4, 5, 6])]
    batch = one_group_batch(samples)
    plain = assemble(batch, estimator="dr_grpo")
    shaped = assemble(batch, estimator="dr_grpo", overlong=shaping)
    # penalties 0, 0, -0.25, -0.5: dr_grpo subtracts their mean (-0.1875) from each
    want = torch.tensor([0.1875, 0.1875, -0.0625, -0.3125])
    got = torch.stack([shaped.batch.advantages[i][shaped.batch.loss_mask[i]][0] for i in range(4)])
    assert torch.allclose(got, want)
    assert not plain.batch.advantages.any()  # equal raw rewards: no signal without the shaping
    assert shaped.metrics["rollout/overlong_penalty"] == pytest.approx(-0.75 / 4)
    assert shaped.metrics["rollout/overlong_frac"] == 0.5
    assert shaped.metrics["rollout/reward"] == 1.0  # the reward itself is reported unshaped
    assert "rollout/overlong_penalty" not in plain.metrics


def test_the_shaping_is_off_by_default_and_a_buffer_past_the_limit_is_refused():
    assert overlong_shaping(_rollout()) is None
    with pytest.raises(ValueError, match="--overlong-buffer-len 9 is longer than"):
        _rollout("--rollout-max-response-len", "8", "--overlong-buffer-len", "9")
