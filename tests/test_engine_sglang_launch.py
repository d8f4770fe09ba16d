"""The SGLang launch path of a run with only the SGLang process replaced: a stand-in
`sglang.launch_server` (tests/fake_sglang) takes SGLang's command line and serves our embedded
engine. Everything else is the real code: the run's flags, the placement groups, the Ray actor
backend, the launcher, the token hand-over, the router, replacement and shutdown."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

import aiohttp
import pytest
import ray

from router.config import RouterConfig
from slime_async.config import parse_config
from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.engine.config import EngineConfig
from slime_async.engine.model import load_model
from slime_async.engine.sglang import SGLangConfig, SGLangServer, build_command
from slime_async.orchestrator.engines.sglang import SGLangBackend, sglang_config
from slime_async.orchestrator.placement import place_roles
from slime_async.orchestrator.roles import Cluster, init_ray

pytestmark = [pytest.mark.timeout(300), pytest.mark.own_ray]
FAKE = Path(__file__).resolve().parent / "fake_sglang"
REPO = FAKE.parents[1]
TOKEN = "sglang-launch-token-abcdef0123456789"
GEN = {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state == "Z"


def _wait_gone(pid: int, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def test_run_flags_reach_the_sglang_command() -> None:
    cfg = parse_config(
        [
            "--engine-backend",
            "sglang",
            "--rollout-num-gpus",
            "16",
            "--rollout-num-gpus-per-engine",
            "4",
            "--sglang-mem-fraction-static",
            "0.8",
            "--sglang-enable-torch-compile",
            "--sglang-cuda-graph-max-bs=64",
            "--engine-start-timeout",
            "1200",
        ]
    )
    assert cfg.engines.num_engines == 4 and cfg.engines.rollout_num_gpus == 16
    assert "rollout-num-gpus 16" in cfg.derived["--num-engines"].why
    assert cfg.engines.sglang_args == (
        "--mem-fraction-static",
        "0.8",
        "--enable-torch-compile",
        "--cuda-graph-max-bs=64",
    )
    from slime_async.contracts.engine import EngineLaunch

    launch = EngineLaunch(
        index=1, model_dir="/w/v000000", weight_version=0, seed=7, host="10.0.0.2"
    )
    engine = EngineConfig(host="127.0.0.1", api_key=TOKEN)
    cmd = build_command(sglang_config(engine, launch, port=30001, fleet=cfg.engines))
    text = " ".join(cmd)
    assert "--tp-size 4" in text and "--host 10.0.0.2" in text
    assert "--mem-fraction-static 0.8 --enable-torch-compile --cuda-graph-max-bs=64" in text
    assert TOKEN not in text


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "4"], "multiple"),
        (["--rollout-num-gpus", "8", "--num-engines", "3"], "contradicts"),
        (["--sglang-mem-fraction-static", "0.8"], "--engine-backend sglang"),
        (["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "2"], "TP 2"),
    ],
)
def test_bad_placement_flags_name_the_fix(argv: list[str], needle: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert needle in capsys.readouterr().err


@pytest.fixture
def fake_sglang(tmp_path: Path, monkeypatch):
    """PYTHONPATH with the stand-in first (Ray workers started after this inherit it)."""
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{FAKE}:{REPO}")
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    model = tmp_path / "model"
    load_model(EngineConfig(dtype="fp32")).model.save_pretrained(str(model))
    return record, model


def _records(record: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(record.glob("*.json"))]


async def _generate(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/generate", json=GEN, headers=headers) as r,
    ):
        await r.read()
        return r.status


async def test_sglang_engines_in_bundles_replaced_and_stopped_without_orphans(fake_sglang):
    record, model = fake_sglang
    init_ray(num_cpus=4)
    fleet = EngineFleetConfig(
        backend="sglang",
        num_engines=2,
        gpus_per_engine=2,
        cpus_per_engine=1,
        start_timeout_s=240,
        sglang_args=("--cuda-graph-max-bs", "8"),
    )
    placement = place_roles(
        actor_num_nodes=1,
        actor_num_gpus_per_node=1,
        actor_num_cpus_per_rank=1,
        num_engines=2,
        gpus_per_engine=2,
        cpus_per_engine=1,
        use_gpus=False,
    )
    engine = EngineConfig(api_key=TOKEN, max_running_requests=8)
    cluster = await Cluster.start(
        backend=SGLangBackend(fleet, engine),
        num_engines=2,
        model_dir=model,
        version=0,
        seed=1,
        router_cfg=RouterConfig(api_key=TOKEN),
        rollout_cores=(),
        slots=placement.engines,
    )
    try:
        recs = _records(record)
        assert len(recs) == 2
        for rec in recs:
            argv = rec["argv"]
            assert argv[argv.index("--tp-size") + 1] == "2"
            assert argv[argv.index("--cuda-graph-max-bs") + 1] == "8"
            assert argv[-2:] == ["--api-key", TOKEN]  # added inside the process ...
            assert TOKEN not in rec["cmdline"]  # ... never on its command line
        assert sorted(cluster.engine_pids) == sorted(r["pid"] for r in recs)
        assert await _generate(cluster.router_url) == 401  # the router asks for the key ...
        assert await _generate(cluster.router_url, TOKEN) == 200  # ... and presents it
        assert await _generate(cluster.engine_urls[0]) == 401
        assert await _generate(cluster.engine_urls[0], TOKEN) == 200

        old = cluster.engine_pids[0]
        new_url = await cluster.replace_engine(0, model_dir=model, version=1)
        assert _wait_gone(old), "the replaced SGLang server outlived its replacement"
        assert new_url == cluster.engine_urls[0] and await _generate(new_url, TOKEN) == 200

        # an actor killed without stop(): its server gets the parent-death signal
        victim = cluster.engines[1]
        ray.kill(victim.ref)
        assert _wait_gone(victim.pid), "SGLang server orphaned by a killed actor"
        assert not await cluster.engine_alive(1)
    finally:
        pids = [p for p in cluster.engine_pids if p]
        await cluster.stop()
        placement.remove()
    assert all(_wait_gone(p) for p in pids)


def _server(tmp_path: Path, **env: str) -> SGLangServer:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(env)
    return SGLangServer(
        SGLangConfig(model_path=str(tmp_path), port=port), log_path=str(tmp_path / "server.log")
    )


def test_health_timeout_is_a_clear_error_and_leaves_nothing(fake_sglang, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_HANG", "1")
    srv = _server(tmp_path)
    with pytest.raises(RuntimeError, match=r"did not answer /health within 3 s") as e:
        srv.start(timeout=3)
    assert "--engine-start-timeout" in str(e.value) and "server.log" in str(e.value)
    assert srv.proc is not None and _wait_gone(srv.proc.pid)


def test_server_exiting_early_reports_its_log(fake_sglang, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_EXIT", "1")
    srv = _server(tmp_path)
    with pytest.raises(RuntimeError, match="exited with code 3") as e:
        srv.start(timeout=60)
    assert "CUDA out of memory (simulated)" in str(e.value)


def test_a_port_something_else_holds_is_a_port_taken_error(fake_sglang, tmp_path):
    """Another process took the server's port after it was chosen and answers it with bytes
    that are not HTTP (a gloo socket, say): the health poll waits for the server instead of
    failing on them, and the server's failed bind is a `PortTakenError`, which the launching
    actor answers with another port."""
    import socket
    import threading

    from slime_async.engine.sglang import PortTakenError

    _, model = fake_sglang
    srv = _server(tmp_path)
    srv = SGLangServer(
        dataclasses.replace(srv.cfg, model_path=str(model)), log_path=str(tmp_path / "s.log")
    )
    with socket.socket() as occupier:
        occupier.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        occupier.bind(("127.0.0.1", srv.cfg.port))
        occupier.listen()

        def garble() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = occupier.accept()
                    with conn:
                        conn.sendall(b"\x00\x01@\xfe not http\r\n\r\n")

        threading.Thread(target=garble, daemon=True).start()
        with pytest.raises(PortTakenError, match=r"(?i)address already in use"):
            srv.start(timeout=60)


def test_train_async_with_sglang_backend(fake_sglang, tmp_path: Path) -> None:
    """The docs/cluster.md launch path end to end on CPU: --engine-backend sglang, TP per engine,
    --sglang-* pass-through, the shared token, two steps."""
    import subprocess
    import sys

    record, _ = fake_sglang
    run_dir = tmp_path / "run"
    env = {**os.environ, "SLIME_ASYNC_AUTH_TOKEN": TOKEN, "RAY_ADDRESS": "local"}
    argv = [
        sys.executable,
        "train_async.py",
        "--engine-backend",
        "sglang",
        "--rollout-num-gpus",
        "2",
        "--rollout-num-gpus-per-engine",
        "2",
        "--sglang-cuda-graph-max-bs",
        "16",
        "--run-dir",
        str(run_dir),
        "--num-steps",
        "2",
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
        # the stand-in SGLang is our CPU engine: the weight group runs over gloo, not NCCL
        "--update-weight-backend",
        "gloo",
    ]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=280)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    said = [x.split(": ", 1)[1] for x in res.stderr.splitlines() if " start-up: " in x]
    assert any(x.startswith("start-up: starting 1 engine(s) (sglang)") for x in said), said
    assert said[-1].startswith("start-up: done in "), said
    recs = _records(record)
    assert len(recs) == 1
    argv_seen = recs[0]["argv"]
    assert argv_seen[argv_seen.index("--tp-size") + 1] == "2"
    assert argv_seen[argv_seen.index("--cuda-graph-max-bs") + 1] == "16"
    served = json.loads((run_dir / "served_versions.json").read_text())
    assert list(served["engines"].values()) == ["2"], served
    assert _wait_gone(recs[0]["pid"]), "the SGLang server outlived the run"
    assert TOKEN not in (run_dir / "config.json").read_text()


@pytest.fixture(autouse=True)
def _restore_env():
    keep = dict(os.environ)
    yield
    for k in ("FAKE_SGLANG_HANG", "FAKE_SGLANG_EXIT"):
        if k not in keep:
            os.environ.pop(k, None)


def _recipe_argv() -> list[str]:
    """The `python train_async.py ...` command of docs/cluster.md's GPU recipe."""
    import re
    import shlex

    text = (REPO / "docs" / "cluster.md").read_text()
    block = text.split("## GPU recipe", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmd = re.sub(r"\\\n", " ", block).split("python train_async.py", 1)[1].splitlines()[0]
    return shlex.split(cmd)


def test_the_docs_gpu_recipe_derives_what_it_says() -> None:
    """docs/cluster.md's command, validated against a 2-node cluster's environment: 4 engines
    of TP 2, 8 trainer ranks as TP 2 x DP 4, the --sglang-* flags on every server's command."""
    from slime_async.config import build_parser, validate
    from slime_async.config.engine_fleet import split_sglang_args
    from slime_async.config.run_config import Environment
    from slime_async.contracts.engine import EngineLaunch
    from slime_async.contracts.model import ModelSpec

    argv, sglang = split_sglang_args(_recipe_argv())
    args = build_parser().parse_args(argv)
    args.sglang_args = sglang
    env = Environment(
        # the recipe's model: the published Qwen3-4B config.json (no weights needed)
        model=ModelSpec.from_hf_config(
            json.loads((REPO / "tests/data/configs/qwen3-4b/config.json").read_text())
        ),
        cpus=tuple(range(8)),
        ray_address="10.0.0.1:6379",
        auth_token=TOKEN,
    )
    cfg = validate(args, env)
    assert cfg.engines.backend == "sglang" and cfg.engines.num_engines == 4
    assert cfg.engines.gpus_per_engine == 2 and cfg.engines.start_timeout_s == 1200
    assert cfg.trainer.world_size == 8 and cfg.trainer.data_parallel_size == 4
    assert cfg.ray_address == "10.0.0.1:6379" and cfg.engine.admin_api_key == TOKEN
    assert cfg.router.admin_api_key == TOKEN and not cfg.trainer_cores  # cores: per node
    # the data-plane key the run minted: the router's and the engines', never the admin key
    assert cfg.engine.api_key == cfg.router.api_key and cfg.engine.api_key not in (None, TOKEN)
    # SGLang's radix cache is salted per push (router/cache_salt.py), and the run says so
    assert cfg.router.cache_salt and cfg.derived["--router-cache-salt"].value is True
    launch = EngineLaunch(
        index=3, model_dir=args.hf_checkpoint, weight_version=0, seed=1, host="10.0.0.2"
    )
    cmd = " ".join(build_command(sglang_config(cfg.engine, launch, port=30000, fleet=cfg.engines)))
    assert "--tp-size 2" in cmd and "--host 10.0.0.2" in cmd
    assert "--mem-fraction-static 0.8 --cuda-graph-max-bs 256" in cmd and TOKEN not in cmd


SLIME_ROUTER_FLAGS = [
    "--sglang-router-request-timeout-secs",
    "600",
    "--sglang-server-concurrency",
    "64",
    "--sglang-mem-fraction-static",
    "0.8",
]


def test_run_sglang_flags_never_reach_the_server() -> None:
    """slime's router/concurrency flags and --sglang-python are the run's: parsed as flags, only
    the rest passed through."""
    from slime_async.config.engine_fleet import split_sglang_args

    argv = [
        "--sglang-router-ip",
        "10.0.0.9",
        "--sglang-router-port=30000",
        *SLIME_ROUTER_FLAGS,
        "--sglang-python",
        "/opt/sglang/bin/python",
    ]
    rest, forwarded = split_sglang_args(argv)
    assert forwarded == ("--mem-fraction-static", "0.8")
    assert rest == [a for a in argv if a not in ("--sglang-mem-fraction-static", "0.8")]
    cfg = parse_config(["--engine-backend", "sglang", "--num-engines", "2", *SLIME_ROUTER_FLAGS])
    assert cfg.engines.sglang_args == ("--mem-fraction-static", "0.8")
    assert cfg.router.request_timeout_s == 600  # slime's name for --router-request-timeout-s
    assert cfg.data_worker.max_inflight == 128  # 64 per server x 2 engines
    assert "--sglang-server-concurrency 64 x 2" in cfg.derived["--max-inflight"].why


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--sglang-router-ip", "10.0.0.9"], ("own work-aware router", "--engine-urls")),
        (["--sglang-router-port", "30000"], ("--sglang-router-port 30000", "external")),
        (
            ["--sglang-server-concurrency", "64", "--max-inflight", "100"],
            ("--max-inflight 100 contradicts --sglang-server-concurrency 64", "one of the two"),
        ),
        (["--sglang-python", "/nonexistent/bin/python"], ("does not exist", "/opt/sglang")),
        (["--sglang-python", str(REPO / "README.md")], ("is not executable",)),
    ],
)
def test_run_sglang_flags_refused_with_the_fix(argv, needles, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--engine-backend", "sglang", *argv])
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err


def test_sglang_python_only_with_the_sglang_backend(capsys) -> None:
    import sys

    with pytest.raises(SystemExit):
        parse_config(["--sglang-python", sys.executable])
    assert "--engine-backend sglang" in capsys.readouterr().err


def test_tokenizer_is_on_unless_there_is_none_or_the_user_decides(tmp_path: Path) -> None:
    """No --skip-tokenizer-init of ours when a tokenizer exists: --hf-checkpoint's when the
    server starts on the trainer's export, the checkpoint's own otherwise."""
    from slime_async.contracts.engine import EngineLaunch

    export = tmp_path / "weights" / "v000000"
    export.mkdir(parents=True)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")

    def flags(model_dir: Path, **fleet: object) -> list[str]:
        launch = EngineLaunch(index=0, model_dir=str(model_dir), weight_version=0, seed=1)
        f = EngineFleetConfig(backend="sglang", **fleet)  # type: ignore[arg-type]
        return build_command(sglang_config(EngineConfig(), launch, port=30000, fleet=f))

    cmd = flags(export, tokenizer_path=str(hf))
    assert "--skip-tokenizer-init" not in cmd
    assert cmd[cmd.index("--tokenizer-path") + 1] == str(hf)
    cmd = flags(hf, tokenizer_path=str(hf))  # starts on --hf-checkpoint itself
    assert "--skip-tokenizer-init" not in cmd and "--tokenizer-path" not in cmd
    cmd = flags(export)  # a model built from its spec: no tokenizer anywhere
    assert "--skip-tokenizer-init" in cmd and "--tokenizer-path" not in cmd
    cmd = flags(export, tokenizer_path=str(tmp_path / "hf-without-tokenizer"))
    assert "--skip-tokenizer-init" in cmd and "--tokenizer-path" not in cmd
    cmd = flags(export, tokenizer_path=str(hf), sglang_args=("--skip-tokenizer-init",))
    assert cmd.count("--skip-tokenizer-init") == 1 and "--tokenizer-path" not in cmd
    cmd = flags(export, sglang_args=("--tokenizer-path", "/t"))
    assert "--skip-tokenizer-init" not in cmd and cmd.count("--tokenizer-path") == 1
    cfg = parse_config(["--engine-backend", "sglang", "--sglang-skip-tokenizer-init"])
    assert cfg.engines.sglang_args == ("--skip-tokenizer-init",)


def test_sglang_python_runs_the_server(fake_sglang, tmp_path: Path) -> None:
    """--sglang-python names the interpreter of the server: a wrapper that records its call,
    then execs Python; the server (stand-in) comes up through the token shim."""
    import socket
    import sys

    from slime_async.contracts.engine import EngineLaunch

    record, model = fake_sglang
    called = tmp_path / "wrapper_called"
    wrapper = tmp_path / "sglang-venv" / "bin" / "python"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\necho "$@" > {called}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    cfg = parse_config(["--engine-backend", "sglang", "--sglang-python", str(wrapper)])
    assert cfg.engines.sglang_python == str(wrapper)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = EngineLaunch(index=0, model_dir=str(model), weight_version=0, seed=1)
    sg = sglang_config(EngineConfig(api_key=TOKEN), launch, port=port, fleet=cfg.engines)
    srv = SGLangServer(sg, log_path=str(tmp_path / "server.log"))
    try:
        srv.start(timeout=120)
        assert called.read_text().split()[:2] == [
            str(REPO / "slime_async/engine/sglang_launch.py"),
            "sglang.launch_server",
        ]
        (rec,) = _records(record)
        assert rec["argv"][-2:] == ["--api-key", TOKEN] and TOKEN not in rec["cmdline"]
    finally:
        srv.stop()


def test_token_shim_needs_only_the_standard_library(tmp_path: Path) -> None:
    """The shim run by path under `python -S` (no site-packages: nothing of this project's
    environment), with this repository's `slime_async/engine/sglang.py` next to it not shadowing `sglang`."""
    import subprocess
    import sys

    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text("import sys; print(' '.join(sys.argv[1:]))\n")
    shim = REPO / "slime_async/engine/sglang_launch.py"
    env = {
        "PATH": os.environ["PATH"],
        "SLIME_ASYNC_SGLANG_API_KEY": "k",
        "SLIME_ASYNC_SGLANG_ADMIN_API_KEY": "a",
    }
    res = subprocess.run(
        [sys.executable, "-S", str(shim), "sglang.launch_server", "--port", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["--port", "1", "--api-key", "k", "--admin-api-key", "a"]


def test_sleep_and_wake_pass_through_the_sglang_launcher(fake_sglang, tmp_path: Path) -> None:
    """--engine-sleep starts SGLang with its memory saver (and the weights' CPU backup), and
    SGLang's release/resume routes reach the server the launcher started."""
    import asyncio

    from slime_async.contracts.engine import EngineLaunch

    record, model = fake_sglang
    fleet = EngineFleetConfig(backend="sglang", engine_sleep=True)
    launch = EngineLaunch(index=0, model_dir=str(model), weight_version=0, seed=1, host=None)
    cfg = sglang_config(
        EngineConfig(dtype="fp32"), launch, port=_server(tmp_path).cfg.port, fleet=fleet
    )
    assert {"--enable-memory-saver", "--enable-weights-cpu-backup"} <= set(build_command(cfg))
    off = sglang_config(
        EngineConfig(), launch, port=30000, fleet=EngineFleetConfig(backend="sglang")
    )
    assert "--enable-memory-saver" not in build_command(off)
    srv = SGLangServer(cfg, log_path=str(tmp_path / "server.log"))
    url = srv.start(timeout=120)

    async def sleep_wake() -> None:
        async with aiohttp.ClientSession() as s:
            level2 = {"tags": ["kv_cache", "weights"]}
            async with s.post(url + "/release_memory_occupation", json=level2) as r:
                assert r.status == 200 and await r.json() is None
            async with s.post(url + "/generate", json=GEN) as r:
                assert r.status == 503
            async with s.post(url + "/resume_memory_occupation", json=level2) as r:
                assert r.status == 200
            async with s.post(url + "/generate", json=GEN) as r:
                assert r.status == 200

    try:
        asyncio.run(sleep_wake())
        argv = _records(record)[-1]["argv"]
        assert "--enable-memory-saver" in argv and "--enable-weights-cpu-backup" in argv
    finally:
        srv.stop()


def test_colocated_train_async_with_sglang_backend(fake_sglang, tmp_path: Path) -> None:
    """slime's `--colocate` with SGLang servers: each server starts with its memory saver, and
    every train step releases it (level 2: weights and KV cache) while the trainer trains and
    resumes it after the trainer offloaded; the server itself reports each state."""
    import subprocess
    import sys

    from slime_async.orchestrator.colocate import read_events
    from tests.test_colocate import TURN, check_turns

    record, _ = fake_sglang
    run_dir = tmp_path / "run"
    env = {**os.environ, "SLIME_ASYNC_AUTH_TOKEN": TOKEN, "RAY_ADDRESS": "local"}
    argv = [
        *(sys.executable, "train_async.py", "--engine-backend", "sglang", "--colocate"),
        *("--rollout-num-gpus", "1", "--run-dir", str(run_dir), "--num-steps", "2"),
        *("--warmstart-steps", "0", "--eval-interval", "0", "--rollout-batch-size", "2"),
        *("--n-samples-per-prompt", "2", "--rollout-max-response-len", "8"),
        *("--micro-batch-size", "2", "--update-weight-backend", "gloo", "--max-staleness", "0"),
    ]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=280)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    assert "derived: --engine-sleep True" in res.stderr
    (rec,) = _records(record)
    assert {"--enable-memory-saver", "--enable-weights-cpu-backup"} <= set(rec["argv"])
    events = read_events(run_dir)
    check_turns(events, [1, 2])
    assert [e["event"] for e in events[9:]] == TURN[1:3]  # the final save's onload, offload
    served = json.loads((run_dir / "served_versions.json").read_text())
    assert list(served["engines"].values()) == ["2"], served
    assert _wait_gone(rec["pid"]), "the SGLang server outlived the run"
