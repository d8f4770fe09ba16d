"""The start-up memory check (`slime_async/config/memory_plan.py`, the `memory` rule of `slime_async.config.rules`): parameter counts
against real models, a derived forward-only role that would not fit becomes `--behavior-forward
trainer` (logged with the numbers), a run that cannot fit is refused with them, and a user's
`--behavior-forward role` is never changed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slime_async.config import Environment, build_parser, validate
from slime_async.config.memory_plan import MEMORY_FRACTION, param_count
from slime_async.config.rules.memory import memory_parts
from slime_async.contracts.model import SMOLLM2_135M, TINY_MOE, ModelSpec

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

SMOLLM2 = SMOLLM2_135M
ASYNC = ("--hf-checkpoint", "/m", "--prompt-data", "t.jsonl", "--keep-old-actor")


def _cfg(*argv: str, memory: int | None):
    env = Environment(model=SMOLLM2, cpus=(0, 1), memory_bytes=memory)
    return validate(build_parser().parse_args(list(argv)), env)


def test_param_count_matches_built_models():
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.forward_only import ForwardOnlyModel

    assert param_count(SMOLLM2) == 134_515_008  # SmolLM2-135M's published count
    for spec in (TINY_MOE, ModelSpec(family="qwen2", num_layers=1)):
        model = ForwardOnlyModel(TrainerConfig(), spec).model
        assert param_count(spec) == sum(p.numel() for p in model.parameters()), spec.family


def test_a_role_that_would_not_fit_is_derived_away_with_the_numbers():
    free = _cfg(*ASYNC, memory=None)
    assert free.trainer.behavior_forward == "role"  # what the run derives with room to spare
    lean = _cfg(*ASYNC, "--behavior-forward", "trainer", memory=None)
    need_role, need_trainer = (sum(memory_parts(c).values()) for c in (free, lean))
    assert need_trainer < need_role
    memory = int((need_role + need_trainer) / 2 / MEMORY_FRACTION)
    cfg = _cfg(*ASYNC, memory=memory)
    assert cfg.trainer.behavior_forward == "trainer"
    why = cfg.derived["--behavior-forward"].why
    assert "would not fit" in why and "GiB" in why and "role" in why
    assert cfg.trainer.max_snapshots == lean.trainer.max_snapshots  # re-derived for the trainer
    assert dataclasses.replace(cfg, derived={}, flags=()) == dataclasses.replace(
        lean, derived={}, flags=()
    )


def test_a_run_that_cannot_fit_is_refused_with_the_numbers_and_a_given_role_is_kept():
    with pytest.raises(ValueError, match=r"would not fit .*trainer .* GiB .*--bf16"):
        _cfg(*ASYNC, memory=2 * 1024**3)
    free = _cfg(*ASYNC, memory=None)
    memory = int(sum(memory_parts(free).values()) / MEMORY_FRACTION) - 1
    with pytest.raises(ValueError, match="role"):  # the user asked for the role: refused
        _cfg(*ASYNC, "--behavior-forward", "role", memory=memory)
    assert _cfg(*ASYNC, memory=64 * 1024**3).trainer.behavior_forward == "role"


def test_with_lora_the_role_holds_the_base_once_and_an_adapter_per_version():
    from slime_async.config.memory_plan import RunShape, role_bytes
    from slime_async.contracts.adapter import LoraSpec, adapter_numel

    lora = LoraSpec(rank=8, alpha=16.0)
    a, n = adapter_numel(SMOLLM2, lora), param_count(SMOLLM2)
    shape = RunShape(params=n, role_versions=3, trainer_snapshots=0, adapter_params=a)
    assert role_bytes(shape)["role"] == 4 * n + 4 * a * (1 + 3)
    full = role_bytes(dataclasses.replace(shape, adapter_params=0))
    assert full["role"] == 4 * n * 4 and role_bytes(shape)["trainer"] < full["trainer"]
    cfg = _cfg(*ASYNC, "--lora-rank", "8", "--behavior-forward", "role", memory=None)
    parts = memory_parts(cfg)
    want = 4 * n + 4 * a * (1 + cfg.trainer.max_snapshots)
    assert parts["role"] == want
