"""reasoning-gym as a prompt source: procedural, verifiable tasks scored by their own scorers.

Owns `GymTask` / `ReasoningGymConfig` (which task families, their difficulty settings and
weights, the system prompt and the answer format), `parse_prompt_source` (the
``reasoning_gym:NAME[,NAME...]`` spec of `--prompt-source` plus `--reasoning-gym-task` settings),
`GymPromptSource` (an endless, resumable stream: the prompt at cursor i depends only on
(seed, i)), `ReasoningGymTasks.eval_set` (held-out prompts from a disjoint seed; a training
question equal to a held-out one is skipped, so the split is exact) and `GymReward` (extracts the
answer the way the prompt asked for it and calls the task's own `score_answer`).

Answer formats: ``answer_tag`` is reasoning-gym's convention (the system prompt asks for
``<answer>...</answer>``; the last such span is scored, none scores 0); ``response`` scores the
whole response, stripped (for a prompt that asks for the answer alone); ``last_number`` scores the
last number in the response (for tasks whose answer is a number, GSM8K-style: "so 3 + 4 = 7."
gives "7"; a response without a number scores as no answer). The scorer is the task's:
e.g. the arithmetic families accept "+01,000.00" for "1000" and give partial credit
len(answer)/len(response) when the answer appears inside a longer response.

Imports `reasoning_gym` lazily (an optional dependency); never the trainer, engine or controller.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from slime_async.contracts.rollout import Prompt

SPEC_PREFIX = "reasoning_gym:"
"""`--prompt-source` prefix naming reasoning-gym task families."""
ANSWER_FORMATS = ("answer_tag", "response", "last_number")
"""How the answer is read from a response (see the module docstring)."""
EVAL_SEED_OFFSET = 1_000_003_711
"""Held-out prompts come from seed + this: reasoning-gym seeds item i with `Random(seed + i)`,
so a nearby seed would replay the training stream shifted by a few items."""
RESERVED_KEYS = ("weight",)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
"""Task settings that are ours, not the task config's."""


def _import_rg() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            "--prompt-source reasoning_gym:... needs the reasoning-gym package: "
            "pip install reasoning-gym (pinned in constraints.txt)"
        ) from e
    return reasoning_gym


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GymTask:
    """One reasoning-gym task family with its settings."""

    name: str
    """Registered name (`reasoning_gym.factory.DATASETS`), e.g. 'chain_sum'."""
    weight: float = 1.0
    """Relative frequency in the training stream and the eval set."""
    settings: tuple[tuple[str, Any], ...] = ()
    """Fields of the task's config dataclass (its difficulty), e.g. (('max_terms', 3),)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReasoningGymConfig:
    """Which reasoning-gym tasks a run trains on, and how prompts and answers are formed."""

    tasks: tuple[GymTask, ...]
    """Task families (at least one)."""
    seed: int = 0
    """Training stream seed; held-out prompts use seed + `EVAL_SEED_OFFSET`."""
    system_prompt: str | None = "direct"
    """A name in `reasoning_gym.utils.SYSTEM_PROMPTS` ('direct', 'default', ...), literal text,
    or None for none (the chat template's own default then applies)."""
    answer_format: str = "answer_tag"
    """'answer_tag', 'response' or 'last_number' (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("reasoning_gym: name at least one task, e.g. reasoning_gym:chain_sum")
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"--reasoning-gym-answer-format {self.answer_format!r}: use one of "
                f"{', '.join(ANSWER_FORMATS)}"
            )
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"reasoning_gym: task named twice in {names}")
        for t in self.tasks:
            if not t.weight > 0:
                raise ValueError(f"reasoning_gym: {t.name}.weight={t.weight} must be > 0")

    def system_text(self) -> str | None:
        """The system message (a named reasoning-gym prompt resolved to its text)."""
        if self.system_prompt is None:
            return None
        from reasoning_gym.utils import SYSTEM_PROMPTS

        return SYSTEM_PROMPTS.get(self.system_prompt, self.system_prompt)


def _value(text: str) -> Any:
    """A setting's value as typed: JSON (numbers, true/false, lists) or else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_prompt_source(
    spec: str,
    *,
    task_settings: Sequence[str] = (),
    seed: int = 0,
    system_prompt: str | None = "direct",
    answer_format: str = "answer_tag",
) -> ReasoningGymConfig:
    """``reasoning_gym:a,b`` and settings ``["a.max_terms=3", "b.weight=2"]`` -> the config.

    Checks the names against reasoning-gym's registry and each setting against the task's config
    dataclass, so a typo fails at start-up with the choices.
    """
    if not spec.startswith(SPEC_PREFIX):
        raise ValueError(f"--prompt-source {spec!r}: expected {SPEC_PREFIX}NAME[,NAME...]")
    names = [n.strip() for n in spec[len(SPEC_PREFIX) :].split(",") if n.strip()]
    rg = _import_rg()
    registry = rg.factory.DATASETS
    unknown = [n for n in names if n not in registry]
    if unknown:
        close = sorted(k for k in registry if any(u[:4] in k for u in unknown))[:10]
        raise ValueError(
            f"--prompt-source: unknown reasoning-gym task(s) {unknown}"
            + (f"; similar: {close}" if close else "")
            + " (all names: python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory"
            ".DATASETS))')"
        )
    settings: dict[str, dict[str, Any]] = {n: {} for n in names}
    for item in task_settings:
        lhs, eq, rhs = item.partition("=")
        task, dot, key = lhs.strip().partition(".")
        if not eq or not dot or not key:
            raise ValueError(
                f"--reasoning-gym-task {item!r}: write TASK.KEY=VALUE, e.g. chain_sum.max_terms=3 "
                "or chain_sum.weight=2"
            )
        if task not in settings:
            raise ValueError(
                f"--reasoning-gym-task {item!r}: {task!r} is not among the --prompt-source "
                f"tasks {names}"
            )
        settings[task][key] = _value(rhs.strip())
    tasks = []
    for n in names:
        kw = dict(settings[n])
        weight = float(kw.pop("weight", 1.0))
        fields = {f.name for f in dataclasses.fields(registry[n][1])} - {"seed", "size"}
        bad = sorted(set(kw) - fields)
        if bad:
            raise ValueError(
                f"--reasoning-gym-task: {n} has no setting(s) {bad}; its settings are "
                f"{sorted(fields)} (and weight)"
            )
        tasks.append(GymTask(name=n, weight=weight, settings=tuple(sorted(kw.items()))))
    return ReasoningGymConfig(
        tasks=tuple(tasks), seed=seed, system_prompt=system_prompt, answer_format=answer_format
    )


def _stable_int(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


class ReasoningGymTasks:
    """The task datasets of a config: train and held-out items, prompts, and the scorer."""

    def __init__(
        self,
        config: ReasoningGymConfig,
        *,
        tokenizer: Any = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._template_kwargs = dict(template_kwargs or {})
        """Keyword arguments of the chat template (--apply-chat-template-kwargs)."""
        rg = _import_rg()
        self.config = config
        self.tokenizer = tokenizer
        self._system = config.system_text()
        self._train: dict[str, Any] = {}
        self._eval: dict[str, Any] = {}
        big = 2**31  # items are generated on demand by index; size only bounds iteration
        for i, t in enumerate(config.tasks):
            kw = dict(t.settings)
            try:
                self._train[t.name] = rg.create_dataset(
                    t.name, seed=_stable_int(config.seed, i, t.name) % 2**40, size=big, **kw
                )
                self._eval[t.name] = rg.create_dataset(
                    t.name,
                    seed=(_stable_int(config.seed, i, t.name) % 2**40) + EVAL_SEED_OFFSET,
                    size=big,
                    **kw,
                )
            except (AssertionError, TypeError, ValueError) as e:
                raise ValueError(
                    f"reasoning_gym task {t.name} with settings {kw}: {e or type(e).__name__}; "
                    "fix its --reasoning-gym-task settings"
                ) from None
        weights = [t.weight for t in config.tasks]
        total = sum(weights)
        self._cum = [sum(weights[: k + 1]) / total for k in range(len(weights))]
        self._held_out: frozenset[tuple[str, str]] = frozenset()
        self.skipped_held_out = 0
        """Training items skipped because their question is in the eval set."""

    # -------------------------------------------------------------------- items
    def _pick(self, cursor: int) -> int:
        u = random.Random(_stable_int(self.config.seed, "pick", cursor)).random()
        return next((k for k, c in enumerate(self._cum) if u < c), len(self._cum) - 1)

    def entry(self, task: str, index: int, *, split: str) -> dict[str, Any]:
        """The reasoning-gym item (question, answer, metadata) of `task` at `index`."""
        ds = (self._train if split == "train" else self._eval)[task]
        return ds[index]

    def train_item(self, cursor: int) -> tuple[str, int, dict[str, Any]]:
        """(task, index, entry) at training cursor `cursor` (a held-out question is never one)."""
        task = self.config.tasks[self._pick(cursor)].name
        e = self.entry(task, cursor, split="train")
        return task, cursor, e

    def is_held_out(self, task: str, entry: Mapping[str, Any]) -> bool:
        """Whether `entry`'s question is one of the held-out prompts (see `eval_set`)."""
        return (task, entry["question"]) in self._held_out

    # -------------------------------------------------------------------- prompts
    def messages(self, question: str) -> list[dict[str, str]]:
        msgs = [{"role": "user", "content": question}]
        if self._system:
            msgs.insert(0, {"role": "system", "content": self._system})
        return msgs

    def prompt_ids(self, question: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("reasoning-gym prompts need a tokenizer: give --hf-checkpoint DIR")
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                self.messages(question),
                tokenize=False,
                add_generation_prompt=True,
                **self._template_kwargs,
            )
            return list(tok(text, add_special_tokens=False)["input_ids"])
        text = f"{self._system}\n\n{question}" if self._system else question
        return list(tok(text)["input_ids"])

    def prompt(
        self, task: str, index: int, entry: Mapping[str, Any], *, split: str, position: int
    ) -> Prompt:
        level = [t.name for t in self.config.tasks].index(task)
        return Prompt(
            key=f"{task}/{split}/{index}",
            prompt_ids=self.prompt_ids(entry["question"]),
            payload={
                "label": entry["answer"],
                "level": level,
                "metadata": {"rg_task": task, "rg_index": index, "rg_split": split},
            },
            index=position,
        )

    def eval_set(self, n: int) -> list[Prompt]:
        """`n` held-out prompts (split over the tasks by weight, at least one each), from the
        eval seed; registers their questions so the training stream skips them."""
        if n <= 0:
            return []
        total = sum(t.weight for t in self.config.tasks)
        prompts, seen = [], set()
        for t in self.config.tasks:
            share = max(1, round(n * t.weight / total))
            for i in range(share):
                e = self.entry(t.name, i, split="eval")
                seen.add((t.name, e["question"]))
                prompts.append(self.prompt(t.name, i, e, split="eval", position=len(prompts)))
        self._held_out = frozenset(seen)
        return prompts

    # -------------------------------------------------------------------- scoring
    def extract(self, response: str) -> str | None:
        """The answer in `response`, the way the prompt asked for it."""
        if self.config.answer_format == "answer_tag":
            from reasoning_gym.utils import extract_answer

            return extract_answer(response)
        if self.config.answer_format == "last_number":
            found = _NUMBER.findall(response)
            return found[-1].replace(",", "") if found else None
        return response.strip()

    def score(self, response: str, metadata: Mapping[str, Any]) -> float:
        """The task's own `score_answer` on the extracted answer."""
        task, index, split = metadata["rg_task"], int(metadata["rg_index"]), metadata["rg_split"]
        entry = self._cached_entry(task, index, split)
        ds = (self._train if split == "train" else self._eval)[task]
        return float(ds.score_answer(self.extract(response), entry))

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one instance per run
    def _cached_entry(self, task: str, index: int, split: str) -> dict[str, Any]:
        return self.entry(task, index, split=split)


class GymPromptSource:
    """Endless training prompts of `ReasoningGymTasks` with a resumable cursor (no epochs)."""

    def __init__(self, tasks: ReasoningGymTasks) -> None:
        self.tasks = tasks
        self.cursor = 0

    def next_prompt(self) -> Prompt | None:
        while True:
            task, index, entry = self.tasks.train_item(self.cursor)
            self.cursor += 1
            if self.tasks.is_held_out(task, entry):
                self.tasks.skipped_held_out += 1
                continue
            return self.tasks.prompt(task, index, entry, split="train", position=self.cursor - 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "seed": self.tasks.config.seed,
            "tasks": [t.name for t in self.tasks.config.tasks],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mine = self.state_dict()
        for k in ("seed", "tasks"):
            if k in state and state[k] != mine[k]:
                raise ValueError(
                    f"prompt source state has {k}={state[k]!r}, this run {mine[k]!r}: resume "
                    "with the same --seed and --prompt-source"
                )
        self.cursor = int(state["cursor"])


class GymReward:
    """Reward function (ours, `fn(RewardInput) -> float`) scoring with the task's scorer."""

    def __init__(self, tasks: ReasoningGymTasks) -> None:
        self.tasks = tasks
        self.__name__ = self.__qualname__ = "reasoning_gym_score_answer"

    def __call__(self, inp: Any) -> float:
        if inp.response_text is None:
            raise ValueError("reasoning-gym rewards need response_text; give the run a tokenizer")
        return self.tasks.score(inp.response_text, inp.metadata)
