"""Rollout contracts: what the data worker, the generate client and batch assembly exchange.

Owns nothing new about samples: the value types are the data worker's own (`data_worker.types`,
a leaf package), re-exported here so that every `slime_async` component names them through the
contracts. The data worker keeps `GenerationResult.payload` opaque; between the generate side
(the client, custom generation) and batch assembly it holds, per generate segment,
`PAYLOAD_KEYS`. A multi-turn response is one sample whose `loss_mask` marks tool output 0. Owns the wire codec of SGLang's `meta_info.routed_experts` (base64 of little-endian
int32, row-major `[prompt + output - 1 - start, num_layers, topk]`), which the engine writes and
the generate client reads.
"""

from __future__ import annotations

import base64

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

PAYLOAD_KEYS: dict[str, str] = {
    "logprobs": "list[float]: π_j^SGL of each new token (0.0 for tool tokens)",
    "nonfinite": "list[bool]: the engine's log-prob was NaN/inf (the token is masked)",
    "loss_mask": "list[int], optional: 1 = a model token (trained), 0 = tool/environment "
    "output (never trained); absent = all 1",
    "finish": "str | None: how the segment's last model turn ended (stop, length, abort)",
    "prompt_len": "int: tokens before this segment (prompt + earlier segments)",
    "routed_experts": "int32 [prompt + response − 1, layers, topk], optional: MoE routing of "
    "the whole sequence (rollout routing replay)",
    "reward": "float: set when the sample is scored",
    "reward_status": "str: ok / non_finite (masked)",
}
"""The per-segment payload keys (see the module docstring)."""

__all__ = [
    "PAYLOAD_KEYS",
    "Accounting",
    "Batch",
    "FinishStatus",
    "GenerationRequest",
    "GenerationResult",
    "Group",
    "Prompt",
    "Sample",
    "decode_routed_experts",
    "encode_routed_experts",
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
