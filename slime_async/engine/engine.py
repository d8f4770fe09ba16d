"""The embedded engine's control plane: model + scheduler + weight version, and every operation
the HTTP routes expose (generate, pause/continue, abort, weight updates, info, load).

Owns: `Engine` and its lifecycle `EngineState`. Weight updates are validated off the serving
path, then swapped between two decode steps (no forward in flight), so a failed load never
touches the weights being served. SGLang's locking rules (0.5.x) are enforced: every running
`/generate` holds the model lock as a reader (`model_lock`, taken by the server); an update
while generation is not paused takes it as the writer, so it waits until the running requests
finished ("drain, then swap"); after `/pause_generation` the update runs at once, and with
`flush_cache: true` (the default) it fails while requests are still in the engine (paused in
place, or retracted). The push that keeps requests alive is therefore pause `in_place` ->
update with `flush_cache: false` -> continue. Weight-update process groups
(`/init_weights_update_group`, `/update_weights_from_distributed`) are joined through the
`slime_async.contracts.weight_group` wire protocol; a bucket call naming a `lora_name` carries
adapter tensors instead, staged and checked like a PEFT directory and activated by
`/load_lora_adapter {from_distributed: true}` (docs/lora.md). Must never import aiohttp (the server wraps
this class).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from slime_async.contracts.adapter import LoraSpec
from slime_async.contracts.weight_group import (
    FLATTENED,
    WeightGroup,
    checksum_problem,
    receive_bucket,
)
from slime_async.contracts.weights import TensorEntry
from slime_async.engine.checkpoint_names import CheckpointAssembler
from slime_async.engine.config import EngineConfig
from slime_async.engine.model import LoadedModel, load_model, read_weights_from_disk, swap_weights
from slime_async.engine.protocol import GenerateRequest, ModelLimits
from slime_async.engine.rwlock import RWLock
from slime_async.engine.sampling import RequestError
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
    received: bool | None = None
    """`update_weights_from_distributed` only: whether the bucket was received (a refusal
    without it leaves this engine out of step with its group: the sender must abort it)."""
    group_broken: bool = False
    """`update_weights_from_distributed` only: the receive had started and failed because the
    group broke under it (rank 0 or another member failed): this engine was in step and is
    not the cause, so the sender does not leave it out of the resend."""


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
        self.model_lock = RWLock()
        """SGLang's model-update lock: `/generate` reads, an unpaused weight update writes."""
        self.paused = False
        """Between `/pause_generation` and `/continue_generation` (updates skip the lock)."""
        self.groups: dict[str, WeightGroup] = {}
        """Weight-update process groups this engine joined, by `group_name`."""
        self._assemblers: dict[str, CheckpointAssembler] = {}
        self._staged: dict[str, dict[str, torch.Tensor]] = {}
        """Per group: checked tensors of the version being received, swapped in together with
        the bucket that carries `weight_version` (or once they cover the whole model), so a
        refused bucket never leaves a mix of two versions behind one label."""
        self._spoiled: set[str] = set()
        """Groups whose current version had a bucket refused: its remaining buckets are received
        (the broadcast must complete) and dropped, up to the one carrying `weight_version`."""
        """Per group: pieces of fused parameters waiting for the rest of their bucket set."""
        self._adapter_parts: dict[str, dict[str, torch.Tensor]] = {}
        """Per group: adapter tensors of the adapter version being received (bucket calls
        with `lora_name`), staged with the bucket that carries `weight_version`."""
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
        for g in self.groups.values():
            g.close()
        self.groups.clear()

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
                # a cached prefix is shared only under the same extra_key and the same adapter
                cache_key=it.extra_key
                if it.lora is None
                else f"{it.extra_key or ''}\0lora:{it.lora}",
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

    def flush_cache(self) -> bool:
        """SGLang semantics: refuse while requests are in the engine; else drop the prefix
        cache."""
        if self.requests_in_engine():
            return False
        assert self.scheduler is not None
        self.scheduler.flush_cache()
        return True

    @contextlib.asynccontextmanager
    async def _update_access(self, *, abort_all_requests: bool, what: str) -> AsyncIterator[None]:
        """SGLang's rule for every weight update: abort first if asked; then, unless generation
        is paused, wait for the writer side of `model_lock` (every running request finishes)."""
        assert self.scheduler is not None
        if abort_all_requests:
            self.scheduler.abort(abort_all=True, message=f"Abort by {what}")
        async with self._update_lock:
            if self.paused:
                yield
            else:
                async with self.model_lock.writer():
                    yield

    def _flush_refusal(self, what: str) -> UpdateResult | None:
        n = self.requests_in_engine()
        if n == 0:
            return None
        return UpdateResult(
            success=False,
            message=(
                f"{what} with flush_cache=true cannot flush the cache: {n} requests are in the "
                "engine (paused in place or retracted). Pass flush_cache: false to keep them "
                "(pause_generation mode in_place -> update -> continue_generation), or pause "
                "with mode abort first. The served weights are unchanged."
            ),
        )

    # ------------------------------------------------------------------ weights and versions
    def _set_version(self, version: str) -> None:
        self.weight_version = version
        assert self.scheduler is not None
        self.scheduler.note_version(version)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        abort_all_requests: bool,
        flush_cache: bool = True,
    ) -> UpdateResult:
        """Under SGLang's lock rule (`_update_access`): load and validate, swap between two
        steps. On any failure the old weights keep serving. Loading runs in the model thread:
        `from_pretrained` flips process-wide torch defaults (default dtype, init patches) that
        must never overlap a forward."""
        assert self.lm is not None and self.scheduler is not None
        lm, sched = self.lm, self.scheduler

        def load_and_swap() -> None:
            swap_weights(lm, read_weights_from_disk(lm, model_path))

        what = "update_weights_from_disk"
        async with self._update_access(abort_all_requests=abort_all_requests, what=what):
            t0 = time.monotonic()
            if flush_cache and (refused := self._flush_refusal(what)) is not None:
                return refused
            in_flight = self.requests_in_engine()
            try:
                await sched.swap_weights(load_and_swap)
            except ValueError as e:
                return UpdateResult(success=False, message=f"Failed to update weights: {e}")
            if flush_cache:
                sched.flush_cache()
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

    # ------------------------------------------------------------------ LoRA adapters
    async def load_lora_adapter(
        self,
        name: str,
        path: str | None,
        *,
        weight_version: str | None = None,
        from_distributed: bool = False,
    ) -> UpdateResult:
        """SGLang's `/load_lora_adapter`: stage (read and check) `path`, then serve it as
        `name`. With `weight_version` an adapter of that name is replaced in place (a versioned
        push: under SGLang's lock rule like a weight update, in-flight requests continue under
        the new adapter and their tokens carry the new version). `from_distributed` (our
        extension, no `path`): activate the adapter `name` received over a weight group with
        exactly this `weight_version`. Any failure leaves what was served unchanged."""
        assert self.lm is not None and self.scheduler is not None
        lora = self.lm.lora
        if lora is None:
            return UpdateResult(
                success=False, message="this engine serves no LoRA: start it with --enable-lora"
            )
        if from_distributed:
            adapter = lora.received.get(name)
            if adapter is None or weight_version is None or adapter.label != weight_version:
                have = "none" if adapter is None else f"version {adapter.label}"
                return UpdateResult(
                    success=False,
                    message=f"Failed to load LoRA adapter: no adapter {name!r} of version "
                    f"{weight_version} was received over a weight group (received: {have}); "
                    "push it with update_weights_from_distributed (lora_name set) first",
                )
            path = adapter.path
        else:
            assert path is not None
            try:
                adapter = await asyncio.to_thread(lora.stage, name, path)
            except (ValueError, OSError) as e:
                return UpdateResult(success=False, message=f"Failed to load LoRA adapter: {e}")
        replace = weight_version is not None
        what = "load_lora_adapter"
        async with self._update_access(abort_all_requests=False, what=what):
            try:
                # a new cache epoch: no prefix computed under the old adapter is reused
                await self.scheduler.swap_weights(lambda: lora.activate(adapter, replace=replace))
            except ValueError as e:
                return UpdateResult(success=False, message=f"Failed to load LoRA adapter: {e}")
            if weight_version is not None:
                self._set_version(weight_version)
        return UpdateResult(success=True, message=f"Loaded LoRA adapter {name!r} from {path}")

    async def unload_lora_adapter(self, name: str) -> UpdateResult:
        """SGLang's `/unload_lora_adapter`; refused while a queued or running request names
        the adapter (it would lose the weights it is generating under)."""
        assert self.lm is not None and self.scheduler is not None
        lora = self.lm.lora
        if lora is None:
            return UpdateResult(success=False, message="this engine serves no LoRA adapters")
        sched = self.scheduler
        users = [s for s in sched.held() if s.lora == name]
        if users:
            return UpdateResult(
                success=False,
                message=(
                    f"adapter {name!r} serves {len(users)} requests in the engine; unload it "
                    "once they finished (or abort them first)"
                ),
            )
        try:
            await sched.swap_weights(lambda: lora.unload(name))
        except ValueError as e:
            return UpdateResult(success=False, message=str(e))
        return UpdateResult(success=True, message=f"Unloaded LoRA adapter {name!r}")

    # ------------------------------------------------------------------ distributed weights
    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> UpdateResult:
        """Join a weight-update group as rank `rank_offset` (one rank: no tensor parallelism);
        returns once every member joined (blocking work off the event loop)."""
        if group_name in self.groups:
            return UpdateResult(
                success=False,
                message=f"weight update group {group_name!r} already exists on this engine; "
                "destroy_weights_update_group it first",
            )
        try:
            g = await asyncio.to_thread(
                WeightGroup.open,
                master_address=master_address,
                master_port=master_port,
                rank=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=self.cfg.weight_group_timeout_s,
            )
        except (ValueError, RuntimeError, OSError) as e:
            return UpdateResult(success=False, message=f"Failed to init group {group_name!r}: {e}")
        self.groups[group_name] = g
        assert self.lm is not None
        self._assemblers[group_name] = CheckpointAssembler(self.lm.state_signature())
        return UpdateResult(success=True, message=f"Succeeded to init group {group_name!r}.")

    def destroy_weights_update_group(self, group_name: str) -> UpdateResult:
        g = self.groups.pop(group_name, None)
        self._assemblers.pop(group_name, None)
        self._staged.pop(group_name, None)
        self._adapter_parts.pop(group_name, None)
        self._spoiled.discard(group_name)
        if g is None:
            return UpdateResult(
                success=False, message=f"no weight update group {group_name!r} on this engine"
            )
        g.close()
        return UpdateResult(success=True, message=f"Succeeded to destroy group {group_name!r}.")

    async def update_weights_from_distributed(
        self,
        entries: tuple[TensorEntry, ...],
        *,
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
        abort_all_requests: bool,
        flush_cache: bool = True,
        lora_name: str | None = None,
        lora_spec: LoraSpec | None = None,
    ) -> UpdateResult:
        """Receive one bucket broadcast by rank 0 of `group_name`, then check and swap it in.
        With `lora_name` (and its `lora_spec`) the bucket holds adapter tensors in PEFT's
        names: staged and checked with the bucket carrying `weight_version`, served once
        `load_lora_adapter(from_distributed=True)` activates them.

        Under SGLang's lock rule (`_update_access`). The bucket is always received in full
        (leaving a broadcast half-way would hang every other member), and only then checked
        against the served model: a bucket that does not fit, or a flush refused while requests
        are in the engine, answers `success: false` with the served weights unchanged.
        `received` says whether the bucket was received: a refusal without it (no such group, a
        failed or aborted receive) leaves this engine out of step with the group."""
        g = self.groups.get(group_name)
        if g is None:
            return UpdateResult(
                success=False,
                message=f"no weight update group {group_name!r} on this engine; call "
                "init_weights_update_group first",
                received=False,
            )
        assert self.lm is not None
        if lora_name is not None and (self.lm.lora is None or lora_spec is None):
            return UpdateResult(
                success=False,
                message="adapter tensors (lora_name) need an engine started with --enable-lora "
                "and the adapter's lora_config",
                received=False,
            )
        res = await self._receive_and_apply(
            g,
            entries,
            group_name=group_name,
            load_format=load_format,
            weight_version=weight_version,
            abort_all_requests=abort_all_requests,
            flush_cache=flush_cache,
            adapter=None if lora_name is None else (lora_name, lora_spec),
        )
        return dataclasses.replace(res, received=res.received is not False)

    async def _receive_and_apply(
        self,
        g: WeightGroup,
        entries: tuple[TensorEntry, ...],
        *,
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
        abort_all_requests: bool,
        flush_cache: bool,
        adapter: tuple[str, LoraSpec] | None = None,
    ) -> UpdateResult:
        """`update_weights_from_distributed` once the group is known: receive, check, stage or
        swap. A failed receive answers `received=False`."""
        assert self.lm is not None and self.scheduler is not None
        lm, sched = self.lm, self.scheduler
        what = "update_weights_from_distributed"
        async with self._update_access(abort_all_requests=abort_all_requests, what=what):
            t0 = time.monotonic()
            try:
                got = await asyncio.to_thread(
                    receive_bucket, g, entries, flatten=load_format == FLATTENED
                )
            except (RuntimeError, ValueError, AttributeError) as e:
                return UpdateResult(
                    success=False,
                    message=f"Failed to receive the bucket over group {group_name!r} ({e}); it "
                    "was not applied. Destroy and re-init the group.",
                    received=False,
                    group_broken=True,
                )
            corrupted = await asyncio.to_thread(checksum_problem, g, entries, got)
            if adapter is not None:
                return await self._stage_adapter_bucket(
                    group_name, got, corrupted, adapter, weight_version=weight_version
                )
            asm = self._assemblers[group_name]
            ready, bad = ({}, []) if corrupted else asm.add(got)
            if not bad and not corrupted:  # never serve NaN/inf, whichever transport brought it
                bad = [
                    f"tensor {k!r} holds non-finite values (NaN or inf)"
                    for k, t in got.items()
                    if not bool(torch.isfinite(t).all())
                ]
            if not bad and not corrupted and weight_version is not None and asm.incomplete():
                bad = [f"the version is incomplete: {p} misses pieces" for p in asm.incomplete()]
            staged = self._staged.setdefault(group_name, {})
            if group_name in self._spoiled:
                asm.reset()
                if weight_version is not None:  # the spoiled version ends with this bucket
                    self._spoiled.discard(group_name)
                return UpdateResult(
                    success=False,
                    message="Failed to update weights: an earlier bucket of this version was "
                    "refused, so none of it is applied; push the whole version again",
                )
            if corrupted:  # never staged; the driver sends the whole version again
                asm.reset()
                staged.clear()
                if weight_version is None:
                    self._spoiled.add(group_name)
                return UpdateResult(
                    success=False,
                    message=f"Failed to update weights: {corrupted}. No tensor of this version "
                    "was applied; push the whole version again",
                )
            if bad:
                asm.reset()
                staged.clear()  # the version's earlier buckets are dropped too
                if weight_version is None:
                    self._spoiled.add(group_name)
                return UpdateResult(
                    success=False,
                    message=f"Failed to update weights: the bucket does not fit the served model "
                    f"({'; '.join(bad[:5])}); export from the same ModelSpec. No tensor of this "
                    "version was applied",
                )
            if flush_cache and (refused := self._flush_refusal(what)) is not None:
                asm.reset()
                staged.clear()
                if weight_version is None:
                    self._spoiled.add(group_name)
                return refused
            staged.update(ready)
            whole = {n for n, _ in lm.model.named_parameters()} <= staged.keys()
            if weight_version is None and not whole:
                return UpdateResult(  # more buckets of this version to come
                    success=True,
                    message=f"Received {len(entries)} tensors; they are applied with the "
                    "bucket that carries weight_version",
                )
            ready = dict(staged)
            staged.clear()
            in_flight = self.requests_in_engine()
            await sched.swap_weights(lambda: swap_weights(lm, ready))
            if flush_cache:
                sched.flush_cache()
            if weight_version is not None:
                self._set_version(weight_version)
            return UpdateResult(
                success=True,
                message=f"Succeeded to update {len(entries)} tensors in "
                f"{time.monotonic() - t0:.3f}s.",
                num_paused_requests=in_flight,
            )

    async def _stage_adapter_bucket(
        self,
        group_name: str,
        got: dict[str, torch.Tensor],
        corrupted: str | None,
        adapter: tuple[str, LoraSpec],
        *,
        weight_version: str | None,
    ) -> UpdateResult:
        """One received bucket of adapter tensors: kept until the bucket with `weight_version`,
        then checked as a PEFT directory is (`EngineLora.stage_tensors`) and kept in
        `received`. A corrupted or refused bucket drops the version (its later buckets are
        received and dropped); what serves never changes here."""
        assert self.lm is not None and self.lm.lora is not None
        lora, (name, spec) = self.lm.lora, adapter
        parts = self._adapter_parts.setdefault(group_name, {})
        problem = corrupted
        if group_name in self._spoiled:
            problem = "an earlier bucket of this adapter version was refused"
        elif problem is None:
            parts.update(got)
            if weight_version is None:
                return UpdateResult(
                    success=True,
                    message=f"Received {len(got)} adapter tensors; they are checked with the "
                    "bucket that carries weight_version",
                )
            tensors = dict(parts)
            parts.clear()
            try:
                staged = await asyncio.to_thread(
                    lora.stage_tensors,
                    name,
                    spec,
                    tensors,
                    path=f"weight_group:{group_name}",
                    label=weight_version,
                )
            except ValueError as e:
                problem = str(e)
            else:
                lora.received[name] = staged
                return UpdateResult(
                    success=True,
                    message=f"Received LoRA adapter {name!r} version {weight_version} "
                    f"({len(tensors)} tensors, checked); /load_lora_adapter with "
                    "from_distributed activates it",
                )
        parts.clear()
        if weight_version is None:
            self._spoiled.add(group_name)
        else:
            self._spoiled.discard(group_name)
        return UpdateResult(
            success=False,
            message=f"Failed to receive LoRA adapter {name!r}: {problem}. Nothing of this "
            "version is staged; the loaded adapter keeps serving",
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
                    "generation_paused": self.paused,
                    "model_lock_readers": self.model_lock.readers,
                    "model_lock_writers_waiting": self.model_lock.writers_waiting,
                    "weight_update_groups": sorted(self.groups),
                    "steps": self.scheduler.steps,
                    "decoded_tokens": self.scheduler.decoded_tokens,
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
