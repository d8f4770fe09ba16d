"""The slice of `roles.Cluster` that `EngineSupervisor` calls, for supervisor tests: the
router's verdict on each engine comes from `verdict(url) -> (is_healthy, state)`; the engines'
processes are alive and on live nodes unless a test's subclass says otherwise."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


class _Control:
    def __init__(self, fleet: FleetSlice) -> None:
        self.fleet = fleet

    async def list_workers(self) -> list[dict]:
        out = []
        for u in self.fleet.engines:
            healthy, state = self.fleet.verdict(u)
            out.append({"url": u, "is_healthy": healthy, "state": state})
        return out


class _Backend:
    can_restart = True


@dataclasses.dataclass
class FleetSlice:
    engines: list[str]
    verdict: Callable[[str], tuple[bool, str]] = lambda _u: (False, "quarantined")
    backend: _Backend = dataclasses.field(default_factory=_Backend)
    pending: set[str] = dataclasses.field(default_factory=set)
    asleep: set[str] = dataclasses.field(default_factory=set)

    @property
    def control(self) -> _Control:
        return _Control(self)

    @property
    def engine_urls(self) -> list[str]:
        return list(self.engines)

    async def engine_alive(self, i: int) -> bool:
        return True

    async def lost_node(self, i: int) -> str | None:
        return None
