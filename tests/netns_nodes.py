"""Two Ray nodes on this machine from network namespaces, for the node-loss tests and the
cluster mode of `scripts/chaos.py`: node A (Ray head, the driver) and node B (a worker raylet)
joined by a veth pair, each with its own private address and loopback. Node B also has its own
mount namespace with tmpfs over Ray's temp dir and over the paths it must not see (a node with
local disks only). `kill_b` kills every process of node B at once (a lost node); `start_b`
brings a fresh node B back (a replaced node: what it had on local disk is gone). Everything is
killed by namespace, never by process name, and both namespaces are deleted by `down`.

Needs root and `ip`/`unshare`; `skip_reason` says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY_CURRENT = Path("/tmp/ray/ray_current_cluster")


def _sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout)


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"sa33-probe{os.getpid() % 100000}"
    res = _sh("ip", "netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    res = _sh("unshare", "--mount", "--propagation", "private", "true", check=False)
    if res.returncode != 0:
        return f"cannot create a mount namespace here: {res.stderr.strip()}"
    return None


class TwoNodes:
    """Node A = `ip_a` (head, `cpus_a` CPUs), node B = `ip_b` (`cpus_b` CPUs, `hide` unseen)."""

    def __init__(
        self,
        *,
        hide: list[Path],
        subnet: str = "10.133.0",
        cpus_a: int = 3,
        cpus_b: int = 3,
    ) -> None:
        tag = f"sa33-{os.getpid() % 100000}"
        short = f"s33{os.getpid() % 100000}"  # interface names: 15 characters at most
        self.ns_a, self.ns_b = f"{tag}a", f"{tag}b"
        self.veth_a, self.veth_b = f"{short}va", f"{short}vb"
        self.ip_a, self.ip_b = f"{subnet}.1", f"{subnet}.2"
        self.cpus_a, self.cpus_b = cpus_a, cpus_b
        self.ray_tmp = Path(f"/tmp/{short}ray")  # short: Ray's unix socket paths must fit
        self.hide = [self.ray_tmp, *hide]
        self.ray_current_existed = RAY_CURRENT.exists()
        self.made: list[str] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            # a lost node is declared dead after ~10 s of missed health checks (default ~30 s);
            # shorter marks a live node dead on a machine this loaded
            "RAY_health_check_period_ms": "2000",
            "RAY_health_check_timeout_ms": "5000",
            "RAY_health_check_failure_threshold": "5",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.env.pop("SLIME_ASYNC_AUTH_TOKEN", None)
        self.ray = str(Path(sys.executable).with_name("ray"))

    def up(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
        _sh("ip", "link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
        for ns, dev, ip in (
            (self.ns_a, self.veth_a, self.ip_a),
            (self.ns_b, self.veth_b, self.ip_b),
        ):
            _sh("ip", "link", "set", dev, "netns", ns)
            run = ("ip", "netns", "exec", ns)
            _sh(*run, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            _sh(*run, "ip", "link", "set", dev, "up")
            _sh(*run, "ip", "link", "set", "lo", "up")
            _sh(*run, "ip", "route", "add", "default", "dev", dev)
        head = [
            *("ip", "netns", "exec", self.ns_a, self.ray, "start", "--head"),
            *("--node-ip-address", self.ip_a, "--port", "6379"),
            *("--num-cpus", str(self.cpus_a), "--num-gpus", "0"),
            *("--include-dashboard", "false", "--disable-usage-stats"),
            *("--object-store-memory", "100000000", "--temp-dir", str(self.ray_tmp)),
        ]
        res = subprocess.run(
            head, capture_output=True, text=True, env=self.env, cwd=REPO, timeout=120
        )
        assert res.returncode == 0, res.stdout + res.stderr
        self.start_b()

    def start_b(self) -> None:
        """Start (or restart) node B's raylet in a fresh mount namespace."""
        mounts = " && ".join(f"mkdir -p {p} && mount -t tmpfs tmpfs {p}" for p in self.hide)
        worker = (
            f"{mounts} && exec {self.ray} start --address {self.ip_a}:6379 "
            f"--node-ip-address {self.ip_b} --num-cpus {self.cpus_b} --num-gpus 0 "
            "--object-store-memory 100000000 --disable-usage-stats"
        )
        cmd = [
            *("ip", "netns", "exec", self.ns_b, "unshare", "--mount", "--propagation", "private"),
            *("sh", "-c", worker),
        ]
        res = subprocess.run(
            cmd, capture_output=True, text=True, env=self.env, cwd=REPO, timeout=120
        )
        assert res.returncode == 0, res.stdout + res.stderr

    def alive_nodes(self) -> int:
        """Nodes the head counts as alive."""
        code = (
            "import ray; ray.init(address='auto', logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        res = subprocess.run(
            ["ip", "netns", "exec", self.ns_a, sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**self.env, "RAY_ADDRESS": f"{self.ip_a}:6379"},
            cwd=REPO,
            timeout=120,
        )
        return int(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else -1

    def wait_nodes(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.alive_nodes() == n:
                return
            time.sleep(1)
        raise AssertionError(f"the head does not see {n} live nodes after {timeout_s:.0f} s")

    def pids(self, ns: str) -> list[int]:
        res = _sh("ip", "netns", "pids", ns, check=False)
        return [int(p) for p in res.stdout.split()]

    def kill_b(self) -> int:
        """SIGKILL every process of node B (a lost node); returns how many there were."""
        pids = self.pids(self.ns_b)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.pids(self.ns_b):
            time.sleep(0.1)
        return len(pids)

    def popen(self, argv: list[str], *, env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start `argv` on node A (the driver), output to `log`."""
        with open(log, "w") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.ns_a, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )

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
                if self.ip_a in RAY_CURRENT.read_text():
                    RAY_CURRENT.unlink()
        return survivors
