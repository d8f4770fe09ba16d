"""The distributed transport's same-node path against real embedded engine processes: engine A
takes buckets through shared memory (it is on the sender's node), engine B was started with
--no-same-node-weights and gets the gloo broadcast in the same group. A push serves the sender's
exact bits from the segment (no copy into the model); an engine on another node (the host
identity the sender's offer carries) gets the broadcast; a segment changed after its checksum
is refused and the old weights keep serving; a segment name from an HTTP client is refused; no
segment outlives the group that made it (nothing in /dev/shm, no descriptor left in the sender,
an engine maps only the set it serves; a sender killed mid-group leaves nothing mapped; an
engine killed mid-push: tests/test_weights_distributed.py::test_engine_dying_as_the_broadcast_starts)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch

from slime_async.contracts import weight_shm
from slime_async.contracts.weight_buckets import (
    bucket_pieces,
    copy_and_checksum,
    entry_nbytes,
    tensors_checksum,
    torch_dtype,
)
from slime_async.contracts.weight_group import CHUNK_KEY, SHM_BUCKET_KEY
from slime_async.contracts.weight_transfer import publish_checksum
from slime_async.engine import EngineConfig, EngineProcess
from slime_async.engine.testing import post, start_processes, stop_processes
from slime_async.weights import InProcessSender
from tests.test_weights_distributed import CFG, Weights, _exact, _pushing, _served

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not weight_shm.supported(), reason="the same-node path needs Linux"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(A: same node, B: --no-same-node-weights), each spilling its weights into its own dir."""
    dirs = [tmp_path_factory.mktemp(n) for n in ("a", "b")]
    engines = [
        EngineProcess(
            EngineConfig(
                dtype="fp32",
                weight_version="0",
                num_threads=1,
                weight_group_timeout_s=60.0,
                same_node_weights=same,
            ),
            env={"TMPDIR": str(d)},
        )
        for same, d in ((True, dirs[0]), (False, dirs[1]))
    ]
    start_processes(engines)
    yield engines, dirs
    stop_processes(engines)


def _segments_mapped(e: EngineProcess) -> set[str]:
    """The weight-group segments process `e` maps (names, from /proc/<pid>/maps)."""
    text = Path(f"/proc/{e.proc.pid}/maps").read_text()  # type: ignore[union-attr]
    return {
        line.split("/memfd:")[1].split(" ")[0]
        for line in text.splitlines()
        if "/memfd:" + weight_shm.NAME_PREFIX in line
    }


def _segments_held_here() -> list[str]:
    """Weight-group segment descriptors this (the sender's) process still holds."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:" + weight_shm.NAME_PREFIX):
            out.append(target)
    return out


def _shm_files() -> set[str]:
    """Weight-group names in /dev/shm (other tests' and processes' files come and go)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith(weight_shm.NAME_PREFIX)}


async def _spilled(s, e: EngineProcess, d: Path) -> dict[str, torch.Tensor]:
    """What engine `e` serves, bit for bit: release its weights (they are written to its
    spill file in `d`), read that file, wake it again."""
    status, _ = await post(s, e.url + "/release_memory_occupation", {"tags": None})
    assert status == 200
    (f,) = d.glob("engine-weights-*.safetensors")
    state = safetensors.torch.load_file(str(f))
    status, _ = await post(s, e.url + "/resume_memory_occupation", {"tags": None})
    assert status == 200
    return state


def _bitwise(weights: Weights, state: dict[str, torch.Tensor]) -> bool:
    want = weights.lm.model.state_dict()
    return bool(state) and all(torch.equal(want[k], v) for k, v in state.items())


async def test_a_same_node_push_serves_the_senders_bits_from_shared_memory(pair) -> None:
    """Two pushes: A serves each version from the segment set it was written into (the sets
    alternate, and A maps no segment of a group it left), B the broadcast; both serve the
    sender's exact bits, and generation uses them."""
    (a, b), dirs = pair
    shm_before = _shm_files()
    weights = Weights()
    async with _pushing([a.url, b.url], InProcessSender(weights)) as (t, s, _rc):
        sets = []
        for v in (1, 2):
            weights.set(v, 100 + v)
            assert (await t.push(v))["weights/push_failed_engines"] == 0.0
            for e in (a, b):
                served, answer = await _served(s, e.url)
                assert served == str(v) and _exact(weights, answer)
            sets.append({n.split("-")[-2] for n in _segments_mapped(a)})
            assert _segments_mapped(b) == set()
        assert sets == [{"s0"}, {"s0", "s1"}]  # A maps both sets of its group (cached)
        for e, d in zip((a, b), dirs, strict=True):
            assert _bitwise(weights, await _spilled(s, e, d))
        # the wake gave A its own memory: a push after it is served from a segment again
        weights.set(3, 103)
        assert (await t.push(3))["weights/push_failed_engines"] == 0.0
        served, answer = await _served(s, a.url)
        assert served == "3" and _exact(weights, answer)
    assert _segments_held_here() == []  # the sender gave every segment up with its group
    mapped = _segments_mapped(a)  # only what A serves: v3's set, one segment per bucket...
    assert len({n.split("-")[-2] for n in mapped}) == 1 and len(mapped) > 1
    assert _shm_files() == shm_before  # ...and nothing was ever named in /dev/shm


def _segment_rss(pid: int | str) -> dict[str, int]:
    """Resident bytes of each weight-group segment set process `pid` maps (`s0`, `s1`, ...),
    from /proc/<pid>/smaps."""
    out: dict[str, int] = {}
    current = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            name = line.split("/memfd:")[1].split(" ")[0] if "/memfd:" in line else ""
            current = name.split("-")[-2] if name.startswith(weight_shm.NAME_PREFIX) else None
        elif current is not None and line.startswith("Rss:"):
            out[current] = out.get(current, 0) + int(line.split()[1]) * 1024
    return out


async def _one_set_resident(pid: int | str, one: int, timeout_s: float = 10.0) -> dict[str, int]:
    """`_segment_rss(pid)` once less than 1.5 versions' bytes are resident (the release runs
    in a thread of the sender after the engines swapped), or after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while sum((got := _segment_rss(pid)).values()) >= 1.5 * one:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    return got


async def test_between_pushes_only_the_served_set_holds_memory(pair) -> None:
    """After each push the set the engine served before holds no memory: the engine has one
    version's bytes resident, not two. The sender maps both sets but has no page of either in
    its own memory (it drops a bucket's pages once written and sent; the engine's mapping
    keeps them). The released set is written again at the next push and served exactly."""
    (a, b), _ = pair
    weights = Weights()
    async with _pushing([a.url, b.url], InProcessSender(weights)) as (t, s, _rc):
        for v in (1, 2, 3):
            weights.set(v, 50 + v)
            assert (await t.push(v))["weights/push_failed_engines"] == 0.0
            served, answer = await _served(s, a.url)
            assert served == str(v) and _exact(weights, answer)
            one = t.push_bytes()
            rss = await _one_set_resident(a.proc.pid, one)  # engine A
            # the served set, whole (each segment rounded up to a page), nothing else
            assert one <= sum(rss.values()) < one + 64 * 4096, (v, rss, one)
            assert len([n for n in rss.values() if n]) == 1, (v, rss)
            assert len(rss) == min(v, 2), (v, rss)  # both sets mapped from v2 on
            sender = _segment_rss("self")
            assert len(sender) == min(v, 2) and sum(sender.values()) == 0, (v, sender)
            assert _segment_rss(b.proc.pid) == {}  # B: over the wire


async def test_an_engine_on_another_node_gets_the_broadcast(pair, caplog) -> None:
    """The sender's offer names another host: neither engine takes shared memory; both get the
    broadcast, serve the version exactly, and A stops mapping the segments it served before."""
    (a, b), _ = pair
    weights = Weights()
    sender = InProcessSender(weights, host_id="another-node/pidns:1")
    async with _pushing([a.url, b.url], sender) as (t, s, _rc):
        weights.set(20, 20)
        assert (await t.push(20))["weights/push_failed_engines"] == 0.0
        for e in (a, b):
            served, answer = await _served(s, e.url)
            assert served == "20" and _exact(weights, answer)
            assert _segments_mapped(e) == set()
    assert _segments_held_here() == []


class _CorruptingShmSender(InProcessSender):
    """Packs each bucket into its segment and computes the digests as rank 0 does, then
    changes one byte of bucket `bad` in the segment before publishing them: a write after the
    checksum. `times`: how many sends are corrupted."""

    def __init__(self, weights: Weights, *, times: int, bad: int = 1) -> None:
        super().__init__(weights)
        self.times, self.bad, self.sends = times, bad, 0

    async def send(self, buckets, *, flatten: bool) -> int:
        self.sends += 1
        if self.sends > self.times:
            return await super().send(buckets, flatten=flatten)
        version, tensors = self._weights()
        await asyncio.to_thread(self._send_corrupted, tensors, buckets)
        return version

    def _send_corrupted(self, tensors, buckets) -> None:
        g = self._group
        assert g is not None and g.same_node.pool is not None
        set_id = g.free_set()
        for j, b in enumerate(buckets):
            k, nbytes = g.buckets, sum(entry_nbytes(e) for e in b)
            seg = g.same_node.pool.segment(set_id, j, nbytes)
            flat = seg.buffer.view(torch_dtype(b[0].dtype))
            digests = copy_and_checksum(seg.buffer, bucket_pieces(tensors, b, flat))
            if j == self.bad:
                seg.buffer[nbytes // 2] ^= 1
            g.store.set(SHM_BUCKET_KEY.format(k), f"{set_id},{j},{seg.fd},{nbytes}")
            for c, d in enumerate(digests):
                g.store.set(CHUNK_KEY.format(k, c), f"{d:016x}")
            publish_checksum(g, digests)
            if g.pg is not None:
                g.broadcast(flat)
            g.buckets += 1
            g.mark_sent()


async def test_a_segment_changed_after_its_checksum_is_refused_and_old_weights_serve(
    pair, caplog
) -> None:
    """Every send of v31 has a byte flipped in the segment after its digests: A refuses it
    in shared memory, B over the wire (it got the segment's bytes); the push fails, both keep
    serving v30 exactly, A maps only v30's segments, and the sender holds none afterwards."""
    (a, b), _ = pair
    shm_before = _shm_files()
    good = Weights()
    good.set(30, 30)
    async with _pushing([a.url, b.url], InProcessSender(good)) as (t, s, _rc):
        assert (await t.push(30))["weights/push_failed_engines"] == 0.0
    serving = _segments_mapped(a)
    assert len({n.split("-")[-2] for n in serving}) == 1  # one set: v30's
    bad = Weights()
    bad.set(31, 31)
    sender = _CorruptingShmSender(bad, times=2)
    async with _pushing([a.url, b.url], sender) as (t, s, _rc):
        with caplog.at_level(logging.WARNING):
            m = await t.push(31)
        assert m["weights/push_failed_engines"] == 2.0 and sender.sends == 2
        assert "corrupted in shared memory" in caplog.text  # A
        assert "arrived corrupted" in caplog.text  # B
        for e in (a, b):
            served, answer = await _served(s, e.url)
            assert served == "30" and _exact(good, answer)
    assert _segments_mapped(a) == serving  # the refused version's segments are gone
    assert _segments_held_here() == [] and _shm_files() == shm_before


async def test_a_resend_after_a_corrupted_segment_serves_the_intact_version(pair) -> None:
    (a, b), _ = pair
    weights = Weights()
    weights.set(40, 40)
    sender = _CorruptingShmSender(weights, times=1, bad=0)
    async with _pushing([a.url, b.url], sender) as (t, s, _rc):
        assert (await t.push(40))["weights/push_failed_engines"] == 0.0
        assert sender.sends == 2 and t.groups_formed == 2  # refused, re-formed, sent again
        for e in (a, b):
            served, answer = await _served(s, e.url)
            assert served == "40" and _exact(weights, answer)


async def test_a_segment_name_from_a_client_is_refused(pair) -> None:
    """`shm_segment` is checked, never opened: a path, another group's segment, or a segment
    for an engine on the wire is refused before anything is read (`received: false`)."""
    (a, b), _ = pair
    weights = Weights()
    weights.set(1, 1)
    async with _pushing([a.url, b.url], InProcessSender(weights)) as (t, s, _rc):
        assert (await t.push(1))["weights/push_failed_engines"] == 0.0
        body = {
            "names": ["model.norm.weight"],
            "dtypes": ["float32"],
            "shapes": [list(weights.lm.model.state_dict()["model.norm.weight"].shape)],
            "group_name": CFG.group_name,
            "flush_cache": False,
        }
        path = "/update_weights_from_distributed"
        for name, url, why in (
            ("/etc/passwd", a.url, "not a weight-group segment name"),
            ("../slime-wg-0123456789abcdef-s0-b0", a.url, "not a weight-group segment name"),
            (7, a.url, "shm_segment must be a string"),
            ("slime-wg-0123456789abcdef-s0-b0", a.url, "not a segment of this weight group"),
            ("slime-wg-0123456789abcdef-s0-b0", b.url, "over the wire"),
        ):
            status, answer = await post(s, url + path, {**body, "shm_segment": name})
            assert status == 400 and answer["received"] is False, (name, answer)
            assert why in answer["message"], (name, answer)
        weights.set(2, 2)  # the group is still in step: the next push lands
        assert (await t.push(2))["weights/push_failed_engines"] == 0.0
        served, answer = await _served(s, a.url)
        assert served == "2" and _exact(weights, answer)


def test_digests_cross_tensor_and_chunk_boundaries_alike() -> None:
    """A bucket's digests are one per CHUNK_BYTES of its bytes, whether they are hashed flat,
    as its tensors one after another, or chunk by chunk while they are copied."""
    n = weight_shm.CHUNK_BYTES // 4
    a, b = torch.randn(n + 3), torch.randn(n // 2 + 5)
    flat = torch.cat([a, b])
    want = tensors_checksum([flat])
    assert len(want) == weight_shm.n_chunks(flat.numel() * 4) == 2
    assert tensors_checksum([a, b]) == want
    raw = torch.empty(flat.numel() * 4, dtype=torch.uint8)
    dst = raw.view(torch.float32)
    seen: list[tuple[int, int]] = []
    pieces = [(dst[: a.numel()], a), (dst[a.numel() :], b)]
    assert copy_and_checksum(raw, pieces, lambda c, d: seen.append((c, d))) == want
    assert seen == list(enumerate(want)) and torch.equal(dst, flat)
    c = flat.clone()
    c[-1] += 1
    assert tensors_checksum([c])[0] == want[0] and tensors_checksum([c])[1] != want[1]


def test_segment_names_are_checked_never_paths() -> None:
    assert weight_shm.parse_segment_name("slime-wg-0123456789abcdef-s1-b12") == (
        "0123456789abcdef",
        1,
        12,
    )
    for bad in ("/dev/shm/x", "slime-wg-0123-s0-b0", "slime-wg-0123456789abcdef-s0-b0/..", None):
        with pytest.raises(ValueError, match="not a weight-group segment name"):
            weight_shm.parse_segment_name(bad)


def _rank0_then_die(port: int, ready) -> None:
    """Rank 0 in a child process: send one version (two buckets), then hang until killed."""
    import threading

    from slime_async.contracts.weight_group import WeightGroup
    from slime_async.contracts.weight_transfer import send_buckets

    g = WeightGroup.open(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name="crash",
        backend="gloo",
        same_node=True,
    )
    send_buckets(g, _CRASH_TENSORS, _crash_buckets(), flatten=True)
    ready.set()
    threading.Event().wait(600)


_CRASH_TENSORS = {f"w{i}": torch.full((300_000,), float(i)) for i in range(4)}


def _crash_buckets():
    from slime_async.contracts.weight_buckets import plan_buckets
    from slime_async.contracts.weights import WeightManifest

    return plan_buckets(WeightManifest.of(_CRASH_TENSORS, version=0), 2_400_000)


def test_a_sender_killed_mid_group_leaves_no_segment_behind() -> None:
    """Rank 0 (a child process) sends a version through shared memory and is SIGKILLed while
    this member waits for the next bucket: the wait fails at once (the store died with rank
    0), and once the member let go of what it received no segment is mapped or named."""
    import multiprocessing as mp
    import time

    from slime_async.contracts.weight_group import WeightGroup
    from slime_async.contracts.weight_transfer import receive_checked
    from slime_async.host import free_port

    shm_before = _shm_files()
    ctx = mp.get_context("spawn")
    ready, port = ctx.Event(), free_port()
    child = ctx.Process(target=_rank0_then_die, args=(port, ready), daemon=True)
    child.start()
    g = WeightGroup.open(
        master_address="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        group_name="crash",
        backend="gloo",
        timeout_s=60.0,
        same_node=True,
    )
    try:
        got = [receive_checked(g, b, flatten=True, check_finite=True) for b in _crash_buckets()]
        assert [r.corrupted for r in got] == [None, None] and got[0].segment is not None
        assert float(got[1].tensors["w3"][0]) == 3.0
        assert ready.wait(30)
        child.kill()
        child.join(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):  # the store is gone: no waiting out the op timeout
            receive_checked(g, _crash_buckets()[0], flatten=True, check_finite=True)
        assert time.monotonic() - t0 < 10
    finally:
        g.close()
        child.kill()
    del got
    import gc

    gc.collect()
    assert not [ln for ln in Path("/proc/self/maps").read_text().splitlines() if "slime-wg-" in ln]
    assert _segments_held_here() == [] and _shm_files() == shm_before
