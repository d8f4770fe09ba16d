"""Losing a node, and no shared filesystem, on two Ray nodes built from network namespaces
(`tests/netns_nodes.py`; skipped with the reason where they cannot be made).

* a trainer rank on a node that cannot see the run directory trains (the warm start reaches it
  from rank 0), and a `--save` that node cannot see is refused before training, naming the node,
  the rank, the path and the fix;
* killing the engine-only node mid-run keeps training on the remaining engine;
* killing a trainer node stops the run with a one-line reason naming the node and rank and a
  resume command, the last complete checkpoint is on disk, and `--load` after the node is back
  finishes with every group trained exactly once (the prompt ledger).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.netns_nodes import TwoNodes, skip_reason

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TOKEN = "sa33-node-loss-token-0123456789abcdef"


def _argv(run_dir: Path, steps: int, ip_a: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "train_async.py",
        *("--ray-address", f"{ip_a}:6379", "--run-dir", str(run_dir)),
        *("--num-steps", str(steps), "--eval-interval", "0"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--rollout-max-response-len", "8", "--micro-batch-size", "2"),
        *("--num-engines", "2", "--rollout-num-cpus-per-engine", "1"),
        *("--max-staleness", "1", "--update-weight-transport", "distributed"),
        *extra,
    ]


TWO_TRAINER_NODES = ("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1")
TWO_TRAINER_NODES += ("--actor-num-cpus-per-rank", "2")


def _ledger(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def _two_nodes(tmp_path: Path, **kw):
    if reason := skip_reason():
        pytest.skip(reason)
    n = TwoNodes(hide=[tmp_path], **kw)  # node B never sees this test's tmp_path
    try:
        n.up()
        yield n
    finally:
        survivors = n.down()
        assert not survivors, f"processes left in the namespaces: {survivors}"


@pytest.fixture
def nodes(tmp_path: Path):
    with _two_nodes(tmp_path) as n:
        yield n


def _run(nodes: TwoNodes, argv: list[str], log: Path, timeout: float = 400) -> tuple[int, str]:
    env = {**nodes.env, "SLIME_ASYNC_AUTH_TOKEN": TOKEN}
    proc = nodes.popen(argv, env=env, log=log)
    try:
        rc = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, log.read_text()


def test_trainer_rank_on_a_node_without_the_run_directory(nodes: TwoNodes, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = _argv(run_dir, 2, nodes.ip_a, *TWO_TRAINER_NODES, "--warmstart-steps", "3")
    rc, out = _run(nodes, argv, tmp_path / "train.log")
    assert rc == 0, out[-6000:]
    assert "rank 0 reads it and sends it over the trainer group" in out, out[-6000:]
    roles = json.loads((run_dir / "roles.json").read_text())
    assert sorted(u.split("//")[1].split(":")[0] for u in roles["engine_urls"]) == [
        nodes.ip_a,
        nodes.ip_b,
    ]
    assert [r["step"] for r in _ledger(run_dir)] == [1, 2]
    assert TOKEN not in out
    # --save where node B cannot see it: refused before training, naming node, rank, path, fix
    save = tmp_path / "ckpt"
    argv = _argv(
        tmp_path / "run2",
        2,
        nodes.ip_a,
        *TWO_TRAINER_NODES,
        "--warmstart-steps",
        "0",
        "--save",
        str(save),
    )
    rc, out = _run(nodes, argv, tmp_path / "refused.log")
    assert rc != 0
    lines = [x for x in out.splitlines() if f"rank 1 on node {nodes.ip_b}" in x]
    assert lines and f"--save {save}" in lines[0] and "mounts at the same path" in lines[0], out[
        -4000:
    ]
    assert not (tmp_path / "run2" / "trained.jsonl").exists()


def _wait_steps(run_dir: Path, n: int, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        ledger = run_dir / "trained.jsonl"
        if ledger.exists() and len(ledger.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {n} (rc {proc.poll()})")


def _assert_ledger_intact(run_dir: Path, steps: int, *, save: Path | None = None) -> None:
    """Every step once, every group (its submission sequence number) trained at most once, and
    with a checkpoint: dispatched = trained + dropped + pending (no group lost)."""
    ledger = _ledger(run_dir)
    assert [r["step"] for r in ledger] == list(range(1, steps + 1)), ledger
    seqs = [g[1] for r in ledger for g in r["groups"]]
    assert len(seqs) == len(set(seqs)) == 2 * steps, seqs  # 2 groups a step, none twice
    if save is not None:
        from slime_async.trainer.checkpoint import find_latest, read_meta

        worker = read_meta(find_latest(save))["extra_state"]["worker"]
        pending = {p["seq"] for p in worker["pending"]}
        dropped = worker["counters"]["n_dropped"] + worker["counters"]["n_filtered"]
        assert not pending & set(seqs)
        assert worker["next_seq"] - len(seqs) - dropped - len(pending) == 0, worker["counters"]


def test_trainer_node_loss_stops_with_a_reason_and_load_finishes(
    nodes: TwoNodes, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    save = Path(f"{tmp_path}_shared") / "ckpt"  # a filesystem both nodes see
    try:
        steps = 6
        argv = _argv(run_dir, steps, nodes.ip_a, *TWO_TRAINER_NODES, "--warmstart-steps", "0")
        argv += ["--save", str(save), "--save-interval", "1"]
        env = {**nodes.env, "SLIME_ASYNC_AUTH_TOKEN": TOKEN}
        proc = nodes.popen(argv, env=env, log=tmp_path / "killed.log")
        try:
            _wait_steps(run_dir, 3, proc)
            killed_at = len(_ledger(run_dir))
            assert nodes.kill_b() > 0
            rc = proc.wait(180)
        finally:
            if proc.poll() is None:
                proc.kill()
        out = (tmp_path / "killed.log").read_text()
        assert rc == 3, out[-6000:]
        stops = [x for x in out.splitlines() if x.startswith("train_async: stopped:")]
        assert len(stops) == 1, out[-6000:]  # one line, whatever Ray prints around it
        last = stops[0]
        assert last.startswith("train_async: stopped: lost trainer rank 1 on node "), last
        assert nodes.ip_b in last and f"--load {save}" in last, last
        assert "Unclosed client session" not in out and "Unclosed connector" not in out
        done = json.loads((save / "latest").read_text())
        # the newest complete checkpoint: the step before the kill's, or a later one
        assert killed_at - 1 <= done <= killed_at + 1, (killed_at, done)
        assert f"step {done} in {save}" in last, last
        # the node comes back; the printed command resumes and finishes with the ledger intact
        nodes.start_b()
        nodes.wait_nodes(2)
        cmd = last.split("resume with: ", 1)[1]
        resume = [sys.executable, *shlex.split(cmd)[1:]]
        assert resume[1:] == [*argv[1:], "--load", str(save)], resume
        rc, out = _run(nodes, resume, tmp_path / "resumed.log")
        assert rc == 0, out[-6000:]
        assert "Unclosed client session" not in out
        _assert_ledger_intact(run_dir, steps, save=save)
    finally:
        shutil.rmtree(save.parent, ignore_errors=True)


def test_trainer_node_loss_without_save_ends_the_process_within_a_bound(
    nodes: TwoNodes, tmp_path: Path
) -> None:
    """The reported shape: one trainer rank and one engine on each node, the distributed
    transport, no --save; node B killed after step 3. The driver ends with status 3 and its one
    line within the stop's bound (it used to hang at times, a survivor blocked in a call that
    never returns), and leaves no process of the run behind on node A."""
    from slime_async.orchestrator.stop import STOP_BOUND_S

    run_dir = tmp_path / "run"
    argv = _argv(run_dir, 40, nodes.ip_a, *TWO_TRAINER_NODES, "--warmstart-steps", "0")
    env = {**nodes.env, "SLIME_ASYNC_AUTH_TOKEN": TOKEN}
    proc = nodes.popen(argv, env=env, log=tmp_path / "killed.log")
    try:
        _wait_steps(run_dir, 3, proc)
        roles = json.loads((run_dir / "roles.json").read_text())
        assert sorted(u.split("//")[1].split(":")[0] for u in roles["engine_urls"]) == sorted(
            [nodes.ip_a, nodes.ip_b]
        )
        assert nodes.kill_b() > 0
        t0 = time.monotonic()
        rc = proc.wait(STOP_BOUND_S + 60)  # finding the lost rank (<= 20 s) + the bound
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "killed.log").read_text()
    assert rc == 3, out[-6000:]
    stops = [x for x in out.splitlines() if x.startswith("train_async: stopped:")]
    assert len(stops) == 1, out[-6000:]
    assert stops[0].startswith("train_async: stopped: lost trainer rank 1 on node "), stops[0]
    assert nodes.ip_b in stops[0] and "no --save" in stops[0], stops[0]
    assert took < STOP_BOUND_S + 60, took


ONE_TRAINER_NODE = ("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2")
ONE_TRAINER_NODE += ("--actor-num-cpus-per-rank", "1")


def test_engine_node_loss_keeps_training_on_the_remaining_engine(tmp_path: Path) -> None:
    # node B has room for one engine only: the trainer packs onto node A, beside engine 0
    with _two_nodes(tmp_path, cpus_b=1) as nodes:
        _engine_node_loss(nodes, tmp_path)


def _engine_node_loss(nodes: TwoNodes, tmp_path: Path) -> None:
    run_dir, steps = tmp_path / "run", 20
    argv = _argv(run_dir, steps, nodes.ip_a, *ONE_TRAINER_NODE, "--warmstart-steps", "0")
    argv += ["--engine-restart-after", "2"]
    env = {**nodes.env, "SLIME_ASYNC_AUTH_TOKEN": TOKEN}
    proc = nodes.popen(argv, env=env, log=tmp_path / "train.log")
    try:
        _wait_steps(run_dir, 2, proc)
        roles = json.loads((run_dir / "roles.json").read_text())
        assert sorted(u.split("//")[1].split(":")[0] for u in roles["engine_urls"]) == sorted(
            [nodes.ip_a, nodes.ip_b]
        )
        assert nodes.kill_b() > 0
        rc = proc.wait(400)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "train.log").read_text()
    assert rc == 0, out[-6000:]
    _assert_ledger_intact(run_dir, steps)
    assert f"its node {nodes.ip_b} is lost" in out and "continuing on 1 of 2 engines" in out
    assert "Unclosed client session" not in out
    roles = json.loads((run_dir / "roles.json").read_text())
    assert [u.split("//")[1].split(":")[0] for u in roles["engine_urls"]] == [nodes.ip_a]
    served = json.loads((run_dir / "served_versions.json").read_text())
    assert served["pushed_version"] == steps and list(served["engines"].values()) == [str(steps)]
