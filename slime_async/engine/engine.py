"""The embedded engine: one served model (model + scheduler + weight version) and the serving
operations the HTTP routes call (generate, pause/continue, abort, flush, health, info, load).

Owns: `Engine` and its lifecycle `EngineState`, the idle check, the model lock (SGLang 0.5.x: every running
`/generate` holds `model_lock` as a reader, taken by the server; a weight update while
generation is not paused takes it as the writer) and the pause state. Weight, adapter and
version updates are `engine.weights` (`engine/weight_updates.py`: the lock rule and the swap
tail), `engine.weight_groups` (`engine/weight_receive.py`: updates over weight-update
groups) and `engine.memory` (`engine/sleep.py`: sleep and wake). Must never import aiohttp (the server wraps this class).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import random
import time
from typing import Any

import torch

from slime_async.engine.config import EngineConfig
from slime_async.engine.model import LoadedModel, load_model
from slime_async.engine.protocol import GenerateItem, GenerateRequest, ModelLimits
from slime_async.engine.rwlock import RWLock
from slime_async.engine.sampling import RequestError
from slime_async.engine.scheduler import PauseMode, Scheduler
from slime_async.engine.sequence import Sequence
from slime_async.engine.sleep import MemoryOccupation
from slime_async.engine.weight_receive import WeightGroups
from slime_async.engine.weight_updates import WeightUpdates

ENGINE_VERSION = "slime-async-embedded/0.1"


class EngineState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"


class Engine:
    """One served model. Create, `await start()` on the serving loop, `await stop()`."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.state = EngineState.STARTING
        self.weight_version = cfg.weight_version
        self.lm: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self.startup_time = time.time()
        self.bound_port: int | None = None
        """The TCP port the server bound (set by `runner.serve`; `cfg.port` may be 0)."""
        self.model_lock = RWLock()
        """SGLang's model-update lock: `/generate` reads, an unpaused weight update writes."""
        self.paused = False
        """Between `/pause_generation` and `/continue_generation` (updates skip the lock)."""
        self.weights = WeightUpdates(self)
        """Weight, adapter and version updates (the lock rule and the swap tail)."""
        self.weight_groups = WeightGroups(self, self.weights)
        """Weight-update process groups this engine joined, and what they are receiving."""
        self.memory = MemoryOccupation(self)
        """Sleep and wake (`/release_memory_occupation`, `/resume_memory_occupation`)."""
        self._seed_rng = random.Random(cfg.seed)

    async def start(self) -> None:
        if self.cfg.num_threads is not None:
            torch.set_num_threads(self.cfg.num_threads)
        self.lm = await asyncio.to_thread(load_model, self.cfg)
        self.scheduler = Scheduler(self.lm, self.cfg, version=lambda: self.weight_version)
        self.scheduler.start()
        self.state = EngineState.SERVING

    async def stop(self) -> None:
        self.state = EngineState.STOPPING
        if self.scheduler is not None:
            await self.scheduler.close()
        self.weight_groups.close()
        self.memory.close()

    def describe(self) -> dict[str, Any]:
        """What this engine holds, for a hang report: state, the model lock, the batch."""
        lock = self.model_lock
        return {
            "state": self.state.value,
            "weight_version": self.weight_version,
            "paused": self.paused,
            "model_lock": f"readers={lock.readers} writer_active={lock.writer_active} "
            f"writers_waiting={lock.writers_waiting}",
            **(self.scheduler.describe() if self.scheduler is not None else {}),
        }

    # ------------------------------------------------------------------ generation
    @property
    def limits(self) -> ModelLimits:
        assert self.lm is not None
        return ModelLimits(
            vocab_size=self.lm.vocab_size,
            context_length=self.lm.context_length,
            moe=self.lm.is_moe,
            routed_experts_enabled=self.cfg.enable_return_routed_experts,
            routed_experts_by_default=self.cfg.always_return_routed_experts and self.lm.is_moe,
            lora_names=None if self.lm.lora is None else frozenset(self.lm.lora.adapters),
            allow_auto_truncate=self.cfg.allow_auto_truncate,
        )

    def submit(self, req: GenerateRequest) -> list[Sequence]:
        """Queue every item of a parsed request; await `seq.done` on the results. Every
        sequence is built before any is queued, so a request is admitted whole or not at all."""
        assert self.scheduler is not None
        seqs = []
        for it in req.items:
            if it.lora is not None and it.lora not in self.limits.lora_names:  # unloaded since
                raise RequestError(f"lora_path {it.lora!r} names no loaded adapter")
            seed = it.params.sampling_seed
            if seed is None:
                seed = self._seed_rng.getrandbits(62)
            seq = Sequence(
                rid=it.rid,
                group_rid=it.group_rid,
                prompt=it.prompt,
                params=it.params,
                generator=torch.Generator().manual_seed(seed),
                weight_version=self.weight_version,
                return_logprob=it.return_logprob,
                logprob_start_len=it.logprob_start_len,
                return_routed_experts=it.return_routed_experts,
                routed_start=it.routed_start,
                lora=it.lora,
                images=it.images,
                # a cached prefix is shared only under the same extra_key, the same adapter
                # and the same images
                cache_key=_cache_key(it),
            )
            seqs.append(seq)
        for seq in seqs:
            self.scheduler.submit(seq)
        return seqs

    def abort(self, *, rid: str | None, abort_all: bool) -> int:
        """`/abort_request`: abort the request(s) whose rid or request-level rid is `rid`."""
        assert self.scheduler is not None
        return self.scheduler.abort(rid=rid, abort_all=abort_all, message="Abort by request")

    def abort_seqs(self, seqs: list[Sequence], message: str) -> None:
        """Abort exactly these sequences (client went away, health probe timed out)."""
        assert self.scheduler is not None
        self.scheduler.abort_seqs(seqs, message)

    async def pause(self, mode: PauseMode) -> None:
        """`/pause_generation`: abort (every request finishes with abort, and this returns once
        none holds the model lock), in_place (frozen with their KV cache) or retract (back to
        the queue, KV dropped)."""
        assert self.scheduler is not None
        self.paused = True
        await self.scheduler.pause(mode)
        while mode is PauseMode.ABORT and self.model_lock.readers:
            self.scheduler.abort(abort_all=True, message="Abort by pause_generation")
            await asyncio.sleep(0.01)  # their handlers release the lock as they answer

    def resume(self) -> None:
        assert self.scheduler is not None
        self.paused = False
        self.scheduler.resume()

    def requests_in_engine(self) -> int:
        """Requests the scheduler holds (queued, prefilling, running, or frozen by a pause)."""
        assert self.scheduler is not None
        return self.scheduler.in_engine()

    def idle(self) -> bool:
        """No request queued, running, paused or being answered: a release may run."""
        return self.requests_in_engine() == 0 and self.model_lock.readers == 0

    def flush_cache(self) -> bool:
        """SGLang semantics: refuse while requests are in the engine; else drop the prefix
        cache."""
        if self.requests_in_engine():
            return False
        assert self.scheduler is not None
        self.scheduler.flush_cache()
        return True

    # ------------------------------------------------------------------ info
    def model_info(self) -> dict[str, Any]:
        assert self.lm is not None
        return {
            "model_path": self.lm.model_path,
            "served_model_name": self.served_model_name(),
            "tokenizer_path": self.lm.model_path,  # SGLang: tokenizer_path defaults to it
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": self.lm.vision is not None,
            "has_audio_understanding": False,
            "model_type": self.lm.model_type,
            "architectures": list(getattr(self.lm.model.config, "architectures", None) or [])
            or [type(self.lm.model).__name__],
            "num_hidden_layers": self.lm.num_layers,
            "num_experts_per_tok": self.lm.topk,
        }

    def served_model_name(self) -> str:
        """`--served-model-name`, else the model path (SGLang's default)."""
        assert self.lm is not None
        return self.cfg.served_model_name or self.lm.model_path

    def load(self) -> dict[str, Any]:
        assert self.scheduler is not None
        return {"dp_rank": 0, **self.scheduler.load()}

    def server_info(self) -> dict[str, Any]:
        assert self.lm is not None and self.scheduler is not None
        args = dataclasses.asdict(self.cfg)
        args.update(
            model_path=self.lm.model_path,
            tokenizer_path=self.lm.model_path,
            served_model_name=self.served_model_name(),
            port=self.bound_port if self.bound_port is not None else self.cfg.port,
            context_length=self.lm.context_length,
            max_context_length=self.lm.context_length,
            enable_return_routed_experts=self.cfg.enable_return_routed_experts,
            skip_tokenizer_init=not self.lm.has_tokenizer,
        )
        return {
            **args,
            "version": ENGINE_VERSION,
            "startup_time": self.startup_time,
            "frontend": "slime_async.engine",
            "weight_version": self.weight_version,
            "internal_states": [
                {
                    **self.scheduler.load(),
                    "paused": self.scheduler.paused,
                    "generation_paused": self.paused,
                    "model_lock_readers": self.model_lock.readers,
                    "model_lock_writers_waiting": self.model_lock.writers_waiting,
                    "weight_update_groups": self.weight_groups.names(),
                    "steps": self.scheduler.steps,
                    "decoded_tokens": self.scheduler.decoded_tokens,
                    "idle": self.idle(),
                    "memory": self.memory.info(),
                    "prefix_cache": (
                        self.scheduler.cache.info() if self.scheduler.cache is not None else None
                    ),
                }
            ],
        }

    def pause_mode(self, raw: Any) -> PauseMode:
        try:
            return PauseMode(raw)
        except ValueError:
            raise ValueError(
                f"mode must be one of {[m.value for m in PauseMode]}, got {raw!r}"
            ) from None


def _cache_key(it: GenerateItem) -> str | None:
    """The prefix-cache namespace of an item: its extra_key, adapter and images."""
    key = it.extra_key
    if it.lora is not None:
        key = f"{key or ''}\0lora:{it.lora}"
    if it.images is not None:
        key = f"{key or ''}\0images:{it.images.digest}"
    return key
