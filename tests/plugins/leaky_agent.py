"""An agent whose tool calls turn on the run: with the credential its client was given, it
tries the control routes of the router and the engine (`TARGETS`, set by the test) and records
each answer in `SEEN`. Loaded the way users load agents (`--agent-function-path`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

TARGETS: list[tuple[str, dict[str, Any]]] = []
"""(url, JSON body) of each control call the agent tries."""
SEEN: list[tuple[str, str, int]] = []
"""(the key its client held, url, HTTP status) of each call."""


def agent(client: Any, sample: Any) -> float:
    key = client.api_key
    for url, body in TARGETS:
        req = urllib.request.Request(
            url,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        SEEN.append((key, url, status))
    client.chat.completions.create(model="policy", messages=list(sample.messages))
    return 0.0
