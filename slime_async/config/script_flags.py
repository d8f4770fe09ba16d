"""The flags slime's launch scripts pass that configure nothing here by themselves: Megatron's
model shape (`model_shape`: checked against config.json) and the run flags whose slime meaning
is either what happens here anyway or not available here.

Owns `ScriptRunFlags` (Megatron's and slime's run flags of those scripts: `--sequence-parallel`,
`--attention-dropout`, `--optimizer`, `--rollout-shuffle`,
`--disable-compute-advantages-and-returns`, ...), `add_script_args` (both flag
groups), `RUN_TABLE` (each run flag's answer: the values accepted, what they mean here, the
check; docs/coming-from-slime.md's generated table) and `check_run_flags` (a run flag is
accepted where its value means here what it means in slime, refused with the reason
otherwise). The `script_flags` rule runs it and `model_shape.check_shape`. Imports only
clifields, contracts and `model_shape`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from clifields import add_flags, flag
from slime_async.config.model_shape import ModelShapeFlags, as_typed, same

__all__ = [
    "RUN_TABLE",
    "RunAnswer",
    "RunFacts",
    "ScriptRunFlags",
    "add_script_args",
    "check_run_flags",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScriptRunFlags:
    """Run flags of slime's scripts (Megatron's and slime's) that are accepted where their value
    means here what it means in slime, and refused with the reason otherwise (the table in
    docs/coming-from-slime.md)."""

    sequence_parallel: bool | None = None
    """Megatron's sequence parallelism: on here whenever --tensor-model-parallel-size > 1
    (Megatron turns it off at TP 1)."""
    context_parallel_size: int | None = flag(None, ge=1)
    """Megatron's context parallelism: 1 only (not implemented here)."""
    optimizer: Literal["adam", "sgd"] | None = None
    """Megatron's optimizer: adam (Megatron's Adam with decoupled weight decay) only."""
    attention_dropout: float | None = flag(None, ge=0, lt=1)
    """Megatron's attention dropout: 0 only (the trainer runs without dropout)."""
    hidden_dropout: float | None = flag(None, ge=0, lt=1)
    """Megatron's hidden dropout: 0 only (the trainer runs without dropout)."""
    attention_softmax_in_fp32: bool | None = None
    """Megatron's fp32 attention softmax: always so here."""
    accumulate_allreduce_grads_in_fp32: bool | None = None
    """Megatron's fp32 gradient accumulation and reduction: always so here (fp32 gradient
    buffers, also under --bf16)."""
    attention_backend: Literal["flash", "fused", "unfused", "local", "auto"] | None = None
    """Megatron's attention kernel: a kernel choice only; the trainer runs its own attention
    on packed samples (PyTorch SDPA), the same math."""
    moe_grouped_gemm: bool | None = None
    """Megatron's grouped expert GEMM: a kernel choice only; the trainer's experts are Megatron's
    sequential expert MLPs, the same math."""
    moe_permute_fusion: bool | None = None
    """Megatron's fused token permutation: a kernel choice only, the same math."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] | None = None
    """Megatron's token dispatcher: the trainer dispatches with allgather, the same math."""
    moe_token_drop_policy: Literal["probs", "position"] | None = None
    """Megatron's token dropping policy: applies only with an expert capacity, and no token is
    dropped here."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Megatron's router precision: fp32 only (the router computes in fp32 here)."""
    moe_aux_loss_coeff: float | None = flag(None, ge=0)
    """Megatron's load-balancing loss weight: 0 only (there is no auxiliary loss here)."""
    optimizer_cpu_offload: bool | None = None
    """Megatron's optimizer offload to the CPU: not implemented here (refused)."""
    overlap_cpu_optimizer_d2h_h2d: bool | None = None
    """Megatron's overlap of the offloaded optimizer's copies: not implemented here (refused)."""
    use_precision_aware_optimizer: bool | None = None
    """Megatron's precision-aware optimizer: not implemented here (refused)."""
    rollout_shuffle: bool | None = None
    """slime's prompt shuffling: the prompt order is always shuffled here, by --rollout-seed."""
    disable_compute_advantages_and_returns: bool | None = None
    """slime's switch for SFT: no advantages or returns; with --loss-type sft_loss only (its
    loss reads none), refused with the RL losses (they train on the advantages)."""
    balance_data: bool | None = None
    """slime's token balance across data-parallel ranks: a performance setting only; here each
    rank takes a contiguous part of the batch (the loss is the same)."""
    kl_coef: float | None = flag(None, ge=0)
    """slime's KL penalty in the reward: 0 only (the KL term is in the loss here:
    --use-kl-loss --kl-loss-coef)."""


def add_script_args(parser: argparse.ArgumentParser) -> None:
    """The flags of slime's scripts: Megatron's model shape and the run flags (their help says
    which values are accepted)."""
    add_flags(parser, ModelShapeFlags, group="model shape (Megatron)")
    add_flags(parser, ScriptRunFlags, group="slime script flags")


@dataclasses.dataclass(frozen=True, slots=True)
class RunFacts:
    """What a run flag's answer depends on."""

    tp: int
    """--tensor-model-parallel-size."""
    sft: bool = False
    """The loss is --loss-type sft_loss."""


Verdict = Callable[[Any, RunFacts], str | None]
"""A given value -> None (accepted) or why it is refused."""


def _only(*ok: Any, why: str) -> Verdict:
    return lambda v, _f: None if any(same(v, o) for o in ok) else why


_ADVANTAGES = (
    "the RL losses here train on the advantages, so they are always computed; slime's switch "
    "is for SFT: it goes with --loss-type sft_loss (drop it otherwise)"
)


def _advantages(v: Any, f: RunFacts) -> str | None:
    return None if not v or f.sft else _ADVANTAGES


def _sp(v: Any, f: RunFacts) -> str | None:
    if v or f.tp == 1:
        return None
    return "sequence parallelism is always on with tensor parallelism here; drop --no-sequence-parallel"


_OFFLOAD_OPT = (
    "Megatron's CPU offload of the optimizer is not implemented here: the optimizer state "
    "stays with the trainer ranks (sharded over data-parallel ranks with "
    "--use-distributed-optimizer, the default with DP > 1); drop the flag"
)


@dataclasses.dataclass(frozen=True, slots=True)
class RunAnswer:
    """What a run flag of slime's scripts gets here."""

    accepts: str
    """The values accepted ("" when none is)."""
    here: str
    """What an accepted value means here (the `accepted:` line), or why none is."""
    verdict: Verdict
    """A given value -> None (accepted) or why it is refused."""


def _any(_v: Any, _f: RunFacts) -> str | None:
    return None


_NO_DROPOUT = "the trainer runs without dropout (its log-probs are the policy's)"
RUN_TABLE: dict[str, RunAnswer] = {
    "sequence_parallel": RunAnswer(
        "on", "sequence parallelism is on whenever --tensor-model-parallel-size > 1", _sp
    ),
    "context_parallel_size": RunAnswer(
        "1",
        "no context parallelism: it is not implemented here (long samples: "
        "--recompute-granularity, --use-dynamic-batch-size --max-tokens-per-gpu)",
        _only(1, why="context parallelism is not implemented here; give 1 (or drop it)"),
    ),
    "optimizer": RunAnswer(
        "adam",
        "Megatron's Adam with decoupled weight decay (--adam-beta1/2, --adam-eps)",
        _only("adam", why="the trainer's optimizer is Megatron's Adam; give adam"),
    ),
    "attention_dropout": RunAnswer("0", _NO_DROPOUT, _only(0.0, why=_NO_DROPOUT)),
    "hidden_dropout": RunAnswer("0", _NO_DROPOUT, _only(0.0, why=_NO_DROPOUT)),
    "attention_softmax_in_fp32": RunAnswer(
        "on",
        "the attention softmax is always fp32 here",
        _only(True, why="the attention softmax is always fp32 here"),
    ),
    "accumulate_allreduce_grads_in_fp32": RunAnswer(
        "on",
        "gradients are always accumulated and reduced in fp32 here (also under --bf16)",
        _only(True, why="gradients are always accumulated and reduced in fp32 here"),
    ),
    "attention_backend": RunAnswer(
        "any",
        "a kernel choice: the trainer runs its own attention on packed samples (PyTorch SDPA), "
        "the same math",
        _any,
    ),
    "moe_grouped_gemm": RunAnswer(
        "any", "a kernel choice: Megatron's sequential expert MLPs, the same math", _any
    ),
    "moe_permute_fusion": RunAnswer("any", "a kernel choice: the same math unfused", _any),
    "moe_token_dispatcher_type": RunAnswer(
        "any", "a communication choice: the trainer dispatches with allgather, the same math", _any
    ),
    "moe_token_drop_policy": RunAnswer(
        "any", "applies only with an expert capacity: no token is dropped here", _any
    ),
    "moe_router_dtype": RunAnswer(
        "fp32",
        "the router computes in fp32",
        _only("fp32", why="the router computes in fp32 here; give fp32"),
    ),
    "moe_aux_loss_coeff": RunAnswer(
        "0",
        "there is no load-balancing loss here",
        _only(0.0, why="there is no load-balancing loss here; give 0 (or drop it)"),
    ),
    "optimizer_cpu_offload": RunAnswer("", _OFFLOAD_OPT, _only(False, why=_OFFLOAD_OPT)),
    "overlap_cpu_optimizer_d2h_h2d": RunAnswer("", _OFFLOAD_OPT, _only(False, why=_OFFLOAD_OPT)),
    "use_precision_aware_optimizer": RunAnswer(
        "",
        "Megatron's precision-aware optimizer is not implemented here (fp32 main weights and Adam "
        "moments; --bf16 computes in bf16); drop the flag",
        _only(False, why="Megatron's precision-aware optimizer is not implemented here; drop it"),
    ),
    "rollout_shuffle": RunAnswer(
        "on",
        "the prompt order is always shuffled here, by --rollout-seed",
        _only(True, why="the prompt order is always shuffled here (by --rollout-seed)"),
    ),
    "disable_compute_advantages_and_returns": RunAnswer(
        "with --loss-type sft_loss",
        "SFT trains on the NLL of the data's responses: no advantages or returns are computed",
        _advantages,
    ),
    "balance_data": RunAnswer(
        "any",
        "a performance setting only: each data-parallel rank takes a contiguous part of the "
        "batch (the loss is the same)",
        _any,
    ),
    "kl_coef": RunAnswer(
        "0",
        "no KL penalty in the reward: the KL term is in the loss here (--use-kl-loss "
        "--kl-loss-coef C --kl-loss-type)",
        _only(
            0.0,
            why="slime's KL penalty in the reward is not here; the KL term is in the loss: "
            "--use-kl-loss --kl-loss-coef C --kl-loss-type",
        ),
    ),
}
"""Run flag (dest) -> its answer (the table in docs/coming-from-slime.md, and the check)."""


def check_run_flags(a: argparse.Namespace, facts: RunFacts) -> tuple[dict[str, str], list[str]]:
    """Each given run flag of `RUN_TABLE`: ({flag as typed: what it means here}, [why each
    refused one is refused])."""
    accepted: dict[str, str] = {}
    errors: list[str] = []
    for dest, answer in RUN_TABLE.items():
        v = getattr(a, dest, None)
        if v is None:
            continue
        said = as_typed(a, dest)
        why = answer.verdict(v, facts)
        if why is None:
            accepted[said] = answer.here
        else:
            errors.append(f"{said} (a flag of slime's scripts): {why}")
    return accepted, errors
