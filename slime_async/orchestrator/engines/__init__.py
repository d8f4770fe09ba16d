"""Engine backends: the ways a run gets its rollout engines, by name.

Owns the built-in backends' code and their registration (one line each, below), and re-exports
the registry (`register_engine_backend`, `get_engine_backend`, `available_engine_backends`,
`resolve_engine_backend`, in `slime_async.config.engine_backends`) and `launch_engine_config`.
Backends implement `slime_async.contracts.engine.EngineBackend`; the run meets them only
through that protocol. The fleet's flags (`EngineFleetConfig`) and each built-in backend's needs
(`BUILTIN_NEEDS`) are config facts, read when the flags are parsed without loading this code.

| name | file | engines |
|---|---|---|
| `embedded` | `embedded.py` | our engine in a Ray actor (CPU or any device); restartable |
| `sglang` | `sglang.py` | a real SGLang server per GPU, launched by a Ray actor; restartable |
| `external` | `external.py` | servers already running at `--engine-urls`; never started or stopped |

Adding a backend is one file with a class implementing the protocol plus one
`register_engine_backend("name", TheClass)` line at the end of a plugin module selected with
`--engine-backend MODULE:NAME` (a built-in one also adds its needs to `BUILTIN_NEEDS`, so the
flags can be checked before its code loads). Modules here may import Ray (they place engines in
Ray actors); none imports roles or the controller.
"""

from __future__ import annotations

from slime_async.config.engine_backends import (
    available_engine_backends,
    get_engine_backend,
    register_engine_backend,
    resolve_engine_backend,
)
from slime_async.config.engine_fleet import launch_engine_config
from slime_async.orchestrator.engines.embedded import EmbeddedBackend
from slime_async.orchestrator.engines.external import ExternalBackend
from slime_async.orchestrator.engines.sglang import SGLangBackend

register_engine_backend("embedded", EmbeddedBackend)
register_engine_backend("sglang", SGLangBackend)
register_engine_backend("external", ExternalBackend)

__all__ = [
    "available_engine_backends",
    "get_engine_backend",
    "launch_engine_config",
    "register_engine_backend",
    "resolve_engine_backend",
]
