"""Rollout contracts: what the data worker, the generate client and batch assembly exchange.

Owns `SegmentPayload` (what one generate segment's `GenerationResult.payload` holds between the
generate side, which writes it: the client, custom generation, scoring, the forward-only role's
annotation; and batch assembly, which reads it) and the wire codec of SGLang's
`meta_info.routed_experts` (base64 of little-endian int32, row-major
`[prompt + output - 1 - start, num_layers, topk]`), which the engine writes and the generate
client reads. The sample value types are the data worker's own (`data_worker.types`, a leaf
package), re-exported here so that every `slime_async` component names them through the
contracts; the data worker keeps payloads opaque (`Mapping[str, Any]`), one per segment in
`Sample.payloads`. A multi-turn response is one sample whose `loss_mask` marks tool output 0.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, TypedDict, cast

import numpy as np

from data_worker.types import (
    Accounting,
    Batch,
    FinishStatus,
    GenerationRequest,
    GenerationResult,
    Group,
    Prompt,
    Sample,
)


class _SegmentPayloadRequired(TypedDict):
    """The keys every generate segment's payload has (`SegmentPayload`)."""

    logprobs: list[float]
    """π_j^SGL of each new token (0.0 for tool tokens and non-finite engine values)."""
    nonfinite: list[bool]
    """The engine's log-prob of the token was NaN/inf (the token is masked out of the loss)."""
    finish: str | None
    """How the segment's last model turn ended (SGLang's `finish_reason.type`: stop, length,
    abort), None when the engine did not say."""
    prompt_len: int
    """Tokens before this segment (the prompt plus earlier segments)."""


class SegmentPayload(_SegmentPayloadRequired, total=False):
    """One generate segment's payload (a sample continued after an abort has several, in order;
    `Sample.payload` is the last): the keys above always, those below when they apply. A plain
    dict at run time: it stays in the driver's process (the data worker checkpoints prompts,
    never samples), so nothing here must survive JSON."""

    loss_mask: list[int]
    """1 = a model token (trained), 0 = tool/environment output (never trained); absent: all 1."""
    routed_experts: np.ndarray
    """int32 `[prompt + response - 1, layers, topk]`: the engine's MoE routing of the whole
    sequence (rollout routing replay, R3); absent when not asked for or not covering it."""
    reward: float
    """The sample's reward, on its last segment once scored."""
    reward_status: str
    """`RewardStatus` of that reward as a string ("ok"; anything else masks the sample)."""
    behavior_logprobs: list[float]
    """π_j^Meg of every response token (all segments; NaN where the forward-only role had no
    value), on the last segment (`--behavior-forward role`)."""


def segment_payload(payload: Mapping[str, Any]) -> SegmentPayload:
    """A `GenerationResult.payload` or one of `Sample.payloads` (the data worker types them as
    opaque mappings) as the `SegmentPayload` it is; nothing is copied or checked."""
    return cast(SegmentPayload, payload)


__all__ = [
    "Accounting",
    "Batch",
    "FinishStatus",
    "GenerationRequest",
    "GenerationResult",
    "Group",
    "Prompt",
    "Sample",
    "SegmentPayload",
    "decode_routed_experts",
    "encode_routed_experts",
    "segment_payload",
]


def encode_routed_experts(arr: np.ndarray) -> str:
    """Base64 of little-endian int32 bytes, row-major (SGLang's `meta_info.routed_experts`)."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(b64: str, *, num_layers: int, topk: int) -> np.ndarray:
    """Inverse of `encode_routed_experts`: int32 `[tokens, num_layers, topk]`."""
    flat = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    if flat.size % (num_layers * topk):
        raise ValueError(
            f"routed_experts holds {flat.size} ids, not a multiple of layers*topk={num_layers * topk}"
        )
    return flat.reshape(-1, num_layers, topk)
