"""Everything `controller.train` needs before its first step, and the run's small services.

Owns `setup_run` (prompt source and rewards, warm start, Ray roles in the right order, resume)
and `Run` (weight push, evaluation, checkpoint, logging, timing, shutdown). Order matters:
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
import enum
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from data_worker.config import PartialRolloutPolicy
from data_worker.worker import RolloutDataWorker
from loss import dynamic_sampling_keep, resolve_loss_spec
from slime_async.config import RunConfig
from slime_async.contracts.engine import EngineBackend
from slime_async.contracts.rollout import Batch, GenerationRequest, Group
from slime_async.engine.backends import get_engine_backend
from slime_async.host import free_port
from slime_async.metrics import MetricsLogger
from slime_async.metrics.guards import run_guard_config
from slime_async.metrics.stability import mean_and_se
from slime_async.placement import Placement, place_roles
from slime_async.roles import Cluster, init_ray, pin_actor
from slime_async.rollout.assemble import ScoredGenerate
from slime_async.rollout.behavior import BehaviorAnnotate
from slime_async.rollout.client import GenerateClient, GenerateClientConfig, check_routed_experts
from slime_async.rollout.custom_generate import CustomGenerate, load_custom_generate, slime_args
from slime_async.rollout.plan import DataPlan, make_data_plan
from slime_async.rollout.tasks import TaskFamilyConfig
from slime_async.rollout.warmstart import WarmStartConfig, warm_start
from slime_async.supervisor import EnginesDownError, EngineSupervisor
from slime_async.trainer.actor import TrainerGroup
from slime_async.trainer.behavior_role import BehaviorRole
from slime_async.trainer.config import TrainerConfig
from slime_async.weights import DiskTransport, DistributedTransport, TransportKind

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class Run:
    """Live state of one run (the controller reads `version`, calls the methods)."""

    cfg: RunConfig
    trainer: TrainerGroup
    cluster: Cluster
    worker: RolloutDataWorker
    client: GenerateClient
    transport: DiskTransport | DistributedTransport
    logger: MetricsLogger
    plan: DataPlan
    supervisor: EngineSupervisor
    start_step: int
    version: int
    served: tuple[Path, int]
    generate: ScoredGenerate
    sample_fn: Any = None
    """What generates one sample: the generate client or a custom generate function."""
    behavior_role: Any = None
    """The forward-only role computing π_j^Meg (`--behavior-forward role`), or None."""
    started: float = dataclasses.field(default_factory=time.perf_counter)
    placement: Placement | None = None
    """The reserved bundles (given back at close)."""
    pushed_version: int = -1
    """The last version pushed to the engines (-1: none yet)."""
    _logged_once: bool = False
    _rollout_idle_mark: float = 0.0

    async def push_weights(self, version: int) -> dict[str, float]:
        """Make the engines serve `version` (see `--partial-rollout` for in-flight requests)."""
        await self._feed_role(version)
        requeue = self.cfg.data_worker.partial_rollout is PartialRolloutPolicy.REQUEUE
        if requeue:  # abort in-flight generations; the data worker re-issues them whole
            await self.worker.pause()
        try:  # pause in place, update without a flush, continue: per-token versions record it
            metrics = await self.transport.push(version)
        finally:
            if requeue:
                await self.cluster.control.continue_generation()
                await self.worker.resume()
        self.worker.set_served_version(version)
        self.pushed_version = version
        if isinstance(self.transport, DiskTransport):
            # replacements start on the newest directory; with the distributed transport they
            # start on the run's start source and join at the next push
            self.served = (self.transport.path(version), version)
        return metrics

    async def _feed_role(self, version: int) -> None:
        """Give the forward-only role `version`'s weights before any engine serves it. A disk
        transport hands over the directory it writes (`on_written`); any other transport has
        no such directory, so the trainer's in-memory export goes to the role through Ray's
        object store (the trainer pays the export, no file write; the role loads it in order)."""
        role = self.behavior_role
        if role is None or getattr(self.transport, "on_written", None) is not None:
            return
        role.add_version(version, await self.trainer.export_weights_ref())

    async def score(self, batch: Batch) -> Batch:
        """Rewards that need a whole group (slime's `--group-rm`); a no-op otherwise."""
        return await self.generate.score_groups(batch)

    async def next_batch(self, num_groups: int) -> Batch:
        """The next batch for train step `self.version`, unless every engine stays down."""
        get = asyncio.ensure_future(self.worker.get_batch(num_groups, current_version=self.version))
        down = asyncio.ensure_future(self.supervisor.failed.wait())
        done, _ = await asyncio.wait({get, down}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            down.cancel()
            return get.result()
        get.cancel()
        raise EnginesDownError(self.supervisor.reason)

    async def write_roles(self) -> None:
        """`run_dir/roles.json`: live pids (driver, engines) for operators and chaos tests; an
        engine's pid is null where the run does not own its process (external backend)."""
        roles = {
            "driver_pid": os.getpid(),
            "engine_backend": self.cfg.engines.backend,
            "engine_pids": self.cluster.engine_pids,
            "engine_urls": self.cluster.engine_urls,
            "router_url": self.cluster.router_url,
        }
        tmp = self.cfg.run_dir / "roles.json.tmp"
        tmp.write_text(json.dumps(roles))
        os.replace(tmp, self.cfg.run_dir / "roles.json")

    async def _record_served_versions(self) -> None:
        """`run_dir/served_versions.json`: the version each engine serves at the end (the last
        push reached every engine when all equal the trainer's version)."""
        versions = await self.cluster.served_versions(token=self.cfg.engine.auth_token)
        record = {"trainer_version": self.version, "pushed_version": self.pushed_version,
                  "engines": dict(zip(self.cluster.engine_urls, versions, strict=True))}  # fmt: skip
        (self.cfg.run_dir / "served_versions.json").write_text(json.dumps(record))

    async def evaluate(self, *, step: int) -> None:
        """Held-out pass rate (`--n-samples-per-eval-prompt` samples per prompt, rollout
        temperature) and its standard error, logged at `step`."""
        if not self.plan.eval_prompts:
            return
        t0 = time.perf_counter()
        scored = ScoredGenerate(self.sample_fn or self.client, self.plan.reward_fn,
                                eos_id=self.plan.eos_id, decode=self.plan.decode,
                                reward_args=self.generate.reward_args,
                                group_rm=self.cfg.rollout.group_rm, score_alone=True)  # fmt: skip
        k = self.cfg.rollout.n_samples_per_eval_prompt
        prompts = [p for p in self.plan.eval_prompts for _ in range(k)]
        reqs = [GenerationRequest(prompt=p, group_seq=-1 - i // k, sample_index=i % k)
                for i, p in enumerate(prompts)]  # fmt: skip
        expected = self.cfg.rollout.max_response_len
        results = await asyncio.gather(*(scored(r, 0.0, expected) for r in reqs))
        by_level: dict[int, list[float]] = {}
        for p, res in zip(prompts, results, strict=True):
            level = int(p.payload.get("level", 0))
            by_level.setdefault(level, []).append(float(res.payload.get("reward", 0.0)))
        allr = [r for rs in by_level.values() for r in rs]
        mean, se = mean_and_se(allr)
        pass_mean, pass_se = mean_and_se([float(r >= 1.0) for r in allr])
        metrics = {"eval/reward": mean, "eval/reward_se": se,
                   "eval/pass": pass_mean, "eval/pass_se": pass_se,
                   "timing/eval_s": time.perf_counter() - t0}  # fmt: skip
        for level, rs in sorted(by_level.items()):
            metrics[f"eval/reward_level{level}"] = sum(rs) / len(rs)
        self.logger.log(step, metrics)

    def should_save(self, version: int) -> bool:
        every = self.cfg.save_interval * self.cfg.rollout.num_steps_per_rollout  # rollouts
        return bool(self.cfg.trainer.save and every and version % every == 0)

    async def save(self, version: int) -> None:
        state = {"step": version, "worker": self.worker.state_dict(),
                 "accounting": self.accounting(), "batch_shape": batch_shape(self.cfg)}  # fmt: skip
        path = await asyncio.to_thread(self.trainer.save_checkpoint, None, extra_state=state)
        log.info("checkpoint saved: %s", path)

    def timing(self, *, wait_s: float, train_s: float, sync_s: float) -> dict[str, float]:
        total = max(1e-9, wait_s + train_s + sync_s)
        idle = self.generate.idle_seconds()
        rollout_idle, self._rollout_idle_mark = idle - self._rollout_idle_mark, idle
        return {
            "idle/rollout_ratio": min(1.0, rollout_idle / total),
            "timing/wait_batch_s": wait_s,
            "timing/train_s": train_s,
            "timing/weight_sync_s": sync_s,
            "timing/step_s": total,
            "timing/elapsed_s": time.perf_counter() - self.started,
            "idle/trainer_ratio": wait_s / total,
        }

    def accounting(self) -> dict[str, float]:
        a = self.worker.accounting()
        return {"accounting/dispatched": a.dispatched, "accounting/consumed": a.consumed,
                "accounting/dropped": a.dropped, "accounting/filtered": a.filtered,
                "accounting/pending": a.pending}  # fmt: skip

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self._logged_once:  # data-loading counters (rows, skipped) go with the first step
            metrics = {**self.plan.metrics, **metrics}
            self._logged_once = True
        self.logger.log(step, metrics)

    def record_trained(self, step: int, batch: Any) -> None:
        """Append which prompt groups step `step` trained on (the prompt ledger)."""
        row = {"step": step, "version": batch.current_version,
               "groups": [[g.prompt.key, g.seq, g.min_version] for g in batch.groups],
               "dropped": batch.dropped, "filtered": batch.filtered}  # fmt: skip
        with open(self.cfg.run_dir / "trained.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    async def close(self) -> None:
        try:
            await self.worker.stop()
        except Exception as e:  # shutting down after an error: report, keep closing
            log.warning("data worker did not stop cleanly: %s", e)
        await self.supervisor.stop()
        await self.client.close()
        try:
            await self.transport.close()
        except Exception as e:  # shutting down: report, keep closing
            log.warning("weight transport did not close cleanly: %s", e)
        await self._record_served_versions()
        await self.cluster.stop()
        self.trainer.shutdown()
        if self.behavior_role is not None:
            self.behavior_role.shutdown()
        if self.placement is not None:
            self.placement.remove()
        self.logger.close()


def _dapo_filter(group: Group) -> bool:
    """DAPO dynamic sampling: drop a group whose rewards all agree (no learning signal)."""
    rewards = [float(s.payload.get("reward", 0.0)) for s in group.samples]
    return dynamic_sampling_keep([rewards])[0]


def _truncate_ledger(path: Path, *, keep_through: int) -> None:
    """On resume, forget steps after the checkpoint: they were rolled back and are redone."""
    if not path.exists():
        return
    rows = [x for x in path.read_text().splitlines() if x.strip()]
    kept = [x for x in rows if _ledger_step(x) <= keep_through]
    if len(kept) != len(rows):
        log.info("resume: %d trained-step records after step %d rolled back",
                 len(rows) - len(kept), keep_through)  # fmt: skip
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)


_SHAPE_FLAGS = {
    "rollout_batch_size": "--rollout-batch-size",
    "n_samples_per_prompt": "--n-samples-per-prompt",
    "global_batch_size": "--global-batch-size",
    "num_steps_per_rollout": "--num-steps-per-rollout",
}


def batch_shape(cfg: RunConfig) -> dict[str, int]:
    """The flags that fix what one step trains on; a resume must keep them (saved in the
    checkpoint's extra state)."""
    return {k: int(getattr(cfg.rollout, k)) for k in _SHAPE_FLAGS}


def check_batch_shape(saved: object, cfg: RunConfig, *, where: str) -> None:
    """Refuse a resume whose batch shape differs from the checkpoint's: the data worker's pending
    groups, the ledger and the step counter all assume the saved shape."""
    if saved is None:  # a checkpoint from before the shape was recorded
        return
    now = batch_shape(cfg)
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint in {where}: batch_shape is {saved!r}, not an object")
    diff = [
        (flag, saved.get(k), now[k]) for k, flag in _SHAPE_FLAGS.items() if saved.get(k) != now[k]
    ]
    if diff:
        was = " ".join(f"{flag} {old}" for flag, old, _ in diff)
        now_s = ", ".join(f"{flag} {new}" for flag, _, new in diff)
        raise ValueError(
            f"--load {where}: the checkpoint was trained with {was}, this run has {now_s}; a "
            f"resume must keep the batch shape (pending groups and the prompt ledger assume it). "
            f"Pass {was}, or start a new run from its weights with --hf-checkpoint."
        )


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
        path, dest,
    )  # fmt: skip
    return dest


def _ledger_step(line: str) -> float:
    """Step of a ledger line; a line torn by a kill mid-write counts as after any checkpoint."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


async def setup_run(cfg: RunConfig) -> Run:
    """Bring every role up and restore state when resuming."""
    record_config(cfg)
    backend = get_engine_backend(cfg.engines.backend)(cfg.engines, cfg.engine)
    await backend.preflight()  # e.g. attached URLs answer: fail in seconds, before the trainer
    r = cfg.rollout
    plan = make_data_plan(seed=cfg.seed if r.seed is None else r.seed, prompt_data=r.prompt_data,
                          hf_checkpoint=cfg.trainer.hf_checkpoint, input_key=r.input_key,
                          label_key=r.label_key, apply_chat_template=r.apply_chat_template,
                          strict_data=r.strict_data, custom_rm_path=r.custom_rm_path,
                          eval_prompts=r.eval_prompts if r.eval_interval else 0,
                          reasoning_gym=r.reasoning_gym_config(cfg.seed if r.seed is None
                                                               else r.seed))  # fmt: skip
    dw = cfg.data_worker
    guards = run_guard_config(dataclasses.asdict(dw))
    logger = MetricsLogger(cfg.run_dir, use_tensorboard=cfg.use_tensorboard,
                           use_wandb=cfg.use_wandb, total_steps=cfg.num_steps,
                           guards=guards)  # fmt: skip
    trainer_cfg = cfg.trainer
    if cfg.warmstart_steps:  # validation leaves it 0 unless a fresh embedded default run
        threads = max(1, len(cfg.trainer_cores + cfg.rollout_cores))
        ws = await asyncio.to_thread(
            warm_start, cfg.run_dir, spec=cfg.model, task=TaskFamilyConfig(seed=cfg.seed),
            config=WarmStartConfig(max_steps=cfg.warmstart_steps, seed=cfg.seed,
                                   num_threads=threads),
            say=lambda m: log.info("%s", m),
        )  # fmt: skip
        trainer_cfg = dataclasses.replace(trainer_cfg, hf_checkpoint=str(ws.path))

    placement = await _place(cfg)
    trainer = await _start_trainer(cfg, trainer_cfg, placement)
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
    first = weights_root / f"v{version:06d}"
    await asyncio.to_thread(trainer.save_weights, first)
    role = await _start_behavior_role(cfg, trainer_cfg)
    if role is not None:
        role.add_version(version, first)
    cluster, transport = await _start_engines(cfg, backend, trainer, first=first, version=version,
                                              placement=placement, role=role)  # fmt: skip
    if trainer_cfg.routing_replay.value == "r3" and cfg.model.is_moe:
        try:  # refuse now what would otherwise surface only at the first train step
            await asyncio.gather(*(check_routed_experts(u, token=cfg.engine.auth_token)
                                   for u in cluster.engine_urls))  # fmt: skip
        except BaseException:
            await cluster.stop()
            raise

    client = GenerateClient(
        GenerateClientConfig(
            url=cluster.router_url,
            max_response_len=r.max_response_len,
            temperature=r.temperature,
            top_p=r.top_p,
            return_routed_experts=trainer_cfg.routing_replay.value == "r3",
            top_k=r.top_k,
            stop=r.stop,
            stop_token_ids=(plan.eos_id, *r.stop_token_ids),
            auth_token=cfg.engine.auth_token,
        ),
        num_layers=cfg.model.num_layers,
        topk=cfg.model.moe_topk,
    )
    args = _slime_args(cfg, cluster.router_url)
    sample_fn: Any = client
    if r.custom_generate_function_path:
        sample_fn = CustomGenerate(load_custom_generate(r.custom_generate_function_path), client,
                                   eos_id=plan.eos_id, args=args,
                                   served_version=lambda: run.version)  # fmt: skip
    generate = ScoredGenerate(sample_fn, plan.reward_fn, eos_id=plan.eos_id, decode=plan.decode,
                              reward_args=args, group_rm=r.group_rm)  # fmt: skip

    async def abort_all() -> None:
        await cluster.control.pause_generation(mode="abort")

    worker = RolloutDataWorker(
        cfg.data_worker,
        plan.source,
        generate if role is None else BehaviorAnnotate(generate, role.logprobs),
        group_filter=_dapo_filter if r.dynamic_sampling else None,
        abort_fn=abort_all,
    )
    if trainer_cfg.load:
        worker.load_state_dict(extra["worker"])
    worker.set_served_version(version)
    supervisor = EngineSupervisor(
        cluster, cfg.supervisor,
        current_weights=lambda: run.served,  # late-bound: the run below
        on_replace=lambda: run.write_roles(),
    )  # fmt: skip
    run = Run(
        cfg=cfg, trainer=trainer, cluster=cluster, worker=worker, client=client,
        transport=transport, logger=logger, plan=plan, start_step=start_step, version=version,
        served=(first, version), supervisor=supervisor, generate=generate, sample_fn=sample_fn,
        behavior_role=role,
        placement=placement,
    )  # fmt: skip
    supervisor.start()
    await run.write_roles()
    return run


async def _start_behavior_role(cfg: RunConfig, trainer_cfg: Any) -> BehaviorRole | None:
    """The forward-only role, on the rollout cores, when π_j^Meg is computed there: the loss
    reads it, snapshots are on, `--behavior-forward role`, and the run is asynchronous (with
    `--max-staleness 0` every trained token is of the current version: nothing to compute)."""
    if not (trainer_cfg.keep_old_actor and trainer_cfg.behavior_forward == "role"
            and resolve_loss_spec(trainer_cfg.loss.name).needs.behavior_logprobs
            and cfg.data_worker.max_staleness > 0):  # fmt: skip
        return None
    role = await asyncio.to_thread(
        BehaviorRole, trainer_cfg, cfg.model, num_threads=max(1, len(cfg.rollout_cores))
    )
    await pin_actor(role.actor, cfg.rollout_cores)
    return role


async def _place(cfg: RunConfig) -> Placement | None:
    """Join (or start) Ray and reserve the trainer's and engines' bundles (`placement`).
    Engines a backend attaches run nowhere on the cluster: only the trainer is placed then."""
    t, e = cfg.trainer, cfg.engines
    starts_engines = not get_engine_backend(e.backend).needs.urls
    need = t.world_size * t.actor_num_cpus_per_rank + e.num_engines * e.cpus_per_engine
    joined = init_ray(address=cfg.ray_address, num_cpus=need)
    if cfg.ray_address is not None and not joined:
        raise RuntimeError("Ray was already started locally in this process; cannot join "
                           f"{cfg.ray_address}")  # fmt: skip
    return await asyncio.to_thread(
        place_roles, actor_num_nodes=t.actor_num_nodes,
        actor_num_gpus_per_node=t.actor_num_gpus_per_node,
        actor_num_cpus_per_rank=t.actor_num_cpus_per_rank,
        num_engines=e.num_engines if starts_engines else 0,
        gpus_per_engine=e.gpus_per_engine, cpus_per_engine=e.cpus_per_engine,
    )  # fmt: skip


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
        slots = [dataclasses.replace(s, node_ip="127.0.0.1", port=free_port())
                 for s in slots[:1]] + list(slots[1:]) if slots else None  # fmt: skip
    trainer = await asyncio.to_thread(
        TrainerGroup, trainer_cfg, cfg.model, world_size=trainer_cfg.world_size,
        num_threads=threads if joined else max(1, len(cfg.trainer_cores)), slots=slots,
    )  # fmt: skip
    for actor, c in zip(trainer.actors, cores, strict=True):
        await pin_actor(actor, c)
    return trainer


async def _start_engines(
    cfg: RunConfig,
    backend: EngineBackend,
    trainer: TrainerGroup,
    *,
    first: Path,
    version: int,
    placement: Placement | None = None,
    role: BehaviorRole | None = None,
) -> tuple[Cluster, DiskTransport | DistributedTransport]:
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
    cluster = await Cluster.start(backend=backend, num_engines=cfg.engines.num_engines,
                                  model_dir=start_from, version=version,
                                  seed=cfg.engine.seed, router_cfg=cfg.router,
                                  rollout_cores=cfg.rollout_cores, slots=slots,
                                  bind_node_ips=joined, pin_slot_cores=joined and not cfg.colocate,
                                  router_host=ray.util.get_node_ip_address() if joined else None)  # fmt: skip
    transport: DiskTransport | DistributedTransport
    if distributed:
        transport = DistributedTransport(
            sender=trainer, control=cluster.control, engine_urls=lambda: cluster.engine_urls,
            cfg=cfg.weights, backend="nccl" if cfg.engines.backend == "sglang" else "gloo",
            token=cfg.engine.auth_token,
        )  # fmt: skip
    else:
        transport = DiskTransport(first.parent, trainer=trainer, control=cluster.control,
                                  on_written=None if role is None else role.add_version)  # fmt: skip
    if not backend.needs.model_dir or distributed:
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
    transport then loading the trainer's weights."""
    if cfg.weights.transport is TransportKind.DISTRIBUTED:
        if cfg.trainer.hf_checkpoint:
            return cfg.trainer.hf_checkpoint
        if cfg.engines.backend != "sglang":  # our engine builds the architecture from the spec
            return ""
        # SGLang cannot start without a checkpoint: the trainer's export, which the engine
        # nodes must then be able to read (give --hf-checkpoint on a cluster, as in slime)
    return str(first.resolve())


def _slime_args(cfg: RunConfig, router_url: str) -> Any:
    """`args` of slime-style plugins (rewards, custom generate): slime's names for our settings."""
    r = cfg.rollout
    return slime_args(
        router_url, router_headers=(
            {"Authorization": f"Bearer {cfg.engine.auth_token}"} if cfg.engine.auth_token else {}
        ), hf_checkpoint=cfg.trainer.hf_checkpoint, rollout_batch_size=r.rollout_batch_size,
        n_samples_per_prompt=r.n_samples_per_prompt, global_batch_size=r.global_batch_size,
        rollout_max_response_len=r.max_response_len, rollout_temperature=r.temperature,
        rollout_top_p=r.top_p, rollout_top_k=r.top_k, rollout_stop=list(r.stop) or None,
        rollout_stop_token_ids=list(r.stop_token_ids) or None,
        rollout_seed=cfg.seed if r.seed is None else r.seed, custom_rm_path=r.custom_rm_path,
        group_rm=r.group_rm, custom_generate_function_path=r.custom_generate_function_path,
        partial_rollout=cfg.data_worker.partial_rollout.value == "continue",
        use_rollout_routing_replay=cfg.trainer.routing_replay.value == "r3",
    )  # fmt: skip


def _json_value(obj: object) -> object:
    return obj.value if isinstance(obj, enum.Enum) else str(obj)


def _redact(obj: Any) -> Any:
    """The config as recorded: a token's value never reaches the run directory."""
    if isinstance(obj, dict):
        return {k: ("<set>" if k == "auth_token" and v else _redact(v)) for k, v in obj.items()}
    return obj


def record_config(cfg: RunConfig) -> None:
    """Say once what the run derived, and save the whole config (with `derived`) in the run dir."""
    for flag, d in cfg.derived.items():
        log.info("derived: %s %s (%s)", flag, d.value, d.why)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_redact(dataclasses.asdict(cfg)), indent=2, default=_json_value)
    tmp = cfg.run_dir / "config.json.tmp"
    tmp.write_text(text)
    os.replace(tmp, cfg.run_dir / "config.json")
