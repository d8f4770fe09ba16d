"""The turns of a colocated run (slime's `--colocate`): the engines generate while the trainer is
offloaded, the trainer trains while the engines' memory is released.

Owns `Colocation` (one per `Run`, `run.colocation`) and `read_events`. Per train step, with
`--offload-rollout` (`--engine-sleep-level N`) and `--offload-train`:

1. the data worker pauses (the engines' in-flight samples are aborted and go on later) and the
   engines release their memory through the router (SGLang's `/release_memory_occupation`, the
   level's tags);
2. the trainer onloads (`TrainerGroup.wake`) and trains the step;
3. the trainer puts the new version into its CPU weight cache and offloads its parameters,
   gradients and optimizer state (`TrainerGroup.sleep`, spilled under `<run-dir>/offload`);
4. the engines resume (`/resume_memory_occupation`) and generation continues; the weight push
   that follows reads the new version from the trainer's weight cache.

The trainer is offloaded once before the first batch is generated, and onloaded around a save
(`trainer_awake`; the engines go on generating meanwhile). Every transition is a line of `<run-dir>/colocate.jsonl` (the event, the
step, the time, the data worker's dispatched count, the engines' reported sleep levels,
released weight bytes, decoded tokens and, on one node, resident memory; the trainer's bytes
and resident memory), and the step's metrics carry the
counts and seconds (`metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from slime_async.config.run_config import RunConfig
from slime_async.engine.sleep import tags_for_level

EVENTS = "colocate.jsonl"
"""The run directory's log of the colocated turns."""


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of `<run_dir>/colocate.jsonl` (none when the run took no turns)."""
    path = Path(run_dir) / EVENTS
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines()]


def _rss_of(pid: int) -> float | None:
    """Resident bytes of local process `pid` (None where /proc does not have it)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclasses.dataclass(kw_only=True)
class Colocation:
    """The turn-taking of one run's trainer and engines (see the module docstring)."""

    cfg: RunConfig
    trainer: Any
    """The `TrainerGroup` (None with --debug-rollout-only: nothing to offload)."""
    cluster: Any
    worker: Any
    transport: Any = None
    """The weight transport: a weight group it holds is released before the trainer sleeps
    (the trainer's side closes with it; the next push forms it again)."""
    totals: dict[str, float] = dataclasses.field(default_factory=dict)
    trainer_asleep: bool = False

    @property
    def level(self) -> int:
        return self.cfg.engine_sleep_level

    @property
    def offload_train(self) -> bool:
        return self.cfg.offload_train and self.trainer is not None

    @property
    def spill_dir(self) -> Path:
        return self.cfg.run_dir / "offload"

    def _add(self, key: str, value: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + value

    async def _event(self, event: str, step: int, **info: Any) -> None:
        record = {"event": event, "step": step, "t": time.time(), **info}
        record["dispatched"] = self.worker.accounting().dispatched
        record["engines"] = await self._engine_states()
        with open(self.cfg.run_dir / EVENTS, "a") as f:
            f.write(json.dumps(record) + "\n")

    async def _engine_states(self) -> list[dict[str, Any] | None]:
        """Each engine's reported sleep level and decoded tokens (`/server_info`; None where it
        did not say, e.g. a real SGLang server's decoded tokens)."""
        import aiohttp

        token = self.cfg.engine.api_key  # /server_info is a data-plane route
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        async def one(s: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
            try:
                async with s.get(f"{url}/server_info", headers=headers) as r:
                    state = (await r.json())["internal_states"][0] if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError):
                return None
            if not isinstance(state, dict):
                return None
            memory = state.get("memory") or {}
            return {
                "sleep_level": memory.get("sleep_level"),
                "weights_bytes": memory.get("weights_bytes"),
                "decoded": state.get("decoded_tokens"),
            }

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            states = list(await asyncio.gather(*(one(s, u) for u in self.cluster.engine_urls)))
        if self.cfg.ray_address is None:  # a one-node run: the engines' processes are here
            for state, pid in zip(states, self.cluster.engine_pids, strict=False):
                if state is not None and pid is not None:
                    state["rss"] = _rss_of(pid)
        return states

    async def start(self, step: int) -> None:
        """Offload the trainer before the engines generate the first batch."""
        if self.offload_train and not self.trainer_asleep:
            await self._offload(step)

    async def _offload(self, step: int) -> None:
        spill = self.spill_dir
        spill.mkdir(parents=True, exist_ok=True)
        if (release := getattr(self.transport, "release_group", None)) is not None:
            await release()
        r = await asyncio.to_thread(self.trainer.sleep, str(spill))
        self.trainer_asleep = True
        freed = r["rss_before"] - r["rss_after"]
        self._add("trainer/offloads", 1.0)
        self._add("timing/trainer_offload_s", r["seconds"])
        self.totals["trainer/offload_bytes"] = r["bytes"]
        self.totals["trainer/rss_freed_bytes"] = freed
        await self._event("trainer_offloaded", step, **r, rss_freed=freed)

    async def _onload(self, step: int) -> None:
        r = await asyncio.to_thread(self.trainer.wake)
        self.trainer_asleep = False
        self._add("timing/trainer_onload_s", r["seconds"])
        await self._event("trainer_onloaded", step, **r)

    async def _release(self, step: int) -> None:
        before = [x and x.get("rss") for x in await self._engine_states()]
        t0 = time.perf_counter()
        await self.cluster.control.release_memory_occupation(tags_for_level(self.level))
        s = time.perf_counter() - t0
        self._add("timing/engine_release_s", s)
        await self._event("engines_released", step, level=self.level, seconds=s, rss_before=before)

    async def _resume(self, step: int) -> None:
        t0 = time.perf_counter()
        await self.cluster.control.resume_memory_occupation(tags_for_level(self.level))
        # the data worker's pause paused the engines (abort mode): let them generate again
        await self.cluster.control.continue_generation()
        s = time.perf_counter() - t0
        self._add("timing/engine_resume_s", s)
        self._add("engines/sleeps", 1.0)
        await self._event("engines_resumed", step, level=self.level, seconds=s)

    @contextlib.asynccontextmanager
    async def train_turn(self, step: int) -> AsyncIterator[None]:
        """Around train step `step`: the engines released (the data worker paused first) and
        the trainer onloaded; after a step that trained, the trainer offloaded (the new
        version in its weight cache); then the engines resumed and the data worker goes on."""
        if self.level:
            await self.worker.pause()
            await self._release(step)
        try:
            if self.offload_train:
                await self._onload(step)
            yield
            if self.offload_train:
                await self._offload(step)
        finally:
            if self.level:
                await self._resume(step)
                await self.worker.resume()

    @contextlib.asynccontextmanager
    async def trainer_awake(self, step: int) -> AsyncIterator[None]:
        """An offloaded trainer onloaded for the body (a save), offloaded again after it. The
        engines are not released for it: a save reads the trainer's state while they go on
        generating."""
        if not self.trainer_asleep:
            yield
            return
        await self._onload(step)
        try:
            yield
        finally:
            await self._offload(step)

    def metrics(self) -> dict[str, float]:
        """The counts and seconds so far (`engines/sleeps`, `timing/sleep_wake_s`, the
        trainer's offloads and its last offload's bytes and freed resident memory)."""
        if not (self.level or self.offload_train):
            return {}
        t = self.totals
        wake = t.get("timing/engine_release_s", 0.0) + t.get("timing/engine_resume_s", 0.0)
        return {**t, "engines/sleeps": t.get("engines/sleeps", 0.0), "timing/sleep_wake_s": wake}

    def close(self) -> None:
        """Remove the spill directory (an offloaded trainer's files, once it is shut down)."""
        import shutil

        shutil.rmtree(self.spill_dir, ignore_errors=True)
