"""The `sglang` engine backend: a real SGLang server per engine, launched by a Ray actor on a GPU.

Owns `sglang_config` (the run's `EngineConfig` + one launch → `SGLangConfig`), `SGLangActor` and
`SGLangBackend`. Ray's GPU assignment (`CUDA_VISIBLE_DEVICES`) gives each engine its own device;
the port is picked on the actor's node. The handle's pid is the SGLang server's (the leader of
its process group): killing it kills the engine, and `alive()` notices. Stopping ends the whole
group (scheduler and detokenizer children included), then the actor. Exercised only where GPUs
exist; the launcher itself is tested by replacing the SGLang process (tests/test_engine_sglang.py).
"""

from __future__ import annotations

from typing import ClassVar

import ray

from slime_async.contracts.engine import EngineLaunch, EngineNeeds
from slime_async.engine.backends.ray_actor import RayActorBackend
from slime_async.engine.config import EngineConfig
from slime_async.engine.sglang import SGLangConfig, SGLangServer


def sglang_config(engine: EngineConfig, launch: EngineLaunch, *, port: int) -> SGLangConfig:
    """The SGLang server of `launch`: token-ids only, routed experts on (R3)."""
    return SGLangConfig(
        model_path=launch.model_dir,
        host=engine.host,
        port=port,
        random_seed=launch.seed,
        weight_version=str(launch.weight_version),
        max_running_requests=engine.max_running_requests,
        context_length=engine.context_length,
        enable_return_routed_experts=True,
        skip_tokenizer_init=True,
    )


@ray.remote(num_cpus=0)
class SGLangActor:
    """Launches and owns one SGLang server process group."""

    def __init__(self, engine: EngineConfig, launch: EngineLaunch) -> None:
        from slime_async.host import free_port

        self._server = SGLangServer(sglang_config(engine, launch, port=free_port()))

    def start(self) -> str:
        return self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def pid(self) -> int:
        return self._server.pid

    def alive(self) -> bool:
        return self._server.running


class SGLangBackend(RayActorBackend):
    """One `SGLangActor` (one GPU) per engine; restartable."""

    needs: ClassVar[EngineNeeds] = EngineNeeds(model_dir=True, gpus_per_engine=1)
    label: ClassVar[str] = "sglang server"

    def make_actor(self, launch: EngineLaunch) -> ray.actor.ActorHandle:
        gpus = self.needs.gpus_per_engine
        return SGLangActor.options(num_gpus=gpus).remote(self.engine, launch)
