"""Megatron DDP, megatron's optimizer and LR schedule, and the optimizer state in a layout-free form.

Owns: `MegatronOptim` — wraps this rank's model chunks in `Float16Module` (bf16) and
megatron's `DistributedDataParallel` (contiguous fp32 grad buffers), builds the optimizer with
`get_megatron_optimizer` (Adam with decoupled weight decay; the `DistributedOptimizer` shards
Adam moments and fp32 main parameters over DP when `use_distributed_optimizer`), the
`OptimizerParamScheduler` LR schedule, and the `finalize_model_grads` hook the schedule calls
(DP / expert-DP gradient reduction, TP reduction of sequence-parallel and q/k-norm grads,
pipeline embedding grads). The step refuses a non-finite gradient norm before touching the
weights. `state_tensors` / `load_state_tensors` give each parameter's Adam moments (and fp32
main parameter under bf16) as full tensors of this rank's TP/EP shard, gathered over DP from
the distributed optimizer's shards, so checkpoints stay independent of the DP layout. Must
never import the controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch

from slime_async.trainer import cpu_compat, lora
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.parallel import ParallelLayout, all_reduce_sum

MOMENTS = ("exp_avg", "exp_avg_sq")
GRAD_SKETCH_ELEMENTS = 1 << 20
"""Gradient elements kept per optimizer group to compare consecutive steps' gradients (a fixed
strided subset when there are more: the cosine of the subsets estimates the full one)."""


def grad_sketch(grads: list[torch.Tensor], budget: int = GRAD_SKETCH_ELEMENTS) -> torch.Tensor:
    """A fixed strided subset (about `budget` elements, fp32) of the concatenated `grads`: the
    same positions every step, so two steps' sketches can be compared element by element."""
    total = sum(g.numel() for g in grads)
    stride = max(1, -(-total // budget))
    parts = [g.detach().reshape(-1)[::stride].float() for g in grads]
    return torch.cat(parts) if parts else torch.zeros(0)


def cosine_sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[a·b, a·a, b·b] in float64: the sums a cosine is made of (they add over shards)."""
    a, b = a.double(), b.double()
    return torch.stack([a @ b, a @ a, b @ b])


def lr_at(step: int, cfg: TrainerConfig) -> float:
    """Learning rate of optimizer update number `step` (0-based): megatron-core's
    `OptimizerParamScheduler` with this config's schedule, evaluated at `step`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class _Groups:
        def __init__(self) -> None:
            self.param_groups: list[dict[str, float]] = [{}]

    sched = OptimizerParamScheduler(_Groups(), **scheduler_kwargs(cfg))
    sched.num_steps = step
    return float(sched.get_lr({}))


def scheduler_kwargs(cfg: TrainerConfig) -> dict[str, object]:
    """Arguments of megatron's `OptimizerParamScheduler` for this config (constant weight decay;
    a constant LR gets a nominal decay length, which megatron requires but does not use)."""
    decay = cfg.lr_decay_steps or cfg.lr_warmup_steps + 1
    return dict(
        init_lr=cfg.lr_warmup_init,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=decay,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def _finalize(model: list[torch.nn.Module], num_tokens: object, **kw: object) -> None:
    """megatron's `finalize_model_grads` without its per-token rescaling: the losses already
    carry the global denominators (see `model.transformer_config`)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kw)


@dataclasses.dataclass
class MegatronOptim:
    """DDP-wrapped chunks, the megatron optimizer and its LR scheduler (one per rank)."""

    chunks: list[torch.nn.Module]
    """The unwrapped GPTModel chunks (parameters are shared with `wrapped`)."""
    wrapped: list[torch.nn.Module]
    """DDP(Float16Module?(chunk)) per chunk: what megatron's schedule runs."""
    optimizer: object
    """The `MegatronOptimizer` (a ChainedOptimizer: dense and expert parameter groups)."""
    scheduler: object
    """megatron's `OptimizerParamScheduler` (num_steps = the trainer version)."""
    distributed: bool
    """Adam state and main parameters are sharded over DP."""
    bf16: bool
    """Model parameters are bf16 with fp32 main parameters in the optimizer."""
    grad_cosine: float = math.nan
    """Cosine between this step's gradient and the previous step's (before clipping; NaN on
    the first step): an early sign of collapse when it turns negative or erratic."""
    _prev_sketch: list[torch.Tensor] | None = None

    # ------------------------------------------------------------------ step
    def zero_grad(self) -> None:
        for c in self.wrapped:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, *, version: int, clip_grad: float) -> tuple[float, float]:
        """Clip by the global grad norm, one Adam update, advance the LR schedule; returns
        (grad norm, LR used). A non-finite norm (the same on every rank) raises before any
        weight changes, on every rank together."""
        lr = self.lr()
        with cpu_compat.cuda_literals_on_cpu():
            self.optimizer.prepare_grads()
            gnorm = float(self.optimizer.get_grad_norm())
            self._update_grad_cosine()
            if not math.isfinite(gnorm):
                self.zero_grad()
                raise FloatingPointError(
                    f"non-finite gradient norm ({gnorm}) in the train step at version {version}; "
                    "the weights were not updated. Check the batch (rollout log-probs, "
                    "advantages) and the loss configuration."
                )
            if clip_grad > 0:
                from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

                for sub in self._subs():
                    params = sub.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, clip_grad, gnorm)
            self.optimizer.step_with_ready_grads()
        self.scheduler.step(1)
        return gnorm, lr

    def _update_grad_cosine(self) -> None:
        """`grad_cosine` of this step's reduced gradient against the previous step's, from
        each optimizer group's sketch, the sums reduced over the group's grad-stats ranks."""
        subs = self._subs()
        sketches = [grad_sketch(sub.get_main_grads_for_grad_norm()) for sub in subs]
        prev, self._prev_sketch = self._prev_sketch, sketches
        if prev is None or any(p.shape != s.shape for p, s in zip(prev, sketches, strict=True)):
            self.grad_cosine = math.nan
            return
        total = torch.zeros(3, dtype=torch.float64)
        for sub, p, s in zip(subs, prev, sketches, strict=True):
            sums = cosine_sums(s, p)
            all_reduce_sum(sums, sub.get_grad_stats_parallel_group())
            total += sums.to(device="cpu", dtype=torch.float64)  # sums live on the grads' device
        dot, na, nb = total.tolist()
        self.grad_cosine = dot / math.sqrt(na * nb) if na > 0 and nb > 0 else math.nan

    def set_version(self, version: int) -> None:
        """Point the LR schedule at update number `version` (after a resume)."""
        self.scheduler.num_steps = 0
        self.scheduler.step(version)

    def reload_main_params(self) -> None:
        """Copy the model weights into the fp32 main parameters (after weights were loaded)."""
        if self.bf16:
            self.optimizer.reload_model_params()

    def _subs(self) -> list[object]:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: Adam moments and fp32 main parameters
        (under bf16; with fp32 parameters the main parameters are the weights themselves)."""
        total = 0
        for sub in self._subs():
            for st in sub.optimizer.state.values():
                total += sum(st[k].numel() * st[k].element_size() for k in MOMENTS if k in st)
            if self.bf16:
                for main in _main_params(sub):
                    total += main.numel() * main.element_size()
        return total

    def step_count(self) -> int:
        for sub in self._subs():
            for st in sub.optimizer.state.values():
                if "step" in st:
                    return int(st["step"])
        return 0

    @torch.no_grad()
    def state_tensors(
        self, names: dict[str, torch.nn.Parameter]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """{key: {global name: full tensor of this rank's TP/EP shard}} for `MOMENTS` (and
        `main_param` under bf16): collective over each optimizer's DP group."""
        keys = (*MOMENTS, "main_param") if self.bf16 else MOMENTS
        by_param = {p: n for n, p in names.items()}
        out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
        for sub, params, group in self._param_sets():
            parts = {k: [] for k in keys}
            for p in params:
                for k in keys:
                    parts[k].append(torch.zeros(p.numel(), dtype=torch.float32))
                for k, (lo, hi), shard in _owned(sub, p, self.distributed, keys):
                    parts[k][-1][lo:hi] = shard.detach().float().reshape(-1).cpu()
            for k in keys:
                flat = torch.cat(parts[k]) if parts[k] else torch.zeros(0)
                if self.distributed:
                    all_reduce_sum(flat, group)  # each element is owned by one DP rank
                at = 0
                for p in params:
                    out[k][by_param[p]] = flat[at : at + p.numel()].view(p.shape).clone()
                    at += p.numel()
        return out

    @torch.no_grad()
    def load_state_tensors(
        self,
        state: dict[str, dict[str, torch.Tensor]],
        names: dict[str, torch.nn.Parameter],
        *,
        step: int,
    ) -> None:
        """Install full per-parameter state (as `state_tensors` gives it) into this rank's
        optimizer: the DP shard each rank owns, Adam's step count set to `step`."""
        by_param = {p: n for n, p in names.items()}
        for sub, params, _ in self._param_sets():
            for p in params:
                name = by_param[p]
                for main, (lo, hi) in _main_and_range(sub, p, self.distributed):
                    st = sub.optimizer.state[main]
                    st["step"] = torch.tensor(float(step))
                    for k in MOMENTS:
                        full = state[k][name].reshape(-1)[lo:hi]
                        st[k] = full.to(main.device, main.dtype).view_as(main).clone()
                    if self.bf16 and "main_param" in state:
                        src = state["main_param"][name].reshape(-1)[lo:hi]
                        main.copy_(src.to(main.device, main.dtype).view_as(main))

    def owned_state(self) -> Iterator[tuple[torch.nn.Parameter, tuple[int, int], dict]]:
        """(model parameter, the range (lo, hi) of `p.view(-1)` whose optimizer state this rank
        holds, {"exp_avg" / "exp_avg_sq" (/ "main_param" under bf16): that state as a flat live
        tensor of hi - lo elements}) for every parameter with state on this rank (the
        distributed optimizer: its DP shard). No copy, no communication."""
        keys = (*MOMENTS, "main_param") if self.bf16 else MOMENTS
        for sub, params, _ in self._param_sets():
            for p in params:
                for main, rng in _main_and_range(sub, p, self.distributed):
                    st = sub.optimizer.state.get(main, {})
                    views = {k: (main if k == "main_param" else st[k]).view(-1) for k in keys}
                    yield p, rng, views

    def init_state(self, *, step: int) -> None:
        """Allocate Adam's state (zeros) where a parameter has none yet and set every step count
        to `step` (before state is read into it: `dist_ckpt.load`)."""
        for sub in self._subs():
            sub.init_state_fn(sub.optimizer, sub.config)
            for st in sub.optimizer.state.values():
                st["step"] = torch.tensor(float(step))

    def _param_sets(self) -> Iterator[tuple[object, list[torch.nn.Parameter], object]]:
        """(sub-optimizer, every model parameter it covers in a fixed order, its DP group)."""
        for sub in self._subs():
            if self.distributed:
                params = [p for buf in sub.buffers for p in buf.params]
                yield sub, params, sub.data_parallel_group
            else:
                yield sub, list(_model_params(sub)), None


def _model_params(sub: object) -> list[torch.nn.Parameter]:
    groups = getattr(sub, "float16_groups", None)
    if groups is not None:  # Float16OptimizerWithFloat16Params
        return [p for g in groups for p in g] + [p for g in sub.fp32_from_fp32_groups for p in g]
    return [p for g in sub.optimizer.param_groups for p in g["params"]]


def _main_params(sub: object) -> list[torch.Tensor]:
    """fp32 main copies of bf16 parameters held by `sub` (this rank's shards)."""
    if hasattr(sub, "shard_fp32_from_float16_groups"):
        return [p for g in sub.shard_fp32_from_float16_groups for p in g]
    return [p for g in getattr(sub, "fp32_from_float16_groups", []) for p in g]


def _main_and_range(
    sub: object, p: torch.nn.Parameter, distributed: bool
) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """[(the optimizer's parameter for `p` on this rank, its range in `p.view(-1)`)]; empty
    when another DP rank owns all of `p`."""
    if distributed:
        if p not in sub.model_param_group_index_map:
            return []
        gi, order = sub.model_param_group_index_map[p]
        rng = sub._get_model_param_range_map(p)["param"]
        return [(sub.optimizer.param_groups[gi]["params"][order], (rng.start, rng.end))]
    groups = getattr(sub, "float16_groups", None)
    if groups is not None:
        for g16, g32 in zip(groups, sub.fp32_from_float16_groups):
            for a, b in zip(g16, g32):
                if a is p:
                    return [(b, (0, p.numel()))]
    return [(p, (0, p.numel()))]


def _owned(
    sub: object, p: torch.nn.Parameter, distributed: bool, keys: tuple[str, ...]
) -> Iterator[tuple[str, tuple[int, int], torch.Tensor]]:
    for main, rng in _main_and_range(sub, p, distributed):
        st = sub.optimizer.state.get(main, {})
        for k in keys:
            if k == "main_param":
                yield k, rng, main
            elif k in st:
                yield k, rng, st[k]


def fuse_cpu_adam(optimizer: object) -> bool:
    """Switch torch's Adam/AdamW over CPU parameters to its fused CPU kernel (one pass per
    parameter, no temporaries). Megatron builds torch's optimizer without `fused` when neither
    Transformer Engine nor Apex is there, so on CPU torch runs its per-tensor loop, whose
    `sqrt(v)` and update temporaries (a parameter's size each, the embedding's 0.1 GiB on
    SmolLM2) raise the step's peak. Same update up to float rounding. Set on the groups before
    the first step (torch reads `fused` from each group at every step); returns whether any
    group was switched."""
    switched = False
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or any(p.device.type != "cpu" for p in params):
            continue
        for g in inner.param_groups:
            g["fused"], g["foreach"] = True, False
        inner.defaults["fused"], inner.defaults["foreach"] = True, False
        switched = True
    return switched


def build_optim(
    chunks: list[torch.nn.Module], cfg: TrainerConfig, layout: ParallelLayout
) -> MegatronOptim:
    """Wrap `chunks` (bf16 → Float16Module) in megatron DDP and build the optimizer/scheduler;
    wires `finalize_model_grads` and DDP's `no_sync` into the model config for the schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    distributed = (
        layout.dp > 1 if cfg.use_distributed_optimizer is None else cfg.use_distributed_optimizer
    )
    config = chunks[0].config
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
    )
    with cpu_compat.cuda_literals_on_cpu():
        wrapped = [
            DistributedDataParallel(
                config,
                ddp_cfg,
                lora.keep_fp32(Float16Module(config, c)) if cfg.bf16 else c,
                disable_bucketing=i > 0,
            )
            for i, c in enumerate(chunks)
        ]
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=cfg.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=distributed,
        )
        optimizer = get_megatron_optimizer(opt_cfg, wrapped)
    fuse_cpu_adam(optimizer)
    for c in chunks:
        c.config.finalize_model_grads_func = _finalize
        c.config.no_sync_func = (
            wrapped[0].no_sync if len(wrapped) == 1 else [w.no_sync for w in wrapped]
        )
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_kwargs(cfg))
    return MegatronOptim(
        chunks=chunks,
        wrapped=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        distributed=distributed,
        bf16=cfg.bf16,
    )
