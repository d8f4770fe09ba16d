"""Real HTTP test engines for the router's tests and benchmarks (no model, real sockets).

One responsibility, the fake engine the router is tested and benchmarked against. Owns:
`FakeEngineConfig`, `FakeEngine` (an aiohttp server speaking the SGLang routes the router
uses, whose service time grows with requested tokens and with concurrency), `EngineProcess`
(the same engine(s) in a child process that can be SIGKILLed), and `python -m router.testing`.
Service model, per engine: requests run in lock-step "decode steps"; one step advances every
active request by `tokens_per_step` tokens and takes `step_s + per_seq_s * n_active` seconds
(a fluid model over wall time, accounted piecewise between arrivals and completions, so a
late wake-up on a busy CPU delays answers but does not change how much work was done by when).
So a request of L tokens alone takes L / tokens_per_step * (step_s + per_seq_s) seconds.
With `prefill_cost` > 0 a request first works off its prompt: every prompt token not found in
the engine's prefix cache (an LRU of 16-token pages, at most `cache_tokens`, keyed by the page
and everything before it, as SGLang's radix cache shares only whole prefixes) costs
`prefill_cost` decode tokens of its share; the prompt is `input_ids`, or `text` split on
whitespace.
Responses are deterministic functions of the request (no timestamps), so pass-through can be
checked byte for byte.
Must never import: `slime_async`, or the router's server/proxy modules (engines are independent);
the control routes it serves are the router's own list (`router.control.CONTROL_PATHS`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

from aiohttp import web

from router.control import CONTROL_PATHS


@dataclass(frozen=True, kw_only=True, slots=True)
class FakeEngineConfig:
    """Behaviour of one test engine."""

    name: str = "engine"
    """Label echoed in `meta_info.engine` so tests can see who answered."""
    step_s: float = 0.002
    """Fixed time of one decode step."""
    per_seq_s: float = 0.0
    """Extra step time per active request (service time grows with concurrency)."""
    tokens_per_step: int = 1
    """Tokens every active request gains per step."""
    default_max_new_tokens: int = 16
    """Output length when the request sets no `max_new_tokens` / `max_tokens`."""
    num_layers: int = 2
    """Layer axis of the synthetic `routed_experts` array."""
    topk: int = 2
    """Top-k axis of the synthetic `routed_experts` array."""
    weight_version: str = "default"
    """Initial `meta_info.weight_version`."""
    prefill_cost: float = 0.0
    """Decode-token work of prefilling one uncached prompt token (0: prefill is free)."""
    cache_tokens: int = 0
    """Prefix-cache budget in tokens (whole pages; least recently used dropped first); 0: no
    cache, every prompt token is prefilled."""


PAGE = 16
"""Prefix-cache page of the fake engines (tokens)."""


class PageCache:
    """LRU prefix cache over 16-token pages; a page is keyed by itself and every page before it.

    >>> c = PageCache(64); c.insert(list(range(40))); c.match(list(range(40)) + [9])
    32
    """

    def __init__(self, budget_tokens: int) -> None:
        self.budget_pages = budget_tokens // PAGE
        self._pages: collections.OrderedDict[int, None] = collections.OrderedDict()

    @staticmethod
    def _keys(tokens: list) -> list[int]:
        keys, h = [], 0
        for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
            h = hash((h, tuple(tokens[i : i + PAGE])))
            keys.append(h)
        return keys

    def match(self, tokens: list) -> int:
        """Cached prefix length of `tokens` (whole pages, never the last token)."""
        n = 0
        for k in self._keys(tokens[:-1]):
            if k not in self._pages:
                break
            self._pages.move_to_end(k)
            n += PAGE
        return n

    def insert(self, tokens: list) -> None:
        for k in self._keys(tokens):
            self._pages[k] = None
            self._pages.move_to_end(k)
        while len(self._pages) > self.budget_pages:
            self._pages.popitem(last=False)


def _routed_experts(rid: str, rows: int, layers: int, topk: int) -> str:
    """Deterministic base64 little-endian int32 array of shape [rows, layers, topk]."""
    seed = sum(rid.encode()) % 97
    vals = [(seed + i) % 8 for i in range(rows * layers * topk)]
    return base64.b64encode(struct.pack(f"<{len(vals)}i", *vals)).decode()


@dataclass(slots=True)
class _Job:
    rid: str
    target: int
    done: asyncio.Future
    arrived: float
    work: float = 0.0
    """Tokens produced so far (fractional: progress is computed from elapsed time)."""
    generated: int = 0
    prefill: float = 0.0
    """Work (decode tokens) of the uncached prompt, done before the first output token."""
    cached: int = 0
    """Prompt tokens found in the prefix cache."""
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False


class FakeEngine:
    """An SGLang-API-shaped HTTP engine for tests. `await start()` returns its url."""

    def __init__(self, cfg: FakeEngineConfig = FakeEngineConfig(), *, port: int = 0) -> None:
        self.cfg = cfg
        self.port = port
        self.weight_version = cfg.weight_version
        self.healthy = True
        self.health_delay_s = 0.0
        """Seconds `/health` and `/health_generate` take to answer (a loaded node)."""
        self.fail_status: int | None = None
        """When set, every generate request answers this HTTP status (e.g. 500)."""
        self.paused = False
        self.requests: list[dict] = []
        """Every generate request body received (parsed), in arrival order."""
        self.headers_seen: list[dict[str, str]] = []
        self.control_calls: list[tuple[str, object]] = []
        self.tokens_served = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        """Prompt tokens received, and those found in the prefix cache."""
        self.cache = PageCache(cfg.cache_tokens) if cfg.cache_tokens > 0 else None
        self.last_arrival = self.last_finish = 0.0
        """`time.monotonic()` (system-wide clock) of the latest arrival and completion."""
        self._jobs: list[_Job] = []
        self._wake = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task | None = None
        self._last = 0.0
        """Event-loop time up to which the active requests' progress is accounted."""
        self.url = ""

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind 127.0.0.1:`port` (0 = ephemeral) and return the base url."""
        app = web.Application()
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._generate)
        app.router.add_put("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health_generate)
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
            app.router.add_get(path, self._info)
        app.router.add_get("/get_load", self._load)
        app.router.add_get("/v1/loads", self._load)
        app.router.add_get("/v1/models", self._models)
        for path in CONTROL_PATHS:  # the routes the router fans out, nothing else
            app.router.add_post(path, self._control)
        app.router.add_get("/flush_cache", self._control)
        # like SGLang, a request whose client disconnects is aborted (handler cancelled)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop_task = asyncio.create_task(self._step_loop())
        return self.url

    async def stop(self) -> None:
        """Stop serving (in-flight requests are cut off)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._runner is not None:
            await self._runner.shutdown()
            await self._runner.cleanup()
            self._runner = None

    # --- service model ----------------------------------------------------------------------
    async def _step_loop(self) -> None:
        """Fluid version of the step model, exact whatever the CPU does: progress is computed
        from elapsed wall time piecewise between events (an arrival, a finish), each piece at the
        rate of the requests active during it, so a late wake-up (a busy CPU) does not change how
        much work was done by when; it only delays the answers."""
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        while True:
            if not self._jobs or not self._unpaused.is_set():
                if not self._jobs:
                    self._wake.clear()
                    await self._wake.wait()  # an arrival accounts up to its own time
                await self._unpaused.wait()  # continuing resets the clock (no work while paused)
                continue
            step = self.cfg.step_s + self.cfg.per_seq_s * len(self._jobs)
            if step <= 0:  # infinitely fast engine: everything finishes on this turn
                await asyncio.sleep(0)
                for job in list(self._jobs):
                    job.work, job.generated = job.target + job.prefill, job.target
                    self._finish(job)
                self._last = loop.time()
                continue
            rate = self.cfg.tokens_per_step / step  # tokens per second per active request
            soonest = min(j.target + j.prefill - j.work for j in self._jobs) / rate
            self._wake.clear()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(min(step, soonest), 0.0))
            self._advance_to(loop.time())

    def _advance_to(self, now: float) -> None:
        """Advance every active request from `self._last` to `now`, piece by piece: within a
        piece the active set is fixed; a piece ends when the next request completes."""
        if not self._unpaused.is_set():
            self._last = now
            return
        t = self._last
        while self._jobs and t < now:
            step = self.cfg.step_s + self.cfg.per_seq_s * len(self._jobs)
            if step <= 0:
                break
            rate = self.cfg.tokens_per_step / step
            dt = min(now - t, min(j.target + j.prefill - j.work for j in self._jobs) / rate)
            t += dt
            for job in list(self._jobs):
                total = job.target + job.prefill
                job.work = min(total, job.work + rate * dt + 1e-9)
                job.generated = min(job.target, max(0, int(job.work - job.prefill)))
                job.progress.set()
                if job.work >= total - 1e-6:
                    job.generated = job.target
                    self._finish(job)
        self._last = now

    def _finish(self, job: _Job, *, aborted: bool = False) -> None:
        self.last_finish = time.monotonic()
        job.aborted = aborted
        job.progress.set()
        if job in self._jobs:
            self._jobs.remove(job)
        if not job.done.done():
            job.done.set_result(None)

    def outstanding_tokens(self) -> int:
        """Tokens still to generate on this engine."""
        return sum(j.target - j.generated for j in self._jobs)

    # --- handlers ---------------------------------------------------------------------------
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers_seen.append(dict(request.headers))
        if self.fail_status is not None:
            return web.json_response({"error": "injected failure"}, status=self.fail_status)
        await self._unpaused.wait()
        openai = request.path.startswith("/v1/")
        if openai:
            target = int(body.get("max_tokens") or self.cfg.default_max_new_tokens)
            prompt_len = len(str(body.get("prompt", body.get("messages", ""))))
        else:
            sp = body.get("sampling_params") or {}
            target = int(sp.get("max_new_tokens") or self.cfg.default_max_new_tokens)
            prompt_len = len(body.get("input_ids") or str(body.get("text", "")))
        rid = str(body.get("rid") or f"r{len(self.requests)}")
        loop = asyncio.get_running_loop()
        self.last_arrival = time.monotonic()
        job = _Job(rid=rid, target=max(target, 1), done=loop.create_future(), arrived=loop.time())
        if self.cfg.prefill_cost > 0 and not openai:
            prompt = body.get("input_ids") or str(body.get("text", "")).split()
            hit = self.cache.match(prompt) if self.cache is not None else 0
            if self.cache is not None:
                self.cache.insert(prompt)
            self.prompt_tokens += len(prompt)
            self.cached_tokens += hit
            job.prefill = (len(prompt) - hit) * self.cfg.prefill_cost
            job.cached = hit
        self._advance_to(job.arrived)  # the requests before it ran at the old rate until now
        self._jobs.append(job)
        self._wake.set()
        if body.get("stream") and not openai:
            return await self._stream(request, job, body, prompt_len)
        try:
            await job.done
        finally:
            self._finish(job)
        self.tokens_served += job.generated
        if openai:
            return web.json_response(self._openai_body(request.path, job))
        return web.json_response(self._generate_body(job, body, prompt_len))

    async def _stream(self, request, job: _Job, body: dict, prompt_len: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while not job.done.done():
                job.progress.clear()
                await job.progress.wait()
                chunk = self._generate_body(job, body, prompt_len)
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        finally:
            self._finish(job)
        self.tokens_served += job.generated
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _generate_body(self, job: _Job, body: dict, prompt_len: int) -> dict:
        out = [(7 * i + len(job.rid)) % 1000 for i in range(job.generated)]
        done = job.generated >= job.target or job.aborted
        if job.aborted:
            finish = {"type": "abort", "message": "aborted", "status_code": None, "err_type": None}
        else:
            finish = {"type": "length", "length": job.target} if done else None
        meta = {
            "id": job.rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_len,
            "completion_tokens": job.generated,
            "cached_tokens": job.cached,
            "weight_version": self.weight_version,
            "engine": self.cfg.name,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
        if body.get("return_routed_experts"):
            rows = max(prompt_len + job.generated - 1, 0)
            meta["routed_experts"] = _routed_experts(
                job.rid, rows, self.cfg.num_layers, self.cfg.topk
            )
        return {"text": " ".join(map(str, out)), "output_ids": out, "meta_info": meta}

    def _openai_body(self, path: str, job: _Job) -> dict:
        text = " ".join(str(i) for i in range(job.generated))
        choice: dict = {"index": 0, "finish_reason": "length"}
        if path.endswith("chat/completions"):
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": job.rid,
            "object": "chat.completion" if "chat" in path else "text_completion",
            "model": "fake",
            "choices": [choice],
            "usage": {"completion_tokens": job.generated, "engine": self.cfg.name},
        }

    async def _health(self, _request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        return web.Response(status=200 if self.healthy else 503)

    async def _health_generate(self, _request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        ok = self.healthy and self.fail_status is None
        return web.Response(status=200 if ok else 503)

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "fake-engine",
                "served_model_name": "fake",
                "tokenizer_path": None,
                "is_generation": True,
                "weight_version": self.weight_version,
                "engine": self.cfg.name,
                "tokens_served": self.tokens_served,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "last_arrival": self.last_arrival,
                "last_finish": self.last_finish,
                "version": "fake",
                "internal_states": [{}],
            }
        )

    async def _load(self, _request: web.Request) -> web.Response:
        n, t = len(self._jobs), self.outstanding_tokens()
        return web.json_response(
            [{"dp_rank": 0, "num_reqs": n, "num_waiting_reqs": 0, "num_tokens": t}]
        )

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _control(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        path = request.path
        self.control_calls.append((path, body))
        if path == "/pause_generation":
            self.paused = True
            self._advance_to(asyncio.get_running_loop().time())  # work done up to the pause
            self._unpaused.clear()
            if body.get("mode", "abort") == "abort":
                for job in list(self._jobs):
                    self._finish(job, aborted=True)
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":
            self.paused = False
            self._last = asyncio.get_running_loop().time()  # nothing was done while paused
            self._unpaused.set()
            return web.json_response(
                {"message": "Generation continued successfully.", "status": "ok"}
            )
        if path == "/update_weights_from_disk":
            if "missing" in str(body.get("model_path", "")):
                return web.json_response(
                    {"success": False, "message": "model_path does not exist"}, status=400
                )
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        if path == "/update_weight_version":
            self.weight_version = str(body["new_version"])
            return web.json_response(
                {"success": True, "message": "ok", "new_version": self.weight_version}
            )
        if path == "/abort_request":
            for job in list(self._jobs):
                if body.get("abort_all") or job.rid == body.get("rid"):
                    self._finish(job, aborted=True)
            return web.Response(status=200)
        if self.cache is not None:  # /flush_cache
            self.cache = PageCache(self.cfg.cache_tokens)
        return web.Response(text="Cache flushed.\n")


class EngineProcess:
    """Fake engines served by a child process (`python -m router.testing`), killable for real.

    Example:
        >>> p = EngineProcess.spawn(count=2, step_s=0.001)   # doctest: +SKIP
        >>> p.urls                                            # doctest: +SKIP
        ['http://127.0.0.1:40001', 'http://127.0.0.1:40002']
        >>> p.kill()                                          # doctest: +SKIP
    """

    def __init__(self, proc: subprocess.Popen, urls: list[str]) -> None:
        self.proc = proc
        self.urls = urls

    @classmethod
    def spawn(
        cls,
        *,
        count: int = 1,
        ports: list[int] | None = None,
        timeout: float = 30.0,
        quiet: bool = False,
        **cfg,
    ) -> EngineProcess:
        """Start `count` engines (or one per entry of `ports`) with `FakeEngineConfig(**cfg)`;
        `quiet` drops the child's stderr (aiohttp logs each rejected HTTP/2 probe there)."""
        ports = ports or [0] * count
        cmd = [sys.executable, "-m", "router.testing", "--ports", *map(str, ports)]
        cmd += ["--config", json.dumps(cfg)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        stderr = subprocess.DEVNULL if quiet else None
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY ") or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"fake engine process failed to start: {line!r}")
        return cls(proc, line.split()[1:])

    def kill(self) -> None:
        """SIGKILL the process (a crash: sockets reset, no goodbye)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


async def _serve(ports: list[int], cfg: dict) -> None:
    engines = []
    for i, port in enumerate(ports):
        c = FakeEngineConfig(**{"name": f"engine{i}", **cfg})
        engines.append(FakeEngine(c, port=port))
    urls = [await e.start() for e in engines]
    print("READY " + " ".join(urls), flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    """CLI: serve fake engines until killed; prints `READY url...` once listening."""
    ap = argparse.ArgumentParser(description="Fake SGLang-API engines for router tests.")
    ap.add_argument("--ports", type=int, nargs="+", default=[0], help="One engine per port.")
    ap.add_argument("--config", default="{}", help="JSON of FakeEngineConfig fields.")
    args = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.ports, json.loads(args.config)))


if __name__ == "__main__":
    main()
