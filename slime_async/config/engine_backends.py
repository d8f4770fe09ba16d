"""The engine backend registry: names → what each backend needs, and its class.

Owns `BUILTIN_NEEDS` (the built-in backends' names and needs: the facts the config wing reads
when the flags are parsed, before any backend code is loaded), `register_engine_backend`,
`get_engine_backend` (the class, for the orchestrator), `engine_backend_needs` (the needs, for
the config wing), `available_engine_backends` and `resolve_engine_backend` (a known name, or
`module:name` for a plugin module whose import registers `name`). A backend is a class
implementing `slime_async.contracts.engine.EngineBackend`, built as `cls(fleet_cfg, engine_cfg)`;
the built-in ones live in `slime_async.orchestrator.engines`, whose import registers them. Must
never import a backend implementation or anything outside the contracts.
"""

from __future__ import annotations

import importlib

from slime_async.contracts.engine import EngineBackend, EngineNeeds

BUILTIN_NEEDS: dict[str, EngineNeeds] = {
    "embedded": EngineNeeds(model_dir=True, versioned_adapters=True, distributed_adapters=True),
    "sglang": EngineNeeds(
        model_dir=True,
        gpus_per_engine=1,
        collective_backend="nccl",
        checkpoint_to_start=True,
        sglang_flags=True,
    ),
    "external": EngineNeeds(model_dir=False, urls=True, owns_processes=False),
}
"""The built-in backends' needs; each class (`slime_async.orchestrator.engines`) declares the
entry of its name as its `needs`, and registering it under that name checks they agree."""

_BACKENDS: dict[str, type[EngineBackend]] = {}


def register_engine_backend(
    name: str, backend: type[EngineBackend], *, replace: bool = False
) -> type[EngineBackend]:
    """Register `backend` (a class) under `name`; returns it, so it can decorate the class."""
    if not name or ":" in name or "," in name:
        raise ValueError(f"engine backend name {name!r} must be non-empty without ':' or ','")
    for attr in ("needs", "can_restart", "preflight", "start", "alive", "stop"):
        if not hasattr(backend, attr):
            raise TypeError(
                f"engine backend {name!r} ({backend!r}) lacks {attr!r}; implement "
                "slime_async.contracts.engine.EngineBackend"
            )
    if name in BUILTIN_NEEDS and backend.needs != BUILTIN_NEEDS[name] and not replace:
        raise ValueError(
            f"engine backend {name!r}: its needs {backend.needs} differ from the built-in "
            f"backend's {BUILTIN_NEEDS[name]}; register it under another name"
        )
    if name in _BACKENDS and _BACKENDS[name] is not backend and not replace:
        raise ValueError(
            f"engine backend {name!r} is already registered; pick another name or pass replace=True"
        )
    _BACKENDS[name] = backend
    return backend


def available_engine_backends() -> list[str]:
    """Known backend names (the built-in ones and those registered), sorted."""
    return sorted(set(BUILTIN_NEEDS) | set(_BACKENDS))


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown engine backend {name!r}; choose one of {', '.join(available_engine_backends())}"
        ", or give MODULE:NAME for a plugin module that registers NAME"
    )


def engine_backend_needs(name: str) -> EngineNeeds:
    """What the backend `name` needs from the run, without loading a built-in backend's code;
    unknown names raise ValueError with the choices."""
    if name in _BACKENDS:
        return _BACKENDS[name].needs
    if name in BUILTIN_NEEDS:
        return BUILTIN_NEEDS[name]
    raise _unknown(name)


def get_engine_backend(name: str) -> type[EngineBackend]:
    """The backend class registered as `name` (the built-in ones are registered once
    `slime_async.orchestrator.engines` is imported); unknown names raise ValueError with the
    choices."""
    try:
        return _BACKENDS[name]
    except KeyError:
        if name in BUILTIN_NEEDS:
            raise ValueError(
                f"engine backend {name!r} is built in but not loaded: import "
                "slime_async.orchestrator.engines first"
            ) from None
        raise _unknown(name) from None


def resolve_engine_backend(value: str) -> str:
    """`value` as a registered name: a name as is, or `module:name` after importing `module`
    (whose import must call `register_engine_backend(name, ...)`)."""
    if ":" not in value:
        engine_backend_needs(value)
        return value
    module, _, name = value.partition(":")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"engine backend plugin module {module!r} cannot be imported: {e}") from e
    if name not in _BACKENDS:
        raise ValueError(
            f"importing {module!r} did not register an engine backend named {name!r}; it has "
            f"{', '.join(available_engine_backends())}"
        )
    return name
