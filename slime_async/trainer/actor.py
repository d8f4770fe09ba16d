"""Thin Ray wrapper around `MegatronTrainer`: one actor per trainer rank, plus a group handle.
One responsibility over 400 lines: every trainer call fanned out to the ranks.

Owns: `TrainStep` (what a train step returns: the new version and the metrics), `TrainerActor` (a `@ray.remote` class with fractional `num_cpus`, so a 2-core node can
schedule trainer, engine, router and data-worker actors together) and `TrainerGroup`, which
starts `world_size` actors on one rendezvous port and fans every call out to all ranks (they
run collectives together), returning rank 0's answer. `TrainerGroup` is also the sender of the
distributed weight transport (`slime_async.weights.WeightSender`): every rank exports (a
collective), rank 0 joins the weight update group and broadcasts. Must never import the
controller, engine, rollout, weights or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weight_buckets import torch_dtype
from slime_async.contracts.weight_group import WeightGroup
from slime_async.contracts.weight_transfer import send_buckets
from slime_async.contracts.weights import HFWeights, TensorEntry, WeightManifest
from slime_async.host import (
    limit_kernel_caches,
    limit_malloc_arenas,
    port_taken,
    rss_bytes,
    trim_heap,
)
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.parallel import free_port

log = logging.getLogger(__name__)

DEFAULT_NUM_CPUS = 0.25
"""Logical CPUs per trainer actor (fractional: see docs/cpu.md, Ray actors on a small node)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainStep:
    """What one train step of the trainer group returns."""

    version: int
    """The trainer's version after the step (optimizer updates so far): what the run records."""
    metrics: dict[str, float]
    """Rank 0's namespaced metrics of the step."""


class _TrainerActorImpl:
    """Actor body: builds the trainer in the actor process (threads set before torch work)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        spec: ModelSpec,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        num_threads: int,
        hf_from_rank0: bool = False,
    ) -> None:
        import torch

        from slime_async.trainer import cpu_compat

        limit_malloc_arenas()  # torch's and Ray's threads share two heaps
        limit_kernel_caches()  # micro-batches of varying token counts
        cpu_compat.import_megatron_lean()  # before anything imports megatron in this process
        torch.set_num_threads(num_threads)
        _gloo_interface(master_addr)
        from slime_async.trainer.trainer import MegatronTrainer

        self.trainer = MegatronTrainer(
            cfg,
            spec,
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            hf_from_rank0=hf_from_rank0,
        )
        self.rank, self.master_addr = rank, master_addr
        self.weight_group: WeightGroup | None = None

    def version(self) -> int:
        return self.trainer.version

    def compute_logprobs(self, batch: TrainerBatch, version: int | None = None) -> tuple[Any, Any]:
        lp, ent = self.trainer.compute_logprobs(batch, version)
        return lp.numpy(), ent.numpy()

    def train_step(self, batch: TrainerBatch) -> tuple[int, dict[str, float]]:
        """One optimizer update; returns (the new version, metrics)."""
        metrics = self.trainer.train_step(batch)
        trim_heap()  # the step's freed activations back to the node (docs/cpu.md#memory)
        return self.trainer.version, metrics

    def snapshot(self) -> int:
        return self.trainer.snapshot()

    def sleep(self, spill_dir: str | None = None) -> dict[str, float]:
        """Close the weight group (the transport forms it again at its next push), keep the
        newest version in the CPU weight cache, offload parameters, gradients and optimizer
        state (`trainer/offload.py`, spilled under `spill_dir`); returns the bytes offloaded,
        this process's resident memory before and after, and the seconds it took."""
        t0, rss = time.monotonic(), rss_bytes()
        self.close_weight_group()
        if spill_dir is not None:
            self.trainer.offload.spill_dir = spill_dir
        freed = self.trainer.sleep()
        trim_heap()
        return {"bytes": float(freed), "rss_before": rss, "rss_after": rss_bytes(),
                "seconds": time.monotonic() - t0}  # fmt: skip

    def wake(self) -> dict[str, float]:
        """Onload: everything `sleep` offloaded back; the resident memory after, and seconds."""
        t0 = time.monotonic()
        self.trainer.wake()
        return {"rss_after": rss_bytes(), "seconds": time.monotonic() - t0}

    def release(self, version: int) -> bool:
        return self.trainer.release(version)

    def save_weights(self, path: str, dtype: str | None = None) -> str:
        """Write the current version as an HF directory (floating tensors in `dtype`, e.g.
        "bfloat16"; None: the parameters' dtype)."""
        cast = None if dtype is None else torch_dtype(dtype)
        return str(self.trainer.save_weights(path, dtype=cast))

    def save_base_weights(self, path: str) -> str:
        return str(self.trainer.save_base_weights(path))

    def save_adapter(self, path: str) -> str:
        return str(self.trainer.save_adapter(path))

    def export_adapter(self) -> Any:
        """The LoRA adapter in PEFT's keys (a collective); rank 0 returns it, the others None."""
        tensors = self.trainer.export_adapter()
        return tensors if self.rank == 0 else None

    def export_weights(self) -> HFWeights | None:
        """The current version's HF tensors in memory (a collective: every rank calls it);
        rank 0 returns them, the others None."""
        w = self.trainer.export_weights()
        return w if self.rank == 0 else None

    def export_weights_put(self) -> list[Any] | None:
        """`[ref]`: the current version's HF tensors in the parameters' dtype, put in the
        object store (a collective); rank 0 returns the ref in a list (so the caller gets the
        ref, not the tensors), the others None."""
        import torch

        w = self.trainer.export_weights(copy=False)  # views, copied right here
        if self.rank != 0:
            return None
        dtype = torch.bfloat16 if self.trainer.cfg.bf16 else torch.float32
        tensors = {k: v.detach().to("cpu", dtype, copy=True) for k, v in w.tensors.items()}
        return [ray.put(dataclasses.replace(w, tensors=tensors))]

    def write_weights_file(self, path: str) -> tuple[str, int]:
        """The current version as one file at `path` (`MegatronTrainer.write_weights_file`; a
        collective): (this rank's Ray node id, the bytes rank 0 wrote; 0 on the others)."""
        n = self.trainer.write_weights_file(path)
        return ray.get_runtime_context().get_node_id(), n

    def save_checkpoint(self, save_dir: str | None, extra_state: dict[str, object]) -> str:
        return str(self.trainer.save_checkpoint(save_dir, extra_state=extra_state))

    def save_hf(self, out: str | None) -> str:
        return str(self.trainer.save_hf(out))

    def extra_state(self) -> dict[str, object]:
        return dict(self.trainer.extra_state)

    # ---------------------------------------------------------------- distributed weight sync
    def weight_endpoint(self) -> tuple[str, int]:
        """This rank's rendezvous address and a free port on its node (rank 0: the sender)."""
        return self.master_addr, free_port()

    def weight_manifest(self, adapter: bool = False) -> WeightManifest:
        """Of the full weights, or (`adapter`) of the LoRA adapter alone; a collective."""
        if adapter:
            return WeightManifest.of(self.trainer.export_adapter(), version=self.trainer.version)
        return self.trainer.export_weights().manifest()

    def open_weight_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
        same_node: bool = True,
    ) -> None:
        self.close_weight_group()
        self.weight_group = WeightGroup.open(
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
            same_node=same_node,
        )

    def send_weights(
        self, buckets: list[tuple[TensorEntry, ...]], flatten: bool, adapter: bool = False
    ) -> int:
        """Every rank exports (a collective) the full weights or (`adapter`) the LoRA adapter in
        PEFT's names; rank 0 broadcasts the buckets. Returns the version."""
        if adapter:
            tensors, version = self.trainer.export_adapter(), self.trainer.version
        else:  # no copy: the buckets are packed from the parameters (nothing trains meanwhile)
            w = self.trainer.export_weights(copy=False)
            tensors, version = w.tensors, w.version
        if self.rank == 0:
            if self.weight_group is None:
                raise RuntimeError("send_weights before open_weight_group")
            g, self.weight_group = self.weight_group, None
            send_buckets(g, tensors, buckets, flatten=flatten)  # aborts the group on failure
            self.weight_group = g
        return version

    def close_weight_group(self) -> None:
        g, self.weight_group = self.weight_group, None
        if g is not None:
            g.close()


def _gloo_interface(master_addr: str) -> None:
    """Off loopback, gloo uses the interface of this node's IP (`host.gloo_interface`)."""
    if not (master_addr.startswith("127.") or master_addr == "localhost"):
        from slime_async.host import gloo_interface

        gloo_interface(ray.util.get_node_ip_address())


TrainerActor = ray.remote(num_cpus=DEFAULT_NUM_CPUS)(_TrainerActorImpl)


class TrainerGroup:
    """`world_size` trainer actors acting as one trainer (calls go to every rank).

    Example::

        group = TrainerGroup(TrainerConfig(), TINY_MOE, world_size=2)
        step = group.train_step(batch)        # all ranks step: step.version, rank 0's metrics
        group.save_weights("/tmp/w_v1")
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        spec: ModelSpec,
        *,
        world_size: int = 1,
        num_cpus_per_actor: float = DEFAULT_NUM_CPUS,
        num_gpus_per_actor: float = 0.0,
        num_threads: int = 1,
        timeout_s: float = 600.0,
        slots: Sequence[Any] | None = None,
        hf_from_rank0: bool = False,
    ) -> None:
        """Without `slots`, `world_size` ranks anywhere on this node, rendezvous on loopback.
        With them (`slime_async.orchestrator.placement.Slot`s: `node_ip`, `port`, `actor_options()`), rank r
        runs in bundle `slots[r]` and the ranks rendezvous on rank 0's node IP at a port found
        free there. `hf_from_rank0`: the start weights (`cfg.hf_checkpoint`) are read by rank 0
        and broadcast, for ranks on nodes that do not hold them."""
        if slots is not None and len(slots) != world_size:
            raise ValueError(f"{len(slots)} trainer slots for world size {world_size}")
        self.timeout_s = timeout_s
        if slots is None:
            addr, port = "127.0.0.1", free_port()
            opts = [{"num_cpus": num_cpus_per_actor, "num_gpus": num_gpus_per_actor}] * world_size
        else:
            addr, port = slots[0].node_ip, slots[0].port
            opts = [s.actor_options() for s in slots]
        if cfg.env_vars:  # --train-env-vars: workers on other nodes never see the driver's
            opts = [{**o, "runtime_env": {"env_vars": cfg.env_vars}} for o in opts]
        self.master = (addr, port)
        self.node_ips = [addr] * world_size if slots is None else [s.node_ip for s in slots]
        """Each rank's node IP (what a lost-rank message names)."""
        self.master_addr = addr
        """Rank 0's rendezvous address (also the weight group's, unless configured)."""
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            self.actors = [
                TrainerActor.options(**opts[r]).remote(
                    cfg,
                    spec,
                    rank=r,
                    world_size=world_size,
                    master_addr=addr,
                    master_port=port,
                    num_threads=num_threads,
                    hf_from_rank0=hf_from_rank0,
                )
                for r in range(world_size)
            ]
            try:
                self._all("version")  # every rank up (raises the build error if any)
                break
            except Exception as e:
                # a port found free on loopback can be taken before rank 0 binds it (another
                # process on the node): build again on another port; never a remote node's
                if (
                    not (addr.startswith("127.") and port_taken(str(e)))
                    or attempt == RENDEZVOUS_ATTEMPTS
                ):
                    self.shutdown()
                    raise
                log.warning(
                    "trainer rendezvous port %d was taken before rank 0 bound it; "
                    "building the trainer again on another (attempt %d of %d)",
                    port,
                    attempt + 1,
                    RENDEZVOUS_ATTEMPTS,
                )
                self.shutdown()
                port = free_port()
                self.master = (addr, port)

    def _all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every rank; the first rank that fails raises at once (a rank whose
        peer died in a collective fails before Ray declares the peer's node dead)."""
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        self._wait_all(refs, f"trainer {method}")
        return ray.get(refs)

    def _wait_all(self, refs: list[Any], what: str) -> None:
        """Wait for every ref; the first that failed raises at once (a rank whose peer died
        waits in its collective: waiting for it too would hang until the timeout)."""
        pending, deadline = list(refs), time.monotonic() + self.timeout_s
        while pending:
            done, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                raise TimeoutError(f"{what} not done after {self.timeout_s:.0f} s")
            ray.get(done)  # raises that rank's error

    def ranks_lost(self, timeout_s: float = 20.0) -> list[tuple[int, str, str]]:
        """(rank, node IP, why) of every rank that does not answer within `timeout_s`: its
        actor died (its node was lost) or it hangs."""
        refs = [a.version.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        lost = []
        for r, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0.1)
            except ray.exceptions.GetTimeoutError:
                lost.append((r, self.node_ips[r], f"no answer within {timeout_s:.0f} s"))
            except ray.exceptions.RayActorError as e:
                lost.append((r, self.node_ips[r], f"its actor is gone ({type(e).__name__})"))
            except Exception:  # it answered with an error: alive
                continue
        return lost

    def version(self) -> int:
        return int(self._all("version")[0])

    def compute_logprobs(self, batch: TrainerBatch, version: int | None = None) -> tuple[Any, Any]:
        """Token-aligned `[B, T]` numpy log-probs and entropies of the trained tokens, 0
        elsewhere (see MegatronTrainer)."""
        ref = ray.put(batch)
        return self._all("compute_logprobs", ref, version)[0]

    def train_step(self, batch: TrainerBatch) -> TrainStep:
        """One optimizer update on every rank: the version it made (every rank's; ranks that
        disagree raise) and rank 0's metrics."""
        ref = ray.put(batch)
        results = self._all("train_step", ref)
        versions = [int(v) for v, _ in results]
        if len(set(versions)) != 1:
            raise RuntimeError(
                f"trainer ranks disagree about the version after a train step: {versions}; "
                "the trainer group is out of step"
            )
        return TrainStep(version=versions[0], metrics=results[0][1])

    def snapshot(self) -> int:
        return int(self._all("snapshot")[0])

    def sleep(self, spill_dir: str | None = None) -> dict[str, float]:
        """Every rank asleep (`_TrainerActorImpl.sleep`); rank 0's bytes, memory, seconds."""
        return self._all("sleep", spill_dir)[0]

    def wake(self) -> dict[str, float]:
        """Every rank awake (`_TrainerActorImpl.wake`); rank 0's memory and seconds."""
        return self._all("wake")[0]

    def release(self, version: int) -> bool:
        return bool(self._all("release", version)[0])

    def save_weights(self, path: str | Path, *, dtype: str | None = None) -> Path:
        return Path(self._all("save_weights", str(path), dtype)[0])

    def save_base_weights(self, path: str | Path) -> Path:
        """LoRA: the frozen base as an HF directory (a collective on every rank)."""
        return Path(self._all("save_base_weights", str(path))[0])

    def save_adapter(self, path: str | Path) -> Path:
        """LoRA: the adapter as a PEFT directory (a collective on every rank)."""
        return Path(self._all("save_adapter", str(path))[0])

    async def export_weights_ref(self) -> Any:
        """A Ray ref to the current version's HF tensors (`HFWeights`, in the parameters'
        dtype), put in the object store by rank 0 and not fetched here (only the ref is): hand
        it to another actor, which receives the tensors."""
        refs = [a.export_weights_put.remote() for a in self.actors]
        return (await asyncio.to_thread(self._all_refs, refs, "weight export"))[0][0]

    async def write_weights_file(self, path: str | Path) -> tuple[str, int]:
        """Rank 0 writes the current version as one file at `path` on its node (every rank
        exports: a collective): (rank 0's Ray node id, the file's bytes)."""
        refs = [a.write_weights_file.remote(str(path)) for a in self.actors]
        return (await asyncio.to_thread(self._all_refs, refs, "weight file"))[0]

    def _all_refs(self, refs: list[Any], what: str) -> list[Any]:
        self._wait_all(refs, what)
        return ray.get(refs)

    def save_checkpoint(
        self, save_dir: str | Path | None = None, *, extra_state: dict[str, object] | None = None
    ) -> Path:
        d = None if save_dir is None else str(save_dir)
        return Path(self._all("save_checkpoint", d, extra_state or {})[0])

    def save_hf(self, out: str | Path | None = None) -> Path:
        """Write the loadable HF directory (`--save-hf`; a collective on every rank)."""
        return Path(self._all("save_hf", None if out is None else str(out))[0])

    def extra_state(self) -> dict[str, object]:
        return self._all("extra_state")[0]

    # ---------------------------------------------------------------- WeightSender (rank 0 sends)
    async def endpoint(self) -> tuple[str, int]:
        return tuple(await self.actors[0].weight_endpoint.remote())  # type: ignore[return-value]

    async def manifest(self) -> WeightManifest:
        refs = [a.weight_manifest.remote() for a in self.actors]
        return (await asyncio.gather(*refs))[0]

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
        await self.actors[0].open_weight_group.remote(
            master_address, master_port, world_size, group_name, backend, timeout_s, same_node
        )

    async def send(self, buckets: Sequence[Sequence[TensorEntry]], *, flatten: bool) -> int:
        plan = [tuple(b) for b in buckets]
        refs = [a.send_weights.remote(plan, flatten) for a in self.actors]
        return int((await asyncio.gather(*refs))[0])

    async def close_group(self) -> None:
        if self.actors:
            await self.actors[0].close_weight_group.remote()

    def adapter_sender(self) -> AdapterSender:
        """This group as the sender of the LoRA adapter alone (the distributed adapter push)."""
        return AdapterSender(self)

    async def export_adapter_ref(self) -> Any:
        """A Ray ref to the current adapter ({PEFT key: fp32 tensor}; a collective): the
        forward-only role fetches it, the driver never does."""
        refs = [a.export_adapter.remote() for a in self.actors]
        await asyncio.to_thread(self._wait_all, refs, "adapter export")
        return refs[0]

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []


RENDEZVOUS_ATTEMPTS = 3
"""Builds of a local trainer group before a rendezvous port race is reported as an error."""


class AdapterSender:
    """A `TrainerGroup` as rank 0 of a weight group that carries the LoRA adapter only (PEFT
    names, fp32): the `WeightSender` of `weights.adapter.DistributedAdapterTransport`."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group

    async def endpoint(self) -> tuple[str, int]:
        return await self.group.endpoint()

    async def manifest(self) -> WeightManifest:
        refs = [a.weight_manifest.remote(True) for a in self.group.actors]
        return (await asyncio.gather(*refs))[0]

    async def open_group(self, **kw: Any) -> None:
        await self.group.open_group(**kw)

    async def send(self, buckets: Sequence[Sequence[TensorEntry]], *, flatten: bool) -> int:
        plan = [tuple(b) for b in buckets]
        refs = [a.send_weights.remote(plan, flatten, True) for a in self.group.actors]
        return int((await asyncio.gather(*refs))[0])

    async def close_group(self) -> None:
        await self.group.close_group()
