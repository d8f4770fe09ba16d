"""A recipe run end to end, measured: wall time, memory of the whole run, step times, the curve.

Runs `train_async.py --config RECIPE [FLAGS...]` as a child process and, while it runs, samples
every `--interval` seconds the memory of the child's whole process tree (the driver, Ray's
processes and actors, the engines, the router): the sum of RSS and the sum of PSS (proportional
set size: shared pages, e.g. Ray's object store, counted once across processes; every
`--pss-every`-th sample, as reading it costs CPU the run would miss), and each
process's own peak RSS under its role and pid (`ray::_TrainerActorImpl [1234]`). Afterwards it reads the
run's `metrics.jsonl` and prints one JSON summary:

  * `wall_s`: start to exit; `first_step_s`: start to the first step's line (start-up);
  * `peak_rss_sum_gib`, `peak_pss_sum_gib`, `peak_rss_by_process_gib` and
    `peak_pss_by_process_gib` (the 16 largest), and each process's PSS at the whole run's PSS
    peak (`pss_at_peak_by_process_gib`);
  * median and mean after the first 3 steps of: seconds per step, training, the forward and
    backward, π_j^Meg's forwards, the weight sync; bytes per push; the idle ratios;
  * `eval`: the held-out curve, `[(step, pass, pass_se)]`, and the train reward per tenth;
  * the load average at start and end (this machine is shared; read the numbers with it);
  * `plan_gib`: the start-up memory plan's prediction for the same flags, per part and in all
    (`slime_async.config.memory_plan`), and its ratio to the measured peak sums; with a
    forward-only role, the plan counts it at its bound (`--max-snapshots` versions), which a
    run may never reach: `plan_at_held_gib` is the same plan with the role at the most versions
    it held (`role/versions_held`), and its ratio to the PSS peak.

    .venv/bin/python scripts/bench_recipe.py recipes/smollm2-chain-sum.yaml --out /tmp/full.json \\
        -- --keep-old-actor --seed 1235 --run-dir runs/full-s1235
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kinds(p: psutil.Process) -> dict[str, int]:
    """`p`'s PSS by kind of mapping: `anon` (heap, anonymous), `shm` (shared memory: Ray's
    object store, /dev/shm files), `libs` (shared libraries) and `files` (other mapped files)."""
    out = {"anon": 0, "shm": 0, "libs": 0, "files": 0}
    for m in p.memory_maps(grouped=True):
        path = m.path
        if "/dev/shm" in path or "plasma" in path or path.startswith("/memfd"):
            kind = "shm"
        elif not path.startswith("/"):
            kind = "anon"
        elif ".so" in path:
            kind = "libs"
        else:
            kind = "files"
        out[kind] += m.pss
    return out


def _sample(
    pid: int,
    per_proc: dict[str, int],
    *,
    pss: bool,
    per_proc_pss: dict[str, int] | None = None,
    kinds: dict[str, dict[str, int]] | None = None,
) -> tuple[int, int]:
    """(sum of RSS, sum of PSS or 0) of `pid`'s tree now; updates each process's peak RSS. PSS
    walks every mapping (`smaps_rollup`), costly for Ray's large address spaces: only when asked;
    with `kinds`, each process's PSS by kind of mapping (`_kinds`) is recorded there too."""
    rss_sum = pss_sum = 0
    for p in _tree(pid):
        try:
            rss = p.memory_info().rss
            title = f"{_role(p)} [{p.pid}]"
            if pss and kinds is not None:
                kinds[title] = _kinds(p)
                one = sum(kinds[title].values())
            else:
                one = p.memory_full_info().pss if pss else 0
            pss_sum += one
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        rss_sum += rss
        per_proc[title] = max(per_proc.get(title, 0), rss)
        if pss and per_proc_pss is not None:
            per_proc_pss[title] = max(per_proc_pss.get(title, 0), one)
    return rss_sum, pss_sum


def _role(p: psutil.Process) -> str:
    """A process's role: its Ray actor class (`ray::_TrainerActorImpl`, the method it runs cut
    off), or its program (`gcs_server`, `raylet`, `train_async.py`, ...)."""
    cmd = p.cmdline()
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0].strip()
    prog = next((Path(c).name for c in cmd if c.endswith(".py") or "/" in c), p.name())
    return prog if prog not in ("python", "python3") else " ".join(cmd[:2])[:60]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


_TIMED = (
    "timing/step_s",
    "timing/train_s",
    "timing/train_fwd_bwd_s",
    "timing/behavior_logprobs_s",
    "timing/weight_sync_s",
    "weights/push_bytes",
    "idle/rollout_ratio",
    "idle/trainer_ratio",
)
"""Per-step metrics summarised by their median and mean after the first 3 steps."""


def summarize(rows: list[dict]) -> dict:
    """Step times, the held-out curve and the train reward per tenth of the run."""
    steps = [r for r in rows if "timing/step_s" in r]

    def late(key: str) -> dict[str, float | None]:
        """Median and mean of `key` over the steps after the first 3 (start-up transients)."""
        xs = [r[key] for r in steps[3:] or steps if isinstance(r.get(key), (int, float))]
        if not xs:
            return {"median": None, "mean": None}
        return {"median": round(statistics.median(xs), 4), "mean": round(statistics.fmean(xs), 4)}

    evals = [
        (r["step"], r["eval/pass"], r.get("eval/pass_se"))
        for r in rows
        if isinstance(r.get("eval/pass"), (int, float))
    ]
    rewards = [r["rollout/reward"] for r in steps if isinstance(r.get("rollout/reward"), float)]
    tenth = max(1, len(rewards) // 10)
    return {
        "steps": len(steps),
        **{k.split("/")[1]: late(k) for k in _TIMED},
        "eval": evals,
        "train_reward_by_tenth": [
            round(statistics.fmean(rewards[i : i + tenth]), 4)
            for i in range(0, len(rewards), tenth)
        ],
    }


def _peaks() -> dict[str, float]:
    """One core's matmul peak in fp32 and bf16 (FLOP/s), as `bench_trainer_speed` measures it."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_trainer_speed import matmul_peak

    torch.set_num_threads(1)
    return {
        "fp32": matmul_peak(torch.float32, device="cpu", n=1024),
        "bf16": matmul_peak(torch.bfloat16, device="cpu", n=1024),
    }


def mfu(rows: list[dict], params: float, prompt_tokens: float, peak: dict[str, float]) -> dict:
    """Model FLOP utilisation of the train step's forward+backward: 6·N·tokens per step over its
    seconds (median after the first 3 steps), against each dtype's peak. Tokens per step: the
    trained samples' prompts (`--prompt-tokens` each) plus their responses."""
    steps = [r for r in rows if "timing/train_fwd_bwd_s" in r][3:]
    rates = [
        6 * params * (r["train/num_seqs"] * prompt_tokens + r["train/num_tokens"])
        / r["timing/train_fwd_bwd_s"]
        for r in steps
    ]  # fmt: skip
    if not rates:
        return {}
    rate = statistics.median(rates)
    return {
        "model_gflops_per_s": round(rate / 1e9, 1),
        "mfu": {k: round(rate / v, 4) for k, v in peak.items()},
    }


def _plan(argv: list[str], *, role_versions: int | None = None) -> dict[str, float]:
    """The memory plan's bytes per part for `argv` (as the run parses them; trainer on CPU).
    `role_versions`: the forward-only role counted at that many versions instead of its bound
    (`--max-snapshots`), the rest of the plan as it is."""
    import dataclasses

    sys.path.insert(0, str(ROOT))
    from slime_async.config import parse_config
    from slime_async.config.memory_plan import process_bytes
    from slime_async.config.rules.memory import run_shape

    shape = run_shape(parse_config(argv))
    if role_versions is not None and shape.role_versions is not None:
        shape = dataclasses.replace(shape, role_versions=role_versions)
    parts = process_bytes(shape)
    out = {k: round(v / 2**30, 2) for k, v in parts.items()}
    return out | {"total": round(sum(parts.values()) / 2**30, 2)}


def _most_versions_held(rows: list[dict]) -> int | None:
    """The most versions the forward-only role held after a release (`role/versions_held`)."""
    held = [int(r["role/versions_held"]) for r in rows if "role/versions_held" in r]
    return max(held) if held else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("--out", required=True, help="the JSON summary is written here")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--pss-every", type=int, default=10, help="PSS on every N-th sample only")
    p.add_argument(
        "--kinds",
        action="store_true",
        help="also each process's PSS by kind of mapping (heap, shared memory, libraries, "
        "files) at the whole run's PSS peak (`pss_kinds_at_peak_mib`)",
    )
    p.add_argument(
        "--mfu-params",
        type=float,
        help="the model's parameter count N: report MFU = 6·N·tokens / fwd+bwd s / one core's "
        "matmul peak (measured before and after the run, the better kept)",
    )
    p.add_argument(
        "--prompt-tokens", type=float, default=0.0, help="prompt tokens per sample (for MFU)"
    )
    p.add_argument("--summarize", metavar="RUN_DIR", help="only summarise a finished run's metrics")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.flags = argv[cut + 1 :]  # train_async.py's flags, after --
    if args.summarize:
        out = Path(args.out)
        old = json.loads(out.read_text()) if out.is_file() else {}
        rows = _metrics(Path(args.summarize))
        new = old | summarize(rows)
        if args.mfu_params:  # the peak measured now, not beside the run: say so
            peak = _peaks()
            new |= {"matmul_peak_gflops_after": {k: round(v / 1e9, 1) for k, v in peak.items()}}
            new |= mfu(rows, args.mfu_params, args.prompt_tokens, peak)
        out.write_text(json.dumps(new, indent=2))
        print(out.read_text())
        return
    cmd = [sys.executable, str(ROOT / "train_async.py"), "--config", args.recipe, *args.flags]
    plan = _plan(["--config", args.recipe, *args.flags])
    run_dir = (
        Path(args.flags[args.flags.index("--run-dir") + 1]) if "--run-dir" in args.flags else None
    )
    load0 = os.getloadavg()
    peaks = [_peaks()] if args.mfu_params else []
    t0 = time.monotonic()
    log = open(Path(args.out).with_suffix(".log"), "w")  # noqa: SIM115 (open for the child's life)
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    per_proc: dict[str, int] = {}
    per_proc_pss: dict[str, int] = {}
    at_peak: dict[str, int] = {}
    kinds_at_peak: dict[str, dict[str, int]] = {}
    peak_rss = peak_pss = 0
    first_step = None
    n = 0
    while child.poll() is None:
        now_pss: dict[str, int] = {}
        now_kinds: dict[str, dict[str, int]] | None = {} if args.kinds else None
        rss, pss = _sample(
            child.pid,
            per_proc,
            pss=n % args.pss_every == 0,
            per_proc_pss=now_pss,
            kinds=now_kinds,
        )
        for k, v in now_pss.items():
            per_proc_pss[k] = max(per_proc_pss.get(k, 0), v)
        if pss > peak_pss:
            at_peak, kinds_at_peak = now_pss, now_kinds or {}
        n += 1
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        if first_step is None and run_dir is not None and _metrics(run_dir):
            first_step = time.monotonic() - t0
        time.sleep(args.interval)
    wall = time.monotonic() - t0
    if args.mfu_params:
        peaks.append(_peaks())
    gib = 2**30
    top = sorted(per_proc.items(), key=lambda kv: -kv[1])[:16]
    result = {
        "cmd": " ".join(cmd[1:]),
        "returncode": child.returncode,
        "wall_s": round(wall, 1),
        "first_step_s": None if first_step is None else round(first_step, 1),
        "peak_rss_sum_gib": round(peak_rss / gib, 2),
        "peak_pss_sum_gib": round(peak_pss / gib, 2),
        "peak_rss_by_process_gib": {k: round(v / gib, 2) for k, v in top},
        "peak_pss_by_process_gib": {k: round(per_proc_pss.get(k, 0) / gib, 2) for k, _ in top},
        "pss_at_peak_by_process_gib": {
            k: round(v / gib, 2) for k, v in sorted(at_peak.items(), key=lambda kv: -kv[1])[:10]
        },
        "pss_kinds_at_peak_mib": {
            k: {kind: round(b / 2**20) for kind, b in v.items()}
            for k, v in sorted(kinds_at_peak.items(), key=lambda kv: -sum(kv[1].values()))[:10]
        },
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        **(summarize(_metrics(run_dir)) if run_dir is not None else {}),
        "plan_gib": plan,
        "plan_over_rss": round(plan["total"] * gib / max(1, peak_rss), 3),
        "plan_over_pss": round(plan["total"] * gib / max(1, peak_pss), 3),
    }
    held = _most_versions_held(_metrics(run_dir)) if run_dir is not None else None
    if held is not None:  # the plan's parts checked apart from the bound the run did not reach
        at_held = _plan(["--config", args.recipe, *args.flags], role_versions=held)
        result |= {
            "role_versions_held_max": held,
            "plan_at_held_gib": at_held,
            "plan_at_held_over_pss": round(at_held["total"] * gib / max(1, peak_pss), 3),
        }
    if args.mfu_params and run_dir is not None:
        peak = {k: max(p[k] for p in peaks) for k in peaks[0]}
        result |= {"matmul_peak_gflops": {k: round(v / 1e9, 1) for k, v in peak.items()}}
        result |= mfu(_metrics(run_dir), args.mfu_params, args.prompt_tokens, peak)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
