"""`slime_async.trainer.cpu_compat`: which patches apply where."""

from __future__ import annotations


def test_the_te_names_moe_routing_reads_are_defined_on_gpus_too(monkeypatch):
    """megatron-core 0.16.1 without TransformerEngine reads `te_general_gemm` in its MoE router
    on any device (a NameError on an H200): `apply()` defines it even where CUDA is usable,
    and leaves every CPU-only patch off there."""
    from megatron.core.transformer.moe import moe_utils

    from slime_async.trainer import cpu_compat

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    assert cpu_compat.apply() is False  # the CPU patches stay off
    assert moe_utils.te_general_gemm is None  # the router's check reads None, not a NameError
