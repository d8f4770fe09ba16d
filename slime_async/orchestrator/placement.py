"""Where a run's roles go on a Ray cluster: placement groups, node IPs and per-node cores.

Owns `place_roles` (reserve the trainer's and the engines' bundles, then look at where each one
landed), `Slot` (one reserved bundle: its node, that node's IP, the cores it may pin, a free port
on that node), `split_node_cores` (each node's usable cores divided among the bundles on it),
and, when a node is lost, `node_alive` and `relocated` (where Ray moved a bundle of a dead node).

Layout, with slime's flag names:

* trainer: `--actor-num-nodes` placement groups of `--actor-num-gpus-per-node` bundles each,
  STRICT_PACK, so the ranks of one group share a node (and its NVLink); rank r takes bundle
  `r % gpus_per_node` of group `r // gpus_per_node`, so rank 0 is the first bundle of group 0;
  a group that landed on the driver's node is group 0 (rank 0 reads what the driver wrote).
* engines: one placement group of `--rollout-num-gpus / --rollout-num-gpus-per-engine` bundles,
  SPREAD, one bundle per engine holding all of its tensor-parallel GPUs.

A bundle asks for GPUs where the cluster has GPUs and for CPUs only where it has none
(`--actor-num-cpus-per-rank`, `--rollout-num-cpus-per-engine` logical CPUs either way). Cores
are given out on each node from that node's own usable set (read on the node, never the
driver's): the bundles on a node share its cores in proportion to the CPUs they asked for.
Never imports the controller, the trainer or an engine backend.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

PLACE_TIMEOUT_S = 120.0
"""How long the placement groups may take to be reserved before the run gives up."""


@ray.remote(num_cpus=0)
def _where() -> tuple[str, str, tuple[int, ...], int]:
    """(node id, node IP, usable cores, a free TCP port on the node IP), run inside a bundle."""
    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        port = int(s.getsockname()[1])
    node = ray.get_runtime_context().get_node_id()
    return node, ip, tuple(sorted(os.sched_getaffinity(0))), port


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """One reserved bundle and where it landed."""

    pg: PlacementGroup
    index: int
    """Bundle index inside `pg`."""
    resources: dict[str, float]
    """What the bundle reserved (`{"GPU": 1, "CPU": 1}` or `{"CPU": 1}`)."""
    node_id: str
    node_ip: str
    """IP of the bundle's node: servers placed here bind it, and URLs are built from it."""
    port: int
    """A TCP port that was free on `node_ip` when the bundle was inspected."""
    cores: tuple[int, ...] = ()
    """Cores of the node this bundle's process pins itself to (empty: no pinning)."""

    def actor_options(self) -> dict[str, Any]:
        """`.options(...)` of an actor that runs in this bundle and uses all of it."""
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=self.index
            ),
            "num_cpus": self.resources.get("CPU", 0.0),
            "num_gpus": self.resources.get("GPU", 0.0),
        }


@dataclasses.dataclass(kw_only=True)
class Placement:
    """The run's reserved bundles: one per trainer rank, one per engine."""

    trainer: list[Slot]
    engines: list[Slot]
    gpus: bool
    """True when bundles hold GPUs (the cluster has them)."""
    groups: list[PlacementGroup]

    def remove(self) -> None:
        """Give every reserved bundle back to the cluster."""
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # shutting down: report, keep going
                log.warning("placement group not removed: %s", e)
        self.groups = []


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0.0) > 0


def _bundle(*, gpus: float, cpus: float, use_gpus: bool) -> dict[str, float]:
    bundle = {"CPU": float(cpus)} if cpus > 0 else {}
    if use_gpus:
        bundle["GPU"] = float(gpus)
    return bundle or {"CPU": 0.001}  # a bundle must reserve something


def place_roles(
    *,
    actor_num_nodes: int,
    actor_num_gpus_per_node: int,
    actor_num_cpus_per_rank: float,
    num_engines: int,
    gpus_per_engine: int,
    cpus_per_engine: float,
    use_gpus: bool | None = None,
    timeout_s: float = PLACE_TIMEOUT_S,
) -> Placement:
    """Reserve the trainer's and the engines' bundles (see module docstring) and find where each
    landed. Raises RuntimeError naming what could not be placed and what the cluster has."""
    use_gpus = cluster_has_gpus() if use_gpus is None else use_gpus
    rank = _bundle(gpus=1, cpus=actor_num_cpus_per_rank, use_gpus=use_gpus)
    engine = _bundle(gpus=gpus_per_engine, cpus=cpus_per_engine, use_gpus=use_gpus)
    groups: list[tuple[PlacementGroup, str]] = []

    def reserve(bundles: list[dict[str, float]], strategy: str, what: str) -> None:
        # one group at a time: the trainer's packed groups are placed before the engines spread
        pg = placement_group(bundles, strategy=strategy)
        groups.append((pg, what))
        if not pg.wait(timeout_seconds=timeout_s):
            raise RuntimeError(
                f"could not reserve {what} on the Ray cluster within {timeout_s:.0f} s "
                f"(cluster resources: {ray.cluster_resources()}); lower "
                "--actor-num-nodes/--actor-num-gpus-per-node/--rollout-num-gpus, or add nodes"
            )

    try:
        for n in range(actor_num_nodes):
            reserve(
                [dict(rank)] * actor_num_gpus_per_node,
                "STRICT_PACK",
                f"trainer node {n}: {actor_num_gpus_per_node} x {rank}",
            )
        if num_engines:
            reserve([dict(engine)] * num_engines, "SPREAD", f"engines: {num_engines} x {engine}")
        slots = [
            _inspect(pg, i, pg.bundle_specs[i])
            for pg, _ in groups
            for i in range(len(pg.bundle_specs))
        ]
    except BaseException:
        for pg, _ in groups:
            remove_placement_group(pg)
        raise
    slots = split_node_cores(slots)
    ranks = actor_num_nodes * actor_num_gpus_per_node
    slots = _driver_node_first(slots[:ranks], actor_num_gpus_per_node) + slots[ranks:]
    placement = Placement(
        trainer=slots[:ranks], engines=slots[ranks:], gpus=use_gpus, groups=[pg for pg, _ in groups]
    )
    log.info(
        "trainer ranks on %s; engines on %s",
        [s.node_ip for s in placement.trainer],
        [s.node_ip for s in placement.engines],
    )
    return placement


def _driver_node_first(trainer: list[Slot], per_node: int) -> list[Slot]:
    """The trainer's groups reordered so that a group on the driver's node (if one landed there)
    holds rank 0: rank 0 reads what the driver wrote (the warm start) and sends it to ranks on
    nodes that cannot see it (docs/cluster.md, no shared filesystem)."""
    here = ray.get_runtime_context().get_node_id()
    groups = [trainer[i : i + per_node] for i in range(0, len(trainer), per_node)]
    groups.sort(key=lambda g: g[0].node_id != here)  # stable: otherwise the reserved order
    return [s for g in groups for s in g]


def _inspect(pg: PlacementGroup, index: int, resources: dict[str, float]) -> Slot:
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index
    )
    node_id, ip, cores, port = ray.get(_where.options(scheduling_strategy=strategy).remote())
    slot = Slot(
        pg=pg,
        index=index,
        resources=dict(resources),
        node_id=node_id,
        node_ip=ip,
        port=port,
        cores=cores,
    )
    return slot


def node_alive(node_id: str) -> bool:
    """Whether Ray counts the node as alive (a lost node is declared dead after its missed
    health checks)."""
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def relocated(slot: Slot, *, timeout_s: float) -> Slot | None:
    """Where `slot`'s bundle is now that its node is lost: Ray moves the bundles of a dead node
    to live nodes that have room, so the bundle is looked at again (the task waits until the
    bundle is placed). None when it is not placed within `timeout_s` (no room). The new slot
    pins no cores (the node's cores are already shared out among its first bundles)."""
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=slot.pg, placement_group_bundle_index=slot.index
    )
    ref = _where.options(scheduling_strategy=strategy).remote()
    done, _ = ray.wait([ref], timeout=timeout_s)
    if not done:
        ray.cancel(ref, force=True)
        return None
    node_id, ip, _, port = ray.get(ref)
    if node_id == slot.node_id:
        return None
    return dataclasses.replace(slot, node_id=node_id, node_ip=ip, port=port, cores=())


def split_node_cores(slots: list[Slot]) -> list[Slot]:
    """Each node's usable cores (as read on that node) divided among the bundles on it, in
    proportion to their CPUs, in bundle order; where a node has fewer cores than bundles, they
    share all of them. Slots come back in the order given.

    >>> # node A has cores 0-7; trainer ranks ask 1 CPU each, one engine asks 2
    >>> # -> rank 0: (0, 1), rank 1: (2, 3), engine: (4, 5, 6, 7)
    """
    by_node: dict[str, list[int]] = {}
    for i, s in enumerate(slots):
        by_node.setdefault(s.node_id, []).append(i)
    out = list(slots)
    for idx in by_node.values():
        cores = slots[idx[0]].cores
        if len(cores) < len(idx):
            continue  # they share the node's cores: no pinning beyond the node's own set
        weights = [max(slots[i].resources.get("CPU", 0.0), 1e-3) for i in idx]
        total, start, acc = sum(weights), 0, 0.0
        for j, i in enumerate(idx):
            acc += weights[j]
            end = len(cores) if j == len(idx) - 1 else round(len(cores) * acc / total)
            end = min(max(end, start + 1), len(cores) - (len(idx) - 1 - j))
            out[i] = dataclasses.replace(slots[i], cores=cores[start:end])
            start = end
    return out
