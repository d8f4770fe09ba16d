"""Where metric records go: console line, JSONL file, TensorBoard, wandb, a stderr progress bar.

Owns the sink classes; each takes one record per step (``{"step": k, "time": t, key: value}``)
with namespaced keys. JSONL is the source of truth (one object per line, flushed per line,
non-finite numbers written as null); TensorBoard and wandb are imported lazily and fail with an
install hint when missing. Imports nothing from slime_async.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

from slime_async.host import atomic_write_text


class Sink(Protocol):
    """Receives one record per logged step."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


class JsonlSink:
    """Appends one JSON object per record to a file and flushes it (survives kill -9)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        # a run killed mid-write leaves a partial line; start ours on a fresh line
        if self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._f.write("\n")

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps({k: _jsonable(v) for k, v in record.items()}, allow_nan=False)
        self._f.write(line + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


CONSOLE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("rollout/reward", "reward", ".3f"),
    ("eval/reward", "eval", ".3f"),
    ("loss/pg_loss", "loss", ".4f"),
    ("policy/entropy", "ent", ".3f"),
    ("mismatch/train_rollout_logprob_abs_diff", "lp_diff", ".2e"),
    ("is/combined/mean", "is_w", ".3f"),
    ("staleness/mean", "stale", ".2f"),
    ("staleness/dropped", "dropped", ".0f"),
    ("rollout/length", "len", ".1f"),
    ("timing/step_s", "step_s", ".2f"),
    ("idle/trainer_ratio", "idle_T", ".2f"),
    ("idle/rollout_ratio", "idle_R", ".2f"),
)
"""(metric key, short label, format) shown on the console line when present."""


def console_line(record: Mapping[str, Any], *, total_steps: int | None = None) -> str:
    """A short readable summary of one record, e.g. ``step 12/200 | reward 0.412 | ...``."""
    step = record.get("step")
    parts = [f"step {step}" + (f"/{total_steps}" if total_steps else "")]
    for key, label, fmt in CONSOLE_FIELDS:
        v = record.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        parts.append(f"{label} {v:{fmt}}" if math.isfinite(v) else f"{label} {v}")
    return " | ".join(parts)


class ConsoleSink:
    """Prints `console_line` for every ``every``-th step (eval-only records always print)."""

    def __init__(
        self, *, stream: TextIO | None = None, every: int = 1, total_steps: int | None = None
    ) -> None:
        self.stream = stream
        self.every = max(1, every)
        self.total_steps = total_steps

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record.get("step", 0))
        if step % self.every and "eval/reward" not in record:
            return
        print(
            console_line(record, total_steps=self.total_steps),
            file=self.stream or sys.stdout,
            flush=True,
        )

    def close(self) -> None:
        pass


def _scalars(record: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("step", "time")
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


class TensorBoardSink:
    """Scalars to TensorBoard event files in ``logdir`` (needs the tensorboard package)."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "TensorBoard logging needs the tensorboard package: pip install tensorboard "
                "(or run without --use-tensorboard)"
            ) from e
        self._w = SummaryWriter(log_dir=str(logdir))

    def write(self, record: Mapping[str, Any]) -> None:
        import numpy as np

        step = int(record["step"])
        for k, v in _scalars(record).items():
            self._w.add_scalar(k, v, global_step=step)
        for k, v in record.items():
            if k.endswith("/hist") and isinstance(v, list) and v:
                self._w.add_histogram(k, np.asarray(_expand_hist(v)), global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _expand_hist(counts: list[Any]) -> list[int]:
    """A count histogram ``[c0, c1, ...]`` as the samples ``[0]*c0 + [1]*c1 + ...``."""
    out: list[int] = []
    for i, c in enumerate(counts):
        if isinstance(c, (int, float)) and math.isfinite(c):
            out.extend([i] * int(c))
    return out or [0]


WANDB_RUN_ID_FILE = "wandb_run_id"
"""File in the run directory holding the wandb run id, so a resumed run logs into the same run."""
DEFAULT_WANDB_PROJECT = "slime-async"
"""wandb project when neither the caller nor $WANDB_PROJECT names one."""


def wandb_run_id(run_dir: str | Path, given: str | None, new_id: Callable[[], str]) -> str:
    """The wandb run id of the run in ``run_dir``, stored in ``run_dir/wandb_run_id``: ``given``
    (a flag), else $WANDB_RUN_ID, else the stored id (a resume or a restart), else ``new_id()``.
    The choice is written (atomically) before wandb starts, so a kill at any point resumes it."""
    path = Path(run_dir) / WANDB_RUN_ID_FILE
    stored = path.read_text(encoding="utf-8").strip() if path.is_file() else ""
    chosen = given or os.environ.get("WANDB_RUN_ID") or stored or new_id()
    if chosen != stored:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, chosen + "\n")
    return chosen


def _unless_env(value: Any, env: str, default: Any) -> Any:
    """``value`` when given; else None when wandb's own variable ``env`` is set (wandb reads it),
    else ``default``."""
    if value is not None:
        return value
    return None if os.environ.get(env) else default


class WandbSink:
    """Scalars to Weights & Biases (needs the wandb package and a login or offline mode).

    One wandb run per run directory: its id is kept in ``run_dir/wandb_run_id`` and opened with
    ``resume="allow"``, so a resumed process continues the same wandb run. An argument left None
    leaves wandb's own ``WANDB_*`` variable in charge; the API key is only ever read by wandb
    from $WANDB_API_KEY (or its login file)."""

    def __init__(
        self,
        *,
        run_dir: str | Path,
        project: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        run_id: str | None = None,
        mode: str | None = None,
        wandb_dir: str | Path | None = None,
        host: str | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """``name`` defaults to the run directory's name; ``config`` becomes the run's config."""
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "wandb logging needs the wandb package: pip install wandb (or run without "
                "--use-wandb)"
            ) from e
        from wandb.sdk.lib.runid import generate_id

        self._wandb = wandb
        self.run_id = wandb_run_id(run_dir, run_id, generate_id)
        directory = _unless_env(wandb_dir, "WANDB_DIR", run_dir)
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=_unless_env(project, "WANDB_PROJECT", DEFAULT_WANDB_PROJECT),
            entity=entity,
            group=group,
            name=_unless_env(name, "WANDB_NAME", Path(run_dir).name),
            id=self.run_id,
            resume="allow",
            mode=mode,
            dir=None if directory is None else str(directory),
            config=dict(config or {}),
            settings=wandb.Settings(base_url=host) if host else None,
        )

    def write(self, record: Mapping[str, Any]) -> None:
        self._run.log(_scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class ProgressBar:
    """A one-line progress bar on stderr (``\\r``-redrawn on a TTY, sparse lines otherwise)."""

    def __init__(
        self,
        total: int | None,
        *,
        stream: TextIO | None = None,
        width: int = 24,
        start_step: int = 0,
    ) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.width = width
        self._t0 = time.monotonic()
        self._start = start_step
        self._last_decile = -1
        self._drawn = False
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def render(self, step: int, *, now: float | None = None) -> str:
        """The bar text for ``step`` (without ``\\r``)."""
        elapsed = (time.monotonic() if now is None else now) - self._t0
        done = max(0, step - self._start)
        rate = elapsed / done if done else float("nan")
        if not self.total:
            return f"step {step}  {rate:.2f} s/step"
        frac = min(1.0, step / self.total)
        fill = round(frac * self.width)
        eta = rate * (self.total - step) if done else float("nan")
        eta_s = f"{eta / 60:.1f}m" if math.isfinite(eta) else "?"
        return (
            f"[{'#' * fill}{'.' * (self.width - fill)}] {step}/{self.total} "
            f"{100 * frac:3.0f}%  {rate:.2f} s/step  eta {eta_s}"
        )

    def update(self, step: int) -> None:
        text = self.render(step)
        if self._tty:
            self.stream.write("\r" + text + "\x1b[K")
            self._drawn = True
        else:
            decile = int(10 * step / self.total) if self.total else step // 50
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar before other output is printed on the terminal."""
        if self._tty and self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def close(self) -> None:
        if self._tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
