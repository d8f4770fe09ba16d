"""The rules of what a run trains on and when: its model source and kind, the rollout and eval
settings, the step count, the concurrency, the data worker's staleness budget and the loss.

Rules (in `RULES` order): `gguf`, `embedded`, `run_flags`, `rollout`, `eval`, `steps`,
`inflight`, `data_worker`, `schedule`, `off_policy_drop`, `loss`, `debug_modes`. The math of the budget is
`data_worker.budget` (docs/staleness-budget.md, docs/windowed-fifo.md).
"""

from __future__ import annotations

import dataclasses
import math

from clifields import range_errors
from data_worker.budget import staleness_bound
from data_worker.config import data_worker_config_from_args
from loss import loss_settings_from_args
from loss.slime_cli import SFT_LOSS
from slime_async.config.derive import raise_all
from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.config.rules.draft import Draft, rule
from slime_async.config.run_config import DEFAULT_NUM_ROLLOUT, Derived, RunConfig
from slime_async.rollout.config import SFT_ROLLOUT, rollout_config_from_args
from slime_async.rollout.data.datasets import count_rows
from slime_async.rollout.generate.dump import check_dump_path

__all__ = [
    "data_worker",
    "debug_modes",
    "embedded",
    "eval_settings",
    "gguf",
    "inflight",
    "loss",
    "off_policy_drop",
    "rollout",
    "run_flags",
    "schedule",
    "steps",
]


@rule("gguf")
def gguf(d: Draft) -> None:
    """A .gguf --hf-checkpoint: the trainer reads the HF directory it was converted into (the
    same weights), recorded as derived."""
    if d.env.converted_checkpoint is None:
        return
    d.args.hf_checkpoint = d.env.converted_checkpoint
    why = f"converted from the GGUF file {d.given['hf_checkpoint']}"
    d.flags.note("hf_checkpoint", d.args.hf_checkpoint, why)


@rule("embedded")
def embedded(d: Draft) -> None:
    """The run's kind: the embedded default run (tiny MoE, built-in tasks) unless it names a
    model or data (--hf-checkpoint, --prompt-data, --prompt-source). Many defaults follow it."""
    a = d.args
    d.embedded = a.hf_checkpoint is None and a.prompt_data is None and a.prompt_source is None


@rule("run_flags")
def run_flags(d: Draft) -> None:
    """Rules among the run's own flags (and router flags the run itself sets), checked before
    anything is derived from them."""
    a, errors = d.args, []
    if a.num_steps is not None and a.num_rollout is not None:
        errors.append("give either --num-steps or --num-rollout, not both")
    errors += range_errors(RunConfig, a)
    if a.router_worker_urls:  # the launcher registers exactly the engines it starts
        errors.append(
            "--router-worker-urls cannot apply to train_async.py: the run registers its engines "
            "with its router itself; drop the flag (to attach servers that are already running, "
            "use --engine-backend external --engine-urls URL,...)"
        )
    raise_all(errors)


@rule("rollout")
def rollout(d: Draft) -> None:
    """The rollout settings; an unset --global-batch-size is what one step trains on."""
    d.rollout = rollout_config_from_args(d.args)
    if d.args.global_batch_size is None:
        d.flags.note(
            "global_batch_size",
            d.rollout.global_batch_size,
            "rollout_batch_size x n_samples_per_prompt / num_steps_per_rollout",
        )


_INHERITED = {
    "eval_max_response_len": "--rollout-max-response-len",
    "eval_temperature": "--rollout-temperature",
    "eval_top_p": "--rollout-top-p",
    "eval_top_k": "--rollout-top-k",
}
"""Eval settings an eval sample inherits from training when unset -> the training flag."""


@rule("eval")
def eval_settings(d: Draft) -> None:
    """Record the eval settings `RolloutConfig` resolved for unset flags: the cadence (0 when
    the run has no eval set: said once, here) and, when it evaluates, the rollout settings the
    eval samples inherit."""
    f, r = d.flags, d.rollout
    if f.unset("eval_interval"):
        if r.eval_interval:
            f.note("eval_interval", r.eval_interval, "default: the run has an eval set")
        else:
            why = (
                f"no eval set: {r.no_eval_set_reason}; give --eval-prompt-data NAME PATH to "
                "evaluate"
            )
            f.note("eval_interval", 0, why)
    if not r.eval_interval:
        return
    inherited = dict(_INHERITED)
    if r.eval_prompt_data:
        inherited |= {"eval_input_key": "--input-key", "eval_label_key": "--label-key"}
    if r.reward_key is not None:  # slime's: eval samples read the reward under the same key
        inherited["eval_reward_key"] = "--reward-key"
    for dest, source in inherited.items():
        if f.unset(dest):
            f.note(dest, getattr(r, dest), f"{source}, as training")


@rule("steps", fills=("num_steps",))
def steps(d: Draft) -> None:
    """Unset --num-steps: --num-rollout (default `DEFAULT_NUM_ROLLOUT`; with --num-epoch,
    slime's count: the epochs x the prompt file's rows // --rollout-batch-size) x
    --num-steps-per-rollout. As in slime, --num-epoch counts only when --num-rollout is not
    given (nor --num-steps here): then it is logged as ignored."""
    a, per = d.args, d.rollout.num_steps_per_rollout
    length_given = not d.flags.unset("num_steps") or a.num_rollout is not None
    if length_given and a.num_epoch is not None:
        given = "--num-steps" if a.num_rollout is None else "--num-rollout"
        d.flags.accepted[f"--num-epoch {a.num_epoch}"] = (
            f"ignored: {given} gives the run's length (slime ignores --num-epoch then)"
        )
    if not d.flags.unset("num_steps"):
        return
    if a.num_rollout is None and a.num_epoch is not None:
        rollouts, why = _epoch_rollouts(d)
    else:
        rollouts = DEFAULT_NUM_ROLLOUT if a.num_rollout is None else a.num_rollout
        why = f"--num-rollout {rollouts}"
    d.flags.fill("num_steps", rollouts * per, f"{why} x --num-steps-per-rollout {per}")


def _epoch_rollouts(d: Draft) -> tuple[int, str]:
    """slime's `--num-epoch`: (rollouts, how they were counted) = epochs x (the rows of
    --prompt-data // --rollout-batch-size)."""
    a, batch = d.args, d.rollout.rollout_batch_size
    if a.prompt_data is None:
        raise ValueError(
            f"--num-epoch {a.num_epoch} counts passes over --prompt-data, and this run has no "
            "prompt file; give --num-rollout N (or --num-steps N)"
        )
    rows = count_rows(a.prompt_data)
    if rows < batch:
        raise ValueError(
            f"--num-epoch {a.num_epoch}: {a.prompt_data} has {rows} rows, fewer than one "
            f"--rollout-batch-size {batch}, so an epoch is no rollout; lower "
            "--rollout-batch-size or give --num-rollout N"
        )
    why = f"--num-epoch {a.num_epoch} x ({rows} rows of {a.prompt_data} // --rollout-batch-size {batch})"
    return a.num_epoch * (rows // batch), why


@rule("inflight", fills=("max_inflight",))
def inflight(d: Draft) -> None:
    """slime's per-server concurrency: --max-inflight = --sglang-server-concurrency x engines
    (a --max-inflight that says otherwise is refused)."""
    a, f = d.args, d.flags
    per = a.sglang_server_concurrency
    if per is None:
        return
    n = EngineFleetConfig.from_args(a).num_engines
    if not f.unset("max_inflight") and a.max_inflight != per * n:
        raise ValueError(
            f"--max-inflight {a.max_inflight} contradicts --sglang-server-concurrency {per} x "
            f"{n} engines = {per * n} concurrent generate calls: give one of the two"
        )
    if f.unset("max_inflight"):
        f.fill("max_inflight", per * n, f"--sglang-server-concurrency {per} x {n} engines")


@rule("data_worker")
def data_worker(d: Draft) -> None:
    """The data worker's settings, shaped by the rollout's; records the defaults it resolved
    (--max-inflight, --fifo-window = 2 x groups per step)."""
    f, r = d.flags, d.rollout
    d.data_worker = data_worker_config_from_args(
        d.args,
        n_samples_per_prompt=r.n_samples_per_prompt,
        groups_per_step=r.groups_per_step,
        default_expected_len=r.max_response_len,
    )
    if f.unset("max_inflight"):
        why = "the default (no --sglang-server-concurrency)"
        f.note("max_inflight", d.data_worker.max_inflight, why)
    if d.args.fifo_window is None:
        why = f"2 x groups per step (B = {r.groups_per_step})"
        f.note("fifo_window", d.data_worker.fifo_window, why)


@rule("schedule")
def schedule(d: Draft) -> None:
    """Rules between the weight-push cadence and the data worker's staleness settings: N >= S
    and I - 1 <= S."""
    errors = []
    s, m = d.data_worker.max_staleness, d.data_worker.max_off_policy_steps
    interval = d.args.update_weights_interval
    if m is not None and m < s:
        errors.append(
            f"--max-off-policy-steps {m} < --max-staleness {s}: groups the budget admits would "
            "be dropped; raise it to at least the staleness bound or lower --max-staleness"
        )
    if interval - 1 > s:
        errors.append(
            f"--update-weights-interval {interval} needs --max-staleness >= {interval - 1}: "
            "engines serve a version that old between pushes, so the staleness budget would "
            "stall generation"
        )
    raise_all(errors)


@rule("off_policy_drop", fills=("max_off_policy_steps",))
def off_policy_drop(d: Draft) -> None:
    """Unset `--max-off-policy-steps`: the staleness bound S + ceil((W - 1) / B)
    (`staleness_bound`; the push interval adds nothing: the budget counts against the pushed
    version), so the run never trains a group past the bound it states. The budget keeps every
    group inside it while the engines serve the pushed weights; a group sampled on older ones
    (the backstop: a replacement engine is held out of the router until it has the fleet's
    weights) is dropped and counted instead of trained. Unbounded window: nothing to derive."""
    dw = d.data_worker
    if not d.flags.unset("max_off_policy_steps"):
        return
    bound = staleness_bound(
        max_staleness=dw.max_staleness,
        fifo_window=dw.fifo_window,
        groups_per_step=dw.groups_per_step,
    )
    if math.isinf(bound):
        return
    n, interval = int(bound), d.args.update_weights_interval
    d.flags.fill(
        "max_off_policy_steps",
        n,
        f"the staleness bound S {dw.max_staleness} + ceil((W {dw.fifo_window:g} - 1) / B "
        f"{dw.groups_per_step})"
        + (
            f" (--update-weights-interval {interval} adds none: the budget counts against the "
            "pushed version)"
            if interval > 1
            else ""
        )
        + ": a group sampled on weights older than the pushed ones is dropped, not trained",
    )
    d.data_worker = dataclasses.replace(dw, max_off_policy_steps=n)


@rule("loss")
def loss(d: Draft) -> None:
    """The loss and its config (the `loss` package's flags); its `loss_scale_factor` defaults to the
    rollout's max response length. Records what the loss package derived."""
    d.loss = loss_settings_from_args(
        d.args, default_loss_scale_factor=float(d.rollout.max_response_len)
    )
    for flag, value, why in d.loss.derived:
        d.flags.derived[flag] = Derived(value, why)


@rule("debug_modes", fills=("debug_train_only",))
def debug_modes(d: Draft) -> None:
    """slime's debug modes: --debug-train-only (derived on with --load-debug-rollout-data, as
    slime sets it, and with SFT, which needs no engines), --debug-rollout-only (no trainer);
    the dump paths and what each mode cannot take."""
    a, f = d.args, d.flags
    sft, load = d.loss.loss.name == SFT_LOSS, a.load_debug_rollout_data
    for flag, spec in (
        ("--save-debug-rollout-data", a.save_debug_rollout_data),
        ("--load-debug-rollout-data", load),
    ):
        if spec is not None:
            check_dump_path(spec, flag=flag)
    if a.rollout_function_path == SFT_ROLLOUT and not sft:
        raise ValueError(
            f"--rollout-function-path {SFT_ROLLOUT} is slime's SFT data path; it goes with "
            "--loss-type sft_loss (the RL rollout here is the data worker's)"
        )
    if a.debug_rollout_only:
        _rollout_only(d, sft=sft)
        return
    why = (
        "slime's rule: train from the dumps, without engines"
        if load
        else ("--loss-type sft_loss trains on the data's own responses: no engines")
    )
    if f.unset("debug_train_only") and (load or sft):
        f.fill("debug_train_only", True, why)
    elif a.debug_train_only is False and (load or sft):
        raise ValueError(
            f"--no-debug-train-only: {'--load-debug-rollout-data' if load else 'SFT'} trains "
            "without engines here; drop --no-debug-train-only"
        )
    elif a.debug_train_only and not (load or sft):
        raise ValueError(
            "--debug-train-only trains without engines, from --load-debug-rollout-data PATH "
            "(the dumps of --save-debug-rollout-data) or with --loss-type sft_loss (on "
            "--prompt-data's conversations); give one"
        )
    if a.debug_train_only and a.save_debug_rollout_data is not None:
        raise ValueError(
            "--save-debug-rollout-data: a --debug-train-only run generates nothing to dump"
        )
    if sft and not load and a.prompt_data is None:
        raise ValueError(
            "--loss-type sft_loss trains on conversations: give --prompt-data PATH whose "
            "--input-key field (e.g. messages) holds {role, content} lists, and --hf-checkpoint "
            "with a chat template (or --load-debug-rollout-data to train on dumped responses)"
        )


def _rollout_only(d: Draft, *, sft: bool) -> None:
    """--debug-rollout-only: no trainer, so nothing that trains, saves or resumes one."""
    a = d.args
    given = {
        "--debug-train-only": a.debug_train_only,
        "--load-debug-rollout-data": a.load_debug_rollout_data,
        "--loss-type sft_loss": sft or None,
        "--load": a.load,
        "--save": a.save,
        "--save-hf": a.save_hf,
    }
    if bad := [flag for flag, value in given.items() if value]:
        raise ValueError(
            f"--debug-rollout-only runs no trainer, so {', '.join(bad)} cannot apply; drop "
            f"{'it' if len(bad) == 1 else 'them'} (the engines serve --hf-checkpoint)"
        )
    if a.hf_checkpoint is None and a.warmstart_steps == 0:
        raise ValueError(
            "--debug-rollout-only: the engines serve a checkpoint, and --warmstart-steps 0 "
            "leaves none; give --hf-checkpoint DIR (or let the embedded run warm-start)"
        )
