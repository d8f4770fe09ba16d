"""The embedded engine's radix (prefix) cache: KV of token prefixes that later prefills reuse.

Owns: `PrefixCache`, a radix tree over token ids whose edges hold the KV (per layer
`[kv_heads, tokens, head_dim]`, own storage) and, when captured, the routed-expert ids of those
tokens; LRU eviction of leaves under a token budget; and the **per-version key**: every node
belongs to the weights epoch (one per weight swap, `activate`) whose forward computed it, and a
lookup only walks the tree of the epoch that serves now, so KV computed under version k is never
reused by a request served by k+1. Two policies: `flush` drops every other epoch's tree when an
epoch is activated (memory freed at once); `salt` keeps them under their own key until LRU
evicts them. Within an epoch, SGLang's `extra_key` namespaces the tree as in SGLang: only
requests with the same key (None included) share prefixes. `insert` refuses KV of any epoch but the active
one (a request that lived through a swap holds KV of two versions: it keeps it, the cache never
takes it). `CacheStats.cross_version_hits` counts nodes of another epoch met on a lookup path;
the structure makes it impossible and the metric proves it stays 0.

Pure data structure plus a lock: the scheduler calls it from its model thread (match, insert)
and `/flush_cache` from the event loop. Must never import the server, the scheduler or aiohttp.
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
from typing import Literal, get_args

import torch

Policy = Literal["flush", "salt"]
POLICIES: tuple[str, ...] = get_args(Policy)
KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer `(keys, values)`, each `[kv_heads, tokens, head_dim]`."""


class _Node:
    __slots__ = ("children", "epoch", "key", "kv", "last_use", "parent", "routed")

    def __init__(
        self,
        key: tuple[int, ...],
        kv: KV,
        routed: torch.Tensor | None,
        parent: _Node | None,
        epoch: int,
    ) -> None:
        self.key = key
        self.kv = kv
        self.routed = routed
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_use = 0
        self.epoch = epoch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Match:
    """What a lookup found: the first `length` tokens' KV (and expert ids where stored)."""

    length: int
    """Tokens reused (0 = miss)."""
    kv: KV | None
    """Per layer `[kv_heads, length, head_dim]` (new tensors), None on a miss."""
    routed: torch.Tensor | None
    """int32 `[length, layers, topk]` when every matched node stored expert ids."""


MISS = Match(length=0, kv=None, routed=None)


@dataclasses.dataclass(kw_only=True, slots=True)
class CacheStats:
    """Counters `/server_info` reports (`internal_states[0].prefix_cache`)."""

    lookups: int = 0
    """Prefills that looked the cache up."""
    hit_requests: int = 0
    """Lookups that reused at least one token."""
    lookup_tokens: int = 0
    """Tokens those prefills had to forward without a cache."""
    cached_tokens: int = 0
    """Tokens reused (the sum of `meta_info.cached_tokens`)."""
    inserted_tokens: int = 0
    """Tokens added to the tree."""
    evicted_tokens: int = 0
    """Tokens dropped by LRU eviction."""
    flushed_tokens: int = 0
    """Tokens dropped by `flush` or by activating an epoch under the `flush` policy."""
    refused_inserts: int = 0
    """Inserts refused because their KV was computed under another epoch than the active one."""
    cross_version_hits: int = 0
    """Nodes of another epoch met on a lookup path (must stay 0)."""


class PrefixCache:
    """Radix tree of KV per weights epoch, at most `max_tokens` tokens in all epochs together."""

    def __init__(self, *, max_tokens: int, policy: Policy = "flush") -> None:
        if policy not in POLICIES:
            raise ValueError(f"prefix cache policy must be one of {POLICIES}, got {policy!r}")
        if max_tokens < 1:
            raise ValueError(f"prefix cache max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens, self.policy = max_tokens, policy
        self.epoch = 0
        """The weights epoch that serves now (only its tree is looked up or grown)."""
        self.stats = CacheStats()
        self._roots: dict[tuple[int, str | None], _Node] = {}
        """Tree roots by (epoch, extra_key)."""
        self._tokens = 0
        self._clock = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ queries
    @property
    def tokens(self) -> int:
        """Tokens held, all epochs."""
        return self._tokens

    def tokens_of(self, epoch: int) -> int:
        """Tokens held in `epoch`'s tree."""
        with self._lock:
            return sum(
                len(n.key)
                for (e, _), root in self._roots.items()
                if e == epoch
                for n in _walk(root)
            )

    def info(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "epoch": self.epoch,
            "tokens": self._tokens,
            "max_tokens": self.max_tokens,
            **dataclasses.asdict(self.stats),
        }

    # ------------------------------------------------------------------ epochs
    def activate(self, epoch: int) -> None:
        """Weights of `epoch` serve from now on. `flush` drops every other epoch's tree;
        `salt` leaves them to LRU eviction (never matched again either way)."""
        with self._lock:
            self.epoch = epoch
            if self.policy == "flush":
                for key in [k for k in self._roots if k[0] != epoch]:
                    self._drop_tree(key)

    def flush(self) -> int:
        """Drop everything (`/flush_cache`, an update with `flush_cache: true`); returns the
        tokens freed."""
        with self._lock:
            freed = self._tokens
            for key in list(self._roots):
                self._drop_tree(key)
            return freed

    def peek(self, tokens: list[int], namespace: str | None = None) -> int:
        """Cached prefix length of `tokens` in the active epoch (no stats, no LRU touch): what
        admission counts as already prefilled."""
        with self._lock:
            node, pos = self._roots.get((self.epoch, namespace)), 0
            while node is not None and pos < len(tokens):
                child = node.children.get(tokens[pos])
                if child is None or child.epoch != self.epoch:
                    break
                n = _common(child.key, tokens, pos, len(tokens))
                pos += n
                node = child if n == len(child.key) else None
            return pos

    # ------------------------------------------------------------------ lookup and insert
    def match(
        self,
        tokens: list[int],
        *,
        limit: int,
        need_routed: bool = False,
        namespace: str | None = None,
    ) -> Match:
        """Longest cached prefix of `tokens[:limit]` in the active epoch's `namespace` tree. With
        `need_routed`, stop at the first node without expert ids. Counts the lookup."""
        with self._lock:
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(tokens)
            root = self._roots.get((self.epoch, namespace))
            if root is None or limit <= 0:
                return MISS
            self._clock += 1
            parts: list[tuple[_Node, int]] = []
            node, pos = root, 0
            while pos < limit:
                child = node.children.get(tokens[pos])
                if child is None:
                    break
                if child.epoch != self.epoch:  # impossible by construction: count, never reuse
                    self.stats.cross_version_hits += 1
                    break
                if need_routed and child.routed is None:
                    break
                n = _common(child.key, tokens, pos, limit)
                child.last_use = self._clock
                parts.append((child, n))
                pos += n
                if n < len(child.key):
                    break
                node = child
            if pos == 0:
                return MISS
            kv = [
                (
                    torch.cat([p.kv[layer][0][:, :n] for p, n in parts], dim=1),
                    torch.cat([p.kv[layer][1][:, :n] for p, n in parts], dim=1),
                )
                for layer in range(len(parts[0][0].kv))
            ]
            routed = None
            if all(p.routed is not None for p, _ in parts):
                routed = torch.cat([p.routed[:n] for p, n in parts])  # type: ignore[index]
            self.stats.hit_requests += 1
            self.stats.cached_tokens += pos
            return Match(length=pos, kv=kv, routed=routed)

    def insert(
        self,
        tokens: list[int],
        kv: KV,
        *,
        epoch: int,
        namespace: str | None = None,
        routed: torch.Tensor | None = None,
    ) -> int:
        """Add `tokens` whose KV (per layer `[kv_heads, len(tokens), head_dim]`) was computed
        under `epoch`; returns the tokens newly stored. Refused (0) unless `epoch` is the active
        one. Existing nodes keep their KV (the same weights computed it) and gain `routed` if
        they lacked it. Evicts LRU leaves down to `max_tokens` afterwards."""
        with self._lock:
            if epoch != self.epoch:
                self.stats.refused_inserts += 1
                return 0
            self._clock += 1
            root = self._roots.get((epoch, namespace))
            if root is None:
                root = self._roots[(epoch, namespace)] = _Node((), [], None, None, epoch)
            node, pos, added = root, 0, 0
            while pos < len(tokens):
                child = node.children.get(tokens[pos])
                if child is None:
                    key = tuple(tokens[pos:])
                    new = _Node(
                        key,
                        [(k[:, pos:].clone(), v[:, pos:].clone()) for k, v in kv],
                        routed[pos:].clone() if routed is not None else None,
                        node,
                        epoch,
                    )
                    new.last_use = self._clock
                    node.children[tokens[pos]] = new
                    added = len(key)
                    break
                n = _common(child.key, tokens, pos, len(tokens))
                if n < len(child.key):
                    child = _split(child, n)
                if child.routed is None and routed is not None:
                    child.routed = routed[pos : pos + n].clone()
                child.last_use = self._clock
                pos += n
                node = child
            self._tokens += added
            self.stats.inserted_tokens += added
            self._evict()
            return added

    # ------------------------------------------------------------------ internals
    def _drop_tree(self, key: tuple[int, str | None]) -> None:
        root = self._roots.pop(key)
        freed = sum(len(n.key) for n in _walk(root))
        self._tokens -= freed
        self.stats.flushed_tokens += freed

    def _evict(self) -> None:
        if self._tokens <= self.max_tokens:
            return
        heap = [
            (n.last_use, id(n), n)
            for root in self._roots.values()
            for n in _walk(root)
            if not n.children
        ]
        heapq.heapify(heap)
        while self._tokens > self.max_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._tokens -= len(leaf.key)
            self.stats.evicted_tokens += len(leaf.key)
            if parent.parent is not None and not parent.children:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        for key in [k for k, r in self._roots.items() if not r.children]:
            del self._roots[key]


def _walk(root: _Node) -> list[_Node]:
    """Every node below `root` (not the root itself)."""
    out, stack = [], list(root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def _common(key: tuple[int, ...], tokens: list[int], pos: int, limit: int) -> int:
    """Length of the common prefix of `key` and `tokens[pos:limit]`."""
    n = min(len(key), limit - pos)
    i = 0
    while i < n and key[i] == tokens[pos + i]:
        i += 1
    return i


def _split(node: _Node, n: int) -> _Node:
    """Split `node` after its first `n` tokens; returns the new upper node (same epoch)."""
    parent = node.parent
    assert parent is not None and 0 < n < len(node.key)
    upper = _Node(
        node.key[:n],
        [(k[:, :n].clone(), v[:, :n].clone()) for k, v in node.kv],
        node.routed[:n].clone() if node.routed is not None else None,
        parent,
        node.epoch,
    )
    upper.last_use = node.last_use
    node.key = node.key[n:]
    node.kv = [(k[:, n:].clone(), v[:, n:].clone()) for k, v in node.kv]
    node.routed = node.routed[n:].clone() if node.routed is not None else None
    node.parent = upper
    upper.children[node.key[0]] = node
    parent.children[upper.key[0]] = upper
    return upper
