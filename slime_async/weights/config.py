"""Configuration of the weight transport: `WeightSyncConfig` and its argparse group.

Owns the flags that choose how a new trainer version reaches the engines (slime's names:
`--update-weight-transport`, `--update-weight-buffer-size`) and their validation. Must never
import torch, Ray or aiohttp: `slime_async.config` imports it to build the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from enum import StrEnum


class TransportKind(StrEnum):
    DISK = "disk"
    """The trainer writes an HF directory; every engine loads it (needs a shared filesystem)."""
    DISTRIBUTED = "distributed"
    """Trainer rank 0 broadcasts the tensors over a process group the engines join."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncConfig:
    """How weights travel from the trainer to the engines."""

    transport: TransportKind = TransportKind.DISTRIBUTED
    """`distributed` (default: no shared filesystem, nothing written per push) or `disk`."""
    bucket_bytes: int = 512 * 1024**2
    """Largest bucket of the distributed transport (one `/update_weights_from_distributed`
    call and, flattened, one broadcast per bucket)."""
    flatten_buckets: bool = True
    """Send each bucket as one flat broadcast (SGLang's `load_format: flattened_bucket`)
    instead of one broadcast per tensor."""
    master_address: str | None = None
    """Rendezvous address of the weight group: trainer rank 0's node IP. None: the address the
    trainer ranks rendezvous on."""
    master_port: int = 0
    """Rendezvous port on rank 0's node; 0 picks a free one there for every group formed."""
    group_name: str = "slime_async_weights"
    """`group_name` of the weight update group on the engines."""
    backend: str | None = None
    """Collective backend: None picks gloo for CPU engines (the embedded engine) and NCCL for
    SGLang engines on GPUs."""
    timeout_s: float = 300.0
    """A group rendezvous, a bucket or a whole push fails after this long."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1024:
            raise ValueError(
                f"--update-weight-buffer-size must be at least 1024 bytes, got {self.bucket_bytes}"
            )
        if not 0 <= self.master_port < 65536:
            raise ValueError(
                f"--update-weight-master-port must be a TCP port, got {self.master_port}"
            )
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"--update-weight-backend must be gloo or nccl, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"--update-weight-timeout must be positive, got {self.timeout_s}")


def add_weight_sync_args(parser: argparse.ArgumentParser) -> None:
    """The weight-transport flags (defaults from `WeightSyncConfig`)."""
    g = parser.add_argument_group("weight sync")
    d = WeightSyncConfig()
    g.add_argument(
        "--update-weight-transport",
        choices=[k.value for k in TransportKind],
        default=None,
        help="How weights reach the engines: 'distributed' (trainer rank 0 broadcasts over a "
        "process group the engines join; no shared filesystem) or 'disk' (an HF directory in "
        f"the run dir that every engine loads). Default: {d.transport.value}, or disk with "
        "--engine-backend external. See docs/weight-sync.md.",
    )
    g.add_argument(
        "--update-weight-buffer-size",
        type=int,
        default=d.bucket_bytes,
        help="Bytes per bucket of the distributed transport (slime's flag).",
    )
    g.add_argument(
        "--update-weight-per-tensor",
        dest="update_weight_flatten",
        action="store_false",
        default=d.flatten_buckets,
        help="Broadcast each tensor separately instead of one flattened buffer per bucket.",
    )
    g.add_argument(
        "--update-weight-master-address",
        default=d.master_address,
        help="Weight group rendezvous address: trainer rank 0's node IP (default: the trainer's "
        "own rendezvous address).",
    )
    g.add_argument(
        "--update-weight-master-port",
        type=int,
        default=d.master_port,
        help="Weight group rendezvous port on rank 0's node (0: a free one).",
    )
    g.add_argument(
        "--update-weight-backend",
        choices=["gloo", "nccl"],
        default=d.backend,
        help="Weight group backend (default: gloo for embedded CPU engines, nccl for SGLang).",
    )
    g.add_argument(
        "--update-weight-timeout",
        type=float,
        default=d.timeout_s,
        help="Seconds before a weight group rendezvous or broadcast fails.",
    )


def weight_sync_config_from_args(args: argparse.Namespace) -> WeightSyncConfig:
    return WeightSyncConfig(
        transport=TransportKind(args.update_weight_transport or WeightSyncConfig().transport),
        bucket_bytes=args.update_weight_buffer_size,
        flatten_buckets=args.update_weight_flatten,
        master_address=args.update_weight_master_address,
        master_port=args.update_weight_master_port,
        backend=args.update_weight_backend,
        timeout_s=args.update_weight_timeout,
    )
