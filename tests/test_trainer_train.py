"""Train step, version snapshots, checkpoint save/load and resume guards (world size 1)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from slime_async.contracts.model import TINY_MOE

pytestmark = pytest.mark.timeout(150)
torch.set_num_threads(1)


def _trainer(**kw):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    base = dict(lr=2e-3, micro_batch_size=2, seed=3)
    base.update(kw)
    return MegatronTrainer(TrainerConfig(**base), TINY_MOE)


def _batch(seed: int = 0, **kw):
    from slime_async.trainer.testing import random_batch

    return random_batch(TINY_MOE, batch=kw.get("batch", 8), width=20, prompt=6, seed=seed)


def _params(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def test_train_step_lowers_loss_and_microbatch_shares_sum_to_full_loss():
    from loss import LossInputs, compis_loss

    tr = _trainer()
    b = _batch()
    lp0, _ = tr.compute_logprobs(b)

    def full_loss(lp: torch.Tensor) -> float:
        inputs = LossInputs(
            logprobs=lp[:, 1:],
            proximal_logprobs=lp0[:, 1:],
            rollout_logprobs=b.rollout_logprobs[:, 1:],
            behavior_logprobs=None,
            advantages=b.advantages[:, 1:],
            loss_mask=b.loss_mask[:, 1:],
        )
        return float(compis_loss(inputs, tr.loss_cfg).loss)

    m = tr.train_step(b)  # 4 micro-batches of 2: the summed shares are the full-batch loss
    assert m["loss/total"] == pytest.approx(full_loss(lp0), abs=1e-6)
    assert tr.version == 1 and m["train/version"] == 1.0
    lp1, _ = tr.compute_logprobs(b)
    assert full_loss(lp1) < m["loss/total"] - 1e-3  # the surrogate went down on this batch
    pos, neg = b.advantages > 0, b.advantages < 0
    assert (lp1 - lp0)[b.loss_mask & pos].mean() > 0 > (lp1 - lp0)[b.loss_mask & neg].mean()
    assert m["train/grad_norm"] > 0 and m["train/lr"] == pytest.approx(2e-3)
    assert m["loss/compis_fallback"] == 1.0  # keep_old_actor off → combined-ratio fallback


def test_per_token_versions_use_their_own_snapshot():
    tr = _trainer(keep_old_actor=True, max_snapshots=3, routing_replay="r2")
    b = _batch(1)
    tr.train_step(b)
    tr.train_step(b)
    assert tr.version == 2 and tr.snapshots.versions() == [0, 1, 2]
    lps = {j: tr.compute_logprobs(b, version=j)[0] for j in (0, 1, 2)}
    assert not torch.allclose(lps[0], lps[2])  # the versions really differ
    assert torch.equal(tr.compute_logprobs(b)[0], lps[2])  # swapping restored current weights
    ver = torch.randint(0, 3, b.token_versions.shape, generator=torch.Generator().manual_seed(0))
    mixed = dataclasses.replace(b, token_versions=torch.where(b.loss_mask, ver, -1))
    beh = tr.compute_behavior_logprobs(mixed)
    expect = torch.where(ver == 0, lps[0], torch.where(ver == 1, lps[1], lps[2]))
    m = mixed.loss_mask
    assert torch.allclose(beh[m], expect[m], atol=1e-6)
    metrics = tr.train_step(mixed)
    assert metrics["loss/compis_fallback"] == 0.0
    assert metrics["is/staleness/version_lag_max"] == 2.0
    # version 0 is evicted once 3 newer snapshots exist → π_0^Meg is gone → explicit fallback
    assert tr.snapshots.versions() == [1, 2, 3]
    assert tr.compute_behavior_logprobs(mixed) is None
    assert tr.train_step(mixed)["loss/compis_fallback"] == 1.0
    assert tr.snapshots.versions() == [2, 3, 4]
    assert tr.release(2) and not tr.release(2) and tr.snapshots.versions() == [3, 4]


def _as_written_before_ckpt_format(ckpt) -> None:
    """Rewrite meta.json as checkpoints were written before --ckpt-format (no such field)."""
    import json

    from slime_async.trainer.checkpoint import _meta_digest

    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["ckpt_format"]
    meta["meta_sha256"] = _meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_save_load_continue_equals_uninterrupted(tmp_path, fmt):
    """Both formats resume bit-exactly; a torch checkpoint written before --ckpt-format existed
    loads under the default (torch_dist) flag: `load` reads the format the checkpoint has."""
    b1, b2 = _batch(2), _batch(3)
    a = _trainer(save=str(tmp_path / "ck"), lr_warmup_steps=2, ckpt_format=fmt)
    a.train_step(b1)
    a.train_step(b2)
    ck = a.save_checkpoint(extra_state={"data_worker": {"cursor": 17}, "controller": [1, 2]})
    assert (ck / "model.pt").is_file() == (fmt == "torch")
    assert (ck / "dist" / ".metadata").is_file() == (fmt == "torch_dist")
    if fmt == "torch":
        _as_written_before_ckpt_format(ck)
    ma = [a.train_step(b1), a.train_step(b2)]
    wa = _params(a)
    b = _trainer(load=str(tmp_path / "ck"), lr_warmup_steps=2)
    assert b.version == 2 and b.extra_state == {"data_worker": {"cursor": 17}, "controller": [1, 2]}
    mb = [b.train_step(b1), b.train_step(b2)]
    wb = _params(b)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert [m["loss/total"] for m in ma] == [m["loss/total"] for m in mb]


def test_resume_guards_name_the_path(tmp_path):
    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer.checkpoint import CheckpointError
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=rf"--load {missing} does not exist"):
        _trainer(load=str(missing), hf_checkpoint=str(tmp_path))  # no fallback to hf weights
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=rf"--load {empty} holds no complete checkpoint"):
        _trainer(load=str(empty))
    zero = _trainer(save=str(tmp_path / "zero"))
    zero.save_checkpoint()
    with pytest.raises(CheckpointError, match="iteration 0"):
        _trainer(load=str(tmp_path / "zero"))
    zero.train_step(_batch())
    zero.save_checkpoint()
    other = dataclasses.replace(TINY_MOE, num_experts=8)
    with pytest.raises(CheckpointError, match=r"another model config.*num_experts.*\(4, 8\)"):
        MegatronTrainer(TrainerConfig(load=str(tmp_path / "zero")), other)
    with pytest.raises(TypeError):
        zero.save_checkpoint(extra_state={"bad": object()})
    assert isinstance(ModelSpec.from_dict(TINY_MOE.to_dict()), ModelSpec)


@pytest.mark.parametrize(
    "fmt, weights, state",
    [("torch", "model.pt", "optim.pt"), ("torch_dist", "dist/__0_0.distcp", "dist/.metadata")],
)
def test_corrupted_or_partial_checkpoint_is_never_picked(tmp_path, caplog, fmt, weights, state):
    """A truncated or bit-flipped file (a torch_dist shard, or the metadata dist_checkpointing
    would unpickle) fails its size / sha256 check before anything reads it."""
    from slime_async.trainer.checkpoint import CheckpointError, find_latest, iter_name

    d = tmp_path / "ck"
    tr = _trainer(save=str(d), keep_checkpoints=5, ckpt_format=fmt)
    b = _batch()
    tr.train_step(b)
    good = tr.save_checkpoint()
    tr.train_step(b)
    newer = tr.save_checkpoint()
    assert find_latest(d) == newer and (d / "latest").read_text().strip() == "2"
    # a crashed save: temp dir full of files, and an iter dir without meta.json
    (d / f".tmp-{iter_name(3)}").mkdir()
    (d / f".tmp-{iter_name(3)}" / "model.pt").write_bytes(b"junk")
    (d / iter_name(4)).mkdir()
    assert find_latest(d) == newer
    # corrupt the newest: truncate its weights → the older complete one is used, with a warning
    f = newer / weights
    f.write_bytes(f.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert find_latest(d) == good
    assert "truncated" in caplog.text
    resumed = _trainer(load=str(d))
    assert resumed.version == 1
    # same size but flipped bytes → sha256 catches it; nothing complete is left → refuse
    g = good / state
    raw = bytearray(g.read_bytes())
    raw[-10] ^= 0xFF
    g.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        find_latest(d)
    with pytest.raises(CheckpointError, match="sha256"):
        find_latest(good)


def test_tampered_or_malformed_meta_json_is_refused_naming_it(tmp_path, caplog):
    """meta.json carries the data-worker state and every file's sha256, so it is checksummed
    itself: an edit (here: the worker's counters), a non-object body or a stripped checksum is
    refused with a message naming the file, never an AttributeError or a silent resume."""
    import json

    from slime_async.trainer.checkpoint import CheckpointError, find_latest

    d = tmp_path / "ck"
    tr = _trainer(save=str(d), keep_checkpoints=5)
    b = _batch()
    tr.train_step(b)
    good = tr.save_checkpoint(extra_state={"worker": {"counters": {"n_dropped": 0}}})
    tr.train_step(b)
    newer = tr.save_checkpoint(extra_state={"worker": {"counters": {"n_dropped": 0}}})
    meta_path = newer / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["extra_state"]["worker"]["counters"]["n_dropped"] = 7  # tampered data-worker state
    meta_path.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        assert find_latest(d) == good  # the newest is skipped, naming why
    assert f"{meta_path} fails its checksum" in caplog.text
    with pytest.raises(CheckpointError, match=r"meta.json fails its checksum"):
        find_latest(newer)
    del meta["meta_sha256"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json has no meta_sha256"):
        find_latest(newer)
    (good / "meta.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"meta.json holds a JSON list"):
        find_latest(good)
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        _trainer(load=str(d))


def test_logprobs_do_not_depend_on_padding_or_batch_company():
    from slime_async.trainer.testing import random_batch

    tr = _trainer(micro_batch_size=3)
    b = random_batch(TINY_MOE, batch=5, width=20, prompt=4, seed=6, lengths=[20, 7, 13, 9, 5])
    lp, ent = tr.compute_logprobs(b)
    assert lp.shape == (5, 20)
    for i in range(5):
        n = int(b.lengths[i])
        alone, _ = tr.compute_logprobs(b.select([i]).trimmed(n))
        assert (lp[i, :n] - alone[0]).abs().max() <= 1e-5, i
        assert (lp[i, n:] == 0).all() and (ent[i, n:] == 0).all()  # padding stays 0


def test_non_finite_gradients_refuse_the_update():
    tr = _trainer()
    b = _batch(4)
    before = _params(tr)
    # an overflow somewhere in backward: one gradient turns into inf
    p = dict(tr.model.named_parameters())["decoder.final_layernorm.weight"]
    handle = p.register_hook(lambda g: g * float("inf"))
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm .* version 0"):
        tr.train_step(b)
    handle.remove()
    assert tr.version == 0
    assert all(torch.equal(before[k], v) for k, v in _params(tr).items())
    assert tr.train_step(b)["train/version"] == 1.0  # the next good batch trains normally


def test_changed_lr_flags_on_resume_are_reported(tmp_path, caplog):
    a = _trainer(save=str(tmp_path / "ck"))
    a.train_step(_batch())
    a.save_checkpoint()
    with caplog.at_level(logging.WARNING):
        b = _trainer(load=str(tmp_path / "ck"), lr=5e-4)
    assert "LR schedule differs" in caplog.text and b.version == 1
    assert b.train_step(_batch())["train/lr"] == pytest.approx(5e-4)


def test_loss_is_selected_by_name_or_dotted_path():
    from loss import LossInputs, LossSelection
    from loss.registry import get_loss

    b = _batch(seed=5)
    ppo = _trainer(loss=LossSelection(name="ppo"))
    lp0, _ = ppo.compute_logprobs(b)
    m = ppo.train_step(b)
    # plain PPO has no behaviour weight: the step's loss is the unweighted surrogate at r1 = 1
    inputs = LossInputs(
        logprobs=lp0[:, 1:],
        proximal_logprobs=lp0[:, 1:],
        rollout_logprobs=b.rollout_logprobs[:, 1:],
        behavior_logprobs=None,
        advantages=b.advantages[:, 1:],
        loss_mask=b.loss_mask[:, 1:],
    )
    assert m["loss/total"] == pytest.approx(float(get_loss("ppo")(inputs, ppo.loss_cfg).loss))
    assert ppo.version == 1
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        _trainer(loss=LossSelection(name="nope"))
    with pytest.raises(ValueError, match="no attribute"):
        _trainer(loss=LossSelection(name="loss.registry.does_not_exist"))


def test_torch_dist_checkpoint_converts_to_torch_and_exports(tmp_path):
    """`convert_checkpoint` turns a torch_dist checkpoint into the torch format (model.pt,
    optim.pt) that resumes to the same state; `export_hf` reads either to the same weights."""
    from safetensors.torch import load_file

    from slime_async.tools.convert_checkpoint import main as convert_main
    from slime_async.tools.export_hf import export_checkpoint
    from slime_async.trainer.checkpoint import _optimizer_moments

    a = _trainer(save=str(tmp_path / "ck"))
    a.train_step(_batch())
    a.save_checkpoint(extra_state={"step": 1})
    assert convert_main(["--load", str(tmp_path / "ck"), "--out", str(tmp_path / "conv")]) == 0
    assert (tmp_path / "conv" / "iter_0000001" / "model.pt").is_file()
    b = _trainer(load=str(tmp_path / "conv"))
    assert b.version == 1 and b.extra_state == {"step": 1}
    (ma, sa), (mb, sb) = _optimizer_moments(a), _optimizer_moments(b)
    assert sa == sb and all(torch.equal(ma[k][n], mb[k][n]) for k in ma for n in ma[k])
    assert all(torch.equal(p, q) for p, q in zip(_params(a).values(), _params(b).values()))
    x = export_checkpoint(tmp_path / "ck", tmp_path / "hf_dist")
    y = export_checkpoint(tmp_path / "conv", tmp_path / "hf_torch")
    for f in x.glob("*.safetensors"):  # the same tensors bit for bit (-0.0 != 0.0 here)
        got, want = load_file(f), load_file(y / f.name)
        assert got.keys() == want.keys()
        assert all(got[k].numpy().tobytes() == want[k].numpy().tobytes() for k in got)


def test_deterministic_mode_runs_the_step_under_deterministic_algorithms():
    """slime's --deterministic-mode: the trainer process switches PyTorch's deterministic
    algorithms on (an op without a deterministic kernel would raise) and still trains."""
    try:
        tr = _trainer(deterministic_mode=True)
        assert torch.are_deterministic_algorithms_enabled()
        m = tr.train_step(_batch())
        assert tr.version == 1 and m["train/grad_norm"] > 0
    finally:
        torch.use_deterministic_algorithms(False)


def test_use_rollout_logprobs_makes_the_engines_logprobs_the_old_policy():
    """slime's --use-rollout-logprobs: PPO's ratio is pi_theta / pi_SGL (here a uniform policy's
    log-probs), not pi_theta / pi_k (1 in value after one update per step)."""
    from loss import LossInputs, LossSelection, resolve_loss_spec

    tr = _trainer(use_rollout_logprobs=True, loss=LossSelection(name="ppo"))
    b = _batch()
    lp0, _ = tr.compute_logprobs(b)
    spec = resolve_loss_spec("ppo")

    def ppo(old: torch.Tensor) -> float:
        inputs = LossInputs(
            logprobs=lp0[:, 1:],
            proximal_logprobs=old[:, 1:],
            rollout_logprobs=b.rollout_logprobs[:, 1:],
            advantages=b.advantages[:, 1:],
            loss_mask=b.loss_mask[:, 1:],
        )
        return float(spec.fn(inputs, tr.loss_cfg).loss)

    m = tr.train_step(b)
    assert m["loss/total"] == pytest.approx(ppo(b.rollout_logprobs), abs=1e-6)
    assert abs(ppo(b.rollout_logprobs) - ppo(lp0)) > 1e-3  # the flag changed the old policy


def test_grad_cosine_compares_consecutive_steps_gradients():
    """`train/grad_cosine`: absent on the first step; 1 when the weights did not move and the
    batch is the same (lr 0); below 1 for a different batch; the sketch of a small model is the
    whole gradient, so the logged value is the exact cosine."""
    from slime_async.trainer.optim import cosine_sums, grad_sketch

    tr = _trainer(lr=0.0)
    b, other = _batch(seed=0), _batch(seed=5)
    assert "train/grad_cosine" not in tr.train_step(b)
    assert tr.train_step(b)["train/grad_cosine"] == pytest.approx(1.0, abs=1e-9)
    before = grad_sketch(tr.optim.optimizer.get_main_grads_for_grad_norm())
    c = tr.train_step(other)["train/grad_cosine"]
    after = grad_sketch(tr.optim.optimizer.get_main_grads_for_grad_norm())
    dot, na, nb = cosine_sums(after, before).tolist()
    assert c == pytest.approx(dot / (na * nb) ** 0.5, abs=1e-9) and -1.0 < c < 0.999
    sk = grad_sketch([torch.arange(10.0), torch.arange(5.0)], budget=4)  # every 4th of 15
    assert sk.tolist() == [0.0, 4.0, 8.0, 0.0, 4.0]


def test_cpu_adam_runs_fused_and_updates_as_the_per_tensor_loop(monkeypatch):
    """On CPU the optimizer runs torch's fused Adam kernel (no parameter-sized temporaries), and
    two steps move the weights as the per-tensor loop megatron would otherwise run."""
    from slime_async.trainer import optim

    def groups(tr):
        return [g for sub in tr.optim._subs() for g in sub.optimizer.param_groups]

    fused = _trainer()
    assert groups(fused) and all(g["fused"] and not g["foreach"] for g in groups(fused))
    monkeypatch.setattr(optim, "fuse_cpu_adam", lambda optimizer: False)
    loop = _trainer()
    assert not any(g["fused"] for g in groups(loop))
    start = _params(fused)
    for seed in range(2):
        fused.train_step(_batch(seed))
        loop.train_step(_batch(seed))
    a, b = _params(fused), _params(loop)
    assert any(not torch.equal(a[n], start[n]) for n in a)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_cpu_step_trims_the_heap_before_each_micro_batch_after_the_first(monkeypatch):
    """What the micro-batches before freed goes back to the node before the next one allocates
    (`schedule._Step.forward_step`; the peak it saves: scripts/bench_trainer_peak.py): a step
    of 4 micro-batches trims 3 times, each after the previous micro-batch's loss (its backward
    follows at once); a step of one micro-batch never."""
    from slime_async.trainer import schedule

    tr = _trainer()
    events: list[str] = []
    real_trim, real_loss = schedule.trim_heap, schedule._Step.loss_func
    monkeypatch.setattr(schedule, "trim_heap", lambda: events.append("trim") or real_trim())

    def loss_func(self, *a, **k):
        events.append("loss")
        return real_loss(self, *a, **k)

    monkeypatch.setattr(schedule._Step, "loss_func", loss_func)
    tr.train_step(_batch())
    assert events == ["loss", "trim"] * 3 + ["loss"]
    events.clear()
    tr.train_step(_batch(batch=2))  # one micro-batch of 2
    assert events == ["loss"]
