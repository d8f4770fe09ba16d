"""EngineConfig validation, its flags, and the argv round trip the subprocess launcher uses."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from slime_async.engine import EngineConfig, EngineServer, add_engine_args, engine_config_from_args
from slime_async.engine.runner import config_to_argv


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dtype": "fp16"}, "dtype must be"),
        ({"max_running_requests": 0}, "max.running.requests"),
        ({"max_prefill_tokens": 0}, "max.prefill.tokens"),
        ({"port": 70000}, "port"),
        ({"model_dir": "/x", "model_spec": {}}, "not both"),
        ({"gguf_file": "a.gguf"}, "gguf_file needs model_dir"),
        ({"context_length": 1}, "context.length"),
        (
            {"always_return_routed_experts": True, "enable_return_routed_experts": False},
            "always_return_routed_experts",
        ),
    ],
)
def test_bad_engine_config_names_the_problem(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kwargs)


def test_argv_round_trip() -> None:
    cfg = EngineConfig(
        port=1234,
        model_dir="/ckpt",
        seed=7,
        dtype="fp32",
        max_running_requests=5,
        max_prefill_tokens=99,
        context_length=512,
        weight_version="4",
        served_model_name="pol",
        always_return_routed_experts=True,
        bf16_via_fp32=False,
        num_threads=1,
    )
    args = add_engine_args(argparse.ArgumentParser()).parse_args(config_to_argv(cfg))
    assert engine_config_from_args(args) == cfg
    defaults = engine_config_from_args(add_engine_args(argparse.ArgumentParser()).parse_args([]))
    assert defaults == EngineConfig()
    assert dataclasses.replace(defaults, dtype="fp32").dtype == "fp32"


def test_start_failure_is_reported(tmp_path) -> None:
    srv = EngineServer(EngineConfig(model_dir=str(tmp_path / "missing")))
    with pytest.raises(RuntimeError, match="not a directory"):
        srv.start(timeout=60)
    srv.stop()


def test_a_built_architecture_travels_on_the_command_line() -> None:
    """An engine that builds its model (weights arrive by the distributed transport) gets the
    spec on its command line and rebuilds exactly that config; bad input names the flag."""
    from slime_async.contracts.model import ModelSpec

    spec = ModelSpec(hidden_size=64, head_dim=16).to_dict()
    cfg = EngineConfig(model_spec=spec)
    args = add_engine_args(argparse.ArgumentParser()).parse_args(config_to_argv(cfg))
    assert engine_config_from_args(args).model_spec == spec
    bad = add_engine_args(argparse.ArgumentParser()).parse_args(["--model-spec", "[1]"])
    with pytest.raises(ValueError, match="--model-spec must be a JSON object"):
        engine_config_from_args(bad)


def test_bf16_matmuls_go_via_fp32_only_where_the_cpu_lacks_native_bf16() -> None:
    """Unset, the engine runs bf16 GEMMs through fp32 only on a CPU without AMX/AVX512_BF16;
    `--bf16-via-fp32` and `--bf16-native-matmul` decide on any CPU."""
    from slime_async.engine.model import use_bf16_via_fp32

    parse = add_engine_args(argparse.ArgumentParser()).parse_args
    assert engine_config_from_args(parse([])).bf16_via_fp32 is None
    assert engine_config_from_args(parse(["--bf16-native-matmul"])).bf16_via_fp32 is False
    assert engine_config_from_args(parse(["--bf16-via-fp32"])).bf16_via_fp32 is True
    assert use_bf16_via_fp32(None, None) and not use_bf16_via_fp32(None, "amx_bf16")
    assert use_bf16_via_fp32(True, "amx_bf16") and not use_bf16_via_fp32(False, None)


def test_native_bf16_and_bf16_via_fp32_give_the_same_logits_to_bf16_rounding() -> None:
    """Both paths are bf16 GEMMs with fp32 accumulation: a small llama's bf16 logits agree to
    a few bf16 roundings of their largest entry."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slime_async.engine.model import Bf16ViaFp32

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 512, (4, 24))
    with torch.no_grad():
        native = model(input_ids=ids).logits.float()
        with Bf16ViaFp32():
            via = model(input_ids=ids).logits.float()
    assert (native - via).abs().max().item() <= 4 * 2**-8 * via.abs().max().item()
