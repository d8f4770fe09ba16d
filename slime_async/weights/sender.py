"""The sending end of the distributed transport, as the driver sees it.

Owns `WeightSender` (the protocol `DistributedTransport` drives: where rank 0 rendezvous, what it
will send, join/leave the group, send the buckets) and `InProcessSender` (a sender holding its
tensors in this process: benchmarks, tests, and drivers that hold the weights themselves). In a
run the sender is trainer rank 0 (`slime_async.trainer.actor.TrainerGroup`, which implements the
same methods over Ray). Must never import aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from slime_async.contracts.weight_group import WeightGroup
from slime_async.contracts.weight_transfer import send_buckets
from slime_async.contracts.weights import TensorEntry, WeightManifest
from slime_async.host import free_port


class WeightSender(Protocol):
    """Rank 0 of a weight update group."""

    async def endpoint(self) -> tuple[str, int]:
        """Rendezvous address (rank 0's node IP) and a free port on that node."""
        ...

    async def manifest(self) -> WeightManifest:
        """Names, dtypes and shapes of the tensors `send` sends (version: the current one)."""
        ...

    async def open_group(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
        same_node: bool = True,
    ) -> None:
        """Join as rank 0 (returns once every member joined); `same_node`: offer the members
        on this node shared memory (`WeightGroup.open`)."""
        ...

    async def send(self, buckets: Sequence[Sequence[TensorEntry]], *, flatten: bool) -> int:
        """Broadcast the current weights bucket by bucket; returns their version. On failure,
        or once the driver aborted the group (`GroupControl.abort`), the group is aborted and
        left without waiting for the op in flight (the members' receives stop at once) and it
        raises."""
        ...

    async def close_group(self) -> None:
        """Leave the group (no-op when not in one)."""
        ...


class InProcessSender:
    """A sender whose tensors live in this process (`weights()` -> (version, name -> tensor)).

    Example::

        sender = InProcessSender(lambda: (v, model.state_dict()), address="127.0.0.1")
        transport = DistributedTransport(sender=sender, control=router_client, ...)
    """

    def __init__(
        self,
        weights: Callable[[], tuple[int, Mapping[str, torch.Tensor]]],
        *,
        address: str = "127.0.0.1",
        host_id: str | None = None,
    ) -> None:
        self._weights, self.address = weights, address
        self.host_id = host_id
        """The host identity its offer names (None: this process's; a test names another
        node with it)."""
        self._group: WeightGroup | None = None

    async def endpoint(self) -> tuple[str, int]:
        return self.address, free_port()

    async def manifest(self) -> WeightManifest:
        version, tensors = self._weights()
        return WeightManifest.of(tensors, version=version)

    async def open_group(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
        same_node: bool = True,
    ) -> None:
        await self.close_group()
        self._group = await asyncio.to_thread(
            WeightGroup.open,
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
            same_node=same_node,
            host_id=self.host_id,
        )

    async def send(self, buckets: Sequence[Sequence[TensorEntry]], *, flatten: bool) -> int:
        if self._group is None:
            raise RuntimeError("send before open_group: the sender is in no weight group")
        version, tensors = self._weights()
        await asyncio.to_thread(send_buckets, self._group, tensors, buckets, flatten=flatten)
        return version

    async def close_group(self) -> None:
        g, self._group = self._group, None
        if g is not None:
            g.close()
