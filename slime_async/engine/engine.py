"""The embedded engine's control plane: model + scheduler + weight version, and every operation
the HTTP routes expose (generate, pause/continue, abort, weight updates, info, load).

Owns: `Engine` and its lifecycle `EngineState`. Weight updates are validated off the serving
path, then swapped between two decode steps (no forward in flight), so a failed load never
touches the weights being served. Must never import aiohttp (the server wraps this class).
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
from slime_async.engine.model import LoadedModel, load_model, read_weights_from_disk, swap_weights
from slime_async.engine.protocol import GenerateRequest, ModelLimits
from slime_async.engine.scheduler import PauseMode, Scheduler
from slime_async.engine.sequence import Sequence

ENGINE_VERSION = "slime-async-embedded/0.1"


class EngineState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UpdateResult:
    """Outcome of a weight or version update (SGLang `{success, message}`)."""

    success: bool
    message: str
    num_paused_requests: int = 0


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
        self._update_lock = asyncio.Lock()
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
        )

    def submit(self, req: GenerateRequest) -> list[Sequence]:
        """Queue every item of a parsed request; await `seq.done` on the results. Every
        sequence is built before any is queued, so a request is admitted whole or not at all."""
        assert self.scheduler is not None
        seqs = []
        for it in req.items:
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
        assert self.scheduler is not None
        await self.scheduler.pause(mode)

    def resume(self) -> None:
        assert self.scheduler is not None
        self.scheduler.resume()

    def flush_cache(self) -> bool:
        """SGLang semantics: refuse while requests run. There is no prefix cache to drop, so a
        successful flush frees nothing; it exists for API parity."""
        assert self.scheduler is not None
        return not (self.scheduler.running or self.scheduler.waiting)

    # ------------------------------------------------------------------ weights and versions
    def _set_version(self, version: str) -> None:
        self.weight_version = version
        assert self.scheduler is not None
        self.scheduler.note_version(version)

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None, abort_all_requests: bool
    ) -> UpdateResult:
        """Pause stepping, load and validate, swap, continue. On any failure the old weights keep
        serving. Loading runs in the model thread: `from_pretrained` flips process-wide torch
        defaults (default dtype, init patches) that must never overlap a forward."""
        assert self.lm is not None and self.scheduler is not None
        lm, sched = self.lm, self.scheduler

        def load_and_swap() -> None:
            swap_weights(lm, read_weights_from_disk(lm, model_path))

        async with self._update_lock:
            t0 = time.monotonic()
            if abort_all_requests:
                sched.abort(abort_all=True, message="Abort by update_weights_from_disk")
            in_flight = len(sched.running) + len(sched.waiting)
            try:
                await sched.run_exclusive(load_and_swap)
            except ValueError as e:
                return UpdateResult(success=False, message=f"Failed to update weights: {e}")
            if weight_version is not None:
                self._set_version(weight_version)
            return UpdateResult(
                success=True,
                message=(
                    f"Succeeded to update model weights from {model_path} in "
                    f"{time.monotonic() - t0:.3f}s."
                ),
                num_paused_requests=in_flight,
            )

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool
    ) -> UpdateResult:
        assert self.scheduler is not None
        async with self._update_lock:
            if abort_all_requests:
                self.scheduler.abort(abort_all=True, message="Abort by update_weight_version")
            self._set_version(new_version)
        return UpdateResult(success=True, message=f"Weight version updated to {new_version}")

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
            "has_image_understanding": False,
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
                    "steps": self.scheduler.steps,
                    "decoded_tokens": self.scheduler.decoded_tokens,
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
