"""The pipeline scheduler: several RL pipelines (runs) share one pool of engine slots.

Owns `PipelineScheduler` (the core as a named Ray actor, on the wall clock) and
`start_scheduler` / `scheduler_handle`. The decisions themselves, `plan_slots` (the policy) and
`SchedulerCore` (the state machine: joins, reports, heartbeats, hand-overs, fences), are pure and live in
`pipeline_policy.py` and `pipeline_core.py` (`SchedulerCore` re-exported here), where the cluster-scale simulator drives the same code
in virtual time. The rules are docs/pipeline-scheduler.md:
each pipeline joins with its priority, the slots its engines sit on and their capacity, and
reports its generation demand, its samples in flight and its running requests per slot with
every heartbeat; each slot serves one pipeline at a time, and no pipeline is granted more
slots than its demand fills; a slot moves only through a hand-over (the holder is told to give
it up, lets it drain or cuts it, puts its engine there to sleep, confirms, and only then is the
slot granted to the next pipeline, which wakes its own engine there and gives it its current
version before it serves: selective sync); a pipeline that leaves loses its slots at once, one
silent for `heartbeat_timeout_s` is dropped and its slots are fenced for `fence_s`. Partial
overlap: a slot marked as a pipeline's trainer slot (`PipelineSchedulerConfig.trainer_slots`)
serves generation only between that pipeline's `before_training` and `after_training` hooks.
The scheduler never talks to an engine itself: the pipelines act (`pipeline_member.py`).
Must never import the controller or a run's roles.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from slime_async.config.pipeline import PipelineSchedulerConfig
from slime_async.orchestrator.pipeline_core import SchedulerCore
from slime_async.orchestrator.pipeline_policy import PipelineState, plan_slots

__all__ = [
    "PipelineScheduler",
    "PipelineState",
    "SchedulerCore",
    "plan_slots",
    "scheduler_handle",
    "start_scheduler",
]

SCHEDULER_NAMESPACE = "slime_async_pipelines"


@ray.remote(num_cpus=0)
class PipelineScheduler:
    """`SchedulerCore` as a named Ray actor (wall clock: `time.monotonic`)."""

    def __init__(self, cfg: PipelineSchedulerConfig) -> None:
        self.core = SchedulerCore(cfg)

    def join(
        self, name: str, priority: float, slots: list[int], capacity: int = 1
    ) -> dict[str, float]:
        return self.core.join(
            name, priority=priority, slots=slots, capacity=capacity, now=time.monotonic()
        )

    def leave(self, name: str) -> None:
        self.core.leave(name, now=time.monotonic())

    def report(
        self,
        name: str,
        demand: int,
        version: int,
        inflight: int = 0,
        load: dict[int, int] | None = None,
    ) -> dict[str, Any]:
        return self.core.report(
            name,
            demand=demand,
            version=version,
            inflight=inflight,
            load=load,
            now=time.monotonic(),
        )

    def released(self, name: str, slot: int) -> None:
        self.core.released(name, slot, now=time.monotonic())

    def before_training(self, name: str) -> dict[str, Any]:
        return self.core.before_training(name, now=time.monotonic())

    def after_training(self, name: str) -> None:
        self.core.after_training(name, now=time.monotonic())

    def state(self) -> dict[str, Any]:
        self.core._expire(time.monotonic())
        return self.core.state()


def start_scheduler(name: str, cfg: PipelineSchedulerConfig) -> Any:
    """Start the scheduler `name` in the current Ray cluster (it lives until killed)."""
    return PipelineScheduler.options(
        name=name, namespace=SCHEDULER_NAMESPACE, lifetime="detached"
    ).remote(cfg)


def scheduler_handle(name: str) -> Any:
    """The running scheduler `name`; a clear error when there is none."""
    try:
        return ray.get_actor(name, namespace=SCHEDULER_NAMESPACE)
    except ValueError:
        raise RuntimeError(
            f"--pipeline-scheduler {name}: no pipeline scheduler of that name runs in this Ray "
            "cluster; start one first (slime_async.orchestrator.pipeline_scheduler."
            "start_scheduler) or drop the flag"
        ) from None
