"""Versioned weight transport from the trainer to the engines, by name and payload.

Owns the built-in transports' registration (one line each, below) and the package's exports.
Every transport pushes the way SGLang keeps requests alive across an update:
`/pause_generation {"mode": "in_place"}` -> the update with `flush_cache: false` ->
`/continue_generation` (`pause.paused_in_place`; docs/weight-sync.md).

| `--update-weight-transport` | payload | class (file) |
|---|---|---|
| `disk` | full | `DiskTransport` (`disk.py`): an HF directory per version, loaded by path |
| `disk` | adapter | `AdapterTransport` (`adapter.py`): a PEFT directory per version |
| `distributed` | full | `DistributedTransport` (`distributed.py`): rank 0 broadcasts, no filesystem |
| `distributed` | adapter | `DistributedAdapterTransport` (`adapter.py`): the adapter over the group |

The two directory transports share `directory.DirectoryTransport`. Adding a transport is one
file with a class implementing `slime_async.contracts.weights.WeightTransport` (its `payload`,
`shared_filesystem`, `writes_directories` and a `from_setup(TransportSetup)` classmethod; a
directory transport inherits `from_setup` and names its `subdir`) plus
one `register_weight_transport("name", TheClass)` line: here for a built-in, or at the end of a
plugin module (`registry.resolve_weight_transport("MODULE:NAME")`). The run selects it by
`--update-weight-transport` and payload (`slime_async.orchestrator.transport`) and uses only
the protocol.
"""

from __future__ import annotations

from slime_async.weights.adapter import AdapterTransport, DistributedAdapterTransport
from slime_async.weights.config import (
    TransportKind,
    WeightSyncConfig,
    add_weight_sync_args,
    weight_sync_config_from_args,
)
from slime_async.weights.directory import DirectoryTransport
from slime_async.weights.disk import DiskTransport
from slime_async.weights.distributed import DistributedTransport, WeightSyncError
from slime_async.weights.registry import (
    available_weight_transports,
    get_weight_transport,
    register_weight_transport,
    resolve_weight_transport,
)
from slime_async.weights.sender import InProcessSender, WeightSender
from slime_async.weights.setup import TransportSetup

register_weight_transport("disk", DiskTransport)
register_weight_transport("disk", AdapterTransport)
register_weight_transport("distributed", DistributedTransport)
register_weight_transport("distributed", DistributedAdapterTransport)

__all__ = [
    "AdapterTransport",
    "DirectoryTransport",
    "DiskTransport",
    "DistributedAdapterTransport",
    "DistributedTransport",
    "InProcessSender",
    "TransportKind",
    "TransportSetup",
    "WeightSender",
    "WeightSyncConfig",
    "WeightSyncError",
    "add_weight_sync_args",
    "available_weight_transports",
    "get_weight_transport",
    "register_weight_transport",
    "resolve_weight_transport",
    "weight_sync_config_from_args",
]
