"""Launcher for real SGLang servers on GPUs (the production engine; the embedded engine mirrors
its HTTP API on CPU).

Owns: `SGLangConfig` (our flags -> `python -m sglang.launch_server` flags), `build_command`,
and `SGLangServer` (start in its own process group, wait for `/health`, stop the whole group
cleanly: SIGTERM, then SIGKILL). Routed-expert capture (`--enable-return-routed-experts`) is on
by default because routing replay (R3) needs it. Must never import sglang (it may not be
installed where the command is built) or torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time

from router.access import check_keys
from slime_async.engine import sglang_launch
from slime_async.engine.runner import wait_healthy
from slime_async.engine.sglang_launch import ADMIN_KEY_ENV, API_KEY_ENV
from slime_async.host import port_taken

SGLANG_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SGLangConfig:
    """One SGLang server (`sglang.launch_server`)."""

    model_path: str
    """HF checkpoint directory (or hub id where the cluster has access)."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 30000
    """HTTP port."""
    tp_size: int = 1
    """Tensor-parallel GPUs of this server."""
    dp_size: int = 1
    """Data-parallel replicas inside this server."""
    ep_size: int = 1
    """Expert-parallel size (must divide tp_size)."""
    dtype: str = "bfloat16"
    """Inference dtype: auto, bfloat16, float16, float32."""
    mem_fraction_static: float | None = None
    """GPU memory fraction for weights + KV cache; None = SGLang's default."""
    context_length: int | None = None
    """Max prompt + output tokens; None = model config."""
    max_running_requests: int | None = None
    """Continuous-batch limit; None = SGLang's default."""
    chunked_prefill_size: int | None = None
    """Prefill chunk in tokens; None = SGLang's default."""
    random_seed: int | None = None
    """Server RNG seed."""
    weight_version: str = "default"
    """Initial `meta_info.weight_version` (the trainer sends "0", "1", ... on updates)."""
    enable_return_routed_experts: bool = True
    """Capture MoE top-k ids so requests can ask for `routed_experts` (R3)."""
    skip_tokenizer_init: bool = False
    """Serve token ids only (no `text`; SGLang's `/v1/*` OpenAI routes need the tokenizer)."""
    tokenizer_path: str | None = None
    """Where SGLang loads the tokenizer from (its `--tokenizer-path`); None: `model_path`."""
    enable_multimodal: bool = False
    """A vision-language model: `--enable-multimodal` (SGLang's image processor on; it decodes
    `input_ids` with the tokenizer and expands each image's `<|image_pad|>`, so the tokenizer
    and the processor config must be loadable)."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the checkpoint."""
    base_gpu_id: int = 0
    """First GPU index (within CUDA_VISIBLE_DEVICES) this server uses."""
    served_model_name: str | None = None
    """Name reported by /model_info."""
    nnodes: int = 1
    """Nodes spanned by one server (multi-node TP)."""
    node_rank: int = 0
    """This node's rank when nnodes > 1."""
    dist_init_addr: str | None = None
    """host:port rendezvous for nnodes > 1."""
    disable_radix_cache: bool = False
    """Turn off prefix caching."""
    enable_memory_saver: bool = False
    """Sleep and wake: `--enable-memory-saver` (SGLang's `/release_memory_occupation` then
    really frees the KV cache and the weights) and `--enable-weights-cpu-backup` (a level-2
    sleep keeps a CPU copy of the weights, which `/resume_memory_occupation` restores)."""
    enable_lora: bool = False
    """Serve LoRA adapters (`--enable-lora`; the run's adapter pushes load them by name)."""
    max_lora_rank: int | None = None
    """`--max-lora-rank`: the largest rank a later `/load_lora_adapter` may bring."""
    lora_target_modules: tuple[str, ...] = ()
    """`--lora-target-modules` (space-separated PEFT names); empty: SGLang infers them."""
    max_loaded_loras: int | None = None
    """`--max-loaded-loras`: adapters resident at once."""
    log_level: str = "warning"
    """SGLang log level."""
    cuda_visible_devices: str | None = None
    """CUDA_VISIBLE_DEVICES for the child process; None inherits."""
    python: str = sys.executable
    """Interpreter that has sglang installed (`--sglang-python`; it need not have this project:
    the token hand-over it runs first is a standard-library script)."""
    launch_module: str = "sglang.launch_server"
    """Module run with `python -m`."""
    extra_args: tuple[str, ...] = ()
    """Further SGLang flags, passed through verbatim (must not repeat a flag set above)."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """Data-plane key SGLang requires (its `--api-key`); handed over through the environment and
    added to the server's own argv in-process (`sglang_launch`), so it is never on a command
    line. Required off loopback."""
    admin_api_key: str | None = dataclasses.field(default=None, repr=False)
    """Admin key (SGLang's `--admin-api-key`: weights, adapters, pause, flush), handed over the
    same way."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("SGLangConfig.model_path is required")
        for name in ("tp_size", "dp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size})")
        if self.dtype not in SGLANG_DTYPES:
            raise ValueError(f"dtype must be one of {SGLANG_DTYPES}, got {self.dtype!r}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0)")
        if self.enable_multimodal and self.skip_tokenizer_init:
            raise ValueError(
                "a vision-language model cannot run with skip_tokenizer_init: SGLang's image "
                "processor decodes input_ids with the tokenizer to place the images"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be in [0, nnodes={self.nnodes})")
        check_keys(
            "SGLang server",
            host=self.host,
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
        )
        ours = {a for a in build_command(self, _with_extra=False) if a.startswith("--")}
        ours |= {"--api-key", "--admin-api-key"}
        clash = sorted(ours & {a.split("=")[0] for a in self.extra_args if a.startswith("--")})
        if keys := [c for c in clash if c in ("--api-key", "--admin-api-key")]:
            raise ValueError(
                f"{'/'.join(keys)} on SGLang's command line would be visible in `ps`: the "
                "launcher hands the keys over itself (export SLIME_ASYNC_API_KEY and "
                "SLIME_ASYNC_AUTH_TOKEN, or pass --api-key-file / --auth-token-file)"
            )
        if clash:
            raise ValueError(
                f"extra_args repeat flags the launcher already sets: {clash}; use the "
                "SGLangConfig fields instead"
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


__all__ = ["ADMIN_KEY_ENV", "API_KEY_ENV", "SGLangConfig", "SGLangServer", "build_command"]


def build_command(cfg: SGLangConfig, *, _with_extra: bool = True) -> list[str]:
    """The argv that starts `cfg` (`[python, -m, sglang.launch_server, --model-path, ...]`; with
    a key, `[python, <path of this package>/sglang_launch.py, sglang.launch_server, ...]`, which
    adds `--api-key` / `--admin-api-key` in-process; run by path, so `cfg.python` needs only
    sglang, not this project)."""
    if cfg.api_key or cfg.admin_api_key:
        cmd = [cfg.python, os.path.abspath(sglang_launch.__file__), cfg.launch_module]
    else:
        cmd = [cfg.python, "-m", cfg.launch_module]
    cmd += ["--model-path", cfg.model_path]
    cmd += ["--host", cfg.host, "--port", str(cfg.port)]
    cmd += ["--tp-size", str(cfg.tp_size), "--dp-size", str(cfg.dp_size)]
    cmd += ["--ep-size", str(cfg.ep_size), "--dtype", cfg.dtype]
    cmd += ["--weight-version", cfg.weight_version, "--log-level", cfg.log_level]
    cmd += ["--base-gpu-id", str(cfg.base_gpu_id)]
    optional = {
        "--mem-fraction-static": cfg.mem_fraction_static,
        "--context-length": cfg.context_length,
        "--max-running-requests": cfg.max_running_requests,
        "--chunked-prefill-size": cfg.chunked_prefill_size,
        "--random-seed": cfg.random_seed,
        "--served-model-name": cfg.served_model_name,
        "--tokenizer-path": cfg.tokenizer_path,
        "--dist-init-addr": cfg.dist_init_addr,
        "--max-lora-rank": cfg.max_lora_rank if cfg.enable_lora else None,
        "--max-loaded-loras": cfg.max_loaded_loras if cfg.enable_lora else None,
    }
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    if cfg.nnodes > 1:
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank)]
    switches = {
        "--enable-return-routed-experts": cfg.enable_return_routed_experts,
        "--skip-tokenizer-init": cfg.skip_tokenizer_init,
        "--enable-multimodal": cfg.enable_multimodal,
        "--trust-remote-code": cfg.trust_remote_code,
        "--disable-radix-cache": cfg.disable_radix_cache,
        "--enable-memory-saver": cfg.enable_memory_saver,
        "--enable-weights-cpu-backup": cfg.enable_memory_saver,
    }
    cmd += [flag for flag, on in switches.items() if on]
    if cfg.enable_lora:
        cmd += ["--enable-lora"]
        if cfg.lora_target_modules:
            cmd += ["--lora-target-modules", *cfg.lora_target_modules]
    if _with_extra:
        cmd += list(cfg.extra_args)
    return cmd


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that launched it dies (a Ray
    actor killed without `stop()`), so no server outlives its owner holding a GPU."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(path: str | None, n: int = 2000) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class PortTakenError(RuntimeError):
    """The server could not bind its port: another process took it after it was chosen."""


class SGLangServer:
    """A launched SGLang server. `start()` returns its URL once `/health` answers 200."""

    def __init__(self, cfg: SGLangConfig, *, log_path: str | None = None) -> None:
        self.cfg, self.log_path = cfg, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return build_command(self.cfg)

    @property
    def pid(self) -> int:
        """Pid of the server process (the leader of its process group)."""
        if self.proc is None:
            raise RuntimeError("SGLangServer is not started; call start() first")
        return self.proc.pid

    @property
    def running(self) -> bool:
        """True while the server process has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 900.0) -> str:
        if self.proc is not None:
            raise RuntimeError("SGLangServer already started")
        env = dict(os.environ)
        if self.cfg.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.cuda_visible_devices
        for var, key in ((API_KEY_ENV, self.cfg.api_key), (ADMIN_KEY_ENV, self.cfg.admin_api_key)):
            env.pop(var, None)
            if key:
                env[var] = key
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # own process group: SGLang forks scheduler/detokenizer children; stop() ends them all
        self.proc = subprocess.Popen(
            self.command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            wait_healthy(self.cfg.url, timeout=timeout, proc=self.proc, token=self.cfg.api_key)
        except (TimeoutError, RuntimeError) as e:
            self.stop()
            why = (
                f"did not answer /health within {timeout:.0f} s (raise the engine start "
                "timeout, --engine-start-timeout, if loading is just slow)"
                if isinstance(e, TimeoutError)
                else str(e)
            )
            log = (
                f"; its log ({self.log_path}) ends:\n{_tail(self.log_path)}"
                if self.log_path
                else ""
            )
            error = PortTakenError if port_taken(log) else RuntimeError
            raise error(f"SGLang server {self.cfg.url} {why}{log}") from e
        except BaseException:
            self.stop()
            raise
        return self.cfg.url

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout`. Idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the child's pid
        if self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + timeout
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):  # children may outlive the leader
            os.killpg(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(5)
