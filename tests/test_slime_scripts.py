"""slime's example launch scripts, as written, on `train_async.py --dry-run`.

The argv of slime's Qwen3-4B, Qwen2.5-0.5B and Qwen3-30B-A3B launch scripts (and its Llama 3.2
model file) and of its Qwen3-4B-Base SFT script, vendored as flag lists in tests/data/slime_scripts/ (its README.md names the
scripts), with local paths swapped in and Megatron's shape flags set to the test model's
config.json:

* no flag gets a bare "unrecognized argument": each is accepted (Megatron's shape flags checked
  against config.json, run flags whose slime meaning holds here) or answered with a reason;
* the dry run passes once the few flags answered with a refusal are changed (the same list
  docs/coming-from-slime.md gives), and logs an `accepted:` line per accepted flag;
* a shape flag that differs from config.json is one error line naming both values;
* the Qwen3-30B-A3B script's expert layout (ETP 1 under TP 4, EP 8) and the SFT script
  (`--num-epoch`, `--disable-compute-advantages-and-returns`, `--lr-warmup-fraction`) pass as
  written, with slime's meaning.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from slime_async.config import parse_config
from slime_async.config.engine_fleet import split_sglang_args
from slime_async.contracts.model import TINY_MOE, ModelSpec

DATA = Path(__file__).parent / "data"
SCRIPTS = DATA / "slime_scripts"
CONFIGS = DATA / "configs"


def script_argv(name: str, paths: dict[str, str]) -> list[str]:
    """The vendored argv of one script, its `$NAME` paths replaced."""
    tokens: list[str] = []
    for line in (SCRIPTS / f"{name}.args").read_text().splitlines():
        tokens += shlex.split(line, comments=True)
    missing = sorted({t for t in tokens if t.startswith("$") and t not in paths})
    assert not missing, f"no local path for {missing}"
    return [paths.get(t, t) for t in tokens]


def fit_shape(argv: list[str], spec: ModelSpec) -> list[str]:
    """`argv` with the value of every Megatron shape flag it gives set to `spec`'s (the
    switches stay as the script gives them: the test model is of the script's family)."""
    values = {
        "--num-layers": spec.num_layers,
        "--hidden-size": spec.hidden_size,
        "--ffn-hidden-size": spec.intermediate_size,
        "--num-attention-heads": spec.num_attention_heads,
        "--num-query-groups": spec.num_key_value_heads,
        "--kv-channels": spec.head_dim,
        "--vocab-size": spec.vocab_size,
        "--norm-epsilon": spec.rms_norm_eps,
        "--rotary-base": spec.rope_theta,
        "--max-position-embeddings": spec.max_position_embeddings,
        "--rotary-scaling-factor": spec.rope_factor,
        "--num-experts": spec.num_experts,
        "--moe-router-topk": spec.moe_topk,
        "--moe-ffn-hidden-size": spec.moe_intermediate_size,
        "--moe-layer-freq": "[" + ",".join(["1"] * spec.num_layers) + "]",
    }
    out = list(argv)
    for i, token in enumerate(out[:-1]):
        if token in values:
            out[i + 1] = str(values[token])
    return out


def without(argv: list[str], *flags: str) -> list[str]:
    """`argv` without `flags` and their values."""
    out, skip = [], False
    for token in argv:
        if token.startswith("--"):
            skip = token in flags
        if not skip:
            out.append(token)
    return out


def _model_dir(tmp: Path, model: str) -> tuple[Path, ModelSpec]:
    """An HF directory of the test model as a dry run reads it: config.json, and a weights
    file (present, as --ref-load checks; its tensors are read only when the run starts)."""
    out = tmp / model
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    if model == "tiny-moe":  # 8 experts: the script's EP 8 splits them
        spec = dataclasses.replace(TINY_MOE, num_experts=8)
        spec.to_hf_config().save_pretrained(str(out))
        return out, spec
    cfg = json.loads((CONFIGS / model / "config.json").read_text())
    if model == "llama3.2-tiny":  # Megatron's --use-rope-scaling fixes the original context
        cfg["rope_scaling"]["original_max_position_embeddings"] = 8192
    (out / "config.json").write_text(json.dumps(cfg))
    return out, ModelSpec.from_hf_config(cfg)


def _paths(tmp: Path, hf: Path) -> dict[str, str]:
    data = tmp / "train.jsonl"
    row = {"prompt": "1+1?", "label": "2", "messages": [{"role": "user", "content": "1+1?"}]}
    data.write_text(json.dumps(row) + "\n")
    return {
        "$HF_CHECKPOINT": str(hf),
        "$REF_LOAD": str(hf),
        "$LOAD": str(tmp / "ckpt"),
        "$SAVE": str(tmp / "ckpt"),
        "$PROMPT_DATA": str(data),
        "$EVAL_DATA": str(data),
    }


def _dry_run(argv: list[str], tmp: Path, capsys) -> tuple[int, str]:
    code, err, _ = _dry_run_out(argv, tmp, capsys)
    return code, err


def _dry_run_out(argv: list[str], tmp: Path, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        parse_config([*argv, "--run-dir", str(tmp / "run"), "--dry-run"])
    out = capsys.readouterr()
    return e.value.code, out.err, out.out


_SGLANG = ("--sglang-mem-fraction-static",)
SCRIPTS_CASES = {
    # script: (test model, the flags answered with a refusal here, the changes that pass)
    "qwen3-4B": ("qwen3-tiny", _SGLANG, []),
    "qwen2.5-0.5B": (
        "qwen2.5-tiny",
        (
            *_SGLANG,
            "--sglang-enable-deterministic-inference",
            "--sglang-attention-backend",
        ),
        [],
    ),
    "qwen3-30B-A3B": (
        "tiny-moe",
        (
            *_SGLANG,
            "--sglang-cuda-graph-bs",
            "--optimizer-cpu-offload",
            "--overlap-cpu-optimizer-d2h-h2d",
            "--use-precision-aware-optimizer",
        ),
        [],  # TP 4 x DP 2 for the dense layers, ETP 1 x EP 8 for the experts, as in slime
    ),
    "llama3.2-3B": ("llama3.2-tiny", _SGLANG, []),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS_CASES))
def test_a_slime_script_runs_but_for_its_paths_and_the_answered_flags(name, tmp_path, capsys):
    model, answered, changes = SCRIPTS_CASES[name]
    hf, spec = _model_dir(tmp_path, model)
    argv = fit_shape(script_argv(name, _paths(tmp_path, hf)), spec)

    code, err = _dry_run(argv, tmp_path, capsys)
    assert "unrecognized argument " not in err, err
    # answered, with the reason (the --sglang-* flags named as the SGLang server's)
    assert code == 2 and any(f.replace("--sglang-", "--") in err for f in answered), err

    code, err, out = _dry_run_out([*without(argv, *answered), *changes], tmp_path, capsys)
    assert code == 0, err
    cfg = json.loads(out)
    assert cfg["rollout"]["rm_type"] == argv[argv.index("--rm-type") + 1]  # slime's reward
    if name == "qwen2.5-0.5B":  # its deterministic eval and training
        assert cfg["rollout"]["eval_top_k"] == 1 and cfg["trainer"]["deterministic_mode"]
    accepted = [line for line in err.splitlines() if line.startswith("accepted: ")]
    assert f"accepted: --num-layers {spec.num_layers} ({hf}/config.json: num_hidden_layers" in err
    assert "accepted: --attention-dropout 0 (" in err and "accepted: --optimizer adam (" in err
    assert len(accepted) >= 20  # every shape flag and run flag of the script, one line each


def test_shape_flags_that_differ_from_config_json_are_one_line_each(tmp_path, capsys):
    hf, _ = _model_dir(tmp_path, "qwen3-tiny")
    argv = without(script_argv("qwen3-4B", _paths(tmp_path, hf)), *_SGLANG)
    code, err = _dry_run(argv, tmp_path, capsys)  # Qwen3-4B's shapes, a tiny Qwen3's config
    assert code == 2
    lines = err.splitlines()
    wrong = [line for line in lines if "but " in line and "config.json has" in line]
    assert len(wrong) == 7, err  # layers, width, MLP, heads, groups, head dim, vocab
    assert any(
        line.endswith(
            f"--num-layers 36, but {hf}/config.json has num_hidden_layers 2: the model is built "
            "from config.json; fix the flag to match it (or drop the flag)"
        )
        for line in lines
    ), err
    assert any("--kv-channels 128, but" in line and "head_dim 16" in line for line in lines)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        # Megatron's defaults count when a script describes a whole model
        (["--num-layers", "2"], "no --qk-layernorm (Megatron: no query/key norm), but"),
        (
            ["--num-layers", "2", "--qk-layernorm"],
            "no --swiglu (Megatron: a GeLU MLP), but",
        ),
        (["--use-rope-scaling"], "rope_scaling"),
        (["--num-experts", "8"], "no experts (a dense qwen3 model)"),
        (["--attention-dropout", "0.1"], "the trainer runs without dropout"),
        (["--context-parallel-size", "2"], "context parallelism is not implemented here"),
        (["--optimizer", "sgd"], "Megatron's Adam"),
        (["--no-rollout-shuffle"], "always shuffled"),
        (["--kl-coef", "0.1"], "--use-kl-loss --kl-loss-coef C"),
        (["--offload-train", "--lora-rank", "4"], "adapter pushes read the live trainer"),
        (["--disable-compute-advantages-and-returns"], "slime's switch is for SFT"),
        (["--num-epoch", "2"], "counts passes over --prompt-data"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "both set the warmup"),
    ],
)
def test_a_flag_whose_slime_meaning_does_not_hold_is_refused_with_the_reason(
    extra, says, tmp_path, capsys
):
    hf, _ = _model_dir(tmp_path, "qwen3-tiny")
    code, err = _dry_run(["--hf-checkpoint", str(hf), *extra], tmp_path, capsys)
    assert code == 2 and says in err, err
    assert "unrecognized argument " not in err


def test_sglang_list_flags_pass_all_their_values():
    rest, sglang = split_sglang_args(["--sglang-cuda-graph-bs", "1", "2", "4", "--lr", "1e-6"])
    assert sglang == ("--cuda-graph-bs", "1", "2", "4") and rest == ["--lr", "1e-6"]


def test_expert_tensor_parallel_size_apart_from_tp_follows_megatrons_rules(tmp_path, capsys):
    """ETP 1 under TP 2: the dense layers' DP is ranks / (TP x PP), the experts' is ranks /
    (ETP x EP x PP); a layout that does not split is one line naming the sizes."""
    hf, _ = _model_dir(tmp_path, "tiny-moe")
    base = ["--hf-checkpoint", str(hf), "--actor-num-gpus-per-node", "2"]
    base += ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    code, err, out = _dry_run_out([*base, "--expert-model-parallel-size", "2"], tmp_path, capsys)
    assert code == 0, err
    trainer = json.loads(out)["trainer"]
    assert (trainer["expert_tensor_parallel_size"], trainer["expert_model_parallel_size"]) == (1, 2)
    code, err = _dry_run([*base, "--expert-model-parallel-size", "4"], tmp_path, capsys)
    assert code == 2 and "--expert-tensor-parallel-size 1 x EP 4 x PP 1" in err, err
    wide = ["--hf-checkpoint", str(hf), "--actor-num-gpus-per-node", "16"]
    code, err = _dry_run([*wide, "--expert-model-parallel-size", "16"], tmp_path, capsys)
    assert code == 2 and "the model's 8 experts do not split evenly" in err, err


def test_slimes_sft_script_runs_as_written(tmp_path, capsys):
    """slime's Qwen3-4B-Base SFT script (`--loss-type sft_loss` on conversations): its flags
    as slime means them. --num-epoch 3 over 300 rows at --rollout-batch-size 128 is 3 x 2
    rollouts of one step each; the cosine schedule decays over them and warms up for a tenth;
    --disable-compute-advantages-and-returns is SFT's."""
    hf, spec = _model_dir(tmp_path, "qwen3-tiny")
    paths = _paths(tmp_path, hf)
    turns = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    (tmp_path / "sft.jsonl").write_text((json.dumps({"messages": turns}) + "\n") * 300)
    paths["$SFT_DATA"] = str(tmp_path / "sft.jsonl")
    argv = fit_shape(script_argv("qwen3-4B-base-sft", paths), spec)

    code, err, out = _dry_run_out(argv, tmp_path, capsys)
    assert code == 0, err
    cfg = json.loads(out)
    assert cfg["trainer"]["loss"]["name"] == "sft" and cfg["debug_train_only"]
    assert cfg["num_steps"] == 6, err
    assert (
        f"derived: --num-steps 6 (--num-epoch 3 x (300 rows of {tmp_path}/sft.jsonl // "
        "--rollout-batch-size 128) x --num-steps-per-rollout 1)" in err
    )
    assert (cfg["trainer"]["lr_decay_steps"], cfg["trainer"]["lr_warmup_steps"]) == (6, 1)
    assert "derived: --lr-warmup-iters 1 (--lr-warmup-fraction 0.1 x --lr-decay-iters 6" in err
    assert "accepted: --disable-compute-advantages-and-returns (SFT trains on" in err
    assert "accepted: --rollout-shuffle (" in err

    code, err, out = _dry_run_out([*argv, "--num-rollout", "2"], tmp_path, capsys)
    assert code == 0 and json.loads(out)["num_steps"] == 2, err  # slime: --num-epoch ignored
    assert "accepted: --num-epoch 3 (ignored: --num-rollout gives the run's length" in err
    rl = [*without(argv, "--loss-type", "--rollout-function-path", "--debug-train-only")]
    code, err = _dry_run([*rl, "--label-key", "label"], tmp_path, capsys)
    assert code == 2 and "--disable-compute-advantages-and-returns (a flag of slime's" in err
