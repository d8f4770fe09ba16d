"""How a run finds a lost trainer rank and what it says (fast; the two-node run:
tests/test_node_loss.py): a trainer call fails as soon as one rank fails and `ranks_lost`
names the rank whose actor is gone (real Ray actors); the one line (`slime_async.orchestrator.node_loss`)
names node and rank, the newest complete checkpoint read from a `--save` directory, and a
resume command that is the run's own command line with `--load`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from slime_async.orchestrator.node_loss import last_checkpoint, resume_command, trainer_lost_message

pytestmark = pytest.mark.own_ray  # a Ray node of its own size

ARGV = ["train_async.py", "--num-steps", "8", "--load", "/old", "--save", "/ck", "--load=/x"]
LOST = [(1, "10.0.0.2", "its actor is gone (ActorDiedError)")]


def _fake_checkpoint(save: Path, version: int) -> None:
    """What `checkpoint.find_latest(hashes=False)` accepts: `latest`, meta.json, model.pt."""
    from slime_async.trainer import checkpoint

    d = save / checkpoint.iter_name(version)
    d.mkdir(parents=True)
    (d / "model.pt").write_bytes(b"weights")
    files = {"model.pt": {"bytes": 7, "sha256": ""}}  # find_latest(hashes=False): sizes only
    meta = {"format": checkpoint.FORMAT, "version": version, "files": files}
    meta["meta_sha256"] = checkpoint._meta_digest(meta)
    (d / "meta.json").write_text(json.dumps(meta))
    (save / "latest").write_text(f"{version}\n")


def test_resume_command_replaces_load() -> None:
    cmd = shlex.split(resume_command(ARGV, "/ck"))
    assert cmd[1:] == ["train_async.py", "--num-steps", "8", "--save", "/ck", "--load", "/ck"]


def test_message_names_node_rank_checkpoint_and_resume(tmp_path: Path) -> None:
    assert last_checkpoint(None) is None and last_checkpoint(tmp_path / "none") is None
    _fake_checkpoint(tmp_path, 3)
    assert last_checkpoint(tmp_path) == 3
    msg = trainer_lost_message(LOST, step=5, save=tmp_path, argv=ARGV)
    assert "\n" not in msg
    assert msg.startswith("lost trainer rank 1 on node 10.0.0.2: its actor is gone"), msg
    assert f"step 3 in {tmp_path} (steps 4..5 are trained again)" in msg, msg
    assert msg.endswith(f"--load {tmp_path}"), msg
    assert "(step 4 is trained again)" in trainer_lost_message(
        LOST, step=4, save=tmp_path, argv=ARGV
    )
    assert "trained again" not in trainer_lost_message(LOST, step=3, save=tmp_path, argv=ARGV)
    no_save = trainer_lost_message(LOST, step=5, save=None, argv=ARGV)
    assert "no --save" in no_save and "--save DIR" in no_save
    empty = trainer_lost_message(LOST, step=1, save=tmp_path / "empty", argv=ARGV)
    assert "No complete checkpoint" in empty


class _Rank:
    """Stands in for a trainer rank's actor: `version` answers; `step` raises at once ("fail":
    the survivor of a broken collective) or blocks until the actor is killed ("hang")."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def version(self) -> int:
        return 0

    def step(self) -> None:
        if self.mode == "fail":
            raise RuntimeError("Connection closed by peer [10.0.0.2]")
        import time

        time.sleep(3600)


def test_a_dead_rank_is_found_and_the_first_failure_raises_at_once() -> None:
    """`TrainerGroup._all` and `ranks_lost` on real Ray actors (a local Ray node)."""
    import ray

    from slime_async.trainer.actor import TrainerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=0)(_Rank)
        group = object.__new__(TrainerGroup)  # the group's calls, without building Megatron
        group.actors = [actor.remote("hang"), actor.remote("fail")]
        group.node_ips, group.timeout_s = ["10.0.0.1", "10.0.0.2"], 3600.0
        assert group.ranks_lost(timeout_s=120) == []
        # rank 1 fails while rank 0 waits forever: the call raises rank 1's error at once
        with pytest.raises(ray.exceptions.RayTaskError, match="Connection closed by peer"):
            group._all("step")
        ray.kill(group.actors[0])  # the hanging one: its node is gone
        lost = group.ranks_lost(timeout_s=120)
        assert [(r, ip) for r, ip, _ in lost] == [(0, "10.0.0.1")], lost
        assert "its actor is gone" in lost[0][2]
    finally:
        ray.shutdown()


# ------------------------------------------------------------------- a stop that stops
_DRIVER = """
import asyncio, sys, threading
import slime_async.config
from slime_async.orchestrator import controller, stop
from slime_async.orchestrator.node_loss import TrainerLostError

stop.STOP_BOUND_S = float(sys.argv[2])
WHY = "lost trainer rank 1 on node 10.0.0.2: its actor is gone, with 3 step(s) trained"

async def survivors_blocked(cfg, *, on_stop=None):
    # a survivor's call that never returns, in a plain thread and in the loop's executor
    threading.Thread(target=threading.Event().wait, name="survivor").start()
    if sys.argv[1] == "teardown-hangs":
        asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)
    if on_stop is not None:
        on_stop(WHY)
    if sys.argv[1] == "teardown-hangs":
        await asyncio.sleep(3600)  # closing the run never finishes
    raise TrainerLostError(WHY)

slime_async.config.parse_config = lambda argv: None
controller.train = survivors_blocked
import train_async
sys.exit(train_async.main([]))
"""


def test_a_stop_ends_the_process_within_its_bound_whatever_survivors_block_in() -> None:
    """`train_async.main` on a run whose survivors never return (a non-daemon thread, an
    executor thread, a teardown that never finishes): the reason once, status 3, within the
    bound (the interpreter would join those threads forever)."""
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    t0 = time.monotonic()
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", _DRIVER, mode, bound],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode, bound in (("stop-raises", "600"), ("teardown-hangs", "4"))
    }
    try:
        for mode, proc in procs.items():
            _out, err = proc.communicate(timeout=120)
            lines = [x for x in err.splitlines() if x.startswith("train_async: stopped:")]
            assert proc.returncode == 3, (mode, err[-3000:])
            assert lines == [
                "train_async: stopped: lost trainer rank 1 on node 10.0.0.2: its "
                "actor is gone, with 3 step(s) trained"
            ], (mode, err[-3000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    assert time.monotonic() - t0 < 100  # a 600 s bound unused: the raise ends it at once


async def test_losing_the_node_of_the_last_engine_stops_the_run_at_once() -> None:
    """The supervisor over a cluster whose only engine's node is lost with no room elsewhere:
    `failed` with a reason naming the node, without waiting out the all-down timeout."""
    import asyncio

    from slime_async.config.supervision import SupervisorConfig
    from slime_async.orchestrator.supervisor import EngineSupervisor
    from tests.supervised_fleet import FleetSlice

    class LostCluster(FleetSlice):  # every engine's node is lost, no live node has room
        async def engine_alive(self, i: int) -> bool:
            return False

        async def lost_node(self, i: int) -> str:
            return "10.0.0.2"

        async def relocate(self, i: int, *, timeout_s: float) -> None:
            return None

        async def drop_engine(self, i: int) -> str:
            return self.engines.pop(i)

    urls = ["http://10.0.0.2:30000"]
    cluster = LostCluster(engines=list(urls))
    cfg = SupervisorConfig(all_down_timeout_s=3600, interval_s=0.05, relocate_wait_s=0.1)
    sup = EngineSupervisor(cluster, cfg, current_weights=lambda: (Path("/w"), 0))  # type: ignore[arg-type]
    sup.start()
    try:
        await asyncio.wait_for(sup.failed.wait(), 10)
    finally:
        await sup.stop()
    assert "no rollout engine is left" in sup.reason and "node 10.0.0.2" in sup.reason
    assert sup.dropped == 1 and not cluster.engines
