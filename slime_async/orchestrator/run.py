"""The live run: what the step loop (`controller.train`) calls between and around steps.
One responsibility over 400 lines: the live run's side of each step.

Owns `Run` (weight push and the replacement engines' catch-up, the next batch, the train step
with its record and its rollout dump (`--save-debug-rollout-data`), evaluation, checkpoint,
timing, logging, shutdown), `RunVersions` (the trainer's, the start's and the fleet's
versions, and what a replacement starts on) and `write_roles`.
`slime_async.orchestrator.launch.setup_run` builds a `Run`; nothing here starts a role.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from data_worker.config import PartialRolloutPolicy
from data_worker.worker import RolloutDataWorker
from slime_async.config.run_config import RunConfig
from slime_async.config.run_paths import batch_shape
from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.rollout import Batch, GenerationRequest, Prompt, segment_payload
from slime_async.contracts.weights import WeightTransport
from slime_async.host import trim_heap
from slime_async.metrics import MetricsLogger
from slime_async.metrics.stability import mean_and_se
from slime_async.orchestrator.colocate import Colocation
from slime_async.orchestrator.generate_chain import GenerateChain
from slime_async.orchestrator.ledger import ledger_path, record_trained
from slime_async.orchestrator.placement import Placement
from slime_async.orchestrator.roles import Cluster
from slime_async.orchestrator.supervisor import EnginesDownError, EngineSupervisor
from slime_async.orchestrator.transport import feed_role
from slime_async.rollout.data.plan import DataPlan
from slime_async.rollout.generate.assemble import ScoredGenerate
from slime_async.rollout.generate.dump import write_step
from slime_async.trainer.actor import TrainerGroup, TrainStep

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSE_TIMEOUT_S = 60.0
"""How long closing the weight transport may take at shutdown before the run goes on closing."""


@dataclasses.dataclass(kw_only=True)
class RunVersions:
    """The versions a run holds, and the weights a replacement engine starts on.

    Example (resumed at step 3, the disk transport, one step per push)::

        v = RunVersions(trainer=3, transport=disk, start_dir=run_dir / "weights/v000003")
        v.advance(4)          # the version the trainer's train step returned: must be 4
        v.fleet = 4           # pushed: v.served() == (run_dir / "weights/v000004", 4)
    """

    trainer: int
    """The trainer's version (optimizer updates so far), the one version the run holds: read
    from the trainer at start-up, then the version each train step returns (`advance`). The
    versions below are recorded from it or derived."""
    transport: WeightTransport
    start_dir: Path
    """The trainer's export at start-up (version `start`), which the engines started on."""
    start: int = dataclasses.field(init=False)
    """`trainer` at start-up (the checkpoint's step on resume, else 0): this run's first step."""
    fleet: int = dataclasses.field(init=False)
    """The version the engines in the router serve: `start`, then each version pushed."""

    def __post_init__(self) -> None:
        self.start = self.fleet = self.trainer

    def current(self) -> int:
        """The trainer's version (what a custom generate function's context reports)."""
        return self.trainer

    def serving(self) -> int:
        """The version the admitted engines serve."""
        return self.fleet

    def advance(self, version: int) -> None:
        """Record `version`, which the trainer's train step returned; anything but the next
        version means the trainer and the run disagree about what was trained: stop."""
        if version != self.trainer + 1:
            raise RuntimeError(
                f"the trainer's train step returned version {version}, but the run holds "
                f"version {self.trainer} and expected {self.trainer + 1}; the trainer and the "
                "run disagree about the steps trained, so nothing more is recorded"
            )
        self.trainer = version

    @property
    def pushed(self) -> int:
        """The last version pushed to the engines (-1: none yet; a push only ever sends a
        version trained in this run, so a fleet past `start` has had one)."""
        return self.fleet if self.fleet != self.start else -1

    def served(self) -> tuple[Path, int]:
        """(directory, version) a replacement engine starts on: the fleet's version where the
        transport writes directories; otherwise the start-up export, and the distributed
        transport brings the replacement up to date at the next push (`Cluster.pending`)."""
        if self.transport.writes_directories and self.pushed >= 0:
            return self.transport.directory(self.fleet), self.fleet
        return self.start_dir, self.start


@dataclasses.dataclass(kw_only=True)
class Run:
    """Live state of one run (the controller calls the methods; `versions` holds the
    versions)."""

    cfg: RunConfig
    trainer: TrainerGroup | None
    """None with `--debug-rollout-only`: the run generates, scores and dumps, nothing else."""
    cluster: Cluster
    worker: RolloutDataWorker
    chain: GenerateChain
    """What the data worker calls to generate and score a sample (`slime_async.orchestrator.generate_chain`)."""
    logger: MetricsLogger
    plan: DataPlan
    supervisor: EngineSupervisor
    versions: RunVersions
    behavior_role: Any = None
    """The forward-only role computing π_j^Meg (`--behavior-forward role`), or None."""
    started: float = dataclasses.field(default_factory=time.perf_counter)
    placement: Placement | None = None
    """The reserved bundles (given back at close)."""
    _logged_once: bool = False
    _rollout_idle_mark: float = 0.0
    pipeline: Any = None
    """This run's `PipelineMember` (`--pipeline-scheduler`), or None."""
    colocation: Colocation = dataclasses.field(init=False)
    """The turns of trainer and engines (`--colocate`: `orchestrator/colocate.py`)."""

    def __post_init__(self) -> None:
        self.colocation = Colocation(
            cfg=self.cfg,
            trainer=self.trainer,
            cluster=self.cluster,
            worker=self.worker,
            transport=self.versions.transport,
        )

    @property
    def transport(self) -> WeightTransport:
        return self.versions.transport

    @property
    def version(self) -> int:
        """The trainer's version (`RunVersions.trainer`)."""
        return self.versions.trainer

    @property
    def start_step(self) -> int:
        return self.versions.start

    @property
    def fleet_version(self) -> int:
        return self.versions.fleet

    @property
    def pushed_version(self) -> int:
        return self.versions.pushed

    async def train_step(self, batch: Batch, data: TrainerBatch) -> TrainStep:
        """One train step on `batch` (assembled as `data`): the trainer's new version recorded
        (`record_step`), and the batch dumped with the step's metrics, or without them when
        the step fails (`dump`)."""
        assert self.trainer is not None
        self.release_role_versions()  # before the trainer's peak
        try:
            async with self.colocation.train_turn(self.version + 1), self._trainer_hooks():
                trained = await asyncio.to_thread(self.trainer.train_step, data)
        except Exception:
            await self.dump(batch.current_version, batch, trained=None)
            raise
        self.record_step(trained.version, batch)
        await self.dump(batch.current_version, batch, trained=trained.metrics)
        return trained

    def _trainer_hooks(self) -> contextlib.AbstractAsyncContextManager:
        """The pipeline scheduler's trainer hooks around a step (partial overlap: its trainer
        slots cleared of engines first, given back after); nothing without a scheduler."""
        return self.pipeline.training() if self.pipeline is not None else contextlib.nullcontext()

    async def dump(
        self, rollout_id: int, batch: Batch, *, trained: dict[str, float] | None
    ) -> None:
        """`--save-debug-rollout-data`: step `rollout_id`'s batch (and, with `trained`, its
        train step's metrics) as a checksummed JSON file, written off the event loop; one that
        cannot be written is logged, never the end of the run."""
        if (spec := self.cfg.save_debug_rollout_data) is None:
            return
        write = functools.partial(write_step, spec, batch, rollout_id=rollout_id, trained=trained)
        try:
            await asyncio.to_thread(write, decode=self.plan.decode)
        except OSError as e:
            log.warning("rollout dump of step %d not written: %s", rollout_id, e)

    def record_step(self, version: int, batch: Any) -> None:
        """Step `version` trained on `batch`: the version the trainer returned (checked to be
        the next one) and the prompt ledger's line."""
        self.versions.advance(version)
        record_trained(ledger_path(self.cfg.run_dir), version, batch)
        trim_heap()  # what the step's batch, responses and pushes freed, back to the node

    async def push_weights(self, version: int) -> dict[str, float]:
        """Make the engines serve `version` (see `--partial-rollout` for in-flight requests).
        With every engine asleep (the pipeline scheduler gave their slots away) nothing is
        pushed: no engine serves until one woke and was given this version, the trainer's
        (`catch_up_replacements`), so the data worker may count on it now."""
        await self._feed_role(version)
        if not self.cluster.awake_urls:  # no engine serves before one woke and took `version`
            self.worker.set_served_version(version)
            self.versions.fleet = version
            return {"weights/push_deferred": 1.0}
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
        self.versions.fleet = version
        await self._admit_caught_up(version)
        return metrics

    async def _admit_caught_up(self, version: int) -> None:
        for url in await self.cluster.admit_caught_up(version, token=self.cfg.engine.api_key):
            log.info("replacement engine %s has v%d: admitted to the router", url, version)

    async def catch_up_replacements(self) -> None:
        """Give pending replacements (started on older weights, `Cluster.pending`) the fleet's
        version, between steps: the trainer is idle and holds `self.version`. When that is the
        fleet's version it is sent again (the replacement joins the weight group; the others
        take the same version); when the trainer is ahead (`--update-weights-interval` > 1) the
        replacement waits for the next push, unless no other engine serves: then that push
        comes now, early, and says so."""
        self.cluster.pending &= set(self.cluster.engine_urls)
        if not self.cluster.pending:
            return
        if self.version == self.fleet_version:
            await self.transport.push(self.version)
            await self._admit_caught_up(self.version)
        elif not self.cluster.serving_urls:  # every engine waits (or sleeps): none serves
            log.warning(
                "every engine is a replacement waiting for weights: pushing v%d now, "
                "before --update-weights-interval %d is due",
                self.version,
                self.cfg.update_weights_interval,
            )
            await self.push_weights(self.version)

    def release_role_versions(self) -> None:
        """The forward-only role drops the versions no sample still to finish can carry
        (`RolloutDataWorker.oldest_unfinished_version`): it holds what the samples in flight
        need, not the staleness bound's worst case (`--max-snapshots`)."""
        if self.behavior_role is not None:
            self.behavior_role.release_below(self.worker.oldest_unfinished_version())

    async def _feed_role(self, version: int) -> None:
        """The forward-only role's copy of `version` (`transport.feed_role`), after it dropped
        the versions nothing needs (their memory is free before the new one is loaded)."""
        self.release_role_versions()
        await feed_role(self.behavior_role, self.transport, self.trainer, version)

    async def score(self, batch: Batch) -> Batch:
        """Rewards that need a whole group (slime's `--group-rm`); a no-op otherwise."""
        return await self.chain.scored.score_groups(batch)

    async def next_batch(self, num_groups: int) -> Batch:
        """The next batch for train step `self.version`, unless every engine stays down."""
        return await self.tending(self.worker.get_batch(num_groups, current_version=self.version))

    async def tending(self, work: Awaitable[T]) -> T:
        """`work`'s result, the fleet tended meanwhile: a replacement started on older weights
        gets the fleet's version (`catch_up_replacements`), and every engine down past
        `--engine-down-timeout` raises `EnginesDownError`. Whatever waits on generation goes
        through here (the next batch, the evals: the final one has no push after it to bring a
        replacement up to date)."""
        task = asyncio.ensure_future(work)
        down = asyncio.ensure_future(self.supervisor.failed.wait())
        try:
            while True:
                behind = asyncio.ensure_future(self.supervisor.behind.wait())
                done, _ = await asyncio.wait(
                    {task, down, behind}, return_when=asyncio.FIRST_COMPLETED
                )
                behind.cancel()
                if task in done:
                    return task.result()
                if down in done:
                    raise EnginesDownError(self.supervisor.reason)
                self.supervisor.behind.clear()  # a replacement waits for the fleet's weights
                await self.catch_up_replacements()
        finally:
            for f in (task, down):
                f.cancel()

    async def write_roles(self) -> None:
        """`run_dir/roles.json` (`write_roles`)."""
        await write_roles(self.cfg, self.cluster)

    async def _record_served_versions(self) -> None:
        """`run_dir/served_versions.json`: the version each engine serves at the end (the last
        push reached every engine when all equal the trainer's version)."""
        versions = await self.cluster.served_versions(token=self.cfg.engine.api_key)
        record = {
            "trainer_version": self.version,
            "pushed_version": self.pushed_version,
            "engines": dict(zip(self.cluster.engine_urls, versions, strict=True)),
        }
        (self.cfg.run_dir / "served_versions.json").write_text(json.dumps(record))

    async def evaluate(self, *, step: int) -> None:
        """Pass rate on each eval set (`--n-samples-per-eval-prompt` samples per prompt, the eval
        sampling settings) and its standard error, logged at `step`: the source's held-out set
        as `eval/reward`, `eval/pass` (with `_se`, per level `eval/reward_level{i}`), each
        `--eval-prompt-data` set as `eval/NAME/reward`, `eval/NAME/pass` (with `_se`)."""
        if not self.plan.eval_prompts and not self.plan.eval_sets:
            return
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        versions: list[int] = []
        if self.plan.eval_prompts:
            scored = self.chain.scored_alone(self.plan.eval_reward_fn)
            rewards = await self._eval_rewards(self.plan.eval_prompts, scored, versions)
            by_level: dict[int, list[float]] = {}
            for p, reward in rewards:
                by_level.setdefault(int(p.payload.get("level", 0)), []).append(reward)
            metrics |= _eval_metrics("eval/", [r for _, r in rewards])
            for level, rs in sorted(by_level.items()):
                metrics[f"eval/reward_level{level}"] = sum(rs) / len(rs)
        for ev in self.plan.eval_sets:
            rewards = await self._eval_rewards(
                ev.prompts, self.chain.scored_alone(ev.reward_fn), versions
            )
            metrics |= _eval_metrics(f"eval/{ev.name}/", [r for _, r in rewards])
        if versions:  # an eval running beside the pushes of an async run spans versions
            metrics["eval/version_min"] = float(min(versions))
            metrics["eval/version_max"] = float(max(versions))
        metrics["timing/eval_s"] = time.perf_counter() - t0
        self.logger.log(step, metrics)

    async def _eval_rewards(
        self, eval_prompts: Sequence[Prompt], scored: ScoredGenerate, versions: list[int]
    ) -> list[tuple[Prompt, float]]:
        """(prompt, reward) of each eval sample: `--n-samples-per-eval-prompt` per prompt; the
        lowest and highest weight version its tokens were sampled on go into `versions`."""
        k = self.cfg.rollout.n_samples_per_eval_prompt
        prompts = [p for p in eval_prompts for _ in range(k)]
        reqs = [
            GenerationRequest(prompt=p, group_seq=-1 - i // k, sample_index=i % k)
            for i, p in enumerate(prompts)
        ]
        expected = self.cfg.rollout.eval_max_response_len
        results = await asyncio.gather(*(scored(r, 0.0, expected) for r in reqs))
        for res in results:
            tv = list(res.token_versions)
            versions.extend((min(tv), max(tv)) if tv else ())
        return [
            (p, float(segment_payload(res.payload).get("reward", 0.0)))
            for p, res in zip(prompts, results, strict=True)
        ]

    @property
    def saves(self) -> bool:
        """Whether the run writes anything at a save: a checkpoint (--save) or an HF
        directory (--save-hf); never without a trainer."""
        return self.trainer is not None and bool(self.cfg.trainer.save or self.cfg.trainer.save_hf)

    def should_save(self, version: int) -> bool:
        every = self.cfg.save_interval * self.cfg.rollout.num_steps_per_rollout  # rollouts
        return bool(self.saves and every and version % every == 0)

    async def save(self, version: int) -> None:
        """The checkpoint (--save) and the loadable HF directory (--save-hf) of `version`."""
        assert self.trainer is not None
        async with self.colocation.trainer_awake(version):  # an offloaded trainer onloads
            await self._save(version)

    async def _save(self, version: int) -> None:
        assert self.trainer is not None
        if self.cfg.trainer.save:
            state = {
                "step": version,
                "worker": self.worker.state_dict(),
                "accounting": self.accounting(),
                "batch_shape": batch_shape(self.cfg),
            }
            path = await asyncio.to_thread(self.trainer.save_checkpoint, None, extra_state=state)
            log.info("checkpoint saved: %s", path)
        if self.cfg.trainer.save_hf:
            path = await asyncio.to_thread(self.trainer.save_hf, None)
            log.info("HF model v%d saved: %s", version, path)

    def timing(self, *, wait_s: float, train_s: float, sync_s: float) -> dict[str, float]:
        total = max(1e-9, wait_s + train_s + sync_s)
        idle = self.chain.scored.idle_seconds()
        rollout_idle, self._rollout_idle_mark = idle - self._rollout_idle_mark, idle
        return {
            "idle/rollout_ratio": min(1.0, rollout_idle / total),
            "timing/wait_batch_s": wait_s,
            "timing/train_s": train_s,
            "timing/weight_sync_s": sync_s,
            "timing/step_s": total,
            "timing/elapsed_s": time.perf_counter() - self.started,
            # the driver node's 1-minute load average: step times read beside it say whether
            # the run had its cores to itself (a load well above what the run alone keeps it
            # at: other work shared them)
            "timing/node_load_1m": os.getloadavg()[0],
            "idle/trainer_ratio": wait_s / total,
            **self.colocation.metrics(),
            **(self.behavior_role.metrics() if self.behavior_role is not None else {}),
        }

    def accounting(self) -> dict[str, float]:
        a = self.worker.accounting()
        return {
            "accounting/dispatched": a.dispatched,
            "accounting/consumed": a.consumed,
            "accounting/dropped": a.dropped,
            "accounting/filtered": a.filtered,
            "accounting/pending": a.pending,
        }

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self._logged_once:  # data-loading counters (rows, skipped) go with the first step
            metrics = {**self.plan.metrics, **metrics}
            self._logged_once = True
        self.logger.log(step, metrics)

    async def close(self) -> None:
        if self.pipeline is not None:  # leave first: the run's slots go to the others at once
            await self.pipeline.stop()
        try:
            await self.worker.stop()
        except Exception as e:  # shutting down after an error: report, keep closing
            log.warning("data worker did not stop cleanly: %s", e)
        await self.supervisor.stop()
        await self.chain.close()
        try:  # bounded: a trainer rank stuck in a collective with a lost peer never answers
            await asyncio.wait_for(self.transport.close(), CLOSE_TIMEOUT_S)
        except Exception as e:  # shutting down: report, keep closing
            log.warning("weight transport did not close cleanly: %s", e or type(e).__name__)
        await self._record_served_versions()
        await self.cluster.stop()
        if self.trainer is not None:
            self.trainer.shutdown()
            self.colocation.close()
        if self.behavior_role is not None:
            self.behavior_role.shutdown()
        if self.placement is not None:
            self.placement.remove()
        self.logger.close()


async def write_roles(cfg: RunConfig, cluster: Cluster) -> None:
    """`run_dir/roles.json`: live pids (driver, engines) for operators and chaos tests; an
    engine's pid is null where the run does not own its process (external backend)."""
    roles = {
        "driver_pid": os.getpid(),
        "engine_backend": cfg.engines.backend,
        "engine_pids": cluster.engine_pids,
        "engine_urls": cluster.engine_urls,
        "router_url": cluster.router_url,
    }
    tmp = cfg.run_dir / "roles.json.tmp"
    tmp.write_text(json.dumps(roles))
    os.replace(tmp, cfg.run_dir / "roles.json")


def _eval_metrics(prefix: str, rewards: list[float]) -> dict[str, float]:
    """Mean reward and pass rate (reward >= 1) of one eval set, each with its standard error."""
    mean, se = mean_and_se(rewards)
    pass_mean, pass_se = mean_and_se([float(r >= 1.0) for r in rewards])
    return {
        f"{prefix}reward": mean,
        f"{prefix}reward_se": se,
        f"{prefix}pass": pass_mean,
        f"{prefix}pass_se": pass_se,
    }
