"""The composition root: everything `controller.train` needs before its first step.

Owns `setup_run` (prompt source and rewards, warm start, Ray roles in the right order, resume),
which returns the live `slime_async.orchestrator.run.Run`; each component is built from its
own config, and the weight transport is chosen once (`orchestrator.transport.transport_class`).
Order matters: the trainer comes up first (fresh, from an HF directory, or resumed from
`--load` through the guarded checkpoint loader; `orchestrator.trainer_start`), the launch-time
resume step checks where it stands (`orchestrator.resume`), then its weights are exported and
the engines start *from that export* (engines a backend attaches instead of starting,
`--engine-backend external`, load it through the weight transport before anything generates),
so engines and trainer always begin on identical weights at the same version, and a resume can
never serve anything but the loaded weights. The engine backend is built from the registry here
and checked (`preflight`) before anything expensive starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from data_worker.worker import RolloutDataWorker
from loss import dynamic_sampling_keep
from slime_async import startup
from slime_async.config.recipe import config_json, config_record, derived_lines
from slime_async.config.run_config import RunConfig
from slime_async.contracts.engine import EngineBackend
from slime_async.contracts.rollout import Group, segment_payload
from slime_async.contracts.weights import Payload, WeightTransport, version_dir_name
from slime_async.host import atomic_write_text
from slime_async.metrics import MetricsLogger
from slime_async.metrics.guards import run_guard_config
from slime_async.orchestrator.engines import get_engine_backend
from slime_async.orchestrator.generate_chain import GenerateChain, build_generate_chain
from slime_async.orchestrator.placement import Placement, place_roles
from slime_async.orchestrator.resume import StartPoint, start_point
from slime_async.orchestrator.roles import Cluster, init_ray
from slime_async.orchestrator.run import Run, RunVersions, write_roles
from slime_async.orchestrator.supervisor import EngineSupervisor
from slime_async.orchestrator.trainer_start import start_behavior_role, start_trainer
from slime_async.orchestrator.transport import (
    build_transport,
    feed_role,
    give_role_start,
    lora_name,
    serves_start_export,
    start_source,
    transport_class,
)
from slime_async.orchestrator.warmstart import WarmStartConfig, is_cached, warm_start
from slime_async.rollout.data.plan import DataPlan, make_data_plan
from slime_async.rollout.data.tasks import TaskFamilyConfig
from slime_async.rollout.generate.client import check_routed_experts
from slime_async.trainer.actor import TrainerGroup
from slime_async.trainer.behavior_role import BehaviorRole
from slime_async.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


def _dapo_filter(group: Group) -> bool:
    """DAPO dynamic sampling: drop a group whose rewards all agree (no learning signal)."""
    rewards = [float(segment_payload(s.payload).get("reward", 0.0)) for s in group.samples]
    return dynamic_sampling_keep([rewards])[0]


async def setup_run(cfg: RunConfig) -> Run:
    """Bring every role up and restore state when resuming. A failure part-way (a refused
    resume, an engine that never came up) releases what was already up, in reverse order: the
    reservation, the trainer, the role, the engines and router, the logger; a process that goes
    on (a test, a notebook, a retry) keeps its cluster's CPUs."""
    undo: list[Callable[[], Any]] = []
    try:
        run = await _build_run(cfg, undo)
        startup.done(f"training from step {run.start_step}")
        return run
    except BaseException:
        startup.abandon()
        for release in reversed(undo):
            try:
                done = release()
                if inspect.isawaitable(done):
                    await done
            except Exception as e:  # report, keep releasing the rest
                log.warning("releasing %s after a failed start: %s", release, e)
        raise


async def _build_run(cfg: RunConfig, undo: list[Callable[[], Any]]) -> Run:
    """`setup_run`'s body; each thing it brings up goes onto `undo` as it comes up. With
    `--debug-rollout-only` no trainer starts: the engines start on `--hf-checkpoint` (or the
    warm start) and nothing is ever pushed."""
    record_config(cfg)
    backend = get_engine_backend(cfg.engines.backend)(cfg.engines, cfg.engine)
    await backend.preflight()  # e.g. attached URLs answer: fail in seconds, before the trainer
    travel = transport_class(cfg)  # what each push moves, and how
    plan = make_data_plan(
        cfg.rollout, seed=cfg.rollout_seed, hf_checkpoint=cfg.trainer.hf_checkpoint
    )
    logger = run_logger(cfg)
    undo.append(logger.close)
    trainer_cfg = await warm_started(cfg)
    placement = await place(cfg)
    if placement is not None:
        undo.append(placement.remove)
    trainer, role, start = None, None, StartPoint(version=0, worker_state=None)
    if cfg.debug_rollout_only:  # the rules saw to a checkpoint (given or the warm start's)
        assert trainer_cfg.hf_checkpoint is not None
        first = Path(trainer_cfg.hf_checkpoint)
    else:
        trainer = await start_trainer(cfg, trainer_cfg, placement)
        undo.append(trainer.shutdown)
        start = await asyncio.to_thread(start_point, cfg, trainer, load=trainer_cfg.load)
        first = await _export_start(cfg, trainer, start.version)
        role = await start_behavior_role(cfg, trainer_cfg)
    if role is not None:
        undo.append(role.shutdown)
        give_role_start(role, travel, first, start.version)
    cluster, transport = await _start_engines(
        cfg, backend, travel, trainer, start, first=first, placement=placement, role=role
    )
    undo.append(cluster.stop)
    undo.append(transport.close)
    if travel.payload is Payload.ADAPTER:  # the start adapter, where no directory was handed over
        await feed_role(role, transport, trainer, start.version)
    await _check_routed_experts(cfg, trainer_cfg, cluster)
    versions = RunVersions(trainer=start.version, transport=transport, start_dir=first)
    chain = build_generate_chain(
        cfg,
        router_url=cluster.router_url,
        plan=plan,
        behavior=None if role is None else role.logprobs,
        served_version=versions.current,
        lora_name=lora_name(travel),
    )
    worker = _data_worker(cfg, plan, chain, cluster, start)
    supervisor = _supervisor(cfg, cluster, versions)
    run = Run(
        cfg=cfg,
        trainer=trainer,
        cluster=cluster,
        worker=worker,
        chain=chain,
        logger=logger,
        plan=plan,
        versions=versions,
        supervisor=supervisor,
        behavior_role=role,
        placement=placement,
    )
    supervisor.start()
    await run.write_roles()
    return run


def run_logger(cfg: RunConfig) -> MetricsLogger:
    """The run's metrics logger, with the config it records and the guards it checks."""
    return MetricsLogger(
        cfg.run_dir,
        loggers=cfg.loggers,
        run_config=config_record(cfg),
        total_steps=cfg.num_steps,
        guards=run_guard_config(cfg.data_worker),
        resume=cfg.trainer.load is not None,  # a new run sets an earlier run's logs aside
    )


def _supervisor(cfg: RunConfig, cluster: Cluster, versions: RunVersions) -> EngineSupervisor:
    """The supervisor of `cluster`: a replacement starts on what `versions` says is served, and
    each replacement rewrites `roles.json`."""
    return EngineSupervisor(
        cluster,
        cfg.supervisor,
        current_weights=versions.served,
        fleet_version=versions.serving,
        on_replace=functools.partial(write_roles, cfg, cluster),
    )


async def warm_started(cfg: RunConfig) -> TrainerConfig:
    """The trainer config, pointed at the warm start's model when the run warm-starts
    (validation leaves `warmstart_steps` 0 unless a fresh embedded default run)."""
    if not cfg.warmstart_steps:
        return cfg.trainer
    threads = max(1, len(cfg.trainer_cores + cfg.rollout_cores))
    ws_args: dict[str, Any] = {
        "spec": cfg.model,
        "task": TaskFamilyConfig(seed=cfg.seed),
        "config": WarmStartConfig(
            max_steps=cfg.warmstart_steps, seed=cfg.seed, num_threads=threads
        ),
    }
    cached = is_cached(cfg.run_dir, **ws_args)
    startup.say(
        f"warm start ({'cached' if cached else f'training up to {cfg.warmstart_steps} steps'})"
    )
    ws = await asyncio.to_thread(
        warm_start, cfg.run_dir, **ws_args, say=lambda m: log.info("%s", m)
    )
    return dataclasses.replace(cfg.trainer, hf_checkpoint=str(ws.path))


async def _export_start(cfg: RunConfig, trainer: TrainerGroup, version: int) -> Path:
    """The trainer's weights of `version` as an HF directory, which the engines start on (or,
    attached ones, load): identical weights. With LoRA the frozen base, which the engines serve
    the adapter over (docs/lora.md)."""
    first = cfg.run_dir / "weights" / version_dir_name(version)
    startup.say(f"exporting the trainer's weights v{version} to {first}")
    await asyncio.to_thread(trainer.save_base_weights, first)
    return first


async def _check_routed_experts(
    cfg: RunConfig, trainer_cfg: TrainerConfig, cluster: Cluster
) -> None:
    """Routing replay of the engines' routing: refuse now engines that do not return routed
    experts, which would otherwise surface only at the first train step."""
    if trainer_cfg.routing_replay.replays_engine_routing and cfg.model.is_moe:
        await asyncio.gather(
            *(check_routed_experts(u, token=cfg.engine.api_key) for u in cluster.engine_urls)
        )


def _data_worker(
    cfg: RunConfig, plan: DataPlan, chain: GenerateChain, cluster: Cluster, start: StartPoint
) -> RolloutDataWorker:
    """The data worker on the plan's prompts and the chain, restored on resume, at the start
    version."""

    async def abort_all() -> None:
        await cluster.control.pause_generation(mode="abort")

    worker = RolloutDataWorker(
        cfg.data_worker,
        plan.source,
        chain.head,
        group_filter=_dapo_filter if cfg.rollout.dynamic_sampling else None,
        abort_fn=abort_all,
    )
    if start.worker_state is not None:
        worker.load_state_dict(start.worker_state)
    worker.set_served_version(start.version)
    return worker


async def place(cfg: RunConfig, *, engines: bool = True) -> Placement | None:
    """Join (or start) Ray and reserve the trainer's and engines' bundles (`placement`).
    Engines a backend attaches run nowhere on the cluster, and a run without `engines` has
    none: only the trainer is placed then."""
    t, e = cfg.trainer, cfg.engines
    starts_engines = engines and not get_engine_backend(e.backend).needs.urls
    need = t.world_size * t.actor_num_cpus_per_rank + e.num_engines * e.cpus_per_engine
    startup.say(f"Ray ({'joining ' + cfg.ray_address if cfg.ray_address else 'local node'})")
    joined = init_ray(address=cfg.ray_address, num_cpus=need)
    if cfg.ray_address is not None and not joined:
        raise RuntimeError(
            f"Ray was already started locally in this process; cannot join {cfg.ray_address}"
        )
    return await asyncio.to_thread(
        place_roles,
        actor_num_nodes=t.actor_num_nodes,
        actor_num_gpus_per_node=t.actor_num_gpus_per_node,
        actor_num_cpus_per_rank=t.actor_num_cpus_per_rank,
        num_engines=e.num_engines if starts_engines else 0,
        gpus_per_engine=e.gpus_per_engine,
        cpus_per_engine=e.cpus_per_engine,
    )


async def _start_engines(
    cfg: RunConfig,
    backend: EngineBackend,
    travel: type[WeightTransport],
    trainer: TrainerGroup | None,
    start: StartPoint,
    *,
    first: Path,
    placement: Placement | None = None,
    role: BehaviorRole | None = None,
) -> tuple[Cluster, WeightTransport]:
    """Engines, a router in front, the weight transport `travel` built for them, all serving
    the `start` version.
    Engines start on `start_source` (the trainer's export `first`, unless the transport sends
    the whole model itself: then they need no shared filesystem and never read the run
    directory); they get `version` through the transport before anything generates unless they
    already serve it (`serves_start_export`). On a joined cluster engines bind their nodes' IPs
    and the router this driver's node IP. A directory transport hands each directory it writes
    to the forward-only `role`; otherwise `Run._feed_role` exports one for it. Without a
    `trainer` (`--debug-rollout-only`) they start on `first`, the checkpoint, and load nothing."""

    joined, version = cfg.ray_address is not None, start.version
    start_from = start_source(cfg, travel, first) if trainer is not None else str(first)
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


def record_config(cfg: RunConfig) -> None:
    """Say once what the run derived, and save the whole config (`config_json`) in the run dir."""
    for line in derived_lines(cfg):
        log.info("%s", line)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cfg.run_dir / "config.json", config_json(cfg))
