"""One request's life in the engine: `Sequence` state, finish rules, weight-version spans.

Owns: `SeqStatus` (WAITING -> RUNNING -> FINISHED, and RUNNING -> WAITING on a retract),
`Sequence` (prompt, sampled tokens, log-probs, captured expert ids, finish reason) and the
stop/length/abort rules with SGLang's `finish_reason` shapes. Mutated only on the event-loop
thread (the scheduler applies model results there). Must never import the server or aiohttp.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Callable
from typing import Any

import torch

from slime_async.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    """Queued for (re)prefill."""
    RUNNING = "running"
    """Has a row in the continuous batch."""
    FINISHED = "finished"
    """Done; `finish_reason` is set and `done` is signalled."""


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class Sequence:
    """A single generation (one prompt, one sample)."""

    rid: str
    """Request id (SGLang `rid`)."""
    group_rid: str = ""
    """Request-level rid of a batch / n > 1 request ("" = same as `rid`)."""
    prompt: list[int]
    """Prompt token ids."""
    params: SamplingParams
    """Validated sampling parameters."""
    generator: torch.Generator
    """This sequence's own sampler RNG."""
    weight_version: str
    """Engine weight version at admission (first span)."""
    return_logprob: bool = False
    """Return `output_token_logprobs` / `input_token_logprobs`."""
    logprob_start_len: int = -1
    """First prompt position with an input log-prob; -1 = output tokens only."""
    return_routed_experts: bool = False
    """Capture and return expert ids."""
    routed_start: int = 0
    """`routed_experts_start_len`: first position whose expert ids are returned."""
    lora: str | None = None
    """Name of the LoRA adapter this request is served under (`lora_path`); None: the base."""
    images: Any = None
    """`engine.vision.EngineImages` of a request with `image_data`, else None."""
    status: SeqStatus = SeqStatus.WAITING
    output: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    routed: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Chunks of int32 `[n, layers, topk]`, one row per forwarded position, in order."""
    finish_reason: dict[str, Any] | None = None
    text_end: int | None = None
    """Where `text` is cut after a matched stop string (None = no cut)."""
    version_spans: list[list[Any]] = dataclasses.field(default_factory=list)
    """`[version, first output index]` per weight version this sequence lived through."""
    cache_key: str | None = None
    """SGLang's `extra_key`: the prefix-cache namespace this request reads and writes."""
    cached_tokens: int = 0
    """Tokens of the last (re)prefill reused from the prefix cache (`meta_info.cached_tokens`)."""
    kv_epoch: int | None = None
    """Weights epoch that computed all of this sequence's KV; None when it has none or it
    lived through a weight swap (mixed KV never enters the prefix cache)."""
    abort_message: str | None = None
    """Set by an abort; the scheduler finishes the sequence at the next safe point."""
    created: float = dataclasses.field(default_factory=time.monotonic)
    finished_at: float | None = None
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    updated: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.version_spans.append([self.weight_version, 0])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def prefill_tokens(self) -> list[int]:
        """Tokens a (re)prefill must forward: the prompt and every sampled token so far."""
        return self.prompt + self.output

    def note_version(self, version: str) -> None:
        """Record that tokens from now on come from `version`."""
        if self.version_spans[-1][0] == version:
            return
        if self.version_spans[-1][1] == len(self.output):
            self.version_spans[-1][0] = version
        else:
            self.version_spans.append([version, len(self.output)])

    def version_span_dicts(self) -> list[dict[str, Any]]:
        """SGLang 0.5.23 `weight_versions`: `{version, start, end}` over output indices."""
        ends = [s[1] for s in self.version_spans[1:]] + [len(self.output)]
        return [{"version": v, "start": s, "end": e} for (v, s), e in zip(self.version_spans, ends)]

    def routed_array(self) -> torch.Tensor:
        """int32 `[prompt + output - 1 - routed_start, layers, topk]` (the last token is never
        forwarded, so it has no expert ids)."""
        full = torch.cat(self.routed) if self.routed else torch.zeros(0, 0, 0, dtype=torch.int32)
        return full[self.routed_start : self.num_tokens - 1]

    def finish(self, reason: dict[str, Any]) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.finished_at = time.monotonic()
        self.done.set()
        self.updated.set()


def abort_reason(
    message: str, *, status_code: int | None = None, err_type: str | None = None
) -> dict[str, Any]:
    """SGLang `FINISH_ABORT`: no status code = a client/control abort (HTTP 200, partial output);
    a 4xx/5xx status code = an error the server reports as that HTTP status."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


def check_finish(
    seq: Sequence,
    *,
    eos_ids: frozenset[int],
    context_length: int,
    tokenizer: Any,
) -> dict[str, Any] | None:
    """Finish reason after the last sampled token, or None to keep going (SGLang's rules:
    stop token/EOS, then stop strings, then max_new_tokens / context length). As in SGLang,
    `ignore_eos` turns off `stop_token_ids` too, not stop strings."""
    p = seq.params
    tok = seq.output[-1]
    if (
        not p.ignore_eos
        and len(seq.output) >= p.min_new_tokens
        and (tok in p.stop_token_ids or tok in eos_ids)
    ):
        return {"type": "stop", "matched": tok}
    if p.stop:
        text = tokenizer.decode(seq.output, skip_special_tokens=p.skip_special_tokens)
        hits = [(text.find(s), s) for s in p.stop if s in text]
        if hits:
            pos, s = min(hits)
            seq.text_end = None if p.no_stop_trim else pos
            return {"type": "stop", "matched": s}
    if len(seq.output) >= p.max_new_tokens or seq.num_tokens >= context_length:
        return {"type": "length", "length": len(seq.output)}
    return None


async def wait_done(
    seqs: list[Sequence], client_gone: Callable[[], bool], poll_s: float = 0.5
) -> bool:
    """Wait until every sequence finished; False if `client_gone()` turned true first (the
    HTTP routes then abort the sequences and free their batch rows)."""
    all_done = asyncio.ensure_future(asyncio.gather(*(s.done.wait() for s in seqs)))
    # at shutdown the waiters are cancelled under the gather: read that outcome so asyncio
    # does not log "exception was never retrieved"
    all_done.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        while True:
            done, _ = await asyncio.wait({all_done}, timeout=poll_s)
            if done:
                return True
            if client_gone():
                return False
    finally:
        all_done.cancel()
