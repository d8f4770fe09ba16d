"""The forward-only role: π_j^Meg of finished samples, off the trainer's critical path.

Owns: `BehaviorForwarder` (in the role's own process: a forward-only megatron model built
exactly as the trainer's (`forward_only.ForwardOnlyModel`: no gradient buffers, optimizer or
gradients), world size 1, with the weights of every version the engines served, computing each
sample's token log-probs under the version that sampled the token), its Ray actor
`BehaviorActor` and the driver-side handle `BehaviorRole`. With `--behavior-forward role` the
run gives it each version's exported weights before the engines load them (the directory the
disk transport writes; otherwise one file trainer rank 0 writes in this node's memory file
system, in the parameters' dtype, which the role maps and removes (`add_version_file`), or,
with rank 0 on another node, the trainer's tensors through Ray's object store) and asks it
for every finished sample's log-probs; the trainer then reads them from
`TrainerBatch.behavior_logprobs` instead of swapping in snapshots during the train step.

Memory: the role holds at most `max_versions` versions and nothing else per parameter: its
model's parameters are the newest version's tensors, a forward points them at the version it
needs (`SnapshotStore.pointed_at`), and a new version is either the trainer's mapped file of
its parameters itself (`SnapshotStore.adopt_tensors`: no copy) or loaded, one tensor at a
time, into the storage of the version it evicts (`SnapshotStore.vacate` / `adopt`). The run releases the
versions no sample still to come can carry (`release_below`, before each train step and each
push, and with every log-prob request, which carries the data worker's floor as it was when the
request was sent, so versions go before the next forward, not behind the forwards queued
before a release): `max_versions` is the staleness bound's worst case, the role holds what the
samples in flight need.
Must never import the controller, engine, rollout or data-worker parts of `slime_async`.

With LoRA (`--lora-rank`) the role shares the base: it loads the frozen base once (`set_base`,
the start-up export the engines serve the adapter over) and keeps one adapter per version (its
snapshots hold the adapter parameters only, like the trainer's), each loaded from the adapter
directory the disk transport writes or the trainer's in-memory adapter (`add_version`).

Same values: the weights are the trainer's own parameters (the export is a lossless copy of
them, in the parameters' dtype), and the forward is the trainer's own
`LogprobForwards.compute_logprobs` with the trainer's settings and code path (temperature,
packing, micro-batching, R3 replay of the engine's routing). Only the grouping of samples into micro-batches differs from the train step's, which
can move a log-prob by float rounding (≤ 1e-6 in fp32; tests/test_behavior_role.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from loss import LossSelection
from slime_async.contracts.adapter import read_peft_dir
from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weights import HFWeights
from slime_async.host import limit_kernel_caches, limit_malloc_arenas, trim_heap
from slime_async.trainer import weights_io
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.lora import is_adapter_param
from slime_async.trainer.snapshots import SnapshotStore

log = logging.getLogger(__name__)


class BehaviorForwarder:
    """A forward-only copy of the trainer's model and the versions' weights it was given.

    Example::

        fwd = BehaviorForwarder(cfg, spec, max_versions=3)
        fwd.add_version(4, "run/weights/v000004")      # the export the engines load
        lp = fwd.logprobs(batch)                         # [B, T]; NaN where not computed
    """

    def __init__(self, cfg: TrainerConfig, spec: ModelSpec, *, max_versions: int) -> None:
        from slime_async.trainer.forward_only import ForwardOnlyModel

        role_cfg = dataclasses.replace(
            cfg,
            keep_old_actor=False,
            behavior_forward="trainer",
            load=None,
            save=None,
            hf_checkpoint=None,
            ref_load=None,
            tensor_model_parallel_size=1,
            expert_model_parallel_size=1,
            expert_tensor_parallel_size=None,
            pipeline_model_parallel_size=1,
            virtual_pipeline_model_parallel_size=None,
            use_distributed_optimizer=None,
            loss=LossSelection(name="ppo"),  # reads nothing extra: no reference weights
            # eager kernels: off the train step's path, the role would spend Inductor's compile
            # and memory on the rollout cores for forwards nobody waits on (docs/cpu.md)
            cpu_fused_kernels=False,
        )
        self.trainer = ForwardOnlyModel(role_cfg, spec)  # no grads, DDP buffers or optimizer
        adapters = self.trainer.lora is not None
        self.store = SnapshotStore(max_versions, keep=is_adapter_param if adapters else None)
        """Per version: every parameter, or with LoRA the adapters only (the base is shared)."""
        self.base_set = not adapters
        """With LoRA: whether `set_base` loaded the frozen base (versions need it first)."""

    def versions(self) -> list[int]:
        return self.store.versions()

    def set_base(self, path: str | Path) -> None:
        """LoRA: load the frozen base once (the HF directory of `save_base_weights`)."""
        if self.trainer.lora is None:
            raise ValueError("set_base is for --lora-rank: without it every version is whole")
        self.trainer.import_hf(path)
        self.base_set = True

    def add_version(
        self, version: int, source: str | Path | HFWeights | dict[str, torch.Tensor]
    ) -> list[int]:
        """Load version `version` from its exported HF directory or the exported tensors
        themselves, and keep it; returns the evicted versions. With LoRA: from the version's
        PEFT adapter directory or adapter tensors (PEFT keys), over the base of `set_base`."""
        evicted = self.store.vacate(self.trainer.model)  # load into storage no version holds
        if self.trainer.lora is not None:
            if not self.base_set:
                raise ValueError(f"adapter v{version} given before the base (call set_base)")
            if isinstance(source, dict):
                tensors = source
            else:
                spec, tensors, _ = read_peft_dir(source, model=self.trainer.spec)
                if spec.rank != self.trainer.lora.rank or spec.targets != self.trainer.lora.targets:
                    raise ValueError(f"{source}: the adapter's rank/targets are not this run's")
            self.trainer.import_adapter(tensors)
        elif isinstance(source, HFWeights):
            if source.version != version:
                raise ValueError(f"weights of version {source.version} given as version {version}")
            self.trainer.import_weights(source, where=f"the trainer's export of v{version}")
        else:
            self.trainer.import_hf(source)
        return evicted + self.store.adopt(self.trainer.model, version)

    def add_version_file(self, version: int, path: str | Path) -> list[int]:
        """Load version `version` from the one-file export the trainer wrote for this process
        (`MegatronTrainer.write_weights_file`, on this node's memory file system), removing the
        file once it is mapped; returns the evicted versions. The tensors are read in place,
        in the dtype they were written in (the parameters'). A file of the parameters
        themselves (`weights_io.PARAMS_LAYOUT`) is the version: its mapped pages are served
        as they are (`SnapshotStore.adopt_tensors`: no copy, nothing allocated), and go back
        to the node when the version is released or evicted."""
        tensors, meta = weights_io.map_tensor_file(path, unlink=True)
        if int(meta.get("weight_version", version)) != version:
            raise ValueError(f"{path} holds version {meta['weight_version']}, not {version}")
        if meta.get("layout") == weights_io.PARAMS_LAYOUT:  # the parameters themselves
            if self.store.keep is not None:
                raise ValueError(f"{path} holds whole parameters; this role keeps adapters")
            return self.store.adopt_tensors(self.trainer.model, version, tensors)
        w = HFWeights(version=version, spec=self.trainer.spec, tensors=tensors)
        return self.add_version(version, w)

    def release_below(self, oldest: int) -> list[int]:
        """Drop the versions older than `oldest` (no sample still to come carries them: the
        run's `RolloutDataWorker.oldest_unfinished_version`), never the newest (the model's
        parameters are its tensors); returns the released versions. Their memory goes back
        to the node; a later version is loaded into fresh storage (`SnapshotStore.vacate`)."""
        held = self.store.versions()
        gone = [v for v in held[:-1] if v < oldest]
        for v in gone:
            self.store.release(v)
        return gone

    @torch.no_grad()
    def logprobs(self, batch: TrainerBatch) -> np.ndarray:
        """`[B, T]` float32: each trained token's log-prob under the weights of the version that
        sampled it (`batch.token_versions`); NaN where the token is not trained or its version
        is not held."""
        out = torch.full(tuple(batch.tokens.shape), float("nan"))
        mask = batch.loss_mask
        for v in sorted({int(x) for x in batch.token_versions[mask].unique()}):
            if v not in self.store:
                continue
            sel = mask & (batch.token_versions == v)
            rows = [i for i in range(batch.size) if bool(sel[i].any())]
            # only v's own tokens go through the LM head (a row may hold tokens of other versions)
            part = dataclasses.replace(batch.select(rows), loss_mask=sel[rows])
            with self.store.pointed_at(self.trainer.model, v):
                lp, _ = self.trainer.compute_logprobs(part)
            full = torch.full_like(out, float("nan"))
            full[rows, : lp.shape[1]] = lp.float()
            out = torch.where(sel, full, out)
        return out.numpy()


def request_floor(batch: TrainerBatch, floor: Callable[[], int] | None) -> int | None:
    """The release floor a `logprobs` request carries: `floor()`, capped at the oldest version
    among the batch's trained tokens; None without a `floor`."""
    if floor is None:
        return None
    out = int(floor())
    versions = batch.token_versions[batch.loss_mask]
    return min(out, int(versions.min())) if versions.numel() else out


class _BehaviorActorImpl:
    """Actor body: sets the thread count, then builds the forwarder in the actor process."""

    def __init__(
        self, cfg: TrainerConfig, spec: ModelSpec, *, max_versions: int, num_threads: int
    ) -> None:
        from slime_async.trainer import cpu_compat

        limit_malloc_arenas()
        limit_kernel_caches()  # requests of varying token counts
        cpu_compat.import_megatron_lean()  # before anything imports megatron in this process
        torch.set_num_threads(num_threads)
        self.fwd = BehaviorForwarder(cfg, spec, max_versions=max_versions)

    def ready(self) -> bool:
        return True

    def where(self) -> tuple[str, int]:
        """(this node's IP, the bytes of one version of the model)."""
        return ray.util.get_node_ip_address(), self.fwd.trainer.parameter_bytes()

    def add_version(self, version: int, source: str | HFWeights | dict) -> list[int]:
        return self.fwd.add_version(version, source)

    def add_version_file(self, version: int, path: str) -> list[int]:
        out = self.fwd.add_version_file(version, path)
        trim_heap()
        return out

    def set_base(self, path: str) -> None:
        self.fwd.set_base(path)

    def release_below(self, oldest: int) -> list[int]:
        """`BehaviorForwarder.release_below`; returns the versions held after it."""
        if self.fwd.release_below(oldest):
            trim_heap()  # the released versions' pages back to the node
        return self.fwd.versions()

    def versions(self) -> list[int]:
        return self.fwd.versions()

    def logprobs(self, batch: TrainerBatch, floor: int | None = None) -> np.ndarray:
        """`BehaviorForwarder.logprobs`, after dropping the versions older than `floor` (the
        oldest version a sample still to come can carry, as the driver knew it when it sent
        this request: no later request needs an older one)."""
        if floor is not None:
            self.fwd.release_below(floor)
        out = self.fwd.logprobs(batch)
        trim_heap()  # the forwards' freed tensors (and released versions) back to the node
        return out


BehaviorActor = ray.remote(num_cpus=0)(_BehaviorActorImpl)


class BehaviorRole:
    """Driver-side handle of the forward-only role (one Ray actor; calls run in order).

    `add_version` is queued before any later `logprobs` call, so a version given before the
    engines serve it is loaded before any sample of it is asked for.
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        spec: ModelSpec,
        *,
        num_threads: int = 1,
        timeout_s: float = 600,
        actor_options: dict[str, Any] | None = None,
    ) -> None:
        """`actor_options`: Ray `.options(...)` of the role's actor (the run keeps it on the
        driver's node, where the exported versions it reads are)."""
        self.timeout_s = timeout_s
        self.actor = BehaviorActor.options(**(actor_options or {})).remote(
            cfg, spec, max_versions=cfg.max_snapshots, num_threads=num_threads
        )
        ray.get(self.actor.ready.remote(), timeout=timeout_s)  # raises the build error, if any
        self.node_ip, self.version_bytes = ray.get(self.actor.where.remote(), timeout=timeout_s)
        self._held_ref: Any = None
        self._held: int | None = None
        self.floor: Callable[[], int] | None = None
        """The oldest version a token of a sample not yet finished can carry (the run sets the
        data worker's `oldest_unfinished_version` once the worker exists): sent with each
        `logprobs` request, so the role drops what nothing needs before that forward, not
        only when the run releases between steps (`release_below`)."""
        self.file_prefix = f"slime_async-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        """Of this run's one-file versions in `weights_io.SHM_DIR` (`version_file`)."""

    def version_file(self, version: int, writer_ip: str) -> Path | None:
        """Where a writer on the node `writer_ip` puts `version` for this role to map
        (`add_version_file`): this node's memory file system, when the writer is on this node
        and it has room for two versions; None otherwise (the object store then)."""
        d = weights_io.SHM_DIR
        here = writer_ip in (self.node_ip, "127.0.0.1")  # loopback: ranks on the driver's node
        if not here or not d.is_dir():
            return None
        if shutil.disk_usage(d).free < 2 * self.version_bytes:
            return None
        return d / f"{self.file_prefix}v{version:06d}.safetensors"

    def add_version(self, version: int, source: str | Path | Any) -> Any:
        """Queue loading `version` from its export: an HF directory, or a Ray ref to the
        trainer's `HFWeights` (`TrainerGroup.export_weights_ref`; the role's process fetches
        the tensors, the driver never does); with LoRA a PEFT adapter directory or a ref to the
        adapter (`TrainerGroup.export_adapter_ref`). Returns the Ray ref of the call."""
        if isinstance(source, (str, Path)):
            source = str(source)
        return self.actor.add_version.remote(version, source)

    def add_version_file(self, version: int, path: str | Path) -> Any:
        """Queue loading `version` from the trainer's one-file export at `path` on this node
        (`TrainerGroup.write_weights_file`); the role removes the file once mapped. The Ray
        ref of the call."""
        return self.actor.add_version_file.remote(version, str(path))

    def release_below(self, oldest: int) -> Any:
        """Queue dropping the versions older than `oldest`, which no sample still to come
        carries (`BehaviorForwarder.release_below`); calls run in order, so a `logprobs` call
        queued before this one still finds them. The Ray ref of the call (the versions held
        after it)."""
        self._held_ref = self.actor.release_below.remote(int(oldest))
        return self._held_ref

    def metrics(self) -> dict[str, float]:
        """`role/versions_held`: the versions the role held after its last release that has
        answered (never waits for it); empty before any has."""
        ref = self._held_ref
        if ref is not None and ray.wait([ref], timeout=0)[0]:
            self._held_ref = None
            try:
                self._held = len(ray.get(ref))
            except Exception as e:  # the role's failures surface in its own calls
                log.warning("forward-only role: releasing versions failed: %s", e)
        return {} if self._held is None else {"role/versions_held": float(self._held)}

    def set_base(self, path: str | Path) -> Any:
        """LoRA: queue loading the frozen base (before any adapter version); the Ray ref."""
        return self.actor.set_base.remote(str(path))

    async def logprobs(self, batch: TrainerBatch) -> np.ndarray:
        """`BehaviorForwarder.logprobs` in the role's process, which first drops the versions
        below the floor: `floor()` now, never above the oldest version of the batch's own
        trained tokens (its samples wait for this answer, so `floor()` counts them anyway)."""
        return await self.actor.logprobs.remote(batch, request_floor(batch, self.floor))

    def versions(self) -> list[int]:
        return ray.get(self.actor.versions.remote(), timeout=self.timeout_s)

    def shutdown(self) -> None:
        ray.kill(self.actor)
        for f in weights_io.SHM_DIR.glob(f"{self.file_prefix}*"):  # a version never mapped
            f.unlink(missing_ok=True)
