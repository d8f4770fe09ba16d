"""The embedded default task family: verifiable digit tasks on a tiny token vocabulary.

Owns: the token layout of the built-in tasks (PAD, BOS, EOS, SEP, task markers, digits), the
deterministic prompt generator with its train / held-out eval split, and `task_hf_config`, which
stamps the special-token ids onto the HF config built from a `ModelSpec`. No tokenizer is needed:
prompts and answers are token ids. Imports only `slime_async.contracts.model`; never imports the
trainer, engine or controller.

A prompt is ``[BOS, <task>, d1 .. dn, SEP]`` and the correct response is the answer digits
followed by EOS. Four tasks: copy, reverse, sort (ascending) and add-one (the digit string as a
decimal number plus one, zero-padded to n digits; ``"999" -> "1000"``). A difficulty ``level``
sets the number of digits, ``n = min_digits + digits_per_level * level`` (2, 5, 8, 11 by
default), so it drives both the response length and the pass rate (longer answers have more
tokens to get wrong). Levels are drawn with probability proportional to ``level_decay**level``:
hard prompts are rarer but long, so simplicity bias and length-aware dispatch are both real.

Worked example (defaults)::

    fam = TaskFamily(TaskFamilyConfig(seed=0))
    p = fam.train_prompt(7)     # the same prompt for (seed=0, index=7), in every process
    p.key                       # e.g. "reverse/31415": stable per prompt, used by length caches
    p.prompt_ids                # (1, 5, 13, 11, 14, 11, 15, 3)
    p.label_ids + (EOS,)        # the one response that earns reward 1
    fam.eval_set()              # held-out prompts: keys never produced by train_prompt
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

from clifields import StrEnum
from slime_async.contracts.model import ModelSpec

PAD = 0
"""Padding token id."""
BOS = 1
"""Beginning-of-sequence token id (first prompt token)."""
EOS = 2
"""End-of-sequence token id: a response is complete when it emits EOS."""
SEP = 3
"""Separator between the digits of the prompt and the response (last prompt token)."""
DIGIT0 = 10
"""Token id of digit 0; digit d is ``DIGIT0 + d``."""
TASK_VOCAB_SIZE = DIGIT0 + 10
"""Smallest vocabulary that holds every task token (ids 8 and 9 are reserved)."""


class TaskKind(StrEnum):
    """The built-in verifiable tasks; the value is the marker name used in keys."""

    COPY = "copy"
    REVERSE = "reverse"
    SORT = "sort"
    ADD_ONE = "add_one"

    @property
    def token(self) -> int:
        """Marker token id placed right after BOS."""
        return 4 + list(TaskKind).index(self)


_MARKER_TO_KIND = {k.token: k for k in TaskKind}
_SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", SEP: "<sep>"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TaskFamilyConfig:
    """Configuration of the embedded task family."""

    seed: int = 0
    """Seed of the prompt generator (train and eval streams derive from it)."""
    tasks: tuple[TaskKind, ...] = tuple(TaskKind)
    """Which tasks to draw from (uniformly)."""
    num_levels: int = 4
    """Number of difficulty levels, 0 .. num_levels-1."""
    min_digits: int = 2
    """Digits at level 0."""
    digits_per_level: int = 3
    """Extra digits per level: n = min_digits + digits_per_level * level."""
    level_decay: float = 0.5
    """P(level) is proportional to level_decay**level (< 1: hard prompts are rarer)."""
    eval_fraction: float = 0.1
    """Fraction of the prompt space (by key hash) held out for evaluation."""
    eval_per_level: int = 32
    """Held-out eval prompts per level returned by `TaskFamily.eval_set()`."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("TaskFamilyConfig.tasks is empty; name at least one TaskKind")
        object.__setattr__(self, "tasks", tuple(TaskKind(t) for t in self.tasks))
        if self.num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {self.num_levels}")
        if self.min_digits < 1 or self.digits_per_level < 0:
            raise ValueError(
                f"need min_digits >= 1 and digits_per_level >= 0, got "
                f"{self.min_digits} and {self.digits_per_level}"
            )
        if self.level_decay <= 0.0:
            raise ValueError(f"level_decay must be > 0, got {self.level_decay}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.eval_per_level < 1:
            raise ValueError(f"eval_per_level must be >= 1, got {self.eval_per_level}")

    def digits_at(self, level: int) -> int:
        """Number of prompt digits at ``level``."""
        return self.min_digits + self.digits_per_level * level

    def max_response_len(self) -> int:
        """Longest correct response (answer digits + EOS) over all levels."""
        return self.digits_at(self.num_levels - 1) + 2

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tasks"] = [t.value for t in self.tasks]
        return d


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TaskPrompt:
    """One verifiable prompt with its label."""

    key: str
    """Stable identity, ``"<task>/<digits>"``: the same prompt always has the same key."""
    kind: TaskKind
    """Which task."""
    level: int
    """Difficulty level (sets the number of digits)."""
    digits: str
    """The input digit string."""
    label: str
    """The correct answer digits."""
    prompt_ids: tuple[int, ...]
    """``[BOS, marker, digits..., SEP]``."""
    label_ids: tuple[int, ...]
    """Answer tokens without EOS; the correct response is ``label_ids + (EOS,)``."""

    @property
    def response_ids(self) -> tuple[int, ...]:
        """The correct response, EOS included."""
        return (*self.label_ids, EOS)

    @property
    def expected_len(self) -> int:
        """Length of the correct response (a good length hint for dispatch)."""
        return len(self.label_ids) + 1


# ---------------------------------------------------------------------------- pure helpers
def solve(kind: TaskKind, digits: str) -> str:
    """The correct answer digits of ``kind`` applied to ``digits``."""
    if not digits or not digits.isdigit():
        raise ValueError(f"digits must be a non-empty string of 0-9, got {digits!r}")
    if kind is TaskKind.COPY:
        return digits
    if kind is TaskKind.REVERSE:
        return digits[::-1]
    if kind is TaskKind.SORT:
        return "".join(sorted(digits))
    if kind is TaskKind.ADD_ONE:
        return str(int(digits) + 1).zfill(len(digits))
    raise ValueError(f"unknown task {kind!r}")


def encode_digits(digits: str) -> tuple[int, ...]:
    """Token ids of a digit string."""
    return tuple(DIGIT0 + int(c) for c in digits)


def make_prompt(kind: TaskKind, digits: str, *, level: int) -> TaskPrompt:
    """Build the `TaskPrompt` for ``kind`` on ``digits``."""
    kind = TaskKind(kind)
    label = solve(kind, digits)
    return TaskPrompt(
        key=f"{kind.value}/{digits}",
        kind=kind,
        level=level,
        digits=digits,
        label=label,
        prompt_ids=(BOS, kind.token, *encode_digits(digits), SEP),
        label_ids=encode_digits(label),
    )


def decode(ids: Any) -> str:
    """Human-readable rendering of task token ids, e.g. ``"<bos> reverse 3 1 <sep>"``."""
    out = []
    for t in ids:
        t = int(t)
        if t in _SPECIAL_NAMES:
            out.append(_SPECIAL_NAMES[t])
        elif t in _MARKER_TO_KIND:
            out.append(_MARKER_TO_KIND[t].value)
        elif DIGIT0 <= t < DIGIT0 + 10:
            out.append(str(t - DIGIT0))
        else:
            out.append(f"<{t}>")
    return " ".join(out)


def key_bucket(key: str) -> float:
    """Deterministic uniform value in [0, 1) derived from a prompt key (process-independent)."""
    h = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64


def level_probs(cfg: TaskFamilyConfig) -> list[float]:
    """P(level) for levels 0 .. num_levels-1 (proportional to ``level_decay**level``)."""
    w = [cfg.level_decay**lv for lv in range(cfg.num_levels)]
    total = sum(w)
    return [x / total for x in w]


def task_hf_config(spec: ModelSpec) -> Any:
    """`spec.to_hf_config()` with the task family's BOS/EOS/PAD ids set.

    Raises if the vocabulary cannot hold the task tokens.
    """
    if spec.vocab_size < TASK_VOCAB_SIZE:
        raise ValueError(
            f"ModelSpec.vocab_size={spec.vocab_size} is too small for the built-in tasks, "
            f"which use token ids up to {TASK_VOCAB_SIZE - 1}; use vocab_size >= {TASK_VOCAB_SIZE}"
        )
    cfg = spec.to_hf_config()
    cfg.bos_token_id = BOS
    cfg.eos_token_id = EOS
    cfg.pad_token_id = PAD
    return cfg


# ---------------------------------------------------------------------------- generator
class TaskFamily:
    """Deterministic prompt source over the configured tasks and levels.

    ``train_prompt(i)`` depends only on (seed, i), so a resumed run that restarts its cursor at
    ``i`` sees exactly the prompts it would have seen. Keys whose hash falls below
    ``eval_fraction`` are held out: `train_prompt` never returns them and `eval_set` returns
    only them.
    """

    def __init__(self, config: TaskFamilyConfig | None = None) -> None:
        self.config = config or TaskFamilyConfig()
        self._level_probs = level_probs(self.config)

    def is_eval_key(self, key: str) -> bool:
        """Whether ``key`` belongs to the held-out eval split."""
        return key_bucket(key) < self.config.eval_fraction

    def _draw(self, rng: random.Random, level: int | None) -> TaskPrompt:
        cfg = self.config
        if level is None:
            level = rng.choices(range(cfg.num_levels), weights=self._level_probs)[0]
        kind = rng.choice(cfg.tasks)
        digits = "".join(rng.choice("0123456789") for _ in range(cfg.digits_at(level)))
        return make_prompt(kind, digits, level=level)

    def train_prompt(self, index: int, *, level: int | None = None) -> TaskPrompt:
        """The training prompt at ``index`` (a level is drawn unless given)."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        rng = random.Random(f"{self.config.seed}/train/{index}/{level}")
        for _ in range(10_000):
            p = self._draw(rng, level)
            if not self.is_eval_key(p.key):
                return p
        raise RuntimeError("could not draw a training prompt; is eval_fraction close to 1?")

    def train_prompts(self, start: int, count: int) -> list[TaskPrompt]:
        """``count`` consecutive training prompts from index ``start``."""
        return [self.train_prompt(i) for i in range(start, start + count)]

    def eval_set(self, per_level: int | None = None) -> list[TaskPrompt]:
        """Held-out prompts, ``per_level`` distinct ones for every level (deterministic)."""
        cfg = self.config
        n = cfg.eval_per_level if per_level is None else per_level
        out: list[TaskPrompt] = []
        for level in range(cfg.num_levels):
            rng = random.Random(f"{cfg.seed}/eval/{level}")
            seen: dict[str, TaskPrompt] = {}
            for _ in range(max(10_000, 200 * n)):
                p = self._draw(rng, level)
                if self.is_eval_key(p.key):
                    seen.setdefault(p.key, p)
                    if len(seen) == n:
                        break
            if len(seen) < n:
                raise ValueError(
                    f"level {level} has only {len(seen)} distinct held-out prompts, fewer than "
                    f"the {n} requested; lower eval_per_level or raise eval_fraction/min_digits"
                )
            out.extend(seen.values())
        return out
