"""The trainer-side roles of a run: the trainer group in its bundles and the forward-only role.

Owns `start_trainer` (`world_size` trainer ranks in their placement bundles, the rendezvous on
rank 0's node, each rank's cores pinned, and on a joined cluster the check that every trainer
node holds the paths it reads: `node_paths.check_trainer_paths`) and `start_behavior_role` (the
forward-only role computing π_j^Meg on the rollout cores, when the run needs one), and
`trainer_side`, which brings both up in order with the start point (`orchestrator.resume`) and
the export of that version engines start on (`export_start`).
`slime_async.orchestrator.launch.setup_run` calls it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from loss import resolve_loss_spec
from slime_async import startup
from slime_async.config.run_config import RunConfig
from slime_async.contracts.weights import WeightTransport, version_dir_name
from slime_async.host import free_port
from slime_async.orchestrator.node_paths import check_trainer_paths
from slime_async.orchestrator.placement import Placement
from slime_async.orchestrator.resume import StartPoint, start_point
from slime_async.orchestrator.roles import pin_actor
from slime_async.orchestrator.transport import give_role_start
from slime_async.trainer import checkpoint
from slime_async.trainer.actor import TrainerGroup
from slime_async.trainer.behavior_role import BehaviorRole
from slime_async.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


async def start_trainer(
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
        hf_from_rank0 = await asyncio.to_thread(_check_paths, cfg, trainer_cfg, slots)
    startup.say(
        f"building the trainer ({trainer_cfg.world_size} rank(s), "
        f"TP {trainer_cfg.tensor_model_parallel_size} / "
        f"PP {trainer_cfg.pipeline_model_parallel_size} / "
        f"EP {trainer_cfg.expert_model_parallel_size} / "
        f"ETP {trainer_cfg.expert_tensor_parallel}"
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


def _check_paths(cfg: RunConfig, trainer_cfg: TrainerConfig, slots: list[Any]) -> bool:
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


def behavior_role_cores(cfg: RunConfig) -> tuple[int, ...]:
    """The cores the forward-only role is pinned to (`--behavior-role-cores`): the engines', or
    the trainer's and the engines' together (empty: not pinned)."""
    if cfg.behavior_role_cores == "rollout" or not cfg.rollout_cores:
        return cfg.rollout_cores
    return tuple(sorted({*cfg.trainer_cores, *cfg.rollout_cores}))


async def start_behavior_role(cfg: RunConfig, trainer_cfg: TrainerConfig) -> BehaviorRole | None:
    """The forward-only role, on `behavior_role_cores`, when π_j^Meg is computed there: the loss
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
    threads = max(1, len(cfg.rollout_cores))  # as many as it had on the engines' cores alone
    role = await asyncio.to_thread(
        BehaviorRole,
        trainer_cfg,
        cfg.model,
        num_threads=threads,
        actor_options={"scheduling_strategy": here},  # it reads exports from the run directory
    )
    cores = behavior_role_cores(cfg)
    await pin_actor(role.actor, cores, threads)
    log.info(
        "forward-only role: %d thread(s) on cores %s (--behavior-role-cores %s)",
        threads,
        list(cores) or "any",
        cfg.behavior_role_cores,
    )
    return role


@dataclasses.dataclass(frozen=True)
class TrainerSide:
    """What `trainer_side` brought up: the trainer (None with `--debug-rollout-only`), the
    forward-only role, where the run starts, and what engines start on (`first`)."""

    trainer: TrainerGroup | None
    role: BehaviorRole | None
    start: StartPoint
    first: Path


async def trainer_side(
    cfg: RunConfig,
    trainer_cfg: TrainerConfig,
    placement: Placement | None,
    travel: type[WeightTransport],
    undo: list[Callable[[], Any]],
) -> TrainerSide:
    """The trainer, where it stands (`start_point`), its export of that version (what engines
    and the forward-only role start on) and the role. With `--debug-rollout-only` no trainer
    starts: the engines start on `--hf-checkpoint` (or the warm start) and nothing is pushed."""
    trainer, role, start = None, None, StartPoint(version=0, worker_state=None)
    if cfg.debug_rollout_only:  # the rules saw to a checkpoint (given or the warm start's)
        assert trainer_cfg.hf_checkpoint is not None
        return TrainerSide(None, None, start, Path(trainer_cfg.hf_checkpoint))
    trainer = await start_trainer(cfg, trainer_cfg, placement)
    undo.append(trainer.shutdown)
    start = await asyncio.to_thread(start_point, cfg, trainer, load=trainer_cfg.load)
    first = await export_start(cfg, trainer, start.version)
    role = await start_behavior_role(cfg, trainer_cfg)
    if role is not None:
        undo.append(role.shutdown)
        give_role_start(role, travel, first, start.version)
    return TrainerSide(trainer, role, start, first)


async def export_start(cfg: RunConfig, trainer: TrainerGroup, version: int) -> Path:
    """The trainer's weights of `version` as an HF directory, which the engines start on (or,
    attached ones, load): identical weights. With LoRA the frozen base, which the engines serve
    the adapter over (docs/lora.md)."""
    first = cfg.run_dir / "weights" / version_dir_name(version)
    startup.say(f"exporting the trainer's weights v{version} to {first}")
    await asyncio.to_thread(trainer.save_base_weights, first)
    return first
