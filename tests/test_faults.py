"""Faults on the real run: a killed engine, all engines down, kill -9 of the whole run, a dead
run's ledger left in the run directory, a resume with another batch shape.

Fast versions of what `scripts/chaos.py` does at random: every scenario kills real processes
(SIGKILL) and checks that the run finishes or stops cleanly, and that the prompt ledger holds
every trained group exactly once. Waits are on states (ledger lines, task or process exit),
never on wall-clock windows: a slow, loaded machine makes a test slower, not red (pytest-timeout
is the only bound).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from slime_async.config import parse_config
from slime_async.orchestrator.controller import train
from slime_async.orchestrator.supervisor import EnginesDownError

pytestmark = pytest.mark.timeout(1200)
ROOT = Path(__file__).resolve().parent.parent


def _argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--run-dir",
        str(run_dir),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "10",
        "--warmstart-steps",
        "0",
        "--eval-interval",
        "0",
        "--micro-batch-size",
        "8",
        "--max-staleness",
        "1",
        "--engine-restart-after",
        "3",
        *extra,
    ]


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "trained.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


async def _wait_for_step(run_dir: Path, step: int, task: asyncio.Task) -> None:
    """Until the ledger has `step` lines (the run's own progress), or the run ended."""
    while _steps_logged(run_dir) < step:
        if task.done():
            task.result()
            raise AssertionError("run ended before the fault was injected")
        await asyncio.sleep(0.2)


def _ledger_groups(run_dir: Path) -> list[tuple[str, int]]:
    rows = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]
    return [(k, s) for r in rows for k, s, _ in r["groups"]]


async def test_killed_engine_is_replaced_and_the_run_finishes(tmp_path):
    cfg = parse_config(_argv(tmp_path, "--num-steps", "5"))
    task = asyncio.create_task(train(cfg))
    await _wait_for_step(tmp_path, 2, task)
    pid = json.loads((tmp_path / "roles.json").read_text())["engine_pids"][0]
    os.kill(pid, signal.SIGKILL)
    summary = await task
    assert summary["train/version"] == 5
    assert summary["engines/restarts"] >= 1
    new_pid = json.loads((tmp_path / "roles.json").read_text())["engine_pids"][0]
    assert new_pid != pid
    groups = _ledger_groups(tmp_path)
    assert len(groups) == len(set(groups)) == 5 * cfg.rollout.groups_per_step


async def test_an_engine_killed_after_the_last_step_is_caught_up_for_the_final_eval(tmp_path):
    """The final eval has no push after it: a replacement started on older weights would wait
    for one forever (and the all-down stop was never looked at after the loop). It gets the
    trainer's version and the eval finishes on it."""
    cfg = parse_config(
        _argv(tmp_path, "--num-steps", "3", "--eval-interval", "3", "--eval-prompts", "172",
              "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "24")
    )  # fmt: skip
    task = asyncio.create_task(train(cfg))
    await _wait_for_step(tmp_path, 3, task)  # trained: the push and the final eval follow
    pid = json.loads((tmp_path / "roles.json").read_text())["engine_pids"][0]
    os.kill(pid, signal.SIGKILL)
    summary = await asyncio.wait_for(task, 600)
    assert summary["train/version"] == 3
    assert json.loads((tmp_path / "roles.json").read_text())["engine_pids"][0] != pid  # replaced
    served = json.loads((tmp_path / "served_versions.json").read_text())
    assert list(served["engines"].values()) == ["3"]  # the replacement serves the final weights
    finals = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if "eval/reward" in r and r["step"] == 3]  # fmt: skip
    assert finals and finals[-1]["eval/version_min"] == finals[-1]["eval/version_max"] == 3


async def test_all_engines_down_stops_with_a_checkpoint(tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    cfg = parse_config(
        _argv(tmp_path, "--num-steps", "50", "--save", str(ckpt), "--engine-down-timeout", "8")
    )
    # no replacement may start (restarts exhausted): the only engine stays down. (Deleting
    # weights/ does not keep it down: the trainer writes the next version, and replacements
    # start and catch up on it.)
    cfg = dataclasses.replace(cfg, supervisor=dataclasses.replace(cfg.supervisor, max_restarts=0))
    task = asyncio.create_task(train(cfg))
    await _wait_for_step(tmp_path, 1, task)
    os.kill(json.loads((tmp_path / "roles.json").read_text())["engine_pids"][0], signal.SIGKILL)
    with pytest.raises(EnginesDownError, match="rollout engines were down"):
        await task
    assert (ckpt / "latest").exists()  # stopped with a checkpoint
    assert "no healthy rollout engine" in caplog.text


def test_kill_9_of_the_whole_run_resumes_without_loss_or_repeat(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = _argv(tmp_path, "--num-steps", "6", "--save", str(ckpt), "--save-interval", "2")
    cmd = [sys.executable, str(ROOT / "train_async.py"), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while _steps_logged(tmp_path) < 3:  # a checkpoint at step 2 exists, step 3 is not saved
            assert proc.poll() is None, "run exited before the kill"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every role it started
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = subprocess.run(
        [*cmd, "--load", str(ckpt)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # step 3 was rolled back and redone
    groups = _ledger_groups(tmp_path)
    b = parse_config(args).rollout.groups_per_step
    assert len(groups) == len(set(groups)) == 6 * b


def test_ledger_rollback_drops_steps_after_the_checkpoint_and_torn_lines(tmp_path):
    from slime_async.orchestrator.ledger import truncate_ledger

    path = tmp_path / "trained.jsonl"
    rows = [json.dumps({"step": s, "groups": []}) for s in (1, 2, 3)]
    path.write_text("\n".join(rows) + '\n{"step": 4, "gro')  # killed mid-write
    truncate_ledger(path, keep_through=2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


async def test_fresh_run_archives_a_dead_runs_ledger_and_resume_keeps_the_batch_shape(tmp_path):
    """A run killed before its first checkpoint leaves `trained.jsonl` behind; a fresh run (no
    --load) in the same directory must not append to it (it would report those groups as
    duplicates): the old ledger is archived. A resume with another batch shape is refused."""
    stale = [
        json.dumps({"step": s, "version": s, "groups": [["p0", 0, 0]], "dropped": 0, "filtered": 0})
        for s in (1, 2, 3)
    ]
    (tmp_path / "trained.jsonl").write_text("\n".join(stale) + "\n")
    ckpt = tmp_path / "ckpt"
    cfg = parse_config(_argv(tmp_path, "--num-steps", "2", "--save", str(ckpt)))
    await train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    groups = _ledger_groups(tmp_path)
    assert len(groups) == len(set(groups)) == 2 * cfg.rollout.groups_per_step
    (archived,) = tmp_path.glob("trained.jsonl.stale-*")
    assert archived.read_text().splitlines() == stale
    other_argv = _argv(tmp_path, "--num-steps", "3", "--rollout-batch-size", "4")
    with pytest.raises(SystemExit):  # refused at parse time, before anything starts
        parse_config([*other_argv, "--load", str(ckpt)])
    # the launcher's own guard (a checkpoint that changed after parsing) refuses it too
    other = parse_config(other_argv)
    other = dataclasses.replace(other, trainer=dataclasses.replace(other.trainer, load=str(ckpt)))
    with pytest.raises(
        ValueError, match=r"trained with --rollout-batch-size 2.*--rollout-batch-size 4"
    ):
        await train(other)
    assert [
        json.loads(x)["step"] for x in (tmp_path / "trained.jsonl").read_text().splitlines()
    ] == [1, 2]
    # the refused resume gave back what it had reserved: the next run in this process gets it
    assert await _cpus_all_free(), (ray.available_resources(), ray.cluster_resources())


async def _cpus_all_free() -> bool:
    """Every CPU of the test's Ray node is unreserved (removal is asynchronous: wait for it)."""
    for _ in range(200):
        if ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU"):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_replacement_serves_only_once_it_has_the_fleets_weights(tmp_path):
    """Distributed transport: a replacement starts on the run's start weights (v0), so it must
    not get generation before a push gave it the current version (else its groups are stale
    past the bound and dropped, or, before the derived drop, trained)."""
    cfg = parse_config(
        _argv(
            tmp_path,
            "--num-steps",
            "6",
            "--max-staleness",
            "0",
            "--update-weight-transport",
            "distributed",
        )
    )
    task = asyncio.create_task(train(cfg))
    await _wait_for_step(tmp_path, 2, task)
    pid = json.loads((tmp_path / "roles.json").read_text())["engine_pids"][0]
    os.kill(pid, signal.SIGKILL)
    summary = await task
    assert summary["train/version"] == 6 and summary["engines/restarts"] >= 1
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "staleness/max" in r]
    assert len(steps) == 6
    assert sum(r["staleness/dropped"] for r in steps) == 0  # nothing sampled on old weights
    assert max(r["staleness/max"] for r in steps) == 0  # the stated bound, every step
    served = json.loads((tmp_path / "served_versions.json").read_text())
    assert set(map(str, served["engines"].values())) == {"6"}, served


def test_the_run_derives_what_replacements_start_on_from_its_versions(tmp_path):
    """`RunVersions.trainer` is the one counter; `start` is recorded from it, and the pushed
    version and a replacement's start weights derive from the fleet's version: the newest
    directory with the disk transport, the start-up export with the distributed one."""
    from slime_async.orchestrator.run import RunVersions
    from slime_async.weights import DiskTransport, DistributedTransport, WeightSyncConfig

    first = tmp_path / "weights" / "v000003"
    disk = DiskTransport(first.parent, trainer=None, control=None)  # type: ignore[arg-type]
    dist = DistributedTransport(
        sender=None,
        control=None,
        engine_urls=list,  # type: ignore[arg-type]
        cfg=WeightSyncConfig(),
    )
    for transport, after_push in ((disk, first.parent / "v000005"), (dist, first)):
        v = RunVersions(trainer=3, transport=transport, start_dir=first)
        assert (v.start, v.fleet, v.pushed) == (3, 3, -1)
        assert v.served() == (first, 3)
        v.advance(4)
        v.advance(5)
        v.fleet = 5  # what push_weights(5) leaves after training twice
        assert v.start == 3 and v.pushed == 5 and v.current() == v.serving() == 5
        assert v.served() == (after_push, 5 if transport is disk else 3)


def test_the_run_records_only_the_next_version_the_trainer_returns(tmp_path):
    """A train step returns the trainer's new version; the run records exactly that, and a
    version that is not the next one (a step lost or counted twice) stops the run loudly."""
    from slime_async.orchestrator.run import RunVersions
    from slime_async.weights import DiskTransport

    disk = DiskTransport(tmp_path / "w", trainer=None, control=None)  # type: ignore[arg-type]
    v = RunVersions(trainer=3, transport=disk, start_dir=tmp_path / "w" / "v000003")
    v.advance(4)
    assert v.trainer == v.current() == 4
    for wrong in (4, 6, 3):
        with pytest.raises(RuntimeError, match=f"returned version {wrong}.*expected 5"):
            v.advance(wrong)
    assert v.trainer == 4  # nothing recorded
