"""The pipeline scheduler's decisions, pure: no Ray, no clock of its own, no I/O.

Owns `PipelineState` (what the scheduler knows of one pipeline), `slot_need`, `spread_need` and
`fair_targets` (how many slots each pipeline should hold), `plan_slots` (the policy: which free
slot goes to whom, which slots nobody needs are lent to spread a pipeline's requests, which held
slot is given up and whether it drains or is cut) and `generation_demand` /
`generation_inflight` (what a run reports). The sustained-demand claims (a pipeline's need
averaged over `demand_window_s`, and what its claim protects) are `pipeline_claims.py`'s; the
grant rules here take their fair shares. The state machine that applies each plan
(`pipeline_core.SchedulerCore`) is driven by both the Ray actor
(`pipeline_scheduler.PipelineScheduler`) and the cluster-scale simulator
(`scripts/simulate_pipelines.py`, virtual time), so what the simulator measures is the policy
the live scheduler runs. Rules: docs/pipeline-scheduler.md. Must never import Ray, the
controller or a run's roles.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from slime_async.orchestrator.pipeline_claims import below_claim, claim_caps, kept


def generation_demand(metrics: Mapping[str, float], n_samples_per_prompt: int) -> int:
    """Samples a run can still use at its current version within its staleness bound and has
    not started yet: the groups its staleness budget still admits times the samples per group,
    plus the samples queued or waiting on a length probe (from the data worker's `metrics()`).
    Samples in flight are not demand: they are `generation_inflight`.

    >>> m = {"data/admission_limit": 6, "data/live_groups": 4, "data/inflight": 3,
    ...      "data/queue_depth": 1, "data/waiting_probe": 2}
    >>> generation_demand(m, 4)
    11
    """
    room = max(0.0, metrics["data/admission_limit"] - metrics["data/live_groups"])
    queued = metrics["data/queue_depth"] + metrics.get("data/waiting_probe", 0.0)
    return int(room * n_samples_per_prompt + queued)


def generation_inflight(metrics: Mapping[str, float]) -> int:
    """Samples a run has sent to its engines and not had back (running or in its router)."""
    return int(metrics["data/inflight"])


@dataclasses.dataclass(slots=True)
class PipelineState:
    """What the scheduler knows of one pipeline."""

    name: str
    priority: float
    slots: tuple[int, ...]
    """Slots this pipeline has an engine on."""
    capacity: int = 1
    """Concurrent requests one of its engines serves (samples per slot)."""
    demand: int = 0
    """Samples it can still use and has not started (its last report)."""
    inflight: int = 0
    """Samples it has running (its last report)."""
    load: dict[int, int] = dataclasses.field(default_factory=dict)
    """Requests running on each slot it serves (its last report; missing: 0)."""
    version: int = 0
    last_seen: float = 0.0
    served_s: float = 0.0
    """Slot-seconds granted so far (the fairness account, weighted by `priority`)."""
    need_avg: float | None = None
    """Its `slot_need` averaged over the scheduler's `demand_window_s` (None: not reported
    yet, or sustained demand off)."""
    sustained: int = 0
    """`need_avg` in whole slots, with hysteresis (`sustained_slots`): what its claim is of."""


def slot_need(p: PipelineState) -> int:
    """The slots `p` can fill: its demand plus its samples in flight over its engines'
    capacity, at most the slots it has engines on.

    >>> slot_need(PipelineState("a", 1.0, (0, 1, 2, 3), capacity=8, demand=9, inflight=3))
    2
    """
    return min(len(p.slots), math.ceil((p.demand + p.inflight) / p.capacity))


def spread_need(p: PipelineState) -> int:
    """The slots `p`'s work could spread over: one request per engine (its demand plus its
    samples in flight), at most the slots it has engines on. Above `slot_need` only while it has
    fewer requests than its engines' places.

    >>> spread_need(PipelineState("a", 1.0, (0, 1, 2, 3), capacity=8, demand=2, inflight=1))
    3
    """
    return min(len(p.slots), p.demand + p.inflight)


def fair_targets(
    need: Mapping[str, int], weight: Mapping[str, float], order: list[str], n_slots: int
) -> dict[str, int]:
    """Water-fill `n_slots` over the pipelines in proportion to `weight`, none above its
    `need`; what one cannot use goes to the others; the indivisible rest one each in `order`.

    >>> fair_targets({"a": 2, "b": 10, "c": 10}, dict.fromkeys("abc", 1.0), list("abc"), 13)
    {'a': 2, 'b': 6, 'c': 5}
    >>> fair_targets({"a": 20, "b": 20}, {"a": 3.0, "b": 1.0}, list("ab"), 8)
    {'a': 6, 'b': 2}
    """
    target = dict.fromkeys(need, 0)
    left, open_ = n_slots, [n for n in order if need[n] > 0]
    while left > 0 and open_:
        total = sum(weight[n] for n in open_)
        share = {n: left * weight[n] / total for n in open_}
        full = [n for n in open_ if need[n] <= share[n]]
        if full:  # they get all they need; the rest is shared again among the others
            for n in full:
                target[n], left = need[n], left - need[n]
            open_ = [n for n in open_ if n not in full]
            continue
        for n in open_:
            target[n], left = int(share[n]), left - int(share[n])
        for n in open_[:left]:  # need > share > target here: one more fits
            target[n] += 1
        left = 0
    return target


@dataclasses.dataclass(slots=True)
class Plan:
    """One decision of `plan_slots`."""

    grant: dict[int, str] = dataclasses.field(default_factory=dict)
    """Free slots and the pipeline each goes to."""
    give_up: dict[int, bool] = dataclasses.field(default_factory=dict)
    """Held slots whose holder must give them up, and whether at once (True: its running
    requests are cut) or after a drain (False)."""
    target: dict[str, int] = dataclasses.field(default_factory=dict)
    """Slots each pipeline should hold (`fair_targets` of the needs)."""
    lent: set[int] = dataclasses.field(default_factory=set)
    """Of `grant`, the slots lent beyond their pipeline's target (slots nobody needs, to spread
    its requests over: above its target, so the first given up when another one is short)."""
    claim: dict[str, int] | None = None
    """Sustained demand: the slots each pipeline keeps even while idle and may take busy
    (`fair_targets` of the sustained needs); None: off."""
    reserved: dict[str, int] = dataclasses.field(default_factory=dict)
    """Trainer slots its trainer holds now, per pipeline: they count toward its claim."""


def plan_slots(
    pipelines: Mapping[str, PipelineState],
    owner: Mapping[int, str | None],
    since: Mapping[int, float],
    *,
    leaving: frozenset[int] | set[int] = frozenset(),
    blocked: frozenset[int] | set[int] = frozenset(),
    now: float,
    min_hold_s: float,
    spread: bool = False,
    trainer_of: Mapping[int, str] | None = None,
    sustained: Mapping[str, int] | None = None,
    training: frozenset[str] | set[str] = frozenset(),
    quantum_s: float = 0.0,
) -> Plan:
    """Who should serve where next (pure). Each pipeline's target is its share of the usable
    slots (not `blocked`) by priority, never above its `slot_need`; the least served (slot
    time per priority) first for the indivisible rest. Free slots go to pipelines below their
    target. With `spread`, a pipeline's need is at least its share of the pool by priority (what
    an exclusive allocation would give it) while its requests could spread over that many
    engines, and the free slots left after the targets (nobody needs them) are lent to
    pipelines whose work could spread over more engines (`spread_need`), water-filled by
    priority: fewer requests per engine decode faster. Only while some pipeline is still short
    after that (and the slots already `leaving` do not cover it) is a holder above its target
    asked to give up slots (lent slots are above it): the ones with the fewest running requests
    first, none held less than `min_hold_s`, nor less than `quantum_s` (the rotation quantum)
    while its holder still needs slots (`slot_need` > 0). A slot with running requests is cut at once only
    for a pipeline of higher priority; otherwise it drains. A slot nobody else needs stays with
    its holder: lending never takes a slot from anyone (a held idle slot taken for spreading
    comes too late: a step's requests are placed when they start, and taking it only moves the
    next step's short for its holder; the simulator showed it losing). A free slot that is a
    pipeline's trainer slot (`trainer_of`: partial overlap) goes to that pipeline first, and to
    the others only after every other free slot (it is taken back at its trainer's next step).
    With `sustained` (each pipeline's sustained slot need), the fair shares of those are the
    claims: a holder never gives up a slot while it holds no more than its claim (nor its
    target), and a busy slot is taken (drained, or cut for a higher priority) only for a
    pipeline short of its claim; slots beyond the claims go where the demand is now (free and
    idle ones only), so a step's short peak takes no running request from anyone. The trainer
    slots of the pipelines `training` (blocked while their trainer holds them) count toward
    their own pipeline's claim: a training pipeline is not short of its claim by the slot its
    trainer is on, so it takes nobody's slot for it. A holder gives up its own trainer slot
    last (it gets it back first at every step), and gets it back while it is short of its
    claim even when it wants no slot at that instant (a fully asynchronous pipeline reports
    no demand between dispatching a step's samples and training on them: lending its slot then
    only wakes another pipeline's engine there to cut it at the next step).

    >>> a = PipelineState("a", 1.0, (0, 1), capacity=4, demand=8, load={0: 4, 1: 1})
    >>> b = PipelineState("b", 1.0, (0, 1), capacity=4, demand=8)
    >>> p = plan_slots({"a": a, "b": b}, {0: "a", 1: "a"}, {}, now=5.0, min_hold_s=2.0)
    >>> p.target, p.give_up
    ({'a': 1, 'b': 1}, {1: False})
    >>> b.priority = 2.0
    >>> plan_slots({"a": a, "b": b}, {0: "a", 1: "a"}, {}, now=5.0, min_hold_s=2.0).give_up
    {1: True}
    """
    order = sorted(pipelines.values(), key=lambda p: (p.served_s / p.priority, p.name))
    usable = [s for s in owner if s not in blocked]
    target = _targets(order, len(usable), spread=spread)
    plan = Plan(target=target)
    trainer_of = trainer_of or {}
    if sustained is not None:
        _claims(plan, order, sustained, owner, usable, blocked, trainer_of, training)
    held = {n: [s for s, h in owner.items() if h == n and s not in leaving] for n in pipelines}
    # a trainer's slot last: it is taken back at its trainer's next step (stable: slot order)
    free = sorted((s for s in usable if owner[s] is None), key=lambda s: s in trainer_of)
    want = {p.name: target[p.name] - len(held[p.name]) for p in order}
    _grant_own_trainer_slots(plan, order, free, trainer_of, held, want)
    for p in order:
        _grant(plan, p, free, want)
    short = {n: w for n, w in want.items() if w > 0}
    if spread:
        _lend(plan, order, held, [s for s in free if s not in plan.grant])
    missing = sum(short.values()) - sum(s not in blocked for s in leaving)
    if missing > 0:
        _give_up(
            plan, pipelines, held, short, since, missing, now=now, trainer_of=trainer_of,
            hold_s=(min_hold_s, max(min_hold_s, quantum_s)),
        )  # fmt: skip
    return plan


def _targets(order: Sequence[PipelineState], usable: int, *, spread: bool) -> dict[str, int]:
    """Each pipeline's target: its fair share by priority of the `usable` slots, never above
    its `slot_need` (with `spread`, at least its share of the pool while its requests could
    spread over that many engines, as on an exclusive allocation), in `order` for the rest."""
    weight = {p.name: p.priority for p in order}
    need = {p.name: slot_need(p) for p in order}
    if spread:
        total = sum(weight.values())
        for p in order:
            share = int(usable * p.priority / total)
            need[p.name] = min(spread_need(p), max(need[p.name], share))
    return fair_targets(need, weight, [p.name for p in order], usable)


def _claims(
    plan: Plan,
    order: Sequence[PipelineState],
    sustained: Mapping[str, int],
    owner: Mapping[int, str | None],
    usable: list[int],
    blocked: frozenset[int] | set[int],
    trainer_of: Mapping[int, str],
    training: frozenset[str] | set[str],
) -> None:
    """`plan.claim` (fair shares of the sustained needs, over the usable slots and the
    trainer slots of the pipelines `training`) and `plan.reserved` (those trainer slots,
    counted toward their own pipeline's claim)."""
    reserved = [s for s in owner if trainer_of.get(s) in training]  # its trainer's: blocked
    weight = {p.name: p.priority for p in order}
    capped = claim_caps(sustained, {p.name: len(p.slots) for p in order})
    n = len(usable) + sum(s in blocked for s in reserved)
    plan.claim = fair_targets(capped, weight, [p.name for p in order], n)
    plan.reserved = {p.name: sum(trainer_of[s] == p.name for s in reserved) for p in order}


def _grant_own_trainer_slots(
    plan: Plan,
    order: Sequence[PipelineState],
    free: list[int],
    trainer_of: Mapping[int, str],
    held: Mapping[str, list[int]],
    want: dict[str, int],
) -> None:
    """Each pipeline's free trainer slots go to it first: up to its want, and beyond it while it
    is short of its sustained claim (it may want nothing at this instant between two steps)."""
    for p in order:
        own = [s for s in free if trainer_of.get(s) == p.name]
        _grant(plan, p, own, want)
        if plan.claim is None:
            continue
        for s in own:
            if s not in plan.grant and s in p.slots and _below_claim(plan, held, p.name):
                plan.grant[s], want[p.name] = p.name, want[p.name] - 1


def _grant(plan: Plan, p: PipelineState, free: list[int], want: dict[str, int]) -> None:
    """Grant `p` the slots of `free` not granted yet that it has engines on, up to its want."""
    for s in free:
        if want[p.name] <= 0:
            return
        if s not in plan.grant and s in p.slots:
            plan.grant[s] = p.name
            want[p.name] -= 1


def _lend(
    plan: Plan, order: list[PipelineState], held: Mapping[str, list[int]], left: list[int]
) -> None:
    """Lend the free slots `left` (nobody needs them) to the pipelines whose work could spread
    over more engines than they hold, water-filled by priority."""
    mine = {
        p.name: len(held[p.name]) + sum(h == p.name for h in plan.grant.values()) for p in order
    }
    extra = {p.name: max(0, spread_need(p) - mine[p.name]) for p in order}
    weight = {p.name: p.priority for p in order}
    share = fair_targets(extra, weight, [p.name for p in order], len(left))
    for p in order:
        for s in left:
            if share[p.name] <= 0:
                break
            if s not in plan.grant and s in p.slots:
                plan.grant[s], share[p.name] = p.name, share[p.name] - 1
                plan.lent.add(s)


def _give_up(
    plan: Plan,
    pipelines: Mapping[str, PipelineState],
    held: Mapping[str, list[int]],
    short: Mapping[str, int],
    since: Mapping[int, float],
    missing: int,
    *,
    now: float,
    hold_s: tuple[float, float],
    trainer_of: Mapping[int, str],
) -> None:
    """Pick up to `missing` slots above their holders' targets for the `short` pipelines
    (a holder's own trainer slot last), none held less than `hold_s` (without, with slot need)."""
    candidates: list[tuple[bool, bool, int, int, bool]] = []
    for name, slots in held.items():
        q = pipelines[name]
        if len(slots) - plan.target[name] <= 0:
            continue
        mine_now = len(slots) + plan.reserved.get(name, 0)
        surplus = mine_now - kept(plan.target[name], plan.claim, name)  # its claim is kept
        if surplus <= 0:
            continue
        mine, hold = [], hold_s[slot_need(q) > 0]
        for s in slots:
            wanting = [pipelines[n] for n in short if s in pipelines[n].slots]
            load = q.load.get(s, 0)
            if load and plan.claim is not None:  # a busy slot only for a claim, or a priority
                wanting = [
                    p
                    for p in wanting
                    if p.priority > q.priority or _below_claim(plan, held, p.name)
                ]
            if not wanting:
                continue
            higher = max(p.priority for p in wanting) > q.priority
            if not higher and now - since.get(s, -math.inf) < hold:
                continue
            mine.append((not higher, trainer_of.get(s) == name, load, s, higher and load > 0))
        candidates.extend(sorted(mine)[:surplus])
    for *_, s, cut in sorted(candidates)[:missing]:
        plan.give_up[s] = cut


def _below_claim(plan: Plan, held: Mapping[str, list[int]], name: str) -> bool:
    assert plan.claim is not None
    granted = sum(n == name for n in plan.grant.values())
    holds = len(held[name]) + granted + plan.reserved.get(name, 0)
    return below_claim(holds, plan.claim, name)
