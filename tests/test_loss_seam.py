"""The loss seam: a loss declares its config and the inputs it reads; the trainer computes only
those; plugin losses get their settings from the command line (`--loss-config`).

The plugin (`tests/plugins/scaled_ppo.py`: one file, one registry line) runs through the real
path: `train_async.py`'s config parsing → `MegatronTrainer.train_step` on the tiny MoE.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from slime_async.contracts.model import TINY_MOE

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

BASE = [
    "--warmstart-steps",
    "0",
    "--micro-batch-size",
    "3",
    "--routing-replay",
    "r2",
    "--behavior-forward",
    "trainer",
    "--lr",
    "2e-3",
    "--seed",
    "3",
]


def _parse(*argv: str):
    from slime_async.config import build_parser, read_environment, validate

    args = build_parser().parse_args([*BASE, *argv])
    return validate(args, read_environment(args))


def _batch(seed: int, versions: tuple[int, ...] = (0,), *, routed: bool = False):
    """Ragged random batch; noisy engine log-probs; trained tokens of the given versions;
    random (fixed) engine routing for R3 when `routed`."""
    import numpy as np

    from slime_async.trainer.testing import random_batch

    b = random_batch(
        TINY_MOE, batch=7, width=20, prompt=6, seed=seed, lengths=[20, 15, 18, 20, 9, 12, 20]
    )
    g = torch.Generator().manual_seed(100 + seed)
    noisy = b.rollout_logprobs + 0.5 * torch.randn(b.rollout_logprobs.shape, generator=g)
    ver = torch.tensor(versions)[torch.randint(len(versions), b.token_versions.shape, generator=g)]
    rng = np.random.default_rng(seed)
    nl, k, e = TINY_MOE.num_layers, TINY_MOE.moe_topk, TINY_MOE.num_experts
    experts = tuple(
        np.stack([rng.permutation(e)[:k] for _ in range((n - 1) * nl)]).reshape(n - 1, nl, k)
        for n in b.lengths.tolist()
    )
    return dataclasses.replace(
        b,
        rollout_logprobs=torch.where(b.loss_mask, noisy, 0.0),
        token_versions=torch.where(b.loss_mask, ver, -1),
        routed_experts=experts if routed else None,
    )


def _count_snapshot_forwards(tr) -> list[int]:
    """Count the trainer's swaps to a version snapshot (one per π_j^Meg forward pass set)."""
    calls = [0]
    real = tr.snapshots.swapped_in

    def counting(model, version):
        calls[0] += 1
        return real(model, version)

    tr.snapshots.swapped_in = counting
    return calls


def _inputs(mb, lp, lp_k, lp_j, version, n_tok=None, n_seq=None):
    """The loss's view of a micro-batch, written out here (position t scores token t)."""
    from loss import LossInputs

    def cut(t):
        return None if t is None else t[:, 1:]

    return LossInputs(
        logprobs=cut(lp),
        proximal_logprobs=cut(lp_k),
        rollout_logprobs=cut(mb.rollout_logprobs),
        behavior_logprobs=cut(lp_j),
        advantages=cut(mb.advantages),
        loss_mask=cut(mb.loss_mask),
        token_versions=cut(mb.token_versions),
        current_version=version,
        global_num_tokens=n_tok,
        global_num_seqs=n_seq,
    )


def _reference_step(tr, b, loss_fn, denominators):
    """The train step written out by hand from the trainer's own forwards: π_k and π_j^Meg of
    the whole batch, the loss's global denominators summed over micro-batches, then the loss of
    each micro-batch with lp_θ = π_k (the same weights) and metrics reduced per token."""
    from slime_async.trainer.metrics_agg import MetricAccumulator

    lp_k, ent = tr.compute_logprobs(b)
    lp_j = tr.compute_behavior_logprobs(b) if tr.loss_spec.needs.behavior_logprobs else None
    parts, start = [], 0
    for mb in b.micro_batches(tr.cfg.micro_batch_size):
        rows, w = slice(start, start + mb.size), int(mb.lengths.max())
        start += mb.size
        j = None if lp_j is None else lp_j[rows, :w]
        parts.append((mb.trimmed(w), lp_k[rows, :w], ent[rows, :w], j))
    counts = [denominators(_inputs(mb, k, k, j, tr.version), tr.loss_cfg) for mb, k, _, j in parts]
    n_tok, n_seq = sum(c[0] for c in counts), sum(c[1] for c in counts)
    acc, total = MetricAccumulator(), 0.0
    for mb, k, e, j in parts:
        out = loss_fn(_inputs(mb, k, k, j, tr.version, n_tok, n_seq), tr.loss_cfg)
        total += float(out.loss)
        m = mb.loss_mask
        acc.add(out.metrics, weight=float(m.sum()))
        acc.add({"policy/entropy": float(e[m].sum() / max(1, int(m.sum())))}, weight=float(m.sum()))
    ref = acc.reduce()
    ref.pop("loss/value", None)
    return {**ref, "loss/total": total, "train/num_tokens": n_tok, "train/num_seqs": n_seq}


def _assert_matches(metrics, ref, *, skip=()):
    for key, want in ref.items():
        if key in skip:
            continue
        assert key in metrics, key
        assert metrics[key] == pytest.approx(want, rel=1e-5, abs=1e-6), key


def test_default_compis_step_equals_the_loss_called_directly():
    """Pins the default CompIS step (snapshots kept, π_j^Meg of mixed versions, R3 replay of the
    engine's routing): loss and every metric equal compis_loss called on the same inputs, with
    compis_denominators (here denom=drop, so they are the loss's own counts)."""
    from loss import compis_denominators, compis_loss
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse(
        "--keep-old-actor",
        "--routing-replay",
        "r3",
        "--engine-correction-method",
        "icepop",
        "--engine-correction-low",
        "0.5",
        "--denom",
        "drop",
    )
    assert cfg.trainer.loss.name == "compis"
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    tr.train_step(_batch(0, routed=True))
    b = _batch(1, versions=(0, 1), routed=True)
    ref = _reference_step(tr, b, compis_loss, compis_denominators)
    swaps = _count_snapshot_forwards(tr)
    m = tr.train_step(b)
    assert m["loss/compis_fallback"] == 0.0 and ref["loss/compis_fallback"] == 0.0
    _assert_matches(m, ref)
    assert m["train/num_tokens"] < float(b.loss_mask.sum())  # denom=drop: the loss's own counts
    assert swaps[0] == 1 and m["train/behavior_forwards"] == 3.0  # version 0, 3 micro-batches
    assert m["train/proximal_forwards"] == 3.0
    tr.shutdown()


def test_plugin_loss_gets_its_flag_and_only_the_inputs_it_declares():
    """`--loss scaled_ppo --loss-config scale=3` through the real config parsing and a real
    train step: the factor reaches the loss, and no snapshot forward runs for it even though
    snapshots are kept (CompIS on the same trainer settings does run them)."""
    import tests.plugins.scaled_ppo as plugin
    from loss import denominators, get_loss
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse(
        "--loss", "scaled_ppo", "--loss-config", "scale=3", "--eps-clip", "0.1", "--keep-old-actor"
    )
    assert cfg.trainer.loss.name == "scaled_ppo"
    assert cfg.trainer.loss.config == plugin.ScaledPPOConfig(
        scale=3.0, eps_clip=0.1, eps_clip_high=0.1, loss_scale_factor=48.0
    )
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    tr.train_step(_batch(0))
    b = _batch(1, versions=(0, 1))
    ppo = get_loss("ppo")

    def unscaled(inputs, c):
        return ppo(inputs, plugin.PPOConfig(**c.ppo_knobs()))

    ref = _reference_step(tr, b, unscaled, lambda i, c: denominators(i.loss_mask))
    swaps = _count_snapshot_forwards(tr)
    m = tr.train_step(b)
    assert m["plugin/scale"] == 3.0
    assert m["loss/total"] == pytest.approx(3.0 * ref["loss/total"], rel=1e-5, abs=1e-6)
    _assert_matches(m, ref, skip=("loss/total",))
    assert swaps[0] == 0 and "train/behavior_forwards" not in m
    assert "timing/behavior_logprobs_s" not in m and "is/engine/mean" not in m
    assert m["train/proximal_forwards"] == 3.0
    tr.shutdown()

    compis = MegatronTrainer(_parse("--keep-old-actor").trainer, TINY_MOE)
    compis.train_step(_batch(0))
    swaps = _count_snapshot_forwards(compis)
    assert compis.train_step(b)["train/behavior_forwards"] > 0 and swaps[0] == 1
    compis.shutdown()


def test_a_loss_without_pi_k_skips_that_forward_unless_r2_records_routing():
    """prime_masked_is reads only π_j^SGL: no π_k forward (its loss equals the direct call with
    the training forward's log-probs); with R2 the forward runs to record the routing."""
    from loss import denominators, prime_masked_is_loss
    from slime_async.trainer.trainer import MegatronTrainer

    b = _batch(2)
    cfg = _parse(
        "--loss",
        "prime_masked_is",
        "--loss-config",
        "token_low=0.3",
        "--routing-replay",
        "none",
        "--no-keep-old-actor",
    )
    assert cfg.trainer.loss.config.token_low == 0.3
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    ref = _reference_step(tr, b, prime_masked_is_loss, lambda i, c: denominators(i.loss_mask))
    m = tr.train_step(b)
    assert m["train/proximal_forwards"] == 0.0 and "timing/proximal_logprobs_s" not in m
    _assert_matches(m, ref)  # entropy comes from the training forward here
    tr.shutdown()
    r2 = MegatronTrainer(dataclasses.replace(cfg.trainer, routing_replay="r2"), TINY_MOE)
    assert r2.train_step(b)["train/proximal_forwards"] == 3.0
    r2.shutdown()


def test_needs_are_checked_at_start_up():
    from loss import LossNeeds, LossSelection, compis_denominators, register_loss
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    with pytest.raises(ValueError, match="needs proximal_logprobs=True"):
        LossNeeds(proximal_logprobs=False, denominators=compis_denominators)
    register_loss(
        "test_only_needs_replay",
        lambda i, c: None,
        config_cls=None,
        needs=LossNeeds(routing_replay=True),
        replace=True,
    )
    with pytest.raises(ValueError, match="only valid with MoE routing replay; set --routing"):
        MegatronTrainer(TrainerConfig(loss=LossSelection(name="test_only_needs_replay")), TINY_MOE)
    from loss import GSPOConfig

    with pytest.raises(ValueError, match="takes a PPOConfig, got a GSPOConfig"):
        MegatronTrainer(
            TrainerConfig(loss=LossSelection(name="ppo", config=GSPOConfig())), TINY_MOE
        )


# ------------------------------------------------------------------ --loss-config parsing


def test_loss_config_types_file_and_precedence(tmp_path):
    from loss import GSPOConfig, M2POConfig

    m2 = _parse(
        "--loss",
        "m2po",
        "--loss-config",
        "tau=0.02",
        "cap=none",
        "--loss-config",
        "diagnostics=false",
        "--eps-clip-c",
        "3",
    ).trainer.loss.config
    assert m2 == M2POConfig(
        tau=0.02, cap=None, diagnostics=False, dual_clip_c=3.0, loss_scale_factor=48.0
    )
    f = tmp_path / "gspo.json"
    f.write_text(json.dumps({"eps_low": 1e-3, "eps_high": 2e-3}))
    gs = _parse(
        "--loss", "gspo", "--loss-config-file", str(f), "--loss-config", "log_ratio_max=5"
    ).trainer.loss.config
    assert gs == GSPOConfig(eps_low=1e-3, eps_high=2e-3, log_ratio_max=5.0)
    from loss import loss_settings_from_args
    from slime_async.config import build_parser

    args = build_parser().parse_args(["--eps-clip", "0.1"])
    derived = loss_settings_from_args(args, default_loss_scale_factor=48.0).derived
    assert derived == (
        ("--eps-clip-high", 0.1, "follows --eps-clip"),
        ("--loss-scale-factor", 48.0, "the max response length"),
    )
    y = tmp_path / "compis.yaml"
    y.write_text("engine_method: icepop\nengine_low: 0.5\ndenom: drop\n")
    c = _parse("--loss-config-file", str(y)).trainer.loss.config
    assert (str(c.engine_method), c.engine_low, str(c.denom)) == ("icepop", 0.5, "drop")
    # a dotted path to a plain function: CompIS settings, as before declared configs existed
    p = _parse(
        "--custom-loss-function-path",
        "loss.compis.compis_loss",
        "--loss-config",
        "eps_clip_high=0.28",
    ).trainer.loss
    assert p.name == "loss.compis.compis_loss" and p.config.eps_clip_high == 0.28


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--loss-config", "nope=1"],
            r"--loss compis \(CompISConfig\) has no setting 'nope'; valid keys: eps_clip, ",
        ),
        (
            ["--loss", "gspo", "--loss-config", "eps_low=abc"],
            r"GSPOConfig\)\.eps_low expected a number",
        ),
        (["--loss", "m2po", "--loss-config", "diagnostics=maybe"], "expected true or false"),
        (["--loss-config", "engine_method=bogus"], "engine_method='bogus' is not supported"),
        (
            ["--eps-clip", "0.1", "--loss-config", "eps_clip=0.3"],
            r"'eps_clip' is given twice \(--eps-clip and --loss-config eps_clip=0.3\)",
        ),
        (["--loss-config", "tau=1", "tau=2", "--loss", "m2po"], "'tau' is given twice"),
        (
            ["--loss", "gspo", "--staleness-correction-method", "cap"],
            r"--staleness-correction-method: --loss gspo \(GSPOConfig\) has no setting",
        ),
        (["--loss", "gspo", "--eps-clip", "0.1"], "valid keys: eps_low, eps_high, log_ratio_max"),
        (["--loss", "ppo", "--custom-loss-function-path", "a.b"], "give one of them"),
        (["--loss", "nope"], "unknown loss 'nope'; choose one of"),
        (["--loss-config", "novalue"], "expects KEY=VALUE"),
        (["--loss", "m2po", "--loss-config", "tau=0"], r"--loss m2po \(M2POConfig\): tau=0.0 must"),
        (["--eps-clip-c", "0.5"], "dual clip"),
        (["--loss-config-file", "/nonexistent.json"], "does not exist"),
        (
            ["--no-loss-diagnostics", "--loss-config", "diagnostics=true"],
            r"'diagnostics' is given twice \(--no-loss-diagnostics and --loss-config",
        ),
    ],
)
def test_loss_config_errors_name_the_problem(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(*argv)


def test_unset_dedicated_flags_leave_the_config_defaults():
    """A dedicated flag not given (None) leaves its field to the loss's config class."""
    from loss import CompISConfig

    cfg = _parse().trainer.loss.config
    assert dataclasses.replace(cfg, loss_scale_factor=None) == CompISConfig()
    assert _parse("--no-loss-diagnostics").trainer.loss.config.diagnostics is False


def test_loss_config_file_conflicts_and_plain_plugins(tmp_path):
    from loss import LossSpec, register_loss

    f = tmp_path / "s.json"
    f.write_text(json.dumps({"eps_clip": 0.3}))
    with pytest.raises(ValueError, match=r"given twice \(--loss-config-file .* and --loss-config"):
        _parse("--loss-config-file", str(f), "--loss-config", "eps_clip=0.1")
    register_loss("test_only_no_settings", lambda i, c: None, config_cls=None, replace=True)
    assert _parse("--loss", "test_only_no_settings").trainer.loss.config is None
    with pytest.raises(ValueError, match="takes no settings"):
        _parse("--loss", "test_only_no_settings", "--loss-config", "x=1")
    from loss import get_loss_spec

    register_loss("test_only_plain", lambda i, c: None, replace=True)

    plain = get_loss_spec("test_only_plain")
    assert isinstance(plain, LossSpec) and plain.needs.behavior_logprobs  # what CompIS reads
    assert plain.config_cls.__name__ == "CompISConfig"
    assert math.isfinite(_parse("--loss", "test_only_plain").trainer.loss.config.eps_clip)


async def test_plugin_loss_end_to_end_through_the_controller(tmp_path):
    """Two async steps of the real run (Ray, embedded engine, router, trainer actor) with the
    plugin loss: the trainer actor, a separate process, resolves it from its config (unpickling
    the config imports the plugin module, whose registry line registers it)."""
    import tests.plugins.scaled_ppo  # noqa: F401  (registers "scaled_ppo" in this process)
    from slime_async.config import parse_config
    from slime_async.orchestrator.controller import train

    cfg = parse_config(
        [
            "--run-dir",
            str(tmp_path),
            "--num-steps",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "4",
            "--rollout-max-response-len",
            "12",
            "--warmstart-steps",
            "0",
            "--eval-interval",
            "0",
            "--micro-batch-size",
            "4",
            "--loss",
            "scaled_ppo",
            "--loss-config",
            "scale=2",
            "--keep-old-actor",
        ]
    )
    summary = await train(cfg)
    assert summary["train/version"] == 2 and math.isfinite(summary["loss/total"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/version" in r]
    assert len(steps) == 2
    assert all(r["plugin/scale"] == 2.0 and "train/behavior_forwards" not in r for r in steps)
    # one optimizer update per step, no R2, denominators from the mask: π_k comes from the
    # training forward, no separate forward
    assert all(r["train/proximal_forwards"] == 0 for r in steps)
