"""slime's `Sample` and `args`, as slime plugins read them: reward functions
(`async def rm(args, sample, **kwargs)`, `--group-rm`) and custom generate functions
(`async def generate(args, sample, sampling_params) -> Sample`).

Owns: `SlimeSample` (slime's field names and `Sample.Status`, plus `append_response_tokens`,
which here also records each token's policy version from `meta_info`), `SlimeArgs` (the
namespace a plugin gets as `args`) and `is_slime_style` (which calling convention a plugin
uses). Never imports the trainer, engine or controller.

A slime plugin sees the fields it uses in slime: `prompt`, `tokens` (prompt + response ids),
`response`, `response_length`, `label`, `reward`, `loss_mask` (response tokens: 1 trained, 0
tool/environment), `rollout_log_probs`, `status`, `metadata`, `weight_versions`,
`rollout_routed_experts`, `index`, `group_index`. slime's own helpers beyond
`append_response_tokens` (multimodal inputs, top-p replay, tracing) are not provided.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
from typing import Any


def is_slime_style(fn: Any, *, min_positional: int = 2) -> bool:
    """True when `fn` takes slime's leading `args` (≥ `min_positional` required positional
    parameters: `rm(args, sample)`, `generate(args, sample, sampling_params)`); ours take one
    (`RewardInput`) or two (`ctx, request`) — see the callers."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(required) >= min_positional


class SlimeArgs(argparse.Namespace):
    """The `args` namespace handed to slime-style plugins: slime's attribute names for the
    settings this run has (`rollout_temperature`, `n_samples_per_prompt`, `custom_rm_path`,
    `group_rm`, `sglang_router_ip`/`sglang_router_port`, ...). An attribute slime has and this
    run does not raises AttributeError naming it, rather than returning a made-up value."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"args.{name}: slime-async does not have slime's {name!r} setting; the plugin's "
            f"args carry: {sorted(vars(self))}"
        )


class _Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclasses.dataclass
class SlimeSample:
    """One sample in slime's shape (mutable, as slime plugins modify it in place)."""

    Status = _Status

    group_index: int | None = None
    index: int | None = None
    prompt: Any = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    status: _Status = _Status.PENDING
    metadata: dict = dataclasses.field(default_factory=dict)
    token_versions: list[int] = dataclasses.field(default_factory=list)
    """Not slime's: the policy version of each response token, recorded by
    `append_response_tokens` (model tokens: from `meta_info`; tool tokens: the version of the
    latest model turn)."""

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Any = None,
        log_probs: Any = None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """slime's helper: append response tokens, keeping `loss_mask` (1 for `trainable`
        model tokens, 0 otherwise), `rollout_log_probs` (0.0 for non-trainable tokens),
        `response`, `response_length` and, here, per-token versions aligned."""
        del args, update_terminal_info
        toks = [int(t) for t in (tokens if tokens is not None else ())]
        lps = None if log_probs is None else [float(x) for x in log_probs]
        if lps is not None and len(lps) != len(toks):
            raise ValueError(f"log_probs length {len(lps)} != tokens length {len(toks)}")
        if toks and trainable and lps is None:
            raise ValueError("trainable response tokens need their rollout log-probs")
        if toks and not trainable:
            if lps is not None:
                raise ValueError("non-trainable (tool) tokens take no rollout log-probs")
            lps = [0.0] * len(toks)
        if text is not None:
            self.response += text
        before = self.response_length
        self.tokens = [*self.tokens, *toks]
        self.response_length += len(toks)
        self.loss_mask = [*(self.loss_mask or [1] * before), *([1 if trainable else 0] * len(toks))]
        if lps is not None:
            self.rollout_log_probs = [*(self.rollout_log_probs or [0.0] * before), *lps]
        meta = meta_info or {}
        if "weight_version" in meta:
            self.weight_versions.append(str(meta["weight_version"]))
        self.token_versions.extend(_versions(meta, len(toks), self.token_versions))
        if meta.get("routed_experts") is not None:
            self.rollout_routed_experts = meta["routed_experts"]
        finish = (meta.get("finish_reason") or {}).get("type") if meta else None
        if finish == "length":
            self.status = _Status.TRUNCATED
        elif finish == "abort":
            self.status = _Status.ABORTED
        elif finish is not None:
            self.status = _Status.COMPLETED


def _versions(meta: dict, n: int, before: list[int]) -> list[int]:
    """Per-token versions of `n` new tokens: `weight_versions` spans, else `weight_version`;
    tokens without `meta_info` (tool output) take the latest model token's version."""
    if "weight_version" not in meta:
        return [before[-1] if before else -1] * n
    out = [int(meta["weight_version"])] * n
    for span in meta.get("weight_versions") or ():
        for t in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            out[t] = int(span["version"])
    return out
