"""The example agent (`slime_async/examples/agent_calculator.py`, ordinary `openai` code) trains
end to end through `train_async`'s path: gateway, router, embedded engines, trainer."""

from __future__ import annotations

import json
import math

import pytest

from slime_async.config import parse_config
from slime_async.orchestrator.controller import train

pytest.importorskip("openai")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


async def test_agent_example_trains_end_to_end(tmp_path):
    cfg = parse_config(
        [
            "--config",
            "recipes/agent-calculator.yaml",
            "--run-dir",
            str(tmp_path),
            "--num-steps",
            "3",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "4",
            "--eval-interval",
            "0",
            "--warmstart-steps",
            "0",
            "--micro-batch-size",
            "4",
            "--max-staleness",
            "1",
        ]
    )
    summary = await train(cfg)
    assert summary["train/version"] == 3 and math.isfinite(summary["loss/total"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/version" in r]
    assert all(r["rollout/tool_tokens"] > 0 for r in steps)  # the tool's output is masked
    last = steps[-1]
    assert last["agent/episodes"] >= 24 and last["agent/failed"] == last["agent/timed_out"] == 0
    assert last["agent/turns"] >= 2 * last["agent/finished"]
    assert summary["rollout/routed_experts_frac"] == 1.0  # R3 covers the whole episode
