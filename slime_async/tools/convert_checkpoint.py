"""`--ckpt-format torch_dist` checkpoint -> `--ckpt-format torch` checkpoint.

Owns `convert_checkpoint`, `one_rank_trainer` (also `export_hf`'s reader of torch_dist
checkpoints) and the command line::

    python -m slime_async.tools.convert_checkpoint --load runs/x/checkpoints --out runs/x/ckpt-torch

`--load` is a `--save` directory (its latest complete checkpoint) or one `iter_*` directory.
A one-rank trainer is built (the whole model's weights, gradient buffer and Adam state in this
process's memory), loads the checkpoint through `checkpoint.load` (every sha256 and guard), and
saves it with --ckpt-format torch into `--out`, a new --save directory (`iter_N`, `latest`)
whose `model.pt` / `optim.pt` hold the full HF-named tensors. `--load` on it continues the run
exactly (weights, Adam moments, step, extra state); the RNG is re-seeded from seed + version, as
after any world-size change.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from clifields import flag


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ConvertConfig:
    """What to convert and where."""

    load: str | None = flag(None, metavar="CKPT")
    """torch_dist checkpoint to convert (required): a --save directory (its latest complete
    checkpoint) or one iter_* directory in it."""
    out: str | None = flag(None, metavar="DIR")
    """New --save directory to write the torch-format checkpoint into (required; must not
    exist or be empty)."""


def one_rank_trainer(ckpt: Path, meta: dict[str, Any]) -> Any:
    """A world-size-1 `MegatronTrainer` restored from the complete checkpoint `ckpt` (its
    `meta.json` already read): the saved precision and LR schedule, every load guard."""
    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        **(meta.get("lr_schedule") or {}),
        bf16=bool((meta.get("optimizer") or {}).get("bf16")),
        ckpt_format="torch",
        keep_checkpoints=0,
        load=str(ckpt),
    )
    return MegatronTrainer(cfg, ModelSpec.from_dict(meta["spec"]))


def convert_checkpoint(load: str | Path, out: str | Path) -> Path:
    """Write the latest complete torch_dist checkpoint in `load` as a torch-format checkpoint
    in the new --save directory `out`; returns its `iter_*` path."""
    from slime_async.trainer import checkpoint

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory")
    ckpt = checkpoint.find_latest(Path(load))
    meta = checkpoint.read_meta(ckpt)
    if checkpoint.ckpt_format(meta) != "torch_dist":
        raise ValueError(f"{ckpt} is already a torch-format checkpoint (model.pt); nothing to do")
    tr = one_rank_trainer(ckpt, meta)
    try:
        return checkpoint.save(tr, out, extra_state=tr.extra_state)
    finally:
        tr.shutdown()


def main(argv: list[str] | None = None) -> int:
    from slime_async.tools import run_tool
    from slime_async.trainer.checkpoint import CheckpointError

    return run_tool(
        argv,
        prog="python -m slime_async.tools.convert_checkpoint",
        description="Convert a --ckpt-format torch_dist checkpoint into the torch format "
        "(full HF-named model.pt / optim.pt).",
        config=ConvertConfig,
        action=lambda cfg: convert_checkpoint(cfg.load, cfg.out),
        refusals=(CheckpointError, FileExistsError, ValueError),
    )


if __name__ == "__main__":
    sys.exit(main())
