"""slime's `--load D --save D`: on an empty (or missing) D the run starts fresh and saves there,
recorded as derived (the flag stays as given); every refusal about --load comes at parse time,
before Ray or the trainer starts (exit 2, one message)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slime_async.config import Environment, build_parser, parse_config, validate
from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.orchestrator.controller import train
from slime_async.trainer.checkpoint import LoadFacts
from tests.cli_errors import error_lines

pytestmark = pytest.mark.timeout(300)


def _argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--run-dir",
        str(run_dir),
        "--num-steps",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "8",
        "--warmstart-steps",
        "0",
        "--eval-interval",
        "0",
        "--micro-batch-size",
        "4",
        *extra,
    ]


def _refused(argv: list[str], capsys, *, ray_before: bool = False) -> str:
    import ray

    capsys.readouterr()  # what earlier tests left behind
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2 and ray.is_initialized() == ray_before
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 2 and lines[0].startswith("train_async.py: error: "), lines
    return lines[0]


async def test_load_save_on_an_empty_dir_starts_fresh_and_a_rerun_resumes(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = parse_config(_argv(tmp_path / "run", "--load", str(ckpt), "--save", str(ckpt)))
    assert cfg.trainer.load is None and cfg.flags["load"] == str(ckpt)  # the flag as given
    assert cfg.derived["--load"].value is None and "is empty" in cfg.derived["--load"].why
    summary = await train(cfg)
    assert summary["train/version"] == 1 and math.isfinite(summary["loss/total"])
    assert (ckpt / "latest").read_text().strip() == "1"

    rerun = parse_config(
        _argv(tmp_path / "run", "--num-steps", "2", "--load", str(ckpt), "--save", str(ckpt))
    )
    assert rerun.trainer.load == str(ckpt) and "--load" not in rerun.derived
    # a resume that does not match the checkpoint is refused at parse time
    argv = _argv(tmp_path / "run", "--rollout-batch-size", "4", "--load", str(ckpt))
    capsys.readouterr()  # the run's progress output
    err = _refused(argv, capsys, ray_before=True)  # this process's run left Ray up
    assert "--rollout-batch-size 2" in err


def test_load_refusals_come_before_anything_starts(tmp_path, capsys):
    import ray

    ray.shutdown()  # an earlier test's run in this process
    missing = tmp_path / "missing"
    assert "--save" in _refused(_argv(tmp_path, "--load", str(missing)), capsys)
    other = _refused(_argv(tmp_path, "--load", str(missing), "--save", str(tmp_path / "x")), capsys)
    assert "does not exist" in other
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    for argv in (["--load", str(junk)], ["--load", str(junk), "--save", str(junk)]):
        assert "holds no complete checkpoint" in _refused(_argv(tmp_path, *argv), capsys)
    megatron = tmp_path / "slime_ckpt"
    megatron.mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("10")
    err = _refused(_argv(tmp_path, "--load", str(megatron)), capsys)
    assert "a Megatron checkpoint whose latest_checkpointed_iteration.txt names iteration 10" in err


GOOD = dict(
    path="ckpt",
    checkpoint="ckpt/iter_0000002",
    version=2,
    spec=TINY_MOE.to_dict(),
    step=2,
    has_worker_state=True,
)


@pytest.mark.parametrize(
    ("facts", "extra", "match"),
    [
        ({"version": 0, "step": 0}, (), "iteration 0"),
        ({"spec": ModelSpec(family="llama").to_dict()}, (), "another model config"),
        ({"has_worker_state": False}, (), "no data-worker state"),
        ({"step": 3}, (), "says step 3 but holds version 2"),
        ({}, ("--use-kl-loss", "--kl-loss-coef", "0.01"), "--ref-load"),
        ({"problem": "--load ckpt holds no complete checkpoint"}, (), "no complete checkpoint"),
    ],
)
def test_validate_refuses_a_checkpoint_that_does_not_match(facts, extra, match):
    env = Environment(model=TINY_MOE, cpus=(0, 1), load=LoadFacts(**{**GOOD, **facts}))
    args = build_parser().parse_args(["--load", "ckpt", *extra])
    with pytest.raises(ValueError, match=match):
        validate(args, env)


def test_validate_resumes_a_matching_checkpoint_and_keeps_the_flag():
    env = Environment(model=TINY_MOE, cpus=(0, 1), load=LoadFacts(**GOOD))
    cfg = validate(build_parser().parse_args(["--load", "ckpt", "--save", "ckpt"]), env)
    assert cfg.trainer.load == "ckpt" and "--load" not in cfg.derived
    assert cfg.warmstart_steps == 0
    empty = Environment(
        model=TINY_MOE, cpus=(0, 1), load=LoadFacts(path="d", empty=True, exists=False)
    )
    fresh = validate(build_parser().parse_args(["--load", "d", "--save", "./d"]), empty)
    assert fresh.trainer.load is None and fresh.flags["load"] == "d"
    assert fresh.warmstart_steps > 0  # the embedded default's fresh start
    assert "does not exist" in fresh.derived["--load"].why
