"""The supervisor tells a slow engine from a hung one before it restarts anything.

Pinned: an engine the router holds unhealthy (its probes time out on a loaded node) but that
answers a 1-token generation itself (a real embedded engine) is not restarted, however long the
router's verdict lasts; a server that accepts connections and never answers is restarted once.
The router's verdict is given (the slice of `roles.Cluster` the supervisor reads); the engine
and the hung server are real sockets.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest

from tests.supervised_fleet import FleetSlice

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def hung_url():
    """A server that accepts connections and reads, and never answers."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        lsock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{lsock.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    lsock.close()


async def test_a_slow_engine_is_spared_and_a_hung_one_is_restarted(hung_url):
    from slime_async.config.supervision import SupervisorConfig
    from slime_async.engine import EngineConfig, EngineServer
    from slime_async.orchestrator.supervisor import EngineSupervisor

    srv = EngineServer(EngineConfig(dtype="fp32", seed=1, weight_version="0"))
    slow_url = srv.start()
    replaced: list[int] = []

    class Fleet(FleetSlice):  # the router holds both unhealthy; both processes run
        async def replace_engine(self, i: int, *, model_dir: Path, version: int, admit: bool):
            replaced.append(i)
            self.engines[i] = f"http://new{i}"
            return self.engines[i]

    fleet = Fleet(
        engines=[slow_url, hung_url],
        verdict=lambda u: (u.startswith("http://new"), "quarantined"),
    )
    cfg = SupervisorConfig(restart_after_s=0.2, hung_timeout_s=3.0, interval_s=0.05)
    sup = EngineSupervisor(fleet, cfg, current_weights=lambda: (Path("/w"), 0))  # type: ignore[arg-type]
    try:
        sup.start()
        await asyncio.sleep(8)
    finally:
        await sup.stop()
        srv.stop()
    assert replaced == [1] and fleet.engines == [slow_url, "http://new1"]
    assert sup.restarts == 1 and sup.slow_spared >= 2  # looked at again, spared again
    assert sup.metrics()["engines/slow_spared"] == sup.slow_spared


async def test_a_replacement_that_takes_long_to_start_does_not_count_as_an_outage():
    """The only engine dies; its replacement takes longer to start than the all-down limit
    (a loaded node) and then serves: the run goes on. Only an outage after it came up counts."""
    from slime_async.config.supervision import SupervisorConfig
    from slime_async.orchestrator.supervisor import EngineSupervisor

    healthy: set[str] = set()

    class Fleet(FleetSlice):
        async def engine_alive(self, i: int) -> bool:
            return self.engines[i] != "http://dead"

        async def replace_engine(self, i: int, *, model_dir: Path, version: int, admit: bool):
            await asyncio.sleep(1.5)  # longer than the all-down limit
            self.engines[i] = "http://new"
            asyncio.get_running_loop().call_later(0.3, healthy.add, "http://new")
            return self.engines[i]

    fleet = Fleet(engines=["http://dead"], verdict=lambda u: (u in healthy, "healthy"))
    cfg = SupervisorConfig(all_down_timeout_s=1.0, interval_s=0.05)
    sup = EngineSupervisor(fleet, cfg, current_weights=lambda: (Path("/w"), 0))  # type: ignore[arg-type]
    try:
        sup.start()
        await asyncio.sleep(3.0)
        assert not sup.failed.is_set(), sup.reason
        assert sup.restarts == 1 and fleet.engines == ["http://new"]
        healthy.clear()  # now it goes down for good: that outage counts
        await asyncio.wait_for(sup.failed.wait(), 5.0)
    finally:
        await sup.stop()
    assert "were down for" in sup.reason
