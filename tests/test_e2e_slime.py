"""A slime user's launch flags and plugins, end to end on the embedded CPU default (real Ray,
engines, router, Megatron): the flag list of slime's example scripts (run-qwen3-4B.sh's
ROLLOUT/EVAL/GRPO/OPTIMIZER groups, the TIS example's flags), scaled down, parses with slime's
meanings and trains; and the shipped multi-turn calculator example trains with tool tokens
outside the loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from slime_async.config import parse_config
from slime_async.orchestrator.controller import train

pytestmark = pytest.mark.timeout(600)

SLIME_FLAGS = [
    # ROLLOUT_ARGS (run-qwen3-4B.sh), scaled down
    "--num-rollout",
    "3",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-max-response-len",
    "12",
    "--rollout-temperature",
    "1",
    "--global-batch-size",
    "8",
    "--rollout-top-p",
    "1",
    "--rollout-top-k",
    "-1",
    "--rollout-seed",
    "42",
    "--rollout-stop-token-ids",
    "8",
    # EVAL_ARGS
    "--eval-interval",
    "2",
    # GRPO_ARGS
    "--advantage-estimator",
    "grpo",
    "--use-kl-loss",
    "--kl-loss-coef",
    "0.01",
    "--kl-loss-type",
    "low_var_kl",
    "--entropy-coef",
    "0.001",
    "--eps-clip",
    "0.2",
    "--eps-clip-high",
    "0.28",
    # TIS (slime's train-infer mismatch example) and slime's loss switches
    "--use-tis",
    "--tis-clip",
    "2.0",
    "--tis-clip-low",
    "0.0",
    "--loss-type",
    "policy_loss",
    "--calculate-per-token-loss",
    # OPTIMIZER_ARGS
    "--lr",
    "1e-6",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0.1",
    "--adam-beta1",
    "0.9",
    "--adam-beta2",
    "0.98",
    # async / misc
    "--partial-rollout",
    "--update-weights-interval",
    "1",
    "--save-interval",
    "20",
    "--use-rollout-routing-replay",
    "--micro-batch-size",
    "4",
    "--custom-rm-path",
    "tests.plugins.slime_rm:rm",
]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_slime_flags_keep_slime_meanings(tmp_path):
    cfg = parse_config([*SLIME_FLAGS, "--run-dir", str(tmp_path)])
    assert cfg.num_steps == 3 and cfg.rollout.groups_per_step == 2
    loss = cfg.trainer.loss.config
    assert (loss.engine_method, loss.engine_low, loss.engine_high) == ("clip", 0.0, 2.0)
    assert loss.agg_mode == "token-mean" and (loss.eps_clip, loss.eps_clip_high) == (0.2, 0.28)
    assert cfg.data_worker.partial_rollout.value == "continue"
    assert cfg.rollout.seed == 42 and cfg.engine.seed == 42 and cfg.rollout.stop_token_ids == (8,)
    assert cfg.trainer.routing_replay.value == "r3"
    reg = cfg.trainer.loss.regularizers
    assert (reg.kl_coef, reg.kl_type, reg.entropy_coef) == (0.01, "low_var_kl", 0.001)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--advantage-estimator", "gspo"], "--advantage-estimator grpo --loss gspo"),
        (["--advantage-estimator", "ppo"], "no critic"),
        (["--loss-type", "sft_loss", "--loss", "ppo"], "sft_loss selects --loss sft"),
        (["--loss-type", "custom_loss"], "needs --custom-loss-function-path"),
        (
            [
                "--loss-type",
                "policy_loss",
                "--custom-loss-function-path",
                "loss.registry.slime_compis_loss",
            ],
            "only with --loss-type custom_loss",
        ),
        (
            [
                "--loss-type",
                "custom_loss",
                "--custom-loss-function-path",
                "loss.registry.slime_compis_loss",
            ],
            "has slime's signature",
        ),
        (["--tis-clip", "3"], "applies only with --use-tis"),
        (["--kl-loss-coef", "0.1"], "applies only with --use-kl-loss"),
        (["--use-tis", "--engine-correction-high", "3"], "given twice"),
        (
            ["--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout"],
            "--custom-generate-function-path",
        ),
        (["--group-rm", "--dynamic-sampling"], "drop one of them"),
        (["--colocate", "--engine-sleep-level", "0"], "--engine-sleep-level 0 keeps it"),
    ],
)
def test_slime_flags_without_an_equivalent_are_refused_with_ours(tmp_path, extra, match, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--run-dir", str(tmp_path), *extra])
    assert match in capsys.readouterr().err


async def test_slime_launch_flags_train_a_few_steps(tmp_path):
    cfg = parse_config(
        [*SLIME_FLAGS, "--run-dir", str(tmp_path), "--warmstart-steps", "0", "--eval-prompts", "8"]
    )
    summary = await train(cfg)
    assert summary["train/version"] == 3 and math.isfinite(summary["loss/total"])
    assert summary["loss/kl_ref"] > 0 and summary["loss/entropy"] > 0  # slime's GRPO_ARGS terms
    rows = _metrics(tmp_path)
    evals = {r["step"]: r for r in rows if "eval/reward" in r}
    # the baseline before any push, and the final weights although 3 is no multiple of 2:
    # each sampled on exactly one version
    assert {0, 3} <= set(evals)
    assert evals[0]["eval/version_min"] == evals[0]["eval/version_max"] == 0
    assert evals[3]["eval/version_min"] == evals[3]["eval/version_max"] == 3
    steps = [r for r in rows if "train/version" in r]
    assert all(r["rollout/reward_masked"] == 0.0 for r in steps)  # slime's rm scored everything


async def test_calculator_example_trains_end_to_end(tmp_path):
    cfg = parse_config(
        [
            "--run-dir",
            str(tmp_path),
            "--num-steps",
            "3",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "4",
            "--rollout-max-response-len",
            "40",
            "--eval-interval",
            "0",
            "--warmstart-steps",
            "0",
            "--micro-batch-size",
            "4",
            "--max-staleness",
            "1",
            "--custom-generate-function-path",
            "slime_async.examples.calculator_tool:generate",
            "--custom-rm-path",
            "slime_async.examples.calculator_tool:reward",
        ]
    )
    summary = await train(cfg)
    assert summary["train/version"] == 3 and math.isfinite(summary["loss/total"])
    steps = [r for r in _metrics(tmp_path) if "train/version" in r]
    assert all(r["rollout/tool_tokens"] > 0 for r in steps)  # every step's episodes used the tool
    assert summary["rollout/routed_experts_frac"] == 1.0  # R3 routing covers multi-turn samples
