"""The last rules: the `RunConfig` built from what the rules before derived, the batch shape a
resume must keep, and the start-up memory check with its one fallback.

Rules (in `RULES` order): `run_config`, `batch_shape`, `memory`. A one-node run whose roles
would not fit in the node's memory, with a derived `--behavior-forward role`, derives `trainer`
instead when that fits: the `memory` rule re-runs only the rules that `--behavior-forward`
feeds (`REFIT`) on a copy of the draft, so the result is what validating with
`--behavior-forward trainer` would give. The byte counts are `slime_async.config.memory_plan`'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from slime_async.config import memory_plan
from slime_async.config.pipeline import pipeline_config_from_args
from slime_async.config.rules.draft import Draft, Rule, rule
from slime_async.config.rules.serving import weight_dtype
from slime_async.config.rules.training import resume, snapshots, trainer, trainer_on_gpu
from slime_async.config.run_config import Derived, RunConfig
from slime_async.config.run_paths import check_batch_shape
from slime_async.config.supervision import supervisor_config_from_args
from slime_async.contracts.adapter import adapter_numel, lora_spec
from slime_async.metrics.config import logging_config_from_args
from slime_async.weights.config import weight_sync_config_from_args

__all__ = ["REFIT", "batch_shape", "memory", "memory_parts", "run_config"]


@rule("run_config")
def run_config(d: Draft) -> None:
    """The `RunConfig`: every component's config, the derived values and the flags as given."""
    a, p = d.args, d.placement
    d.config = RunConfig(
        run_dir=Path(a.run_dir),
        ray_address=d.env.ray_address,
        auth_token_file=a.auth_token_file,
        api_key_file=a.api_key_file,
        num_steps=a.num_steps,
        update_weights_interval=a.update_weights_interval,
        engine_sleep_level=a.engine_sleep_level or 0,
        save_interval=a.save_interval,
        save_debug_rollout_data=a.save_debug_rollout_data,
        load_debug_rollout_data=a.load_debug_rollout_data,
        debug_rollout_only=a.debug_rollout_only,
        debug_train_only=bool(a.debug_train_only),
        engines=d.engines,
        colocate=p.colocate,
        offload=bool(a.offload),
        offload_train=bool(a.offload_train),
        offload_rollout=bool(a.offload_rollout),
        trainer_cores=p.trainer_cores,
        rollout_cores=p.rollout_cores,
        behavior_role_cores=a.behavior_role_cores,
        memory_limit_gib=a.memory_limit_gib,
        warmstart_steps=a.warmstart_steps,
        seed=a.seed,
        loggers=logging_config_from_args(a),
        model=d.env.model,
        rollout=d.rollout,
        data_worker=d.data_worker,
        router=d.router,
        engine=dataclasses.replace(
            d.engine,
            api_key=d.api_key,
            admin_api_key=d.admin_api_key,
            open_data_plane=d.router.open_data_plane,
        ),
        trainer=d.trainer,
        supervisor=supervisor_config_from_args(a),
        pipeline=pipeline_config_from_args(a),
        weights=weight_sync_config_from_args(a),
        derived=d.flags.derived,
        accepted=d.flags.accepted,
        flags=d.given,
    )


@rule("batch_shape")
def batch_shape(d: Draft) -> None:
    """A resume keeps the batch shape its checkpoint was trained with."""
    if d.trainer.load is not None and d.env.load is not None:
        check_batch_shape(d.env.load.batch_shape, d.config, where=str(d.args.load))


def run_shape(cfg: RunConfig, *, trainer_on_gpu: bool = False) -> memory_plan.RunShape:
    """What sets `cfg`'s memory on this node (`memory_plan.RunShape`)."""
    t, r = cfg.trainer, cfg.rollout
    snaps = t.max_snapshots if t.keep_old_actor else 0
    role = t.behavior_forward == "role" and t.keep_old_actor
    tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
    dp = max(1, t.world_size // (tp * pp))
    spec = lora_spec(t, cfg.model)
    head = None  # a token budget: how many of its tokens are responses' is not known here
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu:
        tokens = t.max_tokens_per_gpu
    else:  # a fixed sample count: its prompts are unknown here, `PROMPT_TOKENS` each assumed
        embedded = not any(
            cfg.flags.get(k) for k in ("hf_checkpoint", "prompt_data", "prompt_source")
        )
        prompt = EMBEDDED_PROMPT_TOKENS if embedded else PROMPT_TOKENS
        tokens = t.micro_batch_size * (prompt + r.max_response_len)
        head = t.micro_batch_size * r.max_response_len  # only the responses reach the head
    rc = None
    if t.recompute_granularity == "full":
        rc = memory_plan.Recompute(method=t.recompute_method, num_layers=t.recompute_num_layers)
    return memory_plan.RunShape(
        spec=cfg.model,
        trainer_ranks=t.world_size,
        tp_pp=tp * pp,
        pp=pp,
        dp=dp,
        distributed_optimizer=t.use_distributed_optimizer is not False and dp > 1,
        bf16=t.bf16,
        trainer_on_gpu=trainer_on_gpu,
        micro_batch_tokens=tokens,
        head_tokens=head,
        recompute=rc,
        chunk_tokens=t.logits_chunk_tokens or None,
        trainer_snapshots=0 if role else snaps,
        role_versions=snaps if role else None,
        engines=cfg.engines.num_engines if cfg.engines.backend == "embedded" else 0,
        engine_bytes=2 if cfg.engine.dtype == "bf16" else 4,
        engine_cache_tokens=cfg.engine.prefix_cache_tokens,
        wire_bytes=2 if cfg.weights.dtype in ("bfloat16", "float16") else 4,
        adapter_params=0 if spec is None else adapter_numel(cfg.model, spec),
        fused_kernels=t.cpu_fused_kernels,
    )


def memory_parts(cfg: RunConfig, *, trainer_on_gpu: bool = False) -> dict[str, int]:
    """Peak bytes of each part of `cfg`'s run on this node (`memory_plan.process_bytes`)."""
    return memory_plan.process_bytes(run_shape(cfg, trainer_on_gpu=trainer_on_gpu))


PROMPT_TOKENS = 512
"""Prompt tokens per sample the plan assumes for a micro-batch of a fixed sample count (the
data's prompts are not read at start-up); a token budget (--use-dynamic-batch-size) bounds it."""
EMBEDDED_PROMPT_TOKENS = 32
"""The same for the embedded default run, whose built-in tasks' prompts are a few digits."""
MICRO_BATCHES: tuple[tuple[int, bool], ...] = (
    (2048, False),
    (2048, True),
    (1024, True),
    (512, True),
    (256, True),
    (128, True),
)
"""(token budget, full recompute) a CPU trainer's micro-batch is derived from, the fastest
first: the first that fits the memory limit. Measured on SmolLM2's step in bf16
(docs/cpu.md#memory): each micro-batch costs time beyond its tokens (its weight gradients'
products and their adds into the fp32 buffer are the weights' size whatever the tokens), so
2048 tokens with recompute ran faster than 1024 or 512 without and held less; a budget above
2048 was slower."""
LEANEST = MICRO_BATCHES[-1]
BATCH_FLAGS = ("use_dynamic_batch_size", "max_tokens_per_gpu", "recompute_granularity")
REFIT: tuple[Rule, ...] = (snapshots, trainer, resume, weight_dtype, run_config)
"""The rules `--behavior-forward` feeds, in `RULES` order: the snapshot count (the role holds
only pushed versions), the trainer's config (and the resume step that completes it), the
dtype weights travel in (the role reads disk exports) and the `RunConfig`."""
REBATCH: tuple[Rule, ...] = (trainer, resume, run_config)
"""The rules the micro-batch flags feed: the trainer's config (and its resume step), the
`RunConfig`."""


def memory_limit(d: Draft) -> int | None:
    """Bytes the run may take on this node: --memory-limit-gib, else `MEMORY_FRACTION` of the
    node's memory; None on a joined cluster (each node holds its own share) or unknown memory."""
    if d.env.ray_address is not None:
        return None
    if d.args.memory_limit_gib is not None:
        return int(d.args.memory_limit_gib * memory_plan.GIB)
    if d.env.memory_bytes is None:
        return None
    return int(memory_plan.MEMORY_FRACTION * d.env.memory_bytes)


@rule("memory")
def memory(d: Draft) -> None:
    """The run fits in its memory limit (`memory_limit`), or is refused with the numbers and the
    fix before anything starts. A CPU trainer of a user's model whose micro-batching the user
    left unset gets the fastest micro-batch that fits (`MICRO_BATCHES`); a derived
    `--behavior-forward role` that would not fit becomes `trainer` when that fits. GPU trainers
    are checked against their GPU's memory."""
    limit = memory_limit(d)
    gpu = trainer_on_gpu(d)
    if gpu:
        _check_gpu_trainer(d)
    if limit is None:
        return
    mem = None if d.args.memory_limit_gib is not None else d.env.memory_bytes
    leanest = None
    if not gpu and not d.embedded and _batching_unset(d):
        tries = [(d, False)] + ([(_with_trainer_forward(d), True)] if _forward_movable(d) else [])
        for alt, moved in tries:
            fitted = _fit_micro_batch(alt, limit, mem, moved=moved)
            if fitted is not None:
                d.adopt(fitted)
                return
        leanest = _with_micro_batch(tries[-1][0], *LEANEST)
    parts = memory_parts(d.config, trainer_on_gpu=gpu)
    if memory_plan.fits(parts, limit):
        return
    why = memory_plan.describe(parts, limit, mem)
    if _forward_movable(d):
        alt = _with_trainer_forward(d)
        alt_parts = memory_parts(alt.config, trainer_on_gpu=gpu)
        if memory_plan.fits(alt_parts, limit):
            fit = memory_plan.describe(alt_parts, limit, mem)
            _note_trainer_forward(alt, f"the forward-only role would not fit ({why})", fit)
            d.adopt(alt)
            return
    if leanest is not None:  # what the plan tried last: the smallest budget, with recompute
        why = memory_plan.describe(memory_parts(leanest.config), limit, mem)
    fixes = _fixes(leanest or d)  # not what the plan already tried
    raise ValueError(
        f"this run would not fit in its memory: {why}. Fix: {', '.join(fixes)}, a larger "
        "--memory-limit-gib, or a node with more memory (docs/cpu.md#memory)"
    )


def _fixes(d: Draft) -> list[str]:
    """The flags that would shrink `d`'s run, leaving out what it already does."""
    t = d.config.trainer
    out = [] if t.bf16 else ["--bf16 (half the weights)"]
    if not t.use_dynamic_batch_size or (t.max_tokens_per_gpu or 0) > LEANEST[0]:
        out.append("--use-dynamic-batch-size with a smaller --max-tokens-per-gpu")
    if t.recompute_granularity != "full":
        out.append(
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
        )
    if t.keep_old_actor:
        out.append("fewer --max-snapshots or --no-keep-old-actor")
    if d.config.engines.num_engines > 1:
        out.append("fewer --num-engines")
    if d.config.engine.dtype != "bf16":
        out.append("--engine-dtype bf16")
    if not t.lora_rank:
        out.append("--lora-rank (the base frozen: no gradients or Adam state for it)")
    tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
    if t.world_size == 1 and tp * pp == 1:
        out.append("a cluster with more trainer ranks (--actor-num-gpus-per-node, TP/PP)")
    return out


def _check_gpu_trainer(d: Draft) -> None:
    """A GPU trainer rank's model state and activations fit its GPU (when this node's GPUs are
    known: the smallest of them); refused with the numbers otherwise."""
    if not d.env.gpu_memory_bytes:
        return
    gpu = min(d.env.gpu_memory_bytes)
    need = memory_plan.gpu_trainer_bytes(run_shape(d.config, trainer_on_gpu=True))
    if need > memory_plan.MEMORY_FRACTION * gpu:
        g = memory_plan.GIB
        raise ValueError(
            f"a trainer rank would not fit on its GPU: {need / g:.1f} GiB of model state and "
            f"activations, {memory_plan.MEMORY_FRACTION:.0%} of {gpu / g:.1f} GiB allowed. Fix: "
            "more ranks with --tensor-model-parallel-size / --pipeline-model-parallel-size or "
            "--use-distributed-optimizer, a smaller --max-tokens-per-gpu, or full recompute "
            "(docs/cpu.md#memory)"
        )


def _batching_unset(d: Draft) -> bool:
    """The user gave none of the micro-batching flags (`BATCH_FLAGS`; --micro-batch-size is
    derived by run kind)."""
    a = d.args
    given = a.use_dynamic_batch_size or a.max_tokens_per_gpu is not None
    return not given and a.recompute_granularity is None and "micro_batch_size" in d.flags.filled


def _forward_movable(d: Draft) -> bool:
    return d.config.trainer.behavior_forward == "role" and "--behavior-forward" in d.config.derived


def _fit_micro_batch(d: Draft, limit: int, mem: int | None, *, moved: bool = False) -> Draft | None:
    """A copy of `d` with the first of `MICRO_BATCHES` whose run fits `limit` (derived, with the
    numbers); None if none does."""
    for tokens, recompute in MICRO_BATCHES:
        alt = _with_micro_batch(d, tokens, recompute)
        parts = memory_parts(alt.config)
        if memory_plan.fits(parts, limit):
            fit = memory_plan.describe(parts, limit, mem)
            why = f"the fastest micro-batch for a CPU trainer that fits: {fit}"
            if recompute:
                why = f"with full recompute, the fastest that fits: {fit}"
            alt.flags.derived["--max-tokens-per-gpu"] = Derived(tokens, why)
            if moved:
                _note_trainer_forward(alt, "the forward-only role would not fit", fit)
            return alt
    return None


def _with_micro_batch(d: Draft, tokens: int, recompute: bool) -> Draft:
    """A copy of `d` as if `--use-dynamic-batch-size --max-tokens-per-gpu tokens` (and full
    uniform recompute of single layers) had been derived; the `REBATCH` rules run again."""
    alt = d.fork()
    f = alt.flags
    values = {"use_dynamic_batch_size": True, "max_tokens_per_gpu": tokens}
    if recompute:
        values |= {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    for dest, value in values.items():
        setattr(f.args, dest, value)
        f.filled.add(dest)
        f.note(dest, value, "the memory plan (docs/cpu.md#memory)")
    for r in REBATCH:
        r.rerun(alt)
    return alt


def _note_trainer_forward(alt: Draft, why: str, fit: str) -> None:
    alt.flags.derived["--behavior-forward"] = Derived(
        "trainer", f"{why}; with the snapshots in the trainer: {fit}"
    )


def _with_trainer_forward(d: Draft) -> Draft:
    """A copy of `d` as if `--behavior-forward trainer` had been given: its record moves to the
    end (the fallback sets it) and the `REFIT` rules run again."""
    alt = d.fork()
    alt.args.behavior_forward = alt.given["behavior_forward"] = "trainer"
    alt.flags.filled.discard("behavior_forward")
    del alt.flags.derived["--behavior-forward"]
    for r in REFIT:
        r.rerun(alt)
    return alt
