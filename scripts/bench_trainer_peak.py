"""Benchmark: where a CPU trainer's memory peaks within a step, whether it grows over steps,
what a save costs, and where a step's CPU seconds go.

The trainer alone (`MegatronTrainer`, SmolLM2-135M's shapes with random weights, bf16, one
thread, 512-token micro-batches unless `--tokens`, full recompute unless `--no-recompute`: the
SmolLM2 recipe's trainer as its measured runs set it), its heap trimmed after each step as the trainer actor
does. Two parts, each in a fresh process:

* `phases`: one step after two warm-up steps on the recipe's batch, the process's RSS read
  every millisecond from a thread, and the highest RSS between consecutive marks: the step's
  start, the forward+backward, the head's forward and backward, the optimizer's clipping and
  Adam update, the step's end. What the peak is above the step's start is what the step's
  transients cost; where it lands says which one to cut.
* `export`: after one step, the peak RSS over its start while the trainer writes an HF
  directory (`save_hf`, what `--save-hf` writes; `save_base_weights`, what the engines and the
  forward-only role start from), with `--lora` the adapter folded in: a save that copies
  the whole model shows here.
* `profile`: one step (after one warm-up) under `torch.profiler`, the `--top` ops by self CPU
  seconds: where the step's time goes besides its matmuls.
* `growth`: `--steps` steps of batches whose responses grow (6 → 6 + 2·steps tokens, like a run's),
  the anonymous memory and the heap after each step (`/proc/self/smaps`): a process that grows
  here keeps something per new micro-batch shape.

    .venv/bin/python scripts/bench_trainer_peak.py                    # this tree's defaults
    .venv/bin/python scripts/bench_trainer_peak.py --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 \
        --env LRU_CACHE_CAPACITY=1024                                 # torch's own cache sizes

`--env` values are set in the child before anything else (a value the tree also sets is kept).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench_trainer_speed import run_worker

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, os, random, sys, threading, time
args = json.loads(sys.argv[1])
import torch
torch.set_num_threads(1)
from slime_async import host
host.limit_kernel_caches()  # as the trainer actor does (a value given in the environment wins)
sys.path.insert(0, args["scripts"])
from bench_trainer_speed import recipe_lengths
from slime_async.contracts.model import SMOLLM2_135M as spec
from slime_async.trainer import lm_head
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.testing import random_batch
from slime_async.trainer.trainer import MegatronTrainer
rc = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
lora = dict(lora_rank=16, lora_alpha=32.0, lora_target_modules=(
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
cfg = TrainerConfig(lr=1e-6, seed=0, bf16=True, use_dynamic_batch_size=True,
                    max_tokens_per_gpu=args["tokens"], **(rc if args["recompute"] else {}),
                    **(lora if args["lora"] else {}))
tr = MegatronTrainer(cfg, spec)
MIB = 2**20
def step(batch):
    c = time.process_time(); tr.train_step(batch); host.trim_heap()
    return time.process_time() - c
if args["part"] == "growth":
    def anon():
        total = heap = 0; name = ""
        for line in open("/proc/self/smaps"):
            head = line.split()
            if not head[0].endswith(":"):  # a mapping's first line: its address range, path
                name = head[5] if len(head) > 5 else ""
            elif line.startswith("Anonymous:"):
                kb = int(head[1]); total += kb; heap += kb if name == "[heap]" else 0
        return total / 1024, heap / 1024
    rng, rows = random.Random(0), []
    for s in range(args["steps"]):
        resp = 6 + 2 * s
        lengths = [rng.randint(50, 62) + rng.randint(max(1, resp - 6), resp + 6) for _ in range(32)]
        cpu = step(random_batch(spec, batch=32, width=max(lengths), prompt=40, seed=s, lengths=lengths))
        a, h = anon()
        rows.append({"step": s, "longest": max(lengths), "cpu_s": round(cpu, 2), "anon_mib": round(a), "heap_mib": round(h)})
    print("RESULT " + json.dumps(rows)); sys.exit(0)
page = os.sysconf("SC_PAGE_SIZE")
if args["part"] == "profile":
    from torch.profiler import ProfilerActivity, profile
    lengths = recipe_lengths()
    batch = random_batch(spec, batch=len(lengths), width=max(lengths), prompt=40, seed=1, lengths=lengths)
    step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cpu = step(batch)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args["top"]]
    print("RESULT " + json.dumps({"cpu_s": round(cpu, 2), "ops": [
        {"op": e.key, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 3), "calls": e.count} for e in ops]}))
    sys.exit(0)
if args["part"] == "export":
    import tempfile
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / MIB
    lengths = recipe_lengths()
    step(random_batch(spec, batch=len(lengths), width=max(lengths), prompt=40, seed=1, lengths=lengths))
    out, top = {}, [0.0]
    def watch(stop):
        while not stop:
            top[0] = max(top[0], rss()); time.sleep(0.001)
    with tempfile.TemporaryDirectory() as d:
        for name, save in (("save_hf", lambda: tr.save_hf(f"{d}/hf")),
                           ("save_base_weights", lambda: tr.save_base_weights(f"{d}/base"))):
            host.trim_heap(); start = rss(); top[0] = start; stop = []
            t = threading.Thread(target=watch, args=(stop,), daemon=True); t.start()
            c = time.perf_counter(); save(); s = time.perf_counter() - c
            stop.append(1); t.join()
            out[name] = {"start_mib": round(start), "peak_over_start_mib": round(top[0] - start), "s": round(s, 2)}
    print("RESULT " + json.dumps(out)); sys.exit(0)
marks, peaks, state = [], {}, {"mark": "start", "stop": False}
def mark(name):
    state["mark"] = name; marks.append(name)
def sampler():
    while not state["stop"]:
        with open("/proc/self/statm") as f:
            r = int(f.read().split()[1]) * page / MIB
        peaks[state["mark"]] = max(peaks.get(state["mark"], 0.0), r)
        time.sleep(0.001)
def around(obj, attr, name):
    f = getattr(obj, attr)
    def w(*a, **k):
        mark(name); out = f(*a, **k); mark(name + " done"); return out
    setattr(obj, attr, w)
around(tr, "_forward_backward", "forward+backward")
around(tr, "_optimizer_step", "optimizer")
import megatron.core.optimizer.clip_grads as cg
around(cg, "clip_grad_by_total_norm_fp32", "clip")
for sub in tr.optim._subs():
    around(sub.optimizer, "step", "adam")
fwd, bwd = lm_head._ChunkedLogprobs.forward, lm_head._ChunkedLogprobs.backward
def hf(ctx, *a):
    mark("head forward"); out = fwd(ctx, *a); mark("layers' backward"); return out
def hb(ctx, *a):
    mark("head backward"); out = bwd(ctx, *a); mark("layers' backward"); return out
lm_head._ChunkedLogprobs.forward, lm_head._ChunkedLogprobs.backward = staticmethod(hf), staticmethod(hb)
lengths = recipe_lengths()
batch = random_batch(spec, batch=len(lengths), width=max(lengths), prompt=40, seed=1, lengths=lengths)
step(batch); step(batch)
peaks.clear(); mark("start")
t = threading.Thread(target=sampler, daemon=True); t.start(); time.sleep(0.02)
cpu = step(batch); mark("end"); time.sleep(0.02)
state["stop"] = True; t.join()
print("RESULT " + json.dumps({"cpu_s": round(cpu, 2), "peaks_mib": {k: round(v) for k, v in peaks.items()}}))
"""


def run(part: str, a: argparse.Namespace) -> object:
    env = dict(os.environ)
    env.update(dict(kv.split("=", 1) for kv in a.env))
    args = {
        "part": part,
        "steps": a.steps,
        "tokens": a.tokens,
        "recompute": a.recompute,
        "lora": a.lora,
        "top": a.top,
        "scripts": str(ROOT / "scripts"),
    }
    return run_worker(WORKER, args, cwd=ROOT, env=env, what=f"the {part} worker")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="phases,growth")
    p.add_argument("--steps", type=int, default=10, help="growth: steps of growing batches")
    p.add_argument("--no-recompute", dest="recompute", action="store_false")
    p.add_argument("--tokens", type=int, default=512, help="--max-tokens-per-gpu (micro-batch)")
    p.add_argument("--lora", action="store_true", help="LoRA rank 16 on every linear (export)")
    p.add_argument("--top", type=int, default=15, help="profile: the ops with most self CPU")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the worker")
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    a = p.parse_args()
    result = {"env": a.env, "recompute": a.recompute}
    if "phases" in a.parts:
        ph = result["phases"] = run("phases", a)
        start = ph["peaks_mib"].get("start", 0)
        print(
            f"one step: CPU {ph['cpu_s']} s; RSS at its start {start} MiB; peak per phase (MiB over the start):"
        )
        for k, v in ph["peaks_mib"].items():
            print(f"  {k:<22} {v:>6}  (+{v - start})")
    if "profile" in a.parts:
        pr = result["profile"] = run("profile", a)
        print(f"one step under torch.profiler: CPU {pr['cpu_s']} s; ops by self CPU seconds:")
        for o in pr["ops"]:
            share = o["self_cpu_s"] / pr["cpu_s"]
            print(f"  {o['op']:<32} {o['self_cpu_s']:>7.3f} s {share:>6.1%} {o['calls']:>7} calls")
    if "export" in a.parts:
        ex = result["export"] = run("export", a)
        print("export after a step: RSS at its start, peak over it, seconds")
        for k, v in ex.items():
            print(f"  {k:<18} {v['start_mib']:>6} MiB  +{v['peak_over_start_mib']} MiB  {v['s']} s")
    if "growth" in a.parts:
        rows = result["growth"] = run("growth", a)
        print("growth: step, longest sample, CPU s, anonymous MiB, heap MiB")
        for r in rows:
            print(
                f"  {r['step']:>3} {r['longest']:>4} {r['cpu_s']:>6} {r['anon_mib']:>6} {r['heap_mib']:>6}"
            )
        print(
            f"  anonymous memory {rows[0]['anon_mib']} -> {rows[-1]['anon_mib']} MiB over {len(rows)} steps"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
