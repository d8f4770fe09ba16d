"""MoE routing replay (R2 and R3) on top of megatron-core's `RouterReplay`.

Owns: turning engine routing (`[T−1, L, K]` per sample) into the per-layer, per-rank index
tensors megatron replays (placed like the micro-batch's tokens: padded rows or one packed
row), and a hook that captures the routing a forward actually used (for tests and
diagnostics). Setting replay/record actions per micro-batch is the schedule's forward step
(`schedule.py`). Must never import the controller, engine,
rollout or data-worker parts of `slime_async`.

Modes:
* R2: the first trainer forward of a step (π_k, no grad) RECORDs its top-k per micro-batch;
  later forwards of that step (π_j snapshot, π_θ training) REPLAY it, so all three log-probs
  of a step use one routing.
* R3: every trainer forward REPLAYs the engine's routing, so π_θ/π_k/π_j^Meg use exactly the
  experts the rollout engine used when it sampled.

Token order inside megatron's router is sequence-major: token (s, b) is row `s * B + b` of the
`[S * B, K]` tensor; with sequence parallelism each TP rank sees rows of its sequence shard
only `s ∈ [r·S/tp, (r+1)·S/tp)`.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from slime_async.contracts.model import ModelSpec


class RoutingReplay(enum.Enum):
    """Which routing the trainer's forwards use."""

    NONE = "none"
    """Each forward routes with its own router (no replay)."""
    R2 = "r2"
    """Record in the step's first forward, replay in later ones."""
    R3 = "r3"
    """Replay the rollout engine's routing in every forward."""

    @property
    def replays_engine_routing(self) -> bool:
        """The engines must return their routing (`routed_experts`) for the trainer to replay
        (R3, slime's `--use-rollout-routing-replay`)."""
        return self is RoutingReplay.R3


def engine_routing_to_replay(
    routed: Sequence[np.ndarray],
    *,
    spec: ModelSpec,
    width: int,
    tp: int = 1,
    tp_rank: int = 0,
    layers: list[int] | None = None,
    starts: Sequence[tuple[int, int]] | None = None,
    rows: int | None = None,
) -> list[torch.Tensor]:
    """Per local MoE layer `[width/tp * rows, K]` int64 indices for one micro-batch.

    The model input is `[rows, width]` and sample b starts at `starts[b]` = (row, column)
    (default: one padded row per sample, `(b, 0)`; packed: all in row 0, back to back).
    `routed[b]` is `[n_b, L, K]` (the engine's `T−1` rows); missing positions (each sample's
    last token, padding) get the synthetic distinct ids `arange(K) % E` — those positions are
    never trained. Dense layers are skipped; `layers` (global indices, default all MoE layers)
    selects this rank's. Raises ValueError on bad shapes or ids outside `[0, E)`.
    """
    k, e, nl = spec.moe_topk, spec.num_experts, spec.num_layers
    if width % tp:
        raise ValueError(f"width {width} must be a multiple of tp={tp} (sequence parallel)")
    nrows = len(routed) if rows is None else rows
    places = [(b, 0) for b in range(len(routed))] if starts is None else list(starts)
    full = np.broadcast_to(np.arange(k, dtype=np.int64) % e, (nrows, width, nl, k)).copy()
    for b, arr in enumerate(routed):
        a = np.asarray(arr)
        if a.ndim != 3 or a.shape[1] != nl or a.shape[2] != k:
            raise ValueError(
                f"routed_experts[{b}] has shape {a.shape}; expected [T-1, {nl}, {k}] "
                "(all num_hidden_layers, num_experts_per_tok)"
            )
        r, c = places[b]
        if c + a.shape[0] > width:
            raise ValueError(f"routed_experts[{b}] has {a.shape[0]} rows > width {width - c}")
        if a.size and (a.min() < 0 or a.max() >= e):
            raise ValueError(f"routed_experts[{b}] holds expert ids outside [0, {e})")
        full[r, c : c + a.shape[0]] = a
    seq_major = torch.from_numpy(full).permute(1, 0, 2, 3)  # [S, R, L, K]
    shard = width // tp
    seq_major = seq_major[tp_rank * shard : (tp_rank + 1) * shard]
    flat = seq_major.reshape(shard * nrows, nl, k)
    wanted = spec.moe_layers() if layers is None else layers
    return [flat[:, layer].contiguous() for layer in wanted]


@contextlib.contextmanager
def capture_routing(model: torch.nn.Module, out: list[torch.Tensor]) -> Iterator[None]:
    """Append each MoE router's boolean routing map `[tokens, E]` (forward order) to `out`."""
    from megatron.core.transformer.moe.router import TopKRouter

    handles = []

    def hook(_mod: torch.nn.Module, _inp: object, output: tuple[torch.Tensor, torch.Tensor]):
        out.append(output[1].detach().clone())

    for mod in model.modules():
        if isinstance(mod, TopKRouter):
            handles.append(mod.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
