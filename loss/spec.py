"""What a loss declares to the trainer: its settings class and the inputs it reads.

Owns: `LossNeeds` (which inputs the trainer must compute for a loss), `LossSpec` (name,
function, config class, needs) and `LossSelection` (the chosen loss by name or dotted path,
plus its config object: what the trainer's config holds). Must never import `slime_async`.

The trainer computes only what `needs` names (see loss/README.md, "The loss seam"):

| need | what the trainer does for it |
|---|---|
| `proximal_logprobs` | a no-grad forward per micro-batch at the start of the step (π_k); also run for R2 routing replay, which records routing in it |
| `behavior_logprobs` | with `--keep-old-actor`: per token, a forward under its version's snapshot (π_j^Meg; implies the π_k forward) |
| `rollout_logprobs` | nothing: π_j^SGL comes with every batch from the engines |
| `routing_replay` | refuses to start an MoE run without routing replay (r2 or r3) |
| `entropy` | passes the training forward's entropy (with grad) |
| `reference_logprobs` | keeps the reference weights; one no-grad forward under them per micro-batch |
| `denominators` | None: global valid-token/sequence counts of `loss_mask`, free; a function: called per micro-batch on the no-grad inputs, summed over micro-batches and DP ranks (and the π_k forward runs for it), unless `denominators_read_logprobs(cfg)` says this config's counts are the mask's |

Worked example (a plugin that reads only π_k and the engine's log-probs)::

    register_loss("my_ppo", my_ppo, config_cls=MyConfig,
                  needs=LossNeeds(proximal_logprobs=True, behavior_logprobs=False))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from loss.types import LossInputs, LossOutputs

LossFn = Callable[..., LossOutputs]
"""`fn(inputs: LossInputs, cfg) -> LossOutputs`; `cfg` is an instance of the loss's config class."""
DenominatorFn = Callable[[LossInputs, Any], tuple[float, float]]
"""`fn(inputs, cfg) -> (tokens, sequences)` of one micro-batch (before the training forward)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossNeeds:
    """The inputs a loss reads; the trainer computes these and nothing else."""

    proximal_logprobs: bool = True
    """Reads π_k (`proximal_logprobs`). A train step takes one optimizer update after all its
    micro-batches, so π_k equals the training forward's detached log-probs (r1 ≡ 1 in value):
    the trainer passes those and runs no separate π_k forward, unless something must be known
    before the training forward (R2 routing replay records routing in it; a denominator
    function that reads log-probs, see `denominators_read_logprobs`)."""
    behavior_logprobs: bool = False
    """Reads π_j^Meg (`behavior_logprobs`): with `keep_old_actor`, one forward per held version
    j under its snapshot (plus the π_k forward: tokens of the current version take π_k). When
    False the trainer runs no snapshot forward and passes None (so diagnostics that need
    π_j^Meg, e.g. `is/engine/*`, are not computed either)."""
    rollout_logprobs: bool = True
    """Reads π_j^SGL (`rollout_logprobs`). Nothing to compute: every batch carries them."""
    routing_replay: bool = False
    """Only valid with MoE routing replay (r2 or r3): the trainer refuses an MoE run without it."""
    entropy: bool = False
    """Reads the training forward's per-token entropy (with grad): `LossInputs.entropy`."""
    reference_logprobs: bool = False
    """Reads log π_ref (`LossInputs.reference_logprobs`): the trainer keeps the reference
    weights (the run's initial ones, or `--ref-load`) and runs one no-grad forward under them
    per micro-batch."""
    denominators: DenominatorFn | None = None
    """The loss's global denominators. None: the valid tokens and sequences of `loss_mask`
    (needs no forward). A function (e.g. `compis_denominators`, which honours `denom=drop`):
    called on each micro-batch's no-grad inputs before the training forward, so it needs
    `proximal_logprobs`."""
    denominators_read_logprobs: Callable[[Any], bool] | None = None
    """Whether `denominators`, under the loss's config, reads the log-probs (None: always).
    When it returns False, the function's counts must equal the valid tokens and sequences of
    `loss_mask` (e.g. CompIS with `denom=keep`: masked tokens still count), and the trainer
    takes those without the π_k forward the function would otherwise need."""

    def __post_init__(self) -> None:
        if self.denominators is not None and not callable(self.denominators):
            raise ValueError(f"denominators must be a function or None, got {self.denominators!r}.")
        if self.denominators_read_logprobs is not None and not callable(
            self.denominators_read_logprobs
        ):
            raise ValueError(
                "denominators_read_logprobs must be a function of the loss config or None, got "
                f"{self.denominators_read_logprobs!r}."
            )
        if self.denominators is not None and not self.proximal_logprobs:
            raise ValueError(
                "a loss with its own denominator function needs proximal_logprobs=True (the "
                "denominators are computed from the no-grad inputs before the training "
                "forward); or use denominators=None (valid-token counts of loss_mask)."
            )

    def denominators_need_logprobs(self, cfg: Any) -> bool:
        """True when the loss's own denominators under `cfg` must see the no-grad log-probs."""
        if self.denominators is None:
            return False
        return self.denominators_read_logprobs is None or bool(self.denominators_read_logprobs(cfg))

    def names(self) -> list[str]:
        """The log-prob inputs and features declared, for logs (e.g. ['proximal_logprobs'])."""
        flags = (
            "proximal_logprobs",
            "behavior_logprobs",
            "rollout_logprobs",
            "routing_replay",
            "entropy",
            "reference_logprobs",
        )
        out = [n for n in flags if getattr(self, n)]
        if self.denominators is not None:
            out.append(f"denominators={getattr(self.denominators, '__name__', 'custom')}")
        return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossSpec:
    """A loss as the trainer sees it: call `fn(inputs, cfg)` with `cfg` a `config_cls`."""

    name: str
    """Registry name (or the dotted path it was loaded from)."""
    fn: LossFn
    """`fn(inputs: LossInputs, cfg) -> LossOutputs`."""
    config_cls: type | None
    """Frozen dataclass of the loss's settings (`--loss-config key=value` fills its fields);
    None: the loss takes no settings and is called with `cfg=None`."""
    needs: LossNeeds = dataclasses.field(default_factory=LossNeeds)
    """The inputs the trainer computes for this loss."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"loss {self.name!r} must be callable, got {type(self.fn).__name__}.")
        if self.config_cls is not None and not (
            isinstance(self.config_cls, type) and dataclasses.is_dataclass(self.config_cls)
        ):
            raise ValueError(
                f"loss {self.name!r}: config_cls must be a dataclass type or None, got "
                f"{self.config_cls!r}."
            )

    def config(self, value: Any = None) -> Any:
        """The config the loss is called with: `value` (checked) or `config_cls()` defaults."""
        if self.config_cls is None:
            if value is not None:
                raise ValueError(
                    f"loss {self.name!r} takes no settings (no config class), got a "
                    f"{type(value).__name__}."
                )
            return None
        if value is None:
            return self.config_cls()
        if not isinstance(value, self.config_cls):
            raise ValueError(
                f"loss {self.name!r} takes a {self.config_cls.__name__}, got a "
                f"{type(value).__name__}; build it with loss.loss_settings_from_args or "
                f"{self.config_cls.__name__}(...)."
            )
        return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossSelection:
    """The selected loss and its settings (what a trainer's config holds)."""

    name: str = "compis"
    """Registry name (`loss.available_losses()`) or a dotted path to a plugin: a `LossSpec`
    or a function `fn(inputs, cfg) -> LossOutputs`."""
    config: Any = None
    """An instance of the loss's config class (None: its defaults)."""
    regularizers: Any = None
    """A `loss.regularizers.RegularizerConfig` (entropy bonus, KL to the reference policy)
    added to the loss; None: none."""
