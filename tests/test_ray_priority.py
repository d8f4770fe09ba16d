"""Ray actors of a local run start at the driver's priority, not at Ray's default niceness of
15 (`roles.init_ray`): on a shared machine a niced trainer would lose every core to anything
else running. Their heaps are on transparent huge pages (`host.huge_page_malloc`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, ray
from slime_async.orchestrator.roles import init_ray
init_ray()

@ray.remote(num_cpus=0)
class Probe:
    def nice(self):
        return os.nice(0)

print(os.nice(0), ray.get(Probe.remote().nice.remote()))
"""


def test_actors_run_at_the_drivers_priority():
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr[-2000:]
    driver, actor = map(int, out.stdout.split()[-2:])
    assert actor == driver


GROW = """
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from slime_async.orchestrator.roles import init_ray
init_ray(num_cpus=2)
first = ray.cluster_resources()["CPU"]
pg = placement_group([{"CPU": 1}])
ray.get(pg.ready())
init_ray(num_cpus=first + 1)  # busy: the node is kept (the run's reservation will say why)
busy = ray.cluster_resources()["CPU"]
remove_placement_group(pg)
init_ray(num_cpus=first + 1)  # idle: started again, larger
print(first, busy, ray.cluster_resources()["CPU"])
"""


def test_a_second_run_that_needs_more_cpus_gets_a_larger_local_node():
    """A process that runs twice (a notebook, a test session) asks for more logical CPUs the
    second time: its own local node, idle, is started again with them; a busy one is kept."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", GROW], env=env, capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, busy, grown = map(float, out.stdout.split()[-3:])
    assert busy == first and grown == first + 1


HUGE = """
import os, ray
from slime_async.orchestrator.roles import init_ray
init_ray()

@ray.remote(num_cpus=0)
class Probe:
    def huge_kib(self):
        block = b"x" * (64 << 20)  # a fresh 64 MiB malloc block, every page written
        with open("/proc/self/smaps_rollup") as f:
            kib = [int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")]
        del block
        return os.environ.get("GLIBC_TUNABLES", ""), kib[0]

print(*ray.get(Probe.remote().huge_kib.remote()))
"""


def test_actors_malloc_on_transparent_huge_pages():
    """glibc reads the tunable at the actor's start: a block it allocates then is backed by 2 MiB
    pages (where the kernel's transparent huge pages are not off)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this kernel's transparent huge pages are off")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", HUGE], env=env, capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr[-2000:]
    tunables, huge_kib = out.stdout.split()[-2:]
    assert tunables == "glibc.malloc.hugetlb=1"
    assert int(huge_kib) >= 32 * 1024


def test_a_tunable_the_user_set_is_kept():
    from slime_async.host import MALLOC_TUNABLES, huge_page_malloc

    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}
    assert not huge_page_malloc(env) and env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1"
    env = {}
    assert huge_page_malloc(env) and env == {"GLIBC_TUNABLES": MALLOC_TUNABLES}
