"""End to end: a LoRA run of train_async on the embedded CPU default (real Ray, engines, router,
Megatron): the engines serve the base + the run's adapter, every push moves the adapter only
(its bytes: the rank formula plus the safetensors header), trained tokens come from pushed
adapter versions, and the run's HF export is the merged model with the PEFT adapter beside it."""

from __future__ import annotations

import json

import pytest

from slime_async.config import parse_config
from slime_async.contracts.adapter import LoraSpec, adapter_numel, read_peft_dir
from slime_async.orchestrator.controller import train

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def _argv(run_dir, steps: int) -> list[str]:
    """A short LoRA run of the embedded default: rank-4 adapters on the attention projections."""
    return [
        "--run-dir", str(run_dir), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "12", "--warmstart-steps", "0", "--eval-interval", "0",
        "--micro-batch-size", "4", "--lr", "1e-3", "--num-steps", str(steps),
        "--lora-rank", "4", "--lora-alpha", "8",
        "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
    ]  # fmt: skip


async def test_lora_run_pushes_adapters_only(tmp_path):
    steps = 3
    argv = [*_argv(tmp_path, steps), "--max-staleness", "0"]
    cfg = parse_config(argv)
    assert cfg.engine.enable_lora and cfg.weights.transport == "disk"
    summary = await train(cfg)
    assert summary["train/version"] == steps
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    pushes = [r["weights/push_bytes"] for r in rows if "weights/push_bytes" in r]
    assert len(pushes) == steps
    lora, _, version = read_peft_dir(tmp_path / "adapters" / "v000003")
    assert version == steps and lora.rank == 4
    formula = 4 * adapter_numel(cfg.model, lora)
    f = tmp_path / "adapters" / "v000003" / "adapter_model.safetensors"
    header = 8 + int.from_bytes(f.read_bytes()[:8], "little")  # safetensors: length + JSON
    assert pushes == [formula + header] * steps, (pushes, formula, header)
    ledger = [json.loads(x) for x in (tmp_path / "trained.jsonl").read_text().splitlines()]
    # synchronous (S = 0): step k trains groups generated under adapter version k - 1
    assert [sorted({j for _, _, j in row["groups"]}) for row in ledger] == [[0], [1], [2]]
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "hf-adapter" / "adapter_config.json").is_file()


async def test_lora_run_over_the_weight_group_with_the_forward_only_role(tmp_path):
    """`--update-weight-transport distributed --behavior-forward role` with LoRA: each push is the
    adapter's fp32 tensors over the weight group (exactly the rank formula's bytes), the role
    holds the base once and an adapter per version, and every trained token found its π_j^Meg."""
    steps = 3
    argv = [
        *_argv(tmp_path, steps), "--max-staleness", "1", "--update-weight-transport",
        "distributed", "--keep-old-actor", "--behavior-forward", "role",
    ]  # fmt: skip
    cfg = parse_config(argv)
    assert cfg.engine.enable_lora and cfg.weights.transport == "distributed"
    summary = await train(cfg)
    assert summary["train/version"] == steps
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/version" in r]
    t = cfg.trainer
    lora = LoraSpec(rank=t.lora_rank, alpha=t.lora_alpha, targets=tuple(t.lora_target_modules))
    pushes = [r["weights/push_bytes"] for r in rows if "weights/push_bytes" in r]
    assert pushes == [4 * adapter_numel(cfg.model, lora)] * steps, pushes
    assert all(r.get("train/behavior_missing_tokens", 0) == 0 for r in trained), trained
    assert all(r.get("loss/compis_fallback", 0) == 0 for r in trained), trained
    assert all(r.get("weights/push_failed_engines", 0) == 0 for r in rows)
