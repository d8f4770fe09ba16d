"""Every numeric flag of `train_async.py` is range-checked at parse time, and the message names the
flag and the fix (issue 17, Low): nothing out of range may reach Ray and fail there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slime_async.config import Environment, build_parser, validate
from slime_async.contracts.model import TINY_MOE

TWO_CORES = Environment(model=TINY_MOE, cpus=(0, 1))
ROOT = Path(__file__).resolve().parent.parent

BAD = [
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--rollout-top-p", "0"], "--rollout-top-p"),
    (["--rollout-top-p", "1.5"], "--rollout-top-p"),
    (["--rollout-temperature", "nan"], "--rollout-temperature"),
    (["--rollout-stop-token-ids", "-3"], "--rollout-stop-token-ids"),
    (["--rollout-seed", "-1"], "--rollout-seed"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
    (["--expert-model-parallel-size", "-1"], "--expert-model-parallel-size"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size"),
    (["--router-port", "70000"], "--router-port"),
    (["--router-port", "-1"], "--router-port"),
    (["--adam-beta1", "2"], "--adam-beta1"),
    (["--adam-beta2", "nan"], "--adam-beta2"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--clip-grad", "nan"], "--clip-grad"),
    (["--lr-warmup-iters", "-5"], "--lr-warmup-iters"),
    (["--seed", "-1"], "--seed"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints"),
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--loss", "nosuch"], "unknown loss 'nosuch'"),
    (["--save-interval", "-2"], "--save-interval"),
    (["--engine-restart-after", "nan"], "--engine-restart-after"),
    (["--engine-down-timeout", "-1"], "--engine-down-timeout"),
    (["--engine-attach-timeout", "nan"], "--engine-attach-timeout"),
    (["--router-retry-backoff-s", "-1"], "--router-retry-backoff-s"),
    (["--router-control-timeout-s", "0"], "--router-control-timeout-s"),
    (["--router-health-interval-s", "nan"], "--router-health-interval-s"),
    (["--router-max-connections", "-1"], "--router-max-connections"),
    (["--router-max-body-bytes", "0"], "--router-max-body-bytes"),
    (["--router-auth-token", "  "], "whitespace"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_out_of_range_flag_is_refused_naming_it(argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        validate(build_parser().parse_args(argv), TWO_CORES)
    assert needle in str(e.value)


def test_the_command_line_refuses_before_starting_anything() -> None:
    """`train_async.py --adam-beta1 2` exits 2 with the message, without starting Ray."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "train_async.py"), "--adam-beta1", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "--adam-beta1 must be < 1 (e.g. 0.9 / 0.98), got 2.0" in r.stderr
    error = r.stderr.split("train_async.py: error:")[-1]  # past the usage (it names --ray-address)
    assert "ray" not in error.lower() and "Started a local Ray instance" not in r.stderr


def test_defaults_pass() -> None:
    validate(build_parser().parse_args([]), TWO_CORES)
