"""Everything `controller.train` needs before its first step, and the run's small services.

Owns `setup_run` (prompt source and rewards, warm start, Ray roles in the right order, resume),
which returns the live `slime_async.orchestrator.run.Run`. Order matters:
the trainer comes up first (fresh, from an HF directory, or resumed from `--load` through the
guarded checkpoint loader), then its weights are exported and the engines start *from that
export* (engines a backend attaches instead of starting, `--engine-backend external`, load it
through the weight transport before anything generates), so engines and trainer always begin on
identical weights at the same version, and a resume can never serve anything but the loaded
weights. The engine backend is built from the registry here and checked (`preflight`) before
anything expensive starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from data_worker.worker import RolloutDataWorker
from loss import dynamic_sampling_keep, resolve_loss_spec
from slime_async import startup
from slime_async.config.recipe import config_json, config_record, derived_lines
from slime_async.config.run_config import RunConfig
from slime_async.config.run_paths import check_batch_shape
from slime_async.contracts.engine import EngineBackend
from slime_async.contracts.rollout import Group, segment_payload
from slime_async.contracts.weights import WeightTransport, version_dir_name
from slime_async.engine.backends import get_engine_backend
from slime_async.host import atomic_write_text, free_port
from slime_async.metrics import MetricsLogger
from slime_async.metrics.guards import run_guard_config
from slime_async.orchestrator.generate_chain import build_generate_chain
from slime_async.orchestrator.node_paths import check_trainer_paths
from slime_async.orchestrator.placement import Placement, place_roles
from slime_async.orchestrator.roles import Cluster, init_ray, pin_actor
from slime_async.orchestrator.run import Run
from slime_async.orchestrator.supervisor import EngineSupervisor
from slime_async.orchestrator.warmstart import WarmStartConfig, is_cached, warm_start
from slime_async.rollout.data.plan import make_data_plan
from slime_async.rollout.data.tasks import TaskFamilyConfig
from slime_async.rollout.generate.client import check_routed_experts
from slime_async.trainer import checkpoint
from slime_async.trainer.actor import TrainerGroup
from slime_async.trainer.behavior_role import BehaviorRole
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.lora import spec_of as lora_spec_of
from slime_async.weights import DiskTransport, DistributedTransport, TransportKind
from slime_async.weights.adapter import AdapterTransport, DistributedAdapterTransport

log = logging.getLogger(__name__)


def _dapo_filter(group: Group) -> bool:
    """DAPO dynamic sampling: drop a group whose rewards all agree (no learning signal)."""
    rewards = [float(segment_payload(s.payload).get("reward", 0.0)) for s in group.samples]
    return dynamic_sampling_keep([rewards])[0]


def _truncate_ledger(path: Path, *, keep_through: int) -> None:
    """On resume, forget steps after the checkpoint: they were rolled back and are redone."""
    if not path.exists():
        return
    rows = [x for x in path.read_text().splitlines() if x.strip()]
    kept = [x for x in rows if _ledger_step(x) <= keep_through]
    if len(kept) != len(rows):
        log.info(
            "resume: %d trained-step records after step %d rolled back",
            len(rows) - len(kept),
            keep_through,
        )
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)


def _archive_stale_ledger(path: Path) -> Path | None:
    """A fresh run (no --load) starts a new ledger: one left by an earlier run in the same
    directory (e.g. killed before its first checkpoint) is moved aside, never appended to, and
    the move is logged with the way to resume instead. Returns the archive path, if any."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest = path.with_name(f"{path.name}.stale-{stamp}")
    n = 0
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.stale-{stamp}-{n}")
    os.replace(path, dest)
    log.warning(
        "%s holds the prompt ledger of an earlier run in this --run-dir; this run starts fresh "
        "(no --load), so it starts a new ledger and the old one was moved to %s. To continue "
        "the earlier run instead, stop and pass --load <its --save directory>.",
        path,
        dest,
    )
    return dest


def _ledger_step(line: str) -> float:
    """Step of a ledger line; a line torn by a kill mid-write counts as after any checkpoint."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


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
    """`setup_run`'s body; each thing it brings up goes onto `undo` as it comes up."""
    record_config(cfg)
    backend = get_engine_backend(cfg.engines.backend)(cfg.engines, cfg.engine)
    await backend.preflight()  # e.g. attached URLs answer: fail in seconds, before the trainer
    r = cfg.rollout
    plan = make_data_plan(
        seed=cfg.rollout_seed,
        prompt_data=r.prompt_data,
        hf_checkpoint=cfg.trainer.hf_checkpoint,
        input_key=r.input_key,
        label_key=r.label_key,
        apply_chat_template=r.apply_chat_template,
        strict_data=r.strict_data,
        custom_rm_path=r.custom_rm_path,
        eval_prompts=r.eval_prompts if r.eval_interval else 0,
        reasoning_gym=r.reasoning_gym_config(cfg.rollout_seed),
        eval_data=r.eval_sets if r.eval_interval else (),
        eval_input_key=r.eval_input_key,
        eval_label_key=r.eval_label_key,
    )
    dw = cfg.data_worker
    guards = run_guard_config(dw)
    logger = MetricsLogger(
        cfg.run_dir,
        loggers=cfg.loggers,
        run_config=config_record(cfg),
        total_steps=cfg.num_steps,
        guards=guards,
    )
    undo.append(logger.close)
    trainer_cfg = cfg.trainer
    if cfg.warmstart_steps:  # validation leaves it 0 unless a fresh embedded default run
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
        trainer_cfg = dataclasses.replace(trainer_cfg, hf_checkpoint=str(ws.path))

    placement = await _place(cfg)
    if placement is not None:
        undo.append(placement.remove)
    trainer = await _start_trainer(cfg, trainer_cfg, placement)
    undo.append(trainer.shutdown)
    extra = await asyncio.to_thread(trainer.extra_state)
    version = await asyncio.to_thread(trainer.version)
    start_step = int(extra.get("step", 0)) if trainer_cfg.load else 0
    if trainer_cfg.load and start_step != version:
        raise RuntimeError(
            f"checkpoint in {trainer_cfg.load} says step {start_step} but the trainer is at "
            f"version {version}; the checkpoint is inconsistent, load an earlier one"
        )
    if trainer_cfg.load:
        if "worker" not in extra:
            raise ValueError(
                f"checkpoint in {trainer_cfg.load} holds no data-worker state (it was not written "
                "by train_async.py), so a resume would lose or repeat prompts; start from its "
                "weights with --hf-checkpoint instead of --load"
            )
        check_batch_shape(extra.get("batch_shape"), cfg, where=str(trainer_cfg.load))
        _truncate_ledger(cfg.run_dir / "trained.jsonl", keep_through=start_step)
    else:
        _archive_stale_ledger(cfg.run_dir / "trained.jsonl")

    # the engines start from (attached ones: load) the trainer's own export: identical weights
    weights_root = cfg.run_dir / "weights"
    first = weights_root / version_dir_name(version)
    startup.say(f"exporting the trainer's weights v{version} to {first}")
    # LoRA: the engines serve the frozen base, the adapter is loaded over it (docs/lora.md)
    save = trainer.save_base_weights if trainer_cfg.lora_rank else trainer.save_weights
    await asyncio.to_thread(save, first)
    role = await _start_behavior_role(cfg, trainer_cfg)
    if role is not None:
        undo.append(role.shutdown)
        if trainer_cfg.lora_rank:  # the base once; the adapter versions come with the pushes
            role.set_base(first)
            if cfg.weights.transport is TransportKind.DISTRIBUTED:  # no adapter directory
                role.add_version(version, await trainer.export_adapter_ref())
        else:
            role.add_version(version, first)
    cluster, transport = await _start_engines(
        cfg, backend, trainer, first=first, version=version, placement=placement, role=role
    )
    undo.append(cluster.stop)
    undo.append(transport.close)
    if trainer_cfg.routing_replay.replays_engine_routing and cfg.model.is_moe:
        # refuse now what would otherwise surface only at the first train step
        await asyncio.gather(
            *(check_routed_experts(u, token=cfg.engine.auth_token) for u in cluster.engine_urls)
        )

    # served_version is late-bound: the run is built below
    chain = build_generate_chain(
        cfg,
        router_url=cluster.router_url,
        plan=plan,
        behavior=None if role is None else role.logprobs,
        served_version=lambda: run.version,
    )

    async def abort_all() -> None:
        await cluster.control.pause_generation(mode="abort")

    worker = RolloutDataWorker(
        cfg.data_worker,
        plan.source,
        chain.head,
        group_filter=_dapo_filter if r.dynamic_sampling else None,
        abort_fn=abort_all,
    )
    if trainer_cfg.load:
        worker.load_state_dict(extra["worker"])
    worker.set_served_version(version)
    supervisor = EngineSupervisor(
        cluster,
        cfg.supervisor,
        current_weights=lambda: run.served,  # late-bound: the run below
        fleet_version=lambda: run.fleet_version,
        on_replace=lambda: run.write_roles(),
    )
    run = Run(
        cfg=cfg,
        trainer=trainer,
        cluster=cluster,
        worker=worker,
        chain=chain,
        transport=transport,
        logger=logger,
        plan=plan,
        version=version,
        start_dir=first,
        supervisor=supervisor,
        behavior_role=role,
        placement=placement,
    )
    supervisor.start()
    await run.write_roles()
    return run


async def _start_behavior_role(cfg: RunConfig, trainer_cfg: Any) -> BehaviorRole | None:
    """The forward-only role, on the rollout cores, when π_j^Meg is computed there: the loss
    reads it, snapshots are on, `--behavior-forward role`, and the run is asynchronous (with
    `--max-staleness 0` every trained token is of the current version: nothing to compute)."""
    if not (
        trainer_cfg.keep_old_actor
        and trainer_cfg.behavior_forward == "role"
        and resolve_loss_spec(trainer_cfg.loss.name).needs.behavior_logprobs
        and cfg.data_worker.max_staleness > 0
    ):
        return None
    startup.say("starting the forward-only behavior role")
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    role = await asyncio.to_thread(
        BehaviorRole,
        trainer_cfg,
        cfg.model,
        num_threads=max(1, len(cfg.rollout_cores)),
        actor_options={"scheduling_strategy": here},  # it reads exports from the run directory
    )
    await pin_actor(role.actor, cfg.rollout_cores)
    return role


async def _place(cfg: RunConfig) -> Placement | None:
    """Join (or start) Ray and reserve the trainer's and engines' bundles (`placement`).
    Engines a backend attaches run nowhere on the cluster: only the trainer is placed then."""
    t, e = cfg.trainer, cfg.engines
    starts_engines = not get_engine_backend(e.backend).needs.urls
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


async def _start_trainer(
    cfg: RunConfig, trainer_cfg: TrainerConfig, placement: Placement | None
) -> TrainerGroup:
    """`world_size` trainer ranks in their bundles, rendezvous on rank 0's node IP (a local
    run: loopback); each pins its cores (a local run: `--trainer-cores`, shared)."""
    joined = cfg.ray_address is not None
    slots = placement.trainer if placement is not None else None
    cores = [cfg.trainer_cores] * trainer_cfg.world_size
    if joined and slots is not None:
        cores = [() if cfg.colocate else s.cores for s in slots]
    threads = max(1, min(len(c) for c in cores)) if all(cores) else 1
    if not joined:  # a local node: rendezvous on loopback, ranks in their bundles
        slots = (
            [dataclasses.replace(s, node_ip="127.0.0.1", port=free_port()) for s in slots[:1]]
            + list(slots[1:])
            if slots
            else None
        )
    hf_from_rank0 = False
    if joined and slots is not None:  # no shared filesystem assumed: look on every trainer node
        hf_from_rank0 = await asyncio.to_thread(_check_trainer_paths, cfg, trainer_cfg, slots)
    startup.say(
        f"building the trainer ({trainer_cfg.world_size} rank(s), "
        f"TP {trainer_cfg.tensor_model_parallel_size} / "
        f"PP {trainer_cfg.pipeline_model_parallel_size} / "
        f"EP {trainer_cfg.expert_model_parallel_size}"
        + (f", loading {trainer_cfg.load})" if trainer_cfg.load else ")")
    )
    trainer = await asyncio.to_thread(
        TrainerGroup,
        trainer_cfg,
        cfg.model,
        world_size=trainer_cfg.world_size,
        num_threads=threads if joined else max(1, len(cfg.trainer_cores)),
        slots=slots,
        hf_from_rank0=hf_from_rank0,
    )
    for actor, c in zip(trainer.actors, cores, strict=True):
        await pin_actor(actor, c)
    return trainer


def _check_trainer_paths(cfg: RunConfig, trainer_cfg: TrainerConfig, slots: list[Any]) -> bool:
    """`node_paths.check_trainer_paths` for this run; says which ranks get the start weights
    from rank 0. Raises `NodePathError` (node, rank, path, fix) for a layout that cannot work."""
    hf = trainer_cfg.hf_checkpoint if trainer_cfg.load is None else None
    warm = hf is not None and cfg.warmstart_steps > 0 and hf != cfg.trainer.hf_checkpoint
    load_meta = None
    if trainer_cfg.load is not None:
        load_meta = checkpoint.find_latest(Path(trainer_cfg.load), hashes=False) / "meta.json"
    shared = check_trainer_paths(
        slots,
        hf_dir=hf if hf is not None and Path(hf).is_dir() else None,
        hf_flag="the warm start" if warm else "--hf-checkpoint",
        load_meta=load_meta,
        load=trainer_cfg.load,
        save=trainer_cfg.save,
        run_dir=cfg.run_dir,
    )
    if shared:
        log.info(
            "trainer nodes %s do not hold %s: rank 0 reads it and sends it over the trainer group",
            shared,
            hf,
        )
    return bool(shared)


async def _start_engines(
    cfg: RunConfig,
    backend: EngineBackend,
    trainer: TrainerGroup,
    *,
    first: Path,
    version: int,
    placement: Placement | None = None,
    role: BehaviorRole | None = None,
) -> tuple[Cluster, WeightTransport]:
    """Engines, a router in front, the weight transport (`--update-weight-transport`).
    Engines a backend attaches, and every engine under the distributed transport (which needs no
    shared filesystem: they start from `--hf-checkpoint`, a path every node has as in slime, or
    build the model's architecture, and never read the run directory), get `version` pushed
    through the transport before anything generates; others start on the trainer's export
    `first`. On a joined cluster engines bind their nodes' IPs and the router this driver's
    node IP. A disk transport hands each directory it writes to the forward-only `role`;
    otherwise `Run._feed_role` exports one for it."""
    import ray

    joined = cfg.ray_address is not None
    distributed = cfg.weights.transport is TransportKind.DISTRIBUTED
    slots = placement.engines if placement is not None and placement.engines else None
    start_from = start_source(cfg, first)
    if distributed and not start_from:
        backend.engine = dataclasses.replace(backend.engine, model_spec=cfg.model.to_dict())
    n = cfg.engines.num_engines
    verb = "attaching" if backend.needs.urls else "starting"
    startup.say(f"{verb} {n} engine(s) ({cfg.engines.backend}) and the router")
    cluster = await Cluster.start(
        backend=backend,
        num_engines=cfg.engines.num_engines,
        model_dir=start_from,
        version=version,
        seed=cfg.engine.seed,
        router_cfg=cfg.router,
        rollout_cores=cfg.rollout_cores,
        slots=slots,
        bind_node_ips=joined,
        pin_slot_cores=joined and not cfg.colocate,
        router_host=ray.util.get_node_ip_address() if joined else None,
    )
    startup.say(f"router on {cluster.router_url} in front of {len(cluster.engines)} engine(s)")
    transport: WeightTransport
    lora = cfg.trainer.lora_rank > 0
    if lora and distributed:  # the adapter alone over the weight group (docs/lora.md)
        transport = DistributedAdapterTransport(
            lora=lora_spec_of(cfg.trainer, cfg.model),
            sender=trainer.adapter_sender(),
            control=cluster.control,
            engine_urls=lambda: cluster.engine_urls,
            cfg=cfg.weights,
            backend=backend.needs.collective_backend,
            token=cfg.engine.auth_token,
        )
    elif lora:
        transport = AdapterTransport(
            cfg.run_dir / "adapters",
            trainer=trainer,
            control=cluster.control,
            on_written=None if role is None else role.add_version,
        )
    elif distributed:
        transport = DistributedTransport(
            sender=trainer,
            control=cluster.control,
            engine_urls=lambda: cluster.engine_urls,
            cfg=cfg.weights,
            backend=backend.needs.collective_backend,
            token=cfg.engine.auth_token,
        )
    else:
        transport = DiskTransport(
            first.parent,
            trainer=trainer,
            control=cluster.control,
            on_written=None if role is None else role.add_version,
            dtype=cfg.weights.dtype,
        )
    if not backend.needs.model_dir or distributed or lora:
        startup.say(
            f"engines load version {version} through the {cfg.weights.transport.value} transport"
        )
        try:
            await transport.load(version)
        except BaseException:
            await cluster.stop()
            raise
        log.info("engines attached and serving the trainer's weights v%d", version)
    return cluster, transport


def start_source(cfg: RunConfig, first: Path) -> str:
    """What engines (and replacements) start on: the trainer's export `first` with the disk
    transport; with the distributed one, `--hf-checkpoint` or "" (build the architecture), the
    transport then loading the trainer's weights. LoRA: always `first` (the frozen base; only
    the adapter travels, whichever transport)."""
    if cfg.weights.transport is TransportKind.DISTRIBUTED and not cfg.trainer.lora_rank:
        # (LoRA: only the adapter travels over the group; the base is the start-up export)
        if cfg.trainer.hf_checkpoint:
            return cfg.trainer.hf_checkpoint
        if not cfg.engines.needs.checkpoint_to_start:  # built from the spec
            return ""
        # SGLang cannot start without a checkpoint: the trainer's export, which the engine
        # nodes must then be able to read (give --hf-checkpoint on a cluster, as in slime)
    return str(first.resolve())


def record_config(cfg: RunConfig) -> None:
    """Say once what the run derived, and save the whole config (`config_json`) in the run dir."""
    for line in derived_lines(cfg):
        log.info("%s", line)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cfg.run_dir / "config.json", config_json(cfg))
