"""Who may call which route: the access table of a run's three HTTP servers (the engine, the
router, the training gateway), SGLang's two keys, and the check every server runs first.

Owns `Privilege`, `ACCESS` (the one table: every route of each server and the privilege it
needs; the servers enforce it, `tests/test_access_probe.py` sends every route with every
credential against it, `docs/security.md` shows it), `privilege_of`, `allowed`, `expected`,
`auth_middleware`, the key environment variables and loaders (`load_auth_token`,
`load_api_key`) and `check_keys` (the settings refused before a server binds). Must never import
`slime_async` (the router is a leaf package); the engine and the gateway import it.

SGLang's semantics (`--api-key`, `--admin-api-key`; its `decide_request_auth`):

* a **probe** (`/health*`, `/ready*`, `/liveness`) is open: load balancers and Kubernetes need it
  without a secret;
* a **data** route (generation, `/v1/*`, model and server info) needs the data-plane key
  (`api_key`) when one is set; the admin key does not open it;
* an **admin** route (weights, adapters, pause/continue, flush, abort, worker changes) needs the
  admin key when one is set, else the data-plane key when that is set;
* with no key at all every route is open (only on loopback: `check_keys`).

This project adds one rule SGLang leaves to the operator: an admin key without a data-plane key
would leave generation open to every local user, so it is refused unless the data plane is
opened on purpose (`open_data_plane`, loopback only, logged at start-up).
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import os
from collections.abc import Callable
from typing import Any

from aiohttp import web

ADMIN_KEY_ENV = "SLIME_ASYNC_AUTH_TOKEN"
"""Environment variable holding the admin key (SGLang's `--admin-api-key`): the operator's
token, which a run keeps to itself."""
API_KEY_ENV = "SLIME_ASYNC_API_KEY"
"""Environment variable holding the data-plane key (SGLang's `--api-key`); a run with an admin
key and none of these mints one for itself."""


class Privilege(enum.Enum):
    """What a route needs (see the module docstring)."""

    PROBE = "probe"
    DATA = "data"
    ADMIN = "admin"


_ENGINE_PROBES = ("/health", "/health_generate", "/ready")
_ENGINE_DATA = (
    "/generate",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/get_load",
    "/v1/loads",
)
_ENGINE_ADMIN = (
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/flush_cache",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weight_version",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/release_memory_occupation",
    "/resume_memory_occupation",
)
_ROUTER_PROBES = ("/health", "/liveness", "/readiness", "/health_generate")
_ROUTER_DATA = (
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/get_model_info",
    "/model_info",
    "/get_server_info",
    "/server_info",
    "/metrics",
)
_ROUTER_ADMIN = (
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/flush_cache",
    "/abort_request",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/workers",
    "/workers/{worker_id}",
)
_GATEWAY_DATA = (
    "/episodes/{eid}/v1/chat/completions",
    "/episodes/{eid}/v1/models",
    "/episodes/{eid}/reward",
)


def _rows(
    server: str, privilege: Privilege, paths: tuple[str, ...]
) -> dict[tuple[str, str], Privilege]:
    return {(server, p): privilege for p in paths}


ACCESS: dict[tuple[str, str], Privilege] = {
    **_rows("engine", Privilege.PROBE, _ENGINE_PROBES),
    **_rows("engine", Privilege.DATA, _ENGINE_DATA),
    **_rows("engine", Privilege.ADMIN, _ENGINE_ADMIN),
    **_rows("router", Privilege.PROBE, _ROUTER_PROBES),
    **_rows("router", Privilege.DATA, _ROUTER_DATA),
    **_rows("router", Privilege.ADMIN, _ROUTER_ADMIN),
    **_rows("gateway", Privilege.DATA, _GATEWAY_DATA),
}
"""(server, route pattern as the server registers it) -> the privilege it needs. The gateway's
one key is its agents' credential (its data plane); it has no admin route."""


def privilege_of(server: str, request: web.Request) -> Privilege:
    """The privilege `request` needs on `server`: its route's row; a path no route matches
    (answered 404 after the check) needs the data-plane key."""
    info = request.match_info.route.resource
    pattern = info.canonical if info is not None else request.path
    return ACCESS.get((server, pattern), Privilege.DATA)


def needed_key(
    privilege: Privilege, *, api_key: str | None, admin_api_key: str | None
) -> str | None:
    """The key a request of `privilege` must present (None: open)."""
    if privilege is Privilege.PROBE:
        return None
    if privilege is Privilege.DATA:
        return api_key
    return admin_api_key or api_key


def allowed(
    authorization: str, privilege: Privilege, *, api_key: str | None, admin_api_key: str | None
) -> bool:
    """Whether an `Authorization` header value opens a route of `privilege` (constant time)."""
    key = needed_key(privilege, api_key=api_key, admin_api_key=admin_api_key)
    if key is None:
        return True
    return hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())


CREDENTIALS = ("none", "data", "admin", "wrong")
"""What a probe of the access table sends: no header, the data-plane key, the admin key, a
wrong key."""


def expected(privilege: Privilege, credential: str) -> str:
    """The outcome of `credential` on a route of `privilege` on a server with both keys: "401",
    or "open" (the route's own answer)."""
    if privilege is Privilege.PROBE:
        return "open"
    opens = "data" if privilege is Privilege.DATA else "admin"
    return "open" if credential == opens else "401"


def _why(privilege: Privilege, key: str | None, api_key: str | None) -> str:
    if privilege is Privilege.ADMIN and key != api_key:
        return f"the admin key (SGLang's --admin-api-key; ${ADMIN_KEY_ENV})"
    return f"the data-plane key (SGLang's --api-key; ${API_KEY_ENV})"


def auth_middleware(
    server: str,
    *,
    api_key: str | None,
    admin_api_key: str | None,
    refuse: Callable[[web.Request, int, str], web.StreamResponse],
) -> Any:
    """An aiohttp middleware that checks `server`'s row of `ACCESS` for every request before
    its body is read; a refusal is `refuse(request, 401, message)`."""

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        priv = privilege_of(server, request)
        got = request.headers.get("Authorization", "")
        if not allowed(got, priv, api_key=api_key, admin_api_key=admin_api_key):
            key = needed_key(priv, api_key=api_key, admin_api_key=admin_api_key)
            return refuse(
                request,
                401,
                f"{request.path} needs 'Authorization: Bearer <key>' with "
                f"{_why(priv, key, api_key)}",
            )
        return await handler(request)

    return auth


def is_loopback(host: str) -> bool:
    """True when `host` names only the local machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_key(path: str, what: str) -> str:
    try:
        with open(path) as f:
            key = f.read().strip()
    except OSError as e:
        raise ValueError(f"{what} file {path}: {e.strerror}; give a readable file") from None
    if not key:
        raise ValueError(f"{what} file {path} is empty; write the key into it")
    return key


def load_auth_token(token_file: str | None = None, *, environ: dict | None = None) -> str | None:
    """The admin key: the content of `token_file` (surrounding whitespace stripped) when given,
    else `$SLIME_ASYNC_AUTH_TOKEN`; None when neither is set. ValueError for a file that cannot
    be read or is empty."""
    if token_file:
        return _read_key(token_file, "auth token")
    return (os.environ if environ is None else environ).get(ADMIN_KEY_ENV) or None


def load_api_key(key_file: str | None = None, *, environ: dict | None = None) -> str | None:
    """The data-plane key: the content of `key_file` when given, else `$SLIME_ASYNC_API_KEY`;
    None when neither is set."""
    if key_file:
        return _read_key(key_file, "api key")
    return (os.environ if environ is None else environ).get(API_KEY_ENV) or None


_MINT_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def check_keys(
    who: str,
    *,
    host: str,
    api_key: str | None,
    admin_api_key: str | None,
    open_data_plane: bool = False,
) -> None:
    """Refuse (ValueError naming the fix) keys a server `who` bound to `host` must not run with:
    a blank or padded key, one key for both privileges, no data-plane key off loopback, an admin
    key that would leave the data plane open unless `open_data_plane` says so on purpose."""
    for name, key in (("data-plane key", api_key), ("admin key", admin_api_key)):
        if key is not None and (not key.strip() or key.strip() != key):
            raise ValueError(
                f"the {who}'s {name} is empty, whitespace-only or has leading/trailing "
                "whitespace (HTTP strips header values, so it could never match); use a random "
                f"key such as the output of `{_MINT_HINT}`"
            )
    if api_key is not None and api_key == admin_api_key:
        raise ValueError(
            f"the {who}'s data-plane key (${API_KEY_ENV}) equals its admin key "
            f"(${ADMIN_KEY_ENV}): whoever generates could change the weights; use two keys"
        )
    if not is_loopback(host):
        if open_data_plane:
            raise ValueError(
                f"the {who} would open its data plane on {host!r}, off loopback; drop "
                "--open-data-plane or bind 127.0.0.1"
            )
        if not api_key:
            raise ValueError(
                f"the {who} would listen on {host!r}, off loopback, without a data-plane key: "
                f"export {API_KEY_ENV}=<key> (or pass --api-key-file PATH; with "
                f"{ADMIN_KEY_ENV} / --auth-token-file for the admin routes), or bind 127.0.0.1"
            )
    if admin_api_key and not api_key and not open_data_plane:
        raise ValueError(
            f"the {who} has an admin key but no data-plane key: generation and info would be "
            f"open to every user of this machine. Export {API_KEY_ENV}=<key> (or pass "
            "--api-key-file PATH) for its clients, or pass --open-data-plane to open it on "
            "purpose"
        )
    if open_data_plane and api_key:
        raise ValueError(f"the {who} has a data-plane key and --open-data-plane; drop one of them")
