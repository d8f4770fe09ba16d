"""Two pipelines (runs of the tiny default) share one engine slot under the pipeline scheduler:
each pipeline's engine serves only while the slot is granted to it and sleeps (its memory
released) while the other's serves; both train to completion with their own ledgers, versions
and metrics; a pipeline that stops mid-run loses its slot and the other trains on."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import ray

from slime_async.config import parse_config
from slime_async.config.pipeline import PipelineSchedulerConfig
from slime_async.orchestrator.controller import train
from slime_async.orchestrator.pipeline_scheduler import start_scheduler
from slime_async.orchestrator.roles import init_ray

pytestmark = [pytest.mark.timeout(900), pytest.mark.own_ray, pytest.mark.slow]


def _argv(run_dir: Path, name: str, steps: int) -> list[str]:
    return [
        "--run-dir", str(run_dir),
        "--num-steps", str(steps),
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "12",
        "--warmstart-steps", "0",
        "--eval-interval", "0",
        "--micro-batch-size", "4",
        "--max-staleness", "1",
        "--pipeline-scheduler", "pool",
        "--pipeline-name", name,
    ]  # fmt: skip


def _ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "trained.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def pool():
    init_ray(num_cpus=8)  # two runs' bundles on this node
    # both pipelines begin together (min_pipelines): their sharing never depends on start-up speed
    cfg = PipelineSchedulerConfig(slots=1, min_hold_s=1.0, min_pipelines=2)
    sched = start_scheduler("pool", cfg)
    yield sched
    ray.kill(sched)


async def test_two_pipelines_share_a_slot_and_both_finish(tmp_path, pool) -> None:
    steps = {"a": 30, "b": 3}  # a still trains when b (started alongside) has joined
    runs = {n: tmp_path / n for n in steps}
    cfgs = {n: parse_config(_argv(d, n, steps[n])) for n, d in runs.items()}
    out = await asyncio.gather(*(train(c) for c in cfgs.values()))
    for (name, d), summary in zip(runs.items(), out):
        k = steps[name]
        assert summary["train/version"] == k and math.isfinite(summary["loss/total"]), name
        assert [r["step"] for r in _ledger(d)] == list(range(1, k + 1)), name
        keys = [(key, seq) for r in _ledger(d) for key, seq, _ in r["groups"]]
        assert len(keys) == len(set(keys)) == k * 2
        assert summary["pipeline/switches"] >= 1  # its engine slept and woke
    state = await pool.state.remote()
    granted = {e[1] for e in state["events"] if "granted" in e[2]}
    assert granted == {"a", "b"} and state["pipelines"] == {}  # both left at the end
    assert any("released" in e[2] for e in state["events"])  # hand-overs happened


async def test_a_pipeline_that_stops_loses_its_slot_and_the_other_trains_on(tmp_path, pool):
    a = asyncio.ensure_future(train(parse_config(_argv(tmp_path / "a", "a", 50))))
    b = asyncio.ensure_future(train(parse_config(_argv(tmp_path / "b", "b", 3))))
    while len(_ledger(tmp_path / "a")) < 1:
        assert not a.done(), a.exception()
        await asyncio.sleep(0.5)
    a.cancel()  # pipeline a stops mid-run
    with pytest.raises(asyncio.CancelledError):
        await a
    state = await pool.state.remote()
    assert "a" not in state["pipelines"] and any(e[1] == "a" for e in state["events"])
    summary = await b
    assert summary["train/version"] == 3
    assert [r["step"] for r in _ledger(tmp_path / "b")] == [1, 2, 3]
    assert len(_ledger(tmp_path / "a")) < 50


async def test_a_pipeline_evaluates_before_its_first_and_after_its_last_step(tmp_path) -> None:
    """The evals outside the training loop (the baseline before the first push, the final one
    after the last step) give the engine woken for the run's slot its version: nothing else
    would, and it serves only once it has it (they waited forever before)."""
    init_ray(num_cpus=8)
    sched = start_scheduler("pool-eval", PipelineSchedulerConfig(slots=1, min_hold_s=1.0))
    try:
        argv = _argv(tmp_path / "e", "e", 2)
        argv[argv.index("--eval-interval") + 1] = "5"  # the baseline and the final eval only
        argv[argv.index("--pipeline-scheduler") + 1] = "pool-eval"
        summary = await asyncio.wait_for(train(parse_config(argv)), timeout=400)
    finally:
        ray.kill(sched)
    assert summary["train/version"] == 2
    rows = [json.loads(x) for x in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/reward" in r] == [0, 2]


async def test_a_run_with_a_trainer_slot_clears_it_for_each_step_and_serves_on_it_between(
    tmp_path,
) -> None:
    """Partial overlap in a whole run: its engine 1 sits on its trainer's slot; `Run.train_step`
    calls the trainer hooks, so before every step that engine is cut and put to sleep and after
    it the slot is granted back (its engine woken and given the version); the run trains to
    completion with its ledger whole."""
    init_ray(num_cpus=8)
    cfg = PipelineSchedulerConfig(slots=2, min_hold_s=1.0, trainer_slots={"o": (1,)})
    sched = start_scheduler("pool-overlap", cfg)
    try:
        argv = [*_argv(tmp_path / "o", "o", 3), "--num-engines", "2"]
        argv[argv.index("--pipeline-scheduler") + 1] = "pool-overlap"
        summary = await asyncio.wait_for(train(parse_config(argv)), timeout=600)
        events = (await sched.state.remote())["events"]
    finally:
        ray.kill(sched)
    assert summary["train/version"] == 3
    assert [r["step"] for r in _ledger(tmp_path / "o")] == [1, 2, 3]
    whats = [e[2] for e in events if e[1] == "o"]
    assert whats.count("trainer takes slots [1]") == 3
    assert whats.count("trainer gives back its slots") == 3
    assert sum(w == "granted slot 1" for w in whats) >= 3  # before the first step, then after
    assert summary["pipeline/trainer_wait_s"] >= 0.0
