"""slime's `--colocate` (time-sharing): the flags it derives, and a colocated run of the embedded
default in which the engines are released while the trainer trains and the trainer is offloaded
while the engines generate, observed through the run's own event log (`colocate.jsonl`) and
metrics; the trainer's resident memory drops by its offloaded optimizer and gradient bytes, and a
replay of the run's dumps without any offload reproduces every step bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime_async.config import parse_config
from slime_async.contracts.engine import EngineLaunch
from slime_async.engine.config import EngineConfig
from slime_async.engine.sglang import build_command
from slime_async.orchestrator.colocate import read_events
from slime_async.orchestrator.controller import train
from slime_async.orchestrator.engines.sglang import sglang_config

pytestmark = pytest.mark.timeout(300)
STEPS = 3
TURN = ["engines_released", "trainer_onloaded", "trainer_offloaded", "engines_resumed"]


def test_colocate_derives_slimes_offloads_and_logs_them() -> None:
    cfg = parse_config(["--colocate"])
    assert cfg.offload_train and cfg.offload_rollout and cfg.engine_sleep_level == 2
    for flag in ("--offload-train", "--offload-rollout", "--engine-sleep-level"):
        assert flag in cfg.derived, flag
    off = parse_config([])
    assert not (off.offload_train or off.offload_rollout or off.engine_sleep_level)
    both = parse_config(["--offload", "--engine-sleep-level", "1"])
    assert both.offload_train and both.offload_rollout and both.engine_sleep_level == 1
    assert "--engine-sleep-level" not in both.derived  # given: kept


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--colocate", "--engine-sleep-level", "0"], "--engine-sleep-level 0 keeps it"),
        (["--no-offload-rollout", "--engine-sleep-level", "2"], "drop one of them"),
        (["--colocate", "--lora-rank", "4"], "adapter pushes read the live trainer"),
        (
            ["--colocate", "--engine-backend", "sglang", "--no-engine-sleep"],
            "--enable-memory-saver",
        ),
    ],
)
def test_contradictions_are_refused_naming_both_flags(argv, says, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert says in capsys.readouterr().err


def test_colocate_with_sglang_starts_servers_with_the_memory_saver() -> None:
    cfg = parse_config(["--colocate", "--engine-backend", "sglang", "--rollout-num-gpus", "1"])
    assert cfg.engines.engine_sleep and "--engine-sleep" in cfg.derived
    launch = EngineLaunch(index=0, model_dir="/w/v0", weight_version=0, seed=1, host=None)
    cmd = build_command(sglang_config(EngineConfig(), launch, port=30000, fleet=cfg.engines))
    assert "--enable-memory-saver" in cmd and "--enable-weights-cpu-backup" in cmd


def _argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        *("--run-dir", str(run_dir), "--num-steps", str(STEPS), "--warmstart-steps", "0"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "8", "--eval-interval", "0"),
        *("--max-staleness", "0", "--behavior-forward", "trainer"),
        *("--micro-batch-size", "4", "--lr", "1e-3"),
        *extra,
    ]


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss/total" in r]


def check_turns(events: list[dict], steps: list[int]) -> None:
    """The trainer offloaded before the first batch; then per turn (a train step, or the final
    save: `steps`): released, onloaded, offloaded, resumed; generation (the dispatched count,
    the engines' decoded tokens) only while the trainer is offloaded and the engines awake."""
    assert events[0]["event"] == "trainer_offloaded" and events[0]["step"] == 0
    turns = events[1 : 1 + 4 * len(steps)]
    assert [e["event"] for e in turns] == TURN * len(steps)
    assert [e["step"] for e in turns] == [s for s in steps for _ in TURN]
    for released, onloaded, offloaded, resumed in zip(*[iter(turns)] * 4, strict=True):
        assert released["level"] == 2
        for e in (released, onloaded, offloaded):  # the engines report their sleep level
            assert [x["sleep_level"] for x in e["engines"]] == [2] * len(e["engines"])
        assert all(x["sleep_level"] == 0 for x in resumed["engines"])
        # nothing is dispatched or decoded from the release to the resume: the trainer's turn
        assert released["dispatched"] == onloaded["dispatched"] == offloaded["dispatched"]
        decoded = [[x["decoded"] for x in e["engines"]] for e in (released, offloaded)]
        assert decoded[0] == decoded[1]
    for before, after in zip([events[0], *turns[3::4]], turns[0::4], strict=False):
        # the engines' turn (offloaded or resumed -> the next release): the trainer is
        # offloaded, and the engines decode the next batch
        assert _decoded(after) > _decoded(before), (before, after)


def _decoded(event: dict) -> int:
    return sum(x["decoded"] for x in event["engines"])


async def test_a_colocated_run_takes_turns_frees_the_trainer_and_trains_as_a_replay(tmp_path):
    dumps = tmp_path / "dumps" / "step_{rollout_id}.json"
    cfg = parse_config(_argv(tmp_path / "a", "--colocate", "--save-debug-rollout-data", str(dumps)))
    assert cfg.offload_train and cfg.engine_sleep_level == 2
    summary = await train(cfg)
    assert summary["train/version"] == STEPS

    events = read_events(tmp_path / "a")
    check_turns(events, list(range(1, STEPS + 1)))
    # the final save: the trainer onloaded for it and offloaded again (the engines generate on)
    assert [e["event"] for e in events[1 + 4 * STEPS :]] == TURN[1:3]
    offloads = [e for e in events if e["event"] == "trainer_offloaded"]
    # (b) measured: every offload frees resident memory worth most of the optimizer state and
    # gradients (Adam's two moments and the fp32 main gradients: 3 x the parameters' fp32 bytes)
    params = sum(t.numel() for t in _weights(tmp_path / "a" / "hf").values())
    for e in offloads[1:]:  # after a step: gradients and moments exist
        assert e["bytes"] > 3 * 4 * params, (e["bytes"], params)
        assert e["rss_freed"] > 0.75 * (3 * 4 * params), (e["rss_freed"], params)
    rows = _steps(tmp_path / "a")
    assert [r["engines/sleeps"] for r in rows] == [1.0, 2.0, 3.0]
    assert [r["trainer/offloads"] for r in rows] == [2.0, 3.0, 4.0]  # the first: at start
    assert all(r["trainer/rss_freed_bytes"] > 0 and r["timing/trainer_onload_s"] > 0 for r in rows)
    assert not (tmp_path / "a" / "offload").exists()  # the spill files go with the run

    # (c) the same steps replayed from the dumps, never offloaded: bit for bit
    replay = parse_config(_argv(tmp_path / "b", "--load-debug-rollout-data", str(dumps)))
    assert not replay.offload_train
    await train(replay)
    b = _steps(tmp_path / "b")
    assert len(b) == len(rows) == STEPS
    for x, y in zip(rows, b, strict=True):
        assert y["replay/matches"] == 1.0
        assert x["loss/total"] == y["loss/total"] and x["train/grad_norm"] == y["train/grad_norm"]
    wa, wb = _weights(tmp_path / "a" / "hf"), _weights(tmp_path / "b" / "hf")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _weights(d: Path) -> dict[str, torch.Tensor]:
    from slime_async.trainer.weights_io import read_hf_dir

    return read_hf_dir(d).tensors
