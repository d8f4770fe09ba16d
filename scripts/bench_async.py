"""Synchronous vs asynchronous training on the embedded CPU default, measured in one run.

Runs `train_async.py` several times with the same seed, warm start and sample budget, trainer
and engines on disjoint cores:

  sync          --max-staleness 0, CompIS + rollout routing replay (R3)
  async         --max-staleness 2, CompIS + R3 (--keep-old-actor: r2/r3 split)
  async-nocorr  --max-staleness 2, plain PPO on r1: no staleness or engine correction, no R3

and prints (1) samples/hour, the async/sync ratio and the trainer idle ratio, and (2) reward
and held-out eval at equal samples plus `train_rollout_logprob_abs_diff` over time for each;
it writes `BENCH_DIR/bench_async.png` and `BENCH_DIR/bench_async.md`.

    .venv/bin/python scripts/bench_async.py --num-steps 120
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ARMS: dict[str, list[str]] = {
    "sync": ["--max-staleness", "0", "--use-rollout-routing-replay", "--keep-old-actor"],
    "async": ["--max-staleness", "2", "--use-rollout-routing-replay", "--keep-old-actor"],
    "async-nocorr": ["--max-staleness", "2", "--loss", "ppo"],
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_arm(name: str, out: Path, common: list[str], warm: Path) -> dict:
    run_dir = out / name
    cmd = [sys.executable, str(ROOT / "train_async.py"), "--run-dir", str(run_dir),
           "--hf-checkpoint", str(warm), *common, *ARMS[name]]  # fmt: skip
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "train/version" in r]
    evals = [r for r in rows if "eval/reward" in r]
    samples_per_step = train[0]["rollout/samples"]
    # throughput over steady state: from the end of step 1 to the end of the last step
    span = train[-1]["timing/elapsed_s"] - train[0]["timing/elapsed_s"]
    sph = samples_per_step * (len(train) - 1) / max(span, 1e-9) * 3600
    return {
        "name": name,
        "wall_s": wall,
        "samples_per_hour": sph,
        "idle_trainer": sum(r["idle/trainer_ratio"] for r in train[1:]) / max(1, len(train) - 1),
        # per-step phases (in the sync arm: generation = the trainer's wait for a batch)
        "t_wait": sum(r["timing/wait_batch_s"] for r in train[1:]) / max(1, len(train) - 1),
        "t_train": sum(r["timing/train_s"] for r in train[1:]) / max(1, len(train) - 1),
        "t_sync": sum(r["timing/weight_sync_s"] for r in train[1:]) / max(1, len(train) - 1),
        "steps": [r["step"] for r in train],
        "samples": [r["step"] * samples_per_step for r in train],
        "reward": [r["rollout/reward"] for r in train],
        "lp_diff": [r.get("mismatch/train_rollout_logprob_abs_diff", float("nan")) for r in train],
        "eval_steps": [r["step"] for r in evals],
        "eval": [r["eval/reward"] for r in evals],
        "staleness": [r.get("staleness/mean", 0.0) for r in train],
    }


def smooth(xs: list[float], k: int = 10) -> list[float]:
    return [sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1])
            for i in range(len(xs))]  # fmt: skip


def tail_mean(xs: list[float], frac: float = 0.2) -> float:
    n = max(1, int(len(xs) * frac))
    return sum(xs[-n:]) / n


def report(results: list[dict], out: Path) -> str:
    by = {r["name"]: r for r in results}
    sync = by["sync"]
    lines = [
        "| arm | samples/hour | vs sync | trainer idle | final reward (last 20%) | final eval "
        "| lp_diff first→last | mean staleness |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ev = f"{r['eval'][-1]:.3f}" if r["eval"] else "n/a"
        lines.append(
            f"| {r['name']} | {r['samples_per_hour']:.0f} | "
            f"{r['samples_per_hour'] / sync['samples_per_hour']:.2f}x | {r['idle_trainer']:.2f} | "
            f"{tail_mean(r['reward']):.3f} | {ev} | {r['lp_diff'][0]:.4f}→{r['lp_diff'][-1]:.4f} | "
            f"{sum(r['staleness']) / len(r['staleness']):.2f} |"
        )
    t_gen, t_train = sync["t_wait"], sync["t_train"] + sync["t_sync"]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    lines.append(
        f"\nsync step phases: generation {t_gen:.3f} s, train + weight sync {t_train:.3f} s -> "
        f"ideal async speed-up bound (T_gen + T_train) / max(T_gen, T_train) = {bound:.2f}x"
    )
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in results:
        ax[0].plot(r["samples"], smooth(r["reward"]), label=r["name"])
        if r["eval"]:
            spp = r["samples"][0] / r["steps"][0]
            ax[1].plot([s * spp for s in r["eval_steps"]], r["eval"], marker="o", label=r["name"])
        ax[2].plot(r["steps"], smooth(r["lp_diff"], 5), label=r["name"])
    ax[0].set(title="train reward (10-step mean)", xlabel="samples")
    ax[1].set(title="held-out eval reward", xlabel="samples")
    ax[2].set(title="train_rollout_logprob_abs_diff", xlabel="step", yscale="log")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    path = out / "bench_async.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench_out/async", help="Output directory.")
    p.add_argument("--num-steps", type=int, default=120, help="Train steps per arm.")
    p.add_argument("--rollout-batch-size", type=int, default=4,
                   help="Prompts per step (4 x 8 samples keeps generation and training "
                        "comparable on 2 cores, where async can pay off).")  # fmt: skip
    p.add_argument("--seed", type=int, default=1, help="Seed shared by every arm.")
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="Flags passed to every train_async.py run.")  # fmt: skip
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--num-steps", str(args.num_steps), "--seed", str(args.seed),
              "--rollout-batch-size", str(args.rollout_batch_size), "--micro-batch-size", "16",
              "--eval-interval", str(max(1, args.num_steps // 6)), *args.extra]  # fmt: skip

    from slime_async.rollout.tasks import TaskFamilyConfig
    from slime_async.rollout.warmstart import WarmStartConfig, warm_start

    ws = warm_start(out, config=WarmStartConfig(seed=args.seed),
                    task=TaskFamilyConfig(seed=args.seed))  # fmt: skip
    results = [run_arm(name, out, common, ws.path) for name in args.arms]
    table = report(results, out) if "sync" in args.arms else ""
    png = plot(results, out)
    (out / "bench_async.md").write_text(table + "\n")
    (out / "bench_async.json").write_text(json.dumps(results, indent=1))
    print(table)
    print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
