"""Benchmark: the train step's two largest non-matmul parts alone, this tree against another.

At the SmolLM2 recipe's shapes in bf16 on one thread, each in a fresh process per tree:

* `head`: `lm_head.chunked_logprobs` over the recipe batch's 1307 read positions (SmolLM2's
  vocabulary and hidden size, random weights, the weight with megatron's fp32 gradient
  buffer): its forward alone (no grad), and forward + backward.
* `attention`: `attention.causal_attention` over one layer's 32 right-padded samples of 100
  tokens (9 query heads over 3 key/value groups, head dim 64), in the groups
  `attention.padded_groups` forms: forward alone, and forward + backward.

Each number is the best of `--repeats` runs in CPU seconds (this machine's speed moves between
runs; the best is the least disturbed). The trees alternate over `--rounds` rounds.

    .venv/bin/python scripts/bench_step_parts.py --base 62b28d0
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench_trainer_speed import _base_tree, run_worker

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
args = json.loads(sys.argv[1])
from slime_async.trainer import attention, lm_head
def best(f):
    f(); out = 1e9
    for _ in range(args["repeats"]):
        c = time.process_time(); f(); out = min(out, time.process_time() - c)
    return round(out * 1e3, 1)
g = torch.Generator().manual_seed(0)
n, h, v = 1307, 576, 49152
hid = (torch.randn(n, h, generator=g) * 0.05).bfloat16()
w = torch.randn(v, h, generator=g).bfloat16().requires_grad_()
w.main_grad = torch.zeros(v, h)
tg = torch.randint(0, v, (n,), generator=g)
glp, gent = torch.randn(n, generator=g), torch.randn(n, generator=g)
def head_fwd():
    with torch.no_grad():
        lm_head.chunked_logprobs(hid, w, tg)
def head_fb():
    x = hid.clone().requires_grad_()
    lp, ent = lm_head.chunked_logprobs(x, w, tg)
    ((lp * glp).sum() + (ent * gent).sum()).backward()
b, s = 32, 100
q = torch.randn(b, s, 9, 64, generator=g).bfloat16()
k, val = (torch.randn(b, s, 3, 64, generator=g).bfloat16() for _ in range(2))
go = torch.randn(b, s, 9, 64, generator=g).bfloat16()
bounds = tuple(range(0, (b + 1) * s, s))
plan = attention.padded_groups(bounds, 9, torch.device("cpu"))
sizes = [grp.samples for grp in plan.groups]
def attend(grad):
    i = 0
    for m in sizes:
        parts = [x[i : i + m].clone().requires_grad_(grad) for x in (q, k, val)]
        if grad:
            attention.causal_attention(*parts, 0.125).backward(go[i : i + m])
        else:
            with torch.no_grad():
                attention.causal_attention(*parts, 0.125)
        i += m
print("RESULT " + json.dumps({
    "head_fwd_ms": best(head_fwd), "head_fwd_bwd_ms": best(head_fb),
    "attention_groups": sizes,
    "attention_fwd_ms": best(lambda: attend(False)), "attention_fwd_bwd_ms": best(lambda: attend(True)),
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="also this commit's tree (e.g. main)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json", help="also write the numbers to this file")
    a = ap.parse_args()
    load = [os.getloadavg()[0]]
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("this tree", ROOT)]
        if a.base:
            trees.insert(0, (f"base {a.base}", _base_tree(a.base, tmp)))
        for _ in range(a.rounds):
            for label, tree in trees:
                path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
                env = {**os.environ, "PYTHONPATH": path}
                r = run_worker(WORKER, {"repeats": a.repeats}, cwd=tree, env=env, what=label)
                rows.setdefault(label, []).append(r)
    load.append(os.getloadavg()[0])
    cols = ("head_fwd_ms", "head_fwd_bwd_ms", "attention_fwd_ms", "attention_fwd_bwd_ms")
    print(f"{'tree':<20} " + " ".join(f"{c:>21}" for c in cols) + "  attention groups")
    for label, rs in rows.items():
        for r in rs:
            print(f"{label:<20} " + " ".join(f"{r[c]:>21}" for c in cols), r["attention_groups"])
    print(
        f"CPU milliseconds, best of {a.repeats}; load average before {load[0]:.1f}, after {load[1]:.1f}"
    )
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "load": load}, indent=1))


if __name__ == "__main__":
    main()
