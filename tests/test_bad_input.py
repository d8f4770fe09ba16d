"""Bad input on the rollout path: rewards that return NaN, non-finite engine log-probs.

Each case runs the real pieces (data worker, HTTP generate client, scoring, batch assembly)
and asserts both the masking and the counters; nothing is lost (every sample is still in the
batch, only excluded from the loss).
"""

from __future__ import annotations

import math

import pytest
from aiohttp import web

from data_worker.config import DataWorkerConfig
from data_worker.source import InMemoryPromptSource
from data_worker.worker import RolloutDataWorker
from slime_async.rollout.data.rewards import RewardInput
from slime_async.rollout.generate.assemble import ScoredGenerate, assemble
from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig

pytestmark = pytest.mark.timeout(120)


async def _one_batch(url: str, reward_fn, *, groups: int = 2, n: int = 4):
    client = GenerateClient(GenerateClientConfig(url=url, max_response_len=6))
    scored = ScoredGenerate(client, reward_fn, eos_id=2)
    prompts = [
        {"prompt_ids": [1, 5 + i, 9, 3], "key": f"p{i}", "payload": {"label": [7]}}
        for i in range(groups)
    ]
    cfg = DataWorkerConfig(
        n_samples_per_prompt=n,
        groups_per_step=groups,
        max_staleness=0,
        fifo_window=groups,
        default_expected_len=6,
    )
    worker = RolloutDataWorker(cfg, InMemoryPromptSource(prompts), scored)
    await worker.start()
    try:
        batch = await worker.get_batch(groups, current_version=0, timeout=60)
    finally:
        await worker.stop()
        await client.close()
    return batch, scored, client


@pytest.fixture
async def engine_url():
    from slime_async.engine import EngineConfig, EngineServer

    srv = EngineServer(EngineConfig(dtype="fp32", seed=1, weight_version="0"))
    url = srv.start()
    yield url
    srv.stop()


async def test_reward_that_returns_nan_masks_the_sample_and_is_counted(engine_url):
    """NaN is masked and counted; a reward that raises is an error instead (the sample is
    retried, then the run stops naming the function: tests/test_rollout_plugins.py)."""
    calls = {"n": 0}

    def flaky(inp: RewardInput) -> float:
        calls["n"] += 1
        return math.nan if calls["n"] % 2 == 0 else 1.0

    batch, scored, _ = await _one_batch(engine_url, flaky)
    data = assemble(batch, estimator="grpo")
    n = sum(len(g.samples) for g in batch.groups)
    assert n == 8 and scored.reward_failures == 4  # 4 NaN, none lost
    assert data.metrics["rollout/reward_masked"] == 4.0
    bad = [
        i
        for i, (g, s) in enumerate((g, s) for g in batch.groups for s in g.samples)
        if s.payload["reward_status"] != "ok"
    ]
    assert len(bad) == 4
    for i in range(n):
        assert bool(data.batch.loss_mask[i].any()) == (i not in bad)
    assert data.metrics["rollout/reward"] == 1.0  # the mean over samples that have a reward


async def test_non_finite_engine_logprobs_mask_those_tokens_and_are_counted(unused_tcp_port):
    """An engine answering NaN / inf / null log-probs for some tokens (real HTTP server)."""
    bad_values = [None, "NaN", "Infinity"]

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        lp = [-0.5, bad_values[len(body["input_ids"]) % 3], -0.25, -1.0]
        ids = [7, 8, 9, 2]
        entries = ",".join(
            f"[{'null' if v is None else v}, {t}, null]" for v, t in zip(lp, ids, strict=True)
        )
        text = (
            '{"text": "", "output_ids": [7, 8, 9, 2], "meta_info": {"finish_reason": '
            '{"type": "stop", "matched": 2}, "weight_version": "0", '
            f'"output_token_logprobs": [{entries}]}}}}'
        )
        return web.Response(text=text, content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    try:
        batch, _, client = await _one_batch(f"http://127.0.0.1:{unused_tcp_port}", lambda inp: 1.0)
    finally:
        await runner.cleanup()
    data = assemble(batch, estimator="grpo")
    n = sum(len(g.samples) for g in batch.groups)
    assert client.nonfinite_logprobs == n  # one bad token per sample
    assert data.metrics["rollout/nonfinite_logprobs"] == float(n)
    tb = data.batch
    assert int(tb.loss_mask.sum()) == 3 * n  # 4 response tokens each, the bad one masked
    assert bool((tb.rollout_logprobs[tb.loss_mask]).isfinite().all())
    assert not bool(tb.loss_mask[:, 4 + 1].any())  # response token 1 (column 5) is the bad one


def test_engine_without_a_numeric_weight_version_is_a_clear_error():
    from slime_async.rollout.generate.client import GenerateError, token_versions

    assert token_versions(
        {"weight_version": "3", "weight_versions": [{"version": "2", "start": 0, "end": 2}]}, 4
    ) == [2, 2, 3, 3]
    with pytest.raises(GenerateError, match="--weight-version 0"):
        token_versions({"weight_version": "default"}, 2)
