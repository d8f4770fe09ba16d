"""Prompt sources for the data worker: the built-in task family and real datasets.

Owns `TaskPromptSource` (an endless, resumable stream over `TaskFamily`: the prompt at cursor
i depends only on (seed, i), so a restored cursor replays nothing and skips nothing) and
`dataset_source` (a loaded jsonl/parquet dataset as an epoch-based in-memory source over
`dataset_prompts`, the rows as prompts, which eval sets use as they are; a row's image
references ride in the payload as `images`; repeated rows are
kept, keyed by their line). reasoning-gym tasks are `rollout.gym.GymPromptSource`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from data_worker.source import InMemoryPromptSource
from slime_async.contracts.rollout import Prompt
from slime_async.rollout.data.datasets import LoadedDataset
from slime_async.rollout.data.tasks import TaskFamily, TaskPrompt

log = logging.getLogger(__name__)


def task_prompt(p: TaskPrompt, *, index: int = 0) -> Prompt:
    """A task prompt as the data worker's `Prompt` (label ids in the payload)."""
    return Prompt(
        key=p.key,
        prompt_ids=list(p.prompt_ids),
        payload={"label": list(p.label_ids), "level": p.level},
        index=index,
    )


class TaskPromptSource:
    """Endless stream of training prompts of a `TaskFamily` with a resumable cursor."""

    def __init__(self, family: TaskFamily) -> None:
        self.family = family
        self.cursor = 0

    def next_prompt(self) -> Prompt | None:
        p = self.family.train_prompt(self.cursor)
        self.cursor += 1
        return task_prompt(p, index=self.cursor - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "seed": self.family.config.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state.get("seed", self.family.config.seed)) != self.family.config.seed:
            raise ValueError(
                f"prompt source state is from task seed {state.get('seed')}, this run uses "
                f"{self.family.config.seed}: resume with the same --seed"
            )
        self.cursor = int(state["cursor"])


def dataset_source(
    data: LoadedDataset, *, seed: int, num_epochs: int | None = None
) -> InMemoryPromptSource:
    """A tokenized dataset as a shuffled, resumable, epoch-based source (`dataset_prompts`)."""
    return InMemoryPromptSource(
        dataset_prompts(data), num_epochs=num_epochs, shuffle=True, seed=seed
    )


def dataset_prompts(data: LoadedDataset) -> list[Prompt]:
    """A tokenized dataset's rows as prompts, in file order.

    A row repeated in the file (same prompt and label, or the same id) is kept as a prompt of its
    own: its key gets the row's line (``KEY@LINE``), and a warning counts them.
    """
    prompts = []
    seen: set[str] = set()
    repeats = 0
    for row in data.rows:
        if not row.prompt_ids:
            raise ValueError(
                f"{data.path}:{row.line}: row has no token ids; load the dataset with a tokenizer"
            )
        key = row.key
        if key in seen:
            repeats += 1
            key = f"{row.key}@{row.line}"
        seen.add(key)
        prompts.append(
            Prompt(
                key=key,
                prompt_ids=list(row.prompt_ids),
                payload={"label": row.label, "metadata": dict(row.metadata)}
                | (
                    {"images": list(row.images), "image_tokens": row.image_tokens}
                    if row.images
                    else {}
                ),
                extra_work=row.image_tokens if row.images else 0,
            )
        )
    if repeats:
        log.warning(
            "%s: %d row(s) repeat an earlier row; each is kept as a prompt of its own (keyed by "
            "its line); remove them from the file to train on each prompt once per epoch",
            data.path,
            repeats,
        )
    return prompts
