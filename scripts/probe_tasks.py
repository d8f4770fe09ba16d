"""Base-model pass rates on reasoning-gym tasks: which task can RL move within a short run?

For each candidate task (and each prompt format), samples one response per held-out prompt from
the model in --hf-checkpoint, with the run's prompts (`slime_async.rollout.data.gym`: chat template,
system prompt) and sampling, scores it with the task's own `score_answer`, and prints a table:
mean reward and exact pass rate (score == 1) with their standard errors, the mean response
length and the fraction cut at the length limit. A good RL task starts low but not at zero.

    python scripts/probe_tasks.py --hf-checkpoint ckpt/smollm2-135m \\
        --tasks basic_arithmetic chain_sum leg_counting --n 64

A task may carry settings: ``chain_sum:max_terms=2,max_digits=1``. Generation is Hugging Face's
`generate` (the embedded engine serves the same model code), batched, on CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree


def _task(spec: str) -> tuple[str, list[str]]:
    name, _, rest = spec.partition(":")
    return name, [f"{name}.{kv}" for kv in rest.split(",") if kv]


def _se(xs: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def probe(
    model,
    tok,
    tasks_spec: str,
    settings: list[str],
    a: argparse.Namespace,
    system: str | None,
    fmt: str,
) -> dict[str, float]:
    from slime_async.rollout.data.gym import ReasoningGymTasks, parse_prompt_source

    cfg = parse_prompt_source(
        f"reasoning_gym:{tasks_spec}",
        task_settings=settings,
        seed=a.seed,
        system_prompt=system,
        answer_format=fmt,
    )
    tasks = ReasoningGymTasks(cfg, tokenizer=tok)
    prompts = tasks.eval_set(a.n)
    scores, lens, cut = [], [], 0
    eos = tok.eos_token_id
    torch.manual_seed(a.seed)
    for i in range(0, len(prompts), a.batch):
        chunk = prompts[i : i + a.batch]
        width = max(len(p.prompt_ids) for p in chunk)
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        ids = torch.tensor(
            [[pad] * (width - len(p.prompt_ids)) + list(p.prompt_ids) for p in chunk]
        )
        mask = torch.tensor(
            [[0] * (width - len(p.prompt_ids)) + [1] * len(p.prompt_ids) for p in chunk]
        )
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=a.temperature > 0,
                temperature=a.temperature or None,
                top_p=1.0,
                top_k=0,
                max_new_tokens=a.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        for p, row in zip(chunk, out[:, width:].tolist(), strict=True):
            n = next((k + 1 for k, t in enumerate(row) if t == eos), None)
            cut += n is None
            resp = row[: n or len(row)]
            lens.append(len(resp))
            text = tok.decode(resp, skip_special_tokens=True)
            scores.append(tasks.score(text, p.payload["metadata"]))
    exact = [float(s >= 1.0) for s in scores]
    return {
        "n": len(scores),
        "reward": sum(scores) / len(scores),
        "reward_se": _se(scores),
        "pass": sum(exact) / len(exact),
        "pass_se": _se(exact),
        "len": sum(lens) / len(lens),
        "cut": cut / len(scores),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument(
        "--tasks",
        nargs="+",
        default=["basic_arithmetic", "chain_sum", "leg_counting"],
        help="NAME or NAME:key=value,...",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        default=["direct/answer_tag", "none/response"],
        help="SYSTEM_PROMPT/ANSWER_FORMAT pairs (system 'none': the template's own).",
    )
    p.add_argument("--n", type=int, default=64, help="Held-out prompts per task.")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.hf_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(a.hf_checkpoint, dtype=torch.float32).eval()
    print(
        f"model {a.hf_checkpoint}, T={a.temperature}, max_new_tokens={a.max_new_tokens}, "
        f"one sample per prompt"
    )
    print(
        f"{'task':40s} {'format':22s} {'n':>4s} {'reward':>14s} {'pass (=1)':>14s} "
        f"{'len':>5s} {'cut':>5s} {'s':>5s}"
    )
    for spec in a.tasks:
        name, settings = _task(spec)
        for f in a.formats:
            system, _, fmt = f.partition("/")
            t0 = time.perf_counter()
            r = probe(model, tok, name, settings, a, None if system == "none" else system, fmt)
            print(
                f"{spec:40s} {f:22s} {r['n']:4d} {r['reward']:6.3f} ± {r['reward_se']:.3f} "
                f"{r['pass']:6.3f} ± {r['pass_se']:.3f} {r['len']:5.1f} {r['cut']:5.2f} "
                f"{time.perf_counter() - t0:5.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
