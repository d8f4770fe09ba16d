"""The async training loop, readable top to bottom.

Owns `train(cfg)`: pull a batch of completed groups from the data worker, train one step on
it, push weights every `update_weights_interval` steps, evaluate and checkpoint on schedule.
Rollout never waits for training: the data worker keeps dispatching in this same event loop
while a train step runs in the trainer actor, limited only by the staleness budget
(`--max-staleness S`: S = 0 synchronous, 1 one-step off-policy, > 1 fully async). Setting up
the roles, the data and resuming live in `slime_async.orchestrator.launch`; this file is only the schedule.
slime's debug modes: `--debug-rollout-only` runs the loop without a trainer (`_rollouts_only`);
`--debug-train-only` (replaying dumps, or SFT) trains without engines
(`slime_async.orchestrator.offline`).
A run that must stop (a lost trainer rank, no engine left) says why through `on_stop` before it
tears anything down, so the process ends within a bound (`slime_async.orchestrator.stop`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from slime_async.config.run_config import RunConfig
from slime_async.orchestrator.launch import setup_run
from slime_async.orchestrator.node_loss import TrainerLostError, trainer_lost_message
from slime_async.orchestrator.offline import train_offline
from slime_async.orchestrator.pipeline_member import PipelineMember
from slime_async.orchestrator.run import Run
from slime_async.orchestrator.supervisor import EnginesDownError
from slime_async.rollout.generate.assemble import assemble, overlong_shaping

log = logging.getLogger(__name__)


async def train(cfg: RunConfig, *, on_stop: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the whole job; returns the last step's metrics plus the run's accounting. `on_stop`
    hears the reason of a stop (`StopWatchdog.arm`) before the run is torn down."""
    if cfg.debug_train_only:  # from rollout dumps, or SFT: no engines
        return await train_offline(cfg)
    say = on_stop or (lambda _why: None)
    run = await setup_run(cfg)  # data, warm start, Ray roles, trainer, data worker, resume
    last: dict[str, Any] = {}
    try:
        await run.colocation.start(run.version)  # --colocate: the trainer offloaded first
        await run.worker.start()
        if cfg.pipeline.scheduler is not None:  # engines serve only while their slot is granted
            run.pipeline = PipelineMember(run)
            await run.pipeline.start()
        if cfg.debug_rollout_only:
            return await _rollouts_only(run, cfg)
        evals = _Evals(run, cfg)
        if run.start_step == 0:
            await run.tending(evals.baseline())
        for step in range(run.start_step, cfg.num_steps):
            t0 = time.perf_counter()
            batch = await run.next_batch(cfg.rollout.groups_per_step)
            if not batch.groups:
                log.warning("prompt source exhausted at step %d", step)
                break
            t1 = time.perf_counter()
            batch = await run.score(batch)  # whole-group rewards (slime's --group-rm)
            data = assemble(
                batch,
                estimator=cfg.rollout.advantage_estimator,
                overlong=overlong_shaping(cfg.rollout),
                normalize_rewards=cfg.rollout.rewards_normalization,
                whiten=cfg.rollout.normalize_advantages,
            )
            trained = await run.train_step(batch, data.batch)  # recorded (and dumped)
            t2 = time.perf_counter()

            sync: dict[str, float] = {}
            if run.version % cfg.update_weights_interval == 0:
                sync = await run.push_weights(run.version)
            t3 = time.perf_counter()

            evals.maybe_start()
            if run.should_save(run.version):
                await run.save(run.version)

            last = {
                **trained.metrics,
                **data.metrics,
                **run.worker.metrics(),
                **sync,
                **run.supervisor.metrics(),
                **run.chain.agent_metrics(),
                **run.chain.role_metrics(),
                **run.timing(wait_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2),
                **(run.pipeline.metrics() if run.pipeline is not None else {}),
            }
            run.log(run.version, last)
        await run.tending(evals.final())  # a replacement started meanwhile needs a push
        if run.saves and run.version > run.start_step:
            await run.save(run.version)
        last.update(run.accounting())
        return last
    except EnginesDownError as e:  # stop with a checkpoint: --load resumes once engines are back
        if run.saves:
            await run.save(run.version)
        say(str(e))
        raise
    except Exception as e:  # a lost trainer rank: say which, where it stands, how to resume
        if run.trainer is None or not (lost := await asyncio.to_thread(run.trainer.ranks_lost)):
            raise
        why = trainer_lost_message(lost, step=run.version, save=cfg.trainer.save, argv=sys.argv)
        say(why)  # the rest of the group may never answer again: the stop is bounded from here
        raise TrainerLostError(why) from e
    finally:
        await run.close()


class _Evals:
    """When the run evaluates: the baseline before the first push, every `--eval-interval`
    rollouts beside training (a due step is skipped while the last eval still runs), and the
    final weights after the last step, whatever the interval skipped: no push comes after the
    loop, so that eval (the one runs are compared by) sees exactly one version."""

    def __init__(self, run: Run, cfg: RunConfig) -> None:
        self.run = run
        self.every = cfg.rollout.eval_interval * cfg.rollout.num_steps_per_rollout  # rollouts
        self.task: asyncio.Task | None = None
        self.evaluated = -1  # the step of the last eval started

    async def baseline(self) -> None:
        if self.every:
            await self.run.evaluate(step=0)  # before any push: the initial weights only
            self.evaluated = 0

    def maybe_start(self) -> None:
        v = self.run.version
        if self.every and v % self.every == 0 and (self.task is None or self.task.done()):
            self.task = asyncio.create_task(self.run.evaluate(step=v))
            self.evaluated = v

    async def final(self) -> None:
        if self.task is not None:
            await self.task
        if self.every and self.evaluated != self.run.version:
            await self.run.evaluate(step=self.run.version)


async def _rollouts_only(run: Run, cfg: RunConfig) -> dict[str, Any]:
    """`--debug-rollout-only`: each step's batch generated, scored, assembled (its rollout
    metrics logged at step + 1) and dumped (`--save-debug-rollout-data`); nothing is trained,
    pushed, evaluated or saved, so the engines serve their start weights throughout."""
    last: dict[str, Any] = {}
    for step in range(cfg.num_steps):
        t0 = time.perf_counter()
        batch = await run.next_batch(cfg.rollout.groups_per_step)
        if not batch.groups:
            log.warning("prompt source exhausted at step %d", step)
            break
        batch = await run.score(batch)
        data = assemble(
            batch, estimator=cfg.rollout.advantage_estimator, overlong=overlong_shaping(cfg.rollout)
        )
        await run.dump(step, batch, trained=None)
        # no version is ever pushed: the admission budget (S + v + 1) x B counts the steps
        # consumed instead, so generation stays S + 1 steps ahead as in a training run
        run.worker.set_served_version(step + 1)
        wait = time.perf_counter() - t0
        last = {**data.metrics, **run.worker.metrics(), **run.chain.agent_metrics()}
        last |= run.timing(wait_s=wait, train_s=0.0, sync_s=0.0)
        run.log(step + 1, last)
    last.update(run.accounting())
    return last
