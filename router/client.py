"""Async client helper for the orchestrator: worker registry and control fan-out calls.

Owns: `RouterClient`, `FanoutError`. Must never import: `slime_async`, or router internals
beyond nothing at all (it only speaks HTTP to a running router).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp


class FanoutError(RuntimeError):
    """A control call failed on at least one engine; `.reply` holds the fan-out reply."""

    def __init__(self, path: str, reply: dict) -> None:
        failed = ", ".join(f"{f['url']} ({f['error']})" for f in reply.get("failed", []))
        if not reply.get("total", 0):
            msg = f"{path}: no engine is registered with the router (none to call)"
        else:
            msg = (
                f"{path}: {reply.get('succeeded', 0)}/{reply['total']} engines succeeded; "
                f"failed: {failed or 'none'}"
            )
        super().__init__(msg)
        self.reply = reply


class RouterClient:
    """Talks to a router's management/control API.

    Example:
        >>> async with RouterClient(url, token=None) as rc:          # doctest: +SKIP
        ...     wid = await rc.add_worker("http://127.0.0.1:30001")
        ...     async with rc.paused():
        ...         await rc.update_weights_from_disk("/ckpt/v3", weight_version=3)
    """

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RouterClient:
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self._session

    async def _json(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        async with self._s().request(method, self.url + path, json=body) as r:
            return r.status, await r.json(content_type=None)

    # --- registry ---------------------------------------------------------------------------
    async def add_worker(self, url: str, *, wait_healthy_s: float = 0.0) -> str:
        """Register an engine; optionally wait until it is admitted. Returns the worker id."""
        status, body = await self._json("POST", "/workers", {"url": url})
        if status != 202:
            raise RuntimeError(f"POST /workers {url} -> HTTP {status}: {body}")
        wid = body["worker_id"]
        if wait_healthy_s > 0:
            deadline = asyncio.get_running_loop().time() + wait_healthy_s
            while True:
                w = next((x for x in await self.list_workers() if x["id"] == wid), None)
                if w is not None and w["is_healthy"]:
                    break
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"worker {url} not healthy within {wait_healthy_s}s: {w}")
                await asyncio.sleep(0.05)
        return wid

    async def list_workers(self) -> list[dict]:
        """`GET /workers` entries."""
        status, body = await self._json("GET", "/workers")
        if status != 200:
            raise RuntimeError(f"GET /workers -> HTTP {status}: {body}")
        return body["workers"]

    async def remove_worker(self, worker_id_or_url: str) -> None:
        """Unregister by id, or by url (looked up as slime does)."""
        wid = worker_id_or_url
        if "://" in wid:
            match = [w["id"] for w in await self.list_workers() if w["url"] == wid.rstrip("/")]
            if not match:
                raise KeyError(f"no worker registered with url {wid}")
            wid = match[0]
        status, body = await self._json("DELETE", f"/workers/{wid}")
        if status != 200:
            raise RuntimeError(f"DELETE /workers/{wid} -> HTTP {status}: {body}")

    async def metrics(self) -> dict:
        """The `/metrics` JSON document."""
        return (await self._json("GET", "/metrics"))[1]

    # --- control fan-out --------------------------------------------------------------------
    async def fan_out(self, path: str, body: dict | None = None, *, strict: bool = False) -> dict:
        """POST a control call to every engine and return the fan-out reply.

        Raises `FanoutError` when no engine succeeded, or when an engine failed and is still in
        rotation (it would serve in an inconsistent state). An engine that failed and was
        quarantined is out of rotation and is brought up to date before re-admission, so it
        does not raise unless `strict=True` (then any failure raises).
        """
        status, reply = await self._json("POST", path, body if body is not None else {})
        if "results" not in reply:
            raise RuntimeError(f"{path} -> HTTP {status}: {reply}")
        failed = reply.get("failed", [])
        in_rotation = [f for f in failed if not f.get("quarantined")]
        if reply.get("succeeded", 0) == 0 or in_rotation or (strict and failed):
            raise FanoutError(path, reply)
        return reply

    async def pause_generation(self, *, mode: str = "abort") -> dict:
        """Fan out `/pause_generation`."""
        return await self.fan_out("/pause_generation", {"mode": mode})

    async def release_memory_occupation(
        self,
        tags: list[str] | None = None,
        *,
        worker_urls: list[str] | None = None,
        drain_s: float = 0.0,
    ) -> dict:
        """Put engines to sleep (abort, drain, release; router/sleep.py): `worker_urls`, or every
        serving engine; `drain_s`: first let their running requests finish for up to that long.
        Raises `FanoutError` when one failed."""
        body: dict = {"tags": tags}
        if drain_s:
            body["drain_s"] = drain_s
        if worker_urls is not None:
            body["worker_urls"] = worker_urls
        return await self.fan_out("/release_memory_occupation", body, strict=True)

    async def resume_memory_occupation(
        self, tags: list[str] | None = None, *, worker_urls: list[str] | None = None
    ) -> dict:
        """Wake engines (`worker_urls`, or every sleeping one), caught up on missed weights."""
        body: dict = {"tags": tags}
        if worker_urls is not None:
            body["worker_urls"] = worker_urls
        return await self.fan_out("/resume_memory_occupation", body, strict=True)

    async def continue_generation(self) -> dict:
        """Fan out `/continue_generation`."""
        return await self.fan_out("/continue_generation", {})

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: int,
        strict: bool = False,
        flush_cache: bool | None = None,
    ) -> dict:
        """Fan out `/update_weights_from_disk` tagging the engines with `str(weight_version)`
        (`strict`: any engine that failed raises, see `fan_out`; `flush_cache`: SGLang's field,
        left out when None so the engine's default (true) applies)."""
        body: dict = {"model_path": model_path, "weight_version": str(weight_version)}
        if flush_cache is not None:
            body["flush_cache"] = flush_cache
        return await self.fan_out("/update_weights_from_disk", body, strict=strict)

    async def load_lora_adapter(
        self, name: str, path: str | None, *, weight_version: int, strict: bool = False
    ) -> dict:
        """Fan out `/load_lora_adapter`: serve the PEFT directory `path` as adapter `name`,
        replacing a loaded one of that name, tagged `str(weight_version)` (an adapter push).
        `path` None: activate the adapter of that version each engine received over its weight
        update group (`from_distributed`, the distributed adapter push)."""
        body: dict = {"lora_name": name, "weight_version": str(weight_version)}
        if path is None:
            body["from_distributed"] = True
        else:
            body["lora_path"] = path
        return await self.fan_out("/load_lora_adapter", body, strict=strict)

    async def update_weight_version(self, weight_version: int) -> dict:
        """Fan out `/update_weight_version` (without aborting requests)."""
        body = {"new_version": str(weight_version), "abort_all_requests": False}
        return await self.fan_out("/update_weight_version", body)

    async def flush_cache(self) -> dict:
        """Fan out `/flush_cache`."""
        return await self.fan_out("/flush_cache", {})

    async def abort_request(self, *, rid: str | None = None, abort_all: bool = False) -> dict:
        """Fan out `/abort_request`."""
        return await self.fan_out("/abort_request", {"rid": rid or "", "abort_all": abort_all})

    @contextlib.asynccontextmanager
    async def paused(self, *, mode: str = "abort") -> AsyncIterator[None]:
        """pause_generation -> body -> continue_generation (continue runs even on error)."""
        await self.pause_generation(mode=mode)
        try:
            yield
        finally:
            await self.continue_generation()
