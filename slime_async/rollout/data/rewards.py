"""Reward functions and the safe call around them.

Owns: the reward plugin contracts, the built-in rewards (binary exact match for the embedded
tasks, `math-verify` equivalence for real math data), resolution of a reward by name or dotted
path, `compute_reward` / `compute_group_rewards` (never raise: a reward that throws or returns
NaN/inf yields a `RewardResult` with status ERROR/NON_FINITE) and `RewardError`, which the
scorer raises for an ERROR (a reward that throws is a bug to fix, named with the function and
the sample, never a silently masked sample); NON_FINITE samples are masked and counted
(`summarize_rewards`). Imports the task token ids from `slime_async.rollout.data.tasks` and slime's
sample shape from `slime_async.rollout.slime_sample`; never the trainer, engine or controller.
slime's rule-based rewards (`--rm-type`) follow the same contract in `rollout.data.slime_rm`.

Plugin contracts, named by ``"package.module:function"`` or ``"package.module.function"``:
* ours: ``fn(inp: RewardInput) -> float | bool`` (or an ``async def`` returning one);
* slime's: ``async def rm(args, sample, **kwargs) -> float`` (`SlimeSample`), told apart by its
  two required positional parameters; with ``--group-rm`` slime's group form
  ``async def rm(args, samples: list, **kwargs) -> list[float]``.

Any of them may answer a dict instead of a number, as in slime: `KeyedReward` reads the reward
under ``--reward-key`` (``--eval-reward-key`` for eval samples).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from clifields import StrEnum
from slime_async.rollout.data.tasks import EOS
from slime_async.rollout.slime_sample import SlimeSample, is_slime_style

RewardFn = Callable[["RewardInput"], "float | bool | Awaitable[float | bool]"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RewardInput:
    """What a reward function sees for one sample."""

    response_ids: Sequence[int]
    """Generated token ids (EOS included when the engine stopped on it)."""
    label: Any
    """The dataset label: answer token ids for the built-in tasks, a string for math data."""
    response_text: str | None = None
    """Detokenized response, when a tokenizer exists (required by text rewards)."""
    prompt_ids: Sequence[int] = ()
    """Prompt token ids."""
    eos_id: int = EOS
    """Token id that ends a response."""
    truncated: bool = False
    """Whether generation stopped at the length limit instead of EOS."""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form per-row metadata from the dataset."""
    prompt_key: str = ""
    """The prompt's key (names the sample in errors)."""
    sample_index: int = 0
    """Index of the sample in its group."""
    prompt_text: str | None = None
    """Detokenized prompt, when a tokenizer exists."""
    loss_mask: Sequence[int] | None = None
    """Per response token, 1 trained / 0 tool output (multi-turn rollouts); None: all 1."""

    def describe(self) -> str:
        """The sample, for error messages."""
        return f"prompt {self.prompt_key!r}, sample {self.sample_index}"


class RewardError(RuntimeError):
    """A reward function raised: the run stops with the function and the sample named."""


class RewardStatus(StrEnum):
    """Outcome of one reward call."""

    OK = "ok"
    NON_FINITE = "non_finite"
    ERROR = "error"
    AGENT_FAILED = "agent_failed"
    """The agent of an agent rollout raised or timed out (`rollout.agent`): masked."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RewardResult:
    """A reward value, or the reason there is none (the sample must then be masked)."""

    reward: float
    """The reward; 0.0 when `status` is not OK (never NaN, so sums stay finite)."""
    status: RewardStatus = RewardStatus.OK
    """OK, NON_FINITE (returned NaN/inf or a non-number) or ERROR (raised)."""
    error: str | None = None
    """Short description of what went wrong, for logs."""

    @property
    def masked(self) -> bool:
        """True when the sample must be excluded from the loss."""
        return self.status is not RewardStatus.OK


# ---------------------------------------------------------------------------- built-ins
def exact_match(
    response_ids: Sequence[int], label_ids: Sequence[int], *, eos_id: int = EOS
) -> bool:
    """Whether the response is exactly ``label_ids`` followed by EOS (nothing before or after)."""
    resp = [int(t) for t in response_ids]
    return len(resp) == len(label_ids) + 1 and resp[-1] == eos_id and resp[:-1] == list(label_ids)


def exact_match_reward(inp: RewardInput) -> float:
    """Binary reward for the built-in tasks: 1.0 iff the response is the label then EOS."""
    label = inp.label
    if isinstance(label, str):
        from slime_async.rollout.data.tasks import encode_digits

        label = encode_digits(label)
    return float(exact_match(inp.response_ids, label, eos_id=inp.eos_id))


def _import_math_verify() -> Any:
    try:
        return importlib.import_module("math_verify")
    except ImportError as e:
        raise ImportError(
            "the 'math_verify' reward needs the math-verify package: "
            "pip install math-verify  (or choose another --reward)"
        ) from e


def math_verify_reward(inp: RewardInput) -> float:
    """1.0 iff `math-verify` finds the response's final answer equivalent to the label.

    Needs ``response_text``. The label may be plain (``"42"``, ``"1/2"``) or LaTeX.
    """
    mv = _import_math_verify()
    if inp.response_text is None:
        raise ValueError("math_verify reward needs response_text; give the run a tokenizer")
    # math-verify times out with SIGALRM, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    label = str(inp.label)
    gold = mv.parse(
        label if "$" in label or "\\" in label else f"${label}$", parsing_timeout=timeout
    )
    if not gold:
        raise ValueError(f"math-verify could not parse the label {label!r}")
    pred = mv.parse(inp.response_text, parsing_timeout=timeout)
    return float(bool(pred) and mv.verify(gold, pred, timeout_seconds=timeout))


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match_reward,
    "math_verify": math_verify_reward,
}
"""Rewards selectable by short name."""


def load_reward_fn(name: str) -> RewardFn:
    """Resolve a built-in name or a dotted path (``pkg.mod:fn`` or ``pkg.mod.fn``) to a callable."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
    else:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"reward {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor a dotted "
            f"path like 'my_pkg.rewards:score'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} for reward {name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"module {module_name!r} has no callable {attr!r} (reward {name!r})")
    return fn


def slime_sample(inp: RewardInput, *, group_index: int = 0) -> SlimeSample:
    """`inp` in slime's `Sample` shape (what a slime reward function reads)."""
    resp = [int(t) for t in inp.response_ids]
    status = SlimeSample.Status.TRUNCATED if inp.truncated else SlimeSample.Status.COMPLETED
    return SlimeSample(
        group_index=group_index,
        index=inp.sample_index,
        prompt=inp.prompt_text if inp.prompt_text is not None else "",
        tokens=[*(int(t) for t in inp.prompt_ids), *resp],
        response=inp.response_text or "",
        response_length=len(resp),
        label=inp.label,
        loss_mask=list(inp.loss_mask) if inp.loss_mask is not None else [1] * len(resp),
        status=status,
        metadata=dict(inp.metadata),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class KeyedReward:
    """A reward function whose answer is a dict, read under `key`: slime's `--reward-key`
    (`--eval-reward-key` for eval samples) with `--custom-rm-path`. The function is called as
    it would be alone (ours, slime's, slime's group form); each answer is a dict and the reward
    is its value under `key`."""

    fn: Any
    """The reward function itself."""
    key: str
    """The key of the reward in each answer."""
    flag: str = "--reward-key"
    """The flag that gave `key` (for messages)."""

    def pick(self, answer: Any) -> Any:
        """The reward in `answer` (ValueError naming the key and what the answer holds)."""
        if not isinstance(answer, Mapping):
            raise ValueError(
                f"returned {type(answer).__name__} {answer!r}, not a dict: {self.flag} "
                f"{self.key} reads the reward out of a dict answer; return a dict holding "
                f"{self.key!r} (or drop {self.flag})"
            )
        if self.key not in answer:
            raise ValueError(
                f"returned a dict without the key {self.key!r} ({self.flag}); its keys: "
                f"{', '.join(map(repr, answer)) or 'none'}: give {self.flag} one of them"
            )
        return answer[self.key]


def _unkeyed(fn: Any) -> tuple[Any, KeyedReward | None]:
    """The function to call, and the `KeyedReward` that reads its answers (None: the answer
    is the reward)."""
    return (fn.fn, fn) if isinstance(fn, KeyedReward) else (fn, None)


def function_name(fn: Any) -> str:
    """`module.qualname` of a plugin, for messages."""
    fn, _ = _unkeyed(fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ---------------------------------------------------------------------------- safe calls
def _to_result(value: Any) -> RewardResult:
    if isinstance(value, Mapping):  # slime's reward dicts are read under --reward-key
        keys = ", ".join(map(repr, value)) or "none"
        return RewardResult(
            reward=0.0,
            status=RewardStatus.ERROR,
            error=f"returned a dict (keys: {keys}), not a number; give --reward-key KEY "
            "(and --eval-reward-key KEY for eval samples) to take the reward out of it",
        )
    if isinstance(value, bool):
        return RewardResult(reward=float(value))
    try:
        r = float(value)
    except (TypeError, ValueError):
        return RewardResult(
            reward=0.0,
            status=RewardStatus.NON_FINITE,
            error=f"reward returned {type(value).__name__}, not a number",
        )
    if not math.isfinite(r):
        return RewardResult(reward=0.0, status=RewardStatus.NON_FINITE, error=f"reward was {r}")
    return RewardResult(reward=r)


def _error_result(e: BaseException) -> RewardResult:
    return RewardResult(reward=0.0, status=RewardStatus.ERROR, error=f"{type(e).__name__}: {e}")


def compute_reward_sync(fn: RewardFn, inp: RewardInput) -> RewardResult:
    """Call a synchronous reward outside an event loop; never raises."""
    fn, keyed = _unkeyed(fn)
    try:
        value = fn(inp)
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()
            raise TypeError("async reward called through compute_reward_sync; use compute_reward")
        if keyed is not None:
            value = keyed.pick(value)
    except Exception as e:
        return _error_result(e)
    return _to_result(value)


async def compute_reward(fn: RewardFn, inp: RewardInput, *, args: Any = None) -> RewardResult:
    """Call a sync or async reward from an event loop; never raises. A slime-style
    `rm(args, sample)` gets `args` and `inp` as a `SlimeSample`.

    Errors and NaN/inf/non-numbers become results with status ERROR/NON_FINITE (reward 0.0).
    """
    fn, keyed = _unkeyed(fn)
    try:
        value = fn(args, slime_sample(inp)) if is_slime_style(fn) else fn(inp)
        if inspect.isawaitable(value):
            value = await value
        if keyed is not None:
            value = keyed.pick(value)
    except Exception as e:
        return _error_result(e)
    return _to_result(value)


async def compute_group_rewards(
    fn: Any, inps: Sequence[RewardInput], *, args: Any, group_index: int = 0
) -> list[RewardResult]:
    """slime's `--group-rm`: `rm(args, samples) -> list` once for a whole group; never raises
    (a raise, or a list of the wrong length, gives every sample an ERROR result)."""
    fn, keyed = _unkeyed(fn)
    try:
        value = fn(args, [slime_sample(i, group_index=group_index) for i in inps])
        if inspect.isawaitable(value):
            value = await value
        values = list(value)
        if len(values) != len(inps):
            raise ValueError(f"returned {len(values)} rewards for a group of {len(inps)}")
        if keyed is not None:
            values = [keyed.pick(v) for v in values]
    except Exception as e:
        return [_error_result(e)] * len(inps)
    return [_to_result(v) for v in values]


def summarize_rewards(results: Iterable[RewardResult]) -> dict[str, float]:
    """Metrics of a batch of rewards: mean over unmasked samples, and masked counters.

    Keys: ``rollout/reward`` (NaN when every sample was masked), ``reward/masked_frac``,
    ``reward/error_count``, ``reward/non_finite_count``, ``reward/count``.
    """
    results = list(results)
    ok = [r.reward for r in results if not r.masked]
    errors = sum(r.status is RewardStatus.ERROR for r in results)
    non_finite = sum(r.status is RewardStatus.NON_FINITE for r in results)
    n = len(results)
    return {
        "rollout/reward": sum(ok) / len(ok) if ok else math.nan,
        "reward/masked_frac": (errors + non_finite) / n if n else 0.0,
        "reward/error_count": float(errors),
        "reward/non_finite_count": float(non_finite),
        "reward/count": float(n),
    }
