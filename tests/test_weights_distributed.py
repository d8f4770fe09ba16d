"""The distributed weight transport against real embedded engine servers over gloo on
127.0.0.1: two engines (processes) in one weight update group with an in-process sender as
rank 0, the router in front for pause/continue. Versions advance on every engine and the served
weights are exactly the sender's; a request in flight crosses a push with per-token versions; an
engine that refuses, or dies as the broadcast starts, leaves the others on a whole version; bad
requests are refused with the fix; a short `train_async.py` run pushes this way end to end."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
from pathlib import Path

import aiohttp
import pytest
import torch

from router import Router, RouterClient, RouterConfig
from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weight_buckets import plan_buckets
from slime_async.contracts.weights import WeightManifest, version_dir_name
from slime_async.engine import EngineConfig, EngineProcess
from slime_async.engine.model import load_model
from slime_async.engine.testing import (
    check_against_reference,
    post,
    start_processes,
    stop_processes,
)
from slime_async.weights import DistributedTransport, InProcessSender, WeightSyncConfig, distributed

pytestmark = pytest.mark.timeout(300)
PROMPT = [3, 1, 4, 1, 5]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
LONG = {"max_new_tokens": 300, "ignore_eos": True}
CFG = WeightSyncConfig(bucket_bytes=256 * 1024, timeout_s=60.0)  # several buckets per version


class Weights:
    """What rank 0 holds: version `v`, the tiny model built with `seed`."""

    def __init__(self) -> None:
        self.version, self.lm = 0, load_model(EngineConfig(dtype="fp32", seed=0))

    def set(self, version: int, seed: int) -> None:
        self.version, self.lm = version, load_model(EngineConfig(dtype="fp32", seed=seed))

    def __call__(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.version, self.lm.model.state_dict()


class _KillingSender(InProcessSender):
    """A sender whose peer `victim` dies just as the broadcast starts (after the group formed)."""

    def __init__(self, weights: Weights, victim: EngineProcess) -> None:
        super().__init__(weights)
        self.victim: EngineProcess | None = victim

    async def send(self, buckets, *, flatten: bool) -> int:
        if self.victim is not None:
            self.victim.proc.kill()  # type: ignore[union-attr]
            self.victim.proc.wait()  # type: ignore[union-attr]
            self.victim = None
        return await super().send(buckets, flatten=flatten)


class _StoppingSender(InProcessSender):
    """A sender whose peer `victim` is SIGSTOPped just as the broadcast starts: alive, in the
    group, its socket open, never receiving (a hung engine)."""

    def __init__(self, weights: Weights) -> None:
        super().__init__(weights)
        self.victim: EngineProcess | None = None

    async def send(self, buckets, *, flatten: bool) -> int:
        if self.victim is not None:
            os.kill(self.victim.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            self.victim = None
        return await super().send(buckets, flatten=flatten)


def _engine(**kw) -> EngineProcess:
    return EngineProcess(
        EngineConfig(dtype="fp32", weight_version="0", num_threads=1, weight_group_timeout_s=60.0),
        **kw,
    )


def _start(**kw) -> EngineProcess:
    e = _engine(**kw)
    e.start()
    return e


@pytest.fixture(scope="module")
def fleet():
    engines = [_engine(), _engine()]
    start_processes(engines)
    yield engines
    stop_processes(engines)


async def _served(s: aiohttp.ClientSession, url: str) -> tuple[str, dict]:
    async with s.get(url + "/model_info") as r:
        version = (await r.json())["weight_version"]
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    _, answer = await post(s, url + "/generate", body)
    return version, answer


def _exact(weights: Weights, answer: dict) -> bool:
    return check_against_reference(weights.lm, PROMPT, answer).logprob_abs_diff.max() < 1e-4


async def _router(urls: list[str]) -> tuple[Router, str]:
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=5.0))
    return router, await router.start()


def test_buckets_group_by_dtype_and_respect_the_size() -> None:
    t = {
        "a": torch.zeros(150),
        "b": torch.zeros(150),
        "c": torch.zeros(50),
        "d": torch.zeros(10, dtype=torch.bfloat16),
    }
    plan = plan_buckets(WeightManifest.of(t, version=0), bucket_bytes=1000)
    assert [[e.name for e in b] for b in plan] == [["a"], ["b", "c"], ["d"]]
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(WeightManifest.of(t, version=0), bucket_bytes=0)


def test_both_transports_state_the_protocol(tmp_path: Path) -> None:
    """Each transport offers every member of `WeightTransport` and says whether it writes
    directories; only the disk transport names one (the start-up export's name)."""
    from slime_async.contracts.weights import WeightTransport
    from slime_async.weights import DiskTransport

    members = [m for m in vars(WeightTransport) if not m.startswith("_")]
    members += list(WeightTransport.__annotations__)
    disk = DiskTransport(tmp_path / "w", trainer=object(), control=object())  # type: ignore[arg-type]
    dist = DistributedTransport(sender=object(), control=object(), engine_urls=list, cfg=CFG)  # type: ignore[arg-type]
    for t in (disk, dist):
        assert [m for m in members if not hasattr(t, m)] == [], t
    assert disk.writes_directories and disk.on_written is None
    assert disk.directory(3) == tmp_path / "w" / version_dir_name(3) == tmp_path / "w" / "v000003"
    assert not dist.writes_directories and dist.on_written is None
    with pytest.raises(ValueError, match="no directory"):
        dist.directory(3)


@contextlib.asynccontextmanager
async def _pushing(urls: list[str], sender: object, *, cfg: WeightSyncConfig = CFG):
    """(transport, HTTP session, router client): a `DistributedTransport` from `sender` to the
    engines `urls`, pausing and continuing them through a router over the same engines; the
    transport and the router are closed on the way out."""
    router, rurl = await _router(urls)
    try:
        async with RouterClient(rurl) as rc, aiohttp.ClientSession() as s:
            t = DistributedTransport(sender=sender, control=rc, engine_urls=lambda: urls, cfg=cfg)
            try:
                yield t, s, rc
            finally:
                await t.close()
    finally:
        await router.stop()


class _PortTakenSender(InProcessSender):
    """A sender whose first endpoint is a port another process took between the free-port
    probe and rank 0's bind (here a listening socket of this test)."""

    def __init__(self, weights: Weights, taken: int) -> None:
        super().__init__(weights)
        self.taken, self.ports = taken, []

    async def endpoint(self) -> tuple[str, int]:
        addr, port = await super().endpoint()
        self.ports.append(self.taken if not self.ports else port)
        return addr, self.ports[-1]


async def test_a_port_taken_before_rank_0_binds_it_is_chosen_again(fleet, caplog) -> None:
    """EADDRINUSE at rank 0's bind (another process on the node won the race for the probed
    port): the group is formed again on another port and the push lands; a port the user gave
    is never replaced: that fails naming it."""
    urls = [e.url for e in fleet]
    weights = Weights()
    cfg = dataclasses.replace(CFG, timeout_s=12.0)  # the engines give up on the taken port
    with socket.socket() as occupier:
        occupier.bind(("127.0.0.1", 0))
        occupier.listen()
        taken = occupier.getsockname()[1]
        sender = _PortTakenSender(weights, taken)
        async with _pushing(urls, sender, cfg=cfg) as (t, s, _):
            weights.set(70, 70)
            with caplog.at_level(logging.WARNING):
                assert (await t.push(70))["weights/push_failed_engines"] == 0.0
            assert sender.ports[0] == taken and sender.ports[-1] != taken
            assert any("was taken by another process" in r.getMessage() for r in caplog.records)
            assert t.groups_formed == 1
            served, answer = await _served(s, urls[0])
            assert served == "70" and _exact(weights, answer)
        caplog.clear()
        given = dataclasses.replace(cfg, master_port=taken)
        async with _pushing(urls, InProcessSender(weights), cfg=given) as (t, _, _):
            weights.set(71, 71)
            with caplog.at_level(logging.WARNING):
                assert (await t.push(71))["weights/push_failed_engines"] == 2.0
        said = [r.getMessage() for r in caplog.records]
        assert any(
            f"could not form the weight update group at 127.0.0.1:{taken}" in m for m in said
        )
        assert not any("was taken by another process" in m for m in said)


async def test_versions_advance_on_both_engines(fleet) -> None:
    urls = [e.url for e in fleet]
    weights = Weights()
    async with _pushing(urls, InProcessSender(weights)) as (t, s, rc):
        for version, seed in ((1, 11), (2, 12)):
            weights.set(version, seed)
            m = await t.push(version)
            assert m["weights/push_failed_engines"] == 0.0
            for u in urls:
                served, answer = await _served(s, u)
                assert served == str(version) and _exact(weights, answer)
        assert t.groups_formed == 1  # the same group carried both versions
        await t.close()
        # per-tensor broadcasts (SGLang's default load format), on a fresh group
        per_tensor = WeightSyncConfig(
            bucket_bytes=CFG.bucket_bytes,
            flatten_buckets=False,
            group_name="per_tensor",
            timeout_s=60.0,
        )
        t2 = DistributedTransport(
            sender=InProcessSender(weights), control=rc, engine_urls=lambda: urls, cfg=per_tensor
        )
        weights.set(3, 13)
        assert (await t2.push(3))["weights/push_failed_engines"] == 0.0
        for u in urls:
            served, answer = await _served(s, u)
            assert served == "3" and _exact(weights, answer)
        await t2.close()
        async with s.get(urls[0] + "/server_info") as r:
            assert (await r.json())["internal_states"][0]["weight_update_groups"] == []


async def test_request_in_flight_crosses_a_distributed_push(fleet) -> None:
    urls = [e.url for e in fleet]
    weights = Weights()
    async with _pushing(urls, InProcessSender(weights)) as (t, s, _rc):
        before, _ = await _served(s, urls[0])
        running = asyncio.ensure_future(
            post(s, urls[0] + "/generate", {"input_ids": [9, 9], "sampling_params": LONG})
        )
        for _ in range(2000):
            async with s.get(urls[0] + "/get_load") as r:
                if (await r.json())[0]["num_tokens"] >= 20:
                    break
            await asyncio.sleep(0.02)
        weights.set(int(before) + 1, 21)
        await t.push(int(before) + 1)
        _, r = await running
        await t.close()
    spans = r["meta_info"]["weight_versions"]
    assert [sp["version"] for sp in spans] == [before, str(int(before) + 1)]
    assert spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == LONG["max_new_tokens"]


async def test_refusing_engine_leaves_the_others_whole(fleet, tmp_path: Path) -> None:
    """An engine serving another architecture receives every bucket but refuses them: the
    others take the whole version, it keeps its weights and label."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(ModelSpec(hidden_size=64, head_dim=16).to_dict()))
    odd = _start(extra_args=["--model-spec-json", str(spec)])
    urls = [fleet[0].url, odd.url, fleet[1].url]
    weights = Weights()
    try:
        async with _pushing(urls, InProcessSender(weights)) as (t, s, _rc):
            weights.set(40, 40)
            m = await t.push(40)
            assert m["weights/push_failed_engines"] == 1.0
            for u in (fleet[0].url, fleet[1].url):
                served, answer = await _served(s, u)
                assert served == "40" and _exact(weights, answer)
            async with s.get(odd.url + "/model_info") as r:
                assert (await r.json())["weight_version"] == "0"
            await t.close()
    finally:
        odd.stop()


async def test_non_finite_weights_are_refused_and_the_old_ones_kept(fleet) -> None:
    """A version holding a NaN arrives in full on every engine and is refused by each: they
    keep serving the weights they had, under their old label."""
    urls = [e.url for e in fleet]
    weights = Weights()
    async with _pushing(urls, InProcessSender(weights)) as (t, s, _rc):
        weights.set(50, 50)
        await t.push(50)
        weights.set(51, 51)
        with torch.no_grad():
            next(iter(weights.lm.model.parameters())).view(-1)[0] = float("nan")
        m = await t.push(51)
        assert m["weights/push_failed_engines"] == 2.0
        weights.set(50, 50)  # what the engines must still serve
        for u in urls:
            served, answer = await _served(s, u)
            assert served == "50" and _exact(weights, answer)
        await t.close()


async def test_bad_requests_name_the_fix(fleet) -> None:
    url = fleet[0].url
    async with aiohttp.ClientSession() as s:
        cases = [
            (
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": 1,
                    "rank_offset": 1,
                    "world_size": 2,
                },
                "gloo",
            ),
            (
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": 1,
                    "rank_offset": 0,
                    "world_size": 2,
                    "backend": "gloo",
                },
                "rank 0 is the sender",
            ),
            (
                "/update_weights_from_distributed",
                {"names": ["x"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "nope"},
                "init_weights_update_group first",
            ),
            (
                "/update_weights_from_distributed",
                {"names": ["x", "y"], "dtypes": ["float32"], "shapes": [[2]]},
                "same length",
            ),
            (
                "/update_weights_from_distributed",
                {"names": ["x"], "dtypes": ["complex5"], "shapes": [[2]]},
                "unknown dtype",
            ),
            ("/destroy_weights_update_group", {"group_name": "nope"}, "no weight update group"),
        ]
        for path, body, needle in cases:
            st, res = await post(s, url + path, body)
            assert st == 400 and res["success"] is False and needle in res["message"], (path, res)
            if path == "/update_weights_from_distributed":  # refused before the receive
                assert res["received"] is False, res
        # a bucket call refused before its handler ran (body over the control-route limit) says
        # so too: the sender must abort the group rather than wait on this engine
        huge = {
            "names": ["x" * 100] * 20_000,
            "dtypes": ["float32"] * 20_000,
            "shapes": [[1]] * 20_000,
        }
        st, res = await post(s, url + "/update_weights_from_distributed", huge)
        assert st == 413 and res["received"] is False, res


async def test_engine_refusing_before_receiving_is_left_out_of_the_resend(fleet) -> None:
    """An engine that lost its group refuses the next bucket without receiving it (`received:
    false`): the driver aborts the group at once, the resend goes to the other engine alone
    (it serves the version), and the next push re-forms the group with both."""
    urls = [e.url for e in fleet]
    weights = Weights()
    async with _pushing(urls, InProcessSender(weights)) as (t, s, _rc):
        weights.set(70, 70)
        assert (await t.push(70))["weights/push_failed_engines"] == 0.0
        st, res = await post(
            s, urls[1] + "/destroy_weights_update_group", {"group_name": CFG.group_name}
        )
        assert st == 200, res
        weights.set(71, 71)
        m = await t.push(71)
        assert m["weights/push_failed_engines"] == 1.0 and t.members == (urls[0],)
        served, answer = await _served(s, urls[0])
        assert served == "71" and _exact(weights, answer)
        weights.set(72, 72)
        m = await t.push(72)
        assert m["weights/push_failed_engines"] == 0.0 and t.members == tuple(urls)
        for u in urls:
            served, answer = await _served(s, u)
            assert served == "72" and _exact(weights, answer)
        await t.close()


async def test_engine_dying_as_the_broadcast_starts(fleet) -> None:
    """The group holds both engines; one is killed as rank 0 starts sending. The push re-forms
    the group with the survivor and sends the whole version again before generation continues:
    the survivor serves exactly that version; no shared-memory segment outlives the groups.
    (Runs last: it kills a fleet engine.)"""
    urls = [e.url for e in fleet]
    weights = Weights()
    router, rurl = await _router(urls)
    try:
        async with RouterClient(rurl) as rc, aiohttp.ClientSession() as s:
            sender = _KillingSender(weights, fleet[1])
            sender.victim = None  # the first push forms the group and succeeds
            t = DistributedTransport(sender=sender, control=rc, engine_urls=lambda: urls, cfg=CFG)
            weights.set(50, 50)
            assert (await t.push(50))["weights/push_failed_engines"] == 0.0
            sender.victim = fleet[1]
            weights.set(51, 51)
            m = await t.push(51)
            assert m["weights/push_failed_engines"] == 1.0
            assert t.groups_formed == 2 and t.members == (urls[0],)
            served, answer = await _served(s, urls[0])
            assert served == "51" and _exact(weights, answer)
            weights.set(52, 52)  # the next push goes to the survivor alone, same group
            assert (await t.push(52))["weights/push_failed_engines"] == 1.0
            assert t.groups_formed == 2
            served, answer = await _served(s, urls[0])
            assert served == "52" and _exact(weights, answer)
            await t.close()
        # both engines took the buckets through shared memory: the sender gave every segment
        # up with its groups (the aborted one included), and none was ever named in /dev/shm
        held = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
        assert not [h for h in held if h.startswith("/memfd:slime-wg-")]
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("slime-wg-")]
    finally:
        await router.stop()


@pytest.mark.timeout(300)
async def test_hung_engine_is_aborted_long_before_the_op_timeout(fleet, monkeypatch) -> None:
    """One member is SIGSTOPped as rank 0 starts a push (op timeout 300 s). The driver sees it
    silent long after the other member took the bucket, aborts the group through its store,
    and resends to the other member alone: the push ends before the op timeout, reports the
    hung engine, and the other serves the version. (Before the abort, rank 0 sat in its
    broadcast for the op timeout and the push waited for the stopped engine's bucket call, 330
    s: past this test's timeout.) The stall, health and refusal bounds are shortened (30, 30
    and 10 s in a run) so the test does not sit them out: what they bound is the same."""
    monkeypatch.setattr(distributed, "STALL_MIN_S", 8.0)
    monkeypatch.setattr(distributed, "HEALTH_TIMEOUT_S", 8.0)
    monkeypatch.setattr(distributed, "REFUSAL_GRACE_S", 4.0)
    hung = _start()
    urls = [fleet[0].url, hung.url]
    weights = Weights()
    router, rurl = await _router([fleet[0].url])  # pause/continue reach the live engine
    cfg = dataclasses.replace(CFG, timeout_s=300.0)
    try:
        async with RouterClient(rurl) as rc, aiohttp.ClientSession() as s:
            sender = _StoppingSender(weights)
            t = DistributedTransport(sender=sender, control=rc, engine_urls=lambda: urls, cfg=cfg)
            weights.set(60, 60)
            assert (await t.push(60))["weights/push_failed_engines"] == 0.0
            sender.victim = hung
            weights.set(61, 61)
            m = await t.push(61)
            assert m["weights/push_failed_engines"] == 1.0
            assert t.members == (fleet[0].url,)
            served, answer = await _served(s, fleet[0].url)
            assert served == "61" and _exact(weights, answer)
            await t.close()
    finally:
        await router.stop()
        if hung.proc is not None and hung.proc.poll() is None:
            os.kill(hung.proc.pid, signal.SIGCONT)
        hung.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["distributed", "disk"])
async def test_train_async_pushes_through_each_transport(tmp_path: Path, transport: str) -> None:
    """A short `train_async.py` run (Ray, trainer actor as rank 0, two engines, router): every
    push reaches every engine, versions advance, and only the disk transport writes a weight
    directory per push."""
    from slime_async.config import parse_config
    from slime_async.orchestrator.controller import train

    steps = 3
    argv = [
        "--run-dir",
        str(tmp_path),
        "--num-steps",
        str(steps),
        "--max-staleness",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "8",
        "--warmstart-steps",
        "0",
        "--eval-interval",
        "0",
        "--micro-batch-size",
        "4",
        "--num-engines",
        "2",
        "--update-weight-transport",
        transport,
    ]
    cfg = parse_config(argv)
    assert cfg.weights.transport == transport
    summary = await train(cfg)
    assert summary["train/version"] == steps
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    pushes = [r for r in rows if "weights/push_failed_engines" in r]
    assert len(pushes) == steps and all(r["weights/push_failed_engines"] == 0 for r in pushes)
    ledger = [json.loads(x) for x in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert max(j for row in ledger for _, _, j in row["groups"]) >= 1  # pushed versions generated
    written = sorted(p.name for p in (tmp_path / "weights").iterdir())
    if transport == "distributed":
        assert written == [version_dir_name(0)]  # the engines' start-up export only
        assert all(r["weights/groups_formed"] == 1 for r in pushes)
    else:
        assert written[-1] == version_dir_name(steps)


def test_checkpoint_names_assemble_as_transformers_loads_them(tmp_path: Path) -> None:
    """Per-expert checkpoint tensors (the trainer's export) arriving over two buckets give the
    same served parameters as `from_pretrained` of the same checkpoint on disk."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    from slime_async.engine.checkpoint_names import CheckpointAssembler

    lm = load_model(EngineConfig(dtype="fp32", seed=5))
    g = torch.Generator().manual_seed(0)
    ckpt: dict[str, torch.Tensor] = {}
    for name, t in lm.model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                base = name.removesuffix("gate_up_proj") + str(e)
                ckpt[base + ".gate_proj.weight"] = torch.randn(half, t.shape[2], generator=g)
                ckpt[base + ".up_proj.weight"] = torch.randn(half, t.shape[2], generator=g)
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                ckpt[name.removesuffix("down_proj") + f"{e}.down_proj.weight"] = torch.randn(
                    t.shape[1:], generator=g
                )
        else:
            ckpt[name] = torch.randn(t.shape, generator=g)
    lm.model.config.save_pretrained(str(tmp_path))
    safetensors.torch.save_file(ckpt, str(tmp_path / "model.safetensors"))
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).state_dict()

    asm = CheckpointAssembler(lm.state_signature())
    names = sorted(ckpt)
    got: dict[str, torch.Tensor] = {}
    for part in (names[::2], names[1::2]):  # fused parameters split across the two buckets
        ready, bad = asm.add({n: ckpt[n] for n in part})
        assert not bad
        got.update(ready)
    assert asm.incomplete() == [] and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    _, bad = asm.add({"model.layers.0.mlp.experts.99.up_proj.weight": torch.zeros(2, 2)})
    assert bad and "expert 99" in bad[0]
