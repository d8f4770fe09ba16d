"""Training without engines (slime's `--debug-train-only`): each step's batch comes from a file,
not from generation.

Owns `train_offline` (the trainer alone in its bundles, resumable with `--load`, saving on the
live run's schedule) and the two batch sources it trains on:

* `DumpReplay` (`--load-debug-rollout-data`): step k trains the batch dump k holds
  (`rollout.generate.dump`), assembled as the live run assembles it. The trainer starts from
  the same weights (`--hf-checkpoint`, the seed's initialisation, or `--load`) and steps
  through the same batches, so with the original run's flags and seed every step is the
  original's bit for bit: its `loss/total` and `train/grad_norm` are compared with the ones
  the dump recorded and logged as `replay/matches` (1.0: identical; 0.0: a warning names the
  step). The replay ends at the first step without a dump.
* `SFTData` (`--loss-type sft_loss` without dumps): step k trains conversations of
  `--prompt-data` (`rollout.data.sft`), the assistant tokens only.

Nothing is generated, pushed or evaluated; metrics go to the run's logger as in a live run.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

from slime_async import startup
from slime_async.config.run_config import RunConfig
from slime_async.config.run_paths import batch_shape
from slime_async.contracts.batch import TrainerBatch
from slime_async.metrics import MetricsLogger
from slime_async.orchestrator.launch import place, record_config, run_logger, warm_started
from slime_async.orchestrator.resume import start_point
from slime_async.orchestrator.trainer_start import start_trainer
from slime_async.rollout.generate.assemble import assemble, overlong_shaping
from slime_async.rollout.generate.dump import (
    DumpError,
    batch_of,
    dump_path,
    read_dump,
    same_metrics,
)
from slime_async.trainer.actor import TrainerGroup

log = logging.getLogger(__name__)

REPLAY_CHECKED = ("loss/total", "train/grad_norm")
"""The metrics a replayed step must reproduce exactly (`replay/matches`)."""


class BatchSource(Protocol):
    """Where an offline run's batches come from."""

    def batch(self, step: int, *, version: int) -> tuple[TrainerBatch, dict[str, float]] | None:
        """Step `step`'s batch at trainer `version` and its metrics; None: no more steps."""
        ...

    def check(self, step: int, trained: dict[str, float]) -> dict[str, float]:
        """Metrics comparing step `step`'s train metrics with what the source expects."""
        ...


class DumpReplay:
    """`--load-debug-rollout-data PATH`: the batches of the dumps at PATH."""

    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.load_debug_rollout_data is not None
        self.spec, self.rollout = cfg.load_debug_rollout_data, cfg.rollout
        self._expected: dict[int, dict[str, float] | None] = {}

    def first(self, step: int) -> None:
        """Refuse before anything starts when the first step has no readable dump."""
        path = dump_path(self.spec, step)
        try:
            read_dump(path)
        except DumpError as e:
            raise DumpError(
                f"--load-debug-rollout-data {self.spec}: {e}; the replay starts at step {step} "
                f"and needs {path} (written by a run with --save-debug-rollout-data)"
            ) from None

    def batch(self, step: int, *, version: int) -> tuple[TrainerBatch, dict[str, float]] | None:
        path = dump_path(self.spec, step)
        if not path.exists():
            log.warning("no rollout dump for step %d (%s): the replay ends", step, path)
            return None
        body = read_dump(path)
        self._expected[step] = body["trained"]
        data = assemble(
            batch_of(body),
            estimator=self.rollout.advantage_estimator,
            overlong=overlong_shaping(self.rollout),
        )
        return data.batch, data.metrics

    def check(self, step: int, trained: dict[str, float]) -> dict[str, float]:
        want = self._expected.pop(step, None)
        if want is None:
            return {}
        if same_metrics(trained, want, REPLAY_CHECKED):
            return {"replay/matches": 1.0}
        log.warning(
            "replayed step %d differs from the dumped one: %s",
            step,
            ", ".join(f"{k} {trained.get(k)} vs {want.get(k)}" for k in REPLAY_CHECKED),
        )
        return {"replay/matches": 0.0}


class SFTSource:
    """`--loss-type sft_loss`: the conversations of `--prompt-data`."""

    def __init__(self, cfg: RunConfig) -> None:
        from transformers import AutoTokenizer

        from slime_async.rollout.data.sft import SFTData

        r, hf = cfg.rollout, cfg.trainer.hf_checkpoint
        if hf is None or r.prompt_data is None:
            raise ValueError("SFT needs --hf-checkpoint (its tokenizer) and --prompt-data")
        tok = AutoTokenizer.from_pretrained(hf)
        from slime_async.rollout.data.images import vision_data

        self.data = SFTData(
            r.prompt_data,
            tokenizer=tok,
            input_key=r.input_key,
            batch_size=r.global_batch_size,
            seed=cfg.rollout_seed,
            strict=r.strict_data,
            image_key=r.image_key,
            vision=vision_data(hf, tok) if r.image_key else None,
        )
        self.metrics = dict(self.data.metrics)

    def batch(self, step: int, *, version: int) -> tuple[TrainerBatch, dict[str, float]] | None:
        tb, metrics = self.data.batch(step, version=version)
        first, self.metrics = self.metrics, {}
        return tb, {**first, **metrics}

    def check(self, step: int, trained: dict[str, float]) -> dict[str, float]:
        return {}


def batch_source(cfg: RunConfig) -> DumpReplay | SFTSource:
    """The offline run's batches: the dumps when given, else SFT's conversations."""
    return DumpReplay(cfg) if cfg.load_debug_rollout_data is not None else SFTSource(cfg)


async def train_offline(cfg: RunConfig) -> dict[str, Any]:
    """Train `cfg.num_steps` steps (from the resumed step) on `batch_source(cfg)` without
    engines; returns the last step's metrics."""
    record_config(cfg)
    source = batch_source(cfg)
    logger = run_logger(cfg)
    placement = trainer = None
    try:
        trainer_cfg = await warm_started(cfg)
        placement = await place(cfg, engines=False)
        trainer = await start_trainer(cfg, trainer_cfg, placement)
        start = await asyncio.to_thread(start_point, cfg, trainer, load=trainer_cfg.load)
        if isinstance(source, DumpReplay):
            source.first(start.version)
        startup.done(f"training from step {start.version} without engines")
        return await _steps(cfg, trainer, source, logger, start=start.version)
    except BaseException:
        startup.abandon()
        raise
    finally:
        if trainer is not None:
            trainer.shutdown()
        if placement is not None:
            placement.remove()
        logger.close()


async def _steps(
    cfg: RunConfig, trainer: TrainerGroup, source: BatchSource, logger: MetricsLogger, *, start: int
) -> dict[str, Any]:
    """The offline step loop: batch, train, check, log, save on the live run's schedule."""
    last: dict[str, Any] = {}
    version = start
    saves = bool(cfg.trainer.save or cfg.trainer.save_hf)
    every = cfg.save_interval * cfg.rollout.num_steps_per_rollout
    for step in range(start, cfg.num_steps):
        got = await asyncio.to_thread(source.batch, step, version=version)
        if got is None:
            break
        batch, metrics = got
        trained = await asyncio.to_thread(trainer.train_step, batch)
        if trained.version != version + 1:
            raise RuntimeError(
                f"the trainer's train step returned version {trained.version}, expected "
                f"{version + 1}"
            )
        version = trained.version
        last = {**trained.metrics, **metrics, **source.check(step, trained.metrics)}
        logger.log(version, last)
        if saves and every and version % every == 0:
            await _save(cfg, trainer, version)
    if saves and version > start:
        await _save(cfg, trainer, version)
    return last


async def _save(cfg: RunConfig, trainer: TrainerGroup, version: int) -> None:
    """The checkpoint (--save; no data-worker state: an offline run has none) and the HF
    directory (--save-hf) of `version`."""
    if cfg.trainer.save:
        state = {"step": version, "worker": None, "batch_shape": batch_shape(cfg)}
        path = await asyncio.to_thread(trainer.save_checkpoint, None, extra_state=state)
        log.info("checkpoint saved: %s", path)
    if cfg.trainer.save_hf:
        path = Path(await asyncio.to_thread(trainer.save_hf, None))
        log.info("HF model v%d saved: %s", version, path)
