"""The external loggers a run writes to: wandb (offline, the real library) and the logging flags.

* the run's config.json record is the wandb run's config, read back from wandb's files on disk;
* a second logger in the same run directory (kill + --load) logs into the same wandb run;
* `--wandb-run-id` wins and is stored; `WANDB_*` variables stay in charge of unset flags;
* `--wandb-key` is refused with the environment variable to use, without echoing the key;
* secrets (the run's token, the wandb key) appear in none of the files written.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slime_async.config import parse_config
from slime_async.config.recipe import config_record
from slime_async.metrics import LoggingConfig, MetricsLogger
from slime_async.metrics.sinks import WANDB_RUN_ID_FILE, wandb_run_id

TOKEN = "tok-never-recorded-0451"
WANDB_KEY = "k" * 40


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of one offline run's transaction log (`run-<id>.wandb`): wandb's own
    on-disk format (a 7-byte header, then 32 KiB blocks of crc32/length/type-framed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: one record
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _offline_runs(wandb_dir: Path) -> list[dict[str, Any]]:
    """{id, project, name, config, steps} of every offline run under ``wandb_dir``, oldest first."""
    import wandb

    wandb.teardown()  # wandb's service writes the log files behind `finish()`: let it flush them
    runs = []
    for f in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        info: dict[str, Any] = {"steps": []}
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                info |= {
                    "id": rec.run.run_id,
                    "project": rec.run.project,
                    "name": rec.run.display_name,
                    "group": rec.run.run_group,
                    "config": {u.key: json.loads(u.value_json) for u in rec.run.config.update},
                }
            elif kind == "history":
                info["steps"].append(rec.history.step.num)
        runs.append(info)
    return runs


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """wandb offline, its files in tmp, no WANDB_* setting inherited from the caller's shell."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # wandb reads its environment once per process: start from this test's
    for var in ("WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)
    wandb_dir = tmp_path / "wandb_files"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    monkeypatch.setenv("SLIME_ASYNC_AUTH_TOKEN", TOKEN)
    yield wandb_dir
    wandb.teardown()


def _log_steps(run_dir: Path, cfg: Any, steps: range) -> str:
    """One process's logger as `launch.py` builds it; returns the wandb run id it used."""
    with MetricsLogger(
        run_dir,
        loggers=cfg.loggers,
        run_config=config_record(cfg),
        console=False,
        progress=False,
        stderr=io.StringIO(),
    ) as ml:
        for k in steps:
            ml.log(k, {"rollout/reward": k / 10})
        return ml.sinks[-1].run_id


def test_wandb_gets_the_run_config_and_a_resume_continues_the_same_run(
    offline: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    cfg = parse_config(["--run-dir", str(run_dir), "--use-wandb", "--wandb-group", "ablation"])
    first = _log_steps(run_dir, cfg, range(1, 4))
    assert (run_dir / WANDB_RUN_ID_FILE).read_text().strip() == first
    second = _log_steps(run_dir, cfg, range(3, 6))  # killed after step 3, resumed from it
    assert second == first

    runs = _offline_runs(offline)
    assert len(runs) == 2 and {r["id"] for r in runs} == {first}
    for r in runs:
        assert r["project"] == "slime-async" and r["name"] == "run" and r["group"] == "ablation"
        config = r["config"]
        assert config["flags"]["use_wandb"] is True and config["flags"]["wandb_group"] == "ablation"
        assert config["run_dir"] == str(run_dir)
        assert config["engine"]["admin_api_key"] == "<set>"  # redacted, as in config.json
        assert config["engine"]["api_key"] == "<set>"  # the minted data-plane key too
        assert config["loggers"]["use_wandb"] is True
    assert runs[0]["steps"] == [1, 2, 3] and runs[1]["steps"][-1] == 5

    for f in [*offline.rglob("*"), *run_dir.rglob("*")]:  # no secret lands in any file
        if f.is_file():
            data = f.read_bytes()
            assert TOKEN.encode() not in data and WANDB_KEY.encode() not in data, f


def test_a_new_run_in_a_reused_run_dir_starts_its_own_wandb_run_and_metrics(
    offline: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Experiment B in experiment A's run directory (the default runs/default, no --load):
    A's metrics.jsonl and wandb run id are set aside (kept), B logs into a new wandb run and a
    new metrics.jsonl; B resumed (--load) continues both."""
    from slime_async.metrics.history import read_metrics
    from slime_async.orchestrator.launch import run_logger

    run_dir = tmp_path / "run"
    cfg = parse_config(["--run-dir", str(run_dir), "--use-wandb"])
    a = _log_steps(run_dir, cfg, range(1, 6))
    with caplog.at_level("WARNING"), run_logger(cfg) as logger:  # as launch.py builds it: fresh
        for k in (1, 2):
            logger.log(k, {"rollout/reward": 0.5})
        b = logger.sinks[-1].run_id
    assert b != a and (run_dir / WANDB_RUN_ID_FILE).read_text().strip() == b
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl").records] == [1, 2]
    (old_metrics,) = run_dir.glob("metrics.jsonl.stale-*")
    (old_id,) = run_dir.glob(f"{WANDB_RUN_ID_FILE}.stale-*")
    assert [r["step"] for r in read_metrics(old_metrics).records] == [1, 2, 3, 4, 5]
    assert old_id.read_text().strip() == a
    assert "holds an earlier run's metrics.jsonl; this run starts fresh" in caplog.text
    assert _log_steps(run_dir, cfg, range(3, 4)) == b  # a resume (--load): the same run
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl").records] == [1, 2, 3]


def test_wandb_run_id_flag_wins_and_env_fills_unset_flags(
    offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    (run_dir / WANDB_RUN_ID_FILE).write_text("oldrun01\n")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    cfg = parse_config(["--run-dir", str(run_dir), "--use-wandb", "--wandb-run-id", "given123"])
    assert _log_steps(run_dir, cfg, range(1, 2)) == "given123"
    assert (run_dir / WANDB_RUN_ID_FILE).read_text().strip() == "given123"
    (run,) = _offline_runs(offline)
    assert run["id"] == "given123" and run["project"] == "from-env"  # the env var is not overridden


def test_wandb_run_id_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    stored = tmp_path / WANDB_RUN_ID_FILE
    assert wandb_run_id(tmp_path, None, lambda: "fresh001") == "fresh001"
    assert stored.read_text() == "fresh001\n"
    assert wandb_run_id(tmp_path, None, lambda: "unused") == "fresh001"  # a restart: stored
    monkeypatch.setenv("WANDB_RUN_ID", "envrun01")
    assert wandb_run_id(tmp_path, None, lambda: "unused") == "envrun01"
    assert wandb_run_id(tmp_path, "flagrun1", lambda: "unused") == "flagrun1"  # the flag wins
    assert stored.read_text() == "flagrun1\n"
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temporary file, renamed


def test_wandb_key_is_refused_with_the_env_var(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--wandb-key", "secret-value-77"], ["--wandb-key=secret-value-77"]):
        with pytest.raises(SystemExit) as e:
            parse_config(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--wandb-key is not accepted" in err and "export WANDB_API_KEY" in err
        assert "secret-value-77" not in err


def test_wandb_flags_without_use_wandb_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--wandb-project", "p", "--wandb-mode", "offline"])
    err = capsys.readouterr().err
    assert "--wandb-project, --wandb-mode would do nothing without --use-wandb" in err
    with pytest.raises(ValueError, match="--wandb-run-id"):
        LoggingConfig(wandb_run_id="x")


def test_tensorboard_is_a_dependency() -> None:
    """`--use-tensorboard` needs no extra install: tensorboard is a main dependency."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10 (the [test] extra installs tomli there)
        import tomli as tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    from packaging.requirements import Requirement

    assert any(Requirement(d).name == "tensorboard" for d in project["dependencies"])
    cfg = parse_config(["--use-tensorboard"])
    assert cfg.loggers.use_tensorboard and not cfg.loggers.use_wandb
