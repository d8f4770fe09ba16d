"""A two-node Ray cluster on this machine, built the way a real one looks from the network, and a
short `train_async.py` run on it.

Two network namespaces joined by a veth pair, each with its own private address and its own
loopback: the trainer node (10.77.0.1: Ray head, the driver, two trainer ranks, the router) and
the engine node (10.77.0.2: a worker raylet, the engines). The engine node also gets a private
mount namespace with its own tmpfs over Ray's temp dir (so the two raylets share no files) and,
when the run pushes weights without files, over the run directory's parent. A loopback URL, a
port picked on the driver or a path only the driver sees then fails as it would on a real
cluster. Traffic goes only to the two addresses the test made; everything the test started is
killed by namespace (never by process name) and both namespaces are deleted in `finally`.

Needs root and `ip`/`unshare` (CI runs as root); skips with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime_async.config import build_parser

pytestmark = [pytest.mark.timeout(400), pytest.mark.own_ray]
REPO = Path(__file__).resolve().parents[1]
TRAINER_IP, ENGINE_IP = "10.77.0.1", "10.77.0.2"
TOKEN = "netns-test-token-0123456789abcdef"
RAY_CURRENT = Path("/tmp/ray/ray_current_cluster")


def _distributed_transport() -> bool:
    """Whether this build can push weights without a shared filesystem."""
    return any("--update-weight-transport" in a.option_strings for a in build_parser()._actions)


def _sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout)


class TwoNodes:
    """Namespaces, veth, a Ray head in one and a worker raylet in the other (see module doc)."""

    def __init__(self, tmp: Path, *, hide: list[Path]) -> None:
        tag = f"sa{os.getpid() % 100000}"
        self.ns_t, self.ns_e = f"{tag}t", f"{tag}e"
        self.veth_t, self.veth_e = f"{tag}vt", f"{tag}ve"
        self.ray_tmp = Path(f"/tmp/{tag}ray")  # short: Ray's unix socket paths must fit
        self.hide = [self.ray_tmp, *hide]
        self.tmp = tmp
        self.ray_current_existed = RAY_CURRENT.exists()
        self.made: list[str] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.env.pop("SLIME_ASYNC_AUTH_TOKEN", None)
        self.ray = str(Path(sys.executable).with_name("ray"))

    def net(self) -> None:
        for ns in (self.ns_t, self.ns_e):
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
        _sh("ip", "link", "add", self.veth_t, "type", "veth", "peer", "name", self.veth_e)
        for ns, dev, ip in (
            (self.ns_t, self.veth_t, TRAINER_IP),
            (self.ns_e, self.veth_e, ENGINE_IP),
        ):
            _sh("ip", "link", "set", dev, "netns", ns)
            run = ("ip", "netns", "exec", ns)
            _sh(*run, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            _sh(*run, "ip", "link", "set", dev, "up")
            _sh(*run, "ip", "link", "set", "lo", "up")
            # Ray finds its node IP through the default route; nothing is forwarded past the peer
            _sh(*run, "ip", "route", "add", "default", "dev", dev)

    def ray_up(self) -> None:
        head = [
            "ip",
            "netns",
            "exec",
            self.ns_t,
            self.ray,
            "start",
            "--head",
            "--node-ip-address",
            TRAINER_IP,
            "--port",
            "6379",
            "--num-cpus",
            "4",
            "--num-gpus",
            "0",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--object-store-memory",
            "100000000",
            "--temp-dir",
            str(self.ray_tmp),
        ]
        res = subprocess.run(
            head, capture_output=True, text=True, env=self.env, cwd=REPO, timeout=120
        )
        assert res.returncode == 0, res.stdout + res.stderr
        mounts = " && ".join(f"mkdir -p {p} && mount -t tmpfs tmpfs {p}" for p in self.hide)
        worker = (
            f"{mounts} && exec {self.ray} start --address {TRAINER_IP}:6379 "
            f"--node-ip-address {ENGINE_IP} --num-cpus 2 --num-gpus 0 "
            "--object-store-memory 100000000 --disable-usage-stats"
        )
        cmd = [
            "ip",
            "netns",
            "exec",
            self.ns_e,
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            worker,
        ]
        res = subprocess.run(
            cmd, capture_output=True, text=True, env=self.env, cwd=REPO, timeout=120
        )
        assert res.returncode == 0, res.stdout + res.stderr

    def pids(self, ns: str) -> list[int]:
        res = _sh("ip", "netns", "pids", ns, check=False)
        return [int(p) for p in res.stdout.split()]

    def down(self) -> list[int]:
        """Kill every process in the namespaces, delete them; returns pids that survived."""
        survivors = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for ns in self.made:
                for pid in self.pids(ns):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(self.pids(ns) for ns in self.made):
                time.sleep(0.2)
        for ns in self.made:
            survivors += self.pids(ns)
            _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        if not self.ray_current_existed and RAY_CURRENT.exists():
            with contextlib.suppress(OSError):
                if TRAINER_IP in RAY_CURRENT.read_text():
                    RAY_CURRENT.unlink()
        return survivors


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"saprobe{os.getpid() % 100000}"
    res = _sh("ip", "netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    res = _sh("unshare", "--mount", "--propagation", "private", "true", check=False)
    if res.returncode != 0:
        return f"cannot create a mount namespace here: {res.stderr.strip()}"
    return None


def _train_argv(run_dir: Path, steps: int, *extra: str) -> list[str]:
    argv = [
        sys.executable,
        "train_async.py",
        "--ray-address",
        f"{TRAINER_IP}:6379",
        "--run-dir",
        str(run_dir),
        "--num-steps",
        str(steps),
        "--warmstart-steps",
        "0",
        "--eval-interval",
        "0",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "8",
        "--micro-batch-size",
        "2",
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "2",
        "--actor-num-cpus-per-rank",
        "2",
        "--num-engines",
        "2",
        "--rollout-num-cpus-per-engine",
        "1",
        "--max-staleness",
        "1",
        *extra,
    ]
    return argv


def _shared_model(root: Path) -> Path:
    """A tiny dense model at a path both nodes see (a cluster's shared model store)."""
    from slime_async.contracts.model import ModelSpec
    from slime_async.engine.config import EngineConfig
    from slime_async.engine.model import load_model

    path = root / "shared_model"
    spec = ModelSpec(family="llama").to_dict()
    load_model(EngineConfig(dtype="fp32", model_spec=spec)).model.save_pretrained(str(path))
    return path


def test_train_async_on_two_network_namespaces(tmp_path: Path) -> None:
    """Disk transport: the run directory is shared (as an NFS mount would be)."""
    disk = ("--update-weight-transport", "disk") if _distributed_transport() else ()
    _two_node_run(tmp_path, hidden=False, extra=disk)


@pytest.mark.slow
def test_distributed_transport_needs_no_shared_filesystem(tmp_path: Path) -> None:
    """Distributed transport: the engine node cannot see the run directory at all; engines
    start from the model path every node has and get the trainer's weights over gloo."""
    if not _distributed_transport():
        pytest.skip("this build has no --update-weight-transport distributed")
    model = _shared_model(tmp_path.parent / f"{tmp_path.name}_shared")
    try:
        _two_node_run(
            tmp_path,
            hidden=True,
            extra=("--update-weight-transport", "distributed", "--hf-checkpoint", str(model)),
        )
    finally:
        shutil.rmtree(model.parent, ignore_errors=True)


def _two_node_run(tmp_path: Path, *, hidden: bool, extra: tuple[str, ...] = ()) -> None:
    if reason := _skip_reason():
        pytest.skip(reason)
    run_dir = tmp_path / "run"
    nodes = TwoNodes(tmp_path, hide=[tmp_path] if hidden else [])
    steps = 2
    try:
        nodes.net()
        nodes.ray_up()
        env = {**nodes.env, "SLIME_ASYNC_AUTH_TOKEN": TOKEN}
        cmd = ["ip", "netns", "exec", nodes.ns_t, *_train_argv(run_dir, steps, *extra)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        tail = (res.stdout + res.stderr)[-6000:]
        assert res.returncode == 0, tail
        roles = json.loads((run_dir / "roles.json").read_text())
        assert roles["router_url"].startswith(f"http://{TRAINER_IP}:"), roles
        assert len(roles["engine_urls"]) == 2, roles
        assert all(u.startswith(f"http://{ENGINE_IP}:") for u in roles["engine_urls"]), roles
        served = json.loads((run_dir / "served_versions.json").read_text())
        assert served["pushed_version"] == steps == served["trainer_version"], served
        assert set(served["engines"]) == set(roles["engine_urls"])
        assert all(v == str(steps) for v in served["engines"].values()), served  # every engine
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps_logged = [r for r in rows if "timing/step_s" in r]
        assert len(steps_logged) == steps, rows
        assert all(r.get("weights/push_failed_engines", 0) == 0 for r in steps_logged)
        ledger = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]
        assert [r["step"] for r in ledger] == list(range(1, steps + 1)), ledger
        keys = [g[0] for r in ledger for g in r["groups"]]
        assert len(keys) == len(set(keys)) == 2 * steps, keys  # each trained group once
        config = (run_dir / "config.json").read_text()
        assert TOKEN not in config and TOKEN not in tail
    finally:
        survivors = nodes.down()
    assert not survivors, f"processes left in the namespaces: {survivors}"
    assert nodes.ns_t not in _sh("ip", "netns", "list").stdout
