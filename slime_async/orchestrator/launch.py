"""The composition root: everything `controller.train` needs before its first step.

Owns `setup_run` (prompt source and rewards, warm start, Ray roles in the right order, resume),
which returns the live `slime_async.orchestrator.run.Run`; each component is built from its
own config, and the weight transport is chosen once (`orchestrator.transport.transport_class`).
Order matters: the trainer comes up (fresh, from an HF directory, or resumed from `--load`
through the guarded checkpoint loader; `orchestrator.trainer_start`), the launch-time resume
step checks where it stands (`orchestrator.resume`), then its weights are exported and the
engines start *from that export*, or, where the transport sends the whole model itself, the
engines load the trainer's version through it before anything generates (on a fresh run they
start meanwhile, beside the trainer: `engines_early`). Either way engines and trainer begin on
identical weights at the same version, and a resume never serves anything but the loaded
weights. The engine backend is built from the registry here
and checked (`preflight`) before anything expensive starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from data_worker.worker import RolloutDataWorker
from loss import dynamic_sampling_keep
from slime_async import startup
from slime_async.config import memory_plan
from slime_async.config.recipe import config_json, config_record, derived_lines
from slime_async.config.rules.memory import run_shape
from slime_async.config.run_config import RunConfig
from slime_async.contracts.rollout import Group, segment_payload
from slime_async.contracts.weights import Payload
from slime_async.host import atomic_write_text
from slime_async.metrics import MetricsLogger
from slime_async.metrics.guards import run_guard_config
from slime_async.orchestrator.engine_start import engines_early, start_engines
from slime_async.orchestrator.engines import get_engine_backend
from slime_async.orchestrator.generate_chain import GenerateChain, build_generate_chain
from slime_async.orchestrator.placement import Placement, place_roles
from slime_async.orchestrator.resume import StartPoint
from slime_async.orchestrator.roles import Cluster, init_ray
from slime_async.orchestrator.run import Run, RunVersions, write_roles
from slime_async.orchestrator.supervisor import EngineSupervisor
from slime_async.orchestrator.trainer_start import trainer_side
from slime_async.orchestrator.transport import (
    feed_role,
    lora_name,
    transport_class,
)
from slime_async.orchestrator.warmstart import WarmStartConfig, is_cached, warm_start
from slime_async.rollout.data.plan import DataPlan, make_data_plan
from slime_async.rollout.data.tasks import TaskFamilyConfig
from slime_async.rollout.generate.client import check_routed_experts
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
    early = engines_early(cfg, backend, travel, trainer_cfg, placement, undo)
    side = await trainer_side(cfg, trainer_cfg, placement, travel, undo)
    trainer, role, start, first = side.trainer, side.role, side.start, side.first
    cluster, transport = await start_engines(cfg, backend, travel, side, placement, early)
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
    if role is not None:  # each log-prob request carries the floor of what is still to come
        role.floor = worker.oldest_unfinished_version
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
    # One torch thread: the tiny model's matmuls gain nothing from a second one, and two
    # threads run 5x slower as soon as anything else holds a core (docs/results/2026-11-23-default-run.md)
    ws_args: dict[str, Any] = {
        "spec": cfg.model,
        "task": TaskFamilyConfig(seed=cfg.seed),
        "config": WarmStartConfig(max_steps=cfg.warmstart_steps, seed=cfg.seed, num_threads=1),
    }
    cached = is_cached(cfg.run_dir, **ws_args)
    startup.say(
        f"warm start ({'cached' if cached else f'training up to {cfg.warmstart_steps} steps'})"
    )
    ws = await asyncio.to_thread(
        warm_start, cfg.run_dir, **ws_args, say=lambda m: log.info("%s", m)
    )
    return dataclasses.replace(cfg.trainer, hf_checkpoint=str(ws.path))


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


def _store(cfg: RunConfig) -> int | None:
    """The object store of a local Ray node for this run (`memory_plan.object_store_bytes`),
    logged as derived; None when joining a cluster (its nodes have theirs)."""
    if cfg.ray_address is not None:
        return None
    n = memory_plan.object_store_bytes(run_shape(cfg))
    log.info(
        "derived: Ray's object store %d MiB (what the run puts in it: batches, log-probs, "
        "adapters, and two versions for the forward-only role when they cannot travel as "
        "memory files; docs/cpu.md#memory)",
        n // memory_plan.MIB,
    )
    return n


async def place(cfg: RunConfig, *, engines: bool = True) -> Placement | None:
    """Join (or start) Ray and reserve the trainer's and engines' bundles (`placement`).
    Engines a backend attaches run nowhere on the cluster, and a run without `engines` has
    none: only the trainer is placed then."""
    t, e = cfg.trainer, cfg.engines
    starts_engines = engines and not get_engine_backend(e.backend).needs.urls
    need = t.world_size * t.actor_num_cpus_per_rank + e.num_engines * e.cpus_per_engine
    startup.say(f"Ray ({'joining ' + cfg.ray_address if cfg.ray_address else 'local node'})")
    joined = init_ray(address=cfg.ray_address, num_cpus=need, object_store_memory=_store(cfg))
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


def record_config(cfg: RunConfig) -> None:
    """Say once what the run derived, and save the whole config (`config_json`) in the run dir."""
    for line in derived_lines(cfg):
        log.info("%s", line)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cfg.run_dir / "config.json", config_json(cfg))
