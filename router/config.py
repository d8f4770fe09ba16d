"""Router configuration: the one frozen config of the router, its argparse group, and validation.

Owns: `RouterConfig`, `add_router_args`, `router_config_from_args`, `validate_config`.
Must never import: `slime_async` (the router is a leaf package), nor any other router module but
`router.access` (the keys and who may call what).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import ClassVar

from clifields import add_flags, flag, from_args
from router.access import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    check_keys,
    is_loopback,
    load_api_key,
    load_auth_token,
)

POLICY_NAMES: tuple[str, ...] = ("least_expected_tokens", "least_requests", "round_robin")

AUTH_TOKEN_ENV = ADMIN_KEY_ENV
"""Environment variable holding the admin key of a run's router and engines."""

__all__ = [
    "API_KEY_ENV",
    "AUTH_TOKEN_ENV",
    "POLICY_NAMES",
    "RouterConfig",
    "add_router_args",
    "check_worker_url",
    "is_loopback",
    "load_api_key",
    "load_auth_token",
    "router_config_from_args",
    "validate_config",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterConfig:
    """Everything the router needs; built once, never mutated at run time."""

    FLAG_PREFIX: ClassVar[str] = "router-"
    """Its flags in train_async.py are `--router-*` (`python -m router` drops the prefix)."""

    host: str = "127.0.0.1"
    """Interface to bind. Anything but a loopback address requires `api_key`."""
    port: int = 0
    """TCP port to bind; 0 picks a free ephemeral port (the runner reports the real one)."""
    worker_urls: tuple[str, ...] = flag((), nargs="*")
    """Engines registered at start-up (`http://host:port`); more can join via `POST /workers`."""
    policy: str = flag("least_expected_tokens", choices=POLICY_NAMES)
    """Balancing policy: least_expected_tokens | least_requests | round_robin."""
    worker_capacity_tokens: int = 0
    """Late binding: an engine takes a new request only while its outstanding expected tokens
    are below this; the others wait in the router's queue, longest expected first, and are
    bound when an engine has room. Set it to about what one engine runs at once (its KV
    budget); beyond that an engine only queues internally. 0 binds every request on arrival."""
    group_affinity_tokens: int = flag(4096, ge=0)
    """Group affinity: the next request of a GRPO group (its `X-Group-Key` header, which the
    rollout client sends) goes to the engine that served the group's earlier ones, where its
    prompt is cached, while that engine's outstanding expected tokens exceed the least-loaded
    engine's with room by at most this; beyond it the group is split. 0 turns affinity off."""
    group_affinity_by_prompt: bool = False
    """Also treat requests without `X-Group-Key` that carry the same prompt as one group (for
    clients that send a group's samples as separate requests without the header)."""
    cache_salt: bool = flag(
        False, derived="on with SGLang engines (--engine-backend sglang or external)"
    )
    """Add SGLang's `extra_key` to every `/generate` body, changed by each pause and weight
    call the router fans out, so an engine's radix cache never reuses a prefix computed under
    older weights for a request sent after a push (rewrites request bodies)."""
    default_expected_tokens: int = 1024
    """Expected tokens assumed for a request that sends no `X-Expected-Tokens` header."""
    api_key: str | None = flag(None, repr=False, cli=False)
    """Data-plane key (SGLang's `--api-key`): every route but the health probes needs it, on
    loopback too (`router.access`); presented to the engines on the data plane. From
    $SLIME_ASYNC_API_KEY or `--api-key-file`; a run mints its own."""
    admin_api_key: str | None = flag(None, repr=False, name="auth-token")
    """Admin key (SGLang's `--admin-api-key`): the control routes and `/workers` need it; presented
    to the engines on control calls. From $SLIME_ASYNC_AUTH_TOKEN or the token file: a flag's
    value is visible in `ps` (this flag is a deprecated spelling)."""
    open_data_plane: bool = False
    """With an admin key and no data-plane key: serve generation and info to anyone who can
    reach the router, on purpose (loopback only; said at start-up). Without it such a router is
    refused."""
    health_interval_s: float = 1.0
    """Seconds between `/health` probes of each engine."""
    health_timeout_s: float = 5.0
    """Timeout of one health probe; a slower answer counts as a failure. sglang-router's
    default: a loaded engine answers in seconds (2 s quarantined working engines of a run on a
    node at load 20)."""
    failure_threshold: int = 3
    """Consecutive failures (probes or proxied requests) that quarantine an engine
    (sglang-router's default)."""
    success_threshold: int = 1
    """Consecutive successful probes that re-admit a quarantined engine."""
    readmit_probe_path: str = "/health_generate"
    """Probe of a quarantined engine (a real 1-token generation in SGLang), so an engine whose
    HTTP server is up but whose generation fails is not re-admitted."""
    max_retries: int = 3
    """Extra attempts of one request on other engines after a connection error or 5xx."""
    retry_backoff_s: float = 0.05
    """Pause before a retry; doubles each attempt, capped at 1 s."""
    wait_for_worker_s: float = 30.0
    """How long a request waits for a healthy engine before the router answers 503."""
    request_timeout_s: float = flag(3600.0, aliases=("--sglang-router-request-timeout-secs",))
    """Total timeout of one proxied request (long rollouts are normal); slime's
    `--sglang-router-request-timeout-secs` is another name for it."""
    connect_timeout_s: float = 2.0
    """TCP connect timeout to an engine; a refused/timed-out connect is retried elsewhere."""
    control_timeout_s: float = 600.0
    """Timeout of one fan-out control call per engine (weight loads can be slow)."""
    max_connections: int = 0
    """Connection pool limit to engines (0 = unlimited)."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest accepted request body (the embedded engine's `/generate` limit, 64 MiB)."""
    client_timeout_s: float = 120.0
    """A client must send a request within this many seconds, and a connection may sit idle
    this long (closed after): slow or silent clients cannot hold connections forever."""
    extra: dict[str, str] = flag(default_factory=dict, cli=False)
    """Free-form labels echoed in `/metrics` (e.g. run id); not interpreted."""


def _flag(field: str) -> str:
    """How the flag of `field` is spelled in train_async.py and in `python -m router`."""
    dashed = field.replace("_", "-")
    return f"--router-{dashed} (python -m router: --{dashed})"


def validate_config(cfg: RouterConfig) -> None:
    """Raise `ValueError` with an actionable sentence for any inconsistent setting."""
    _check_access(cfg)
    _check_counts(cfg)
    _check_connections(cfg)
    for url in cfg.worker_urls:
        check_worker_url(url)


def _check_access(cfg: RouterConfig) -> None:
    """The policy name, and who may reach the router: host, token and port."""
    if cfg.policy not in POLICY_NAMES:
        raise ValueError(
            f"unknown router policy {cfg.policy!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    check_keys(
        "router",
        host=cfg.host,
        api_key=cfg.api_key,
        admin_api_key=cfg.admin_api_key,
        open_data_plane=cfg.open_data_plane,
    )
    if not 0 <= cfg.port <= 65535:
        raise ValueError(
            f"{_flag('port')} must be in [0, 65535] (0 = any free port), got {cfg.port}"
        )


def _check_counts(cfg: RouterConfig) -> None:
    """Token budgets, health thresholds and retries."""
    if cfg.default_expected_tokens <= 0:
        raise ValueError(
            f"{_flag('default_expected_tokens')} must be > 0 (tokens assumed per request)"
        )
    if cfg.worker_capacity_tokens < 0:
        raise ValueError(
            f"{_flag('worker_capacity_tokens')} must be >= 0 (0 = bind each request on arrival), "
            f"got {cfg.worker_capacity_tokens}"
        )
    if cfg.group_affinity_tokens < 0:
        raise ValueError(
            f"{_flag('group_affinity_tokens')} must be >= 0 (0 = no group affinity), "
            f"got {cfg.group_affinity_tokens}"
        )
    if cfg.failure_threshold < 1 or cfg.success_threshold < 1:
        raise ValueError(
            f"{_flag('failure_threshold')} and {_flag('success_threshold')} must be >= 1"
        )
    if cfg.max_retries < 0:
        raise ValueError(f"{_flag('max_retries')} must be >= 0 (0 disables retries)")


def _check_connections(cfg: RouterConfig) -> None:
    """How engines and clients are talked to: every interval and timeout a finite number of
    seconds, the re-admit probe a path, the connection and body limits."""
    for name in (
        "health_interval_s",
        "health_timeout_s",
        "request_timeout_s",
        "connect_timeout_s",
        "control_timeout_s",
        "client_timeout_s",
    ):
        if not 0 < getattr(cfg, name) < math.inf:
            raise ValueError(f"{_flag(name)} must be a finite number of seconds > 0")
    for name in ("wait_for_worker_s", "retry_backoff_s"):
        if not 0 <= getattr(cfg, name) < math.inf:
            raise ValueError(f"{_flag(name)} must be a finite number of seconds >= 0")
    if not cfg.readmit_probe_path.startswith("/"):
        raise ValueError(
            f"{_flag('readmit_probe_path')} must be an engine path such as /health_generate"
        )
    if cfg.max_connections < 0:
        raise ValueError(f"{_flag('max_connections')} must be >= 0 (0 = unlimited)")
    if cfg.max_body_bytes < 1:
        raise ValueError(f"{_flag('max_body_bytes')} must be >= 1")


def check_worker_url(url: str) -> str:
    """Return `url` without a trailing slash, or raise if it is not `http(s)://host:port`."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"worker url {url!r} must start with http:// or https://")
    rest = url.split("://", 1)[1].rstrip("/")
    if not rest or "/" in rest:
        raise ValueError(f"worker url {url!r} must be http://host:port with no path")
    return url.rstrip("/")


def add_router_args(parser: argparse.ArgumentParser, *, prefix: str = "router-") -> None:
    """One `--<prefix><field>` flag per `RouterConfig` field (`clifields`; `extra` is not one)."""
    add_flags(parser, RouterConfig, group="router", prefix=prefix)
    if not prefix:  # the router's own CLI; train_async.py reads the run's key files
        parser.add_argument(
            "--auth-token-file",
            default=None,
            help=f"File holding the admin key (default: ${AUTH_TOKEN_ENV}).",
        )
        parser.add_argument(
            "--api-key-file",
            default=None,
            help=f"File holding the data-plane key (default: ${API_KEY_ENV}).",
        )


def router_config_from_args(
    args: argparse.Namespace, *, prefix: str = "router-", api_key: str | None = None
) -> RouterConfig:
    """Build and validate a `RouterConfig` from flags added by `add_router_args`; `api_key`: the
    run's data-plane key (the router's own CLI reads `--api-key-file` / $SLIME_ASYNC_API_KEY)."""
    attr = prefix.replace("-", "_")
    token = getattr(args, attr + "auth_token", None)
    if not token:
        token = load_auth_token(getattr(args, attr + "auth_token_file", None))
    if api_key is None and not prefix:
        api_key = load_api_key(getattr(args, "api_key_file", None))
    cfg = from_args(RouterConfig, args, prefix=prefix, admin_api_key=token, api_key=api_key)
    validate_config(cfg)
    return cfg
