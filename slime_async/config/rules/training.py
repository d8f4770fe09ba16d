"""The rules of the trainer: its defaults by run kind, where pi_j^Meg is computed, how many
weight snapshots it keeps, its precision, the config itself and what it resumes from.

Rules (in `RULES` order): `lr`, `run_kind`, `behavior_forward`, `snapshots`, `bf16`, `save_hf`,
`trainer`, `script_flags`, `resume`. The paths' rules themselves are `slime_async.config.run_paths`'.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from data_worker.budget import snapshot_count, staleness_bound
from loss import resolve_loss_spec
from loss.slime_cli import SFT_LOSS
from slime_async.config.derive import raise_all
from slime_async.config.engine_backends import engine_backend_needs
from slime_async.config.model_shape import check_shape
from slime_async.config.rules.draft import Draft, rule
from slime_async.config.run_paths import (
    check_resume,
    derive_save_hf,
    resume_from,
    start_weights,
)
from slime_async.config.script_flags import RunFacts, check_run_flags
from slime_async.contracts.model import ModelSpec
from slime_async.trainer.config import (
    REAL_MODEL_LR,
    REAL_MODEL_LR_WARN,
    TrainerConfig,
    run_kind_defaults,
    trainer_config_from_args,
)

log = logging.getLogger(__name__)

__all__ = [
    "behavior_forward",
    "bf16",
    "fused_kernels",
    "lr",
    "resume",
    "run_kind",
    "save_hf",
    "script_flags",
    "snapshots",
    "trainer",
    "trainer_on_gpu",
]

_USER_RUN = "a run with --hf-checkpoint/--prompt-data/--prompt-source"


def _reads_behavior(d: Draft) -> bool:
    """The run's loss reads pi_j^Meg (its `LossNeeds`), so snapshots are worth keeping."""
    return resolve_loss_spec(d.loss.loss.name).needs.behavior_logprobs


@rule("lr", fills=("lr", "lr_decay_iters"))
def lr(d: Draft) -> None:
    """The learning rate by run kind; a user lr far above what RL on a pretrained model takes is
    kept, with a warning (it is the user's flag). The schedule's lengths as in slime
    (`_schedule_lengths`)."""
    _schedule_lengths(d)
    f = d.flags
    if f.unset("lr"):
        if d.embedded:
            f.fill("lr", TrainerConfig().lr, "default of the embedded default run (tiny model)")
        else:
            f.fill("lr", REAL_MODEL_LR, f"default of {_USER_RUN}: RL on a pretrained model")
    elif not d.embedded and d.args.lr > REAL_MODEL_LR_WARN:
        log.warning(
            "--lr %g is far above what RL on a pretrained model takes (~%g): expect the policy "
            "entropy to collapse and the train-rollout log-prob gap to jump after one update",
            d.args.lr,
            REAL_MODEL_LR,
        )


def _schedule_lengths(d: Draft) -> None:
    """slime's (Megatron's) defaults: a decaying --lr-decay-style without --lr-decay-iters
    decays over the run's train steps; --lr-warmup-fraction F warms up for F x
    --lr-decay-iters (the run's train steps under a constant LR), rounded to whole steps."""
    a, f = d.args, d.flags
    decay = a.lr_decay_iters
    if decay is None and a.lr_decay_style != "constant":
        decay = a.num_steps
        f.fill("lr_decay_iters", decay, "slime's default: the run's train steps (--num-steps)")
    frac = a.lr_warmup_fraction
    if frac is None:
        return
    if a.lr_warmup_iters:
        raise ValueError(
            f"--lr-warmup-fraction {frac} and --lr-warmup-iters {a.lr_warmup_iters} both set "
            "the warmup; give one of them"
        )
    length, of = (decay, "--lr-decay-iters") if decay else (a.num_steps, "--num-steps")
    a.lr_warmup_iters = round(frac * length)  # its default is 0, not unset: set, and said
    why = f"--lr-warmup-fraction {frac} x {of} {length}, rounded to whole steps"
    f.note("lr_warmup_iters", a.lr_warmup_iters, why)


@rule("run_kind", fills=tuple(run_kind_defaults(embedded=True)))
def run_kind(d: Draft) -> None:
    """Run-kind defaults (`trainer.config.EMBEDDED_RUN`: micro batch, routing replay, snapshots
    on) for the unset flags; snapshots are kept by default only for a loss that reads pi_j^Meg."""
    kind = "the embedded default run" if d.embedded else _USER_RUN
    for dest, value in run_kind_defaults(embedded=d.embedded).items():
        aliased = dest == "routing_replay" and d.args.use_rollout_routing_replay
        if not d.flags.unset(dest) or aliased:
            continue
        if dest == "keep_old_actor" and value and not _reads_behavior(d):
            d.flags.fill(dest, False, f"--loss {d.loss.loss.name} does not read pi_j^Meg snapshots")
        else:
            d.flags.fill(dest, value, f"default of {kind}")


@rule("behavior_forward", fills=("behavior_forward",))
def behavior_forward(d: Draft) -> None:
    """Where pi_j^Meg is computed: the forward-only role in an async run whose loss reads it (off
    the train step), the trainer otherwise. The `memory` rule may move it back to the trainer."""
    if not d.flags.unset("behavior_forward"):
        return
    a = d.args
    if a.keep_old_actor and _reads_behavior(d) and d.data_worker.max_staleness > 0:
        lora = "; under LoRA it holds the base once and an adapter per version"
        why = (
            "an async run whose loss reads pi_j^Meg: the forward-only role computes it off the "
            "train step (docs/compis.md)" + (lora if a.lora_rank else "")
        )
        d.flags.fill("behavior_forward", "role", why)
    else:
        d.flags.fill("behavior_forward", "trainer", "nothing to move off the train step")


@rule("snapshots", fills=("max_snapshots",))
def snapshots(d: Draft) -> None:
    """--max-snapshots from the staleness bound: every version a trained token can come from
    (the role holds only the pushed ones); a user's count below it is refused. A finite bound is
    needed to keep snapshots at all."""
    a, dw = d.args, d.data_worker
    if not a.keep_old_actor:
        return  # no snapshots are kept, so --max-snapshots has nothing to size
    window = dict(
        max_staleness=dw.max_staleness,
        fifo_window=dw.fifo_window,
        groups_per_step=dw.groups_per_step,
    )
    bound = staleness_bound(**window, max_off_policy_steps=dw.max_off_policy_steps)
    if math.isinf(bound):
        raise ValueError(
            "--keep-old-actor with --fifo-window inf has no staleness bound, so no finite number "
            "of weight snapshots suffices; use a finite --fifo-window or --max-off-policy-steps, "
            "or --no-keep-old-actor"
        )
    b = int(bound)
    why = f"S {dw.max_staleness} + ceil((W {dw.fifo_window:g} - 1) / B {dw.groups_per_step})"
    if bound < staleness_bound(**window):
        why = f"--max-off-policy-steps {b}"
    # the trainer snapshots every version; the forward-only role only the pushed ones
    every = a.update_weights_interval if a.behavior_forward == "role" else 1
    need = int(snapshot_count(bound=b, versions_every=every))
    if every == 1:
        why = f"staleness bound {b} ({why}) + the current version"
    else:
        why = (
            f"staleness bound {b} ({why}), the role holding only versions pushed every "
            f"--update-weights-interval {every}: floor({b} / {every}) + 1 of them, + 1 off "
            "that grid (a resumed start or an early push)"
        )
    if d.flags.unset("max_snapshots"):
        d.flags.fill("max_snapshots", need, why)
    elif a.max_snapshots < need:
        raise ValueError(
            f"--max-snapshots {a.max_snapshots} is too few for --keep-old-actor: a trained token "
            f"can come from any of {need} versions ({why}); give --max-snapshots {need} or more "
            "(or drop the flag), or lower --max-staleness / --fifo-window"
        )


@rule("bf16", fills=("bf16",))
def bf16(d: Draft) -> None:
    """bf16 compute (fp32 main weights and gradient accumulation) for a run with a user's model
    whose trainer runs on GPUs (`trainer_on_gpu`) or on a CPU with native bf16 matmuls (AMX /
    AVX512_BF16); fp32 otherwise (docs/cpu.md)."""
    f, env = d.flags, d.env
    if not f.unset("bf16"):
        return
    if d.embedded:
        f.fill("bf16", False, "the embedded default run's tiny model trains in fp32")
    elif env.load is not None and env.load.version is not None:
        why = "a resumed run keeps fp32 unless told: give --bf16 if its checkpoint was saved so"
        f.fill("bf16", False, why)
    elif trainer_on_gpu(d):
        why = "the trainer runs on GPUs: bf16 compute, fp32 main weights and gradients, as slime"
        f.fill("bf16", True, why)
    elif env.cpu_bf16:
        why = f"the CPU has {env.cpu_bf16}: bf16 matmuls, fp32 main weights and gradients"
        f.fill("bf16", True, why)
    else:
        f.fill("bf16", False, "the CPU has no AMX/AVX512_BF16 (bf16 would be emulated): fp32")


@rule("fused_kernels", fills=("cpu_fused_kernels",))
def fused_kernels(d: Draft) -> None:
    """--cpu-fused-kernels: on for a run with a user's model whose trainer runs on CPUs and whose
    node has a C++ compiler (Inductor builds the kernels); off for the embedded default run (its
    tiny model's step is over before the compile would pay), GPU trainers (megatron's own
    kernels) and a node without a compiler. Given on without a compiler: refused (docs/cpu.md)."""
    f, env = d.flags, d.env
    if not f.unset("cpu_fused_kernels"):
        if d.args.cpu_fused_kernels and env.cxx is None and not trainer_on_gpu(d):
            raise ValueError(
                "--cpu-fused-kernels needs a C++ compiler for torch's Inductor and none was "
                "found (g++ or clang++ on PATH, or CXX): install one (apt-get install g++) or "
                "pass --no-cpu-fused-kernels"
            )
        return
    if d.embedded:
        f.fill("cpu_fused_kernels", False, "the embedded default run's tiny model: eager kernels")
    elif trainer_on_gpu(d):
        f.fill("cpu_fused_kernels", False, "the trainer runs on GPUs: megatron's kernels")
    elif env.cxx is None:
        why = "no C++ compiler on this node (g++/clang++/CXX) for Inductor: eager kernels"
        f.fill("cpu_fused_kernels", False, why)
    else:
        f.fill("cpu_fused_kernels", True, f"a CPU trainer and a C++ compiler ({env.cxx})")


def trainer_on_gpu(d: Draft) -> bool:
    """The trainer ranks run on GPUs: this node has CUDA devices (a local Ray node offers them
    and each rank takes one), or the engines are GPU engines (their cluster has GPUs, and the
    ranks' bundles take GPUs wherever the cluster has them: `orchestrator.placement`)."""
    needs = engine_backend_needs(d.args.engine_backend)
    return bool(d.env.gpu_memory_bytes) or needs.gpus_per_engine > 0


@rule("save_hf", fills=("save_hf",))
def save_hf(d: Draft) -> None:
    """`--save-hf`: `<run-dir>/hf` for a run that would keep no model otherwise (the embedded
    default run, a user's model without --save; `run_paths.derive_save_hf`)."""
    derive_save_hf(d.flags, embedded=d.embedded, gguf=d.given["hf_checkpoint"])


def _check_rollout_logprobs(d: Draft) -> None:
    """--use-rollout-logprobs makes the engine's log-probs the loss's old policy: refused for a
    loss that corrects the engine mismatch from π_j^Meg (CompIS; --use-tis, which slime refuses
    with it, is CompIS's engine correction)."""
    name = d.loss.loss.name
    if _reads_behavior(d):
        raise ValueError(
            f"--use-rollout-logprobs with --loss {name}: the engine's log-probs would be both the old "
            "policy and the engine correction's denominator (CompIS corrects the engine mismatch "
            "and the staleness separately, from π_j^Meg); use a loss with one ratio (--loss ppo, "
            "gspo, decoupled_ppo) with --use-rollout-logprobs, or drop it"
        )


@rule("trainer")
def trainer(d: Draft) -> None:
    """The trainer's config from the derived flags, with the loss and the sampling temperature;
    checked against the model it trains (routing replay needs an MoE)."""
    t = trainer_config_from_args(d.args)
    if t.use_rollout_logprobs:
        _check_rollout_logprobs(d)
    replay, model = t.routing_replay.value, d.env.model
    if replay != "none" and not model.is_moe:
        raise ValueError(
            f"--routing-replay {replay} needs an MoE model, but {d.args.hf_checkpoint} is dense "
            f"({model.family}); drop the routing-replay flag"
        )
    _check_expert_split(t, model)
    d.trainer = dataclasses.replace(
        t, loss=d.loss.loss, temperature=d.rollout.temperature, hf_source=d.args.hf_checkpoint
    )


def _check_expert_split(t: TrainerConfig, model: ModelSpec) -> None:
    """The experts split over --expert-model-parallel-size ranks and each expert's MLP over
    the expert tensor-parallel ranks (ValueError naming the sizes), now rather than when the
    trainer builds the model."""
    if not model.is_moe:
        return
    ep, etp = t.expert_model_parallel_size, t.expert_tensor_parallel
    if model.num_experts % ep:
        raise ValueError(
            f"--expert-model-parallel-size {ep}: the model's {model.num_experts} experts do not "
            "split evenly over that many ranks; give a divisor of the expert count"
        )
    if model.moe_intermediate_size % etp:
        raise ValueError(
            f"expert tensor-parallel size {etp} (--expert-tensor-parallel-size, default: TP): "
            f"the experts' MLP width {model.moe_intermediate_size} does not split evenly; give "
            "a divisor of it"
        )


@rule("script_flags")
def script_flags(d: Draft) -> None:
    """The flags of slime's scripts that set nothing here: Megatron's model shape checked
    against the model the trainer builds (config.json), and the run flags accepted where their
    slime meaning holds here (`model_shape`, `script_flags`: one line each, in the accepted
    record)."""
    a, model = d.args, d.env.model
    where = (
        f"{a.hf_checkpoint}/config.json"
        if a.hf_checkpoint
        else "the embedded default model (the tiny MoE)"
    )
    shape, errors = check_shape(a, model, where=where)
    facts = RunFacts(tp=d.trainer.tensor_model_parallel_size, sft=d.loss.loss.name == SFT_LOSS)
    run, refused = check_run_flags(a, facts)
    raise_all(errors + refused)
    d.flags.accepted.update(shape | run)


@rule("resume")
def resume(d: Draft) -> None:
    """The checkpoint the trainer resumes from (`run_paths.resume_from`: none yet for slime's
    `--load D --save D` on an empty D), or the weights it starts from when --load names weights
    (`run_paths.start_weights`: a Megatron torch_dist checkpoint, an HF directory), every
    refusal about them (`run_paths.check_resume`); what --ref-load holds is logged."""
    start = start_weights(d.flags, d.env)
    load = resume_from(d.flags, d.env, embedded=d.embedded)
    d.trainer = dataclasses.replace(d.trainer, load=load, start_from=start)
    check_resume(d.args, d.env, d.trainer)
    if d.env.ref_load is not None:
        d.flags.accepted[f"--ref-load {d.args.ref_load}"] = d.env.ref_load.describe()
