"""Shared pytest setup: CPU-friendly thread count, GPU-test skipping, offline HF hub, and the
leak check: the session fails if it ends holding more threads, open fds or child processes than
it started with (beyond `LEAK_MARGIN`), naming what leaked and which modules gained it."""

from __future__ import annotations

import gc
import os
import time

import pytest

from tests.hangs import engine_report
from tests.leaks import Held, gained, held

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is an install error caught elsewhere
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """On a pytest-timeout failure, add what the in-process engines still hold (tests/hangs.py)
    to the report, beside the thread stacks pytest-timeout prints."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "Timeout (>" in str(report.longrepr):
        text = engine_report()
        if text:
            report.sections.append(("engines at the timeout", text))


LEAK_MARGIN = {"threads": 32, "fds": 96}
"""What the session may end holding over its start: the state a process keeps once made
(torch's and gRPC's thread pools; after `ray.shutdown` a Ray driver keeps its gRPC threads, a
few sockets and a log file of each session, about 13 threads and 14 fds for the first session
and 1 thread and 2-3 fds for each later one). A leak per test or per module (a process group:
3 threads and ~6 fds; an event loop, an executor, a server, a child) overruns it: the 1,668
process groups a run once leaked were 5,004 threads."""
SETTLE_S = 15.0
"""How long released threads and processes get to end before the check counts them."""
KEPT_CHILDREN = ("multiprocessing.resource_tracker",)
"""Children a process keeps by design (one `spawn` resource tracker, for its lifetime)."""
_module_gains: list[tuple[str, list[str]]] = []


def _excess(start: Held, now: Held) -> bool:
    new = [c for p, c in now.children.items() if p not in start.children]
    return (
        now.n_threads > start.n_threads + LEAK_MARGIN["threads"]
        or now.n_fds > start.n_fds + LEAK_MARGIN["fds"]
        or any(not any(k in c for k in KEPT_CHILDREN) for c in new)
    )


def _settled(start: Held) -> Held:
    """What is held once released threads/processes ended (at most `SETTLE_S`)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        gc.collect()
        now = held()
        if not _excess(start, now) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


@pytest.fixture(autouse=True, scope="session")
def _no_leaks_at_session_end():
    """Fail the run if the session ends holding more than it started with (+`LEAK_MARGIN`)."""
    start = held()
    yield
    _shutdown_ray()  # the Ray node kept between modules
    _release_torch_distributed()
    _release_process_singletons()
    now = _settled(start)
    if _excess(start, now):
        culprits = "\n".join(f"  {mod}: {'; '.join(g)}" for mod, g in _module_gains) or "  -"
        pytest.fail(
            "the test session leaked (margin "
            + ", ".join(f"{k} +{v}" for k, v in LEAK_MARGIN.items())
            + "): "
            + "; ".join(gained(start, now))
            + "\nmodules that ended holding more than they started with:\n"
            + culprits,
            pytrace=False,
        )


@pytest.fixture(autouse=True, scope="module")
def _module_leaks(request: pytest.FixtureRequest):
    """Record what each module gained (named when the session check fails). Set up before
    the other module fixtures, so it measures after their teardown; no garbage collection here
    (0.1-0.3 s a module), so garbage not yet collected counts too."""
    before = held()
    yield
    g = gained(before, held())
    if g:
        _module_gains.append((request.module.__name__, g))


def _release_process_singletons() -> None:
    """State a process makes once and keeps: megatron's async checkpoint writer starts one
    `multiprocessing` manager (a child process) for its results queue on the first save."""
    import sys

    fs = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(fs, "_results_queue", None)
    if queue is not None:
        fs._results_queue = None
        queue._manager.shutdown()


def _release_torch_distributed(*, keep_default: bool = False) -> None:
    """The trainer keeps its default process group up for reuse across tests in one process
    (and megatron's groups until the next trainer or its `shutdown`): a module ends megatron's
    (`keep_default`), the session ends both."""
    import sys

    if "torch.distributed" not in sys.modules or "slime_async.trainer.parallel" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from slime_async.trainer import parallel

        if keep_default:
            parallel.release_model_parallel()
        else:
            parallel.release_distributed()


@pytest.fixture(autouse=True, scope="module")
def _ray_between_modules(request: pytest.FixtureRequest):
    """A module starts without megatron's process groups and ends them. A local Ray node that
    `init_ray` started is kept for the next module when the module left all of it free (no
    actor, no placement group): its start (3.3 s) and stop (1.4 s) once per session instead of
    per module. Any other Ray session is shut down after the module, and before a module
    marked `own_ray` (it sizes or joins Ray itself)."""
    if request.node.get_closest_marker("own_ray"):
        _shutdown_ray()
    yield
    _release_torch_distributed(keep_default=True)
    if request.node.get_closest_marker("own_ray") or not _ray_reusable():
        _shutdown_ray()


def _shutdown_ray() -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _ray_reusable() -> bool:
    """A local node of `init_ray`'s, every CPU/GPU free and no placement group alive."""
    import sys

    ray, roles = sys.modules.get("ray"), sys.modules.get("slime_async.orchestrator.roles")
    if ray is None or roles is None or not ray.is_initialized() or not roles._LOCAL[0]:
        return False
    from ray.util import placement_group_table

    deadline = time.monotonic() + 5.0  # a killed actor's resources come back asynchronously
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        idle = all(free.get(k, 0.0) >= total[k] - 1e-6 for k in ("CPU", "GPU") if k in total)
        groups = [g for g in placement_group_table().values() if g.get("state") != "REMOVED"]
        if idle and not groups:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
