"""The distributed weight transport: trainer rank 0 broadcasts, the engines receive.

Owns `DistributedTransport`, one responsibility over 400 lines: a push over the weight group,
from forming the group to the last bucket, its aborts and its re-forming. It forms a weight update group of the sender (rank 0) and every
engine (`/init_weights_update_group`, rank `i + 1` for engine i), and pushes a version as
SGLang expects it: `/pause_generation {"mode": "in_place"}` through the router, then per bucket
one `/update_weights_from_distributed` call to every engine (`flush_cache: false`; the
`weight_version` rides on the last bucket, so an engine's label changes only once the whole
version arrived) while the sender broadcasts that bucket, then `/continue_generation`. Requests
in flight keep their KV cache and go on with the new weights, each token labelled with its
version. Nothing touches a filesystem. Floating-point tensors travel in `--update-weight-dtype`
(bf16 when the engines serve bf16: half the bytes), each bucket with a checksum the engine checks
before staging (`contracts.weight_transfer`): a corrupted bucket is refused like any other
refusal, so the whole version is sent again and the corrupted one is never served. Engines
on rank 0's node take the buckets through shared memory instead of the broadcast, each one
deciding when the group forms (`--update-weight-same-node`; `contracts.weight_group`, "Same
node"); nothing here changes with it.

Membership: the group holds the engines that answer `/health` at the push; it is re-formed
(destroyed everywhere, then initialised again on a fresh port) whenever that set changes or a
push failed. A push that fails part-way (an engine
died or refused) is sent again, whole, to the engines that still answer `/health`, before
generation continues; so an engine that failed never leaves the others with half a version.
Engines that could not take it are counted in `weights/push_failed_engines` and get the whole
version at the next push. Must never import Ray or the trainer.

A member that stops receiving must not hold rank 0 for the op timeout (`_watch_bucket`): when
its bucket call gets no answer (connection refused or reset, timeout), when it refuses and rank
0 has not finished the bucket `REFUSAL_GRACE_S` later (it refused before receiving), or when it
has not answered long after another member took the bucket, the driver aborts the group through
the group's store (`GroupControl`): every member's broadcast stops at once, and the resend goes
to the healthy engines without the ones that stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from router.client import RouterClient
from slime_async.contracts.weight_buckets import bucket_body, entry_nbytes, in_dtype, plan_buckets
from slime_async.contracts.weight_group import GroupControl
from slime_async.contracts.weights import Payload, WeightManifest
from slime_async.host import port_taken
from slime_async.weights.config import WeightSyncConfig
from slime_async.weights.pause import paused_in_place
from slime_async.weights.sender import WeightSender
from slime_async.weights.setup import TransportSetup

log = logging.getLogger(__name__)

REFUSAL_GRACE_S = 10.0
"""After a member refused a bucket, how long rank 0 may take to finish that bucket before the
driver concludes the member refused without receiving it and aborts the group."""
STALL_MIN_S = 30.0
"""A member still silent this long (at least; see `_stall_after`) after another member took
the bucket is taken as stuck (hung, stopped) and the group is aborted."""
HEALTH_TIMEOUT_S = 30.0
"""Bound of `/health` (SGLang's own health check gives up after 20 s) and of
`/destroy_weights_update_group` to a member the group was aborted for: a hung engine must not
hold the push for the session's timeout."""
STORE_TIMEOUT_S = 10.0
"""Bound of connecting the driver's client to a new group's store (rank 0 hosts it)."""
FORM_ATTEMPTS = 3
"""Groups formed before giving up when another process takes rank 0's port first."""
BIND_GRACE_S = 1.0
"""How long `_form` waits for rank 0's bind to fail before sending the engines to its port."""
POLL_S = 0.2
"""How often `_watch_bucket` re-checks its deadlines while bucket calls are out."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    """One engine's answer to a call: `answered` is False when no HTTP answer came (connection
    refused or reset, timeout): the engine may not be there at all."""

    ok: bool
    why: str = ""
    answered: bool = True
    received: bool | None = None
    """A refused bucket call's `received` field: False when the engine refused without
    receiving the bucket (it is out of step with the group), True when it received and then
    refused; None when the engine does not say (SGLang)."""
    group_broken: bool = False
    """The engine's receive started and failed because the group broke under it (another
    member or rank 0 failed): a consequence of someone else's failure, never a culprit."""


class WeightSyncError(RuntimeError):
    """A weight update group could not be formed or a version reached no engine."""


def _stall_after(first_s: float, members: int) -> float:
    """Silence allowed after the first member took a bucket in `first_s`: rank 0 may serve the
    members one after another, so the last may need `members` times as long."""
    return max(STALL_MIN_S, members * first_s)


def _grace(elapsed_s: float, members: int) -> float:
    """How long after a refusal (`elapsed_s` into the bucket) rank 0 may still need to finish
    the bucket for the other members (served one after another, at worst)."""
    return max(REFUSAL_GRACE_S, members * elapsed_s)


class _BucketWatch:
    """The bucket calls of one bucket, and which members look like they stopped taking part.

    A member is a suspect from its failure on: at once when its call got no answer or it
    refused saying it did not receive the bucket (`received: false`, the embedded engine), after
    `_grace` when it refused without saying (it may have received the bucket first, and rank 0
    may still be sending to the others), and at once when it is still silent `_stall_after` the
    first member took the bucket. A refusal saying `received: true` leaves the group in step. A
    suspect is due once that time passed; the driver then aborts the group unless rank 0
    finished the bucket and every due member may have received it (the due members are the
    culprits)."""

    def __init__(self, i: int, calls: dict[asyncio.Future, str], failed: dict[str, str]) -> None:
        self.i, self.calls, self.failed = i, calls, failed
        self.pending = set(calls)
        self.suspects: dict[str, float] = {}
        """member -> when it is due."""
        self.out_of_step: set[str] = set()
        """Suspects that did not receive the bucket (said so, or silent long after another
        member took it): aborted for even when rank 0 finished the bucket (it fit in their
        socket buffers, and they would read it as the next one)."""
        self.culprits: set[str] = set()
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.first_ok: float | None = None
        self.aborted_at: float | None = None

    async def collect(self) -> None:
        """Wait up to `POLL_S` for answers; note successes and failures."""
        done, self.pending = await asyncio.wait(
            self.pending, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED
        )
        now = self.loop.time()
        for f in done:
            u, r = self.calls[f], f.result()
            if r.ok:
                self.first_ok = now if self.first_ok is None else self.first_ok
                self.suspects.pop(u, None)
                continue
            self.failed.setdefault(u, r.why)
            if r.group_broken:  # it was receiving when the group broke: not the cause
                continue
            if self.aborted_at is None and r.received is not True:
                if r.received is False:
                    self.out_of_step.add(u)
                wait = _grace(now - self.t0, len(self.calls)) if r.received is None else 0.0
                self.suspects.setdefault(u, now + (wait if r.answered else 0.0))

    def due(self) -> set[str]:
        """Suspects whose time came, the silent ones included once they stalled."""
        now = self.loop.time()
        if self.first_ok is not None and now >= self.first_ok + _stall_after(
            self.first_ok - self.t0, len(self.calls)
        ):
            for f in self.pending:
                self.out_of_step.add(self.calls[f])
                self.suspects.setdefault(self.calls[f], now)
        return {u for u, t in self.suspects.items() if now >= t}

    def aborted(self, culprits: set[str]) -> None:
        self.aborted_at, self.culprits = self.loop.time(), culprits
        for u in culprits:
            self.failed.setdefault(
                u,
                f"no answer to bucket {self.i} long after another engine took it (hung or stopped)",
            )

    def give_up_on_hung(self) -> None:
        """After an abort every receiving member answers at once; stop waiting for the rest
        after `REFUSAL_GRACE_S` (they are hung)."""
        assert self.aborted_at is not None
        if self.pending and self.loop.time() - self.aborted_at > REFUSAL_GRACE_S:
            for f in self.pending:
                f.cancel()
                self.failed.setdefault(self.calls[f], "no answer after the group was aborted")
            self.pending = set()


class DistributedTransport:
    """Broadcast versions from `sender` to the engines at `engine_urls()` (read at every push:
    the supervisor may have replaced some)."""

    payload: ClassVar[Payload] = Payload.FULL
    shared_filesystem: ClassVar[bool] = False
    writes_directories: ClassVar[bool] = False
    on_written: Callable[[int, Path], object] | None = None
    """Nothing is written, so nothing is handed over (the run feeds the role itself)."""

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> DistributedTransport:
        """The trainer group is the sender (rank 0 broadcasts)."""
        return cls(**cls._setup_kwargs(setup, setup.trainer))

    @staticmethod
    def _setup_kwargs(setup: TransportSetup, sender: WeightSender) -> dict[str, Any]:
        return {
            "sender": sender,
            "control": setup.control,
            "engine_urls": setup.engine_urls,
            "cfg": setup.cfg,
            "backend": setup.collective_backend,
            "token": setup.token,
        }

    def __init__(
        self,
        *,
        sender: WeightSender,
        control: RouterClient,
        engine_urls: Callable[[], Sequence[str]],
        cfg: WeightSyncConfig,
        backend: str = "gloo",
        token: str | None = None,
    ) -> None:
        self.sender, self.control, self.engine_urls, self.cfg = sender, control, engine_urls, cfg
        self._headers = {"Authorization": f"Bearer {token}"} if token else None
        """The run's admin key: the weight-group routes are the engines' admin routes."""
        self.backend = cfg.backend or backend
        self.members: tuple[str, ...] = ()
        """Engines in the current group (rank i + 1 is members[i]); empty: no group."""
        self.groups_formed = 0
        self._control: GroupControl | None = None
        """The driver's client on the current group's store (abort, rank 0's progress)."""
        self._group_ok = True
        """False once the current group was aborted: re-formed before it is used again."""
        self._manifest: WeightManifest | None = None
        """Names, dtypes and shapes of what the sender sends (fixed for a run: asked once)."""
        self._lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ HTTP to one engine
    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s + 30.0, sock_connect=10.0)
            self._http = aiohttp.ClientSession(timeout=timeout, headers=self._headers)
        return self._http

    async def _call(
        self, url: str, path: str, body: dict[str, Any], timeout_s: float | None = None
    ) -> _Reply:
        """POST `path` to one engine (`timeout_s`: a total bound shorter than the session's)."""
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session().post(url + path, json=body, timeout=timeout) as r:
                data = await r.json(content_type=None)
                ok = r.status == 200 and not (
                    isinstance(data, dict) and data.get("success") is False
                )
                msg = data.get("message", "") if isinstance(data, dict) else str(data)
                got = data.get("received") if isinstance(data, dict) else None
                received = got if isinstance(got, bool) else None
                broken = isinstance(data, dict) and data.get("group_broken") is True
                return _Reply(
                    ok,
                    "" if ok else f"HTTP {r.status}: {msg}",
                    received=received,
                    group_broken=broken,
                )
        except ValueError as e:  # an answer that is not JSON
            return _Reply(False, f"{type(e).__name__}: {e}")
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ConnectionError) as e:
            return _Reply(False, f"{type(e).__name__}: {e}", answered=False)

    async def _healthy(self, url: str) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            async with self._session().get(url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ConnectionError):
            return False

    # ------------------------------------------------------------------ group membership
    async def _teardown(self, stopped: Collection[str] = ()) -> None:
        """Destroy the group on every member (`stopped` ones, which may hang, get
        `HEALTH_TIMEOUT_S` to answer) and on the sender."""
        members, self.members, self._control = self.members, (), None
        body = {"group_name": self.cfg.group_name}
        await asyncio.gather(
            *(
                self._call(
                    u,
                    "/destroy_weights_update_group",
                    body,
                    timeout_s=HEALTH_TIMEOUT_S if u in stopped else None,
                )
                for u in members
            )
        )
        if self.sender is not None:  # none without a trainer (--debug-rollout-only)
            await self.sender.close_group()

    async def _form(self, urls: Sequence[str], stopped: Collection[str] = ()) -> None:
        """A new group of the sender and `urls` (any old one is destroyed first; see
        `_teardown` for `stopped`). A port of the sender's choosing that another process on its
        node took before rank 0 bound it (EADDRINUSE) is chosen again, up to `FORM_ATTEMPTS`
        times; a port the user gave (`--update-weight-master-port`) is never changed."""
        await self._teardown(stopped)
        for attempt in range(1, FORM_ATTEMPTS + 1):
            addr, port, failed, taken = await self._try_form(urls)
            if not failed:
                break
            self.members = tuple(urls)
            await self._teardown()
            if not taken or self.cfg.master_port or attempt == FORM_ATTEMPTS:
                raise WeightSyncError(
                    f"could not form the weight update group at {addr}:{port} "
                    f"(world size {len(urls) + 1}): {'; '.join(failed)}. Check that every "
                    "engine can reach that address (--update-weight-master-address) and port."
                )
            log.warning(
                "weight group port %d was taken by another process before rank 0 bound it; "
                "forming the group again on another port (attempt %d of %d)",
                port,
                attempt + 1,
                FORM_ATTEMPTS,
            )
        self.members, self._group_ok = tuple(urls), True
        self.groups_formed += 1
        self._control = await self._connect_control(addr, port)

    async def _try_form(self, urls: Sequence[str]) -> tuple[str, int, list[str], bool]:
        """One attempt: (address, port, what failed, whether rank 0's port was taken)."""
        addr, port = await self.sender.endpoint()
        addr = self.cfg.master_address or addr
        port = self.cfg.master_port or port
        world = len(urls) + 1
        opened = asyncio.ensure_future(
            self.sender.open_group(
                master_address=addr,
                master_port=port,
                world_size=world,
                group_name=self.cfg.group_name,
                backend=self.backend,
                timeout_s=self.cfg.timeout_s,
                same_node=self.cfg.same_node,
            )
        )
        # rank 0 binds its port at once: a port taken meanwhile fails here, before any engine
        # is sent to it (an engine would wait out its rendezvous timeout on a foreign listener)
        await asyncio.wait({opened}, timeout=BIND_GRACE_S)
        if opened.done() and (e := opened.exception()) is not None and port_taken(str(e)):
            return addr, port, [f"sender: {type(e).__name__}: {e}"], True
        joins = await asyncio.gather(
            *(
                self._call(
                    u,
                    "/init_weights_update_group",
                    {
                        "master_address": addr,
                        "master_port": port,
                        "rank_offset": i + 1,
                        "world_size": world,
                        "group_name": self.cfg.group_name,
                        "backend": self.backend,
                    },
                )
                for i, u in enumerate(urls)
            )
        )
        failed = [f"{u}: {r.why}" for u, r in zip(urls, joins) if not r.ok]
        taken = False
        try:
            await opened
        except Exception as e:
            failed.append(f"sender: {type(e).__name__}: {e}")
            taken = port_taken(str(e))
        return addr, port, failed, taken

    async def _connect_control(self, addr: str, port: int) -> GroupControl | None:
        """The driver's client on the new group's store; None (with a warning) if rank 0's
        store cannot be reached from here: pushes then cannot be aborted early."""
        try:
            return await asyncio.to_thread(
                GroupControl.connect,
                master_address=addr,
                master_port=port,
                group_name=self.cfg.group_name,
                timeout_s=STORE_TIMEOUT_S,
            )
        except (RuntimeError, OSError) as e:
            log.warning(
                "cannot reach the weight group's store at %s:%d (%s): a member that "
                "stops receiving holds a push for --update-weight-timeout",
                addr,
                port,
                e,
            )
            return None

    # ------------------------------------------------------------------ sending
    async def _send(self, version: int) -> tuple[dict[str, str], set[str]]:
        """Send the sender's current weights as `version` to `members`. Returns the engines
        that did not take every bucket, with why (empty: all did), and those among them that
        stopped taking part (the group was aborted for them: leave them out of a resend)."""
        buckets = plan_buckets(await self._wire_manifest(), self.cfg.bucket_bytes)
        flatten = self.cfg.flatten_buckets
        base = await self._sent()
        sending = asyncio.ensure_future(self.sender.send(buckets, flatten=flatten))
        failed: dict[str, str] = {}
        stopped: set[str] = set()
        for i, b in enumerate(buckets):
            body: dict[str, Any] = {
                **bucket_body(b, group_name=self.cfg.group_name, flatten=flatten),
                "flush_cache": False,
                **self._bucket_fields(),
            }
            if i == len(buckets) - 1:
                body["weight_version"] = str(version)
            # every member gets every bucket, even one that refused an earlier one after
            # receiving it; one that stopped receiving aborts the group (`_watch_bucket`)
            target = None if base is None else base + i + 1
            stopped = await self._watch_bucket(i, body, sending, target, failed)
            if stopped:
                break
        try:
            sent = await sending
        except Exception as e:  # the group was aborted: every member not done failed
            for u in self.members:
                failed.setdefault(u, f"sender failed: {type(e).__name__}: {e}")
            return failed, stopped
        if sent != version:
            raise WeightSyncError(f"the sender holds version {sent}, not {version}")
        return failed, stopped

    async def _wire_manifest(self) -> WeightManifest:
        """What travels: the sender's manifest (asked once) in `--update-weight-dtype`."""
        if self._manifest is None:
            self._manifest = in_dtype(await self.sender.manifest(), self.cfg.dtype)
        return self._manifest

    def _bucket_fields(self) -> dict[str, Any]:
        """Extra fields of every bucket call (the adapter transport names its adapter)."""
        return {}

    async def _activate(self, version: int, failed: int, *, strict: bool) -> int:
        """After the buckets of `version` went out (inside the pause): what else makes the
        engines serve it; returns how many engines are without it. Full weights: nothing (the
        last bucket swaps them in)."""
        return failed

    async def _sent(self) -> int | None:
        """Buckets rank 0 finished in this group so far (None: not known here)."""
        if self._control is None:
            return None
        try:
            return await asyncio.to_thread(self._control.sent)
        except (RuntimeError, OSError):
            return None

    async def _bucket_done(self, sending: asyncio.Future, target: int | None) -> bool:
        """Rank 0 is past this bucket: it finished it (the `sent` count reached `target`) or
        it is no longer sending at all (done, or failed and aborted the group itself)."""
        if sending.done():
            return True
        sent = await self._sent()
        return sent is not None and target is not None and sent >= target

    async def _abort(self, why: str) -> bool:
        """Abort the current group: every member's broadcast stops; the group is re-formed
        before it is used again in any case. False when its store could not be reached."""
        ctl, self._control, self._group_ok = self._control, None, False
        if ctl is None:
            return False
        try:
            await asyncio.to_thread(ctl.abort, why)
        except (RuntimeError, OSError) as e:
            log.warning("could not abort the weight group: %s", e)
            return False
        log.warning("weight group aborted: %s", why)
        return True

    async def _watch_bucket(
        self,
        i: int,
        body: dict[str, Any],
        sending: asyncio.Future,
        target: int | None,
        failed: dict[str, str],
    ) -> set[str]:
        """Post bucket `i` to every member while rank 0 broadcasts it; record failures in
        `failed`. Aborts the group when a member cannot be taking part (`_BucketWatch`) and
        returns those members (empty: no abort)."""
        path = "/update_weights_from_distributed"
        calls = {asyncio.ensure_future(self._call(u, path, body)): u for u in self.members}
        watch = _BucketWatch(i, calls, failed)
        while watch.pending:
            await watch.collect()
            if watch.aborted_at is not None:
                watch.give_up_on_hung()
                continue
            due = watch.due()
            if not due:
                continue
            if not watch.out_of_step & due and await self._bucket_done(sending, target):
                watch.suspects.clear()  # they received it and refused: the group is in step
            elif (
                await self._abort(
                    f"bucket {i}: "
                    + "; ".join(f"{u} ({failed.get(u, 'silent')})" for u in sorted(due))
                )
                or sending.done()
                or watch.out_of_step & due
            ):
                # (rank 0 no longer sending: it aborted the group itself; out of step: the
                # group is lost for them whether or not its store still answers)
                watch.aborted(due)
            else:
                watch.suspects.clear()  # cannot abort: the op timeout bounds the wait
        return watch.culprits

    async def _healthy_of(self, urls: Sequence[str]) -> list[str]:
        oks = await asyncio.gather(*map(self._healthy, urls))
        return [u for u, ok in zip(urls, oks) if ok]

    async def _push_locked(self, version: int) -> int:
        """Send to the engines that answer `/health` (a dead member would stall the group's
        rendezvous), re-forming the group when that set changed; on failure re-form with the
        engines still healthy and send again. Returns how many engines are without `version`."""
        urls = list(self.engine_urls())
        healthy = await self._healthy_of(urls)
        if not healthy:
            await self._teardown()
            return len(urls)
        if tuple(healthy) != self.members or not self._group_ok:
            await self._form(healthy)
        failed, stopped = await self._send(version)
        if not failed:
            return len(urls) - len(healthy)
        log.warning(
            "weight push v%d failed on %d engine(s): %s",
            version,
            len(failed),
            "; ".join(f"{u} ({why})" for u, why in failed.items()),
        )
        healthy = [u for u in await self._healthy_of(urls) if u not in stopped]
        if not healthy:
            await self._teardown(stopped)
            return len(urls)
        await self._form(healthy, stopped)
        again, _ = await self._send(version)
        if again:
            log.warning(
                "weight push v%d failed again on %s; they get the whole version at the next push",
                version,
                ", ".join(again),
            )
            await self._teardown()  # re-formed at the next push
        return len(urls) - len(healthy) + len(again)

    async def push(self, version: int) -> dict[str, float]:
        """Pause in place, send `version` to every engine, continue; returns timings."""
        async with self._lock:
            t0 = time.perf_counter()
            async with paused_in_place(self.control, version):
                t1 = time.perf_counter()
                try:
                    failed = await asyncio.wait_for(
                        self._push_locked(version), self.cfg.timeout_s * 3
                    )
                except WeightSyncError as e:
                    log.warning("weight push v%d: %s", version, e)
                    failed = len(self.engine_urls())
                failed = await self._activate(version, failed, strict=False)
            t2 = time.perf_counter()
        return {
            "timing/weight_pause_s": t1 - t0,
            "timing/weight_load_s": t2 - t1,
            "weights/push_failed_engines": float(failed),
            "weights/groups_formed": float(self.groups_formed),
            "weights/push_bytes": float(self.push_bytes()),
        }

    def push_bytes(self) -> int:
        """Bytes one version broadcasts (tensor bytes only; 0 before the first push)."""
        m = self._manifest
        return 0 if m is None else sum(entry_nbytes(e) for e in m.entries)

    def directory(self, version: int) -> Path:
        raise ValueError(f"the distributed transport writes no directory (asked for v{version})")

    async def load(self, version: int) -> None:
        """Every engine must take `version` (start-up of attached engines): raises otherwise."""
        async with self._lock:
            urls = list(self.engine_urls())
            await self._form(urls)
            failed, _ = await self._send(version)
        if failed:
            raise WeightSyncError(
                f"engines did not take version {version}: "
                + "; ".join(f"{u} ({why})" for u, why in failed.items())
            )
        await self._activate(version, 0, strict=True)

    async def release_group(self) -> None:
        """Destroy the group everywhere (the trainer goes to sleep, or the engines that serve
        change); the next push forms it again with the engines that serve then."""
        async with self._lock:
            await self._teardown()

    async def close(self) -> None:
        """Destroy the group everywhere and close the HTTP session (closed even when the
        teardown fails: a trainer rank lost with its node)."""
        try:
            async with self._lock:
                await self._teardown()
        finally:
            if self._http is not None:
                await self._http.close()
                self._http = None
