"""What a run generates and how it is scored: the built-in tasks or a real dataset.

Owns `DataPlan`, `EvalSet` and `make_data_plan`: the prompt source handed to the data worker
(built-in tasks, a jsonl/parquet file, or reasoning-gym tasks from `rollout.gym`), the held-out
eval prompts, the named eval sets read from `--eval-prompt-data` files (tokenized like
`--prompt-data`, scored by `--rm-type`, `--rm-url` or `--custom-rm-path`, else math-verify), the
reward function (`--rm-type` and a row's metadata `rm_type`: slime's rule-based rewards,
`rollout.data.slime_rm`), the EOS id and (for real data) the tokenizer's decoder that text
rewards such as math-verify need. Real data reads jsonl/parquet through `rollout.datasets` (bad
rows skipped with a count, or an error naming file:line under `--strict-data`) and tokenizes
with the tokenizer found in `--hf-checkpoint`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from data_worker.source import PromptSource
from slime_async.contracts.rollout import Prompt
from slime_async.rollout.config import RolloutConfig
from slime_async.rollout.data import rewards as rw
from slime_async.rollout.data.datasets import DataRow, DatasetConfig, load_dataset
from slime_async.rollout.data.gym import (
    GymPromptSource,
    GymReward,
    ReasoningGymConfig,
    ReasoningGymTasks,
)
from slime_async.rollout.data.images import vision_data
from slime_async.rollout.data.remote_rm import RemoteReward
from slime_async.rollout.data.slime_rm import SlimeRewards, parse_rm_type
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
    """Scores one sample: --rm-type, --rm-url, --custom-rm-path, else math-verify (as a
    --prompt-data run)."""


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
    eval_reward_fn: Callable[[rw.RewardInput], Any] | None = None
    """Scores the held-out `eval_prompts` (None: `reward_fn`)."""


def make_data_plan(rollout: RolloutConfig, *, seed: int, hf_checkpoint: str | None) -> DataPlan:
    """The data of a run on `rollout`'s prompts: reasoning-gym tasks when `--prompt-source`
    names them, else the built-in verifiable tasks when `--prompt-data` is unset, else the
    dataset; with `--eval-interval` > 0 the held-out prompts and the `--eval-prompt-data` files
    as eval sets (read with the `--eval-*-key`s). `seed`: the rollout seed (task streams,
    dataset order); `hf_checkpoint`: the tokenizer's directory."""
    evaluates = bool(rollout.eval_interval)
    plan = _plan(rollout, seed=seed, hf_checkpoint=hf_checkpoint, evaluates=evaluates)
    eval_data = rollout.eval_sets if evaluates else ()
    if not eval_data:
        return plan
    if hf_checkpoint is None or plan.decode is None:
        raise ValueError(
            "--eval-prompt-data needs --hf-checkpoint DIR (its tokenizer) and a run on "
            "--prompt-data or --prompt-source (the built-in tasks have their own vocabulary)"
        )
    tok = _tokenizer(hf_checkpoint)
    sets, metrics = [], dict(plan.metrics)
    for name, path in eval_data:
        data = load_dataset(
            DatasetConfig(
                path=path,
                prompt_key=rollout.eval_input_key or rollout.input_key,
                label_key=rollout.eval_label_key or rollout.label_key,
                metadata_key=rollout.metadata_key,
                strict=rollout.strict_data,
                apply_chat_template=rollout.apply_chat_template or None,
                chat_template_kwargs=rollout.chat_template_kwargs,
                flag="--eval-prompt-data",
                image_key=rollout.image_key,
            ),
            tokenizer=tok,
            vision=vision_data(hf_checkpoint, tok) if rollout.image_key else None,
        )
        prompts = dataset_prompts(data)
        reward = _reward(
            rollout, rw.math_verify_reward, seed, evaluates=True, rows=data.rows, where=path
        )
        sets.append(EvalSet(name=name, prompts=tuple(prompts), reward_fn=reward))
        metrics[f"data/eval/{name}/rows"] = float(len(data.rows))
        metrics[f"data/eval/{name}/skipped"] = float(data.num_skipped)
    return dataclasses.replace(plan, eval_sets=tuple(sets), metrics=metrics)


def _reward(
    rollout: RolloutConfig,
    default: Callable[[rw.RewardInput], Any],
    seed: int,
    *,
    evaluates: bool = False,
    rows: Sequence[DataRow] = (),
    where: str = "",
) -> Any:
    """`--custom-rm-path`, `--rm-type` (slime's rule-based rewards; its `random` seeded by
    `seed`) or `--rm-url` (the remote reward model) when given, else `default`; `evaluates`:
    the eval samples' (read under `--eval-reward-key`; a --custom-rm-path function's dict
    answers too: `rw.KeyedReward`). As in slime, a row whose metadata names
    an `rm_type` is scored by that type, unless --custom-rm-path scores every sample."""
    key = rollout.eval_reward_key if evaluates else rollout.reward_key
    if rollout.custom_rm_path:
        fn = rw.load_reward_fn(rollout.custom_rm_path)
        if key is None:
            return fn
        own = evaluates and rollout.eval_reward_key != rollout.reward_key
        return rw.KeyedReward(fn, key, "--eval-reward-key" if own else "--reward-key")
    remote = None
    if rollout.rm_url:
        remote = RemoteReward(
            rollout.rm_url,
            timeout_s=rollout.rm_timeout,
            retries=rollout.rm_retries,
            reward_key=key,
        )
    fallback = remote if remote is not None else default
    _check_row_types(rows, where, remote=remote is not None)
    if rollout.rm_type or any(r.metadata.get("rm_type") for r in rows):
        return SlimeRewards(
            rollout.rm_type, seed=seed, remote=remote, reward_key=key, fallback=fallback
        )
    return fallback


def _check_row_types(rows: Sequence[DataRow], where: str, *, remote: bool) -> None:
    """Each rm_type rows name is one scored here (remote_rm with --rm-url): refused at start-up,
    naming the first row, rather than at its first sample."""
    first: dict[str, int] = {}
    for r in rows:
        if r.metadata.get("rm_type"):
            first.setdefault(str(r.metadata["rm_type"]), r.line)
    for name, line in first.items():
        try:
            parse_rm_type(name)
        except ValueError as e:
            raise ValueError(f"{where}:{line}: the row's metadata rm_type {e}") from None
        if name.strip() == "remote_rm" and not remote:
            raise ValueError(
                f"{where}:{line}: the row's metadata rm_type remote_rm posts the sample to a "
                "reward model: give its --rm-url URL"
            )


def _plan(
    rollout: RolloutConfig, *, seed: int, hf_checkpoint: str | None, evaluates: bool
) -> DataPlan:
    """`make_data_plan` without the eval files."""
    eval_prompts = rollout.eval_prompts if evaluates else 0
    gym = rollout.reasoning_gym_config(seed)
    if gym is not None:
        return _gym_plan(
            gym, rollout, hf_checkpoint=hf_checkpoint, eval_prompts=eval_prompts, seed=seed
        )
    if rollout.prompt_data is None:
        family = TaskFamily(TaskFamilyConfig(seed=seed))
        per_level = max(1, eval_prompts // family.config.num_levels) if eval_prompts else 0
        held_out = [task_prompt(p) for p in family.eval_set(per_level)] if per_level else []
        return DataPlan(
            source=TaskPromptSource(family),
            eval_prompts=tuple(held_out),
            reward_fn=_reward(rollout, rw.exact_match_reward, seed),
            eval_reward_fn=_reward(rollout, rw.exact_match_reward, seed, evaluates=True),
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
            path=rollout.prompt_data,
            prompt_key=rollout.input_key,
            label_key=rollout.label_key,
            metadata_key=rollout.metadata_key,
            strict=rollout.strict_data,
            apply_chat_template=rollout.apply_chat_template or None,
            chat_template_kwargs=rollout.chat_template_kwargs,
            image_key=rollout.image_key,
        ),
        tokenizer=tok,
        vision=vision_data(hf_checkpoint, tok) if rollout.image_key else None,
    )
    return DataPlan(
        source=dataset_source(data, seed=seed),
        eval_prompts=(),
        reward_fn=_reward(
            rollout, rw.math_verify_reward, seed, rows=data.rows, where=rollout.prompt_data
        ),
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
    rollout: RolloutConfig,
    *,
    hf_checkpoint: str | None,
    eval_prompts: int,
    seed: int,
) -> DataPlan:
    if hf_checkpoint is None:
        raise ValueError(
            "--prompt-source reasoning_gym:... needs --hf-checkpoint DIR holding the model and "
            "its tokenizer (prompts are chat-templated and tokenized with it)"
        )
    tok = _tokenizer(hf_checkpoint)
    tasks = ReasoningGymTasks(config, tokenizer=tok, template_kwargs=rollout.chat_template_kwargs)
    held_out = tasks.eval_set(eval_prompts)  # before any training prompt: the split is exact
    scorer = GymReward(tasks)
    return DataPlan(
        source=GymPromptSource(tasks),
        eval_prompts=tuple(held_out),
        reward_fn=_reward(rollout, scorer, seed),
        eval_reward_fn=_reward(rollout, scorer, seed, evaluates=True),
        eos_id=int(tok.eos_token_id),
        decode=lambda ids: tok.decode(list(ids), skip_special_tokens=True),
        metrics={"data/eval_prompts": float(len(held_out))},
    )
