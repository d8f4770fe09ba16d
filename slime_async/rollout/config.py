"""`RolloutConfig`: what is generated, how it is scored, and how advantages are formed.

Owns the rollout settings of a run (batch shape, sampling, data source, rewards, eval cadence).
Its flags are in `slime_async.args`; cross-flag rules in `slime_async.config.validate`.
"""

from __future__ import annotations

import dataclasses

from loss import DEFAULT_ADVANTAGE_ESTIMATOR


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """What is generated, how it is scored, and how advantages are formed."""

    rollout_batch_size: int = 8
    """Prompts per rollout (one rollout feeds `num_steps_per_rollout` train steps)."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (GRPO group size)."""
    global_batch_size: int = 64
    """Samples per optimizer step (= groups per step x n)."""
    max_response_len: int = 48
    """Most new tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature (the trainer divides logits by the same value)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    advantage_estimator: str = DEFAULT_ADVANTAGE_ESTIMATOR
    """A registered estimator (`loss.available_advantages()`; flag: `loss.add_loss_args`)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all agree (no learning signal) and refill."""
    prompt_data: str | None = None
    """jsonl/parquet prompts; None uses the built-in verifiable task family."""
    input_key: str = "prompt"
    """Field holding the prompt in `prompt_data`."""
    label_key: str = "label"
    """Field holding the reference answer in `prompt_data`."""
    apply_chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template."""
    strict_data: bool = False
    """Fail on the first malformed data row (file and line named) instead of skipping it."""
    custom_rm_path: str | None = None
    """Dotted path of a reward function `(prompt, response_ids, label) -> float`."""
    eval_interval: int = 10
    """Evaluate on held-out prompts every this many train steps (0: never)."""
    eval_prompts: int = 64
    """Held-out prompts per evaluation."""

    @property
    def groups_per_step(self) -> int:
        return self.global_batch_size // self.n_samples_per_prompt
