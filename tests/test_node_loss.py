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

import json
import sys
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


@pytest.fixture
def nodes(tmp_path: Path):
    if reason := skip_reason():
        pytest.skip(reason)
    n = TwoNodes(hide=[tmp_path])  # node B never sees this test's tmp_path
    try:
        n.up()
        yield n
    finally:
        survivors = n.down()
        assert not survivors, f"processes left in the namespaces: {survivors}"


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
