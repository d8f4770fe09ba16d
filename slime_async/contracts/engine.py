"""Engine backend contract: how a run starts, checks and stops its rollout engines.

Owns `EngineLaunch` (what engine i starts on), `EngineHandle` (a started or attached engine: the
URL the router reaches it at, its pid where the backend owns a local process), `EngineNeeds`
(what a backend needs from the run) and `EngineBackend` (the protocol every backend implements).
The registry of backends and their flags live in the config wing
(`slime_async.config.engine_backends`, `engine_fleet`), the built-in backends (embedded,
sglang, external) in `slime_async.orchestrator.engines`; the handle set a run holds (`Cluster`) lives in
`slime_async.orchestrator.roles`. Nothing here is backend-specific. Imports nothing from the rest of
slime_async.

Lifecycle, as `roles.Cluster` drives it:

    backend = BackendClass(fleet_cfg, engine_cfg)    # from the registry, by name
    await backend.preflight()                         # before the trainer starts: fail fast
    h = await backend.start(EngineLaunch(index=0, model_dir="/run/weights/v000000",
                                         weight_version=0, seed=0))
    h.url                                             # registered with the router
    await backend.alive(h)                            # False only when it is known to be gone
    await backend.stop(h)                             # its whole process tree (external: no-op)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineLaunch:
    """What engine `index` of the fleet starts on (a restart gets a new launch)."""

    index: int
    """Position of the engine in the fleet (0-based); stays the same across restarts."""
    model_dir: str
    """HF directory the engine loads at start: the trainer's export of `weight_version`."""
    weight_version: int
    """Trainer version of those weights (`weight_version` on the wire is its string)."""
    seed: int
    """Sampling seed of this engine; distinct per engine and per restart."""
    cores: tuple[int, ...] = ()
    """CPU cores the engine may use (empty: no pinning)."""
    host: str | None = None
    """Address the engine binds: its node's IP when the run places it on a cluster node (the
    URL is built from it); None keeps the backend's configured host (loopback)."""
    placement: dict[str, Any] | None = dataclasses.field(default=None, compare=False)
    """Ray actor options placing the engine in its reserved bundle (scheduling strategy, CPUs,
    GPUs), for backends that start Ray actors; None: anywhere, no reservation."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineHandle:
    """One started (or attached) engine, as the rest of the run sees it."""

    index: int
    """Position of the engine in the fleet."""
    url: str
    """Base URL the router reaches the engine at (`http://host:port`)."""
    pid: int | None
    """Pid of the process that serves (killing it kills the engine); None where the backend
    does not own a local process (external servers)."""
    identity: str
    """Short description for logs, e.g. `embedded actor pid 1234` or the attached URL."""
    ref: Any = dataclasses.field(default=None, compare=False, repr=False)
    """Backend-private handle (a Ray actor, a subprocess); opaque to everyone but the backend."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineNeeds:
    """What a backend needs from the run and what its engines can do: the run asks these, never
    a backend's name. The defaults describe engines the run starts itself from an export."""

    model_dir: bool = True
    """True: `start` loads `launch.model_dir`, so the run exports its weights first. False: the
    engines keep serving what they were started with; the run pushes its current version to
    them (through its weight transport) before the first generate."""
    urls: bool = False
    """The backend attaches to `--engine-urls` (one engine per URL) instead of starting any."""
    gpus_per_engine: float = 0.0
    """GPUs each engine takes from the cluster (0: CPU engines)."""
    owns_processes: bool = True
    """The run starts and stops the engines' processes. False: servers the run does not own,
    which come back (after a crash) on whatever weights they load themselves; the run's
    default weight transport is then the disk one, whose newest load the router replays on
    them before re-admission."""
    collective_backend: str = "gloo"
    """torch.distributed backend of the weight update group the engines join (the distributed
    transport): "gloo" for CPU engines, "nccl" for GPU servers."""
    checkpoint_to_start: bool = False
    """The engines cannot start without an HF checkpoint directory (SGLang). False: given no
    directory, they build the architecture from the run's `ModelSpec` and take the weights
    through the transport."""
    sglang_flags: bool = False
    """The backend passes the run's `--sglang-*` flags to every server it launches."""
    versioned_adapters: bool = False
    """The engines replace a loaded LoRA adapter in place when `/load_lora_adapter` carries a
    `weight_version` (per-token versions across the push), which a LoRA run's adapter pushes
    need (the embedded engine; SGLang refuses to load a name twice)."""
    distributed_adapters: bool = False
    """The engines take a LoRA adapter over the weight update group: `/update_weights_from_
    distributed` with `lora_name` + `lora_config` stages it (checked as a PEFT directory is),
    `/load_lora_adapter {from_distributed: true}` activates it (the embedded engine; SGLang's
    only tensor route for adapters unpickles and is refused)."""


class EngineBackend(Protocol):
    """A way to run rollout engines that speak SGLang's HTTP API.

    A backend is a class registered by name; the run builds one instance per run as
    `cls(fleet_cfg, engine_cfg)` and drives it from one event loop. Every method must be
    bounded in time: a hung engine is reported as not alive, never waited on forever.
    """

    needs: ClassVar[EngineNeeds]
    """What the backend needs from the run (read before an instance exists)."""
    can_restart: ClassVar[bool]
    """True: `start` may be called again for an index whose engine died (the supervisor
    replaces engines). False: a dead engine can only come back by itself; the router re-admits
    it once `/health` answers, and the run stops after the all-down timeout."""

    async def preflight(self) -> None:
        """Checks that need no weights (e.g. attached URLs answer), run before the trainer
        starts so that a bad fleet fails in seconds. Raises with a message naming the problem."""
        ...

    async def start(self, launch: EngineLaunch) -> EngineHandle:
        """Start (or attach) engine `launch.index`; return once its URL answers `/health`."""
        ...

    async def alive(self, handle: EngineHandle) -> bool:
        """False when the engine is known to be gone or wedged (its process exited, its actor
        died, it stopped answering); the router's health state is tracked separately."""
        ...

    async def stop(self, handle: EngineHandle, *, timeout_s: float = 30.0) -> None:
        """Stop the engine and its whole process tree: gracefully within `timeout_s`, then by
        force; idempotent. A backend that does not own the engine leaves it running."""
        ...
