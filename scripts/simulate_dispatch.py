"""Discrete-event simulation of rollout dispatch policies at cluster scale.

Runs the REAL `RolloutDataWorker` (admission, probe dispatch, window, budget, drops) on a
virtual-time asyncio loop (`data_worker.virtual_loop`) against a simulated cluster:

* `--engines` engines with `--slots` concurrent requests each (continuous batching: a token
  step takes `tok_base + tok_per_req * active` seconds, `active` measured when the request
  starts); a router sends each request to the engine with the fewest outstanding expected
  tokens (the worker's `expected_len`, as `X-Expected-Tokens` would).
* `--prompts` prompts with a difficulty d in [0, 1) (a low-discrepancy sequence, so every
  prefix of the stream has the population mean); d drives the response length (heavy-tailed,
  5k-30k tokens, longer when harder, per-sample noise) and the pass rate (1 - d).
* a trainer that takes `--groups-per-step` groups per step, trains for `--train-step-s`, and
  pushes weights in place after every step (per-token versions record the switch).

It compares arrival-order FIFO (W = inf), strict submission order (W = 1), windowed FIFO for a
few W, and windowed FIFO + length-probe dispatch on: throughput (trained samples per second),
trainer idle ratio, staleness, dropped groups, and difficulty bias (mean difficulty of trained
groups minus the prompt population's). Prints a markdown table and writes `dispatch.md` and
`dispatch.png` to `--out` (default bench_out/).

Usage: .venv/bin/python scripts/simulate_dispatch.py [--out bench_out] [--steps 120]
       .venv/bin/python scripts/simulate_dispatch.py --bound ...   (sync vs async vs the bound)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import math
import random
import time
from pathlib import Path

from data_worker import (
    DataWorkerConfig,
    GenerationRequest,
    GenerationResult,
    InMemoryPromptSource,
    RolloutDataWorker,
    VersionRuns,
)
from data_worker.virtual_loop import run_virtual

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """Cluster, workload and trainer of one simulation."""

    engines: int = 64
    """Inference engines."""
    slots: int = 32
    """Concurrent requests per engine (continuous batching)."""
    tok_base: float = 0.015
    """Seconds per decode step of an engine with one request."""
    tok_per_req: float = 0.0003
    """Extra seconds per decode step per concurrent request."""
    prefill_s: float = 0.5
    """Prefill latency per request."""
    prompts: int = 10_000
    """Prompts in the dataset (epochs repeat; lengths are cached from epoch 2 on)."""
    min_len: int = 5_000
    """Shortest response."""
    max_len: int = 30_000
    """Longest response."""
    n: int = 8
    """Samples per prompt."""
    groups_per_step: int = 64
    """B."""
    max_staleness: int = 8
    """S: a 30k-token response takes ~750 s, ~11 train steps; S must let the pipeline cover it."""
    max_off_policy_steps: int | None = 10
    """Drop groups staler than this at consumption (S + 2: windows up to 2B never drop)."""
    train_step_s: float = 60.0
    """Trainer time per step (generation of one step's tokens takes ~68 s at full load)."""
    steps: int = 240
    """Train steps simulated (240 x 64 groups = 1.5 epochs: the second half has cached lengths)."""
    seed: int = 0
    """Seed of the per-sample length noise and rewards."""


def difficulty(index: int) -> float:
    """Low-discrepancy difficulty in [0, 1) of prompt `index`."""
    return ((index + 1) * GOLDEN) % 1.0


class Workload:
    """Per-prompt difficulty -> per-sample response length and reward."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.diff = [difficulty(i) for i in range(cfg.prompts)]
        ratio = math.log(cfg.max_len / cfg.min_len)
        self.base = [cfg.min_len * math.exp(ratio * d * d) for d in self.diff]

    def length(self, index: int, sample: int) -> int:
        rng = random.Random(self.cfg.seed * 1_000_003 + index * 64 + sample)
        raw = self.base[index] * math.exp(rng.gauss(0.0, 0.3))
        return int(min(self.cfg.max_len, max(self.cfg.min_len, raw)))

    def reward(self, index: int, sample: int) -> float:
        rng = random.Random(self.cfg.seed * 7_000_003 + index * 64 + sample)
        return 1.0 if rng.random() < 1.0 - self.diff[index] else 0.0


class Cluster:
    """Engines + router + in-place weight updates, in virtual time."""

    def __init__(self, cfg: SimConfig, work: Workload) -> None:
        self.cfg = cfg
        self.work = work
        self.active = [0] * cfg.engines
        self.outstanding = [0] * cfg.engines
        self.update_times = [0.0]
        self.update_versions = [0]
        self.busy_slot_s = 0.0
        self.tokens = 0

    def set_version(self, version: int, now: float) -> None:
        self.update_times.append(now)
        self.update_versions.append(version)

    def _versions(self, t0: float, tau: float, count: int) -> VersionRuns:
        i = bisect.bisect_right(self.update_times, t0) - 1
        runs, done = [], 0
        version = self.update_versions[i]
        for u, v in zip(self.update_times[i + 1 :], self.update_versions[i + 1 :]):
            before = min(count, max(done, int((u - t0) / tau)))
            runs.append((version, before - done))
            done, version = before, v
        runs.append((version, count - done))
        return VersionRuns(runs)

    async def generate(
        self, request: GenerationRequest, priority: float, expected_len: int
    ) -> GenerationResult:
        c = self.cfg
        best, best_load = -1, math.inf
        for e in range(c.engines):
            if self.active[e] < c.slots and self.outstanding[e] < best_load:
                best, best_load = e, self.outstanding[e]
        if best < 0:
            raise RuntimeError("no free engine slot: max_inflight exceeds engines * slots")
        self.active[best] += 1
        self.outstanding[best] += expected_len
        index = request.prompt.index
        todo = self.work.length(index, request.sample_index) - len(request.prefix_ids)
        tau = c.tok_base + c.tok_per_req * self.active[best]
        loop = asyncio.get_running_loop()
        t0 = loop.time() + c.prefill_s
        duration = c.prefill_s + todo * tau
        await asyncio.sleep(duration)
        self.active[best] -= 1
        self.outstanding[best] -= expected_len
        self.busy_slot_s += duration
        self.tokens += todo
        return GenerationResult(
            output_ids=range(todo),
            token_versions=self._versions(t0, tau, todo),
            payload={"reward": self.work.reward(index, request.sample_index)},
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """One dispatch policy to compare."""

    name: str
    window: float
    probe: bool
    siblings: str = "queue"


@dataclasses.dataclass(kw_only=True, slots=True)
class Result:
    """What one simulation measured."""

    policy: Policy
    sim_s: float
    trained_samples: int
    idle_s: float
    staleness: list[int]
    dropped: int
    difficulty_bias: float
    reward_bias: float
    batch_bias: list[float]
    step_end: list[float]
    slot_util: float
    probe_hit_rate: float
    wall_s: float


def worker_config(cfg: SimConfig, policy: Policy, max_inflight: int) -> DataWorkerConfig:
    """The data worker's settings for `cfg` under `policy` (`simulate_pipelines.py` too)."""
    return DataWorkerConfig(
        n_samples_per_prompt=cfg.n,
        groups_per_step=cfg.groups_per_step,
        max_staleness=cfg.max_staleness,
        fifo_window=policy.window,
        max_off_policy_steps=cfg.max_off_policy_steps,
        length_probe=policy.probe,
        probe_siblings=policy.siblings,
        max_inflight=max_inflight,
        default_expected_len=(cfg.min_len + cfg.max_len) // 2,
    )


def simulate(cfg: SimConfig, policy: Policy) -> Result:
    work = Workload(cfg)
    cluster = Cluster(cfg, work)
    wcfg = worker_config(cfg, policy, cfg.engines * cfg.slots)
    source = InMemoryPromptSource(
        [{"prompt_ids": [i], "key": str(i)} for i in range(cfg.prompts)], num_epochs=None
    )
    worker = RolloutDataWorker(wcfg, source, cluster.generate)
    pop_d = sum(work.diff) / len(work.diff)
    pop_r = 1.0 - pop_d
    stale: list[int] = []
    batch_bias: list[float] = []
    step_end: list[float] = []
    trained_d = trained_r = 0.0
    trained = 0
    idle = 0.0
    wall = time.perf_counter()

    async def trainer() -> float:
        nonlocal trained_d, trained_r, trained, idle
        loop = asyncio.get_running_loop()
        await worker.start()
        for k in range(cfg.steps):
            t = loop.time()
            batch = await worker.get_batch(cfg.groups_per_step, k)
            idle += loop.time() - t
            ds = [work.diff[g.prompt.index] for g in batch.groups]
            rs = [s.payload["reward"] for g in batch.groups for s in g.samples]
            batch_bias.append(sum(ds) / len(ds) - pop_d)
            trained_d += sum(ds)
            trained_r += sum(rs)
            trained += len(ds)
            stale.extend(batch.staleness())
            await asyncio.sleep(cfg.train_step_s)
            cluster.set_version(k + 1, loop.time())
            worker.set_served_version(k + 1)
            step_end.append(loop.time())
        end = loop.time()
        await worker.stop()
        return end

    sim_s = run_virtual(trainer())
    m = worker.metrics()
    return Result(
        policy=policy,
        sim_s=sim_s,
        trained_samples=trained * cfg.n,
        idle_s=idle,
        staleness=stale,
        dropped=worker.accounting().dropped,
        difficulty_bias=trained_d / trained - pop_d,
        reward_bias=trained_r / (trained * cfg.n) - pop_r,
        batch_bias=batch_bias,
        step_end=step_end,
        slot_util=cluster.busy_slot_s / (sim_s * cfg.engines * cfg.slots),
        probe_hit_rate=m["data/probe_hit_rate"],
        wall_s=time.perf_counter() - wall,
    )


def _pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))]) if s else 0.0


def table(results: list[Result], cfg: SimConfig) -> str:
    """Markdown table; ratios are relative to arrival-order FIFO measured in the same run."""
    base = next((r for r in results if math.isinf(r.policy.window) and not r.policy.probe), None)
    base_tp = base.trained_samples / base.sim_s if base else math.nan
    base_bias = abs(base.difficulty_bias) if base else math.nan
    head = (
        "| policy | W | probe | throughput (samples/s) | vs arrival | trainer idle | slot util "
        "| staleness mean / p99 / max | dropped | difficulty bias | \\|bias\\| vs arrival "
        "| mean \\|batch bias\\| | reward bias | probe hit |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        tp = r.trained_samples / r.sim_s
        mean_s = sum(r.staleness) / len(r.staleness)
        w = "inf" if math.isinf(r.policy.window) else str(int(r.policy.window))
        rows.append(
            f"| {r.policy.name} | {w} | {'yes' if r.policy.probe else 'no'} | {tp:.1f} "
            f"| {tp / base_tp:.3f} | {r.idle_s / r.sim_s:.3f} | {r.slot_util:.3f} "
            f"| {mean_s:.2f} / {_pct(r.staleness, 0.99):.0f} / {max(r.staleness)} "
            f"| {r.dropped} | {r.difficulty_bias:+.4f} "
            f"| {abs(r.difficulty_bias) / base_bias:.3f} "
            f"| {sum(abs(b) for b in r.batch_bias) / len(r.batch_bias):.4f} "
            f"| {r.reward_bias:+.4f} | {r.probe_hit_rate:.2f} |"
        )
    note = (
        f"\n{cfg.engines} engines x {cfg.slots} slots, {cfg.prompts} prompts, n={cfg.n}, "
        f"B={cfg.groups_per_step}, S={cfg.max_staleness}, "
        f"max_off_policy_steps={cfg.max_off_policy_steps}, {cfg.steps} steps of "
        f"{cfg.train_step_s:.0f} s; lengths {cfg.min_len}-{cfg.max_len} tokens. Throughput = "
        "trained samples per simulated second; difficulty bias = mean difficulty of trained "
        "groups minus the population mean; mean |batch bias| = per-step composition error.\n"
    )
    return head + "\n".join(rows) + "\n" + note


def plot(results: list[Result], cfg: SimConfig, path: Path) -> None:
    """Four panels: progress over time, batch difficulty bias, staleness, summary bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    per_step = cfg.groups_per_step * cfg.n
    for r in results:
        label = r.policy.name
        ax[0, 0].plot(
            [t / 3600 for t in r.step_end],
            [(i + 1) * per_step for i in range(len(r.step_end))],
            label=label,
        )
        k = 5
        smooth = [
            sum(r.batch_bias[max(0, i - k + 1) : i + 1]) / min(k, i + 1)
            for i in range(len(r.batch_bias))
        ]
        ax[0, 1].plot(smooth, label=label)
        ax[1, 0].hist(
            r.staleness, bins=range(0, max(r.staleness) + 2), histtype="step", label=label
        )
    ax[0, 0].set(xlabel="simulated hours", ylabel="trained samples", title="Training progress")
    ax[0, 1].axhline(0.0, color="k", lw=0.5)
    ax[0, 1].set(
        xlabel="train step",
        ylabel="batch mean difficulty - population",
        title="Difficulty bias per batch (5-step mean)",
    )
    ax[1, 0].set(xlabel="staleness k - j_min", ylabel="groups", title="Staleness of trained groups")
    names = [r.policy.name for r in results]
    base = next(r for r in results if math.isinf(r.policy.window) and not r.policy.probe)
    tp = [(r.trained_samples / r.sim_s) / (base.trained_samples / base.sim_s) for r in results]
    bias = [abs(r.difficulty_bias) / max(abs(base.difficulty_bias), 1e-12) for r in results]
    x = range(len(results))
    ax[1, 1].bar([i - 0.2 for i in x], tp, width=0.4, label="throughput / arrival")
    ax[1, 1].bar([i + 0.2 for i in x], bias, width=0.4, label="|difficulty bias| / arrival")
    ax[1, 1].axhline(0.95, color="g", ls="--", lw=0.8)
    ax[1, 1].axhline(0.10, color="r", ls="--", lw=0.8)
    ax[1, 1].set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax[1, 1].set(title="Relative to arrival-order FIFO")
    for a in (ax[0, 0], ax[0, 1], ax[1, 0], ax[1, 1]):
        a.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def async_bound(cfg: SimConfig, window: float) -> str:
    """Sync (S = 0) vs async (S = cfg.max_staleness) on the same cluster and workload: the
    async speed-up against its bound (Tg + Tt) / max(Tg, Tt), Tg = the sync trainer's wait
    per step (generating one step's groups on the whole cluster), Tt = `train_step_s`."""
    sync_cfg = dataclasses.replace(cfg, max_staleness=0, max_off_policy_steps=None)
    sync = simulate(sync_cfg, Policy(name="sync", window=window, probe=False))
    asy = simulate(cfg, Policy(name="async", window=window, probe=False))
    tg, tt = sync.idle_s / cfg.steps, cfg.train_step_s
    bound = (tg + tt) / max(tg, tt)
    sync_tp = sync.trained_samples / sync.sim_s
    async_tp = asy.trained_samples / asy.sim_s
    speedup = async_tp / sync_tp
    # the pipelined bound: every slot busy at full batch, or the trainer never idle
    work = Workload(cfg)
    lens = [work.length(i, j) for i in range(cfg.prompts) for j in range(cfg.n)]
    per_req = cfg.prefill_s + sum(lens) / len(lens) * (cfg.tok_base + cfg.tok_per_req * cfg.slots)
    gen_tp = cfg.engines * cfg.slots / per_req
    ideal = min(gen_tp, cfg.groups_per_step * cfg.n / tt)
    w = "inf" if math.isinf(window) else str(int(window))
    return (
        f"S={cfg.max_staleness}, W={w}: sync Tg {tg:.0f} s (its long tail) + Tt {tt:.0f} s -> "
        f"bound {bound:.2f}x; async {speedup:.2f}x sync = {speedup / bound:.0%} of that bound. "
        f"Pipelined bound min(generation {gen_tp:.1f}, training "
        f"{cfg.groups_per_step * cfg.n / tt:.1f}) = {ideal:.1f} samples/s; async "
        f"{async_tp:.1f} samples/s = {async_tp / ideal:.0%} of it; async trainer idle "
        f"{asy.idle_s / asy.sim_s:.3f}, slot util {asy.slot_util:.2f}, dropped {asy.dropped}, "
        f"staleness mean {sum(asy.staleness) / len(asy.staleness):.2f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = SimConfig()
    p.add_argument("--out", default="bench_out", help="output directory for dispatch.md/.png")
    p.add_argument("--engines", type=int, default=d.engines, help="inference engines")
    p.add_argument("--slots", type=int, default=d.slots, help="concurrent requests per engine")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts in the dataset")
    p.add_argument("--n", type=int, default=d.n, help="samples per prompt")
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step, help="B")
    p.add_argument("--max-staleness", type=int, default=d.max_staleness, help="S")
    p.add_argument(
        "--max-off-policy-steps",
        type=int,
        default=d.max_off_policy_steps,
        help="drop groups staler than this (negative: never drop)",
    )
    p.add_argument("--train-step-s", type=float, default=d.train_step_s, help="trainer s/step")
    p.add_argument("--steps", type=int, default=d.steps, help="train steps to simulate")
    p.add_argument("--seed", type=int, default=d.seed, help="length/reward noise seed")
    p.add_argument("--windows", default="1,2,4", help="windowed-FIFO W values, in multiples of B")
    p.add_argument(
        "--probe-windows", default="1,2", help="W values (multiples of B) run with probes"
    )
    p.add_argument(
        "--probe-siblings",
        default="queue",
        choices=["queue", "backfill", "hold"],
        help="what a probing group's other samples do (DataWorkerConfig.probe_siblings)",
    )
    p.add_argument(
        "--bound",
        action="store_true",
        help="only compare sync (S=0) with async (S) against the bound (Tg+Tt)/max(Tg,Tt)",
    )
    p.add_argument("--min-len", type=int, default=d.min_len, help="shortest response (tokens)")
    p.add_argument("--max-len", type=int, default=d.max_len, help="longest response (tokens)")
    p.add_argument("--tok-base", type=float, default=d.tok_base, help="s per decode step")
    a = p.parse_args()
    cfg = SimConfig(
        engines=a.engines,
        slots=a.slots,
        prompts=a.prompts,
        n=a.n,
        groups_per_step=a.groups_per_step,
        max_staleness=a.max_staleness,
        max_off_policy_steps=None if a.max_off_policy_steps < 0 else a.max_off_policy_steps,
        train_step_s=a.train_step_s,
        steps=a.steps,
        seed=a.seed,
        min_len=a.min_len,
        max_len=a.max_len,
        tok_base=a.tok_base,
    )
    if a.bound:
        print(async_bound(cfg, window=max(1, cfg.groups_per_step)))
        print(async_bound(cfg, window=math.inf))
        return
    B = cfg.groups_per_step
    policies = [Policy(name="arrival FIFO", window=math.inf, probe=False)]
    policies.append(Policy(name="strict order", window=1, probe=False))
    for m in (float(x) for x in a.windows.split(",") if x):
        policies.append(Policy(name=f"window {m:g}B", window=max(1, round(m * B)), probe=False))
    for m in (float(x) for x in a.probe_windows.split(",") if x):
        policies.append(
            Policy(
                name=f"window {m:g}B + probe",
                window=max(1, round(m * B)),
                probe=True,
                siblings=a.probe_siblings,
            )
        )
    results = []
    for pol in policies:
        r = simulate(cfg, pol)
        print(f"  simulated {pol.name:22s} {r.sim_s / 3600:6.2f} h in {r.wall_s:5.1f} s wall")
        results.append(r)
    md = table(results, cfg)
    print()
    print(md)
    base = results[0]
    strict = results[1]
    btp = base.trained_samples / base.sim_s
    for r in results:
        if not r.policy.probe:
            continue
        tp = r.trained_samples / r.sim_s
        ok_tp = tp >= 0.95 * btp
        ok_bias = abs(r.difficulty_bias) <= 0.10 * abs(base.difficulty_bias)
        ok_strict = tp > strict.trained_samples / strict.sim_s
        print(
            f"goal [{r.policy.name}]: throughput >= 95% of arrival: {ok_tp}; "
            f"|bias| <= 10% of arrival: {ok_bias}; beats strict order: {ok_strict}"
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "dispatch.md.tmp"
    tmp.write_text(md)
    tmp.replace(out / "dispatch.md")
    plot(results, cfg, out / "dispatch.png")
    print(f"wrote {out / 'dispatch.md'} and {out / 'dispatch.png'}")


if __name__ == "__main__":
    main()
