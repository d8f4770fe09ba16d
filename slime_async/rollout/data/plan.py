"""What a run generates and how it is scored: the built-in tasks or a real dataset.

Owns `DataPlan`, `EvalSet` and `make_data_plan`: the prompt source handed to the data worker
(built-in tasks, a jsonl/parquet file, or reasoning-gym tasks from `rollout.gym`), the held-out
eval prompts, the named eval sets read from `--eval-prompt-data` files (tokenized like
`--prompt-data`, scored by `--custom-rm-path` else math-verify), the reward function, the EOS id and (for real data) the tokenizer's decoder that
text rewards such as math-verify need. Real data reads jsonl/parquet through
`rollout.datasets` (bad rows skipped with a count, or an error naming file:line under
`--strict-data`) and tokenizes with the tokenizer found in `--hf-checkpoint`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from data_worker.source import PromptSource
from slime_async.contracts.rollout import Prompt
from slime_async.rollout.data import rewards as rw
from slime_async.rollout.data.datasets import DatasetConfig, load_dataset
from slime_async.rollout.data.gym import (
    GymPromptSource,
    GymReward,
    ReasoningGymConfig,
    ReasoningGymTasks,
)
from slime_async.rollout.data.sources import (
    TaskPromptSource,
    dataset_prompts,
    dataset_source,
    task_prompt,
)
from slime_async.rollout.data.tasks import EOS, TaskFamily, TaskFamilyConfig


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalSet:
    """One `--eval-prompt-data` file, evaluated whole and logged as `eval/NAME/...`."""

    name: str
    """The metric key segment (`eval/NAME/reward`)."""
    prompts: tuple[Prompt, ...]
    """Its usable rows, in file order."""
    reward_fn: Callable[[rw.RewardInput], Any]
    """Scores one sample: --custom-rm-path, else math-verify (as a --prompt-data run)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataPlan:
    """The data side of a run."""

    source: PromptSource
    """Training prompts (resumable)."""
    eval_prompts: tuple[Prompt, ...]
    """Held-out prompts (payload `level` groups the eval metrics when present)."""
    reward_fn: Callable[[rw.RewardInput], Any]
    """Scores one finished sample."""
    eos_id: int
    """Token that ends a response."""
    decode: Callable[[Sequence[int]], str] | None
    """Token ids -> text (None without a tokenizer)."""
    metrics: dict[str, float]
    """Data-loading counters (rows, skipped) logged with the first step."""
    eval_sets: tuple[EvalSet, ...] = ()
    """Named eval sets (`--eval-prompt-data`), beside the held-out `eval_prompts`."""


def make_data_plan(
    *,
    seed: int,
    prompt_data: str | None,
    hf_checkpoint: str | None,
    input_key: str,
    label_key: str,
    apply_chat_template: bool,
    strict_data: bool,
    custom_rm_path: str | None,
    eval_prompts: int,
    reasoning_gym: ReasoningGymConfig | None = None,
    eval_data: Sequence[tuple[str, str]] = (),
    eval_input_key: str | None = None,
    eval_label_key: str | None = None,
) -> DataPlan:
    """reasoning-gym tasks when given, else built-in verifiable tasks when `prompt_data` is None,
    else the dataset; plus the `eval_data` (name, path) files as eval sets (their keys default
    to the training ones)."""
    plan = _plan(
        seed=seed,
        prompt_data=prompt_data,
        hf_checkpoint=hf_checkpoint,
        input_key=input_key,
        label_key=label_key,
        apply_chat_template=apply_chat_template,
        strict_data=strict_data,
        custom_rm_path=custom_rm_path,
        eval_prompts=eval_prompts,
        reasoning_gym=reasoning_gym,
    )
    if not eval_data:
        return plan
    if hf_checkpoint is None or plan.decode is None:
        raise ValueError(
            "--eval-prompt-data needs --hf-checkpoint DIR (its tokenizer) and a run on "
            "--prompt-data or --prompt-source (the built-in tasks have their own vocabulary)"
        )
    tok = _tokenizer(hf_checkpoint)
    reward = rw.load_reward_fn(custom_rm_path) if custom_rm_path else rw.math_verify_reward
    sets, metrics = [], dict(plan.metrics)
    for name, path in eval_data:
        data = load_dataset(
            DatasetConfig(
                path=path,
                prompt_key=eval_input_key or input_key,
                label_key=eval_label_key or label_key,
                strict=strict_data,
                apply_chat_template=apply_chat_template or None,
                flag="--eval-prompt-data",
            ),
            tokenizer=tok,
        )
        prompts = dataset_prompts(data)
        sets.append(EvalSet(name=name, prompts=tuple(prompts), reward_fn=reward))
        metrics[f"data/eval/{name}/rows"] = float(len(data.rows))
        metrics[f"data/eval/{name}/skipped"] = float(data.num_skipped)
    return dataclasses.replace(plan, eval_sets=tuple(sets), metrics=metrics)


def _plan(
    *,
    seed: int,
    prompt_data: str | None,
    hf_checkpoint: str | None,
    input_key: str,
    label_key: str,
    apply_chat_template: bool,
    strict_data: bool,
    custom_rm_path: str | None,
    eval_prompts: int,
    reasoning_gym: ReasoningGymConfig | None,
) -> DataPlan:
    """`make_data_plan` without the eval files."""
    if reasoning_gym is not None:
        return _gym_plan(
            reasoning_gym,
            hf_checkpoint=hf_checkpoint,
            custom_rm_path=custom_rm_path,
            eval_prompts=eval_prompts,
        )
    if prompt_data is None:
        family = TaskFamily(TaskFamilyConfig(seed=seed))
        per_level = max(1, eval_prompts // family.config.num_levels) if eval_prompts else 0
        held_out = [task_prompt(p) for p in family.eval_set(per_level)] if per_level else []
        reward = rw.load_reward_fn(custom_rm_path) if custom_rm_path else rw.exact_match_reward
        return DataPlan(
            source=TaskPromptSource(family),
            eval_prompts=tuple(held_out),
            reward_fn=reward,
            eos_id=EOS,
            decode=None,
            metrics={},
        )
    if hf_checkpoint is None:
        raise ValueError(
            "--prompt-data needs --hf-checkpoint DIR holding the model and its tokenizer "
            "(prompts are tokenized with it)"
        )
    tok = _tokenizer(hf_checkpoint)
    data = load_dataset(
        DatasetConfig(
            path=prompt_data,
            prompt_key=input_key,
            label_key=label_key,
            strict=strict_data,
            apply_chat_template=apply_chat_template or None,
        ),
        tokenizer=tok,
    )
    reward = rw.load_reward_fn(custom_rm_path) if custom_rm_path else rw.math_verify_reward
    return DataPlan(
        source=dataset_source(data, seed=seed),
        eval_prompts=(),
        reward_fn=reward,
        eos_id=int(tok.eos_token_id),
        decode=lambda ids: tok.decode(list(ids), skip_special_tokens=True),
        metrics=data.metrics(),
    )


def _tokenizer(hf_checkpoint: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_checkpoint)
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {hf_checkpoint} has no eos_token_id; set one")
    return tok


def _gym_plan(
    config: ReasoningGymConfig,
    *,
    hf_checkpoint: str | None,
    custom_rm_path: str | None,
    eval_prompts: int,
) -> DataPlan:
    if hf_checkpoint is None:
        raise ValueError(
            "--prompt-source reasoning_gym:... needs --hf-checkpoint DIR holding the model and "
            "its tokenizer (prompts are chat-templated and tokenized with it)"
        )
    tok = _tokenizer(hf_checkpoint)
    tasks = ReasoningGymTasks(config, tokenizer=tok)
    held_out = tasks.eval_set(eval_prompts)  # before any training prompt: the split is exact
    reward = rw.load_reward_fn(custom_rm_path) if custom_rm_path else GymReward(tasks)
    return DataPlan(
        source=GymPromptSource(tasks),
        eval_prompts=tuple(held_out),
        reward_fn=reward,
        eos_id=int(tok.eos_token_id),
        decode=lambda ids: tok.decode(list(ids), skip_special_tokens=True),
        metrics={"data/eval_prompts": float(len(held_out))},
    )
