"""How this run's weights travel: the transport chosen once, and what the run asks it.

Owns `transport_class` (the one place that reads what a push moves, the full weights or, with
`--lora-rank`, the adapter, and picks the registered transport of `--update-weight-transport`
for it), `build_transport`, `start_source` (what engines start on), `serves_start_export`,
`give_role_start` and `feed_role` (the forward-only role's copy of a version when no directory
is handed over).
Everything else in the orchestrator asks the transport (`payload`, `shared_filesystem`,
`writes_directories`, `on_written`); nothing else reads `--lora-rank` to decide how weights
travel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slime_async.config.run_config import RunConfig
from slime_async.contracts.adapter import ADAPTER_NAME, lora_spec
from slime_async.contracts.engine import EngineBackend
from slime_async.contracts.weights import Payload, WeightTransport
from slime_async.weights import TransportSetup, get_weight_transport, resolve_weight_transport


def transport_class(cfg: RunConfig) -> type[WeightTransport]:
    """The registered transport named by `--update-weight-transport` (or `MODULE:NAME` of a
    plugin) that moves this run's payload: the adapter with `--lora-rank`, else the full
    weights."""
    payload = Payload.ADAPTER if cfg.trainer.lora_rank else Payload.FULL
    return get_weight_transport(resolve_weight_transport(str(cfg.weights.transport)), payload)


def lora_name(cls: type[WeightTransport]) -> str | None:
    """The adapter name generation requests ask for, when pushes move the adapter."""
    return ADAPTER_NAME if cls.payload is Payload.ADAPTER else None


def build_transport(
    cls: type[WeightTransport],
    cfg: RunConfig,
    *,
    trainer: Any,
    cluster: Any,
    backend: EngineBackend,
    role: Any = None,
) -> WeightTransport:
    """`cls` built for this run: the trainer, the router's control client, the engines, the
    weight-sync settings, and the forward-only `role`'s feed for directory transports."""
    setup = TransportSetup(
        run_dir=cfg.run_dir,
        trainer=trainer,
        control=cluster.control,
        # read at every push: replacements come and go, sleeping engines get no push
        engine_urls=lambda: cluster.awake_urls,
        cfg=cfg.weights,
        collective_backend=backend.needs.collective_backend,
        token=cfg.engine.admin_api_key or cfg.engine.api_key,
        on_written=None if role is None else role.add_version,
        lora=lora_spec(cfg.trainer, cfg.model),
    )
    return cls.from_setup(setup)  # type: ignore[attr-defined]


def sends_start_weights(cls: type[WeightTransport]) -> bool:
    """Whether the transport hands the engines the whole model itself (the full payload without
    a shared filesystem): then engines need not start on the trainer's export."""
    return cls.payload is Payload.FULL and not cls.shared_filesystem


def serves_start_export(cls: type[WeightTransport], backend: EngineBackend) -> bool:
    """Whether engines that started on the trainer's export already serve the start version,
    so the transport need not load it: full weights by files, and a backend that starts its
    engines on a model directory."""
    return cls.payload is Payload.FULL and cls.shared_filesystem and backend.needs.model_dir


def start_source(cfg: RunConfig, cls: type[WeightTransport], first: Path) -> str:
    """What engines (and replacements) start on: the trainer's export `first`, unless the
    transport sends the whole model itself (`source_before_export`). LoRA: always `first` (the
    frozen base; only the adapter travels, whichever transport)."""
    src = source_before_export(cfg, cls)
    return str(first.resolve()) if src is None else src


def source_before_export(cfg: RunConfig, cls: type[WeightTransport]) -> str | None:
    """What engines start on when that need not wait for the trainer's export: with a transport
    that sends the whole model itself (`sends_start_weights`), `--hf-checkpoint` or "" (build
    the architecture), the transport then loading the trainer's weights; None otherwise."""
    if sends_start_weights(cls):
        if cfg.trainer.hf_checkpoint:
            return cfg.trainer.hf_checkpoint
        if not cfg.engines.needs.checkpoint_to_start:  # built from the spec
            return ""
        # SGLang cannot start without a checkpoint: the trainer's export, which the engine
        # nodes must then be able to read (give --hf-checkpoint on a cluster, as in slime)
    return None


def give_role_start(role: Any, cls: type[WeightTransport], first: Path, version: int) -> None:
    """The forward-only `role`'s start: the trainer's export `first` as `version`; when pushes
    move the adapter, `first` is the frozen base instead, and the start adapter comes the way
    every adapter version does (the transport's directory, else `feed_role`)."""
    if cls.payload is Payload.ADAPTER:
        role.set_base(first)
    else:
        role.add_version(version, first)


async def feed_role(role: Any, transport: WeightTransport, trainer: Any, version: int) -> None:
    """Give the forward-only `role` `version`'s weights (the adapter, when pushes move the
    adapter) before any engine serves it. A directory transport hands over the directory it
    writes (`on_written`); any other transport has no such directory, so trainer rank 0 writes
    the version in the parameters' dtype as one file in this node's memory file system, which
    the role maps and removes (`BehaviorRole.version_file`: no copy in the object store, none
    in the driver), or, where rank 0 is on another node or the memory file system has no
    room, puts it in Ray's object store for the role. The role loads it in order."""
    if role is None or transport.on_written is not None:
        return
    if transport.payload is Payload.ADAPTER:  # the adapter alone (the role holds the base)
        role.add_version(version, await trainer.export_adapter_ref())
        return
    path = role.version_file(version, trainer.node_ips[0])
    if path is not None:  # one file in memory on this node, mapped by the role: no copy
        await trainer.write_weights_file(path)
        role.add_version_file(version, path)
    else:
        role.add_version(version, await trainer.export_weights_ref())
