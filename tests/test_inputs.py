"""What a run reads is checked when its flags are parsed (`slime_async/config/inputs.py`, read_environment):
a missing --prompt-data, --eval-prompt-data, --custom-rm-path or --ref-load fails the dry run
(all listed at once), a Hub id is refused at once with the download command, and --ref-load /
--load tell a Megatron torch_dist checkpoint (slime's) from an HF directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slime_async.config import parse_config
from slime_async.trainer.megatron_ckpt import TRACKER

CONFIGS = Path(__file__).parent / "data" / "configs"


def _run(argv: list[str], tmp: Path, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        parse_config([*argv, "--run-dir", str(tmp / "run"), "--dry-run"])
    out = capsys.readouterr()
    return e.value.code, out.err, out.out


@pytest.fixture
def model(tmp_path) -> Path:
    """An HF directory (config.json and a weights file: what --ref-load checks)."""
    out = tmp_path / "qwen3-tiny"
    out.mkdir()
    (out / "config.json").write_text((CONFIGS / "qwen3-tiny" / "config.json").read_text())
    (out / "model.safetensors").write_bytes(b"")
    return out


def _megatron(root: Path, iteration: str = "release") -> Path:
    """slime's converter's layout (what a parse reads of it: the tracker and metadata.json)."""
    sub = root / (iteration if iteration == "release" else f"iter_{int(iteration):07d}")
    sub.mkdir(parents=True)
    (root / TRACKER).write_text(iteration)
    (sub / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return root


def test_a_hub_id_is_refused_at_once_with_the_download_command(tmp_path, capsys):
    t0 = time.perf_counter()
    code, err, _ = _run(["--hf-checkpoint", "Qwen/Qwen3-0.6B"], tmp_path, capsys)
    assert code == 2 and time.perf_counter() - t0 < 5  # no retries against the hub
    assert "`hf download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B`" in err
    assert "--hf-checkpoint models/Qwen3-0.6B" in err


def test_every_missing_input_is_named_before_anything_starts(tmp_path, model, capsys):
    argv = [
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(tmp_path / "train.jsonl"),
        "--eval-prompt-data",
        "aime",
        str(tmp_path / "aime.jsonl"),
        "--custom-rm-path",
        "no_such_module:reward",
        "--ref-load",
        str(tmp_path / "ref"),
        "--use-kl-loss",
    ]
    code, err, _ = _run(argv, tmp_path, capsys)
    assert code == 2
    for said in (
        f"--ref-load {tmp_path / 'ref'} does not exist",
        f"--prompt-data {tmp_path / 'train.jsonl'} does not exist",
        f"--eval-prompt-data aime {tmp_path / 'aime.jsonl'} does not exist",
        "--custom-rm-path no_such_module:reward: cannot import module 'no_such_module'",
    ):
        assert said in err, err


def test_ref_load_takes_a_megatron_torch_dist_checkpoint_or_an_hf_directory(
    tmp_path, model, capsys
):
    ckpt = _megatron(tmp_path / "Qwen3-tiny_torch_dist")
    for ref, says in (
        (ckpt, f"a Megatron torch_dist checkpoint ({ckpt / 'release'}, iteration release)"),
        (model, "a Hugging Face directory"),
    ):
        argv = ["--hf-checkpoint", str(model), "--ref-load", str(ref), "--use-kl-loss"]
        code, err, out = _run(argv, tmp_path, capsys)
        assert code == 0, err
        assert f"accepted: --ref-load {ref} ({says})" in err
        assert json.loads(out)["trainer"]["ref_load"] == str(ref)
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "notes.txt").write_text("")
    argv = ["--hf-checkpoint", str(model), "--ref-load", str(tmp_path / "neither")]
    code, err, _ = _run(argv, tmp_path, capsys)
    assert code == 2 and "is neither a Hugging Face directory" in err


def test_load_of_a_megatron_checkpoint_starts_a_new_run_from_its_weights(tmp_path, model, capsys):
    ckpt = _megatron(tmp_path / "slime_run", iteration="20")
    argv = ["--hf-checkpoint", str(model), "--load", str(ckpt)]
    code, err, out = _run(argv, tmp_path, capsys)
    assert code == 0, err
    trainer = json.loads(out)["trainer"]
    assert trainer["load"] is None and trainer["start_from"] == str(ckpt)
    assert f"derived: --load None (--load {ckpt} is a Megatron torch_dist checkpoint" in err
    code, err, _ = _run([*argv, "--save", str(ckpt)], tmp_path, capsys)
    assert code == 2 and "give --save another directory" in err
