"""megatron-core's optional-dependency warnings ("Apex is not installed. Falling back to ...")
are filtered by `slime_async.trainer.quiet` before megatron is first imported, and only they.

Each case is a fresh interpreter: megatron warns once, when a module is first imported, so an
in-process check would see nothing whichever way the filter worked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]

WARNERS = (
    "megatron.core.optimizer",
    "megatron.core.models.backends",
    "megatron.core.models.gpt.gpt_layer_specs",
)
"""megatron modules that warn at import when Apex/TransformerEngine are missing (the optimizer
package pulls in megatron_fsdp's mixed precision, which warns too)."""

MARKERS = ("Apex is not installed", "Apex are not installed")


def _stderr(quiet: bool) -> str:
    code = textwrap.dedent(f"""
        import importlib, warnings
        if {quiet}:
            from slime_async.trainer.quiet import quiet_optional_dependency_warnings
            quiet_optional_dependency_warnings()
        for name in {WARNERS!r}:
            importlib.import_module(name)
        # precision: the same text from another package, and another megatron warning, show
        warnings.warn_explicit("Apex is not installed. Falling back to x", UserWarning,
                               "elsewhere.py", 1, module="elsewhere")
        warnings.warn_explicit("an unrelated megatron warning", UserWarning,
                               "megatron/core/x.py", 1, module="megatron.core.x")
        import os, sys  # done: skip the interpreter's teardown of torch and megatron (seconds)
        sys.stderr.flush()
        os._exit(0)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _megatron_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if "/megatron" in ln and any(m in ln for m in MARKERS)]


def test_the_filter_silences_only_megatrons_optional_dependency_warnings() -> None:
    loud = _stderr(quiet=False)
    if not _megatron_lines(loud):
        pytest.skip("Apex/TransformerEngine installed here: megatron has nothing to warn about")
    assert len(_megatron_lines(loud)) >= 4, loud  # norm, optimizers, multi-tensor kernels
    quiet = _stderr(quiet=True)
    assert _megatron_lines(quiet) == [], quiet
    assert "elsewhere.py:1: UserWarning: Apex is not installed" in quiet
    assert "an unrelated megatron warning" in quiet


def test_importing_the_trainer_module_imports_none_of_the_warning_modules() -> None:
    """`MegatronTrainer.__init__` installs the filter; that is early enough only while the
    module's own imports leave megatron's warning modules unimported."""
    code = (
        f"import sys, slime_async.trainer.trainer, slime_async.trainer.actor, "
        f"slime_async.trainer.behavior_role; "
        f"print([m for m in {WARNERS!r} if m in sys.modules], flush=True); "
        f"import os; os._exit(0)"  # skip the interpreter's teardown of torch (seconds)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
