"""What a run says when it loses a trainer rank (its node died, or its collective broke), and
how it is resumed.

Owns `TrainerLostError` (the one-line reason `train_async.py` prints: which rank on which node,
at which step, the newest complete checkpoint and the command that resumes from it),
`last_checkpoint` and `resume_command`. The rest of a trainer group cannot write a checkpoint
once one rank is gone (every rank holds part of the state and a save is a collective), so the
run stops at the newest complete checkpoint in `--save`: the steps after it are trained again on
`--load` (the ledger is cut back to it and the data worker's state is the checkpoint's, so no
group is lost or trained twice). `--save-interval` bounds how many steps that is. Pure, except
for reading `--save`'s checkpoint index.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from slime_async.trainer import checkpoint


class TrainerLostError(RuntimeError):
    """A trainer rank is gone; the message is the whole story (node, rank, checkpoint, resume)."""


def last_checkpoint(save: str | Path | None) -> int | None:
    """The step of the newest complete checkpoint in `save` (None: none, or no --save)."""
    if save is None:
        return None
    try:
        meta = checkpoint.read_meta(checkpoint.find_latest(Path(save), hashes=False))
    except (checkpoint.CheckpointError, OSError, ValueError):
        return None
    return int(meta["version"])


def resume_command(argv: Sequence[str], save: str | Path) -> str:
    """`argv` (the run's own command line, `sys.argv`) with `--load <save>` in place of any
    `--load` it had."""
    out, skip = [], False
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--load":
            skip = True
            continue
        if a.startswith("--load="):
            continue
        out.append(a)
    return shlex.join([Path(sys.executable).name, argv[0], *out, "--load", str(save)])


def trainer_lost_message(
    lost: Sequence[tuple[int, str, str]],
    *,
    step: int,
    save: str | Path | None,
    argv: Sequence[str],
) -> str:
    """One line: what was lost, where the run stands, what to run next."""
    who = "; ".join(f"trainer rank {r} on node {ip}: {why}" for r, ip, why in lost)
    head = f"lost {who}, with {step} step(s) trained"
    if save is None:
        return (
            f"{head}; the run stops. It had no --save, so nothing can be resumed: rerun with "
            "--save DIR (on a filesystem every trainer node mounts) to be able to resume"
        )
    done = last_checkpoint(save)
    if done is None:
        return (
            f"{head}; the run stops. No complete checkpoint in --save {save} yet "
            "(--save-interval not reached): rerun from the start"
        )
    again = (
        ""
        if done >= step
        else f" (step {step} is trained again)"
        if done + 1 == step
        else f" (steps {done + 1}..{step} are trained again)"
    )
    return (
        f"{head}; the run stops at the last complete checkpoint, step {done} in {save}{again}. "
        f"Once the node is back or replaced, resume with: {resume_command(argv, save)}"
    )
