"""`RolloutConfig`: what is generated, how it is scored, and how advantages are formed.

Owns the rollout settings of a run (batch shape, sampling, data source (built-in tasks, a
jsonl/parquet file, or reasoning-gym tasks, `rollout.gym`), rewards, eval cadence),
their command-line flags (`add_rollout_args` / `rollout_config_from_args`, every default read from
`RolloutConfig`), and the rules among them (batch-shape divisibility). Rules that involve other
components live in `slime_async.config`. Must never import other `slime_async` components.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from loss import DEFAULT_ADVANTAGE_ESTIMATOR
from loss.slime_cli import advantage_estimator_from_args
from slime_async.rollout.gym import ANSWER_FORMATS, ReasoningGymConfig, parse_prompt_source


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """What is generated, how it is scored, and how advantages are formed."""

    rollout_batch_size: int = 8
    """Prompts per rollout (one rollout feeds `num_steps_per_rollout` train steps)."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (GRPO group size)."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout (slime's name); sizes the default global batch."""
    global_batch_size: int | None = None
    """Samples per optimizer step (= groups per step x n); None: rollout_batch_size x n /
    num_steps_per_rollout."""
    max_response_len: int = 48
    """Most new tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature (the trainer divides logits by the same value)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling (-1: the whole vocabulary)."""
    stop: tuple[str, ...] = ()
    """Stop strings (the engine matches them on decoded text; needs a tokenizer)."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop token ids besides the tokenizer's EOS."""
    seed: int | None = None
    """Seed of the prompt order and of the engines' sampling; None: the run's --seed."""
    advantage_estimator: str = DEFAULT_ADVANTAGE_ESTIMATOR
    """A registered estimator (`loss.available_advantages()`; flag: `loss.add_loss_args`)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all agree (no learning signal) and refill."""
    prompt_data: str | None = None
    """jsonl/parquet prompts; None uses the built-in verifiable task family."""
    prompt_source: str | None = None
    """``reasoning_gym:NAME[,NAME...]``: reasoning-gym tasks as the prompt source
    (`rollout.gym`); None: `prompt_data` or the built-in tasks."""
    reasoning_gym_task: tuple[str, ...] = ()
    """Per-task settings ``TASK.KEY=VALUE`` (difficulty fields of the task's config, ``weight``)."""
    reasoning_gym_system_prompt: str | None = "direct"
    """System prompt of reasoning-gym prompts: a `SYSTEM_PROMPTS` name, literal text, or None."""
    reasoning_gym_answer_format: str = "answer_tag"
    """'answer_tag' (reasoning-gym's ``<answer>`` format), 'response' (the whole response) or
    'last_number' (the last number in it)."""
    input_key: str = "prompt"
    """Field holding the prompt in `prompt_data`."""
    label_key: str = "label"
    """Field holding the reference answer in `prompt_data`."""
    apply_chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template."""
    strict_data: bool = False
    """Fail on the first malformed data row (file and line named) instead of skipping it."""
    custom_rm_path: str | None = None
    """Dotted path of a reward function: ours `fn(RewardInput) -> float` or slime's
    `async fn(args, sample, **kwargs) -> float` (`rollout.rewards`)."""
    group_rm: bool = False
    """slime's `--group-rm`: the reward function scores a whole group at once,
    `async fn(args, samples: list, **kwargs) -> list[float]`."""
    custom_generate_function_path: str | None = None
    """Dotted path of a per-sample generate function (multi-turn, tools): ours
    `async fn(ctx, request) -> Trajectory` or slime's `async fn(args, sample, sampling_params)`
    (`rollout.custom_generate`)."""
    eval_interval: int = 10
    """Evaluate on held-out prompts every this many rollouts (slime's unit; one rollout is
    `num_steps_per_rollout` train steps) (0: never)."""
    eval_prompts: int = 64
    """Held-out prompts per evaluation."""
    n_samples_per_eval_prompt: int = 1
    """Samples per held-out prompt at each evaluation (slime's flag): the eval reward averages
    them, so repeats shrink its standard error (logged as `eval/reward_se`) past the size of
    the held-out set."""

    def __post_init__(self) -> None:
        if self.prompt_source is not None and self.prompt_data is not None:
            raise ValueError(
                f"--prompt-source {self.prompt_source} and --prompt-data {self.prompt_data} both "
                "name the prompts; give one of them"
            )
        if self.reasoning_gym_task and self.prompt_source is None:
            raise ValueError(
                "--reasoning-gym-task needs --prompt-source reasoning_gym:NAME,... naming the tasks"
            )
        if self.prompt_source is not None:
            self.reasoning_gym_config(0)  # bad names / settings fail at start-up
        n, steps = self.n_samples_per_prompt, self.num_steps_per_rollout
        if n < 1:
            raise ValueError("--n-samples-per-prompt must be >= 1")
        if self.rollout_batch_size < 1 or steps < 1:
            raise ValueError("--rollout-batch-size and --num-steps-per-rollout must be >= 1")
        if self.eval_interval < 0 or self.eval_prompts < 0:
            raise ValueError("--eval-interval and --eval-prompts must be >= 0")
        if self.n_samples_per_eval_prompt < 1:
            raise ValueError(
                f"--n-samples-per-eval-prompt {self.n_samples_per_eval_prompt} must be >= 1"
            )
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"--rollout-top-k {self.top_k}: give -1 (off) or k >= 1")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"--rollout-temperature {self.temperature}: give a finite number > 0 (1.0 samples "
                "the policy as trained)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--rollout-top-p {self.top_p}: give a number in (0, 1] (1.0 = off)")
        if self.max_response_len < 1:
            raise ValueError(f"--rollout-max-response-len {self.max_response_len}: give >= 1")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"--rollout-stop-token-ids {list(self.stop_token_ids)}: token ids are >= 0"
            )
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"--rollout-seed {self.seed}: give a seed >= 0 (or leave it unset)")
        gbs = self.global_batch_size
        if gbs is None:
            total = self.rollout_batch_size * n
            if total % steps:
                raise ValueError(
                    f"rollout_batch_size x n = {total} is not divisible by "
                    f"--num-steps-per-rollout {steps}; pass --global-batch-size explicitly"
                )
            gbs = total // steps
            object.__setattr__(self, "global_batch_size", gbs)
        if gbs < 1 or gbs % n:
            raise ValueError(
                f"--global-batch-size {gbs} must be a multiple of --n-samples-per-prompt {n} "
                "(whole groups are trained together)"
            )

    def seed_or(self, run_seed: int) -> int:
        """The rollout seed: `--rollout-seed`, else the run's `--seed` (the one place this
        fallback is written; `RunConfig.rollout_seed` reads it)."""
        return run_seed if self.seed is None else self.seed

    def reasoning_gym_config(self, seed: int) -> ReasoningGymConfig | None:
        """The reasoning-gym tasks of `prompt_source` with the run's rollout seed, or None."""
        if self.prompt_source is None:
            return None
        return parse_prompt_source(
            self.prompt_source, task_settings=self.reasoning_gym_task, seed=seed,
            system_prompt=self.reasoning_gym_system_prompt,
            answer_format=self.reasoning_gym_answer_format,
        )  # fmt: skip

    @property
    def groups_per_step(self) -> int:
        """B: prompt groups one train step consumes."""
        return self.global_batch_size // self.n_samples_per_prompt


def add_rollout_args(parser: argparse.ArgumentParser) -> None:
    """Add the rollout and data flags (the advantage estimator is with the loss flags)."""
    g = parser.add_argument_group("rollout and data")
    d = RolloutConfig()
    _add_batch_and_sampling_args(g, d)
    _add_data_and_reward_args(g, d)
    g.add_argument(
        "--eval-interval",
        type=int,
        default=d.eval_interval,
        help="Evaluate every N rollouts, slime's unit (N x --num-steps-per-rollout train "
        "steps; 0: never).",
    )
    g.add_argument(
        "--eval-prompts", type=int, default=d.eval_prompts, help="Held-out prompts per evaluation."
    )
    g.add_argument(
        "--n-samples-per-eval-prompt",
        type=int,
        default=d.n_samples_per_eval_prompt,
        help="Samples per held-out prompt at each evaluation; the eval reward averages them "
        "(its standard error is logged as eval/reward_se).",
    )


def _add_batch_and_sampling_args(g: argparse._ArgumentGroup, d: RolloutConfig) -> None:
    g.add_argument(
        "--rollout-batch-size", type=int, default=d.rollout_batch_size, help="Prompts per rollout."
    )
    g.add_argument(
        "--n-samples-per-prompt",
        type=int,
        default=d.n_samples_per_prompt,
        help="Samples per prompt (group size).",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step (default: rollout_batch_size x n / "
        "num_steps_per_rollout).",
    )
    g.add_argument(
        "--num-steps-per-rollout",
        type=int,
        default=d.num_steps_per_rollout,
        help="Optimizer steps per rollout.",
    )
    g.add_argument(
        "--rollout-max-response-len",
        type=int,
        default=d.max_response_len,
        help="Most new tokens per sample.",
    )
    g.add_argument(
        "--rollout-temperature", type=float, default=d.temperature, help="Sampling temperature."
    )
    g.add_argument("--rollout-top-p", type=float, default=d.top_p, help="Nucleus sampling mass.")
    g.add_argument("--rollout-top-k", type=int, default=d.top_k, help="Top-k sampling (-1: off).")
    g.add_argument("--rollout-stop", nargs="+", default=None,
                   help="Stop strings (matched on decoded text).")  # fmt: skip
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None,
                   help="Stop token ids besides EOS.")  # fmt: skip
    g.add_argument("--rollout-seed", type=int, default=d.seed,
                   help="Seed of the prompt order and engine sampling (default: --seed).")  # fmt: skip


def _add_data_and_reward_args(g: argparse._ArgumentGroup, d: RolloutConfig) -> None:
    g.add_argument(
        "--dynamic-sampling",
        action="store_true",
        default=d.dynamic_sampling,
        help="DAPO: drop zero-variance groups and refill with fresh prompts.",
    )
    g.add_argument(
        "--prompt-data",
        default=d.prompt_data,
        help="jsonl/parquet prompts (default: built-in verifiable tasks).",
    )
    g.add_argument(
        "--prompt-source",
        default=d.prompt_source,
        help="reasoning_gym:NAME[,NAME...]: endless procedural reasoning-gym tasks scored by "
        "their own score_answer (held-out eval from a disjoint seed; needs --hf-checkpoint "
        "for the tokenizer). Default: --prompt-data, else the built-in tasks.",
    )
    g.add_argument("--reasoning-gym-task", nargs="+", default=None, metavar="TASK.KEY=VALUE",
                   help="Per-task settings: the task's difficulty fields (e.g. "
                   "chain_sum.max_terms=3) and its weight (chain_sum.weight=2).")  # fmt: skip
    g.add_argument("--reasoning-gym-system-prompt", default=d.reasoning_gym_system_prompt,
                   help="System prompt: a reasoning_gym.utils.SYSTEM_PROMPTS name, literal "
                   "text, or 'none'.")  # fmt: skip
    g.add_argument("--reasoning-gym-answer-format", default=d.reasoning_gym_answer_format,
                   choices=list(ANSWER_FORMATS),
                   help="answer_tag: score the last <answer>...</answer> (reasoning-gym's "
                   "format); response: the whole response; last_number: the last number in "
                   "it (numeric tasks).")  # fmt: skip
    g.add_argument("--input-key", default=d.input_key, help="Prompt field of --prompt-data.")
    g.add_argument("--label-key", default=d.label_key, help="Label field of --prompt-data.")
    g.add_argument(
        "--apply-chat-template",
        action="store_true",
        default=d.apply_chat_template,
        help="Apply the tokenizer chat template to prompts.",
    )
    g.add_argument(
        "--strict-data",
        action="store_true",
        default=d.strict_data,
        help="Stop at the first malformed data row (file:line) instead of skipping.",
    )
    g.add_argument(
        "--custom-rm-path",
        default=d.custom_rm_path,
        help="Dotted path of a reward function, ours fn(RewardInput) or slime's "
        "async fn(args, sample) (default: exact match / math-verify).",
    )
    g.add_argument("--group-rm", action="store_true", default=d.group_rm,
                   help="slime's: the reward function scores a whole group, "
                   "fn(args, samples) -> list of rewards.")  # fmt: skip
    g.add_argument("--custom-generate-function-path", default=d.custom_generate_function_path,
                   help="Per-sample generate function (multi-turn, tools): ours "
                   "fn(ctx, request) or slime's fn(args, sample, sampling_params).")  # fmt: skip
    g.add_argument("--rollout-function-path", default=None,
                   help="slime's whole-rollout function: refused, see the error for the "
                   "equivalents.")  # fmt: skip


def rollout_config_from_args(args: argparse.Namespace) -> RolloutConfig:
    """Build (and check) the config from `add_rollout_args` flags and `--advantage-estimator`."""
    if getattr(args, "rollout_function_path", None):
        raise ValueError(
            f"--rollout-function-path {args.rollout_function_path}: slime's whole-rollout "
            "function cannot apply here, where the data worker decides which sample is generated "
            "next (asynchronously, under the staleness budget). Per-sample logic (multi-turn, "
            "tools, custom requests) goes in --custom-generate-function-path, the reward in "
            "--custom-rm-path (--group-rm for whole groups), the prompts in --prompt-data"
        )
    if args.custom_generate_function_path:  # fail at start-up, not in the first rollout
        from slime_async.rollout.custom_generate import load_custom_generate

        load_custom_generate(args.custom_generate_function_path)
    if args.group_rm and args.dynamic_sampling:
        raise ValueError(
            "--group-rm scores a group when a step consumes it, after --dynamic-sampling would "
            "have had to filter it by reward; drop one of them"
        )
    return RolloutConfig(
        prompt_source=args.prompt_source,
        reasoning_gym_task=tuple(args.reasoning_gym_task or ()),
        reasoning_gym_system_prompt=None
        if args.reasoning_gym_system_prompt in (None, "none")
        else args.reasoning_gym_system_prompt,
        reasoning_gym_answer_format=args.reasoning_gym_answer_format,
        rollout_batch_size=args.rollout_batch_size,
        n_samples_per_prompt=args.n_samples_per_prompt,
        num_steps_per_rollout=args.num_steps_per_rollout,
        global_batch_size=args.global_batch_size,
        max_response_len=args.rollout_max_response_len,
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        advantage_estimator=advantage_estimator_from_args(args),
        dynamic_sampling=args.dynamic_sampling,
        prompt_data=args.prompt_data,
        input_key=args.input_key,
        label_key=args.label_key,
        apply_chat_template=args.apply_chat_template,
        strict_data=args.strict_data,
        custom_rm_path=args.custom_rm_path,
        group_rm=args.group_rm,
        custom_generate_function_path=args.custom_generate_function_path,
        top_k=args.rollout_top_k,
        stop=tuple(args.rollout_stop or ()),
        stop_token_ids=tuple(args.rollout_stop_token_ids or ()),
        seed=args.rollout_seed,
        eval_interval=args.eval_interval,
        eval_prompts=args.eval_prompts,
        n_samples_per_eval_prompt=args.n_samples_per_eval_prompt,
    )
