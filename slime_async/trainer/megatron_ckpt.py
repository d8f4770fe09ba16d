"""Weights from outside this project: a Megatron `torch_dist` checkpoint (what slime's
`tools/convert_hf_to_torch_dist` script writes, or a slime or Megatron run's checkpoint) or a Hugging Face
directory, told apart by what the directory holds.

Owns `WeightsDir` (a directory of weights and its kind), `weights_dir` (tells the kinds apart,
or says why a directory is neither; filesystem only, no torch), `megatron_dist_dir` and
`load_megatron_weights` (this rank's slices of the model weights from a Megatron torch_dist
directory, through megatron-core's `dist_checkpointing`: any TP/PP/EP layout, nothing
gathered). Must never import the controller, engine, rollout or data-worker parts of
`slime_async`.

A Megatron checkpoint directory holds `latest_checkpointed_iteration.txt` naming an iteration
(`release`, or a number N for `iter_000000N/`); the iteration directory (or a directory given
directly) holds `metadata.json` with `"sharded_backend": "torch_dist"` and the PyTorch
Distributed Checkpoint files (`.metadata`, `*.distcp`, `common.pt`). The model's tensors are
stored under megatron-core's sharded keys (`decoder.layers.self_attention.linear_qkv.weight`,
...), the same keys this trainer's model gives, so a checkpoint of the same architecture loads
into it whatever its parallel layout; only the model weights are read (a slime run's optimizer
state is not, nor is `common.pt`, the run's pickled args and counters). Reading unpickles the
checkpoint's `.metadata` (PyTorch's format): give only checkpoints you trust, as with a plug-in
module (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's file naming the newest iteration of a checkpoint directory."""
_HF_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


@dataclasses.dataclass(frozen=True, slots=True)
class WeightsDir:
    """A directory of model weights and what it is."""

    kind: Literal["hf", "torch_dist"]
    """hf: a Hugging Face directory (config.json and weights); torch_dist: a Megatron
    dist_checkpointing directory."""
    path: Path
    """The directory the weights are read from (for torch_dist: the iteration's)."""
    iteration: str | None = None
    """torch_dist: the iteration (`release`, or the number) the tracker file named."""

    def describe(self) -> str:
        """One phrase for messages and the `accepted:` line."""
        if self.kind == "hf":
            return "a Hugging Face directory"
        at = f", iteration {self.iteration}" if self.iteration else ""
        return f"a Megatron torch_dist checkpoint ({self.path}{at})"


def megatron_dist_dir(path: Path) -> WeightsDir | None:
    """The torch_dist directory of the Megatron checkpoint at `path`: `path` itself (it holds
    metadata.json), or the iteration its tracker file names; None when `path` is not a
    Megatron checkpoint. Raises ValueError naming the path for a Megatron checkpoint that
    cannot be read here (a tracker naming a missing iteration, another backend, the legacy
    `mp_rank_*` torch format)."""
    iteration = None
    tracker = path / TRACKER
    if tracker.is_file():
        iteration = tracker.read_text().strip()
        name = iteration if iteration == "release" else _iter_name(iteration, tracker)
        if not (path / name).is_dir():
            raise ValueError(
                f"{path} is a Megatron checkpoint whose {TRACKER} names iteration {iteration}, "
                f"but {path / name} does not exist"
            )
        path = path / name
    meta = path / "metadata.json"
    if not meta.is_file():
        if iteration is None:
            return None
        legacy = any(path.glob("mp_rank_*"))
        raise ValueError(
            f"{path} is a Megatron checkpoint "
            + (
                "in the legacy torch format (mp_rank_*/), which this trainer does not read; "
                "convert the model to Hugging Face and give that directory"
                if legacy
                else "without metadata.json (not a dist_checkpointing directory)"
            )
        )
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"unreadable {meta} ({e})") from None
    if backend != "torch_dist":
        raise ValueError(
            f"{path} is a Megatron dist checkpoint with sharded_backend {backend!r}; only "
            "torch_dist (slime's and Megatron's default) is read here"
        )
    return WeightsDir("torch_dist", path, iteration)


def _iter_name(text: str, tracker: Path) -> str:
    try:
        return f"iter_{int(text):07d}"
    except ValueError:
        raise ValueError(
            f"{tracker} (a Megatron checkpoint's) holds {text!r}, not an iteration number or "
            "'release'"
        ) from None


def weights_dir(path: Path) -> WeightsDir | str:
    """What `path` holds: a Hugging Face directory or a Megatron torch_dist checkpoint, else
    the reason it is neither (a sentence without the flag)."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    try:
        megatron = megatron_dist_dir(path)
    except ValueError as e:
        return f"cannot be read: {e}"
    if megatron is not None:
        return megatron
    if (path / "config.json").is_file():
        if any(next(path.glob(p), None) for p in _HF_WEIGHTS):
            return WeightsDir("hf", path)
        return "holds a config.json but no weights (*.safetensors or pytorch_model*.bin)"
    found = sorted(p.name for p in path.iterdir())[:8]
    return (
        f"is neither a Hugging Face directory (config.json and *.safetensors) nor a Megatron "
        f"torch_dist checkpoint ({TRACKER}, or metadata.json with sharded_backend torch_dist); "
        f"it holds {found}"
    )


def load_megatron_weights(chunks: list[Any], path: Path) -> None:
    """Read this rank's slices of every model chunk's weights from the torch_dist directory
    `path` (collective over the trainer's ranks; cast to the parameters' dtype). Raises
    ValueError naming the directory when its tensors do not fit this model."""
    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from slime_async.trainer import dist_ckpt

    template = {f"model{i}": dist_ckpt.model_state(c) for i, c in enumerate(chunks)}
    dests = [(p, leaf.data) for p, leaf in dist_ckpt.walk(template)]
    try:
        loaded = dist_checkpointing.load(template, str(path), common_strategy=_no_common())
    except (Exception, CheckpointException) as e:  # torch's is a BaseException
        raise ValueError(
            f"{path}: its tensors do not fit this model ({_first_line(e)}); give a checkpoint "
            "of the same architecture as --hf-checkpoint"
        ) from None
    with torch.no_grad():
        for p, dest in dests:
            dest.copy_(dist_ckpt.get(loaded, p).view_as(dest))


def _first_line(e: BaseException) -> str:
    """The cause of a failed load in one line: the innermost error megatron reported (torch
    wraps each rank's failure with its traceback)."""
    lines = [ln.strip() for ln in str(e).splitlines() if "Exception:" in ln or "Error:" in ln]
    return lines[-1] if lines else f"{type(e).__name__}: {e}"


def _no_common() -> Any:
    """dist_checkpointing's common-state reader that reads nothing: a Megatron run's common.pt
    (its args, iteration, RNG and rerun state: pickled objects) is not what this trainer loads,
    so it is never unpickled."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class NoCommon(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> dict[str, Any]:
            return {}

    return NoCommon()
