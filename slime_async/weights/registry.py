"""The weight transport registry: (name, payload) → transport class.

Owns `TransportSetup` (everything a run offers a transport to build itself from),
`register_weight_transport`, `get_weight_transport`, `available_weight_transports` and
`resolve_weight_transport` (a registered name, or `module:name` for a plugin module whose
import registers `name`). A transport is a class implementing
`slime_async.contracts.weights.WeightTransport` whose `payload` says what it moves (the full
weights or the LoRA adapter) and whose classmethod `from_setup(setup)` builds it; one name (a
`--update-weight-transport` value) may hold one class per payload. Must never import the
built-in transports (the package `__init__` registers them), Ray or the trainer.

Example::

    register_weight_transport("disk", DiskTransport)           # payload: full
    register_weight_transport("disk", AdapterTransport)        # payload: adapter
    cls = get_weight_transport("disk", Payload.ADAPTER)        # -> AdapterTransport
    transport = cls.from_setup(setup)
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from router.client import RouterClient
from slime_async.contracts.adapter import LoraSpec
from slime_async.contracts.weights import Payload, WeightTransport
from slime_async.weights.config import WeightSyncConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransportSetup:
    """What a run hands `from_setup`: each transport takes the parts it needs."""

    run_dir: Path
    """The run directory: directory transports write their versions under it."""
    trainer: Any
    """The trainer group: it writes versions (`save_weights`, `save_adapter`), is the sender of
    the full weights (`slime_async.weights.WeightSender`) and gives the adapter's
    (`adapter_sender()`)."""
    control: RouterClient
    """The router's control client (pause, loads fanned out to every engine)."""
    engine_urls: Callable[[], Sequence[str]]
    """The engines now (read at every push: the supervisor may have replaced some)."""
    cfg: WeightSyncConfig
    """`--update-weight-*`."""
    collective_backend: str = "gloo"
    """The engines' collective backend (gloo for CPU engines, NCCL for GPU ones)."""
    token: str | None = None
    """The run's shared token (engines off loopback require it on every route)."""
    on_written: Callable[[int, Path], object] | None = None
    """Called with (version, directory) after a directory transport wrote it (the forward-only
    role's feed); None: nobody listens."""
    lora: LoraSpec | None = None
    """The run's LoRA adapter (None: full-weight training)."""


_TRANSPORTS: dict[tuple[str, Payload], type[WeightTransport]] = {}
_NEEDS = ("payload", "shared_filesystem", "writes_directories", "from_setup", "load", "push")


def register_weight_transport(
    name: str, transport: type[WeightTransport], *, replace: bool = False
) -> type[WeightTransport]:
    """Register `transport` (a class) under `name` for its `payload`; returns it, so it can
    decorate the class."""
    if not name or ":" in name or "," in name:
        raise ValueError(f"weight transport name {name!r} must be non-empty without ':' or ','")
    for attr in (*_NEEDS, "close"):
        if not hasattr(transport, attr):
            raise TypeError(
                f"weight transport {name!r} ({transport!r}) lacks {attr!r}; implement "
                "slime_async.contracts.weights.WeightTransport and a from_setup classmethod"
            )
    key = (name, Payload(transport.payload))
    if _TRANSPORTS.get(key, transport) is not transport and not replace:
        raise ValueError(
            f"a {key[1]} weight transport {name!r} is already registered; pick another name or "
            "pass replace=True"
        )
    _TRANSPORTS[key] = transport
    return transport


def available_weight_transports(payload: Payload | None = None) -> list[str]:
    """Registered names (of transports moving `payload`, when given), sorted."""
    return sorted({n for n, p in _TRANSPORTS if payload is None or p is payload})


def get_weight_transport(name: str, payload: Payload) -> type[WeightTransport]:
    """The class registered as `name` for `payload`; unknown pairs raise ValueError with the
    choices."""
    try:
        return _TRANSPORTS[(name, payload)]
    except KeyError:
        raise ValueError(
            f"no weight transport {name!r} moves the {payload} payload; choose one of "
            f"{', '.join(available_weight_transports(payload))}, or give MODULE:NAME for a "
            "plugin module that registers NAME"
        ) from None


def resolve_weight_transport(value: str) -> str:
    """`value` as a registered name: a name as is, or `module:name` after importing `module`
    (whose import must call `register_weight_transport(name, ...)`)."""
    if ":" not in value:
        return value
    module, _, name = value.partition(":")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(
            f"weight transport plugin module {module!r} cannot be imported: {e}"
        ) from e
    if name not in available_weight_transports():
        raise ValueError(
            f"importing {module!r} did not register a weight transport named {name!r}; it has "
            f"{', '.join(available_weight_transports())}"
        )
    return name
