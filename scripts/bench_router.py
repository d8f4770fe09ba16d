"""Benchmark our router against the real sglang-router binary, in the same run, on loopback.

Part 1 (overhead): trivial backends (one instant decode step). Sequential requests give the
latency p50/p99 direct to a backend, through our router and through sglang-router
(round_robin); the "added" columns subtract the direct latency. A concurrent run gives
requests/s through each.

Part 2 (makespan): heavy-tailed workloads (Pareto lengths; the client sends each request's
expected length as `X-Expected-Tokens`) submitted at once, as slime submits a rollout batch, to
backends whose service time grows with tokens and with concurrency (`router.testing` step
model: each decode step advances every active request by `tokens_per_step` tokens and takes
`step_s + per_seq_s * n_active`). Three workloads: independent requests with exactly known
lengths in random order, the same sorted longest first (the data worker's probe dispatch
order), and GRPO groups (n samples share a long prompt; the header carries the prompt's length
scale, each sample's true length varies around it; the client also sends `X-Group-Key`, one per
group, as our rollout client does). The backends model prefill and a prefix cache: every prompt
token not in an engine's LRU prefix cache costs `prefill_cost` decode tokens of work
(`router.testing.PageCache`), so a group whose samples share an engine prefills its prompt once.
Makespan = first submit to last answer;
imbalance = max / mean tokens served per engine; dispatch = submit to last arrival at an engine.
Compared: our least_expected_tokens with late binding (`@2048`: `--worker-capacity-tokens
2048`, the headline) and binding on arrival (the previous default), vs sglang-router's
round_robin, cache_aware and power_of_two (`--ours` / `--sglang` choose others). Each workload
also prints its lower bound (`lower_bound`: perfect balance at the backends' peak rate, every
distinct prompt prefilled once: perfect caching) and every router's ratio to it, so a goal below
the bound shows as such, and the share of prompt tokens each router's placement let the engines
take from their caches (`cached`).

Every router and the backends run as separate processes; all numbers come from this one run on a
shared machine, so read ratios, not absolutes. Usage:

    .venv/bin/python scripts/bench_router.py            # ~5 minutes
    .venv/bin/python scripts/bench_router.py --quick    # smaller, for a smoke check
    .venv/bin/python scripts/bench_router.py --skip-overhead --ours least_expected_tokens@1024
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from router.testing import EngineProcess


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """Sizes of the two benchmark parts."""

    latency_requests: int = 1000
    """Sequential requests per target for the latency percentiles."""
    throughput_requests: int = 2000
    """Requests per target for the throughput run."""
    throughput_concurrency: int = 32
    """Requests in flight during the throughput run."""
    engines: int = 4
    """Backends behind the routers in the makespan part."""
    num_requests: int = 200
    """Requests in the heavy-tailed workload."""
    pareto_alpha: float = 1.1
    """Tail index of the length distribution (smaller = heavier tail)."""
    min_tokens: int = 64
    """Pareto scale: the shortest response."""
    max_tokens: int = 8192
    """Length cap."""
    step_s: float = 0.0005
    """Backend decode-step base time."""
    per_seq_s: float = 0.006
    """Backend decode-step time per active request (makes per-engine work dominate, as in
    real rollouts where generation takes far longer than dispatching a batch)."""
    tokens_per_step: int = 16
    """Tokens per request per decode step."""
    repeats: int = 2
    """Makespan runs per policy and workload (median reported)."""
    group_size: int = 8
    """Samples per prompt in the GRPO workload."""
    grpo_prompt_tokens: tuple[int, int] = (512, 2048)
    """Prompt length range (uniform) of the GRPO workload, in tokens (words)."""
    prefill_cost: float = 0.2
    """Backend work of prefilling one uncached prompt token, in decode tokens (0: prefill free
    and no cache: the benchmark before prefix caching)."""
    cache_tokens: int = 16384
    """Backend prefix-cache budget per engine (tokens)."""
    seed: int = 0
    """Workload seed."""
    ours: tuple[str, ...] = ("least_expected_tokens@2048", "least_expected_tokens")
    """Our router's settings compared: `policy` binds on arrival, `policy@C` late-binds with
    `--worker-capacity-tokens C`. The first one is the headline (checked against the goal)."""
    sglang: tuple[str, ...] = ("round_robin", "cache_aware", "power_of_two")
    """sglang-router's policies compared (its best one is the reference)."""
    only: str = ""
    """Run only the workloads whose name contains this (e.g. "GRPO"); "" = all three."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProc:
    """A router child process (ours or sglang-router), stopped by PID."""

    def __init__(self, proc: subprocess.Popen, url: str, label: str, log: str = "") -> None:
        self.proc, self.url, self.label, self.log = proc, url, label, log

    @classmethod
    def ours(cls, urls: list[str], spec: str) -> RouterProc:
        """`spec` is `policy` (bind on arrival) or `policy@C` (late binding, capacity C), either
        optionally followed by `gS` (group affinity slack S tokens; default: the router's)."""
        policy, _, cap = spec.partition("@")
        policy, _, slack0 = policy.partition("g") if "@" not in spec else (policy, "", "")
        cap, _, slack = cap.partition("g")
        slack = slack or slack0
        cmd = [sys.executable, "-m", "router", "--port", "0", "--policy", policy]
        cmd += ["--worker-urls", *urls, "--health-interval-s", "2"]
        cmd += ["--worker-capacity-tokens", cap or "0"]
        if slack:
            cmd += ["--group-affinity-tokens", slack]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env())
        line = proc.stdout.readline()
        if "listening on" not in line:
            proc.kill()
            raise RuntimeError(f"our router failed to start: {line!r}")
        return cls(proc, line.split()[3], f"ours:{spec}")

    @classmethod
    def sglang(cls, urls: list[str], policy: str) -> RouterProc:
        port = _free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls]
        cmd += ["--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-level", "warn"]
        fd, log = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
        with os.fdopen(fd, "w") as f:  # it renames itself `sglang::router`; we stop it by PID
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env())
        return cls(proc, f"http://127.0.0.1:{port}", f"sglang:{policy}", log)

    async def ready(self, n_workers: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                try:
                    async with s.get(self.url + "/workers") as r:
                        body = await r.json(content_type=None)
                    healthy = [w for w in body.get("workers", []) if w.get("is_healthy")]
                    if len(healthy) == n_workers:
                        async with s.post(self.url + "/generate", json=_req(1, "warm")) as r:
                            if r.status == 200:
                                return
                except (aiohttp.ClientError, json.JSONDecodeError, ValueError):
                    pass
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    tail = Path(self.log).read_text()[-2000:] if self.log else ""
                    raise RuntimeError(
                        f"{self.label} not ready (exit code {self.proc.poll()}); log tail:\n{tail}"
                    )
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        if self.log:
            with contextlib.suppress(OSError):
                os.unlink(self.log)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _env() -> dict[str, str]:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=root)


def _req(tokens: int, text: str) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": tokens}}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


# --- part 1: overhead ------------------------------------------------------------------------
async def _latencies(url: str, n: int, *, direct_urls: list[str] | None = None) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n + 50):
            target = direct_urls[i % len(direct_urls)] if direct_urls else url
            t0 = time.perf_counter()
            async with s.post(target + "/generate", json=_req(1, f"p{i}")) as r:
                await r.read()
                assert r.status == 200, r.status
            if i >= 50:  # warm-up excluded
                out.append((time.perf_counter() - t0) * 1e3)
    return out


async def _throughput(
    url: str, n: int, conc: int, *, direct_urls: list[str] | None = None
) -> float:
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(i: int) -> None:
            target = direct_urls[i % len(direct_urls)] if direct_urls else url
            async with sem, s.post(target + "/generate", json=_req(1, f"t{i}")) as r:
                await r.read()
                assert r.status == 200, r.status

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t0)


async def overhead(cfg: BenchConfig) -> None:
    backends = EngineProcess.spawn(count=2, quiet=True, step_s=0.0, tokens_per_step=1)
    rows = []
    try:
        direct = await _latencies("", cfg.latency_requests, direct_urls=backends.urls)
        direct_tp = await _throughput(
            "", cfg.throughput_requests, cfg.throughput_concurrency, direct_urls=backends.urls
        )
        rows.append(("direct (no router)", direct, direct_tp))
        for kind, policy in (("ours", cfg.ours[0]), ("sglang", "round_robin")):
            router = await _start_router(kind, policy, backends.urls, 2)
            try:
                lat = await _latencies(router.url, cfg.latency_requests)
                tp = await _throughput(
                    router.url, cfg.throughput_requests, cfg.throughput_concurrency
                )
                rows.append((router.label, lat, tp))
            finally:
                router.stop()
    finally:
        backends.kill()
    d50, d99 = _pct(direct, 0.5), _pct(direct, 0.99)
    print("\n## Part 1: router overhead, trivial backends (ms; added = minus direct)")
    print(
        f"{'target':28s} {'p50':>7s} {'p99':>7s} {'added p50':>10s} {'added p99':>10s} {'req/s':>8s}"
    )
    for label, lat, tp in rows:
        p50, p99 = _pct(lat, 0.5), _pct(lat, 0.99)
        print(f"{label:28s} {p50:7.3f} {p99:7.3f} {p50 - d50:10.3f} {p99 - d99:10.3f} {tp:8.0f}")


async def _start_router(kind: str, policy: str, urls: list[str], n: int) -> RouterProc:
    """Start a router and wait until it routes; one retry (a racing ephemeral port)."""
    make = RouterProc.ours if kind == "ours" else RouterProc.sglang
    for attempt in range(2):
        router = make(urls, policy)
        try:
            await router.ready(n)
            return router
        except RuntimeError as e:
            router.stop()
            if attempt:
                raise
            print(f"(restarting {router.label}: {str(e).splitlines()[0]})")
    raise AssertionError("unreachable")


# --- part 2: makespan ------------------------------------------------------------------------
Work = list[tuple[int, int, str]]
"""(actual length, expected length sent as X-Expected-Tokens, prompt) per request."""


def _words(rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(rng.randint(8, 24)))


def _pareto(cfg: BenchConfig, rng: random.Random) -> int:
    return min(cfg.max_tokens, int(cfg.min_tokens * rng.paretovariate(cfg.pareto_alpha)))


def workload(cfg: BenchConfig) -> Work:
    """Independent requests: Pareto lengths, known exactly, unique prompts."""
    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.num_requests):
        n = _pareto(cfg, rng)
        out.append((n, n, f"q{i} {_words(rng)}"))
    return out


def grpo_workload(cfg: BenchConfig) -> Work:
    """GRPO-style groups: `group_size` samples share a prompt; the prompt's difficulty sets
    its length scale (Pareto) and each sample varies around it (lognormal, sigma 0.5). The
    expected length sent is the prompt's scale (what the data worker's per-prompt length
    estimate knows), not the sample's true length. Groups are submitted together."""
    rng = random.Random(cfg.seed + 1)
    out = []
    lo, hi = cfg.grpo_prompt_tokens
    for p in range(cfg.num_requests // cfg.group_size):
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(rng.randint(lo, hi) - 1))
        scale, text = _pareto(cfg, rng), f"prompt{p} {words}"
        for _ in range(cfg.group_size):
            n = max(1, min(cfg.max_tokens, int(scale * rng.lognormvariate(0.0, 0.5))))
            out.append((n, scale, text))
    return out


def scenarios(cfg: BenchConfig) -> dict[str, Work]:
    """The workloads of part 2, by name."""
    indep = workload(cfg)
    return {
        "independent, random order": indep,
        "independent, longest first (data worker's probe order)": sorted(indep, reverse=True),
        f"GRPO groups of {cfg.group_size}, expected = prompt's length scale": grpo_workload(cfg),
    }


def lower_bound(cfg: BenchConfig, work: Work) -> float:
    """Makespan no router can beat on these backends: every engine at its peak rate
    (`tokens_per_step / per_seq_s` tokens/s, the limit of many active requests) with the work
    split perfectly, every distinct prompt prefilled once (perfect caching, none evicted); and
    no less than the longest output alone on an engine."""
    prefill = sum(len(t.split()) - 1 for t in {w[2] for w in work}) * cfg.prefill_cost
    total = sum(w[0] for w in work) + prefill
    spread = total * cfg.per_seq_s / (cfg.tokens_per_step * cfg.engines)
    alone = max(w[0] for w in work) * (cfg.step_s + cfg.per_seq_s) / cfg.tokens_per_step
    return max(spread, alone)


async def _warm(url: str, n: int) -> None:
    """A burst of n one-token requests: routers are long-lived, so measure them with warm
    connection pools (applied to every router alike)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(i: int) -> None:
            async with s.post(url + "/generate", json=_req(1, f"warm{i}")) as r:
                await r.read()

        await asyncio.gather(*(one(i) for i in range(n)))


async def _flush(urls: list[str]) -> None:
    """Empty every backend's prefix cache (no request runs between workloads)."""
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.post(u + "/flush_cache") as r:
                await r.read()


async def _served(urls: list[str]) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        out = []
        for u in urls:
            async with s.get(u + "/get_server_info") as r:
                out.append(await r.json())
        return out


async def _makespan(
    url: str, work: Work, backend_urls: list[str]
) -> tuple[float, float, float, float]:
    """(makespan, token imbalance, dispatch window: submit to last arrival at an engine, share
    of prompt tokens found in the engines' prefix caches)."""
    before = await _served(backend_urls)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(n: int, expected: int, text: str) -> None:
            headers = {"X-Expected-Tokens": str(expected)}
            if text.startswith("prompt"):  # a GRPO group: the key our rollout client sends
                headers["X-Group-Key"] = text.split(" ", 1)[0]
            async with s.post(url + "/generate", json=_req(n, text), headers=headers) as r:
                body = await r.json()
                assert r.status == 200 and body["meta_info"]["completion_tokens"] == n, body

        t0, m0 = time.perf_counter(), time.monotonic()
        await asyncio.gather(*(one(*w) for w in work))
        span = time.perf_counter() - t0
    after = await _served(backend_urls)
    served = [a["tokens_served"] - b["tokens_served"] for a, b in zip(after, before)]
    dispatch = max(a["last_arrival"] for a in after) - m0
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    cached = sum(a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before))
    return span, max(served) / statistics.mean(served), dispatch, cached / max(prompt, 1)


async def makespan(cfg: BenchConfig) -> bool:
    """Run part 2; return True if the >= 15% goal holds for every workload."""
    works = scenarios(cfg)
    lengths = [w[0] for w in works["independent, random order"]]
    works = {k: v for k, v in works.items() if cfg.only in k}
    backends = EngineProcess.spawn(
        count=cfg.engines,
        quiet=True,
        step_s=cfg.step_s,
        per_seq_s=cfg.per_seq_s,
        tokens_per_step=cfg.tokens_per_step,
        prefill_cost=cfg.prefill_cost,
        cache_tokens=cfg.cache_tokens if cfg.prefill_cost > 0 else 0,
    )
    targets = [("ours", spec) for spec in cfg.ours] + [("sglang", p) for p in cfg.sglang]
    results: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    try:
        for rep in range(cfg.repeats):
            order = targets if rep % 2 == 0 else list(reversed(targets))  # spread drift
            for kind, policy in order:
                router = await _start_router(kind, policy, backends.urls, cfg.engines)
                try:
                    await _warm(router.url, cfg.num_requests)
                    for name, work in works.items():
                        await asyncio.sleep(0.3)
                        await _flush(backends.urls)  # every router starts from cold caches
                        results.setdefault((name, router.label), []).append(
                            await _makespan(router.url, work, backends.urls)
                        )
                finally:
                    router.stop()
    finally:
        backends.kill()
    print(
        f"\n## Part 2: makespan, {cfg.num_requests} requests submitted at once, "
        f"Pareto(alpha={cfg.pareto_alpha}) lengths (independent: {min(lengths)}..{max(lengths)}, "
        f"mean {statistics.mean(lengths):.0f}, total {sum(lengths)}), {cfg.engines} engines, "
        f"step = {cfg.step_s} + {cfg.per_seq_s} * n_active s per {cfg.tokens_per_step} tokens, "
        f"median of {cfg.repeats}; imbalance = max/mean tokens served per engine; dispatch = "
        f"submit to last arrival at an engine; prefill {cfg.prefill_cost} decode tokens per "
        f"uncached prompt token, prefix cache {cfg.cache_tokens} tokens per engine (LRU); "
        f"cached = share of prompt tokens found in the caches"
    )
    ok = True
    for arrival in works:
        rows = {label: runs for (a, label), runs in results.items() if a == arrival}
        med = {k: statistics.median(r[0] for r in v) for k, v in rows.items()}
        best = min(v for k, v in med.items() if k.startswith("sglang"))
        bound = lower_bound(cfg, works[arrival])
        print(f"\nworkload: {arrival}; lower bound {bound:.3f} s (perfect balance, no dispatch)")
        print(
            f"{'router:policy':34s} {'makespan s':>10s} {'runs':>16s} {'imbalance':>9s} "
            f"{'dispatch s':>10s} {'cached':>6s} {'/bound':>6s} {'vs best sglang':>15s}"
        )
        for label, runs in rows.items():
            spans = ",".join(f"{r[0]:.2f}" for r in runs)
            imb = statistics.median(r[1] for r in runs)
            disp = statistics.median(r[2] for r in runs)
            hit = statistics.median(r[3] for r in runs)
            rel = (med[label] - best) / best * 100
            print(
                f"{label:34s} {med[label]:10.3f} {spans:>16s} {imb:9.3f} {disp:10.3f} "
                f"{hit:6.2f} {med[label] / bound:6.3f} {rel:+14.1f}%"
            )
        print(
            f"(15% below sglang-router's best is {0.85 * best:.3f} s = "
            f"{0.85 * best / bound:.3f} x the lower bound)"
        )
        gain = (1 - med[f"ours:{cfg.ours[0]}"] / best) * 100
        ok &= gain >= 15
        print(
            f"ours:{cfg.ours[0]}: {gain:.1f}% lower makespan than sglang-router's best "
            "(goal >= 15%)"
        )
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Small sizes (smoke check).")
    ap.add_argument("--skip-overhead", action="store_true", help="Only part 2.")
    ap.add_argument("--skip-makespan", action="store_true", help="Only part 1.")
    ap.add_argument("--repeats", type=int, default=None, help="Makespan runs per policy.")
    ap.add_argument(
        "--ours",
        nargs="+",
        default=None,
        help="Our settings to compare: policy (bind on arrival) or policy@C (late binding, "
        "capacity C tokens per engine); the first is the headline.",
    )
    ap.add_argument("--sglang", nargs="+", default=None, help="sglang-router policies.")
    ap.add_argument(
        "--prefill-cost",
        type=float,
        default=None,
        help="Backend prefill work per uncached prompt token, in decode tokens (0: no prefill "
        "and no prefix cache, the benchmark before caching).",
    )
    ap.add_argument(
        "--only", default=None, help='Only workloads whose name contains this ("GRPO").'
    )
    args = ap.parse_args()
    cfg = BenchConfig()
    if args.quick:
        cfg = BenchConfig(
            latency_requests=200, throughput_requests=400, num_requests=100, repeats=1
        )
    for name in ("repeats", "ours", "sglang", "prefill_cost", "only"):
        value = getattr(args, name)
        if value is not None:
            value = tuple(value) if isinstance(value, list) else value
            cfg = BenchConfig(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, name: value})
    t0 = time.monotonic()
    if not args.skip_overhead:
        asyncio.run(overhead(cfg))
    if not args.skip_makespan:
        asyncio.run(makespan(cfg))
    print(
        f"\n(bench wall time {time.monotonic() - t0:.0f} s, {os.cpu_count()} CPUs, load avg "
        f"{os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
