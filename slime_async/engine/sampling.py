"""Sampling parameters (SGLang's `sampling_params`) and the per-row sampling math.

Owns: `SamplingParams` (validated from a request dict; unknown keys are an error, like SGLang
0.5.23's contract) and `sample` (temperature, top-k, top-p, min-p, per-row seeded generators).

Log-prob convention (SGLang's default): the returned log-prob of a token is taken from the
temperature-scaled distribution `log_softmax(logits / T)` *before* top-k/top-p/min-p filtering;
the token itself is drawn from the filtered, renormalised distribution. Greedy
(`temperature < 1e-6`) picks the argmax and reports log-probs at T = 1, as SGLang does.
Must never import the server, the scheduler or aiohttp.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

GREEDY_EPS = 1e-6
MAX_STOP_STRINGS = 32


class RequestError(ValueError):
    """A malformed request: the server answers HTTP 400 with this message."""


# SGLang keys we accept only at their neutral value (the embedded engine does not implement them).
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "watermark": None,
    "beam_width": None,
}
_IGNORED = ("stream_interval", "skip_special_tokens", "spaces_between_special_tokens")
_FREE_OBJECTS = ("custom_params",)
"""Accepted as any JSON object (or null) and not used: SGLang hands `custom_params` only to a
custom logit processor, which the embedded engine refuses (slime sends it with top_p < 1)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """SGLang `sampling_params` the embedded engine implements."""

    max_new_tokens: int = 128
    """Most tokens to generate (finish_reason length when reached)."""
    temperature: float = 1.0
    """Softmax temperature; < 1e-6 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or >= vocab) keeps all."""
    min_p: float = 0.0
    """Drop tokens with p < min_p * p_max."""
    min_new_tokens: int = 0
    """Stop tokens are masked out (logit -inf) until this many tokens exist."""
    stop: tuple[str, ...] = ()
    """Stop strings (matched on decoded output text)."""
    stop_token_ids: frozenset[int] = frozenset()
    """Extra token ids that end the sequence."""
    ignore_eos: bool = False
    """Do not stop on the model's EOS ids (stop_token_ids still stop)."""
    no_stop_trim: bool = False
    """Keep the matched stop token/string in `text`."""
    n: int = 1
    """Parallel samples of one prompt."""
    sampling_seed: int | None = None
    """Seed of this request's sampler: same seed, same prompt, same model = same tokens."""
    skip_special_tokens: bool = True
    """Decode `text` without special tokens."""

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def _num(d: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    v = d.get(key)
    if v is None:
        return default
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise RequestError(f"sampling_params.{key} must be an integer, got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, int | float)):
        raise RequestError(f"sampling_params.{key} must be a number, got {v!r}")
    if kind is bool and not isinstance(v, bool):
        raise RequestError(f"sampling_params.{key} must be true or false, got {v!r}")
    try:
        return kind(v)
    except OverflowError:  # an integer too large for a float
        raise RequestError(f"sampling_params.{key}={v} is out of range") from None


SEED_LIMIT = 2**64
"""`sampling_seed` (plus n - 1 for n > 1 samples) must be below this: a torch generator seed."""


def parse_sampling_params(d: Any, *, vocab_size: int | None = None) -> SamplingParams:
    """Validate one request's `sampling_params` dict (None = defaults); raises `RequestError`.

    Every field is checked here, at admission, against the served model (`vocab_size`): a value
    that would only fail inside the shared decode step (a stop id outside the vocabulary, a seed
    torch cannot take, a NaN temperature) is a 400 for this request, never an error of its batch.
    """
    if d is None:
        return SamplingParams()
    if not isinstance(d, dict):
        raise RequestError(f"sampling_params must be an object, got {type(d).__name__}")
    _check_keys(d)
    stop, sti = _stops(d, vocab_size)
    p = SamplingParams(
        max_new_tokens=_num(d, "max_new_tokens", int, 128),
        temperature=_num(d, "temperature", float, 1.0),
        top_p=_num(d, "top_p", float, 1.0),
        top_k=_num(d, "top_k", int, -1),
        min_p=_num(d, "min_p", float, 0.0),
        min_new_tokens=_num(d, "min_new_tokens", int, 0),
        stop=stop,
        stop_token_ids=sti,
        ignore_eos=_num(d, "ignore_eos", bool, False),
        no_stop_trim=_num(d, "no_stop_trim", bool, False),
        n=_num(d, "n", int, 1),
        sampling_seed=_num(d, "sampling_seed", int, None),
        skip_special_tokens=_num(d, "skip_special_tokens", bool, True),
    )
    _check_ranges(p, d)
    return p


def _check_keys(d: dict[str, Any]) -> None:
    """Unknown keys, and the unimplemented ones at anything but their neutral value, are
    refused; `_FREE_OBJECTS` must be objects."""
    known = {f.name for f in dataclasses.fields(SamplingParams)} | set(_NEUTRAL) | set(_IGNORED)
    known |= set(_FREE_OBJECTS)
    unknown = sorted(set(d) - known)
    if unknown:
        raise RequestError(
            f"unknown sampling_params keys {unknown}; see SGLang's SamplingParams for valid keys"
        )
    for key, neutral in _NEUTRAL.items():
        v = d.get(key)
        if v is not None and v != neutral:
            raise RequestError(
                f"sampling_params.{key}={v!r} is not supported by the embedded engine "
                f"(leave it unset or {neutral!r})"
            )
    for key in _FREE_OBJECTS:
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise RequestError(
                f"sampling_params.{key} must be a JSON object, got {type(d[key]).__name__}"
            )


def _stops(d: dict[str, Any], vocab_size: int | None) -> tuple[tuple[str, ...], frozenset[int]]:
    """(`stop` strings, `stop_token_ids`), checked (ids inside the vocabulary when known)."""
    stop = d.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("sampling_params.stop must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"sampling_params.stop has {len(stop)} strings; at most 32 allowed")
    sti = d.get("stop_token_ids") or []
    if not isinstance(sti, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in sti
    ):
        raise RequestError("sampling_params.stop_token_ids must be a list of integers")
    if vocab_size is not None and (bad := [t for t in sti if not 0 <= t < vocab_size]):
        raise RequestError(
            f"sampling_params.stop_token_ids holds {bad[0]!r}, outside the vocabulary; token ids "
            f"must be integers in [0, {vocab_size})"
        )
    return tuple(stop), frozenset(sti)


def _check_ranges(p: SamplingParams, d: dict[str, Any]) -> None:
    """Each value inside the range the sampler (and torch's generator seed) can take."""
    if p.max_new_tokens < 0:
        raise RequestError(f"sampling_params.max_new_tokens must be >= 0, got {p.max_new_tokens}")
    for key in ("temperature", "top_p", "min_p"):
        if not math.isfinite(getattr(p, key)):
            raise RequestError(f"sampling_params.{key} must be a finite number, got {d[key]!r}")
    if p.temperature < 0:
        raise RequestError(f"sampling_params.temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise RequestError(f"sampling_params.top_k must be -1 or >= 1, got {p.top_k}")
    if not 0 <= p.min_p <= 1:
        raise RequestError(f"sampling_params.min_p must be in [0, 1], got {p.min_p}")
    if p.min_new_tokens < 0 or p.min_new_tokens > p.max_new_tokens:
        raise RequestError(
            f"sampling_params.min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}"
        )
    if not 1 <= p.n <= 1024:
        raise RequestError(f"sampling_params.n must be in [1, 1024], got {p.n}")
    if p.sampling_seed is not None and not 0 <= p.sampling_seed <= SEED_LIMIT - p.n:
        raise RequestError(
            f"sampling_params.sampling_seed must be in [0, 2^64 - n] (n = {p.n} samples use "
            f"seeds seed..seed+n-1), got {p.sampling_seed}"
        )


def _filter(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero out tokens removed by top-k / top-p / min-p (one row `[V]`)."""
    v = probs.shape[-1]
    if 0 < params.top_k < v:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop = (sorted_p.cumsum(0) - sorted_p) >= params.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    *,
    banned: list[frozenset[int]] | None = None,
) -> tuple[list[int], list[float]]:
    """Draw one token per row of `logits [B, V]` (fp32); returns `(tokens, logprobs)`.

    `banned[i]`: ids masked to -inf for row i before anything else (min_new_tokens). Sampled rows
    draw from their own generator only (an exponential race `argmax p / E`, `E = -log U`), so a
    row's draw does not depend on the other rows of the batch.
    """
    if banned is not None and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    lp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = lp.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long)
        probs = (lp if len(rows) == len(params) else lp.index_select(0, idx)).exp()
        for j, i in enumerate(rows):
            p = params[i]
            if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                probs[j] = _filter(probs[j], p)
        v = logits.shape[-1]
        noise = torch.stack(
            [torch.rand(v, generator=generators[i], dtype=torch.float32) for i in rows]
        )
        tokens[idx] = (probs / -torch.log(noise)).argmax(dim=-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def prompt_logprobs(logits: torch.Tensor, targets: list[int], temperature: float) -> list[float]:
    """log p(targets[j]) under row j of prompt logits `[n, V]` (the positions before them)."""
    t = 1.0 if temperature < GREEDY_EPS else temperature
    lp = torch.log_softmax(logits / t, dim=-1)
    tgt = torch.tensor(targets, dtype=torch.long)[:, None]
    return lp.gather(1, tgt)[:, 0].tolist()
