"""Prompt sources: where the worker gets new prompts.

Owns the `PromptSource` protocol (`next_prompt`, `state_dict`, `load_state_dict`) and
`InMemoryPromptSource`, a list-backed source with epochs, a per-epoch seeded shuffle, per-prompt
keys and a resumable cursor. The lead wraps real datasets in the protocol. Never imports
`slime_async`.

Example:
    >>> src = InMemoryPromptSource([{"prompt_ids": [1, 2]}, {"prompt_ids": [3]}], num_epochs=1)
    >>> [p.key for p in iter(src.next_prompt, None)]
    ['0', '1']
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from data_worker.types import Prompt


@runtime_checkable
class PromptSource(Protocol):
    """A resumable stream of prompts."""

    def next_prompt(self) -> Prompt | None:
        """The next prompt, or None when the source is exhausted."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable cursor."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor saved by `state_dict`."""
        ...


class InMemoryPromptSource:
    """Prompts held in memory, served epoch after epoch.

    Each item is a `Prompt` or a mapping with `prompt_ids` and optionally `key` (default: the
    item's index as a string), `payload` and `extra_work`. With `shuffle`, epoch e uses the permutation of
    `random.Random(seed + e)`, so a restored cursor reproduces the same order.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt | Mapping[str, Any]],
        *,
        num_epochs: int | None = 1,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (endless), got {num_epochs!r}.")
        if len(prompts) == 0:
            raise ValueError("InMemoryPromptSource needs at least one prompt, got an empty list.")
        self._items: list[Prompt] = [self._coerce(i, p) for i, p in enumerate(prompts)]
        keys = [p.key for p in self._items]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"prompt keys must be unique; {dup!r} appears more than once.")
        self._num_epochs = num_epochs
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._pos = 0
        self._order = self._permutation(0)

    @staticmethod
    def _coerce(i: int, p: Prompt | Mapping[str, Any]) -> Prompt:
        if isinstance(p, Prompt):
            return p
        if "prompt_ids" not in p:
            raise ValueError(f"prompt #{i} has no 'prompt_ids'; give token ids for every prompt.")
        return Prompt(
            key=str(p.get("key", i)),
            prompt_ids=list(p["prompt_ids"]),
            payload=dict(p.get("payload", {})),
            index=i,
            extra_work=int(p.get("extra_work", 0)),
        )

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self._items)))
        if self._shuffle:
            random.Random(self._seed + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self._items)

    @property
    def epoch(self) -> int:
        """Current epoch (0-based)."""
        return self._epoch

    def next_prompt(self) -> Prompt | None:
        """The next prompt (tagged with its epoch), or None after the last epoch."""
        if self._pos >= len(self._order):
            if self._num_epochs is not None and self._epoch + 1 >= self._num_epochs:
                return None
            self._epoch += 1
            self._pos = 0
            self._order = self._permutation(self._epoch)
        item = self._items[self._order[self._pos]]
        self._pos += 1
        return Prompt(
            key=item.key,
            prompt_ids=item.prompt_ids,
            payload=item.payload,
            epoch=self._epoch,
            index=item.index,
            extra_work=item.extra_work,
        )

    def state_dict(self) -> dict[str, Any]:
        """Cursor: epoch and position (plus a size check)."""
        return {"epoch": self._epoch, "pos": self._pos, "size": len(self._items)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a cursor saved by `state_dict` from a source over the same prompts."""
        if int(state["size"]) != len(self._items):
            raise ValueError(
                f"cursor was saved for {state['size']} prompts but this source has "
                f"{len(self._items)}; resume with the same dataset."
            )
        self._epoch = int(state["epoch"])
        self._pos = int(state["pos"])
        self._order = self._permutation(self._epoch)
