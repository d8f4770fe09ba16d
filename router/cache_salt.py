"""Prefix-cache salt per weight switch: every `/generate` the router forwards carries SGLang's
`extra_key`, a value that changes with every `/pause_generation` and every weight call the
router fans out, so an engine's radix cache (which shares prefixes only between requests with
the same `extra_key`) never hands KV computed under old weights to a request forwarded after the
switch.

Owns: `SALT_FIELD`, `salt_value`, `salt_body`.
Rule (docs/weight-sync.md, "Prefix cache across a push"): a push pauses the engines first, so
requests forwarded after the pause carry the new salt and cannot be prefilled before the new
weights are in; those forwarded before it keep the old salt (running ones keep their own KV, as
the per-token version contract says; ones still queued inside the engine may reuse a prefix of
the old weights: the window this leaves). A client's own `extra_key` is kept, with the salt
appended (`own|salt`). Off by default: it rewrites request bodies (an object without
`extra_key` gets the field prepended, bytes otherwise unchanged; one with it is re-serialised).
Must never import: `slime_async`, aiohttp, or the proxy/server modules.
"""

from __future__ import annotations

import json
from typing import Any

SALT_FIELD = "extra_key"


def salt_value(pauses: int, weight_generation: int) -> str:
    """The salt after `pauses` pause fan-outs and `weight_generation` weight calls."""
    return f"slime-p{pauses}-w{weight_generation}"


def _with(own: Any, salt: str) -> Any:
    return salt if own is None else f"{own}|{salt}" if isinstance(own, str) else own


def salt_body(body: bytes, obj: Any, salt: str) -> bytes:
    """`body` (parsed as `obj`) with `salt` in its `extra_key`; a non-object body unchanged."""
    if not isinstance(obj, dict) or not obj:
        return body
    if SALT_FIELD not in obj:
        i = body.find(b"{")
        field = json.dumps(SALT_FIELD).encode() + b":" + json.dumps(salt).encode() + b","
        return body[: i + 1] + field + body[i + 1 :]
    own = obj[SALT_FIELD]
    salted = [_with(k, salt) for k in own] if isinstance(own, list) else _with(own, salt)
    return json.dumps({**obj, SALT_FIELD: salted}).encode()
