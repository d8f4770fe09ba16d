"""Work-aware, fault-tolerant HTTP router in front of SGLang-API engines.

Public surface: `RouterConfig`, `Router` (async `start() -> url`, `stop()`), `RouterThread`
(same, for synchronous callers), `RouterClient` (registry + control fan-out helper),
`add_router_args` / `router_config_from_args`, `EXPECTED_TOKENS_HEADER`.
This package is a leaf: it must never import `slime_async`.
"""

from __future__ import annotations

from router.client import FanoutError, RouterClient
from router.config import RouterConfig, add_router_args, router_config_from_args, validate_config
from router.proxy import EXPECTED_TOKENS_HEADER
from router.server import Router, RouterThread

__all__ = [
    "EXPECTED_TOKENS_HEADER",
    "FanoutError",
    "Router",
    "RouterClient",
    "RouterConfig",
    "RouterThread",
    "add_router_args",
    "router_config_from_args",
    "validate_config",
]
