"""Partial overlap through the live parts: the pipeline scheduler (a Ray actor), `PipelineMember`
(the run's side of it), our router and real embedded engines. A slot marked as a pipeline's
trainer slot serves that pipeline's generation between its train steps; around a step
(`PipelineMember.training`, the hooks `Run.train_step` calls) the engine there is cut, put to
sleep at level 2 (its weights' memory given back to the OS, measured on the engine process)
and out of the router, and its cut requests are sent whole to the pipeline's other engine,
each answered exactly once; after the step it is woken, given the run's version and serves
again. A pipeline whose trainer crashes mid-step loses its slots, the trainer slot after the
fence, to another pipeline, which never stops serving.

The run around the member is reduced to what the member reads (its demand, its engines and
router, its version) and what the run does for a woken engine (`Run.catch_up_replacements`:
the version, then into the router), emulated by `_catch_up`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import psutil
import pytest
import ray

from router import Router, RouterClient, RouterConfig
from slime_async.config.pipeline import PipelineConfig, PipelineSchedulerConfig
from slime_async.contracts.model import TINY_MOE
from slime_async.engine import EngineConfig, EngineProcess, EngineServer
from slime_async.engine.testing import post
from slime_async.orchestrator.pipeline_member import PipelineMember
from slime_async.orchestrator.pipeline_scheduler import start_scheduler
from slime_async.orchestrator.roles import init_ray

pytestmark = pytest.mark.timeout(240)
# ~40 MB of fp32 weights (as tests/test_engine_sleep.py): the trainer slot's engine process
SPEC = dataclasses.replace(
    TINY_MOE, vocab_size=8192, hidden_size=384, intermediate_size=768, moe_intermediate_size=384
)
N_TOKENS = 300
_names = itertools.count()


@dataclasses.dataclass
class _Cluster:
    """What a member reads of `roles.Cluster`."""

    engine_urls: list[str]
    control: RouterClient
    asleep: set[str] = dataclasses.field(default_factory=set)
    pending: set[str] = dataclasses.field(default_factory=set)
    engine_cores: list[tuple[int, ...]] = dataclasses.field(default_factory=list)

    @property
    def engines(self) -> list[str]:
        return self.engine_urls

    @property
    def serving_urls(self) -> list[str]:
        return [u for u in self.engine_urls if u not in self.asleep | self.pending]


def _run(
    name: str, scheduler: str, cluster: _Cluster, demand: dict, trainer_cores=()
) -> SimpleNamespace:
    """The parts of a `Run` its member uses; `demand["groups"]` is what it asks for (one sample
    per group, capacity 4 per engine)."""
    metrics = lambda: {  # noqa: E731
        "data/admission_limit": demand["groups"], "data/live_groups": 0,
        "data/inflight": 0, "data/queue_depth": 0,
    }  # fmt: skip
    return SimpleNamespace(
        cfg=SimpleNamespace(
            pipeline=PipelineConfig(scheduler=scheduler, name=name, heartbeat_s=0.2),
            run_dir=Path(name),
            rollout=SimpleNamespace(n_samples_per_prompt=1),
            engine=SimpleNamespace(admin_api_key=None, api_key=None),
            trainer_cores=trainer_cores,
        ),
        cluster=cluster,
        worker=SimpleNamespace(
            cfg=SimpleNamespace(max_inflight=4 * len(cluster.engine_urls)), metrics=metrics
        ),
        version=0,
        supervisor=SimpleNamespace(behind=asyncio.Event()),
    )


async def _catch_up(run: SimpleNamespace) -> None:
    """What the run does for a woken engine (`Run.catch_up_replacements`): its version, then
    into the router."""
    async with aiohttp.ClientSession() as s:
        while True:
            await run.supervisor.behind.wait()
            run.supervisor.behind.clear()
            for url in sorted(run.cluster.pending):
                st, _ = await post(
                    s, url + "/update_weight_version", {"new_version": str(run.version)}
                )
                assert st == 200
                await run.cluster.control.add_worker(url, wait_healthy_s=60.0)
                run.cluster.pending.discard(url)


@contextlib.asynccontextmanager
async def _pipeline(name: str, scheduler: str, urls: list[str], demand: dict, cores=None):
    """`cores`: (the trainer's cores, each engine's cores), as `--trainer-cores` and
    `--rollout-cores` pin them; None: nothing pinned."""
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=0.1))
    url = await router.start()
    control = RouterClient(url)
    trainer_cores, engine_cores = cores or ((), [])
    cluster = _Cluster(list(urls), control, engine_cores=list(engine_cores))
    run = _run(name, scheduler, cluster, demand, trainer_cores)
    member = PipelineMember(run)
    catching = asyncio.ensure_future(_catch_up(run))
    try:
        await member.start()
        yield SimpleNamespace(run=run, member=member, router=router, url=url, control=control)
    finally:
        catching.cancel()
        await member.stop()
        await control.close()
        await router.stop()


async def _routed(control: RouterClient) -> dict[str, dict]:
    return {w["url"]: w for w in await control.list_workers()}


async def _until(check, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.05)


async def _server_info(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/server_info") as r:
        return (await r.json())["internal_states"][0]


def _body(i: int) -> dict:
    return {
        "rid": f"req-{i}",
        "input_ids": [3 + i, 1, 4, 1, 5],
        "sampling_params": {"max_new_tokens": N_TOKENS, "temperature": 0.0, "ignore_eos": True},
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Slot 0: an in-process engine; slot 1 (the trainer slot): an engine process, so that
    the memory its sleep gives back is measured on its own process."""
    import torch

    torch.set_num_threads(1)
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = EngineProcess(
        EngineConfig(dtype="fp32", model_spec=SPEC.to_dict(), num_threads=1), log_path=str(log)
    )
    srv = EngineServer(EngineConfig(dtype="fp32", model_spec=SPEC.to_dict(), num_threads=1))
    try:
        yield srv.start(), proc.start(), proc.proc.pid
    finally:
        proc.stop()
        srv.stop()


@contextlib.contextmanager
def _scheduler(**kw):
    init_ray()
    name = f"overlap-{next(_names)}"
    sched = start_scheduler(name, PipelineSchedulerConfig(**kw))
    try:
        yield name, sched
    finally:
        ray.kill(sched)


async def test_the_trainer_slot_serves_between_steps_and_sleeps_while_its_pipeline_trains(
    engines,
) -> None:
    u0, u1, pid = engines
    ps = psutil.Process(pid)
    demand = {"groups": 8}  # 2 engines' worth
    with _scheduler(slots=2, min_hold_s=0.5, trainer_slots={"a": (1,)}) as (name, sched):
        async with _pipeline("a", name, [u0, u1], demand) as a, aiohttp.ClientSession() as s:

            async def both_serve(woken: int) -> bool:  # at start every engine sleeps first
                if a.member.switches < woken or a.run.cluster.pending | a.run.cluster.asleep:
                    return False
                routed = await _routed(a.control)
                return all(u in routed and routed[u]["is_healthy"] for u in (u0, u1))

            await _until(lambda: both_serve(2), what="both slots granted, woken and admitted")
            jobs = [asyncio.ensure_future(post(s, a.url + "/generate", _body(i))) for i in range(6)]

            async def u1_runs() -> bool:
                routed = await _routed(a.control)
                return routed[u1]["outstanding_requests"] > 0 and sum(
                    w["outstanding_requests"] for w in routed.values()
                ) == len(jobs)

            await _until(u1_runs, what="the requests placed, some on the trainer slot")
            cut = (await _routed(a.control))[u1]["outstanding_requests"]
            weights = (await _server_info(s, u1))["memory"]["weights_bytes"]
            rss_awake = ps.memory_info().rss
            assert weights > 30e6

            async with a.member.training():  # what `Run.train_step` wraps the step in
                info = await _server_info(s, u1)
                rss_asleep = ps.memory_info().rss
                assert info["memory"]["sleep_level"] == 2 and info["idle"]
                assert rss_awake - rss_asleep > 0.8 * weights, (rss_awake, rss_asleep, weights)
                assert u1 not in await _routed(a.control) and u1 in a.run.cluster.asleep
                for _ in range(5):  # the step: the reports go on, none grants slot 1
                    state = await sched.state.remote()
                    assert list(state["training"]) == ["a"] and state["owner"] == {0: "a", 1: None}
                    await asyncio.sleep(0.3)
                st, out = await post(s, a.url + "/generate", {**_body(9), "rid": "during"})
                assert st == 200 and len(out["output_ids"]) == N_TOKENS  # slot 0 serves on

            woken = a.member.switches + 1
            await _until(lambda: both_serve(woken), what="the trainer slot back, woken, admitted")
            answers = await asyncio.gather(*jobs)
            assert [st for st, _ in answers] == [200] * len(jobs)
            rids = [o["meta_info"]["id"] for _, o in answers]
            assert sorted(rids) == sorted(f"req-{i}" for i in range(len(jobs)))
            for _, o in answers:  # each answered once, whole
                assert o["meta_info"]["finish_reason"]["type"] == "length"
                assert len(o["output_ids"]) == N_TOKENS
            assert a.router.proxy.stats.redispatched == cut >= 1
            assert ps.memory_info().rss > rss_asleep + 0.8 * weights  # its weights back
            served = (await _routed(a.control))[u1]["total_requests"]
            more = [post(s, a.url + "/generate", {**_body(i), "rid": f"after-{i}"})
                    for i in range(4)]  # fmt: skip
            assert [st for st, _ in await asyncio.gather(*more)] == [200] * 4
            assert (await _routed(a.control))[u1]["total_requests"] > served  # it serves again
            assert a.member.metrics()["pipeline/trainer_wait_s"] > 0


async def test_an_engine_on_the_trainers_core_sleeps_at_the_schedulers_level_or_is_refused(
    engines,
) -> None:
    """Partial overlap on cores: a's engine 1 pinned to its trainer's core is fine when slot 1
    is a's trainer slot (it sleeps through the step, at the scheduler's `sleep_level`, here 1:
    its weights stay); a join whose engine on the trainer's core is not on a trainer slot is
    refused, naming the fix, and leaves the scheduler."""
    u0, u1, _ = engines
    cores = ((1,), [(0,), (1,)])  # --trainer-cores 1 --rollout-cores 0,1
    kw = {"slots": 2, "min_hold_s": 0.5, "sleep_level": 1}
    with _scheduler(**kw, trainer_slots={"a": (1,)}) as (name, _sched):
        async with _pipeline("a", name, [u0, u1], {"groups": 8}, cores) as a:
            await _until(
                lambda: _awake(a, 2), what="both slots granted, woken and admitted"
            )  # fmt: skip
            async with a.member.training(), aiohttp.ClientSession() as s:
                memory = (await _server_info(s, u1))["memory"]
                assert memory["sleep_level"] == 1 and memory["released_tags"] == ["kv_cache"]
    with _scheduler(**kw, trainer_slots={"a": (0,)}) as (name, sched):
        with pytest.raises(RuntimeError, match=r"engine\(s\) \[1\] sit on the trainer's cores"):
            async with _pipeline("a", name, [u0, u1], {"groups": 8}, cores):
                pass
        assert (await sched.state.remote())["pipelines"] == {}


async def _awake(a: SimpleNamespace, woken: int) -> bool:
    if a.member.switches < woken or a.run.cluster.pending | a.run.cluster.asleep:
        return False
    return len(await _routed(a.control)) == len(a.run.cluster.engine_urls)


@pytest.fixture(scope="module")
def four_engines():
    servers = [EngineServer(EngineConfig(dtype="fp32", num_threads=1)) for _ in range(4)]
    try:
        yield [srv.start() for srv in servers]
    finally:
        for srv in servers:
            srv.stop()


async def test_a_pipeline_whose_trainer_crashes_loses_its_slots_and_the_other_serves_on(
    four_engines,
) -> None:
    """a (trainer slot 1) crashes mid-step; its run ends (the member leaves): its trainer slot
    is granted to nobody for `fence_s` (its trainer may still hold the device), then to b,
    whose engine there wakes and serves; b's requests are answered throughout."""
    a0, a1, b0, b1 = four_engines
    cfg = dict(slots=2, min_hold_s=0.5, fence_s=1.5, min_pipelines=2, overlap_others=True)
    with _scheduler(**cfg, trainer_slots={"a": (1,)}) as (name, sched):
        demand_a, demand_b = {"groups": 4}, {"groups": 4}
        async with (
            _pipeline("a", name, [a0, a1], demand_a) as a,
            _pipeline("b", name, [b0, b1], demand_b) as b,
            aiohttp.ClientSession() as s,
        ):

            async def owners(want: dict) -> bool:
                return (await sched.state.remote())["owner"] == want

            await _until(lambda: owners({0: "b", 1: "a"}), what="a on its trainer slot, b on 0")
            demand_a["groups"], demand_b["groups"] = 0, 8  # a trains (synchronous); b wants both
            with pytest.raises(RuntimeError, match="trainer crashed"):
                async with a.member.training():
                    assert (await sched.state.remote())["owner"] == {0: "b", 1: None}
                    await asyncio.sleep(1.0)  # b wants slot 1: not while a trains
                    assert (await sched.state.remote())["owner"] == {0: "b", 1: None}
                    raise RuntimeError("trainer crashed")
            await a.member.stop()  # the run ends: its member leaves (`Run.close`)
            state = await sched.state.remote()
            assert "a" not in state["pipelines"] and 1 in state["fenced"]
            assert any(e[1] == "a" and e[2] == "left" for e in state["events"])
            jobs = [post(s, b.url + "/generate", {**_body(i), "rid": f"b-{i}"}) for i in range(4)]
            assert [st for st, _ in await asyncio.gather(*jobs)] == [200] * 4

            async def b_serves_both() -> bool:
                if b.run.cluster.pending | b.run.cluster.asleep:
                    return False
                routed = await _routed(b.control)
                return all(u in routed and routed[u]["is_healthy"] for u in (b0, b1))

            await _until(b_serves_both, what="a's trainer slot granted to b after the fence")
            assert (await sched.state.remote())["owner"] == {0: "b", 1: "b"}
            assert a1 in a.run.cluster.asleep  # a's engine there never woke again
