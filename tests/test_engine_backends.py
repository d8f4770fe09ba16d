"""Engine backends: the registry and fleet flags, a test-only backend added by one file plus one
registry line (tests/plugins/subprocess_engine.py) running the real training path, and the
`external` backend attaching engine servers this test starts itself.

Every run goes through `parse_config` → `controller.train` with real Ray, router, trainer and
engines; assertions read what the engines report (`/model_info`, per-token versions in the
ledger) and what processes exist afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from slime_async.config import parse_config
from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.contracts.engine import EngineLaunch
from slime_async.engine import EngineConfig, EngineProcess
from slime_async.engine.testing import start_processes, stop_processes
from slime_async.orchestrator.controller import train
from slime_async.orchestrator.engines import (
    available_engine_backends,
    get_engine_backend,
    register_engine_backend,
)
from slime_async.orchestrator.engines.external import EngineAttachError
from slime_async.orchestrator.engines.sglang import sglang_config
from slime_async.orchestrator.supervisor import EnginesDownError

pytestmark = pytest.mark.timeout(600)
PLUGIN = "tests.plugins.subprocess_engine:subprocess"


def _argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--run-dir",
        str(run_dir),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "8",
        "--warmstart-steps",
        "0",
        "--eval-interval",
        "0",
        "--micro-batch-size",
        "8",
        "--max-staleness",
        "1",
        *extra,
    ]


def _ledger(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]


def _get(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, json.loads(r.read() or b"null")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state == "Z"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------- registry and flags
def test_builtin_backends_are_registered_with_their_needs() -> None:
    assert {"embedded", "sglang", "external"} <= set(available_engine_backends())
    assert get_engine_backend("embedded").can_restart
    assert get_engine_backend("sglang").needs.gpus_per_engine == 1
    ext = get_engine_backend("external")
    assert not ext.can_restart and ext.needs.urls and not ext.needs.model_dir


def test_capabilities_say_what_the_backend_names_used_to() -> None:
    """Call sites ask capabilities, never names: the built-ins declare theirs."""
    emb, sgl, ext = (get_engine_backend(n).needs for n in ("embedded", "sglang", "external"))
    assert (emb.owns_processes, sgl.owns_processes, ext.owns_processes) == (True, True, False)
    assert (emb.collective_backend, sgl.collective_backend, ext.collective_backend) == (
        "gloo",
        "nccl",
        "gloo",
    )
    assert [n.checkpoint_to_start for n in (emb, sgl, ext)] == [False, True, False]
    assert [n.sglang_flags for n in (emb, sgl, ext)] == [False, True, False]


def test_the_flags_are_checked_without_loading_a_backend() -> None:
    """The config wing reads each built-in backend's needs from the registry's table: parsing
    an sglang fleet loads no backend code (no Ray), and a class registered under a built-in
    name must declare the same needs."""
    code = (
        "import sys; from slime_async.config.engine_fleet import EngineFleetConfig\n"
        "f = EngineFleetConfig(backend='sglang', num_engines=2)\n"
        "assert f.needs.gpus_per_engine == 1\n"
        "assert 'slime_async.orchestrator.engines' not in sys.modules\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

    class Impostor(get_engine_backend("embedded")):
        needs = get_engine_backend("sglang").needs

    with pytest.raises(ValueError, match="differ from the built-in"):
        register_engine_backend("embedded", Impostor)
    assert get_engine_backend("embedded") is not Impostor


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--engine-backend", "external"], "give their URLs with --engine-urls"),
        (["--engine-urls", "http://127.0.0.1:1"], "drop --engine-urls"),
        (
            [
                "--engine-backend",
                "external",
                "--engine-urls",
                "http://a:1,http://b:2",
                "--num-engines",
                "3",
            ],
            "--num-engines 3 does not match the 2 --engine-urls",
        ),
        (["--engine-backend", "external", "--engine-urls", "http://a:1,http://a:1"], "twice"),
        (["--engine-backend", "external", "--engine-urls", "a:1"], "--engine-urls: worker url"),
        (["--engine-backend", "nope"], "unknown engine backend 'nope'; choose one of"),
        (["--engine-backend", "no_such_module:x"], "cannot be imported"),
        (["--engine-backend", "tests.plugins.subprocess_engine:other"], "did not register"),
        (["--num-engines", "0"], "--num-engines must be >= 1"),
    ],
)
def test_bad_fleet_flags_are_refused_with_the_fix(argv, needle, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert needle in capsys.readouterr().err


def test_fleet_flags_resolve_without_overriding_the_user() -> None:
    ext = parse_config(["--engine-backend", "external", "--engine-urls", "http://a:1, http://b:2"])
    assert ext.engines == EngineFleetConfig(
        backend="external", num_engines=2, urls=("http://a:1", "http://b:2")
    )
    both = ["--engine-backend", "external", "--engine-urls", "http://a:1", "--num-engines", "1"]
    assert parse_config(both).engines.num_engines == 1
    assert parse_config(["--num-engines", "3"]).engines.num_engines == 3
    assert parse_config(["--engine-backend", PLUGIN]).engines.backend == "subprocess"


def test_sglang_launch_maps_the_engine_config() -> None:
    launch = EngineLaunch(index=1, model_dir="/w/v000003", weight_version=3, seed=1007)
    cfg = sglang_config(EngineConfig(max_running_requests=32), launch, port=31000)
    assert (cfg.model_path, cfg.port, cfg.weight_version) == ("/w/v000003", 31000, "3")
    assert cfg.random_seed == 1007 and cfg.max_running_requests == 32
    assert cfg.enable_return_routed_experts and cfg.skip_tokenizer_init


# ------------------------------------------------------------- a plugin backend, the real path
async def test_plugin_backend_from_one_file_runs_the_real_training_path(tmp_path) -> None:
    cfg = parse_config(_argv(tmp_path, "--num-steps", "3", "--engine-backend", PLUGIN))
    assert cfg.engines.backend == "subprocess"
    task = asyncio.create_task(train(cfg))
    roles = tmp_path / "roles.json"
    deadline = time.monotonic() + 300
    while not roles.exists():
        assert not task.done(), task.exception() if task.done() else None
        assert time.monotonic() < deadline, "run did not start its engines"
        await asyncio.sleep(0.2)
    info = json.loads(roles.read_text())
    (pid,) = info["engine_pids"]
    assert info["engine_backend"] == "subprocess"
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"slime_async.engine" in cmdline  # the plugin's own launch path, not a Ray actor

    summary = await asyncio.wait_for(task, 400)
    assert summary["train/version"] == 3
    ledger = _ledger(tmp_path)
    assert [r["step"] for r in ledger] == [1, 2, 3]
    # versions advanced on the engine: later steps train tokens the engine tagged with pushes
    assert max(j for r in ledger for _, _, j in r["groups"]) >= 1
    assert _gone(pid), "the plugin's engine process outlived the run"


# ------------------------------------------------------------------------- external engines
@pytest.fixture
def external_engines(tmp_path):
    """Two engine servers started outside the run (child processes, loopback)."""
    procs = [
        EngineProcess(
            EngineConfig(weight_version="boot", seed=100 + i, num_threads=1),
            log_path=str(tmp_path / f"ext{i}.log"),
        )
        for i in range(2)
    ]
    try:
        urls = start_processes(procs)
        yield procs, urls
    finally:
        stop_processes(procs)


async def test_external_engines_get_the_run_weights_and_stay_running(
    tmp_path, external_engines
) -> None:
    procs, urls = external_engines
    assert all(_get(u + "/model_info")[1]["weight_version"] == "boot" for u in urls)
    run_dir = tmp_path / "run"
    cfg = parse_config(
        _argv(
            run_dir,
            "--num-steps",
            "3",
            "--engine-backend",
            "external",
            "--engine-urls",
            ",".join(urls),
        )
    )
    summary = await asyncio.wait_for(train(cfg), 400)

    assert summary["train/version"] == 3
    assert summary["engines/restarts"] == 0
    ledger = _ledger(run_dir)
    # every trained token came from a run version: the initial push replaced "boot" (v0) first
    assert min(j for r in ledger for _, _, j in r["groups"]) >= 0
    assert max(j for r in ledger for _, _, j in r["groups"]) >= 1
    # ... and it carried the trainer's weights: engine and trainer log-probs agree from step 1
    # (bf16 engine vs fp32 trainer: ~1e-3; the servers' own random weights differ by nats)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "mismatch/train_rollout_logprob_abs_diff" in r)
    assert first["mismatch/train_rollout_logprob_abs_diff"] < 0.05
    for p, u in zip(procs, urls, strict=True):
        assert p.proc is not None and p.proc.poll() is None, "the run stopped an external engine"
        assert _get(u + "/health")[0] == 200
        assert _get(u + "/model_info")[1]["weight_version"] == "3"  # every push reached it
    roles = json.loads((run_dir / "roles.json").read_text())
    assert roles["engine_pids"] == [None, None] and roles["engine_urls"] == urls


async def test_unreachable_external_url_fails_before_anything_starts(tmp_path) -> None:
    import ray

    if ray.is_initialized():  # left by an earlier test of this module
        ray.shutdown()
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens here
    cfg = parse_config(
        _argv(
            tmp_path,
            "--num-steps",
            "2",
            "--engine-backend",
            "external",
            "--engine-urls",
            url,
            "--engine-attach-timeout",
            "2",
        )
    )
    with pytest.raises(EngineAttachError, match=f"external engine {url} did not answer /health"):
        await train(cfg)
    assert not ray.is_initialized()  # refused before Ray, the trainer or any engine started


async def test_external_engine_that_dies_is_waited_for_then_the_run_stops(tmp_path, caplog) -> None:
    ext = EngineProcess(EngineConfig(seed=7, num_threads=1))
    url = ext.start()
    try:
        ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
        cfg = parse_config(
            _argv(
                run_dir,
                "--num-steps",
                "50",
                "--engine-backend",
                "external",
                "--engine-urls",
                url,
                "--save",
                str(ckpt),
                "--engine-down-timeout",
                "6",
            )
        )
        task = asyncio.create_task(train(cfg))
        deadline = time.monotonic() + 300
        while not (run_dir / "trained.jsonl").exists():
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.2)
        assert ext.proc is not None
        os.kill(ext.proc.pid, signal.SIGKILL)  # the external server dies; the run cannot restart it
        with pytest.raises(EnginesDownError, match="rollout engines were down"):
            await asyncio.wait_for(task, 300)
        assert (ckpt / "latest").exists()  # stopped with a checkpoint
        assert "cannot restart engines" in caplog.text
        assert "restarting it" not in caplog.text
    finally:
        ext.stop()


async def test_external_engine_that_comes_back_is_readmitted_on_current_weights(tmp_path) -> None:
    port = _free_port()
    ext = EngineProcess(EngineConfig(port=port, seed=7, num_threads=1))
    url = ext.start()
    back: EngineProcess | None = None
    try:
        run_dir = tmp_path / "run"
        cfg = parse_config(
            _argv(run_dir, "--num-steps", "4", "--engine-backend", "external", "--engine-urls", url)
        )
        task = asyncio.create_task(train(cfg))
        deadline = time.monotonic() + 300
        while not (run_dir / "trained.jsonl").exists():
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.2)
        ext.stop()  # the operator restarts the server on the same port, on its own weights
        back = EngineProcess(EngineConfig(port=port, seed=8, num_threads=1, weight_version="boot"))
        assert await asyncio.to_thread(back.start) == url
        summary = await asyncio.wait_for(task, 300)
        assert summary["train/version"] == 4 and summary["engines/restarts"] == 0
        # re-admitted only after the router replayed the newest weights on it
        assert _get(url + "/model_info")[1]["weight_version"] == "4"
        assert back.proc is not None and back.proc.poll() is None
    finally:
        ext.stop()
        if back is not None:
            back.stop()
