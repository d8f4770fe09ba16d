"""The forward-only role (`--behavior-forward role`): π_j^Meg computed off the train step.

Pinned: the role's log-probs (its own process, the versions' exported weights) equal the ones
the train step's snapshot forwards compute from the same weights; a train step that reads them
gives the loss of the critical-path step, with no snapshot forward; a token without a value
makes the step fall back (counted), never use a wrong value; and the real run wires it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from tests.test_loss_seam import _batch, _parse, _reference_step

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ray_up():
    from slime_async.orchestrator.roles import init_ray

    init_ray()
    yield


def _trained(tmp_path):
    """A trainer (snapshots in the step) after two steps, and each version's export."""
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse("--keep-old-actor", "--routing-replay", "r3")
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    dirs = {0: tr.save_weights(tmp_path / "v0")}
    for v in (1, 2):
        tr.train_step(_batch(v, routed=True))
        dirs[v] = tr.save_weights(tmp_path / f"v{v}")
    return cfg, tr, dirs


def test_role_logprobs_equal_the_train_steps_and_the_step_reads_them(tmp_path, ray_up):
    from loss import compis_denominators, compis_loss
    from slime_async.trainer.behavior_role import BehaviorRole

    cfg, tr, dirs = _trained(tmp_path)
    role = BehaviorRole(cfg.trainer, cfg.model)
    try:
        for v, d in dirs.items():
            role.add_version(v, d)
        b = _batch(7, versions=(0, 1, 2), routed=True)
        got = torch.as_tensor(asyncio_run(role.logprobs(b)))
    finally:
        role.shutdown()
    want = tr.compute_behavior_logprobs(b)  # the critical path: snapshots swapped in
    m = b.loss_mask
    assert bool(torch.isfinite(got[m]).all()) and bool(torch.isnan(got[~m]).all())
    assert (got[m] - want[m]).abs().max() <= 1e-6

    ref = _reference_step(tr, b, compis_loss, compis_denominators)
    tr.cfg = dataclasses.replace(tr.cfg, behavior_forward="role")  # this step reads the batch's
    assert tr.keeps_snapshots is False
    out = tr.train_step(dataclasses.replace(b, behavior_logprobs=got))
    assert out["train/behavior_forwards"] == 0.0 and out["train/behavior_missing_tokens"] == 0.0
    assert out["loss/compis_fallback"] == 0.0
    for key, value in ref.items():
        assert out[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    # trained tokens of an older version without a value → the step falls back, counted
    after = tr.train_step(
        dataclasses.replace(_batch(8, versions=(0, 3), routed=True), behavior_logprobs=None)
    )
    assert after["loss/compis_fallback"] == 1.0 and after["train/behavior_missing_tokens"] > 0
    tr.shutdown()


def test_a_logprob_request_drops_the_versions_below_its_floor_before_the_forward(tmp_path, ray_up):
    """Each request carries the data worker's floor (`BehaviorRole.floor`), capped at the
    oldest version of its own tokens: the role drops the older versions before that forward,
    with no release call between, and the log-probs are unchanged."""
    from slime_async.trainer.behavior_role import BehaviorRole

    cfg, tr, dirs = _trained(tmp_path)
    tr.shutdown()
    role = BehaviorRole(cfg.trainer, cfg.model)
    try:
        for v, d in dirs.items():
            role.add_version(v, d)
        floor = [0]
        role.floor = lambda: floor[0]
        b = _batch(7, versions=(1, 2), routed=True)
        want = torch.as_tensor(asyncio_run(role.logprobs(b)))
        assert role.versions() == [0, 1, 2]
        floor[0] = 2  # nothing still to come is older than v2; this batch's tokens are of v1
        got = torch.as_tensor(asyncio_run(role.logprobs(b)))
        assert role.versions() == [1, 2]  # v0 went; v1 stays for this batch's own tokens
        m = b.loss_mask
        assert bool(torch.isfinite(got[m]).all()) and torch.equal(got[m], want[m])
        asyncio_run(role.logprobs(_batch(8, versions=(2,), routed=True)))
        assert role.versions() == [2]
    finally:
        role.shutdown()


def test_role_fed_through_the_object_store_equals_the_role_fed_from_directories(tmp_path, ray_up):
    """The distributed transport writes no directory: the trainer's export reaches the role as
    one file in this node's memory file system (removed once the role mapped it), or as a Ray
    ref. Same weights, same log-probs (bit for bit); a ref whose version does not match is
    refused."""
    import ray

    from slime_async.trainer import weights_io
    from slime_async.trainer.behavior_role import BehaviorRole
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse("--keep-old-actor", "--routing-replay", "r3")
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    dirs, refs = {}, {}
    for v in (0, 1, 2):
        if v:
            tr.train_step(_batch(v, routed=True))
        dirs[v] = tr.save_weights(tmp_path / f"v{v}")
        refs[v] = ray.put(tr.export_weights())  # a copy, as an actor's return value is
    b = _batch(7, versions=(0, 1, 2), routed=True)
    from_dirs, from_refs, from_files = (
        BehaviorRole(cfg.trainer, cfg.model),
        BehaviorRole(cfg.trainer, cfg.model),
        BehaviorRole(cfg.trainer, cfg.model),
    )
    try:
        files = {}
        for v in (0, 1, 2):
            from_dirs.add_version(v, dirs[v])
            from_refs.add_version(v, refs[v])
            tr.import_hf(dirs[v])  # the trainer at version v writes its one file
            tr.version = v
            files[v] = from_files.version_file(v, "127.0.0.1")
            assert files[v] is not None and files[v].parent == weights_io.SHM_DIR
            assert tr.write_weights_file(files[v]) == files[v].stat().st_size
            from_files.add_version_file(v, files[v])
        a = torch.as_tensor(asyncio_run(from_dirs.logprobs(b)))
        c = torch.as_tensor(asyncio_run(from_refs.logprobs(b)))
        f = torch.as_tensor(asyncio_run(from_files.logprobs(b)))
        assert not any(p.exists() for p in files.values())  # the role removed each once mapped
        assert from_files.version_file(3, "10.255.255.1") is None  # a writer on another node
        with pytest.raises(ray.exceptions.RayTaskError, match="version 2 given as version 5"):
            ray.get(from_refs.add_version(5, refs[2]))
    finally:
        from_dirs.shutdown()
        from_refs.shutdown()
        from_files.shutdown()
        tr.shutdown()
    m = b.loss_mask
    assert bool(torch.isfinite(c[m]).all())
    assert torch.equal(a[m], c[m]) and torch.equal(a[m], f[m])


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


async def test_the_run_computes_pi_j_in_the_role(tmp_path):
    """Four async steps of the real run (the role is the default here): every step reads
    π_j^Meg from the batch (no snapshot forward, nothing missing, no fallback)."""
    from slime_async.config import parse_config
    from slime_async.orchestrator.controller import train

    cfg = parse_config(
        [
            "--run-dir",
            str(tmp_path),
            "--num-steps",
            "4",
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
            "--max-staleness",
            "2",
        ]
    )
    # the default of an async run whose loss reads pi_j^Meg
    assert cfg.trainer.keep_old_actor and cfg.trainer.behavior_forward == "role"
    summary = await train(cfg)
    assert summary["train/version"] == 4 and math.isfinite(summary["loss/total"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/version" in r]
    assert len(steps) == 4
    assert all(r["train/behavior_forwards"] == 0 for r in steps)
    assert all(r["train/behavior_missing_tokens"] == 0 for r in steps)
    assert all(r["loss/compis_fallback"] == 0 for r in steps)
    assert all(
        math.isfinite(r["timing/node_load_1m"]) and r["timing/node_load_1m"] >= 0 for r in steps
    )
    # the role held what the samples in flight needed, not the bound's worst case
    held = [r["role/versions_held"] for r in steps if "role/versions_held" in r]
    assert held and max(held) < cfg.trainer.max_snapshots, (held, cfg.trainer.max_snapshots)
    assert any(r["staleness/mean"] > 0 for r in steps)  # older versions were trained on
    # how busy the role kept the rollout side, per step: every trained sample went through it
    assert all(r["role/failures"] == 0 for r in steps)
    assert sum(r["role/samples"] for r in steps) >= 4 * 8 - 8  # the first batch may predate
    assert all(r["role/calls"] <= r["role/samples"] for r in steps)  # bursts of >= 1 sample
    assert sum(r["role/calls"] for r in steps) > 0 and sum(r["role/busy_s"] for r in steps) > 0


def test_a_continued_sample_is_sent_whole_and_assembled_in_place():
    """`sample_batch` gives the role prompt + every segment with each token's version;
    `assemble` puts a sample's values on its response tokens, NaN for a sample without any."""
    from data_worker.versions import VersionRuns
    from slime_async.contracts.rollout import (
        Batch,
        GenerationRequest,
        GenerationResult,
        Group,
        Prompt,
        Sample,
    )
    from slime_async.rollout.generate.assemble import assemble
    from slime_async.rollout.generate.behavior import sample_batch

    prompt = Prompt(key="p", prompt_ids=(1, 5, 3))
    req = GenerationRequest(
        prompt=prompt,
        group_seq=0,
        sample_index=0,
        prefix_ids=(11, 12),
        prefix_versions=VersionRuns.constant(4, 2),
    )
    res = GenerationResult(output_ids=(13, 2), token_versions=(5, 5))
    b = sample_batch([(req, res)])
    assert b.tokens.tolist() == [[1, 5, 3, 11, 12, 13, 2]]
    assert b.loss_mask.tolist() == [[False] * 3 + [True] * 4]
    assert b.token_versions.tolist() == [[-1, -1, -1, 4, 4, 5, 5]]

    def sample(i: int, payload: dict) -> Sample:
        base = {"logprobs": [-1.0, -1.0], "nonfinite": [False, False], "reward": float(i)}
        return Sample(
            sample_index=i,
            output_ids=(13, 2),
            token_versions=VersionRuns.constant(5, 2),
            payloads=({**base, **payload},),
            min_version=5,
            attempts=1,
        )

    group = Group(
        seq=0,
        prompt=prompt,
        samples=(sample(0, {"behavior_logprobs": [-0.5, -0.25]}), sample(1, {})),
        min_version=5,
        max_version=5,
        admitted_version=5,
        completed_at=0.0,
    )
    tb = assemble(
        Batch(groups=(group,), dropped=0, filtered=0, current_version=6, wait_s=0.0),
        estimator="grpo",
    ).batch
    assert tb.behavior_logprobs[0, 3:].tolist() == [-0.5, -0.25]
    assert bool(tb.behavior_logprobs[0, :3].isnan().all()) and bool(
        tb.behavior_logprobs[1].isnan().all()
    )


def test_the_role_holds_only_weights_and_computes_the_trainers_values(tmp_path):
    """The lean forward-only model: no gradients, no DDP gradient buffer, no optimizer; its
    bytes are its parameters' alone, and its log-probs are the trainer's on the same weights."""
    from slime_async.trainer.behavior_role import BehaviorForwarder
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse("--keep-old-actor")
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    tr.train_step(_batch(1))
    tr.save_weights(tmp_path / "v1")
    b = _batch(2, versions=(1,))
    want, _ = tr.compute_logprobs(b)
    fwd = BehaviorForwarder(cfg.trainer, cfg.model, max_versions=2)
    fwd.add_version(1, tmp_path / "v1")
    got = torch.as_tensor(fwd.logprobs(b))
    m = b.loss_mask
    assert (got[m] - want[m]).abs().max() <= 1e-6
    model = fwd.trainer
    assert not hasattr(model, "optim")
    assert all(not p.requires_grad and p.grad is None for p in model.model.parameters())
    assert all(not hasattr(p, "main_grad") for p in model.model.parameters())
    params = sum(p.numel() for p in model.model.parameters())
    assert model.parameter_bytes() == 4 * params  # fp32 weights, nothing per parameter else


def _storages(*tensor_sets) -> int:
    """Bytes of the distinct storages behind the tensors (a shared one counted once)."""
    seen: dict[int, int] = {}
    for ts in tensor_sets:
        for t in ts:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_the_role_holds_exactly_its_versions_and_reads_them_in_place(tmp_path):
    """The role keeps `max_versions` versions and nothing more: its model's parameters are the
    newest version's tensors (no current copy), a forward points them at a version (no swap
    copy), and a new version is loaded into the evicted oldest one's storage. The log-probs
    are each version's, as the trainer computes them."""
    from slime_async.trainer.behavior_role import BehaviorForwarder
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse("--keep-old-actor")
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    fwd = BehaviorForwarder(cfg.trainer, cfg.model, max_versions=2)
    params = list(fwd.trainer.model.parameters())
    one = fwd.trainer.parameter_bytes()
    evicted = []
    for v in (0, 1, 2):
        if v:
            tr.train_step(_batch(v))
        evicted += fwd.add_version(v, tr.export_weights())
        held = [list(fwd.store.state(x).values()) for x in fwd.versions()]
        assert _storages(params, *held) == one * len(fwd.versions())  # no copy beside them
    assert evicted == [0] and fwd.versions() == [1, 2]
    newest = [p.data_ptr() for p in params]
    b = _batch(7, versions=(1, 2))
    got = torch.as_tensor(fwd.logprobs(b))
    assert [p.data_ptr() for p in params] == newest  # pointed back at the newest version
    want = tr.compute_behavior_logprobs(b)
    m = b.loss_mask
    assert bool(torch.isfinite(got[m]).all()) and (got[m] - want[m]).abs().max() <= 1e-6
    tr.shutdown()


def test_the_role_releases_the_versions_no_sample_to_come_needs(tmp_path):
    """`release_below(v)` drops every version older than v, never the newest (its model's
    parameters), and their storage goes: the role then holds the versions it keeps and nothing
    more; the kept versions' log-probs are unchanged, a released version's tokens have none
    (NaN, never a wrong value), and the next version is loaded beside the kept ones."""
    from slime_async.trainer.behavior_role import BehaviorForwarder
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse("--keep-old-actor")
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    fwd = BehaviorForwarder(cfg.trainer, cfg.model, max_versions=4)
    params = list(fwd.trainer.model.parameters())
    one = fwd.trainer.parameter_bytes()
    for v in (0, 1, 2, 3):
        if v:
            tr.train_step(_batch(v))
        fwd.add_version(v, tr.export_weights())
    b = _batch(7, versions=(1, 2, 3))
    m = b.loss_mask
    before = torch.as_tensor(fwd.logprobs(b))
    assert fwd.release_below(2) == [0, 1] and fwd.versions() == [2, 3]
    held = [list(fwd.store.state(x).values()) for x in fwd.versions()]
    assert _storages(params, *held) == 2 * one  # nothing of versions 0 and 1 is left
    after = torch.as_tensor(fwd.logprobs(b))
    old = m & (b.token_versions == 1)
    assert bool(old.any()) and bool(after[old].isnan().all())
    kept = m & (b.token_versions >= 2)
    assert bool(kept.any()) and torch.equal(after[kept], before[kept])
    assert fwd.release_below(99) == [2] and fwd.versions() == [3]  # the newest stays
    tr.train_step(_batch(4))
    assert fwd.add_version(4, tr.export_weights()) == [] and fwd.versions() == [3, 4]
    held = [list(fwd.store.state(x).values()) for x in fwd.versions()]
    assert _storages(params, *held) == 2 * one
    tr.shutdown()


def _mapped(path) -> list[tuple[int, int]]:
    """This process's address ranges that map `path` (removed or not)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if str(path) in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def test_a_file_of_the_parameters_is_the_version_served_in_place(tmp_path):
    """A trainer that holds the whole model writes its parameters themselves (not the HF
    export): the role serves the mapped file as the version, every parameter a view of its
    pages (nothing copied or allocated), with the log-probs of the HF path bit for bit; a
    released version's pages leave the process."""
    from slime_async.trainer import weights_io
    from slime_async.trainer.behavior_role import BehaviorForwarder
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = _parse("--keep-old-actor")
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    assert tr.holds_whole_model()
    fwd = BehaviorForwarder(cfg.trainer, cfg.model, max_versions=3)
    ref = BehaviorForwarder(cfg.trainer, cfg.model, max_versions=3)
    d = weights_io.SHM_DIR if weights_io.SHM_DIR.is_dir() else tmp_path
    files = {v: d / f"slime_async-test-{os.getpid()}-v{v}.safetensors" for v in (1, 2)}
    for v in (1, 2):
        tr.train_step(_batch(v))
        tr.write_weights_file(files[v])
        _, meta = weights_io.map_tensor_file(files[v])
        assert meta["layout"] == weights_io.PARAMS_LAYOUT
        fwd.add_version_file(v, files[v])
        ref.add_version(v, tr.export_weights())
        assert not files[v].exists()  # removed once mapped
    ranges = _mapped(files[2])
    params = dict(fwd.trainer.model.named_parameters())
    assert ranges and all(
        any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in params.values()
    )
    b = _batch(7, versions=(1, 2))
    m = b.loss_mask
    got, want = torch.as_tensor(fwd.logprobs(b)), torch.as_tensor(ref.logprobs(b))
    assert bool(torch.isfinite(got[m]).all()) and torch.equal(got[m], want[m])
    assert _mapped(files[1])
    assert fwd.release_below(2) == [1] and not _mapped(files[1])  # its pages are gone
    tr.shutdown()


def test_lora_role_shares_the_base_and_equals_the_trainers_adapter_snapshots(tmp_path):
    """`--behavior-forward role` with `--lora-rank`: the role loads the frozen base once and one
    adapter per version (from the adapter directory a disk push writes, or the trainer's
    in-memory adapter); its snapshots hold the adapters only, and its π_j^Meg equal the
    trainer's adapter snapshots' (≤ 1e-6)."""
    from slime_async.contracts.adapter import adapter_numel
    from slime_async.trainer.behavior_role import BehaviorForwarder
    from slime_async.trainer.trainer import MegatronTrainer

    lora = ("--lora-rank", "4", "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj")
    cfg = _parse("--keep-old-actor", *lora)
    assert _parse("--keep-old-actor", "--behavior-forward", "role", *lora).trainer.lora_rank == 4
    tr = MegatronTrainer(cfg.trainer, cfg.model)
    base = tr.save_base_weights(tmp_path / "base")
    sources: dict[int, object] = {0: tr.save_adapter(tmp_path / "a0")}
    for v in (1, 2):
        tr.train_step(_batch(v))
        sources[v] = tr.save_adapter(tmp_path / f"a{v}") if v == 1 else tr.export_adapter()
    fwd = BehaviorForwarder(cfg.trainer, cfg.model, max_versions=3)
    with pytest.raises(ValueError, match="before the base"):
        fwd.add_version(0, sources[0])
    fwd.set_base(base)
    for v, src in sources.items():
        fwd.add_version(v, src)
    b = _batch(7, versions=(0, 1, 2))
    got = torch.as_tensor(fwd.logprobs(b))
    want = tr.compute_behavior_logprobs(b)  # the trainer's adapter snapshots swapped in
    m = b.loss_mask
    assert bool(torch.isfinite(got[m]).all())
    assert (got[m] - want[m]).abs().max() <= 1e-6
    held = fwd.store.state(2)
    assert sum(t.numel() for t in held.values()) == adapter_numel(cfg.model, tr.lora)
    tr.shutdown()


def test_the_role_floats_over_the_runs_cores_with_one_thread(ray_up):
    """`--behavior-role-cores all`: the role is pinned to the trainer's and the engines' cores
    together and keeps the one thread it had on the engines' cores; `rollout` (the default)
    keeps it on the engines' cores."""
    import os

    import ray

    from slime_async.config import parse_config
    from slime_async.orchestrator.roles import pin_actor
    from slime_async.orchestrator.trainer_start import behavior_role_cores

    default = parse_config(["--trainer-cores", "0", "--rollout-cores", "1"])
    assert default.behavior_role_cores == "rollout" and behavior_role_cores(default) == (1,)
    both = parse_config(
        ["--trainer-cores", "0", "--rollout-cores", "1", "--behavior-role-cores", "all"]
    )
    assert behavior_role_cores(both) == (0, 1)
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse_config(["--behavior-role-cores", "trainer"])

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self):
            return sorted(os.sched_getaffinity(0)), torch.get_num_threads()

    probe = Probe.remote()
    try:
        asyncio_run(pin_actor(probe, behavior_role_cores(both), 1))
        assert ray.get(probe.where.remote()) == ([0, 1], 1)
        asyncio_run(pin_actor(probe, behavior_role_cores(default), 1))
        assert ray.get(probe.where.remote()) == ([1], 1)
    finally:
        ray.kill(probe)
