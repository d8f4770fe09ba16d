"""Configuration of the rollout engine fleet: which backend, how many engines, where they are.

Owns `EngineFleetConfig`, its flags (`EngineFleetConfig.add_args`: `--engine-backend`,
`--num-engines`, `--engine-urls`, `--engine-attach-timeout`, `--engine-start-timeout`, slime's
`--rollout-num-gpus[-per-engine]`, and the pass-through `--sglang-*` flags:
`split_sglang_args`), their parsing
(`EngineFleetConfig.from_args`) and every rule among them, and `launch_engine_config` (the run's
`EngineConfig` for one `EngineLaunch`, shared by the backends that run our engine). `--engine-backend` accepts the
registered names (the registry is the one list of choices) or `MODULE:NAME` for a plugin.
Nothing is changed behind the user's back: a URL count that disagrees with `--num-engines` is an
error, not an override. Must never import a backend implementation, Ray or torch.
"""

from __future__ import annotations

import argparse
import dataclasses

from router.config import check_worker_url
from slime_async.contracts.engine import EngineLaunch, EngineNeeds
from slime_async.engine.backends.registry import (
    available_engine_backends,
    get_engine_backend,
    resolve_engine_backend,
)
from slime_async.engine.config import EngineConfig


def launch_engine_config(engine: EngineConfig, launch: EngineLaunch) -> EngineConfig:
    """The run's engine config serving `launch.model_dir` at its version, with its seed (an
    empty `model_dir`: the run's `model_spec`, built, until the transport loads the weights)."""
    return dataclasses.replace(
        engine,
        model_dir=launch.model_dir or None,
        model_spec=None if launch.model_dir else engine.model_spec,
        weight_version=str(launch.weight_version),
        seed=launch.seed,
        host=launch.host or engine.host,
    )


SGLANG_PREFIX = "--sglang-"


def split_sglang_args(argv: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """(argv without them, SGLang flags): every `--sglang-FLAG [VALUE]` / `--sglang-FLAG=VALUE`
    of `argv` becomes `--FLAG [VALUE]`; a value is the next token unless it starts with `--`."""
    rest: list[str] = []
    sglang: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith(SGLANG_PREFIX) and len(a) > len(SGLANG_PREFIX):
            sglang.append("--" + a[len(SGLANG_PREFIX) :])
            if "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                sglang.append(argv[i + 1])
                i += 1
        else:
            rest.append(a)
        i += 1
    return rest, tuple(sglang)


def _backend_arg(value: str) -> str:
    try:
        return resolve_engine_backend(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineFleetConfig:
    """The rollout engines of a run."""

    backend: str = "embedded"
    """Registered engine backend (`embedded`, `sglang`, `external`, or a plugin's name)."""
    num_engines: int = 1
    """Engines in the fleet (a URL backend has exactly one per URL)."""
    urls: tuple[str, ...] = ()
    """Base URLs of running servers to attach (URL backends such as `external` only)."""
    attach_timeout_s: float = 30.0
    """Seconds each attached URL has to answer `/health` and `/model_info`."""
    gpus_per_engine: int = 1
    """GPUs of one engine (slime's `--rollout-num-gpus-per-engine`; an SGLang server's tensor
    parallelism); used where the cluster has GPUs."""
    cpus_per_engine: float = 1.0
    """Logical Ray CPUs each engine reserves in its placement-group bundle."""
    start_timeout_s: float = 900.0
    """Seconds a launched server (SGLang) has to answer `/health` before the run gives up."""
    sglang_args: tuple[str, ...] = ()
    """Flags passed verbatim to every SGLang server: the run's `--sglang-*` flags with the
    `sglang-` prefix removed (slime's convention), e.g. `--sglang-mem-fraction-static 0.8`."""

    @property
    def needs(self) -> EngineNeeds:
        """What the chosen backend needs and can do (its registered class's `needs`)."""
        return get_engine_backend(self.backend).needs

    @property
    def rollout_num_gpus(self) -> int:
        """GPUs of the whole fleet (slime's `--rollout-num-gpus`)."""
        return self.num_engines * self.gpus_per_engine

    def __post_init__(self) -> None:
        backend = get_engine_backend(self.backend)  # unknown names fail with the choices
        if self.num_engines < 1:
            raise ValueError(f"--num-engines must be >= 1, got {self.num_engines}")
        if not self.attach_timeout_s > 0 or self.attach_timeout_s == float("inf"):
            raise ValueError(
                f"--engine-attach-timeout must be a finite number of seconds > 0, got "
                f"{self.attach_timeout_s}"
            )
        if self.gpus_per_engine < 1:
            raise ValueError(
                f"--rollout-num-gpus-per-engine must be >= 1, got {self.gpus_per_engine}"
            )
        if self.start_timeout_s <= 0:
            raise ValueError(f"--engine-start-timeout must be > 0, got {self.start_timeout_s}")
        if self.sglang_args and not backend.needs.sglang_flags:
            raise ValueError(
                f"--sglang-* flags ({' '.join(self.sglang_args)}) configure SGLang servers, but "
                f"--engine-backend is {self.backend!r}: drop them or use --engine-backend sglang"
            )
        if self.cpus_per_engine < 0:
            raise ValueError(
                f"--rollout-num-cpus-per-engine must be >= 0, got {self.cpus_per_engine}"
            )
        if not backend.needs.urls:
            if self.urls:
                raise ValueError(
                    f"--engine-urls is for a backend that attaches to running servers, but "
                    f"--engine-backend is {self.backend!r}: drop --engine-urls, or use "
                    "--engine-backend external"
                )
            return
        if not self.urls:
            raise ValueError(
                f"--engine-backend {self.backend} attaches to servers that are already running: "
                "give their URLs with --engine-urls http://host:port[,http://host:port...]"
            )
        for url in self.urls:
            if check_worker_url(url) != url:  # raises for what is not http(s)://host:port
                raise ValueError(f"engine URL {url!r} must not end in '/'")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"--engine-urls lists a server twice: {', '.join(self.urls)}")
        if self.num_engines != len(self.urls):
            raise ValueError(
                f"--num-engines {self.num_engines} does not match the {len(self.urls)} "
                f"--engine-urls; --engine-backend {self.backend} runs one engine per URL: drop "
                "--num-engines or list that many URLs"
            )

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """The `rollout engines` flag group."""
        d = EngineFleetConfig()
        names = ", ".join(available_engine_backends())
        g = parser.add_argument_group("rollout engines")
        g.add_argument(
            "--engine-backend",
            type=_backend_arg,
            default=d.backend,
            metavar="NAME",
            help=f"How engines run: one of {names} (embedded: CPU/any device in Ray actors; "
            "sglang: SGLang servers on GPUs; external: attach running servers by URL), or "
            "MODULE:NAME for a plugin module that registers NAME.",
        )
        g.add_argument(
            "--num-engines",
            type=int,
            default=None,
            help=f"Rollout engines (default: {d.num_engines}; with --engine-urls, one per URL).",
        )
        g.add_argument(
            "--engine-urls",
            default=None,
            help="Comma-separated base URLs of SGLang-API servers that are already running "
            "(--engine-backend external). They are never started or stopped by the run; they "
            "must be able to read the run directory's weights/ (disk weight transport).",
        )
        g.add_argument(
            "--rollout-num-gpus",
            type=int,
            default=None,
            help="GPUs of all engines together (slime's name); the engine count is this / "
            "--rollout-num-gpus-per-engine (default: --num-engines x that).",
        )
        g.add_argument(
            "--rollout-num-gpus-per-engine",
            type=int,
            default=d.gpus_per_engine,
            help="GPUs of one engine: an SGLang server's tensor-parallel size (slime's name).",
        )
        g.add_argument(
            "--rollout-num-cpus-per-engine",
            type=float,
            default=d.cpus_per_engine,
            help="Logical Ray CPUs each engine reserves (on a cluster without GPUs, instead "
            "of GPUs).",
        )
        g.add_argument(
            "--engine-start-timeout",
            type=float,
            default=d.start_timeout_s,
            help="Seconds a launched SGLang server has to answer /health (model loading, CUDA "
            "graphs) before the run stops with its log. Any --sglang-FLAG [VALUE] is passed "
            "to every SGLang server as --FLAG [VALUE].",
        )
        g.add_argument(
            "--engine-attach-timeout",
            type=float,
            default=d.attach_timeout_s,
            help="Seconds each --engine-urls server has to answer /health and /model_info.",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineFleetConfig:
        """The fleet config of parsed flags (validation errors raise ValueError)."""
        try:
            urls = tuple(
                check_worker_url(u.strip())
                for u in (args.engine_urls or "").split(",")
                if u.strip()
            )
        except ValueError as e:
            raise ValueError(f"--engine-urls: {e}") from None
        num = args.num_engines
        per = getattr(args, "rollout_num_gpus_per_engine", 1)
        total = getattr(args, "rollout_num_gpus", None)
        if total is not None:
            if total < 1 or per < 1 or total % per:
                raise ValueError(
                    f"--rollout-num-gpus {total} is not a positive multiple of "
                    f"--rollout-num-gpus-per-engine {per}; give a multiple (one engine per "
                    f"{per} GPUs)"
                )
            if num is not None and num != total // per:
                raise ValueError(
                    f"--num-engines {num} contradicts --rollout-num-gpus {total} / "
                    f"--rollout-num-gpus-per-engine {per} = {total // per} engines; drop one"
                )
            num = total // per
        if num is None:
            num = len(urls) if urls and get_engine_backend(args.engine_backend).needs.urls else 1
        return cls(
            backend=args.engine_backend,
            num_engines=num,
            urls=urls,
            attach_timeout_s=args.engine_attach_timeout,
            gpus_per_engine=per,
            start_timeout_s=getattr(args, "engine_start_timeout", 900.0),
            sglang_args=tuple(getattr(args, "sglang_args", ()) or ()),
            cpus_per_engine=getattr(args, "rollout_num_cpus_per_engine", 1.0),
        )
