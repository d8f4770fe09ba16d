"""Run micro-batches through this rank's pipeline stage (PP = 1: the whole model).

Owns: `StageExecutor`, the point-to-point schedule between pipeline stages. Each micro-batch
goes forward through all stages (activations sent to the next stage's matching rank), the
last stage applies a `head` to the logits (log-probs, or the loss), and with gradients the
backward runs straight back through the stages before the next micro-batch starts. This is
the simple sequential schedule (no 1F1B overlap): pipeline parallelism here splits *memory*
(layers) across ranks, it does not overlap stages in time. Must never import the controller,
engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slime_async.trainer.forward import padded_width
from slime_async.trainer.parallel import comm_device
from slime_async.trainer.replay import bound, recording, replaying


class StageExecutor:
    """Forward (and backward) of one micro-batch across the pipeline stages."""

    def __init__(
        self, model: torch.nn.Module, routers: list[object], *, tp: int, hidden_size: int
    ) -> None:
        from megatron.core import parallel_state as ps

        self.model, self.routers, self.tp, self.hidden = model, routers, tp, hidden_size
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        if self.pp > 1:
            self.next = ps.get_pipeline_model_parallel_next_rank()
            self.prev = ps.get_pipeline_model_parallel_prev_rank()
            self.last_rank = ps.get_pipeline_model_parallel_last_rank()
            self.group = ps.get_pipeline_model_parallel_group()

    def run(
        self,
        tokens: torch.Tensor,
        routing: list[torch.Tensor] | None,
        *,
        head: Callable[[torch.Tensor], Any],
        grad: bool,
        record: list[list[torch.Tensor] | None] | None = None,
    ) -> Any:
        """Run `tokens` `[B, T]`; returns `head(logits [B, T, V])` on the last stage, else None.

        With `grad`, `head` must return `(loss, extra)`; the loss is back-propagated through
        every stage. With `record` (R2), this stage's routing is appended to it.
        """
        b, t = tokens.shape
        tpad = padded_width(t, self.tp)
        param = next(self.model.parameters())
        ids = tokens.to(param.device)
        if tpad != t:
            ids = torch.cat([ids, ids.new_zeros(b, tpad - t)], dim=1)
        pos = torch.arange(tpad, device=param.device).unsqueeze(0).expand(b, -1)
        rec: list[torch.Tensor] = []
        inp = None
        with torch.set_grad_enabled(grad):
            if not self.first:
                inp = torch.empty(tpad // self.tp, b, self.hidden, dtype=param.dtype,
                                  device=param.device)  # fmt: skip
                self._recv(inp, self.prev)
                inp.requires_grad_(grad)
                self.model.set_input_tensor(inp)
            ctx = recording(rec) if record is not None else contextlib.nullcontext()
            with bound(self.routers), ctx, replaying(routing):
                out = self.model(ids if self.first else None, pos, attention_mask=None)
        if record is not None:
            record.append(rec or None)
        result = None
        if not self.last:
            self._send(out.detach(), self.next)
            if grad:
                g = torch.empty_like(out)
                self._recv(g, self.next)
                out.backward(g)
        else:
            result = head(out[:, :t])
            if grad:
                result[0].backward()
        if grad and inp is not None:
            self._send(inp.grad, self.prev)
        return result

    def broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        """Give every stage the last stage's `t` (same shape everywhere); in place."""
        if self.pp == 1:
            return t
        dev = comm_device()
        staged = t.to(dev).contiguous()
        dist.broadcast(staged, src=self.last_rank, group=self.group)
        t.copy_(staged.to(t.device))
        return t

    @staticmethod
    def _send(t: torch.Tensor, dst: int) -> None:
        dist.send(t.contiguous().to(comm_device()), dst=dst)

    @staticmethod
    def _recv(t: torch.Tensor, src: int) -> None:
        dev = comm_device()
        if t.device == dev:
            dist.recv(t, src=src)
            return
        buf = torch.empty_like(t, device=dev)
        dist.recv(buf, src=src)
        with torch.no_grad():
            t.copy_(buf.to(t.device))
