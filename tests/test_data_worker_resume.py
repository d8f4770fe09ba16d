"""Exact resume: a worker restored from `state_dict()` loses no prompt and duplicates none."""

from __future__ import annotations

import asyncio
import json

import pytest

from data_worker import (
    PROBE_PRIORITY,
    DataWorkerConfig,
    InMemoryPromptSource,
    Prompt,
    RolloutDataWorker,
)
from data_worker.testing import SimulatedEngine
from data_worker.virtual_loop import run_virtual

pytestmark = pytest.mark.timeout(60)

N_PROMPTS, EPOCHS = 24, 2


def _source() -> InMemoryPromptSource:
    return InMemoryPromptSource(
        [
            {"prompt_ids": [i, i + 1], "key": f"p{i}", "payload": {"label": i}}
            for i in range(N_PROMPTS)
        ],
        num_epochs=EPOCHS,
        shuffle=True,
        seed=3,
    )


def _cfg() -> DataWorkerConfig:
    return DataWorkerConfig(
        n_samples_per_prompt=2, groups_per_step=3, max_staleness=2, fifo_window=4, max_inflight=5
    )


def _engine() -> SimulatedEngine:
    return SimulatedEngine(length_fn=lambda p, i: 5 + 13 * (int(p.key[1:]) % 5) + 3 * i, chunk=4)


def test_resume_from_a_mid_flight_checkpoint_is_exact() -> None:
    eng_a = _engine()
    a = RolloutDataWorker(_cfg(), _source(), eng_a.generate, abort_fn=eng_a.abort_all)
    before: list[tuple[str, int]] = []
    saved: dict = {}

    async def run_a() -> None:
        await a.start()
        for k in range(4):
            batch = await a.get_batch(3, k)
            before.extend((g.prompt.key, g.prompt.epoch) for g in batch.groups)
            eng_a.set_version(k + 1)
            a.set_served_version(k + 1)
        # leave some groups staged (taken from the window but not yet returned)
        with pytest.raises(TimeoutError):
            await a.get_batch(30, 4, timeout=0.2)
        eng_a.set_version(6)
        a.set_served_version(6)  # budget re-opens: new generations start
        await asyncio.sleep(0.002)
        assert len(a._core.staged) > 0 and a.metrics()["data/inflight"] > 0
        saved.update(json.loads(json.dumps(a.state_dict())))  # JSON only: no pickle
        # work after the checkpoint is lost in the "crash"
        await a.get_batch(1, 4)
        await a.stop()

    run_virtual(run_a())
    pending_seqs = {e["seq"] for e in saved["pending"]}
    assert pending_seqs and saved["next_seq"] > max(pending_seqs)

    eng_b = _engine()
    b = RolloutDataWorker(_cfg(), _source(), eng_b.generate)
    b.load_state_dict(saved)
    assert b.accounting().pending == len(pending_seqs) and b.accounting().balanced
    after: list[tuple[str, int]] = []
    seqs_b: list[int] = []

    async def run_b() -> None:
        await b.start()
        k = b.served_version  # the checkpoint's version (6)
        while True:
            batch = await b.get_batch(3, k)
            after.extend((g.prompt.key, g.prompt.epoch) for g in batch.groups)
            seqs_b.extend(g.seq for g in batch.groups)
            k += 1
            eng_b.set_version(k)
            b.set_served_version(k)
            if batch.end_of_data:
                break
        await b.stop()

    run_virtual(run_b())
    everything = before + after
    assert len(everything) == len(set(everything)) == N_PROMPTS * EPOCHS
    assert set(everything) == {(f"p{i}", e) for i in range(N_PROMPTS) for e in range(EPOCHS)}
    # re-issued groups keep their sequence numbers; new ones continue after next_seq
    assert all(s in pending_seqs or s >= saved["next_seq"] for s in seqs_b)
    acc = b.accounting()
    assert acc.balanced and acc.pending == 0 and acc.dispatched == N_PROMPTS * EPOCHS
    # the length cache survived: prompts measured by worker A are not probed again by B
    known = set(saved["length_cache"])
    probed = {c.key for c in eng_b.calls if c.priority == PROBE_PRIORITY and c.attempt == 0}
    assert known and not (probed & known)


def test_state_dict_rejects_non_json_payloads_and_foreign_state() -> None:
    eng = _engine()
    src = InMemoryPromptSource([Prompt(key="x", prompt_ids=[1], payload={"obj": object()})])
    w = RolloutDataWorker(_cfg(), src, eng.generate)

    async def main() -> None:
        await w.start()
        await asyncio.sleep(0)
        with pytest.raises(TypeError, match="JSON-serialisable"):
            w.state_dict()
        await w.stop()

    run_virtual(main())
    fresh = RolloutDataWorker(_cfg(), _source(), eng.generate)
    with pytest.raises(ValueError, match="not a data-worker state"):
        fresh.load_state_dict({"format": "something else"})
