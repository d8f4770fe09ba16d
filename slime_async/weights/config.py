"""Configuration of the weight transport: `WeightSyncConfig` and its argparse group.

Owns the flags that choose how a new trainer version reaches the engines (slime's names:
`--update-weight-transport`, `--update-weight-buffer-size`) and their validation. Must never
import torch, Ray or aiohttp: `slime_async.config` imports it to build the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import ClassVar, Literal

from clifields import StrEnum, add_flags, check_ranges, flag, from_args


class TransportKind(StrEnum):
    DISK = "disk"
    """The trainer writes an HF directory; every engine loads it (needs a shared filesystem)."""
    DISTRIBUTED = "distributed"
    """Trainer rank 0 broadcasts the tensors over a process group the engines join."""


def _transport_arg(value: str) -> str:
    """`--update-weight-transport` as given, once it names a registered transport (a plugin's
    `MODULE:NAME` is imported here, which registers it); kept as given so that a replayed
    config.json imports the plugin again."""
    from slime_async.weights.registry import resolve_weight_transport

    try:
        resolve_weight_transport(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncConfig:
    """How weights travel from the trainer to the engines."""

    FLAG_PREFIX: ClassVar[str] = "update-weight-"
    """Its flags are `--update-weight-*` (slime's names)."""

    transport: str = flag(
        TransportKind.DISTRIBUTED.value,
        derived="distributed, or disk with an engine backend that does not own its servers",
        parse=_transport_arg,
        metavar="NAME",
    )
    """How weights reach the engines: a registered transport ('distributed': trainer rank 0
    broadcasts over a process group the engines join, no shared filesystem, nothing written per
    push; 'disk': an HF directory in the run dir that every engine loads), or MODULE:NAME of a
    plugin module that registers NAME (`slime_async.weights.register_weight_transport`). See
    docs/weight-sync.md."""
    bucket_bytes: int = flag(512 * 1024**2, name="buffer-size", ge=1024)
    """Bytes per bucket of the distributed transport (slime's flag): one
    `/update_weights_from_distributed` call and, flattened, one broadcast per bucket."""
    dtype: Literal["bfloat16", "float16", "float32"] | None = flag(
        None,
        derived="bfloat16 when the trainer is bf16, or when embedded engines serve bf16 and no "
        "forward-only role reads the disk exports; float32 otherwise",
    )
    """Floating-point dtype the weights travel in, both transports (cast on the trainer; every
    distributed bucket carries a checksum the engine verifies before staging it)."""
    flatten_buckets: bool = flag(True, name="flatten-buckets", off=("--update-weight-per-tensor",))
    """Send each bucket as one flat broadcast (SGLang's `load_format: flattened_bucket`);
    --update-weight-per-tensor broadcasts each tensor separately."""
    master_address: str | None = None
    """Weight group rendezvous address: trainer rank 0's node IP (default: the address the
    trainer ranks rendezvous on)."""
    master_port: int = flag(0, ge=0, lt=65536, hint="a TCP port; 0 = a free one")
    """Weight group rendezvous port on rank 0's node; 0 picks a free one there for every group
    formed."""
    group_name: str = flag("slime_async_weights", cli=False)
    """`group_name` of the weight update group on the engines."""
    backend: str | None = flag(None, choices=("gloo", "nccl"))
    """Weight group collective backend (default: gloo for CPU engines (the embedded engine),
    NCCL for SGLang engines on GPUs)."""
    timeout_s: float = flag(300.0, name="timeout", gt=0)
    """Seconds before a weight group rendezvous, a bucket or a whole push fails."""
    same_node: bool = flag(True, name="same-node")
    """Distributed transport, gloo: hand buckets to the engines on trainer rank 0's node through
    shared memory instead of the socket (each engine decides when the group forms whether it is
    on that node; the others get the broadcast). --no-update-weight-same-node: every engine
    gets the broadcast."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"--update-weight-backend must be gloo or nccl, got {self.backend!r}")


def add_weight_sync_args(parser: argparse.ArgumentParser) -> None:
    """The weight-transport flags: one per `WeightSyncConfig` field (`group_name` is not one)."""
    add_flags(parser, WeightSyncConfig, group="weight sync")


def weight_sync_config_from_args(args: argparse.Namespace) -> WeightSyncConfig:
    """Build the config from `add_weight_sync_args` flags; an unset `--update-weight-transport`
    (not derived by the run) is the `WeightSyncConfig` default."""
    return from_args(WeightSyncConfig, args)
