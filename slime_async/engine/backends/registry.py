"""The engine backend registry: names → backend classes.

Owns `register_engine_backend`, `get_engine_backend`, `available_engine_backends` and
`resolve_engine_backend` (a registered name, or `module:name` for a plugin module whose import
registers `name`). A backend is a class implementing `slime_async.contracts.engine.EngineBackend`,
built as `cls(fleet_cfg, engine_cfg)`. Must never import the built-in backends (the package
`__init__` registers them) or anything outside the contracts.
"""

from __future__ import annotations

import importlib

from slime_async.contracts.engine import EngineBackend

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
    if name in _BACKENDS and _BACKENDS[name] is not backend and not replace:
        raise ValueError(
            f"engine backend {name!r} is already registered; pick another name or pass replace=True"
        )
    _BACKENDS[name] = backend
    return backend


def available_engine_backends() -> list[str]:
    """Registered backend names, sorted."""
    return sorted(_BACKENDS)


def get_engine_backend(name: str) -> type[EngineBackend]:
    """The backend class registered as `name`; unknown names raise ValueError with the choices."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown engine backend {name!r}; choose one of {', '.join(available_engine_backends())}"
            ", or give MODULE:NAME for a plugin module that registers NAME"
        ) from None


def resolve_engine_backend(value: str) -> str:
    """`value` as a registered name: a name as is, or `module:name` after importing `module`
    (whose import must call `register_engine_backend(name, ...)`)."""
    if ":" not in value:
        get_engine_backend(value)
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
