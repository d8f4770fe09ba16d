"""Aborting a weight update group (`slime_async.contracts.weight_group`) over real gloo, with
real processes: a member that joined and then stops receiving no longer holds rank 0 for the op
timeout once the driver sets the group's `abort` key (`GroupControl`); a member still receiving
stops too; rank 0 leaves the group without blocking and forms a new one with a healthy member.
The op timeout is 300 s, so a regression fails by the pytest timeout instead of passing slowly.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from slime_async.contracts.weight_buckets import plan_buckets
from slime_async.contracts.weight_group import GroupControl, WeightGroup, WeightGroupAborted
from slime_async.contracts.weight_transfer import receive_bucket, send_buckets
from slime_async.contracts.weights import WeightManifest
from slime_async.host import free_port

pytestmark = pytest.mark.timeout(150)
OP_TIMEOUT_S = 300.0
NUMEL = 4_000_000
"""16 MB per bucket: more than loopback socket buffers hold, so a sender to a member that does
not read really waits."""
TENSORS = {f"w{i}": torch.full((NUMEL,), float(i)) for i in range(4)}
BUCKETS = plan_buckets(WeightManifest.of(TENSORS, version=0), bucket_bytes=NUMEL * 4)


def _member(port: int, rank: int, world: int, stop_after: int, out: mp.Queue) -> None:
    """Rank `rank`: receive every bucket, or `stop_after` of them and then idle (alive, in the
    group, no longer receiving). Reports ("got", sums) or ("aborted", how many it received)."""
    g = WeightGroup.open(
        master_address="127.0.0.1",
        master_port=port,
        rank=rank,
        world_size=world,
        group_name="w",
        backend="gloo",
        timeout_s=OP_TIMEOUT_S,
    )
    sums = []
    try:
        for b in BUCKETS:
            if len(sums) == stop_after:
                out.put(("idle", len(sums)))
                threading.Event().wait(600)
            got = receive_bucket(g, b, flatten=True)
            sums.append(sorted((k, float(v.sum())) for k, v in got.items()))
    except WeightGroupAborted:
        out.put(("aborted", len(sums)))
        return
    finally:
        g.close()
    out.put(("got", sums))


def _start(port: int, rank: int, world: int, stop_after: int) -> tuple[mp.Process, mp.Queue]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_member, args=(port, rank, world, stop_after, q), daemon=True)
    p.start()
    return p, q


def _send_in_thread(g: WeightGroup) -> tuple[threading.Thread, list[BaseException | None]]:
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            send_buckets(g, TENSORS, BUCKETS, flatten=True)
            result.append(None)
        except BaseException as e:  # handed to the test
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def _expected() -> list[list[tuple[str, float]]]:
    return [sorted((e.name, float(TENSORS[e.name].sum())) for e in b) for b in BUCKETS]


def test_member_that_stops_receiving_is_aborted_and_a_new_group_works() -> None:
    port = free_port()
    stopper, q_stop = _start(port, 1, 3, stop_after=2)
    keeper, q_keep = _start(port, 2, 3, stop_after=len(BUCKETS))
    procs = [stopper, keeper]
    try:
        g = WeightGroup.open(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=3,
            group_name="w",
            backend="gloo",
            timeout_s=OP_TIMEOUT_S,
        )
        ctl = GroupControl.connect(master_address="127.0.0.1", master_port=port, group_name="w")
        sender, result = _send_in_thread(g)
        assert q_stop.get(timeout=60) == ("idle", 2)
        sender.join(5)
        assert sender.is_alive(), "rank 0 must be waiting on the member that stopped"
        assert ctl.sent() == 2  # the driver sees rank 0's progress
        ctl.abort("member 1 stopped receiving")
        sender.join(60)  # well under the 300 s op timeout
        assert not sender.is_alive() and isinstance(result[0], WeightGroupAborted)
        assert "member 1 stopped receiving" in str(result[0])
        # the member still receiving stops as well, instead of at its op timeout
        kind, n = q_keep.get(timeout=60)
        assert kind == "aborted" and n in (2, 3)  # rank 0 may have served it bucket 2
        g.close()  # already left: returns at once, never waits for the op in flight

        # a fresh group on a fresh port, with a healthy member, carries every bucket
        port2 = free_port()
        healthy, q_ok = _start(port2, 1, 2, stop_after=len(BUCKETS))
        procs.append(healthy)
        g2 = WeightGroup.open(
            master_address="127.0.0.1",
            master_port=port2,
            rank=0,
            world_size=2,
            group_name="w",
            backend="gloo",
            timeout_s=OP_TIMEOUT_S,
        )
        send_buckets(g2, TENSORS, BUCKETS, flatten=True)
        assert q_ok.get(timeout=60) == ("got", _expected())
        g2.close()
    finally:
        for p in procs:
            p.kill()
            p.join()


def test_close_with_an_op_in_flight_does_not_block() -> None:
    """Another thread is in a broadcast to a member that stopped: `close` leaves the group
    at once (the op is released in the background) and the broadcast raises."""
    port = free_port()
    stopper, q_stop = _start(port, 1, 2, stop_after=1)
    try:
        g = WeightGroup.open(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name="w",
            backend="gloo",
            timeout_s=OP_TIMEOUT_S,
        )
        sender, result = _send_in_thread(g)
        assert q_stop.get(timeout=60) == ("idle", 1)
        g.close()  # must not wait for the op's 300 s timeout
        assert g.pg is None
        sender.join(60)
        assert not sender.is_alive() and isinstance(result[0], WeightGroupAborted)
    finally:
        stopper.kill()
        stopper.join()
