"""What a run starts from and what it writes: the rules between `--load`, `--save`,
`--save-hf`, `--hf-checkpoint` and the warm start, checked when the flags are parsed (before Ray
starts).

Owns `resume_from` (slime's `--load D --save D` on an empty D starts fresh), `start_weights`
(--load naming a Megatron torch_dist checkpoint or an HF directory: a new run from its
weights), `check_resume`
(every refusal about the checkpoint a resume would load), the batch shape a checkpoint records
(`batch_shape`, `check_batch_shape`), `derive_save_hf` and `derive_warmstart`. Pure: the directory facts come in through `Environment` (gathered by
`slime_async.config.read_environment`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from loss import resolve_loss_spec
from loss.regularizers import with_regularizers
from slime_async.config.derive import Flags, raise_all
from slime_async.config.run_config import Derived, Environment, RunConfig, run_default
from slime_async.contracts.model import ModelSpec
from slime_async.trainer import hf_save
from slime_async.trainer.config import TrainerConfig

__all__ = ["check_resume", "derive_save_hf", "derive_warmstart", "resume_from", "start_weights"]


def start_weights(f: Flags, env: Environment) -> str | None:
    """The weights the trainer starts from when --load names weights, not a checkpoint of
    train_async.py (a Megatron torch_dist checkpoint such as slime's, or an HF directory): a
    new run from them, recorded as `derived: --load None`; None otherwise. Saving into that
    directory is refused (this run's checkpoints would mix with what it holds)."""
    a, facts = f.args, env.load
    if facts is None or facts.weights is None:
        return None
    what = facts.weights.describe()
    if a.save is not None and os.path.abspath(a.load) == os.path.abspath(a.save):
        raise ValueError(
            f"--load {a.load} is {what}, not a checkpoint of train_async.py, and --save names "
            "the same directory: this run's checkpoints would be written among its files; give "
            "--save another directory"
        )
    f.derived["--load"] = Derived(
        None,
        f"--load {a.load} is {what}, not a checkpoint of train_async.py: a new run starts from "
        "its weights, with a fresh optimizer and prompt order (a slime run's optimizer and "
        "data state are not read)",
    )
    return str(a.load)


def resume_from(f: Flags, env: Environment, *, embedded: bool) -> str | None:
    """The directory the trainer resumes from: --load, unless it holds nothing yet and --save
    names the same directory (slime's `--load D --save D`: the first run starts fresh, a rerun
    resumes), or it holds weights to start from (`start_weights`). The flag stays as given; the
    run records why it does not resume."""
    a, facts = f.args, env.load
    if facts is not None and facts.weights is not None:
        return None
    if facts is None or not facts.empty:
        return a.load
    what = "is empty" if facts.exists else "does not exist"
    if a.save is None or os.path.abspath(a.load) != os.path.abspath(a.save):
        raise ValueError(
            f"--load {a.load} {what}: no checkpoint to resume, and this run would not start "
            f"fresh on its own; fix the path, drop --load to start a new run, or give --save "
            f"{a.load} too (a first run starts fresh and saves there, a rerun resumes, as slime's "
            "--load D --save D)"
        )
    start = (
        f"--hf-checkpoint {a.hf_checkpoint}"
        if a.hf_checkpoint
        else "the embedded default's start (its warm start, if any)"
        if embedded
        else "the model's initial weights"
    )
    f.derived["--load"] = Derived(
        None,
        f"--load {a.load} {what}, no checkpoint yet: starting fresh from {start}, as slime "
        "does; --save writes there, so a rerun with the same flags resumes",
    )
    return None


def check_resume(a: argparse.Namespace, env: Environment, trainer: TrainerConfig) -> None:
    """Every refusal about the checkpoint a resume loads, before anything starts (the trainer's
    load repeats them, and checks the files' sha256)."""
    facts = env.load
    if trainer.load is None or facts is None:
        return
    if facts.problem is not None:
        raise ValueError(facts.problem)
    where = f"--load {a.load}"
    if facts.version == 0:
        raise ValueError(
            f"{where}: checkpoint {facts.checkpoint} is iteration 0 (untrained initial weights); "
            "resuming it would push initial weights to the engines as if trained; start a new "
            "run with --hf-checkpoint instead of --load"
        )
    from slime_async.trainer.checkpoint import CheckpointError, check_spec

    try:
        check_spec(
            ModelSpec.from_dict(facts.spec), env.model, where=f"{where} ({facts.checkpoint})"
        )
    except CheckpointError as e:
        raise ValueError(
            f"{e} (this run's model is "
            f"{'--hf-checkpoint ' + str(a.hf_checkpoint) if a.hf_checkpoint else 'the tiny MoE'})"
        ) from None
    if not facts.has_worker_state:
        raise ValueError(
            f"{where}: checkpoint {facts.checkpoint} holds no data-worker state (it was not "
            "written by train_async.py), so a resume would lose or repeat prompts; start from "
            "its weights with --hf-checkpoint instead of --load"
        )
    if facts.step is not None and int(facts.step) != facts.version:
        raise ValueError(
            f"{where}: checkpoint {facts.checkpoint} says step {facts.step} but holds version "
            f"{facts.version}; the checkpoint is inconsistent, load an earlier one"
        )
    needs = with_regularizers(resolve_loss_spec(trainer.loss.name), trainer.loss.regularizers)
    if needs.needs.reference_logprobs and a.ref_load is None:
        raise ValueError(
            f"--use-kl-loss with {where}: the resumed weights are not the run's reference "
            "policy; give --ref-load with the HF directory the run started from (its "
            "--hf-checkpoint, or RUN_DIR/warmstart for the embedded default)"
        )


def derive_save_hf(f: Flags, *, embedded: bool, gguf: str | None) -> None:
    """`--save-hf`: when unset, `<run-dir>/hf` for a run that would otherwise keep no model
    (the embedded default run, a user's model without --save); a run with --save keeps it in
    its checkpoints, and says so. 'none' turns it off. Refused where replacing it (or, with
    --lora-rank, its adapter directory beside it) would delete or clash with the run's other
    paths or with data not written by --save-hf."""
    a = f.args
    if f.unset("save_hf"):
        if not embedded and a.save is not None:
            f.note(
                "save_hf",
                "none",
                f"the trained model is kept in --save {a.save}'s checkpoints (python -m "
                "slime_async.tools.export_hf turns one into a Hugging Face directory); give "
                "--save-hf DIR to also export it at every save",
            )
            return
        why = (
            "the embedded default run keeps its model"
            if embedded
            else "a run without --save keeps its trained model here (--save-hf none: keep none)"
        )
        f.fill("save_hf", str(Path(a.run_dir) / "hf"), why)
    elif a.save_hf.strip().lower() in ("", "none"):
        a.save_hf = None
        return
    paths = {
        "--run-dir": a.run_dir,
        "--save": a.save,
        "--load": a.load,
        "--hf-checkpoint": a.hf_checkpoint,
        "--ref-load": a.ref_load,
    }
    if gguf and gguf != a.hf_checkpoint and Path(gguf).exists():
        paths["the GGUF file"] = gguf
    errors = hf_save.target_errors(a.save_hf, paths=paths, lora=bool(a.lora_rank))
    if errors and "--save-hf" in f.derived:
        errors.append("(--save-hf was derived: pass --save-hf DIR elsewhere, or --save-hf none)")
    raise_all(errors)


def derive_warmstart(f: Flags, *, embedded: bool, resume: bool) -> None:
    """Warm start applies only to a fresh embedded default run (tiny MoE, built-in tasks)."""
    a = f.args
    why_not = None  # why a warm start cannot apply to this run
    if resume:
        why_not = "the run resumes from --load, whose checkpoint holds the trained weights"
    elif not embedded:
        why_not = (
            "warm start trains the tiny MoE on the built-in tasks, and this run has "
            "--hf-checkpoint/--prompt-data/--prompt-source"
        )
    if f.unset("warmstart_steps"):
        default = run_default("warmstart_steps")
        f.fill(
            "warmstart_steps",
            0 if why_not else default,
            why_not or "default of the embedded default run",
        )
    elif a.warmstart_steps > 0 and why_not:
        raise ValueError(
            f"--warmstart-steps {a.warmstart_steps} cannot apply: {why_not}; drop --warmstart-steps"
        )


_SHAPE_FLAGS = {
    "rollout_batch_size": "--rollout-batch-size",
    "n_samples_per_prompt": "--n-samples-per-prompt",
    "global_batch_size": "--global-batch-size",
    "num_steps_per_rollout": "--num-steps-per-rollout",
}
"""The rollout fields that fix what one step trains on -> their flags."""


def batch_shape(cfg: RunConfig) -> dict[str, int]:
    """The flags that fix what one step trains on; a resume must keep them (saved in the
    checkpoint's extra state)."""
    return {k: int(getattr(cfg.rollout, k)) for k in _SHAPE_FLAGS}


def check_batch_shape(saved: object, cfg: RunConfig, *, where: str) -> None:
    """Refuse a resume whose batch shape differs from the checkpoint's: the data worker's pending
    groups, the ledger and the step counter all assume the saved shape."""
    if saved is None:  # a checkpoint from before the shape was recorded
        return
    now = batch_shape(cfg)
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint in {where}: batch_shape is {saved!r}, not an object")
    diff = [
        (flag, saved.get(k), now[k]) for k, flag in _SHAPE_FLAGS.items() if saved.get(k) != now[k]
    ]
    if diff:
        was = " ".join(f"{flag} {old}" for flag, old, _ in diff)
        now_s = ", ".join(f"{flag} {new}" for flag, _, new in diff)
        raise ValueError(
            f"--load {where}: the checkpoint was trained with {was}, this run has {now_s}; a "
            f"resume must keep the batch shape (pending groups and the prompt ledger assume it). "
            f"Pass {was}, or start a new run from its weights with --hf-checkpoint."
        )
