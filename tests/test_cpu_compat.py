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


def test_megatron_is_imported_without_the_loggers_nothing_here_uses():
    """The trainer's and the role's actors import megatron through `import_megatron_lean`:
    wandb and torch's tensorboard writer (megatron's timers' loggers) are not loaded, ~22 MiB
    less per process, and stay importable afterwards. In a fresh process (this one has
    megatron already)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from slime_async.trainer import cpu_compat\n"
        "cpu_compat.import_megatron_lean()\n"
        "from megatron.core import timers\n"
        "import slime_async.trainer.model\n"
        "assert timers.wandb is None and timers.SummaryWriter is None\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'tensorboard'))\n"
        "assert not loaded, loaded[:5]\n"
        "import importlib.util\n"
        "assert all(importlib.util.find_spec(m) for m in cpu_compat._UNUSED_BY_MEGATRON)\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip().endswith("ok"), p.stderr[-2000:]
