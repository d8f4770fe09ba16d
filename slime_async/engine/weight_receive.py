"""Weight updates over a weight-update group: joining and leaving groups, receiving buckets,
checking them, and staging a version until it is whole.

Owns: `WeightGroups` (one per `Engine`, `engine.weight_groups`), behind
`/init_weights_update_group`, `/update_weights_from_distributed` and
`/destroy_weights_update_group`. Groups are joined through `slime_async.contracts.weight_group`
and buckets received through `slime_async.contracts.weight_transfer`. A bucket is always received in full
(leaving a broadcast half-way would hang every other member), then checked against the served
model (checkpoint names assembled into served parameters, finite values, checksum); a version's
buckets are staged and swapped in together with the bucket that carries `weight_version` (or
once they cover the whole model), through `WeightUpdates.swap`, the swap tail every update path
shares, under its lock rule (`WeightUpdates.access`). A refused bucket drops its whole version.
A bucket naming a `lora_name` carries adapter tensors instead, staged and checked like a PEFT
directory and activated by `/load_lora_adapter {from_distributed: true}` (docs/lora.md). Must
never import aiohttp.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import torch

from slime_async.contracts import weight_shm
from slime_async.contracts.adapter import LoraSpec
from slime_async.contracts.weight_buckets import FLATTENED
from slime_async.contracts.weight_group import WeightGroup
from slime_async.contracts.weight_transfer import Received, receive_checked
from slime_async.contracts.weights import TensorEntry
from slime_async.engine.checkpoint_names import CheckpointAssembler
from slime_async.engine.model import swap_weights
from slime_async.engine.weight_updates import ServingEngine, UpdateResult, WeightUpdates

_WHAT = "update_weights_from_distributed"
log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, kw_only=True)
class _Inbox:
    """One joined weight-update group and what it holds of the version being received."""

    group: WeightGroup
    assembler: CheckpointAssembler
    """Pieces of fused parameters waiting for the rest of their bucket set."""
    staged: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Checked tensors of the version being received, swapped in together with the bucket
    that carries `weight_version` (or once they cover the whole model), so a refused bucket
    never leaves a mix of two versions behind one label."""
    adapter_parts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Adapter tensors of the adapter version being received (bucket calls with
    `lora_name`), staged with the bucket that carries `weight_version`."""
    spoiled: bool = False
    """The current version had a bucket refused: its remaining buckets are received (the
    broadcast must complete) and dropped, up to the one carrying `weight_version`."""
    staged_set: int | None = None
    """The segment set the staged tensors view (same-node path), None when they are owned."""

    def drop_version(self, weight_version: str | None) -> None:
        """Forget the version being received after a refused bucket; unless this bucket ends
        it, its later buckets are dropped too."""
        self.assembler.reset()
        self.staged.clear()
        self.staged_set = None
        if weight_version is None:
            self.spoiled = True


class WeightGroups:
    """The weight-update groups one `Engine` joined, by `group_name`."""

    def __init__(self, engine: ServingEngine, updates: WeightUpdates) -> None:
        self.engine = engine
        self.updates = updates
        self._inboxes: dict[str, _Inbox] = {}

    def names(self) -> list[str]:
        return sorted(self._inboxes)

    def close(self) -> None:
        """Leave every group (engine shutdown)."""
        for inbox in self._inboxes.values():
            inbox.group.close()
        self._inboxes.clear()

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
        if group_name in self._inboxes:
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
                timeout_s=self.engine.cfg.weight_group_timeout_s,
                same_node=self.engine.cfg.same_node_weights,
            )
        except (ValueError, RuntimeError, OSError) as e:
            return UpdateResult(success=False, message=f"Failed to init group {group_name!r}: {e}")
        assert self.engine.lm is not None
        asm = CheckpointAssembler(self.engine.lm.state_signature())
        self._inboxes[group_name] = _Inbox(group=g, assembler=asm)
        how = "through shared memory (rank 0 is on this node)"
        if g.same_node.reader is None:
            how = f"over {backend}" + (f" ({g.same_node.why})" if g.same_node.why else "")
        log.info("weight group %r joined: buckets arrive %s", group_name, how)
        return UpdateResult(
            success=True, message=f"Succeeded to init group {group_name!r}; buckets arrive {how}."
        )

    def destroy_weights_update_group(self, group_name: str) -> UpdateResult:
        inbox = self._inboxes.pop(group_name, None)
        if inbox is None:
            return UpdateResult(
                success=False, message=f"no weight update group {group_name!r} on this engine"
            )
        inbox.group.close()
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
        shm_segment: str | None = None,
    ) -> UpdateResult:
        """Receive one bucket broadcast by rank 0 of `group_name`, then check and swap it in.
        With `lora_name` (and its `lora_spec`) the bucket holds adapter tensors in PEFT's
        names: staged and checked with the bucket carrying `weight_version`, served once
        `load_lora_adapter(from_distributed=True)` activates them.

        Under SGLang's lock rule (`WeightUpdates.access`). The bucket is always received in
        full, and only then checked against the served model: a bucket that does not fit, or a
        flush refused while requests are in the engine, answers `success: false` with the
        served weights unchanged. `received` says whether the bucket was received: a refusal
        without it (no such group, a failed or aborted receive) leaves this engine out of step
        with the group."""
        inbox = self._inboxes.get(group_name)
        if inbox is None:
            return UpdateResult(
                success=False,
                message=f"no weight update group {group_name!r} on this engine; call "
                "init_weights_update_group first",
                received=False,
            )
        assert self.engine.lm is not None
        if lora_name is not None and (self.engine.lm.lora is None or lora_spec is None):
            return UpdateResult(
                success=False,
                message="adapter tensors (lora_name) need an engine started with --enable-lora "
                "and the adapter's lora_config",
                received=False,
            )
        if shm_segment is not None and (why := _segment_refusal(inbox.group, shm_segment)):
            return UpdateResult(success=False, message=why, received=False)
        adapter = None if lora_name is None else (lora_name, lora_spec)
        res = await self._receive_and_apply(
            inbox,
            entries,
            group_name=group_name,
            load_format=load_format,
            weight_version=weight_version,
            abort_all_requests=abort_all_requests,
            flush_cache=flush_cache,
            adapter=adapter,
            shm_segment=shm_segment,
        )
        return dataclasses.replace(res, received=res.received is not False)

    async def _receive_and_apply(
        self,
        inbox: _Inbox,
        entries: tuple[TensorEntry, ...],
        *,
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
        abort_all_requests: bool,
        flush_cache: bool,
        adapter: tuple[str, LoraSpec | None] | None,
        shm_segment: str | None,
    ) -> UpdateResult:
        """`update_weights_from_distributed` once the group is known: receive, check, stage or
        swap. A failed receive answers `received=False`; a bucket whose segment is not the one
        the call named (`shm_segment`) is refused after it was read."""
        updates = self.updates
        async with updates.access(abort_all_requests=abort_all_requests, what=_WHAT):
            t0 = time.monotonic()
            try:
                rx = await asyncio.to_thread(
                    receive_checked,
                    inbox.group,
                    entries,
                    flatten=load_format == FLATTENED,
                    check_finite=adapter is None and not inbox.spoiled,
                )
            except (RuntimeError, ValueError, AttributeError, OSError) as e:
                return UpdateResult(
                    success=False,
                    message=f"Failed to receive the bucket over group {group_name!r} ({e}); it "
                    "was not applied. Destroy and re-init the group.",
                    received=False,
                    group_broken=True,
                )
            if shm_segment is not None and shm_segment != rx.segment:
                rx = dataclasses.replace(rx, corrupted=_segment_mismatch(shm_segment, rx))
            if adapter is not None:
                name, spec = adapter
                assert spec is not None
                got = rx.tensors
                if rx.segment_set is not None:  # kept past this push: copied out of rank 0's
                    got = {k: v.clone() for k, v in got.items()}
                return await self._stage_adapter_bucket(
                    inbox, group_name, got, rx.corrupted, name, spec, weight_version=weight_version
                )
            return await self._apply_model_bucket(
                inbox,
                entries,
                rx,
                weight_version=weight_version,
                flush_cache=flush_cache,
                times=(t0, time.monotonic()),
            )

    # ------------------------------------------------------------------ model weights
    async def _apply_model_bucket(
        self,
        inbox: _Inbox,
        entries: tuple[TensorEntry, ...],
        rx: Received,
        *,
        weight_version: str | None,
        flush_cache: bool,
        times: tuple[float, float],
    ) -> UpdateResult:
        """One received and checked bucket of model weights: refused (and its version dropped),
        staged, or, with the bucket that ends the version, swapped in through the shared swap
        tail: by reference where it came through shared memory in the served dtype (the
        parameters view the segment, which rank 0 does not write while this engine holds
        it), else copied. `times`: when the receive started, and when it and the checks
        ended (for the answer's message)."""
        if inbox.spoiled:
            inbox.assembler.reset()
            if weight_version is not None:  # the spoiled version ends with this bucket
                inbox.spoiled = False
            return UpdateResult(
                success=False,
                message="Failed to update weights: an earlier bucket of this version was "
                "refused, so none of it is applied; push the whole version again",
            )
        updates = self.updates
        ready, problem = _check_model_bucket(
            inbox.assembler, rx.tensors, rx.corrupted, rx.nonfinite, weight_version
        )
        refused = None
        if problem is not None:
            refused = UpdateResult(success=False, message=f"Failed to update weights: {problem}")
        elif flush_cache:
            refused = updates.flush_refusal(_WHAT)
        if refused is not None:  # the version's earlier buckets are dropped too
            inbox.drop_version(weight_version)
            return refused
        lm = self.engine.lm
        assert lm is not None
        inbox.staged.update(ready)
        if rx.segment_set is not None:
            inbox.staged_set = rx.segment_set
        whole = {n for n, _ in lm.model.named_parameters()} <= inbox.staged.keys()
        if weight_version is None and not whole:
            return UpdateResult(  # more buckets of this version to come
                success=True,
                message=f"Received {len(entries)} tensors ({_took(rx, times)}); they are "
                "applied with the bucket that carries weight_version",
            )
        ready, tag = dict(inbox.staged), None
        if inbox.staged_set is not None:
            tag = (inbox.group.same_node.reader, inbox.staged_set)
        inbox.staged.clear()
        inbox.staged_set = None
        in_flight = await updates.swap(
            lambda: swap_weights(lm, ready, borrowed=tag),
            flush_cache=flush_cache,
            weight_version=weight_version,
        )
        if inbox.group.same_node.reader is not None:  # rank 0 must not overwrite what serves
            reader = inbox.group.same_node.reader
            held = {s for r, s in lm.borrowed.values() if r is reader}
            await asyncio.to_thread(inbox.group.hold, held)
        now = time.monotonic()
        how = "by reference" if tag is not None else "copied"
        return UpdateResult(
            success=True,
            message=f"Succeeded to update {len(entries)} tensors in {now - times[0]:.3f}s "
            f"({_took(rx, times)}, swapped in {now - times[1]:.3f}s, {how}).",
            num_paused_requests=in_flight,
        )

    # ------------------------------------------------------------------ adapter tensors
    async def _stage_adapter_bucket(
        self,
        inbox: _Inbox,
        group_name: str,
        got: dict[str, torch.Tensor],
        corrupted: str | None,
        name: str,
        spec: LoraSpec,
        *,
        weight_version: str | None,
    ) -> UpdateResult:
        """One received bucket of adapter tensors: kept until the bucket with `weight_version`,
        then checked as a PEFT directory is (`EngineLora.stage_tensors`) and kept in
        `received`. A corrupted or refused bucket drops the version (its later buckets are
        received and dropped); what serves never changes here."""
        assert self.engine.lm is not None and self.engine.lm.lora is not None
        lora, parts = self.engine.lm.lora, inbox.adapter_parts
        problem = corrupted
        if inbox.spoiled:
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
        inbox.spoiled = weight_version is None
        return UpdateResult(
            success=False,
            message=f"Failed to receive LoRA adapter {name!r}: {problem}. Nothing of this "
            "version is staged; the loaded adapter keeps serving",
        )


def _took(rx: Received, times: tuple[float, float]) -> str:
    """How long the receive and the checks of a bucket took, for its answer's message."""
    if rx.segment is not None:
        return f"received and checked in {times[1] - times[0]:.3f}s through shared memory"
    return f"received in {rx.received_s:.3f}s, checked in {rx.checked_s:.3f}s"


def _segment_refusal(g: WeightGroup, named: str) -> str | None:
    """Why a call naming segment `named` is refused before anything is read (None: it names
    one of this group's segments). Names are checked, never opened: the segment read is the
    one rank 0 published in the group's store."""
    try:
        nonce, _, _ = weight_shm.parse_segment_name(named)
    except ValueError as e:
        return f"shm_segment: {e}"
    reader = g.same_node.reader
    if reader is None:
        return (
            f"shm_segment {named!r}: this engine receives the group's buckets over the wire, "
            "not through shared memory (it is not on rank 0's node, or the path is off)"
        )
    if nonce != reader.offer.nonce:
        return f"shm_segment {named!r} is not a segment of this weight group"
    return None


def _segment_mismatch(named: str, rx: Received) -> str:
    """Why a bucket whose call named segment `named` is refused."""
    if rx.segment is None:
        return (
            f"the call names shared-memory segment {named!r}, but this engine receives the "
            "group's buckets over the wire"
        )
    return (
        f"the call names shared-memory segment {named!r}, but rank 0 wrote this bucket into "
        f"{rx.segment!r}"
    )


def _check_model_bucket(
    asm: CheckpointAssembler,
    got: dict[str, torch.Tensor],
    corrupted: str | None,
    nonfinite: list[str],
    weight_version: str | None,
) -> tuple[dict[str, torch.Tensor], str | None]:
    """(served parameters ready from this bucket, why it is refused or None): a corrupted
    bucket, names or shapes the served model does not have, non-finite values (`nonfinite`,
    from `weight_buckets.nonfinite_names`), or a version that ends with pieces missing."""
    if corrupted:
        return {}, (
            f"{corrupted}. No tensor of this version was applied; push the whole version again"
        )
    ready, bad = asm.add(got)
    if not bad:
        bad = nonfinite
    if not bad and weight_version is not None and asm.incomplete():
        bad = [f"the version is incomplete: {p} misses pieces" for p in asm.incomplete()]
    if not bad:
        return ready, None
    return ready, (
        f"the bucket does not fit the served model ({'; '.join(bad[:5])}); export from the "
        "same ModelSpec. No tensor of this version was applied"
    )
