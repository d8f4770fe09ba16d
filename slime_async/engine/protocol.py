"""SGLang `/generate` wire format: request parsing/validation and response building.

Owns: `parse_generate` (SGLang `GenerateReqInput`: single or batch `input_ids`/`text`, per-item
or shared `sampling_params`, `rid`, `return_logprob`, `logprob_start_len`,
`return_routed_experts`, `routed_experts_start_len`, `n` > 1, `image_data` (strings per input,
decoded later by `engine.vision`); unknown top-level keys ignored,
unknown sampling keys rejected), `response_item` (`text`, `output_ids`, `meta_info` with
`finish_reason`, token counts, `[logprob, id, text|null]` lists, `weight_version(s)`,
`e2e_latency`, base64 int32 `routed_experts`: the codec is a contract, in
`slime_async.contracts.rollout`).
Must never import the server, the scheduler or torch model code.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from slime_async.contracts.rollout import encode_routed_experts
from slime_async.engine.sampling import RequestError, SamplingParams, parse_sampling_params
from slime_async.engine.sequence import SeqStatus, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GenerateItem:
    """One prompt x one sample of a `/generate` call."""

    rid: str
    """Request id of this item."""
    group_rid: str
    """The request-level `rid` (what `/abort_request` may name to abort every item)."""
    prompt: list[int]
    """Prompt token ids."""
    params: SamplingParams
    """Sampling parameters (sampling_seed already offset for n > 1)."""
    return_logprob: bool
    """Return log-prob lists."""
    logprob_start_len: int
    """First prompt position with an input log-prob (-1: outputs only)."""
    return_text_in_logprobs: bool
    """Fill the text slot of log-prob entries."""
    return_routed_experts: bool
    """Return `meta_info.routed_experts`."""
    routed_start: int
    """`routed_experts_start_len`."""
    lora: str | None = None
    """`lora_path`: the loaded adapter this item is served under (None: the base)."""
    extra_key: str | None = None
    """SGLang's `extra_key`: only requests with the same key share cached prefixes."""
    images: Any = None
    """`engine.vision.EngineImages` (set by `with_images`), or None."""
    image_data: tuple[str, ...] = ()
    """This input's `image_data` strings, until `with_images` decodes them."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GenerateRequest:
    """A parsed `/generate` body."""

    items: list[GenerateItem]
    """Every sequence to generate, in response order."""
    batch: bool
    """Answer with a JSON list (batch input or n > 1)."""
    stream: bool
    """Server-sent events instead of one JSON body."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelLimits:
    """What request validation needs to know about the served model."""

    vocab_size: int
    context_length: int
    moe: bool
    routed_experts_enabled: bool
    routed_experts_by_default: bool = False
    lora_names: frozenset[str] | None = None
    """Adapters `lora_path` may name; None: the engine serves no LoRA (--enable-lora off)."""
    allow_auto_truncate: bool = False
    """SGLang's `--allow-auto-truncate`: cut what does not fit instead of a 400."""


_UNSUPPORTED = (
    "input_embeds",
    "video_data",
    "audio_data",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_hidden_states",
    "custom_logit_processor",
    "session_params",
)


def _per_item(body: dict[str, Any], key: str, n: int, default: Any) -> list[Any]:
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, list):
        if len(v) != n:
            raise RequestError(f"{key} is a list of {len(v)} entries but the batch has {n} inputs")
        return v
    return [v] * n


def _check_ids(ids: Any, limits: ModelLimits, where: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{where} must be a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise RequestError(
                f"{where} holds {t!r}; token ids must be integers in [0, {limits.vocab_size})"
            )
    if len(ids) >= limits.context_length and not limits.allow_auto_truncate:
        raise RequestError(
            f"{where} has {len(ids)} tokens; the engine's context length is "
            f"{limits.context_length} (prompt must be shorter)"
        )
    return ids


def _fit_context(
    prompt: list[int],
    params: SamplingParams,
    asked: Any,
    limits: ModelLimits,
    *,
    where: str,
) -> SamplingParams:
    """SGLang's total-length rule: prompt + `max_new_tokens` (when the request sets it) must
    fit the context length, else a 400 naming both numbers; with `allow_auto_truncate` the
    prompt is cut (in place) to leave room and `max_new_tokens` is lowered to what is left."""
    ctx = limits.context_length
    if limits.allow_auto_truncate and len(prompt) >= ctx:
        keep = min(ctx - 1, max(1, ctx - (params.max_new_tokens if asked is not None else 1)))
        del prompt[keep:]
    if asked is None or len(prompt) + params.max_new_tokens <= ctx:
        return params
    if limits.allow_auto_truncate:
        left = ctx - len(prompt)
        return dataclasses.replace(
            params, max_new_tokens=left, min_new_tokens=min(params.min_new_tokens, left)
        )
    raise RequestError(
        f"{where} asks for {len(prompt)} prompt tokens + max_new_tokens "
        f"{params.max_new_tokens} = {len(prompt) + params.max_new_tokens} tokens, over the "
        f"engine's context length of {ctx}: lower max_new_tokens to at most "
        f"{ctx - len(prompt)} or shorten the prompt (or start the engine with "
        "--allow-auto-truncate to have it lowered)"
    )


def _flag(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false, got {v!r}")
    return v


def _int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{key} must be an integer, got {v!r}")
    return v


def _lora_name(v: Any, limits: ModelLimits) -> str | None:
    """A `lora_path` entry: None (the base) or the name of a loaded adapter."""
    if v is None:
        return None
    if limits.lora_names is None:
        raise RequestError(
            "lora_path needs an engine started with --enable-lora; leave it unset for the base"
        )
    if not isinstance(v, str) or v not in limits.lora_names:
        raise RequestError(
            f"lora_path {v!r} names no loaded adapter (loaded: {sorted(limits.lora_names)}); "
            "load it with /load_lora_adapter first"
        )
    return v


def parse_generate(body: Any, *, tokenizer: Any, limits: ModelLimits) -> GenerateRequest:
    """Validate a `/generate` JSON body; raises `RequestError` (-> HTTP 400) naming the problem."""
    if not isinstance(body, dict):
        raise RequestError("the /generate body must be a JSON object")
    prompts, is_batch = _prompts(body, tokenizer=tokenizer, limits=limits)
    n_in = len(prompts)
    sps = _sampling_per_input(body, prompts, limits)
    rlp = _per_item(body, "return_logprob", n_in, False)
    lsl = _per_item(body, "logprob_start_len", n_in, -1)
    rre = _per_item(body, "return_routed_experts", n_in, limits.routed_experts_by_default)
    rsl = _per_item(body, "routed_experts_start_len", n_in, 0)
    loras = [_lora_name(v, limits) for v in _per_item(body, "lora_path", n_in, None)]
    eks = _per_item(body, "extra_key", n_in, None)
    imgs = parse_image_data(body.get("image_data"), n_in, batch=is_batch)
    if not all(k is None or isinstance(k, str) for k in eks):
        raise RequestError("extra_key must be a string (or a list of strings, one per input)")
    rtl = _flag(body.get("return_text_in_logprobs") or False, "return_text_in_logprobs")
    stream = _flag(body.get("stream") or False, "stream")
    rids, base = _request_ids(body.get("rid"), n_in)
    items: list[GenerateItem] = []
    for i, prompt in enumerate(prompts):
        p = sps[i]
        start, want_re, rstart = _offsets(prompt, lsl[i], rre[i], rsl[i], limits)
        group = str(rids[i] if rids is not None else base)
        for j in range(p.n):
            seed = None if p.sampling_seed is None else p.sampling_seed + j
            items.append(
                GenerateItem(
                    rid=_item_rid(group, listed=rids is not None, i=i, j=j, n_in=n_in, n=p.n),
                    group_rid=group,
                    prompt=list(prompt),
                    params=dataclasses.replace(p, sampling_seed=seed, n=1),
                    return_logprob=_flag(rlp[i], "return_logprob"),
                    logprob_start_len=start,
                    return_text_in_logprobs=rtl,
                    return_routed_experts=want_re,
                    routed_start=rstart,
                    lora=loras[i],
                    extra_key=eks[i],
                    image_data=tuple(imgs[i]),
                )
            )
    return GenerateRequest(items=items, batch=is_batch or len(items) > 1, stream=stream)


def parse_image_data(raw: Any, n_in: int, *, batch: bool) -> list[list[str]]:
    """Per input, its image strings (empty: none). A batch takes one entry per input."""
    if raw is None or raw == [] or raw == "":
        return [[] for _ in range(n_in)]
    per = raw if batch else [raw]
    if not isinstance(per, list) or len(per) != n_in:
        raise RequestError(f"image_data must have one entry per input ({n_in})")
    out = []
    for entry in per:
        items = [] if entry is None else entry if isinstance(entry, list) else [entry]
        if not all(isinstance(s, str) and s for s in items):
            raise RequestError("image_data entries must be base64 strings or data URIs")
        out.append(items)
    return out


def _prompts(
    body: dict[str, Any], *, tokenizer: Any, limits: ModelLimits
) -> tuple[list[list[int]], bool]:
    """(the prompts' token ids, whether the body is a batch) from `input_ids` or `text`."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise RequestError("send exactly one of `input_ids` or `text`")
    for key in _UNSUPPORTED:
        if body.get(key):  # the stock router sends these as false/null: only truthy is refused
            raise RequestError(f"{key} is not supported by the embedded engine; leave it unset")
    if has_ids:
        raw = body["input_ids"]
        is_batch = isinstance(raw, list) and bool(raw) and isinstance(raw[0], list)
        prompts = [
            _check_ids(p, limits, f"input_ids[{i}]" if is_batch else "input_ids")
            for i, p in enumerate(raw if is_batch else [raw])
        ]
        return prompts, is_batch
    raw = body["text"]
    is_batch = isinstance(raw, list)
    texts = raw if is_batch else [raw]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError("text must be a string or a non-empty list of strings")
    try:
        ids = [tokenizer.encode(t) for t in texts]
    except ValueError as e:
        raise RequestError(str(e)) from None
    return [_check_ids(p, limits, "text (tokenized)") for p in ids], is_batch


def _sampling_per_input(
    body: dict[str, Any], prompts: list[list[int]], limits: ModelLimits
) -> list[SamplingParams]:
    """Each input's checked `sampling_params`, fitted to the context length (`_fit_context`)."""
    n_in = len(prompts)
    raws = _per_item(body, "sampling_params", n_in, None)
    sps = [parse_sampling_params(d, vocab_size=limits.vocab_size) for d in raws]
    return [
        _fit_context(
            prompts[i],
            p,
            raw.get("max_new_tokens") if isinstance(raw, dict) else None,
            limits,
            where=f"input {i}" if n_in > 1 else "the request",
        )
        for i, (p, raw) in enumerate(zip(sps, raws))
    ]


def _request_ids(rid: Any, n_in: int) -> tuple[list[Any] | None, str]:
    """(`rid` as a list with one entry per input, or None; the request's base rid)."""
    rids = rid if isinstance(rid, list) else None
    if rids is not None and len(rids) != n_in:
        raise RequestError(f"rid is a list of {len(rids)} entries but the batch has {n_in} inputs")
    base = rid if isinstance(rid, str) else uuid.uuid4().hex
    if rid is not None and not isinstance(rid, str | list):
        raise RequestError("rid must be a string or a list of strings")
    return rids, base


def _item_rid(group: str, *, listed: bool, i: int, j: int, n_in: int, n: int) -> str:
    """Sample `j` of input `i`: `group` itself when it names one sample (a listed rid, or a
    single input), else `group_i` (inputs of one rid) or `group_j` (samples of one input)."""
    if n > 1:
        return f"{group}_{j}"
    return group if listed or n_in == 1 else f"{group}_{i}"


def _offsets(
    prompt: list[int], lsl: Any, rre: Any, rsl: Any, limits: ModelLimits
) -> tuple[int, bool, int]:
    """(`logprob_start_len`, `return_routed_experts`, `routed_experts_start_len`) of one input,
    checked against its prompt and the engine."""
    start = _int(lsl, "logprob_start_len")
    if not -1 <= start <= len(prompt):
        raise RequestError(
            f"logprob_start_len={start} is outside [-1, {len(prompt)}] (prompt length)"
        )
    want_re = _flag(rre, "return_routed_experts")
    rstart = _int(rsl, "routed_experts_start_len")
    if want_re and not (limits.moe and limits.routed_experts_enabled):
        raise RequestError(
            "return_routed_experts needs an MoE model and an engine started with routed "
            "experts enabled (--disable-return-routed-experts not set)"
        )
    if not 0 <= rstart <= len(prompt):
        raise RequestError(
            f"routed_experts_start_len={rstart} is outside [0, {len(prompt)}] (prompt length)"
        )
    return start, want_re, rstart


# ---------------------------------------------------------------------------- responses
def _text_ids(seq: Sequence) -> list[int]:
    reason = seq.finish_reason or {}
    if (
        reason.get("type") == "stop"
        and isinstance(reason.get("matched"), int)
        and not seq.params.no_stop_trim
    ):
        return seq.output[:-1]
    return seq.output


def response_item(
    seq: Sequence,
    *,
    tokenizer: Any,
    return_text_in_logprobs: bool = False,
    index: int | None = None,
    skip_special_tokens: bool | None = None,
) -> dict[str, Any]:
    """SGLang's response object for one sequence (cumulative; final when finished); its text
    without special tokens as the request says, unless `skip_special_tokens` overrides it."""
    skip = seq.params.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
    text = tokenizer.decode(_text_ids(seq), skip_special_tokens=skip)
    if seq.text_end is not None:
        text = text[: seq.text_end]
    finished = seq.status is SeqStatus.FINISHED
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason if finished else None,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output),
        "cached_tokens": seq.cached_tokens,
        "weight_version": seq.version_spans[-1][0],
        "weight_versions": seq.version_span_dicts(),
    }

    def tok_text(t: int) -> str | None:
        return tokenizer.decode([t]) if return_text_in_logprobs else None

    if seq.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, tok_text(t)] for lp, t in zip(seq.output_logprobs, seq.output)
        ]
        start = max(seq.logprob_start_len, 0) if seq.logprob_start_len >= 0 else len(seq.prompt)
        lps = seq.input_logprobs or []
        meta["input_token_logprobs"] = [
            [lp, t, tok_text(t)] for lp, t in zip(lps, seq.prompt[start:])
        ]
    if finished:
        meta["e2e_latency"] = (seq.finished_at or time.monotonic()) - seq.created
        if seq.return_routed_experts:
            meta["routed_experts"] = encode_routed_experts(seq.routed_array().numpy())
    out: dict[str, Any] = {"text": text, "output_ids": list(seq.output), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out
