"""Which no-grad forwards a train step runs, and that skipping one never changes the loss.

One optimizer update per step means π_k (the weights the step starts from) equals the
training forward's own log-probs (r1 ≡ 1 in value): the step takes them detached instead of
running a separate π_k forward, for every loss that reads π_k. Pinned here against the step
written out by hand from the trainer's no-grad forwards (`_reference_step`), on the tiny MoE
with the engine's routing replayed (R3) and trained tokens of two versions.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_loss_seam import _batch, _count_snapshot_forwards, _parse, _reference_step

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

LOSSES_READING_PI_K = ["compis", "ppo", "decoupled_ppo", "single_ratio", "m2po", "gspo"]


def _denominators_fn(tr):
    from loss import denominators

    fn = tr.loss_spec.needs.denominators
    return fn if fn is not None else (lambda i, c: denominators(i.loss_mask))


@pytest.mark.parametrize("name", LOSSES_READING_PI_K)
def test_no_pi_k_forward_and_the_same_loss(name):
    """Every built-in loss that reads π_k: no separate π_k forward runs, and the loss and its
    metrics equal the step computed with π_k (and lp_θ) from the no-grad forward, to 1e-6."""
    from loss import get_loss
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse("--loss", name, "--keep-old-actor", "--routing-replay", "r3")
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    tr.train_step(_batch(0, routed=True))
    b = _batch(1, versions=(0, 1), routed=True)
    ref = _reference_step(tr, b, get_loss(name), _denominators_fn(tr))
    swaps = _count_snapshot_forwards(tr)
    m = tr.train_step(b)
    assert m["train/proximal_forwards"] == 0.0 and "timing/proximal_logprobs_s" not in m
    for key, want in ref.items():
        assert m[key] == pytest.approx(want, rel=1e-6, abs=1e-6), key
    reads_snapshots = tr.loss_spec.needs.behavior_logprobs
    assert swaps[0] == (1 if reads_snapshots else 0)  # only version 0 needs a snapshot
    assert ("train/behavior_forwards" in m) == reads_snapshots
    tr.shutdown()


def test_ppo_with_snapshots_kept_runs_no_snapshot_forward():
    """`--loss ppo --keep-old-actor`: snapshots are kept (other callers may read them) but the
    step runs neither the snapshot forward nor a π_k forward, and its loss equals plain PPO's
    (no snapshots) on the same weights and batch."""
    from slime_async.trainer.trainer import MegatronTrainer

    steps = {}
    for keep in ("--keep-old-actor", "--no-keep-old-actor"):
        cfg = _parse("--loss", "ppo", keep, "--routing-replay", "r3")
        tr = MegatronTrainer(cfg.trainer, cfg.model)
        tr.train_step(_batch(0, routed=True))
        swaps = _count_snapshot_forwards(tr)
        steps[keep] = tr.train_step(_batch(1, versions=(0, 1), routed=True))
        assert swaps[0] == 0 and tr.snapshots.versions() == ([0, 1, 2] if keep[2] == "k" else [])
        tr.shutdown()
    kept, plain = steps["--keep-old-actor"], steps["--no-keep-old-actor"]
    for m in (kept, plain):
        assert m["train/proximal_forwards"] == 0.0 and "train/behavior_forwards" not in m
        assert "timing/behavior_logprobs_s" not in m
    assert kept["loss/total"] == plain["loss/total"]
    assert kept["train/grad_norm"] == plain["train/grad_norm"]


def test_denominators_that_read_log_probs_keep_the_pi_k_forward():
    """CompIS `denom=drop` with a masking correction counts tokens from π_k before the training
    forward, so the π_k forward runs there (and only there)."""
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse(
        "--keep-old-actor",
        "--routing-replay",
        "r3",
        "--denom",
        "drop",
        "--staleness-correction-method",
        "cap",
    )
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    assert tr.train_step(_batch(0, routed=True))["train/proximal_forwards"] == 3.0
    tr.shutdown()
    cfg = _parse("--keep-old-actor", "--routing-replay", "r3", "--denom", "drop")  # clip: none
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    assert tr.train_step(_batch(0, routed=True))["train/proximal_forwards"] == 0.0
    tr.shutdown()
