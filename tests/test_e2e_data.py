"""Real-data runs: jsonl prompts, a local HF model directory with its tokenizer, math-verify.
An --eval-prompt-data file is evaluated at step 0 and every --eval-interval rollouts.

The model and tokenizer are built in code (no hub): a dense Llama-style model whose vocabulary
is a word-level tokenizer over digits and a few symbols. Malformed rows are skipped and counted,
or, under --strict-data, stop the run with the file and line named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_async.config import parse_config
from slime_async.orchestrator.controller import train

pytestmark = pytest.mark.timeout(400)


def _hf_dir(root: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from slime_async.contracts.model import ModelSpec

    words = [
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
        *list("0123456789+-=?"),
        "What",
        "is",
        "The",
        "answer",
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(
        pattern=r"\s+|(?=[0-9+\-=?])|(?<=[0-9+\-=?])", behavior="removed"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    spec = ModelSpec(
        family="llama",
        vocab_size=32,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    )
    cfg = spec.to_hf_config()
    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = 2, 0, 1
    out = root / "hf"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def _data(root: Path) -> Path:
    rows = [
        json.dumps({"prompt": f"What is {a}+{b}?", "label": str(a + b)})
        for a in range(4)
        for b in range(3)
    ]
    rows.insert(3, "{not json")
    rows.insert(5, "")
    rows.insert(7, json.dumps({"prompt": "What is 1+1?"}))  # no label
    path = root / "data.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _argv(tmp: Path, hf: Path, data: Path, *extra: str) -> list[str]:
    return [
        "--run-dir",
        str(tmp / "run"),
        "--prompt-data",
        str(data),
        "--hf-checkpoint",
        str(hf),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "6",
        "--num-steps",
        "2",
        "--eval-interval",
        "0",
        "--micro-batch-size",
        "4",
        *extra,
    ]


async def test_jsonl_run_with_tokenizer_and_math_verify_skips_bad_rows(tmp_path):
    hf, data = _hf_dir(tmp_path), _data(tmp_path)
    summary = await train(parse_config(_argv(tmp_path, hf, data)))
    assert summary["train/version"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "train/version" in r)
    assert first["data/rows"] == 12 and first["data/skipped"] == 3
    assert 0.0 <= summary["rollout/reward"] <= 1.0


async def test_eval_prompt_data_is_logged_at_step_0_and_every_interval(tmp_path):
    hf, data = _hf_dir(tmp_path), _data(tmp_path)
    mini = tmp_path / "mini.jsonl"
    rows = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(3)]
    mini.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{bad\n")
    argv = _argv(tmp_path, hf, data, "--eval-prompt-data", "mini", str(mini))
    argv += ["--eval-interval", "1", "--eval-input-key", "question", "--eval-label-key", "answer"]
    cfg = parse_config(argv)
    assert cfg.rollout.eval_sets == (("mini", str(mini)),)
    summary = await train(cfg)
    assert summary["train/version"] == 2
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval/mini/reward" in r]
    # step 0 (the initial weights), then each rollout; one evaluation at a time, so a step whose
    # previous evaluation is still running skips its own
    steps = [r["step"] for r in evals]
    assert steps[0] == 0 and steps == sorted(set(steps)) and set(steps) <= {0, 1, 2}
    assert len(steps) >= 2, steps
    for r in evals:
        assert 0.0 <= r["eval/mini/reward"] <= 1.0 and r["eval/mini/reward_se"] >= 0.0
        assert 0.0 <= r["eval/mini/pass"] <= 1.0
        assert "eval/reward" not in r  # a --prompt-data run has no held-out set
    first = next(r for r in recs if "train/version" in r)
    assert first["data/eval/mini/rows"] == 3 and first["data/eval/mini/skipped"] == 1


def test_strict_data_names_file_and_line(tmp_path):
    from slime_async.rollout.config import RolloutConfig
    from slime_async.rollout.data.datasets import DatasetError
    from slime_async.rollout.data.plan import make_data_plan

    hf, data = _hf_dir(tmp_path), _data(tmp_path)
    with pytest.raises(DatasetError, match=rf"{data}:4: "):
        make_data_plan(
            RolloutConfig(prompt_data=str(data), strict_data=True),
            seed=0,
            hf_checkpoint=str(hf),
        )


def test_prompt_data_without_a_tokenizer_dir_is_refused(tmp_path):
    from slime_async.rollout.config import RolloutConfig
    from slime_async.rollout.data.plan import make_data_plan

    with pytest.raises(ValueError, match="--prompt-data needs --hf-checkpoint"):
        make_data_plan(RolloutConfig(prompt_data=str(_data(tmp_path))), seed=0, hf_checkpoint=None)
