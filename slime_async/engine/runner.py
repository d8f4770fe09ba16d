"""Ways to run an embedded engine: in-process (its own thread and event loop), or as a child
process (`python -m slime_async.engine`), each with `start() -> url` and `stop()`.

Owns: `serve` (the coroutine that loads the model, binds, serves until told to stop),
`EngineServer` (in-process; for tests and Ray actors), `EngineProcess` (subprocess launcher
that waits for `/health`) and `config_to_argv`. Must never import Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from clifields import flag_name, flag_specs
from router.access import ADMIN_KEY_ENV, API_KEY_ENV
from slime_async.engine.config import EngineConfig
from slime_async.engine.engine import Engine
from slime_async.engine.server import build_app, cap_connections


async def serve(
    cfg: EngineConfig,
    stop: asyncio.Event,
    *,
    on_ready: Callable[[Engine, int], None] | None = None,
) -> None:
    """Load the model, bind `cfg.host:cfg.port`, serve until `stop` is set, then shut down."""
    engine = Engine(cfg)
    await engine.start()
    runner = web.AppRunner(
        build_app(engine),
        handle_signals=False,
        access_log=None,
        keepalive_timeout=cfg.client_timeout_s,  # also closes a connection sending no request
    )
    await runner.setup()
    cap_connections(runner, cfg.max_connections)
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = runner.addresses[0][1]
        engine.bound_port = port
        if on_ready is not None:
            on_ready(engine, port)
        await stop.wait()
    finally:
        await engine.stop()
        await runner.cleanup()


def write_port_file(path: str, port: int) -> None:
    """Atomically write `port` to `path` (temp file + rename)."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


class EngineServer:
    """An engine served from a background thread of this process.

    >>> srv = EngineServer(EngineConfig(dtype="fp32"))   # doctest: +SKIP
    >>> url = srv.start()                                 # 'http://127.0.0.1:PORT'
    >>> srv.stop()
    """

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.engine: Engine | None = None
        self.port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EngineServer is not started; call start() first")
        return f"http://{self.cfg.host}:{self.port}"

    def start(self, timeout: float = 300.0) -> str:
        """Start serving; returns the base URL once the model is loaded and the port bound."""
        if self._thread is not None:
            raise RuntimeError("EngineServer already started")
        self._thread = threading.Thread(target=self._run, name="embedded-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"embedded engine did not start within {timeout}s")
        if self._error is not None:
            raise RuntimeError(f"embedded engine failed to start: {self._error!r}") from self._error
        return self.url

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop

        def ready(engine: Engine, port: int) -> None:
            self.engine, self.port = engine, port
            self._ready.set()

        async def main() -> None:
            self._stop = asyncio.Event()
            await serve(self.cfg, self._stop, on_ready=ready)

        try:
            loop.run_until_complete(main())
        except BaseException as e:  # surface start-up errors to start()
            self._error = e
        finally:
            self._ready.set()
            loop.close()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort in-flight requests, close the server, join the thread. Idempotent."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> EngineServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def config_to_argv(cfg: EngineConfig) -> list[str]:
    """Command-line flags of `python -m slime_async.engine` that reproduce `cfg`: one per field
    that differs from its default, spelled as `add_engine_args` spells it (`clifields`), plus
    `--model-spec` JSON. The token never goes on the command line (`EngineProcess` passes it in
    the environment)."""
    argv: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        spec = flag_specs(EngineConfig)[f.name]
        value = getattr(cfg, f.name)
        if not spec.cli or value == f.default:
            continue
        name = flag_name(EngineConfig, f.name)
        if isinstance(value, bool):
            argv.append(name if value else (spec.off or ("--no-" + name[2:],))[0])
        elif value is None:
            raise ValueError(f"{name} cannot be set back to None on the command line")
        else:
            argv += [name, str(value)]
    if cfg.model_spec is not None:  # build the architecture (weights come by the transport)
        argv += ["--model-spec", json.dumps(cfg.model_spec, separators=(",", ":"))]
    return argv


def wait_healthy(
    url: str,
    *,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    token: str | None = None,
) -> None:
    """Poll `GET url/health` (with the bearer `token`, if any) until 200; raise if `proc` exits
    or `timeout` passes."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with code {proc.returncode} before healthy")
        try:
            req = urllib.request.Request(f"{url}/health", headers=headers)
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
            pass  # not up yet, or something else answers its port (it then fails to bind)
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health not ready within {timeout}s")


class EngineProcess:
    """`python -m slime_async.engine` as a child process; `start()` waits for `/health`."""

    def __init__(
        self,
        cfg: EngineConfig,
        *,
        extra_args: list[str] | None = None,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.cfg, self.extra_args, self.log_path = cfg, extra_args or [], log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = None

    def start(self, timeout: float = 300.0) -> str:
        if self.proc is not None:
            raise RuntimeError("EngineProcess already started")
        with tempfile.TemporaryDirectory(prefix="engine-port-") as d:
            port_file = str(Path(d) / "port")
            cmd = [sys.executable, "-m", "slime_async.engine", *config_to_argv(self.cfg)]
            cmd += [*self.extra_args, "--port-file", port_file]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", **(self.env or {})}
            # the keys travel through the environment: argv is visible in `ps`
            for var, key in (
                (API_KEY_ENV, self.cfg.api_key),
                (ADMIN_KEY_ENV, self.cfg.admin_api_key),
            ):
                env.pop(var, None)
                if key:
                    env[var] = key
            if self.log_path:  # the child holds its own copy of the log's fd
                with open(self.log_path, "ab") as out:
                    self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            else:
                self.proc = subprocess.Popen(
                    cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env
                )
            try:
                return self._await_start(port_file, time.monotonic() + timeout, timeout)
            except BaseException:  # never leave a child running behind a failed start
                self.stop(timeout=5.0)
                raise

    def _await_start(self, port_file: str, deadline: float, timeout: float) -> str:
        """Wait for the child to write its port, then for `/health`."""
        assert self.proc is not None
        while not os.path.exists(port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine process exited with code {self.proc.returncode} during start-up"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"engine process did not bind within {timeout}s")
            time.sleep(0.05)
        port = int(Path(port_file).read_text())
        self.url = f"http://{self.cfg.host}:{port}"
        wait_healthy(
            self.url,
            timeout=max(1.0, deadline - time.monotonic()),
            proc=self.proc,
            token=self.cfg.api_key,
        )
        return self.url

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (graceful: in-flight requests are aborted), then SIGKILL after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
