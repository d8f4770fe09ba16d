"""The distributed weight transport: trainer rank 0 broadcasts, the engines receive.

Owns `DistributedTransport`. It forms a weight update group of the sender (rank 0) and every
engine (`/init_weights_update_group`, rank `i + 1` for engine i), and pushes a version as
SGLang expects it: `/pause_generation {"mode": "in_place"}` through the router, then per bucket
one `/update_weights_from_distributed` call to every engine (`flush_cache: false`; the
`weight_version` rides on the last bucket, so an engine's label changes only once the whole
version arrived) while the sender broadcasts that bucket, then `/continue_generation`. Requests
in flight keep their KV cache and go on with the new weights, each token labelled with its
version. Nothing touches a filesystem.

Membership: the group holds the engines that answer `/health` at the push; it is re-formed
(destroyed everywhere, then initialised again on a fresh port) whenever that set changes or a
push failed. A push that fails part-way (an engine
died or refused) is sent again, whole, to the engines that still answer `/health`, before
generation continues; so an engine that failed never leaves the others with half a version.
Engines that could not take it are counted in `weights/push_failed_engines` and get the whole
version at the next push. Must never import Ray or the trainer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from router.client import RouterClient
from slime_async.contracts.weight_group import bucket_body, plan_buckets
from slime_async.contracts.weights import WeightManifest
from slime_async.weights.config import WeightSyncConfig
from slime_async.weights.pause import paused_in_place
from slime_async.weights.sender import WeightSender

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A weight update group could not be formed or a version reached no engine."""


class DistributedTransport:
    """Broadcast versions from `sender` to the engines at `engine_urls()` (read at every push:
    the supervisor may have replaced some)."""

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
        """The run's shared token: engines off loopback require it on every route."""
        self.backend = cfg.backend or backend
        self.members: tuple[str, ...] = ()
        """Engines in the current group (rank i + 1 is members[i]); empty: no group."""
        self.groups_formed = 0
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

    async def _call(self, url: str, path: str, body: dict[str, Any]) -> tuple[bool, str]:
        """POST `path` to one engine: (succeeded, why not)."""
        try:
            async with self._session().post(url + path, json=body) as r:
                data = await r.json(content_type=None)
                ok = r.status == 200 and not (
                    isinstance(data, dict) and data.get("success") is False
                )
                msg = data.get("message", "") if isinstance(data, dict) else str(data)
                return ok, "" if ok else f"HTTP {r.status}: {msg}"
        except (aiohttp.ClientError, TimeoutError, ConnectionError, ValueError) as e:
            return False, f"{type(e).__name__}: {e}"

    async def _healthy(self, url: str) -> bool:
        try:
            async with self._session().get(url + "/health") as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return False

    # ------------------------------------------------------------------ group membership
    async def _teardown(self) -> None:
        members, self.members = self.members, ()
        body = {"group_name": self.cfg.group_name}
        await asyncio.gather(
            *(self._call(u, "/destroy_weights_update_group", body) for u in members)
        )
        await self.sender.close_group()

    async def _form(self, urls: Sequence[str]) -> None:
        """A new group of the sender and `urls` (any old one is destroyed first)."""
        await self._teardown()
        addr, port = await self.sender.endpoint()
        addr = self.cfg.master_address or addr
        port = self.cfg.master_port or port
        world = len(urls) + 1
        opened = asyncio.ensure_future(
            self.sender.open_group(master_address=addr, master_port=port, world_size=world,
                                   group_name=self.cfg.group_name, backend=self.backend,
                                   timeout_s=self.cfg.timeout_s)
        )  # fmt: skip
        joins = await asyncio.gather(*(
            self._call(u, "/init_weights_update_group", {
                "master_address": addr, "master_port": port, "rank_offset": i + 1,
                "world_size": world, "group_name": self.cfg.group_name, "backend": self.backend,
            })
            for i, u in enumerate(urls)
        ))  # fmt: skip
        try:
            await opened
        except Exception as e:
            joins.append((False, f"sender: {type(e).__name__}: {e}"))
        failed = [f"{u}: {why}" for u, (ok, why) in zip(urls, joins) if not ok]
        if failed or not all(ok for ok, _ in joins):
            self.members = tuple(urls)
            await self._teardown()
            raise WeightSyncError(
                f"could not form the weight update group at {addr}:{port} "
                f"(world size {world}): {'; '.join(failed) or joins[-1][1]}. Check that every "
                "engine can reach that address (--update-weight-master-address) and port."
            )
        self.members = tuple(urls)
        self.groups_formed += 1

    # ------------------------------------------------------------------ sending
    async def _send(self, version: int) -> dict[str, str]:
        """Send the sender's current weights as `version` to `members`; returns the engines
        that did not take every bucket, with why (empty: all did)."""
        if self._manifest is None:
            self._manifest = await self.sender.manifest()
        buckets = plan_buckets(self._manifest, self.cfg.bucket_bytes)
        flatten = self.cfg.flatten_buckets
        sending = asyncio.ensure_future(self.sender.send(buckets, flatten=flatten))
        failed: dict[str, str] = {}
        for i, b in enumerate(buckets):
            body: dict[str, Any] = {
                **bucket_body(b, group_name=self.cfg.group_name, flatten=flatten),
                "flush_cache": False,
            }
            if i == len(buckets) - 1:
                body["weight_version"] = str(version)
            # every member gets every bucket, even one that refused an earlier one: it still
            # receives (a member that skipped a broadcast would stall the sender)
            outs = await asyncio.gather(
                *(self._call(u, "/update_weights_from_distributed", body) for u in self.members)
            )
            for u, (ok, why) in zip(self.members, outs):
                if not ok:
                    failed.setdefault(u, why)
        try:
            sent = await sending
        except Exception as e:  # the sender closed the group: every member not done failed
            for u in self.members:
                failed.setdefault(u, f"sender failed: {type(e).__name__}: {e}")
            return failed
        if sent != version:
            raise WeightSyncError(f"the sender holds version {sent}, not {version}")
        return failed

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
        if tuple(healthy) != self.members:
            await self._form(healthy)
        failed = await self._send(version)
        if not failed:
            return len(urls) - len(healthy)
        log.warning("weight push v%d failed on %d engine(s): %s", version, len(failed),
                    "; ".join(f"{u} ({why})" for u, why in failed.items()))  # fmt: skip
        healthy = await self._healthy_of(urls)
        if not healthy:
            await self._teardown()
            return len(urls)
        await self._form(healthy)
        again = await self._send(version)
        if again:
            log.warning("weight push v%d failed again on %s; they get the whole version at the "
                        "next push", version, ", ".join(again))  # fmt: skip
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
            t2 = time.perf_counter()
        return {
            "timing/weight_pause_s": t1 - t0,
            "timing/weight_load_s": t2 - t1,
            "weights/push_failed_engines": float(failed),
            "weights/groups_formed": float(self.groups_formed),
        }

    async def load(self, version: int) -> None:
        """Every engine must take `version` (start-up of attached engines): raises otherwise."""
        async with self._lock:
            urls = list(self.engine_urls())
            await self._form(urls)
            failed = await self._send(version)
        if failed:
            raise WeightSyncError(
                f"engines did not take version {version}: "
                + "; ".join(f"{u} ({why})" for u, why in failed.items())
            )

    async def close(self) -> None:
        """Destroy the group everywhere and close the HTTP session."""
        async with self._lock:
            await self._teardown()
        if self._http is not None:
            await self._http.close()
            self._http = None
