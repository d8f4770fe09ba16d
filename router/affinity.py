"""Group affinity: the samples of one GRPO group go to one engine, where their shared prompt is
already in the prefix cache, while that keeps the engines balanced within a bound.

Owns: `GROUP_KEY_HEADER`, `group_key` (the group a request belongs to), `GroupAffinity` (each
group's home engine, bounded LRU) and `AffinityStats`.
Rule (docs/router-policy.md, "Group affinity"): a request with a group key goes to the group's
home engine if that engine is among the candidates the dispatcher offers (healthy, with room)
and its outstanding expected tokens exceed the least-loaded candidate's by at most
`slack_tokens`; otherwise the policy chooses (the group is split) and the chosen engine becomes
the home, since it now holds the prompt too. So affinity never adds more than `slack_tokens` to
the imbalance the policy alone would leave, and `slack_tokens = 0` turns it off. The key is the
`X-Group-Key` header the rollout client sends (one per group); with `by_prompt`, a request
without the header is keyed by its prompt (same `input_ids` / `text` / `prompt` / `messages` =
same group). Requests without a key are placed by the policy alone, exactly as before.
Must never import: `slime_async`, aiohttp, or the proxy/server modules (pure bookkeeping, like
a policy; the dispatcher calls it without an `await` between choosing and counting).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.policies import Policy
from router.workers import Worker

GROUP_KEY_HEADER = "X-Group-Key"
MAX_GROUPS = 65536
"""Homes remembered (least recently used forgotten first): a group lives for one rollout step."""


def group_key(header: str | None, body: Any, *, by_prompt: bool = True) -> str | None:
    """The group of a request: its `X-Group-Key` header, else (`by_prompt`) its prompt (a single
    `/generate` item's `input_ids` or `text`, a completion's `prompt`, a chat's `messages`);
    None for a batch or a body without one (no affinity)."""
    if header:
        return "h:" + header
    if not by_prompt or not isinstance(body, Mapping):
        return None
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and not isinstance(ids[0], list):
        return f"i:{hash(tuple(ids) if all(isinstance(t, int) for t in ids) else str(ids))}"
    for field in ("text", "prompt"):
        v = body.get(field)
        if isinstance(v, str):
            return f"t:{hash(v)}"
    msgs = body.get("messages")
    if isinstance(msgs, list):
        return f"m:{hash(json.dumps(msgs, sort_keys=True, default=str))}"
    return None


@dataclass(slots=True)
class AffinityStats:
    """Counters (exported by `/metrics` as `group_*`)."""

    new: int = 0
    """Requests that started a group (no home yet)."""
    kept: int = 0
    """Requests placed on their group's home engine."""
    split: int = 0
    """Requests placed elsewhere: the home was busier than the bound allows, full, or gone."""


class GroupAffinity:
    """Chooses an engine for a request of a group (see the module rule).

    Example (slack 1000): group g's first request goes where the policy says, engine a (home).
    The second request: a has 600 tokens outstanding, b 0 -> 600 <= 1000 -> a. Once a is
    1200 ahead of b, the next one goes to b, which becomes the home.
    """

    def __init__(self, *, slack_tokens: int, max_groups: int = MAX_GROUPS) -> None:
        self.slack = slack_tokens
        self.max_groups = max_groups
        self.stats = AffinityStats()
        self._homes: collections.OrderedDict[str, str] = collections.OrderedDict()

    def choose(
        self, policy: Policy, roomy: Sequence[Worker], *, expected_tokens: int, key: str | None
    ) -> Worker:
        """One of `roomy` (non-empty) for a request of group `key` (None = no group)."""
        if key is None or self.slack <= 0:
            return policy.select(roomy, expected_tokens=expected_tokens)
        home_id = self._homes.get(key)
        if home_id is not None:
            home = next((w for w in roomy if w.id == home_id), None)
            if home is not None:
                least = min(w.outstanding_tokens for w in roomy)
                if home.outstanding_tokens - least <= self.slack:
                    self.stats.kept += 1
                    self._homes.move_to_end(key)
                    return home
            self.stats.split += 1
        else:
            self.stats.new += 1
        w = policy.select(roomy, expected_tokens=expected_tokens)
        self._homes[key] = w.id
        self._homes.move_to_end(key)
        while len(self._homes) > self.max_groups:
            self._homes.popitem(last=False)
        return w
