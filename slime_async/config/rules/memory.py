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
from slime_async.config.rules.draft import Draft, Rule, rule
from slime_async.config.rules.serving import weight_dtype
from slime_async.config.rules.training import resume, snapshots, trainer
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
        num_steps=a.num_steps,
        update_weights_interval=a.update_weights_interval,
        save_interval=a.save_interval,
        engines=d.engines,
        colocate=p.colocate,
        trainer_cores=p.trainer_cores,
        rollout_cores=p.rollout_cores,
        warmstart_steps=a.warmstart_steps,
        seed=a.seed,
        loggers=logging_config_from_args(a),
        model=d.env.model,
        rollout=d.rollout,
        data_worker=d.data_worker,
        router=d.router,
        engine=dataclasses.replace(d.engine, auth_token=d.token),
        trainer=d.trainer,
        supervisor=supervisor_config_from_args(a),
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


def memory_parts(cfg: RunConfig) -> dict[str, int]:
    """Bytes each role of `cfg` holds on this node (`memory_plan.role_bytes`)."""
    t = cfg.trainer
    snaps = t.max_snapshots if t.keep_old_actor else 0
    role = t.behavior_forward == "role" and t.keep_old_actor
    lay = (t.tensor_model_parallel_size, t.pipeline_model_parallel_size)
    dp = max(1, t.world_size // (lay[0] * lay[1]))
    spec = lora_spec(t, cfg.model)
    shape = memory_plan.RunShape(
        params=memory_plan.param_count(cfg.model),
        trainer_ranks=t.world_size,
        tp_pp=lay[0] * lay[1],
        dp=dp,
        distributed_optimizer=t.use_distributed_optimizer is not False and dp > 1,
        bf16=t.bf16,
        trainer_snapshots=0 if role else snaps,
        role_versions=snaps if role else None,
        engines=cfg.engines.num_engines if cfg.engines.backend == "embedded" else 0,
        engine_bytes=2 if cfg.engine.dtype == "bf16" else 4,
        adapter_params=0 if spec is None else adapter_numel(cfg.model, spec),
    )
    return memory_plan.role_bytes(shape)


REFIT: tuple[Rule, ...] = (snapshots, trainer, resume, weight_dtype, run_config)
"""The rules `--behavior-forward` feeds, in `RULES` order: the snapshot count (the role holds
only pushed versions), the trainer's config (and the resume step that completes it), the
dtype weights travel in (the role reads disk exports) and the `RunConfig`."""


@rule("memory")
def memory(d: Draft) -> None:
    """A one-node run whose roles would not fit in the node's memory: with a derived
    `--behavior-forward role`, derive `trainer` instead when that fits (the snapshots live in
    the trainer, no second model); otherwise refuse, with the numbers and the fix."""
    mem = d.env.memory_bytes
    if mem is None or d.env.ray_address is not None:  # a joined cluster: nodes of their own
        return
    parts = memory_parts(d.config)
    if memory_plan.fits(parts, mem):
        return
    why = memory_plan.describe(parts, mem)
    if d.config.trainer.behavior_forward == "role" and "--behavior-forward" in d.config.derived:
        alt = _with_trainer_forward(d)
        alt_parts = memory_parts(alt.config)
        if memory_plan.fits(alt_parts, mem):
            alt.flags.derived["--behavior-forward"] = Derived(
                "trainer",
                f"the forward-only role would not fit ({why}); with the snapshots in the "
                f"trainer: {memory_plan.describe(alt_parts, mem)}",
            )
            d.adopt(alt)
            return
    raise ValueError(
        f"this run would not fit in this node's memory: {why}. Fix: --bf16 (half the weights), "
        "fewer --max-snapshots or --no-keep-old-actor, fewer --num-engines, --engine-dtype "
        "bf16, or a node with more memory (docs/cpu.md#memory)"
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
