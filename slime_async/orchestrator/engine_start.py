"""The engine side of a run's start: engines and the router, and the weights they begin on.

Owns `start_engines` (the engines behind a router, the weight transport built for them, all
serving the start version), `start_cluster` (`Cluster.start` with the run's placement and
binding) and `engines_early` (the engines started while the trainer comes up, where they need
nothing of it: `EarlyEngines`). `slime_async.orchestrator.launch.setup_run` calls them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import ray

from slime_async import startup
from slime_async.config.run_config import RunConfig
from slime_async.contracts.engine import EngineBackend
from slime_async.contracts.weights import WeightTransport
from slime_async.orchestrator.placement import Placement
from slime_async.orchestrator.roles import Cluster
from slime_async.orchestrator.trainer_start import TrainerSide
from slime_async.orchestrator.transport import (
    build_transport,
    serves_start_export,
    source_before_export,
    start_source,
)
from slime_async.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EarlyEngines:
    """Engines and router started while the trainer comes up (`engines_early`)."""

    task: asyncio.Task[Cluster]
    adopted: bool = False

    async def take(self) -> Cluster:
        """The started cluster, now the run's (its failure to start is raised here)."""
        cluster = await self.task
        self.adopted = True
        return cluster

    async def release(self) -> None:
        """A start that failed before the run took them: wait the engines out, stop them."""
        if self.adopted:
            return
        try:
            cluster = await self.task
        except BaseException:
            return  # `Cluster.start` leaves nothing running when it fails
        await cluster.stop()


def engines_early(
    cfg: RunConfig,
    backend: EngineBackend,
    travel: type[WeightTransport],
    trainer_cfg: TrainerConfig,
    placement: Placement | None,
    undo: list[Callable[[], Any]],
) -> EarlyEngines | None:
    """Start the engines and the router while the trainer comes up, where they need nothing of
    it: a fresh run (version 0) whose transport sends the whole model (`source_before_export`),
    the transport then loading the trainer's v0 before anything generates, as it does after a
    start in turn. Start-up then takes the longer of the two instead of their sum. None where
    the engines must wait (they start on the export, a resume, `--debug-rollout-only`)."""
    src = source_before_export(cfg, travel)
    if src is None or trainer_cfg.load or cfg.debug_rollout_only:
        return None
    early = EarlyEngines(asyncio.create_task(start_cluster(cfg, backend, src, 0, placement)))
    undo.append(early.release)
    return early


async def start_engines(
    cfg: RunConfig,
    backend: EngineBackend,
    travel: type[WeightTransport],
    side: TrainerSide,
    placement: Placement | None = None,
    early: EarlyEngines | None = None,
) -> tuple[Cluster, WeightTransport]:
    """Engines, a router in front, the weight transport `travel` built for them, all serving
    the `side.start` version.
    Engines start on `start_source` (the trainer's export `first`, unless the transport sends
    the whole model itself: then they need no shared filesystem and never read the run
    directory); they get `version` through the transport before anything generates unless they
    already serve it (`serves_start_export`). On a joined cluster engines bind their nodes' IPs
    and the router this driver's node IP. A directory transport hands each directory it writes
    to the forward-only `role`; otherwise `Run._feed_role` exports one for it. Without a
    `trainer` (`--debug-rollout-only`) they start on `first`, the checkpoint, and load nothing.
    `early`: the engines `engines_early` started meanwhile (their failure is raised here)."""

    trainer, role, version = side.trainer, side.role, side.start.version
    if early is not None:
        cluster = await early.take()
        if version != 0:  # `engines_early` starts only fresh runs
            await cluster.stop()
            raise RuntimeError(f"engines started early for v0, but the trainer is at v{version}")
    else:
        first = side.first
        start_from = start_source(cfg, travel, first) if trainer is not None else str(first)
        cluster = await start_cluster(cfg, backend, start_from, version, placement)
    transport = build_transport(
        travel, cfg, trainer=trainer, cluster=cluster, backend=backend, role=role
    )
    if trainer is not None and not serves_start_export(travel, backend):
        startup.say(f"engines load version {version} through the {cfg.weights.transport} transport")
        try:
            await transport.load(version)
        except BaseException:
            await cluster.stop()
            raise
        log.info("engines attached and serving the trainer's weights v%d", version)
    return cluster, transport


async def start_cluster(
    cfg: RunConfig,
    backend: EngineBackend,
    start_from: str,
    version: int,
    placement: Placement | None,
) -> Cluster:
    """`Cluster.start` for the run: `num_engines` engines on `start_from` ("" builds the
    architecture), a router in front. On a joined cluster engines bind their nodes' IPs and the
    router this driver's node IP."""
    joined = cfg.ray_address is not None
    if not start_from:  # built from the architecture
        backend.engine = dataclasses.replace(backend.engine, model_spec=cfg.model.to_dict())
    n = cfg.engines.num_engines
    verb = "attaching" if backend.needs.urls else "starting"
    startup.say(f"{verb} {n} engine(s) ({cfg.engines.backend}) and the router")
    cluster = await Cluster.start(
        backend=backend,
        num_engines=n,
        model_dir=start_from,
        version=version,
        seed=cfg.engine.seed,
        router_cfg=cfg.router,
        rollout_cores=cfg.rollout_cores,
        slots=placement.engines if placement is not None and placement.engines else None,
        bind_node_ips=joined,
        pin_slot_cores=joined and not cfg.colocate,
        router_host=ray.util.get_node_ip_address() if joined else None,
    )
    startup.say(f"router on {cluster.router_url} in front of {len(cluster.engines)} engine(s)")
    return cluster
