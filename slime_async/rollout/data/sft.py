"""Supervised fine-tuning data (`--loss-type sft_loss`): conversations as token ids whose
assistant turns are trained, and the trainer's batch of them.

Owns `render_trained` (one conversation -> its ids and which of them are trained), `SFTData`
(the usable conversations of `--prompt-data`, read with `--input-key`, and the batches of each
step: `--global-batch-size` conversations, in an order shuffled per epoch by the rollout seed,
so step k's batch depends only on (seed, k) and a resume repeats and skips nothing) and
`sft_batch` (conversations -> `TrainerBatch`); rows with images (`--multimodal-keys`) get their
placeholders expanded (`with_images`) and travel to the trainer by reference. Never imports the trainer, engine or controller.

Which tokens are trained: for each assistant message i, the tokens the chat template renders for
it after the conversation up to it with the generation prompt (its content and its closing
tokens, e.g. `<|im_end|>`): `render(messages[:i + 1])` minus `render(messages[:i],
add_generation_prompt=True)`. Everything else (system, user, tool turns, generation prompts)
has loss mask 0. A template that renders an earlier turn differently once later turns follow
(Qwen3 strips the `<think>` of earlier assistant turns) cannot mark them this way: such a
conversation is refused with the fix (one assistant turn to train per row).

Example (ChatML): user "hi", assistant "yo" -> `<|im_start|>user\\nhi<|im_end|>\\n
<|im_start|>assistant\\n` untrained, then `yo<|im_end|>\\n` trained.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import torch

from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.chat import ChatError, has_chat_template, normalize_messages, render_chat
from slime_async.contracts.vision import ImageRefs
from slime_async.rollout.data.datasets import DataRow, DatasetConfig, DatasetError, load_dataset


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Conversation:
    """One conversation ready to train: ids and, per id, whether it is trained."""

    ids: tuple[int, ...]
    trained: tuple[bool, ...]
    """Per id: an assistant token (trained) or not."""


def render_trained(
    tokenizer: Any, messages: Sequence[dict[str, Any]], *, where: str
) -> Conversation:
    """The ids of `messages` through the chat template and the assistant tokens among them
    (see the module docstring); `DatasetError` naming `where` when they cannot be marked."""
    try:
        msgs = normalize_messages(list(messages))
        full = render_chat(tokenizer, msgs, add_generation_prompt=False)
    except ChatError as e:
        raise DatasetError(f"{where}: {e}") from None
    trained = [False] * len(full)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = len(render_chat(tokenizer, msgs[:i], add_generation_prompt=True)) if i else 0
        upto = render_chat(tokenizer, msgs[: i + 1], add_generation_prompt=False)
        if full[: len(upto)] != upto or start > len(upto):
            raise DatasetError(
                f"{where}: the chat template renders assistant message {i} differently once "
                "later messages follow (e.g. it strips an earlier turn's <think> block), so its "
                "tokens cannot be marked; split the conversation into rows that each end with "
                "the one assistant turn to train"
            )
        trained[start : len(upto)] = [True] * (len(upto) - start)
    if not any(trained[1:]):
        raise DatasetError(f"{where}: no assistant token to train (an empty assistant turn?)")
    return Conversation(ids=tuple(full), trained=tuple(trained))


def with_images(conv: Conversation, refs: tuple[str, ...], vision: Any) -> Conversation:
    """`conv` with each image's single pad expanded to its grid (`images.expand`, the
    processor run once); the pads are prompt tokens, never trained."""
    from slime_async.rollout.data import images as im

    ids = im.expand(list(conv.ids), refs, vision)
    trained: list[bool] = []
    j = 0
    for i, t in enumerate(conv.ids):
        if t == vision.vision.image_token_id and (i == 0 or conv.ids[i - 1] != t):
            while j < len(ids) and ids[j] == t:
                trained.append(False)
                j += 1
        elif t != vision.vision.image_token_id:
            trained.append(conv.trained[i])
            j += 1
    return Conversation(ids=tuple(ids), trained=tuple(trained))


def sft_batch(
    conversations: Sequence[Conversation], *, version: int, images: Sequence[Any] | None = None
) -> TrainerBatch:
    """The padded batch of `conversations`: each its ids, loss mask on its trained tokens (never
    token 0), no engine log-probs or advantages (the SFT loss reads neither), tokens labelled
    with the trainer's `version`."""
    n, width = len(conversations), max(len(c.ids) for c in conversations)
    tokens = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, c in enumerate(conversations):
        tokens[i, : len(c.ids)] = torch.as_tensor(c.ids)
        mask[i, : len(c.ids)] = torch.as_tensor(c.trained)
    mask[:, 0] = False
    versions = torch.where(mask, version, -1)
    return TrainerBatch(
        tokens=tokens,
        lengths=torch.as_tensor([len(c.ids) for c in conversations]),
        loss_mask=mask,
        rollout_logprobs=torch.zeros(n, width),
        advantages=torch.zeros(n, width),
        token_versions=versions,
        images=None if images is None or not any(images) else tuple(images),
    )


class SFTData:
    """The conversations of an SFT run and each step's batch of them.

    Example: 10 usable rows, `--global-batch-size 4`: step 0 takes rows 0-3 of epoch 0's
    shuffled order, step 2 rows 8-9 of it and 0-1 of epoch 1's."""

    def __init__(
        self,
        path: str,
        *,
        tokenizer: Any,
        input_key: str,
        batch_size: int,
        seed: int,
        strict: bool = False,
        image_key: str | None = None,
        vision: Any = None,
    ) -> None:
        """`image_key`, `vision` (`images.VisionData`): rows with images (`--multimodal-keys`);
        each user turn's `<image>` markers (or its front) get the placeholders."""
        if not has_chat_template(tokenizer):
            raise ValueError(
                "SFT (--loss-type sft_loss) renders conversations with the tokenizer's chat "
                "template, and the --hf-checkpoint tokenizer has none; use a chat model's "
                "tokenizer (or add a chat_template to its tokenizer_config.json)"
            )
        data = load_dataset(
            DatasetConfig(
                path=path,
                prompt_key=input_key,
                require_label=False,
                strict=strict,
                image_key=image_key,
            ),
            vision=vision,
        )
        self.vision = vision
        self._rendered: dict[int, Conversation] = {}
        self.rows = [r for r in data.rows if _conversation(r)]
        if not self.rows:
            raise DatasetError(
                f"{path}: no conversation to train: SFT reads --input-key {input_key!r} as a "
                "list of {role, content} messages with at least one assistant message"
            )
        self.path, self.tokenizer, self.batch_size, self.seed = path, tokenizer, batch_size, seed
        self._orders: dict[int, list[int]] = {}
        self.metrics = {
            "data/rows": float(len(self.rows)),
            "data/skipped": float(data.num_skipped + len(data.rows) - len(self.rows)),
        }

    def _render(self, k: int) -> Conversation:
        """Row `k` rendered (and its images' pads expanded) once, then reused."""
        if k not in self._rendered:
            row = self.rows[k]
            where = f"{self.path}:{row.line}"
            messages = row.prompt
            if row.images:
                from slime_async.rollout.data.images import with_placeholders

                messages = with_placeholders(messages, len(row.images), self.vision.placeholder)
            conv = render_trained(self.tokenizer, messages, where=where)
            self._rendered[k] = with_images(conv, row.images, self.vision) if row.images else conv
        return self._rendered[k]

    def order(self, epoch: int) -> list[int]:
        """Row indices in epoch `epoch`'s shuffled order (a function of the seed and epoch;
        the two latest are kept)."""
        if epoch not in self._orders:
            idx = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = idx
        return self._orders[epoch]

    def batch(self, step: int, *, version: int) -> tuple[TrainerBatch, dict[str, float]]:
        """Step `step`'s batch (at trainer `version`) and its `sft/*` metrics."""
        first, n = step * self.batch_size, len(self.rows)
        picked, images = [], []
        for j in range(first, first + self.batch_size):
            k = self.order(j // n)[j % n]
            picked.append(self._render(k))
            refs = self.rows[k].images
            images.append(ImageRefs(refs=refs) if refs else None)
        tb = sft_batch(picked, version=version, images=images)
        return tb, {
            "sft/epoch": float((first + self.batch_size - 1) // n),
            "sft/trained_tokens": float(tb.loss_mask.sum()),
            "sft/length": float(tb.lengths.float().mean()),
        }


def _conversation(row: DataRow) -> bool:
    """A row SFT can train: a list of messages with an assistant message."""
    return isinstance(row.prompt, list) and any(m.get("role") == "assistant" for m in row.prompt)
