"""Warm start: trains once, reuses its cache, re-trains when the config changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime_async.contracts.model import ModelSpec
from slime_async.orchestrator.warmstart import (
    MARKER,
    WarmStartConfig,
    build_model,
    cache_hash,
    measure_pass_rates,
    sample_responses,
    warm_start,
)
from slime_async.rollout.data.tasks import EOS, PAD, TaskFamily, TaskFamilyConfig

SPEC = ModelSpec(
    vocab_size=32,
    hidden_size=32,
    num_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    num_experts=2,
    moe_topk=1,
    moe_intermediate_size=32,
    max_position_embeddings=64,
)
TASK = TaskFamilyConfig(num_levels=2, eval_per_level=4)
TINY = WarmStartConfig(
    max_steps=3,
    batch_size=8,
    target_pass_rate=None,
    probe_per_level=4,
    report_per_level=4,
    report_samples=1,
    num_threads=1,
)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _run(run_dir: Path, config: WarmStartConfig = TINY, spec: ModelSpec = SPEC):
    messages: list[str] = []
    res = warm_start(run_dir, spec=spec, task=TASK, config=config, say=messages.append)
    return res, messages


def test_cache_reuse_and_invalidation(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    first, _ = _run(tmp_path)
    assert not first.reused and first.steps == 3
    assert set(first.pass_rates) == {0, 1}
    assert all(0.0 <= r <= 1.0 for r in first.pass_rates.values())
    marker = json.loads((first.path / MARKER).read_text())
    assert marker["hash"] == cache_hash(SPEC, TASK, TINY) and marker["steps"] == 3
    model, info = AutoModelForCausalLM.from_pretrained(first.path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (model.config.eos_token_id, model.config.pad_token_id) == (EOS, PAD)
    weights_mtime = next(first.path.glob("*.safetensors")).stat().st_mtime_ns

    again, msgs = _run(tmp_path)
    assert again.reused and again.pass_rates == first.pass_rates and again.steps == 3
    assert any("reusing" in m for m in msgs)
    assert next(first.path.glob("*.safetensors")).stat().st_mtime_ns == weights_mtime

    # num_threads does not shape the model: still reused
    assert _run(tmp_path, config=WarmStartConfig(**{**_fields(TINY), "num_threads": 2}))[0].reused

    changed, msgs = _run(tmp_path, config=WarmStartConfig(**{**_fields(TINY), "max_steps": 2}))
    assert not changed.reused and changed.steps == 2
    assert any("another config" in m for m in msgs)
    assert json.loads((changed.path / MARKER).read_text())["hash"] != marker["hash"]

    other_spec = ModelSpec(**{**SPEC.to_dict(), "hidden_size": 48, "head_dim": 24})
    assert not _run(tmp_path, spec=other_spec)[0].reused
    # nothing but the final directory is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warmstart"]


def test_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    first, _ = _run(tmp_path)
    for f in first.path.glob("*.safetensors"):
        f.unlink()
    assert not _run(tmp_path)[0].reused
    (first.path / MARKER).write_text("{torn")
    assert not _run(tmp_path)[0].reused


def _fields(cfg: WarmStartConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_sampling_stops_at_eos_and_respects_the_limit() -> None:
    model = build_model(SPEC, seed=0)
    fam = TaskFamily(TASK)
    prompts = [p.prompt_ids for p in fam.train_prompts(0, 12)]
    g = torch.Generator().manual_seed(0)
    out = sample_responses(model, prompts, max_new_tokens=5, generator=g)
    assert len(out) == 12
    for r in out:
        assert 1 <= len(r) <= 5
        assert EOS not in r[:-1]
    g2 = torch.Generator().manual_seed(0)
    assert sample_responses(model, prompts, max_new_tokens=5, generator=g2) == out


def test_pass_rate_is_one_for_a_model_that_knows_the_answers() -> None:
    """An 'oracle' LM whose logits put all mass on the right next token scores 1.0."""
    fam = TaskFamily(TASK)
    prompts = fam.eval_set(3)
    table = {}
    for p in prompts:
        seq = (*p.prompt_ids, *p.response_ids)
        for i in range(len(p.prompt_ids), len(seq)):
            table[seq[:i]] = seq[i]

    class Oracle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=True):
            hist = (
                input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], 1)
            )
            logits = torch.full((*input_ids.shape, SPEC.vocab_size), -1e9)
            for b, row in enumerate(hist.tolist()):
                logits[b, -1, table.get(tuple(row), EOS)] = 0.0
            return type("Out", (), {"logits": logits, "past_key_values": hist})()

    rates = measure_pass_rates(Oracle(), prompts)
    assert rates == {0: 1.0, 1: 1.0}


@pytest.mark.slow
def test_default_warm_start_reaches_partial_accuracy(tmp_path: Path) -> None:
    res = warm_start(tmp_path, config=WarmStartConfig())
    assert 0.2 <= res.pass_rate <= 0.6, res
    rates = [res.pass_rates[lv] for lv in sorted(res.pass_rates)]
    assert rates[0] == max(rates)  # the easiest level passes most often
    assert sum(rates[2:]) / 2 < sum(rates[:2]) / 2  # hard levels pass less
