"""Silence megatron-core's warnings about optional dependencies this project runs without.

Owns `OPTIONAL_DEPENDENCY_WARNINGS` (the messages) and `quiet_optional_dependency_warnings()`,
which installs one `warnings` filter per message, scoped to megatron's modules. megatron-core
warns at import, once per module, that Apex, TransformerEngine or absl are missing and it falls
back to its own implementations (Torch norm, Torch optimizers, local multi-tensor kernels):
~12 lines of stderr per trainer process that say nothing about the run. Every other warning,
megatron's included, still shows. Must be called before megatron's modules are first imported
in the process (`MegatronTrainer.__init__` does, first thing). Imports only the standard
library; must never import torch, megatron or any other part of `slime_async`.
"""

from __future__ import annotations

import warnings

OPTIONAL_DEPENDENCY_WARNINGS: tuple[str, ...] = (
    r"(Transformer Engine and )?Apex (is|are) not installed\. Falling back to ",
    r"absl\.logging is not installed\. ",
)
"""Regexes matched against the start of a warning's message (`warnings.filterwarnings`)."""

_MEGATRON_MODULES = r"megatron"
"""Matched against the start of the warning's module name: `megatron.core.*` and a separately
installed `megatron_fsdp`."""


def quiet_optional_dependency_warnings() -> None:
    """Ignore megatron's optional-dependency `UserWarning`s in this process (idempotent:
    `warnings.filterwarnings` replaces an identical filter instead of adding another)."""
    for message in OPTIONAL_DEPENDENCY_WARNINGS:
        warnings.filterwarnings(
            "ignore", message=message, category=UserWarning, module=_MEGATRON_MODULES
        )
