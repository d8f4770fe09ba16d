"""Engine backends: the ways a run gets its rollout engines, by name.

Owns the built-in backends and their registration (one line each, below), and re-exports the
registry (`register_engine_backend`, `get_engine_backend`, `available_engine_backends`,
`resolve_engine_backend`) and the fleet config (`EngineFleetConfig`: `--engine-backend`,
`--num-engines`, `--engine-urls`, `--engine-attach-timeout`). Backends implement
`slime_async.contracts.engine.EngineBackend`; the run meets them only through that protocol.

| name | file | engines |
|---|---|---|
| `embedded` | `embedded.py` | our engine in a Ray actor (CPU or any device); restartable |
| `sglang` | `sglang.py` | a real SGLang server per GPU, launched by a Ray actor; restartable |
| `external` | `external.py` | servers already running at `--engine-urls`; never started or stopped |

Adding a backend is one file with a class implementing the protocol plus one
`register_engine_backend("name", TheClass)` line: here for a built-in, or at the end of a
plugin module selected with `--engine-backend MODULE:NAME`. Unlike the engine core, modules
here may import Ray (they place engines in Ray actors); none imports roles or the controller.
"""

from __future__ import annotations

from slime_async.engine.backends.config import EngineFleetConfig, launch_engine_config
from slime_async.engine.backends.embedded import EmbeddedBackend
from slime_async.engine.backends.external import ExternalBackend
from slime_async.engine.backends.registry import (
    available_engine_backends,
    get_engine_backend,
    register_engine_backend,
    resolve_engine_backend,
)
from slime_async.engine.backends.sglang import SGLangBackend

register_engine_backend("embedded", EmbeddedBackend)
register_engine_backend("sglang", SGLangBackend)
register_engine_backend("external", ExternalBackend)

__all__ = [
    "EngineFleetConfig",
    "available_engine_backends",
    "get_engine_backend",
    "launch_engine_config",
    "register_engine_backend",
    "resolve_engine_backend",
]
