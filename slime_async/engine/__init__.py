"""Inference engines that speak SGLang's HTTP API.

Owns: the embedded engine (HF model, continuous batching, SGLang routes) and the launcher of real
SGLang servers on GPUs (`slime_async.engine.sglang`). Public surface:

* `EngineConfig` — the embedded engine's config (`add_engine_args` builds its flags).
* `EngineServer(cfg).start() -> url` / `.stop()` — in-process server (tests, Ray actors).
* `EngineProcess(cfg).start() -> url` / `.stop()` — `python -m slime_async.engine` child process.
* `SGLangConfig` / `SGLangServer(cfg).start() -> url` / `.stop()` — real SGLang on GPUs.

The subpackage `backends` (how a run gets its engines: registry, fleet flags, the embedded /
sglang / external backends) is imported on its own and may use Ray; the engine core may not.

Must never import the trainer, the controller, Ray (outside `backends`), or the leaves'
internals. Heavy modules (torch, transformers, aiohttp) load lazily on first attribute access.
"""

from __future__ import annotations

from typing import Any

from slime_async.engine.config import EngineConfig, add_engine_args, engine_config_from_args

__all__ = [
    "EngineConfig",
    "EngineProcess",
    "EngineServer",
    "SGLangConfig",
    "SGLangServer",
    "add_engine_args",
    "engine_config_from_args",
]


def __getattr__(name: str) -> Any:
    if name in ("EngineServer", "EngineProcess"):
        from slime_async.engine import runner

        return getattr(runner, name)
    if name in ("SGLangConfig", "SGLangServer"):
        from slime_async.engine import sglang

        return getattr(sglang, name)
    raise AttributeError(f"module 'slime_async.engine' has no attribute {name!r}")
