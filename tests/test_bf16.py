"""bf16 compute: derived from the CPU's flags (never overriding the user's), and its numerics
against fp32 on the same weights (per-token log-probs within a stated tolerance), with fp32
main weights and fp32 gradient accumulation in the optimizer."""

from __future__ import annotations

import pytest
import torch

from slime_async.config import Environment, build_parser, validate
from slime_async.config.hardware import cpu_bf16_feature
from slime_async.contracts.model import TINY_MOE, ModelSpec

pytestmark = pytest.mark.timeout(240)
torch.set_num_threads(1)

LLAMA = ModelSpec(family="llama", num_layers=2)
REAL = ("--hf-checkpoint", "/models/x", "--prompt-data", "train.jsonl")

BF16_LOGPROB_TOL = 0.02
"""Largest |log p_bf16 − log p_fp32| of a token (a bf16 mantissa has 8 bits: ~0.4% per value,
accumulated over two layers and the softmax; measured 0.007, mean 0.002)."""


def test_cpu_flags_name_the_native_bf16_feature():
    assert cpu_bf16_feature("flags\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n") == (
        "amx_bf16"
    )
    assert cpu_bf16_feature("flags\t: fpu avx512f avx512_bf16\n") == "avx512_bf16"
    assert cpu_bf16_feature("flags\t: fpu sse avx2\n") is None
    assert cpu_bf16_feature("") is None


def _validate(*argv: str, cpu_bf16: str | None, model: ModelSpec = LLAMA):
    env = Environment(model=model, cpus=(0, 1), cpu_bf16=cpu_bf16)
    return validate(build_parser().parse_args(list(argv)), env)


def test_bf16_is_derived_for_a_real_model_on_a_bf16_cpu_and_logged():
    cfg = _validate(*REAL, cpu_bf16="avx512_bf16")
    assert cfg.trainer.bf16 is True
    assert "avx512_bf16" in cfg.derived["--bf16"].why
    assert _validate(*REAL, cpu_bf16=None).trainer.bf16 is False
    assert "fp32" in _validate(*REAL, cpu_bf16=None).derived["--bf16"].why
    assert _validate(cpu_bf16="amx_bf16", model=TINY_MOE).trainer.bf16 is False  # embedded


def test_a_user_given_bf16_flag_is_never_changed():
    assert _validate(*REAL, "--no-bf16", cpu_bf16="amx_bf16").trainer.bf16 is False
    assert _validate(*REAL, "--bf16", cpu_bf16=None).trainer.bf16 is True
    assert "--bf16" not in _validate(*REAL, "--no-bf16", cpu_bf16="amx_bf16").derived


def test_engine_dtype_follows_the_cpu_as_the_trainers_bf16_and_the_weights_follow():
    """From `/proc/cpuinfo`'s text: a CPU without native bf16 gets fp32 engines (bf16 would be
    emulated) shipped fp32 weights and counted at 4 bytes a parameter; one with it bf16 engines
    and bf16 weights; a given `--engine-dtype` is kept."""
    from slime_async.config.rules.memory import memory_parts, run_shape

    avx2, avx512 = "flags\t: fpu sse avx2\n", "flags\t: fpu avx512f avx512_bf16\n"
    engine_bytes = {}
    for text, dtype, weights in ((avx2, "fp32", "float32"), (avx512, "bf16", "bfloat16")):
        cfg = _validate(*REAL, cpu_bf16=cpu_bf16_feature(text))
        assert cfg.engine.dtype == dtype and cfg.trainer.bf16 is (dtype == "bf16")
        assert cfg.derived["--engine-dtype"].value == dtype
        assert cfg.weights.dtype == weights
        assert run_shape(cfg).engine_bytes == (2 if dtype == "bf16" else 4)  # the plan follows
        engine_bytes[dtype] = memory_parts(cfg)["engines"]
    assert engine_bytes["fp32"] > engine_bytes["bf16"]
    given = _validate(*REAL, "--engine-dtype", "bf16", cpu_bf16=cpu_bf16_feature(avx2))
    assert given.engine.dtype == "bf16" and "--engine-dtype" not in given.derived
    assert given.weights.dtype == "bfloat16"  # shipped as the engines serve


def test_bf16_logprobs_match_fp32_within_the_stated_tolerance(tmp_path):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    batch = random_batch(LLAMA, batch=4, width=24, prompt=6, seed=1)
    fp32 = MegatronTrainer(TrainerConfig(lr=3e-3, micro_batch_size=2, seed=5), LLAMA)
    for _ in range(3):  # away from the near-uniform initial distribution
        fp32.train_step(batch)
    fp32.save_weights(tmp_path / "w")
    lp32, _ = fp32.compute_logprobs(batch)

    bf = MegatronTrainer(
        TrainerConfig(lr=3e-3, micro_batch_size=2, seed=5, bf16=True, hf_checkpoint=None), LLAMA
    )
    bf.import_hf(tmp_path / "w")
    assert all(p.dtype == torch.bfloat16 for p in bf.model.parameters())
    lp16, _ = bf.compute_logprobs(batch)
    m = batch.loss_mask
    diff = (lp16 - lp32)[m].abs()
    print(f"bf16 vs fp32 log-probs: max {diff.max():.4f}, mean {diff.mean():.5f}")
    assert lp32[m].std() > 0.1  # a non-uniform model: the comparison has teeth
    assert float(diff.max()) <= BF16_LOGPROB_TOL
    assert float(diff.mean()) <= BF16_LOGPROB_TOL / 4

    metrics = bf.train_step(batch)  # fp32 main weights, fp32 gradient buffers
    assert torch.isfinite(torch.tensor(metrics["loss/total"]))
    assert all(p.main_grad.dtype == torch.float32 for p in bf.model.parameters())
    assert bf.version == 1


def test_a_resumed_run_is_not_switched_to_bf16():
    from slime_async.trainer.checkpoint import LoadFacts

    env = Environment(
        model=LLAMA,
        cpus=(0, 1),
        cpu_bf16="amx_bf16",
        load=LoadFacts(path="/ckpt", checkpoint="/ckpt/iter_0000003", version=3),
    )
    args = build_parser().parse_args([*REAL, "--load", "/ckpt"])
    from slime_async.config.rules import Draft, training

    d = Draft.start(args, env)
    d.embedded = False
    training.bf16(d)
    assert d.args.bf16 is False and "resumed" in d.flags.derived["--bf16"].why
