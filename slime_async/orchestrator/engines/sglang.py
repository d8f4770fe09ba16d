"""The `sglang` engine backend: a real SGLang server per engine, launched by a Ray actor in the
engine's placement-group bundle.

Owns `sglang_config` (the run's `EngineConfig` + fleet + one launch → `SGLangConfig`),
`SGLangActor` and `SGLangBackend`. Each engine's bundle holds `--rollout-num-gpus-per-engine`
GPUs (Ray's `CUDA_VISIBLE_DEVICES`), which is the server's tensor parallelism; `--sglang-*`
flags of the run reach every server verbatim (prefix removed), except the run's own
(`RUN_SGLANG_FLAGS`); `--sglang-python` is the interpreter that runs it. The port is picked on the actor's
node, on the address the server binds (its node's IP on a joined cluster, with the run's keys
handed over outside the command line). The handle's pid is the SGLang server's (the leader of
its process group): killing it kills the engine, and `alive()` notices. Stopping ends the whole
group (scheduler and detokenizer children included), then the actor; a server whose actor dies
without stopping it gets SIGKILL from the kernel (parent-death signal), so a replaced engine
leaves no orphan holding a GPU. Exercised only where GPUs exist; the launcher and this backend
are tested by replacing the SGLang process alone (tests/test_engine_sglang_launch.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, ClassVar

import ray

from slime_async.config.engine_backends import BUILTIN_NEEDS
from slime_async.contracts.engine import EngineLaunch, EngineNeeds
from slime_async.engine.config import EngineConfig
from slime_async.engine.sglang import PortTakenError, SGLangConfig, SGLangServer
from slime_async.orchestrator.engines.ray_actor import RayActorBackend

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any of these in a checkpoint directory: SGLang can load a tokenizer from it."""


def _has_tokenizer(path: str | None) -> bool:
    return bool(path) and any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _is_vl(model_dir: str | None) -> bool:
    """The checkpoint's `config.json` names a vision-language model (its `vision_config`)."""
    import json

    path = os.path.join(model_dir or "", "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return bool(json.load(f).get("vision_config"))


def _vl_tokenizer(launch: EngineLaunch, tokenizer: str | None, user: set[str]) -> None:
    """ValueError naming the fix when SGLang could not place a VL model's images: its image
    processor decodes `input_ids` with the tokenizer and reads `preprocessor_config.json`
    beside it."""
    if "--skip-tokenizer-init" in user:
        raise ValueError(
            "--sglang-skip-tokenizer-init cannot serve a vision-language model: SGLang's image "
            "processor decodes input_ids with the tokenizer; drop the flag"
        )
    where = tokenizer or launch.model_dir
    if "--tokenizer-path" not in user and not (
        _has_tokenizer(where) and os.path.isfile(os.path.join(where, "preprocessor_config.json"))
    ):
        raise ValueError(
            f"a vision-language model on SGLang needs the tokenizer and preprocessor_config.json "
            f"of its processor; {where} lacks them: use an --hf-checkpoint that has both (the "
            "HF processor's save_pretrained writes them)"
        )


def sglang_config(
    engine: EngineConfig, launch: EngineLaunch, *, port: int, fleet: Any = None
) -> SGLangConfig:
    """The SGLang server of `launch`: routed experts on (R3), TP = the GPUs of one engine, the
    fleet's `--sglang-*` flags passed through, run by `--sglang-python`.

    The tokenizer is on (SGLang's `/v1/*` routes need it; our `/generate` calls send
    `input_ids` and read ids either way): from the checkpoint the server starts on, else from
    `--hf-checkpoint` (the trainer's export has no tokenizer files). Only where neither has
    tokenizer files on the server's node (a model built from its spec, a hub id) is it started
    with `--skip-tokenizer-init`. A `--sglang-skip-tokenizer-init` or `--sglang-tokenizer-path` of the
    user's decides instead, untouched. A vision-language checkpoint (`vision_config` in its
    `config.json`) adds `--enable-multimodal` and needs the tokenizer and the processor's
    `preprocessor_config.json` (ValueError otherwise); its memory fraction stays SGLang's own,
    which reserves room for the vision encoder, unless `--sglang-mem-fraction-static` is given."""
    extra = tuple(getattr(fleet, "sglang_args", ()))
    user = {a.split("=", 1)[0] for a in extra}
    tokenizer, skip = None, False
    if not user & {"--skip-tokenizer-init", "--tokenizer-path"}:
        source = getattr(fleet, "tokenizer_path", None)
        if not _has_tokenizer(launch.model_dir) and _has_tokenizer(source):
            tokenizer = source
        skip = tokenizer is None and not _has_tokenizer(launch.model_dir)
    vl = _is_vl(launch.model_dir)
    if vl:
        _vl_tokenizer(launch, tokenizer, user)
    sleep = bool(getattr(fleet, "engine_sleep", False))
    return SGLangConfig(
        model_path=launch.model_dir,
        host=launch.host or engine.host,
        port=port,
        tp_size=getattr(fleet, "gpus_per_engine", 1),
        random_seed=launch.seed,
        weight_version=str(launch.weight_version),
        max_running_requests=engine.max_running_requests,
        context_length=engine.context_length,
        enable_return_routed_experts=True,
        skip_tokenizer_init=skip,
        tokenizer_path=tokenizer,
        enable_multimodal=vl and "--enable-multimodal" not in user,
        extra_args=extra,
        enable_memory_saver=sleep and not user & {"--enable-memory-saver"},
        enable_lora=engine.enable_lora,
        max_lora_rank=engine.max_lora_rank,
        lora_target_modules=engine.lora_target_modules,
        max_loaded_loras=engine.max_loaded_loras,
        api_key=engine.api_key,
        admin_api_key=engine.admin_api_key,
        python=getattr(fleet, "sglang_python", None) or sys.executable,
    )


PORT_ATTEMPTS = 3
"""Ports an SGLang server is started on before its start fails (each taken by another
process between the free-port probe and the server's bind)."""


@ray.remote(num_cpus=0)
class SGLangActor:
    """Launches and owns one SGLang server process group."""

    def __init__(
        self, engine: EngineConfig, launch: EngineLaunch, fleet: Any, start_timeout_s: float
    ) -> None:
        self._args = (engine, launch, fleet)
        self._server = self._on_free_port()
        self._timeout = start_timeout_s

    def _on_free_port(self) -> SGLangServer:
        from slime_async.host import free_port

        engine, launch, fleet = self._args
        cfg = sglang_config(engine, launch, port=free_port(launch.host or engine.host), fleet=fleet)
        logs = os.path.join(tempfile.gettempdir(), "slime_async_sglang")
        os.makedirs(logs, exist_ok=True)
        return SGLangServer(
            cfg, log_path=os.path.join(logs, f"engine{launch.index}_{cfg.port}.log")
        )

    def log_path(self) -> str | None:
        return self._server.log_path

    def start(self) -> str:
        """Start the server; a port another process took after it was chosen is chosen again
        (up to `PORT_ATTEMPTS` times)."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._server.start(timeout=self._timeout)
            except PortTakenError:
                if attempt == PORT_ATTEMPTS:
                    raise
                self._server = self._on_free_port()
        raise AssertionError("unreachable")

    def stop(self) -> None:
        self._server.stop()

    def pid(self) -> int:
        return self._server.pid

    def alive(self) -> bool:
        return self._server.running


class SGLangBackend(RayActorBackend):
    """One `SGLangActor` (its bundle's GPUs) per engine; restartable."""

    needs: ClassVar[EngineNeeds] = BUILTIN_NEEDS["sglang"]
    label: ClassVar[str] = "sglang server"

    def start_limit_s(self) -> float:
        return float(getattr(self.fleet, "start_timeout_s", 900.0))

    def make_actor(self, launch: EngineLaunch) -> ray.actor.ActorHandle:
        opts = launch.placement or {"num_gpus": getattr(self.fleet, "gpus_per_engine", 1)}
        return SGLangActor.options(**opts).remote(
            self.engine, launch, self.fleet, self.start_limit_s()
        )

    async def waits_for(self, actor: ray.actor.ActorHandle, launch: EngineLaunch) -> str:
        where = await actor.log_path.remote()  # on the engine's node
        return f"{self.label} {launch.index} /health, log {where}"
