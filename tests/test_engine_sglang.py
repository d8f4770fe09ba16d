"""The SGLang launcher: the command it builds from our config, its validation, and its process
lifecycle (start -> /health -> stop of the whole process group). The lifecycle test runs a
stand-in HTTP server script in place of SGLang (which cannot run on CPU); a `gpu` test starts
real SGLang when it is installed."""

from __future__ import annotations

import os
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from slime_async.engine.sglang import SGLangConfig, SGLangServer, build_command

pytestmark = pytest.mark.timeout(60)


def _flags(cmd: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, a in enumerate(cmd):
        if a.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_default_command_enables_routed_experts() -> None:
    cmd = build_command(SGLangConfig(model_path="/ckpt/qwen3-30b-a3b"))
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    f = _flags(cmd)
    assert f["--model-path"] == "/ckpt/qwen3-30b-a3b"
    assert f["--host"] == "127.0.0.1" and f["--port"] == "30000"
    assert "--enable-return-routed-experts" in f and f["--enable-return-routed-experts"] is None
    assert f["--tp-size"] == "1" and f["--dtype"] == "bfloat16"
    assert f["--weight-version"] == "default"
    assert "--mem-fraction-static" not in f and "--nnodes" not in f


def test_full_command_maps_every_field() -> None:
    cfg = SGLangConfig(
        model_path="/m",
        host="10.0.0.2",
        port=31000,
        tp_size=8,
        dp_size=2,
        ep_size=4,
        dtype="float16",
        mem_fraction_static=0.7,
        context_length=32768,
        max_running_requests=512,
        chunked_prefill_size=4096,
        random_seed=42,
        weight_version="0",
        enable_return_routed_experts=False,
        skip_tokenizer_init=True,
        trust_remote_code=True,
        base_gpu_id=4,
        served_model_name="policy",
        nnodes=2,
        node_rank=1,
        dist_init_addr="10.0.0.1:5000",
        disable_radix_cache=True,
        extra_args=("--cuda-graph-max-bs", "256"),
        api_key="k3y-off-the-command-line",  # off loopback a token is required
    )
    cmd = build_command(cfg)
    # the token shim is run by path: SGLang's interpreter (--sglang-python) needs only sglang
    assert cmd[1:3] == [
        str(Path(__file__).parents[1] / "slime_async/engine/sglang_launch.py"),
        "sglang.launch_server",
    ]
    assert not any("k3y" in a for a in cmd)
    f = _flags(cmd)
    assert f == {
        "--model-path": "/m",
        "--host": "10.0.0.2",
        "--port": "31000",
        "--tp-size": "8",
        "--dp-size": "2",
        "--ep-size": "4",
        "--dtype": "float16",
        "--weight-version": "0",
        "--log-level": "warning",
        "--base-gpu-id": "4",
        "--mem-fraction-static": "0.7",
        "--context-length": "32768",
        "--max-running-requests": "512",
        "--chunked-prefill-size": "4096",
        "--random-seed": "42",
        "--served-model-name": "policy",
        "--dist-init-addr": "10.0.0.1:5000",
        "--nnodes": "2",
        "--node-rank": "1",
        "--skip-tokenizer-init": None,
        "--trust-remote-code": None,
        "--disable-radix-cache": None,
        "--cuda-graph-max-bs": "256",
    }


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"model_path": ""}, "model_path is required"),
        ({"tp_size": 0}, "tp_size must be >= 1"),
        ({"tp_size": 4, "ep_size": 3}, "must divide tp_size"),
        ({"dtype": "bf16"}, "dtype must be one of"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"nnodes": 2}, "dist_init_addr"),
        ({"node_rank": 1}, "node_rank"),
        ({"extra_args": ("--tp-size", "2")}, "repeat flags"),
        ({"extra_args": ("--port=1",)}, "repeat flags"),
        ({"extra_args": ("--api-key", "x")}, "visible in `ps`"),
        ({"host": "0.0.0.0"}, "SLIME_ASYNC_API_KEY"),
        ({"api_key": "k", "admin_api_key": "k"}, "use two keys"),
        ({"extra_args": ("--admin-api-key", "x")}, "SLIME_ASYNC_AUTH_TOKEN"),
    ],
)
def test_bad_config_names_the_problem(kwargs: dict, needle: str) -> None:
    base = {"model_path": "/m"}
    with pytest.raises(ValueError, match=needle):
        SGLangConfig(**{**base, **kwargs})


FAKE_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    open(sys.argv[0] + ".args", "w").write(" ".join(args))
    # a child like SGLang's scheduler process, in the same process group
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[0] + ".child", "w").write(str(child.pid))
    time.sleep(0.3)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def test_server_lifecycle_waits_for_health_and_kills_the_group(tmp_path: Path) -> None:
    import socket

    mod = tmp_path / "fake_sglang.py"
    mod.write_text(FAKE_SERVER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = SGLangConfig(model_path="/m", port=port, launch_module="fake_sglang", weight_version="3")
    srv = SGLangServer(cfg)
    env_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tmp_path)
    try:
        url = srv.start(timeout=30)
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_before
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
        args = (tmp_path / "fake_sglang.py.args").read_text().split()
        assert "--enable-return-routed-experts" in args and "3" in args
        child = int((tmp_path / "fake_sglang.py.child").read_text())
        os.kill(child, 0)  # alive while the server runs
    finally:
        srv.stop(timeout=5)
    assert srv.proc is not None and srv.proc.poll() is not None
    import time

    for _ in range(50):  # the grandchild got the group signal too (a zombie counts as gone)
        try:
            state = Path(f"/proc/{child}/status").read_text().split("State:")[1].split()[0]
        except (FileNotFoundError, IndexError):
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("SGLang child process survived stop()")


@pytest.mark.gpu
def test_real_sglang_serves_generate(tmp_path: Path) -> None:
    pytest.importorskip("sglang")
    from slime_async.engine.config import EngineConfig
    from slime_async.engine.model import load_model

    load_model(EngineConfig(dtype="bf16")).model.save_pretrained(str(tmp_path / "m"))
    srv = SGLangServer(
        SGLangConfig(model_path=str(tmp_path / "m"), port=31234, skip_tokenizer_init=True)
    )
    url = srv.start(timeout=600)
    try:
        import json

        body = {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4},
            "return_routed_experts": True,
        }
        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            ans = json.loads(r.read())
        assert len(ans["output_ids"]) == 4 and "routed_experts" in ans["meta_info"]
    finally:
        srv.stop()
