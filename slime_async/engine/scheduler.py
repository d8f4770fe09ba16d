"""Iteration-level (continuous) batching: one asyncio task drives model steps in a worker thread.

Owns: `Scheduler` — the FIFO waiting queue, the running batch and its `KVBatch`, admission
(at most `max_running_requests` rows, `max_prefill_tokens` per prefill), the step loop
(prefill newcomers, then one decode step for every running row; finished rows leave before the
next step), aborts, pause/continue (abort / in_place / retract) and exclusive access for weight
swaps. Torch work runs in a single worker thread; all `Sequence` state changes on the loop thread.
One responsibility over 400 lines, on purpose: the batch state (queue, prefilling and running
rows, their KV, the prefix-cache epoch) has a single owner, and every change to it (loop-thread
bookkeeping, worker-thread jobs) reads as one class.

Worked example (max_running_requests=2): A and B arrive -> step 1 prefills A,B and decodes both;
C arrives while step 1 runs and waits; A finishes at step 3 and leaves; step 4 prefills C and
decodes B,C together. No request ever waits for the whole batch to drain.
Must never import the server or aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from slime_async.engine import batch
from slime_async.engine.config import EngineConfig
from slime_async.engine.model import LoadedModel
from slime_async.engine.prefix_cache import MISS, PrefixCache
from slime_async.engine.sampling import prompt_logprobs, sample
from slime_async.engine.sequence import SeqStatus, Sequence, abort_reason, check_finish
from slime_async.host import trim_heap

T = TypeVar("T")


class PauseMode(enum.Enum):
    ABORT = "abort"
    """Finish every in-flight request with finish_reason abort (partial output returned)."""
    IN_PLACE = "in_place"
    """Freeze running requests with their KV cache; they resume on continue."""
    RETRACT = "retract"
    """Drop running requests' KV cache and requeue them; they are re-prefilled on continue."""


class Scheduler:
    """Runs the continuous batch. Create on the event loop that serves requests, then
    `start()`; `submit()` sequences and await `seq.done`."""

    def __init__(self, lm: LoadedModel, cfg: EngineConfig, *, version: Callable[[], str]) -> None:
        self.lm, self.cfg, self._version = lm, cfg, version
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.kv: batch.KVBatch | None = None
        self.paused = False
        self.steps = 0
        self._trimmed_at = 0
        """`steps` when the heap was last trimmed: the loop trims once each time it goes idle
        (no request queued or running, or paused) after stepping, so the freed KV, logits and
        prefill tensors of a burst go back to the node instead of staying in glibc's heap
        (measured: +170 MiB resident after a burst of 64 requests on the tiny model, kept
        until the process ends). Never between two steps of a burst."""
        self.decoded_tokens = 0
        self.outputs = 0
        """Tokens produced for any sequence (prefill's first tokens and decode's): what
        `/health_generate` watches, as SGLang's watches any output of its scheduler."""
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._task: asyncio.Task[None] | None = None
        self._in_step = False
        self._prefilling: list[Sequence] = []
        """Admitted, prefill in flight: in neither `waiting` nor `running` yet."""
        self.epoch = 0
        """Weights epoch: +1 on every weight swap (the prefix cache's per-version key)."""
        self.cache: PrefixCache | None = (
            None
            if cfg.disable_radix_cache
            else PrefixCache(max_tokens=cfg.prefix_cache_tokens, policy=cfg.prefix_cache_policy)
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-scheduler")

    async def close(self) -> None:
        self.abort(abort_all=True, message="Engine shutting down")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.shutdown(wait=True)

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run `fn` in the worker thread between steps (no forward in flight): weight swaps."""
        async with self._step_lock:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def swap_weights(self, fn: Callable[[], T]) -> T:
        """`run_exclusive(fn)` for a weight swap; if it returns, a new weights epoch starts
        before any forward can run: the prefix cache serves only KV of the new weights, and the
        sequences holding KV (running, frozen in place) keep it but never hand it to the cache."""
        async with self._step_lock:
            out = await asyncio.get_running_loop().run_in_executor(self._pool, fn)
            trim_heap()  # the incoming version's buffers, freed by the swap, back to the node
            self.epoch += 1
            for seq in [*self._prefilling, *self.running]:
                seq.kv_epoch = None
            if self.cache is not None:
                self.cache.activate(self.epoch)
            return out

    def flush_cache(self) -> int:
        """Drop the prefix cache (callers check that no request is in the engine); returns
        the tokens freed."""
        return self.cache.flush() if self.cache is not None else 0

    # ------------------------------------------------------------------ requests
    def submit(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._wake.set()

    def abort(self, *, rid: str | None = None, abort_all: bool = False, message: str) -> int:
        """Abort every request (`abort_all`) or those whose rid or request-level rid is `rid`;
        returns how many were hit."""
        hits = [
            s
            for s in [*self.waiting, *self._prefilling, *self.running]
            if abort_all or (rid is not None and rid in (s.rid, s.group_rid))
        ]
        return self.abort_seqs(hits, message)

    def abort_seqs(self, seqs: list[Sequence], message: str) -> int:
        """Finish `seqs` with finish_reason abort (partial output kept) at the next safe point."""
        hit = 0
        for seq in seqs:
            if seq.abort_message is None and seq.status is not SeqStatus.FINISHED:
                seq.abort_message = message
                hit += 1
        self._drop_aborted_waiting()
        if not self._in_step:
            self._retire()
        return hit

    async def pause(self, mode: PauseMode) -> None:
        """Stop stepping; returns once no forward is in flight (so nothing moves after it)."""
        self.paused = True
        if mode is PauseMode.ABORT:
            self.abort(abort_all=True, message="Abort by pause_generation")
        async with self._step_lock:
            if mode is PauseMode.RETRACT:
                self._retract_all()

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def note_version(self, version: str) -> None:
        for seq in [*self.waiting, *self._prefilling, *self.running]:
            seq.note_version(version)

    def held(self) -> list[Sequence]:
        """Every sequence queued, prefilling or running here."""
        return [*self.waiting, *self._prefilling, *self.running]

    def in_engine(self) -> int:
        """Requests held here: queued, prefilling, running, or frozen by a pause."""
        return len(self.waiting) + len(self._prefilling) + len(self.running)

    def load(self) -> dict[str, int]:
        """SGLang `/get_load` numbers."""
        return {
            "num_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_tokens": sum(s.num_tokens for s in self.running),
        }

    def describe(self) -> dict[str, Any]:
        """The batch state for a hang report (the test suite prints it on a timeout): the step
        loop's task, and every held sequence with how far it got."""
        task = self._task
        if task is None or not task.done():
            loop_state = "not started" if task is None else "running"
        else:
            loop_state = "cancelled" if task.cancelled() else f"ended: {task.exception()!r}"

        def row(s: Sequence) -> str:
            return (
                f"{s.rid} {s.status.name} prompt={len(s.prompt)} out={len(s.output)}"
                f"/{s.params.max_new_tokens} age={time.monotonic() - s.created:.1f}s"
                + (f" abort={s.abort_message!r}" if s.abort_message else "")
            )

        return {
            "loop": loop_state,
            "paused": self.paused,
            "in_step": self._in_step,
            "step_lock_held": self._step_lock.locked(),
            "steps": self.steps,
            "waiting": [row(s) for s in self.waiting],
            "prefilling": [row(s) for s in self._prefilling],
            "running": [row(s) for s in self.running],
        }

    # ------------------------------------------------------------------ loop
    async def _loop(self) -> None:
        while True:
            if self.paused or not (self.waiting or self.running):
                if self._trimmed_at != self.steps:  # idle after steps: their heap goes back
                    self._trimmed_at = self.steps
                    await asyncio.get_running_loop().run_in_executor(self._pool, trim_heap)
                    continue  # a request may have come meanwhile: look again before waiting
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                try:
                    await self._step()
                except Exception as e:  # a broken step must not hang clients: fail them loudly
                    self._fail_step(f"engine step failed: {type(e).__name__}: {e}")
            await asyncio.sleep(0)

    def _admit(self) -> list[Sequence]:
        """FIFO admission while `max_prefill_tokens` lasts, counting the tokens a prefill will
        forward (as SGLang counts extend tokens): a prompt found in the prefix cache, or
        repeating one admitted in this step, costs only what is not cached."""
        out: list[Sequence] = []
        budget = self.cfg.max_prefill_tokens
        seen: set[tuple[Any, ...]] = set()
        while self.waiting and len(self.running) + len(out) < self.cfg.max_running_requests:
            seq = self.waiting[0]
            n = seq.num_tokens
            if self.cache is not None:
                key = (seq.cache_key, *seq.prefill_tokens())
                cached = n - 1 if key in seen else self.cache.peek(key[1:], seq.cache_key)
                n -= min(cached, n - 1)
                seen.add(key)
            if out and n > budget:
                break
            out.append(self.waiting.popleft())
            budget -= n
        return out

    def _fail_step(self, message: str) -> None:
        """Finish every request the failed step touched (the batch cache may be half-updated);
        waiting requests stay queued."""
        self._in_step = False
        for seq in [*self._prefilling, *self.running]:
            if seq.status is not SeqStatus.FINISHED:
                seq.finish(abort_reason(message, status_code=500, err_type="InternalServerError"))
        self._prefilling, self.running, self.kv = [], [], None

    async def _step(self) -> None:
        loop = asyncio.get_running_loop()
        new = self._admit()
        self._in_step = True
        if new:
            self._prefilling = new
            # samples of one prompt (n > 1, a GRPO group) admitted together: the first is
            # prefilled alone so the others reuse its prompt's KV from the prefix cache
            first, rest = _split_repeats(new) if self.cache is not None else (new, [])
            done = await self._prefill_isolated(first)
            if rest:
                done += await self._prefill_isolated(rest)
            for seqs, result in done:
                self._apply_prefill(seqs, *result)
            # cleared only once every admitted row is in `running` (or finished): if applying
            # a prefill raises, `_fail_step` still finds the rows not yet moved and answers them
            self._prefilling = []
            self._retire()
        if self.running and self.kv is not None and not self.paused:
            # a failing batched forward is an engine fault (all rows fail: _fail_step); a row
            # whose own sampling fails is finished alone and the others go on
            toks, lps, routed, failed = await loop.run_in_executor(self._pool, self._decode_job)
            for i, seq in enumerate(self.running):
                if i in failed:
                    _fail_alone(seq, failed[i])
                    continue
                if routed is not None and seq.return_routed_experts:
                    seq.routed.append(routed[i : i + 1])
                self._append(seq, toks[i], lps[i])
            self.decoded_tokens += len(toks) - len(failed)
        self.steps += 1
        self._in_step = False
        self._retire()

    async def _prefill_isolated(self, new: list[Sequence]) -> list[tuple[list[Sequence], Any]]:
        """Prefill `new` together; if the batched prefill raises, once more one sequence at a
        time, so only the sequences that fail on their own are finished (with a 500). Prefill
        builds its own cache, so the running batch is never touched by a failed prefill."""
        loop = asyncio.get_running_loop()
        try:
            return [(new, await loop.run_in_executor(self._pool, self._prefill_job, new))]
        except Exception as e:
            if len(new) == 1:
                seq = new[0]
                seq.finish(
                    abort_reason(
                        f"engine prefill failed: {type(e).__name__}: {e}",
                        status_code=500,
                        err_type="InternalServerError",
                    )
                )
                return []
        out = []
        for seq in new:
            out += await self._prefill_isolated([seq])
        return out

    # ------------------------------------------------------------------ worker-thread jobs
    def _sample_rows(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[float], dict[int, str]]:
        """One token per row of `logits [B, V]`; returns `(tokens, logprobs, failed)` where
        `failed` maps a row whose own sampling raised to the reason (its token is a
        placeholder). Rows are checked before any generator draws, so a bad row never shifts
        another row's random stream; an unexpected failure retries row by row."""
        n, v = logits.shape
        banned = [self._banned(s) for s in seqs]
        failed = {
            i: f"stop_token_ids {sorted(b)[:3]} outside the vocabulary [0, {v})"
            for i, b in enumerate(banned)
            if b and not all(0 <= t < v for t in b)
        }
        ok = [i for i in range(n) if i not in failed]
        toks, lps = [0] * n, [0.0] * n
        if not ok:
            return toks, lps, failed
        sub = logits if len(ok) == n else logits.index_select(0, torch.tensor(ok))
        try:
            t, lp = sample(
                sub,
                [seqs[i].params for i in ok],
                [seqs[i].generator for i in ok],
                banned=[banned[i] for i in ok],
            )
            for j, i in enumerate(ok):
                toks[i], lps[i] = t[j], lp[j]
        except Exception:
            for i in ok:
                try:
                    (toks[i],), (lps[i],) = sample(
                        logits[i : i + 1],
                        [seqs[i].params],
                        [seqs[i].generator],
                        banned=[banned[i]],
                    )
                except Exception as e:
                    failed[i] = f"{type(e).__name__}: {e}"
        return toks, lps, failed

    def _banned(self, seq: Sequence) -> frozenset[int]:
        """Ids row `seq` may not sample: stop/EOS ids before min_new_tokens, and a VL model's
        vision tokens always (a placeholder is an image's slot, never an answer)."""
        p, always = seq.params, self._vision_ids
        if len(seq.output) >= p.min_new_tokens:
            return always
        return always | p.stop_token_ids | (frozenset() if p.ignore_eos else self.lm.eos_token_ids)

    @functools.cached_property
    def _vision_ids(self) -> frozenset[int]:
        v = self.lm.vision
        if v is None:
            return frozenset()
        return frozenset(
            (v.image_token_id, v.video_token_id, v.vision_start_token_id, v.vision_end_token_id)
        )

    def _prefill_job(self, seqs: list[Sequence]) -> tuple[Any, ...]:
        want_in = [s.return_logprob and s.logprob_start_len >= 0 and not s.output for s in seqs]
        tokens = [s.prefill_tokens() for s in seqs]
        capture = any(s.return_routed_experts for s in seqs)
        hits = [self._lookup(s, t, w) for s, t, w in zip(seqs, tokens, want_in)]
        # the first position whose logits give a prompt log-prob asked for (token
        # logprob_start_len is read at the position before it; never inside the reused prefix)
        starts = [
            max(s.logprob_start_len - 1, h.length, 0) if w else None
            for s, h, w in zip(seqs, hits, want_in)
        ]
        with self._adapters(seqs):
            out = batch.prefill(
                self.lm,
                tokens,
                prompt_logits_from=starts,
                capture=capture,
                past=[h.kv for h in hits] if any(h.length for h in hits) else None,
                images=[s.images for s in seqs] if self.lm.vision is not None else None,
            )
        if out.routed is not None:  # expert ids of reused tokens come from the cache
            out.routed = [
                torch.cat([h.routed, r]) if h.length and h.routed is not None else r
                for h, r in zip(hits, out.routed)
            ]
        if self.cache is not None:
            for i, t in enumerate(tokens):
                self.cache.insert(
                    t,
                    batch.row_kv(out.kv, i, len(t)),
                    epoch=self.epoch,
                    namespace=seqs[i].cache_key,
                    routed=_full(out.routed, i, len(t)),
                )
        toks, lps, failed = self._sample_rows(out.last_logits, seqs)
        in_lps: list[list[float] | None] = [None] * len(seqs)
        for i, s in enumerate(seqs):
            if want_in[i] and i not in failed:
                try:  # logits of positions a.. give the log-probs of tokens a+1..
                    a = starts[i]
                    assert a is not None
                    in_lps[i] = (
                        [None] * a
                        + prompt_logprobs(  # type: ignore[operator]
                            out.prompt_logits[i], s.prompt[a + 1 :], s.params.temperature
                        )
                    )
                except Exception as e:
                    failed[i] = f"{type(e).__name__}: {e}"
        return out, in_lps, toks, lps, failed, [h.length for h in hits]

    def _lookup(self, seq: Sequence, tokens: list[int], want_in: bool) -> Any:
        """The prefix cache's longest reusable prefix for `seq`: never its last token (its
        logits start the output), never a position whose input log-prob it asked for, and
        with expert ids stored wherever it asked for them."""
        if self.cache is None:
            return MISS
        limit = len(tokens) - 1
        if want_in:
            limit = min(limit, seq.logprob_start_len - 1)
        return self.cache.match(
            tokens, limit=limit, need_routed=seq.return_routed_experts, namespace=seq.cache_key
        )

    def _adapters(self, seqs: list[Sequence]) -> contextlib.AbstractContextManager[None]:
        """Row i of the next forward under `seqs[i]`'s LoRA adapter (engine/lora.py)."""
        if self.lm.lora is None:
            return contextlib.nullcontext()
        return self.lm.lora.applied([s.lora for s in seqs])

    def _decode_job(self) -> tuple[list[int], list[float], torch.Tensor | None, dict[int, str]]:
        assert self.kv is not None
        capture = any(s.return_routed_experts for s in self.running)
        with self._adapters(self.running):
            logits, routed = batch.decode(
                self.lm, self.kv, [s.output[-1] for s in self.running], capture=capture
            )
        toks, lps, failed = self._sample_rows(logits, self.running)
        return toks, lps, routed, failed

    # ------------------------------------------------------------------ loop-thread bookkeeping
    def _apply_prefill(
        self,
        seqs: list[Sequence],
        out: batch.PrefillOut,
        in_lps: list[list[float] | None],
        toks: list[int],
        lps: list[float],
        failed: dict[int, str],
        cached: list[int],
    ) -> None:
        self.kv = batch.merge(self.kv, out.kv)
        for i, seq in enumerate(seqs):
            seq.status = SeqStatus.RUNNING
            seq.cached_tokens, seq.kv_epoch = cached[i], self.epoch
            self.running.append(seq)  # a failed row leaves the batch at the next _retire
            if i in failed:
                _fail_alone(seq, failed[i])
                continue
            if out.routed is not None and seq.return_routed_experts:
                seq.routed = [out.routed[i]]  # a re-prefill re-records every position
            if in_lps[i] is not None:
                seq.input_logprobs = ([None, *in_lps[i]])[seq.logprob_start_len :]
            if seq.params.max_new_tokens == 0:
                seq.finish({"type": "length", "length": 0})
                continue
            self._append(seq, toks[i], lps[i])

    def _append(self, seq: Sequence, tok: int, lp: float) -> None:
        if seq.status is not SeqStatus.RUNNING:
            return
        self.outputs += 1
        seq.output.append(tok)
        seq.output_logprobs.append(lp)
        try:
            reason = check_finish(
                seq,
                eos_ids=self.lm.eos_token_ids,
                context_length=self.lm.context_length,
                tokenizer=self.lm.tokenizer,
            )
        except Exception as e:  # e.g. the tokenizer cannot decode this output: this row only
            seq.finish(
                abort_reason(
                    f"checking the stop rules failed: {type(e).__name__}: {e}",
                    status_code=500,
                    err_type="InternalServerError",
                )
            )
            return
        if reason is not None:
            seq.finish(reason)
        else:
            seq.updated.set()

    def _drop_aborted_waiting(self) -> None:
        keep: collections.deque[Sequence] = collections.deque()
        for seq in self.waiting:
            if seq.abort_message is not None:
                seq.finish(abort_reason(seq.abort_message))
            else:
                keep.append(seq)
        self.waiting = keep

    def _retire(self) -> None:
        """Remove finished/aborted rows from the batch (loop thread, no step in flight)."""
        for seq in self.running:
            if seq.abort_message is not None and seq.status is not SeqStatus.FINISHED:
                seq.finish(abort_reason(seq.abort_message))
        keep = [i for i, s in enumerate(self.running) if s.status is not SeqStatus.FINISHED]
        if len(keep) != len(self.running):
            self._cache_finished(keep)
            self.kv = batch.select(self.kv, keep) if self.kv is not None else None
            self.running = [self.running[i] for i in keep]
        self._drop_aborted_waiting()

    def _cache_finished(self, keep: list[int]) -> None:
        """Hand the KV of rows leaving the batch (prompt and output, all but the last token) to
        the prefix cache, if one epoch computed all of it and that epoch still serves."""
        if self.cache is None or self.kv is None:
            return
        lengths = self.kv.lengths().tolist()
        for i, seq in enumerate(self.running):
            if i in keep or seq.kv_epoch != self.epoch or lengths[i] <= len(seq.prompt):
                continue
            tokens = seq.prefill_tokens()[: lengths[i]]
            routed = torch.cat(seq.routed) if seq.return_routed_experts and seq.routed else None
            self.cache.insert(
                tokens,
                batch.row_kv(self.kv, i, len(tokens)),
                epoch=seq.kv_epoch,
                namespace=seq.cache_key,
                routed=routed if routed is not None and len(routed) == len(tokens) else None,
            )

    def _retract_all(self) -> None:
        for seq in reversed(self.running):
            seq.status = SeqStatus.WAITING
            seq.kv_epoch = None
            self.waiting.appendleft(seq)
        self.running, self.kv = [], None


def _full(routed: list[torch.Tensor] | None, i: int, n: int) -> torch.Tensor | None:
    """Row `i`'s expert ids if they cover all its `n` tokens (else the cache stores none)."""
    return routed[i] if routed is not None and len(routed[i]) == n else None


def _split_repeats(seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """`(first, rest)`: `rest` holds the sequences whose tokens repeat an earlier one's."""
    seen: set[tuple[int, ...]] = set()
    first, rest = [], []
    for s in seqs:
        key = (s.cache_key, *s.prefill_tokens())
        (rest if key in seen and len(key) > 2 else first).append(s)
        seen.add(key)
    return first, rest


def _fail_alone(seq: Sequence, why: str) -> None:
    """Finish one row whose own sampling failed: a 400 for its request (what failed depends only
    on that request's parameters); the rest of the batch is unaffected."""
    if seq.status is not SeqStatus.FINISHED:
        seq.finish(
            abort_reason(
                f"this request failed in its own sampling step ({why}); check its sampling_params",
                status_code=400,
                err_type="BadRequestError",
            )
        )
