"""Micro-batches through megatron-core's forward/backward schedule.

Owns: `MicroBatch` (one micro-batch's samples and its model inputs: packed THD with
`PackedSeqParams`, or padded BSHD), and `Schedule.run`, which hands megatron-core's
`get_forward_backward_func` (no pipelining, 1F1B, or interleaved 1F1B with virtual stages)
the three things it asks for — a data iterator, a forward step and a loss function — and
nothing more. The last stage returns hidden states; the `head` gets them as `lm_head.Logits`. The forward step sets the micro-batch's MoE routing replay on this chunk's
routers (R2 record / R3 replay; with activation recompute the backward's re-forward pops the
same indices, megatron's REPLAY_BACKWARD); the loss function applies a `head` to the last
stage's logits. No-grad log-prob passes run the same schedule with `forward_only=True`.
Must never import the controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.vision import VisionSpec
from slime_async.host import trim_heap
from slime_async.trainer import cpu_compat, packing

Routing = list[torch.Tensor] | None


@dataclasses.dataclass(eq=False)
class MicroBatch:
    """One micro-batch of a DP rank: its samples, where they sit in the model input, routing."""

    batch: TrainerBatch
    """The samples, right-padded to their own longest (`[b, w]`; the loss's view)."""
    rows: list[int]
    """Their positions in this DP rank's shard (results are scattered back there)."""
    layout: packing.RowLayout
    """Model input layout: packed (one row, `cu_seqlens`) or padded."""
    routing: Routing = None
    """Replay indices per local MoE router (construction order), or None (route freely)."""
    recorded: Routing = None
    """Routing recorded by an R2 recording pass (same layout as `routing`)."""

    def __post_init__(self) -> None:
        self.input_ids = packing.model_input(self.batch.tokens, self.layout)
        self.position_ids = packing.position_ids(self.layout)
        self.src, self.valid = packing.sample_index(self.layout, self.batch.width)
        self.read = self.reads(self.batch.loss_mask)
        """`[rows, width − 1]` bool: the positions whose log-prob is read (those predicting a
        trained token, `batch.loss_mask`); only these go through the LM head."""
        self.packed_seq_params = _packed_params(self.layout)

    def reads(self, tokens: torch.Tensor) -> torch.Tensor:
        """`[rows, width − 1]` bool: the positions that predict the tokens of a token-aligned
        `[b, w]` mask (`read` is this of `batch.loss_mask`)."""
        return packing.read_positions(
            self.src, self.valid, tokens, self.layout.rows, self.layout.width
        )

    def to_samples(self, per_position: torch.Tensor) -> torch.Tensor:
        """`[rows, width − 1]` per-position values → token-aligned `[b, w]`."""
        return packing.to_samples(per_position, self.src, self.valid)


def micro_batch(
    local: TrainerBatch,
    rows: list[int],
    *,
    packed: bool,
    tp: int,
    min_width: int = 0,
    min_rows: int = 0,
) -> MicroBatch:
    """The micro-batch of `local`'s `rows` (trimmed to its longest sample)."""
    sel = local.select(rows)
    sel = sel.trimmed(int(sel.lengths.max()))
    layout = packing.row_layout(
        sel.lengths.tolist(), packed=packed, tp=tp, min_width=min_width, min_rows=min_rows
    )
    return MicroBatch(batch=sel, rows=list(rows), layout=layout)


def _packed_params(layout: packing.RowLayout) -> object:
    if not layout.packed:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    if cpu_compat.cuda_available():
        cu = cu.cuda()
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


class Schedule:
    """Runs micro-batches through megatron's schedule on this rank's (DDP-wrapped) chunks."""

    def __init__(
        self,
        wrapped: list[torch.nn.Module],
        routers: list[list[object]],
        *,
        recompute: bool,
        chunks: list[torch.nn.Module] | None = None,
        chunk_tokens: int | None = None,
        vision: VisionSpec | None = None,
        images: Callable[[Any], Any] | None = None,
    ) -> None:
        self.wrapped = wrapped
        self.vision = vision
        """A vision-language model's vision spec: inputs get mRoPE positions and images."""
        self.images = images
        """Turns a sample's images by reference into pixels (`vl_inputs.ImageResolver`)."""
        self.chunks = chunks or []
        """The unwrapped chunks (their output weight, when the last one returns hidden states)."""
        self.chunk_tokens = chunk_tokens
        """Tokens per chunk of the log-prob head (`lm_head.Logits.chunk_tokens`)."""
        self.routers = routers
        """RouterReplay instances of each chunk, in construction order."""
        self.offsets = [sum(len(r) for r in routers[:k]) for k in range(len(routers))]
        self.recompute = recompute

    def run(
        self,
        mbs: list[MicroBatch],
        head: Callable[[torch.Tensor, MicroBatch], Any],
        *,
        forward_only: bool,
        record: bool = False,
    ) -> list[Any]:
        """Forward (and backward) every micro-batch; returns, on the last pipeline stage,
        `head(logits, mb)` per micro-batch in order (elsewhere []). With gradients `head` must
        return `(loss, extra)`: the loss (this micro-batch's share) is back-propagated and
        `extra` returned. `record` (R2): each micro-batch's routing lands in `mb.recorded`."""
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        step = _Step(self, head, forward_only=forward_only, record=record)
        for w in self.wrapped:
            w.train(not forward_only)
        iters = [iter(mbs) for _ in self.wrapped]
        grad = torch.enable_grad() if not forward_only else torch.no_grad()
        try:
            with grad, cpu_compat.cuda_literals_on_cpu():
                get_forward_backward_func()(
                    forward_step_func=step.forward_step,
                    data_iterator=iters if len(iters) > 1 else iters[0],
                    model=self.wrapped,
                    num_microbatches=len(mbs),
                    seq_length=max(mb.layout.width for mb in mbs),
                    micro_batch_size=max(mb.layout.rows for mb in mbs),
                    forward_only=forward_only,
                    collect_non_loss_data=forward_only,
                )
        finally:
            for routers in self.routers:
                for r in routers:
                    r.clear_indices()
                    r.clear_router_replay_action()
        return step.outputs

    def _logits(self, output: torch.Tensor, k: int) -> Any:
        """The last stage's output as `head` gets it: `lm_head.Logits` (hidden states, not yet
        multiplied by the output weight) when chunk `k` returns hidden states, else logits."""
        from slime_async.trainer import lm_head

        if k >= len(self.chunks) or not lm_head.returns_hidden(self.chunks[k]):
            return output
        weight = lm_head.output_weight(self.chunks[k])
        return lm_head.Logits(
            hidden=output, weight=weight, group=lm_head.tp_group(), chunk_tokens=self.chunk_tokens
        )

    def _before(self, mb: MicroBatch, k: int, record: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = self.routers[k]
        if record:
            for r in routers:
                r.set_router_replay_action(RouterReplayAction.RECORD)
        elif mb.routing is not None:
            lo = self.offsets[k]
            for r, idx in zip(routers, mb.routing[lo : lo + len(routers)], strict=True):
                r.set_target_indices(idx)  # also queued for a recompute's REPLAY_BACKWARD
                r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            for r in routers:
                r.clear_router_replay_action()

    def _after(self, mb: MicroBatch, k: int, record: bool, *, training: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = self.routers[k]
        if record:
            if mb.recorded is None:
                mb.recorded = [None] * sum(len(r) for r in self.routers)
            lo = self.offsets[k]
            for i, r in enumerate(routers):
                mb.recorded[lo + i] = r.get_recorded_indices().detach().clone()
        for r in routers:
            if training and self.recompute and mb.routing is not None and not record:
                # the backward's recompute re-runs the router: pop this micro-batch's indices
                r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                r.clear_router_replay_action()


class _Step:
    """megatron's forward-step and loss callbacks for one `Schedule.run`: each micro-batch
    through its chunk (routing replayed or recorded), `head` on the last stage's output; what
    `head` returns (its `extra` with gradients) collects in `outputs`, in order."""

    def __init__(
        self,
        schedule: Schedule,
        head: Callable[[torch.Tensor, MicroBatch], Any],
        *,
        forward_only: bool,
        record: bool,
    ) -> None:
        self.schedule, self.head = schedule, head
        self.forward_only, self.record = forward_only, record
        self.outputs: list[Any] = []
        self.chunk_of = {id(w): k for k, w in enumerate(schedule.wrapped)}
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if cpu_compat.cuda_available()
            else torch.device("cpu")
        )
        self.one = torch.ones((), dtype=torch.int)
        self.started = 0
        """Micro-batches whose forward has started (on a CPU, each after the first trims the
        heap first: `forward_step`)."""

    def loss_func(
        self, mb: MicroBatch, k: int, output: torch.Tensor, non_loss_data: bool = False
    ) -> Any:
        output = self.schedule._logits(output, k)
        with cpu_compat.model_code():
            res = self.head(output, mb)
        if self.forward_only:
            self.outputs.append(res)
            return res
        loss, extra = res
        self.outputs.append(extra)
        # 3-tuple + calculate_per_token_loss: megatron back-propagates `loss` as it is
        return loss, self.one, {"loss": loss.detach().clone()}

    def _vl_inputs(
        self, mb: MicroBatch, k: int, ids: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """(mRoPE positions, the image-bearing `decoder_input` on the stage with the vision
        tower) of a vision-language micro-batch (`vl_inputs.layout_inputs`)."""
        from slime_async.trainer.vl_inputs import image_embeddings, layout_inputs

        b = mb.batch
        assert self.schedule.vision is not None
        images = b.images
        if images is not None and self.schedule.images is not None:
            images = tuple(self.schedule.images(i) for i in images)
        pos, pixels, grids, where = layout_inputs(
            b.tokens, b.loss_mask, images, mb.layout, self.schedule.vision
        )
        chunk = self.schedule.chunks[k] if self.schedule.chunks else None
        if chunk is None or getattr(chunk, "vision", None) is None:
            return pos.to(self.device), {}
        emb = image_embeddings(chunk, ids, pixels, grids, where)
        return pos.to(self.device), {"decoder_input": emb}

    def forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple[Any, Callable]:
        mb = next(data_iterator)
        k = self.chunk_of[id(model)]
        sched = self.schedule
        if self.started and self.device.type == "cpu":
            # what the micro-batches before this one freed, back to the node before this one
            # allocates: glibc otherwise keeps their fragments and the step's peak grows with
            # every micro-batch (docs/cpu.md#memory)
            trim_heap()
        self.started += 1
        with cpu_compat.model_code():
            sched._before(mb, k, self.record)
            ids, kw = mb.input_ids.to(self.device), {}
            pos = mb.position_ids.to(self.device)
            if sched.vision is not None:
                pos, kw = self._vl_inputs(mb, k, ids)
            out = model(ids, pos, attention_mask=None, packed_seq_params=mb.packed_seq_params, **kw)
            sched._after(mb, k, self.record, training=not self.forward_only)
        return out, functools.partial(self.loss_func, mb, k)
