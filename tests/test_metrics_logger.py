"""Metric logger: JSONL always (flushed, kill-safe), console line, progress bar, guard warnings."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from slime_async.metrics import MetricsConfig, MetricsLogger, read_metrics
from slime_async.metrics.sinks import ProgressBar, console_line


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_jsonl_is_written_and_flushed_per_line(tmp_path: Path) -> None:
    out = io.StringIO()
    ml = MetricsLogger(tmp_path, total_steps=10, stdout=out, stderr=io.StringIO())
    ml.log(
        1,
        {
            "rollout/reward": 0.25,
            "policy/entropy": np.float32(1.5),
            "loss/pg_loss": torch.tensor(-0.125),
            "staleness/hist": [3, 1, 0],
            "is/engine/p99": math.nan,
            "timing/step_s": 2,
        },
    )
    recs = _lines(tmp_path / "metrics.jsonl")  # read while the logger is still open
    assert recs[0]["event"] == "run_start" and recs[0]["step"] == 1
    rec = recs[1]
    assert rec["step"] == 1 and isinstance(rec["time"], float)
    assert rec["rollout/reward"] == 0.25 and rec["policy/entropy"] == 1.5
    assert rec["loss/pg_loss"] == -0.125 and rec["staleness/hist"] == [3, 1, 0]
    assert rec["is/engine/p99"] is None  # NaN -> null: the file stays strict JSON
    assert rec["timing/step_s"] == 2
    assert out.getvalue().startswith("step 1/10 | reward 0.250 | loss -0.1250 | ent 1.500")
    ml.close()


@pytest.mark.parametrize(
    ("metrics", "err", "match"),
    [
        ({"reward": 1.0}, ValueError, "not namespaced; use 'group/name'"),
        ({"rollout/": 1.0}, ValueError, "not namespaced"),
        ({"rollout/name": "high"}, TypeError, "'rollout/name' has a str value"),
        ({"x/y": [[1]]}, ValueError, "nested lists"),
    ],
)
def test_bad_metrics_are_rejected_with_the_key(tmp_path: Path, metrics, err, match) -> None:
    with (
        MetricsLogger(tmp_path, console=False, progress=False) as ml,
        pytest.raises(err, match=match),
    ):
        ml.log(1, metrics)


def test_bad_step_and_use_after_close(tmp_path: Path) -> None:
    ml = MetricsLogger(tmp_path, console=False, progress=False)
    with pytest.raises(ValueError, match="non-negative int"):
        ml.log(-1, {"a/b": 1})
    with pytest.raises(ValueError, match="non-negative int"):
        ml.log(1.5, {"a/b": 1})  # type: ignore[arg-type]
    ml.close()
    with pytest.raises(RuntimeError, match="after close"):
        ml.log(1, {"a/b": 1})


def test_eval_merges_and_resume_replaces_abandoned_steps(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, console=False, progress=False) as ml:
        for k in range(1, 6):
            ml.log(k, {"rollout/reward": k / 10})
        ml.log(3, {"eval/reward": 0.9})  # late eval for an earlier step: merged, not a resume
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "rollout/rew')  # killed mid-write
    with MetricsLogger(tmp_path, console=False, progress=False) as ml:  # resumed from step 3
        ml.log(4, {"rollout/reward": 0.44})
        ml.log(5, {"rollout/reward": 0.55})
    hist = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in hist.records] == [1, 2, 3, 4, 5]
    assert hist.series("rollout/reward") == ([1, 2, 3, 4, 5], [0.1, 0.2, 0.3, 0.44, 0.55])
    assert hist.series("eval/reward") == ([3], [0.9])
    assert hist.bad_lines == 1 and hist.restarts == 1


def test_guard_warnings_go_to_stderr_and_the_log(tmp_path: Path) -> None:
    err = io.StringIO()
    with MetricsLogger(tmp_path, console=False, progress=False, stderr=err) as ml:
        for k in range(1, 13):
            if k == 12:  # an eval record arriving first must not hide the train record
                assert ml.log(k, {"eval/reward": 0.5, "timing/eval_s": 1.0}) == []
            ent = 3.0 if k >= 10 else 1.0  # three spiking steps in a row: reported at the third
            fired = ml.log(k, {"policy/entropy": ent, "is/combined/mean": 1.0})
        assert [w.kind for w in fired] == ["entropy_spike"]
    assert "WARNING step 12 [entropy_spike]: entropy spiked to 3" in err.getvalue()
    hist = read_metrics(tmp_path / "metrics.jsonl")
    assert [(e["step"], e["kind"]) for e in hist.events] == [(12, "entropy_spike")]
    assert len(hist.records) == 12 and "event" not in hist.records[-1]
    quiet = MetricsLogger(tmp_path / "q", console=False, progress=False, guards=None)
    for k in range(1, 13):
        assert quiet.log(k, {"policy/entropy": 3.0 if k >= 10 else 1.0}) == []
    quiet.close()


def test_console_every_and_line_format(tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = MetricsConfig(console_every=5, progress=False)
    with MetricsLogger(tmp_path, config=cfg, stdout=out) as ml:
        for k in range(1, 11):
            ml.log(k, {"rollout/reward": 0.5})
        ml.log(7, {"eval/reward": 0.25})
    assert [ln.split(" |")[0] for ln in out.getvalue().splitlines()] == [
        "step 5",
        "step 10",
        "step 7",
    ]
    line = console_line(
        {
            "step": 3,
            "staleness/mean": 1.5,
            "idle/trainer_ratio": 0.25,
            "mismatch/train_rollout_logprob_abs_diff": 0.0123,
        }
    )
    assert line == "step 3 | lp_diff 1.23e-02 | stale 1.50 | idle_T 0.25"


def test_progress_bar_non_tty_prints_sparse_lines() -> None:
    s = io.StringIO()
    bar = ProgressBar(100, stream=s)
    for k in range(1, 101):
        bar.update(k)
    lines = s.getvalue().splitlines()
    assert len(lines) == 11  # one per 10 %, plus the first step
    assert lines[-1].startswith("[########################] 100/100 100%")
    assert "eta" in lines[0]
    assert ProgressBar(None, stream=io.StringIO()).render(3).startswith("step 3")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_tty_redraws_in_place() -> None:
    s = _Tty()
    bar = ProgressBar(4, stream=s, width=4)
    bar.update(1)
    bar.update(2)
    bar.clear()
    bar.close()
    out = s.getvalue()
    assert out.count("\r[") == 2 and "[##..] 2/4" in out and "\n" not in out.rstrip("\n")


def test_tensorboard_sink_writes_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, use_tensorboard=True, console=False, progress=False) as ml:
        for k in range(1, 4):
            ml.log(k, {"rollout/reward": k / 4, "staleness/hist": [k, 1], "x/nan": math.nan})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward")] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
    ]
    assert "x/nan" not in acc.Tags()["scalars"]  # non-finite values are not plotted
    assert "staleness/hist" in acc.Tags()["histograms"]


def test_tensorboard_missing_gives_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install tensorboard"):
        MetricsLogger(tmp_path, use_tensorboard=True)


def test_wandb_missing_gives_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, use_wandb=True)


def test_read_metrics_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is this a run directory"):
        read_metrics(tmp_path / "metrics.jsonl")
