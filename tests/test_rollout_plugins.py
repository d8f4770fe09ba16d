"""Rollout plugins a slime user brings, on our real engine over HTTP with the real data worker:
reward functions with slime's signature (`async def rm(args, sample)`, `--group-rm`), a reward
that raises (a clear error, not a masked sample), custom generation with our contract (the
calculator example: tool tokens never reach the loss; a partial rollout across a weight update
keeps each token's version) and with slime's contract (`append_response_tokens`)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import aiohttp
import pytest
import torch

from data_worker.config import DataWorkerConfig
from data_worker.source import InMemoryPromptSource
from data_worker.worker import RolloutDataWorker
from loss import CompISConfig, compis_loss
from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.testing import post
from slime_async.examples import calculator_tool as calc
from slime_async.rollout.agents.custom_generate import CustomGenerate, slime_args
from slime_async.rollout.data.sources import task_prompt
from slime_async.rollout.data.tasks import EOS, TaskFamily, TaskFamilyConfig, TaskKind, make_prompt
from slime_async.rollout.generate.assemble import ScoredGenerate, assemble
from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig
from slime_async.trainer.loss_inputs import loss_inputs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def engine():
    torch.set_num_threads(1)
    srv = EngineServer(EngineConfig(dtype="fp32", seed=1, weight_version="0"))
    url = srv.start()
    yield url, srv
    srv.stop()


def _prompts(n: int) -> list:
    fam = TaskFamily(TaskFamilyConfig(seed=0))
    return [task_prompt(fam.train_prompt(i), index=i) for i in range(n)]


async def _batch(url, reward_fn, *, groups=2, n=4, custom=None, group_rm=False, abort=False):
    client = GenerateClient(
        GenerateClientConfig(url=url, max_response_len=40, stop_token_ids=(EOS,)),
        num_layers=2,
        topk=2,
    )
    args = slime_args(url, n_samples_per_prompt=n, group_rm=group_rm)
    gen = CustomGenerate(custom, client, eos_id=EOS, args=args) if custom else client
    scored = ScoredGenerate(gen, reward_fn, eos_id=EOS, reward_args=args, group_rm=group_rm)
    cfg = DataWorkerConfig(
        n_samples_per_prompt=n,
        groups_per_step=groups,
        max_staleness=0,
        fifo_window=groups,
        default_expected_len=8,
    )

    async def abort_all() -> None:
        async with aiohttp.ClientSession() as s:
            await post(s, url + "/pause_generation", {"mode": "abort"})

    worker = RolloutDataWorker(
        cfg, InMemoryPromptSource(_prompts(groups)), scored, abort_fn=abort_all if abort else None
    )
    await worker.start()
    try:
        batch = await worker.get_batch(groups, current_version=0, timeout=60)
        batch = await scored.score_groups(batch)
    finally:
        await worker.stop()
        await client.close()
    return batch, scored


async def test_slime_style_reward_gets_args_and_a_slime_sample(engine):
    url, _ = engine
    seen = []

    async def rm(args, sample, **kwargs):
        seen.append(
            (
                args.sglang_router_port,
                args.n_samples_per_prompt,
                sample.status.value,
                sample.response_length,
                len(sample.tokens),
                sample.label,
            )
        )
        return float(sample.response_length % 2)

    batch, _ = await _batch(url, rm)
    samples = [s for g in batch.groups for s in g.samples]
    assert len(seen) == len(samples) == 8
    port = int(url.rsplit(":", 1)[1])
    for s in samples:
        assert s.payload["reward"] == float(len(s.output_ids) % 2)
    for got_port, n, status, rlen, ntok, label in seen:
        assert (got_port, n) == (port, 4) and status in ("completed", "truncated")
        assert ntok > rlen > 0 and label is not None


async def test_group_rm_scores_each_group_once(engine):
    url, _ = engine
    calls = []

    async def rm(args, samples, **kwargs):
        calls.append(len(samples))
        return [float(i) for i in range(len(samples))]

    batch, _ = await _batch(url, rm, group_rm=True)
    assert calls == [4, 4]
    for g in batch.groups:
        assert [s.payload["reward"] for s in g.samples] == [0.0, 1.0, 2.0, 3.0]
    data = assemble(batch, estimator="grpo")
    assert data.metrics["rollout/reward"] == 1.5
    # slime's --disable-rewards-normalization: the raw rewards are the advantages; with
    # --normalize-advantages they are whitened over the batch's trained tokens
    tb = assemble(batch, estimator="grpo", normalize_rewards=False).batch
    for i, s in enumerate(s for g in batch.groups for s in g.samples):
        assert set(tb.advantages[i][tb.loss_mask[i]].tolist()) == {s.payload["reward"]}
    white = assemble(batch, estimator="grpo", normalize_rewards=False, whiten=True).batch
    vals = white.advantages[white.loss_mask]
    assert abs(float(vals.mean())) < 1e-5 and abs(float(vals.std()) - 1.0) < 1e-4


async def test_a_reward_that_raises_stops_the_run_naming_function_and_sample(engine):
    url, _ = engine

    async def broken_rm(args, sample, **kwargs):
        raise KeyError("label_field")

    with pytest.raises(RuntimeError) as err:
        await _batch(url, broken_rm)
    msg = str(err.value)
    assert "broken_rm" in msg and "KeyError" in msg and "sample" in msg and "prompt" in msg


async def test_a_batch_with_only_non_finite_rewards_is_a_clear_error(engine):
    """Not the trainer's `global_num_tokens=0.0 must be > 0` later."""
    url, _ = engine
    batch, scored = await _batch(url, lambda inp: math.nan)
    assert scored.reward_failures == 8
    with pytest.raises(ValueError, match="8 of 8 samples have a non-finite reward"):
        assemble(batch, estimator="grpo")


async def test_calculator_tool_tokens_never_enter_the_loss(engine):
    url, _ = engine
    batch, _ = await _batch(url, calc.reward, custom=calc.generate)
    data = assemble(batch, estimator="grpo")
    tb = data.batch
    rows = [(g, s) for g in batch.groups for s in g.samples]
    n_tool = 0
    for i, (g, s) in enumerate(rows):
        p = len(g.prompt.prompt_ids)
        mask = [m for p_ in s.payloads for m in p_["loss_mask"]]
        tool = [j for j, m in enumerate(mask) if m == 0]
        n_tool += len(tool)
        assert tool and s.output_ids[tool[0]] == calc.TOOL  # every episode called the tool
        assert not tb.loss_mask[i, [p + j for j in tool]].any()
        assert tb.loss_mask[i, p : p + len(mask)].sum() == len(mask) - len(tool)
    assert data.metrics["rollout/tool_tokens"] == n_tool
    # through the loss: zero loss and zero gradient at every tool position
    lp = tb.rollout_logprobs.clone().requires_grad_()
    inp = loss_inputs(tb, lp, tb.rollout_logprobs, None, version=0)
    inp = dataclasses.replace(inp, advantages=torch.ones_like(inp.advantages))
    compis_loss(inp, CompISConfig()).loss.backward()
    tool_pos = ~tb.loss_mask & (torch.arange(tb.tokens.shape[1]) >= 1)
    assert float(lp.grad[tool_pos].abs().sum()) == 0.0 and float(lp.grad.abs().sum()) > 0


@pytest.mark.parametrize("custom", [None, calc.generate], ids=["client", "custom"])
async def test_every_segment_payload_is_a_segment_payload(engine, custom):
    """What the client and custom generation write, and scoring adds, is `SegmentPayload`:
    its required keys on every segment, nothing it does not name, the reward on the last."""
    from slime_async.contracts.rollout import SegmentPayload

    url, _ = engine
    batch, _ = await _batch(url, calc.reward, groups=1, n=2, custom=custom)
    allowed = SegmentPayload.__required_keys__ | SegmentPayload.__optional_keys__
    for s in (s for g in batch.groups for s in g.samples):
        for p in s.payloads:
            assert SegmentPayload.__required_keys__ <= p.keys() <= allowed, sorted(p)
        assert {"reward", "reward_status"} <= s.payload.keys()
        assert ("loss_mask" in s.payload) == (custom is not None)


def test_calculator_reward_reads_the_last_turn():
    p = make_prompt(TaskKind.REVERSE, "417", level=0)
    tool = calc.calculator(TaskKind.REVERSE, [14, 11, 17, EOS])
    resp = [14, 11, 17, EOS, *tool, *p.label_ids, EOS]
    mask = [1] * 4 + [0] * len(tool) + [1] * 4
    from slime_async.rollout.data.rewards import RewardInput

    ok = RewardInput(response_ids=resp, label=list(p.label_ids), loss_mask=mask)
    assert calc.reward(ok) == 1.0
    assert calc.reward(dataclasses.replace(ok, loss_mask=[1] * len(resp))) == 0.0  # no tool call
    goes_on = [*resp[:-1], 14, EOS]  # the answer, then one more digit
    assert calc.reward(dataclasses.replace(ok, response_ids=goes_on, loss_mask=[*mask, 1])) == 0.5
    wrong = [*resp[:-4], 11, 17, 14, EOS]
    assert calc.reward(dataclasses.replace(ok, response_ids=wrong)) == 0.0


async def test_partial_rollout_across_a_weight_update_keeps_per_token_versions(engine):
    """Turn 1 and the tool at version 0; the sample is aborted while turn 2 waits in the engine
    (the data worker's pause for a weight update); the engine moves to version 1; the data
    worker continues the sample from its prefix and turn 2 runs at version 1."""
    url, _ = engine
    tool_done, gate = asyncio.Event(), asyncio.Event()

    async def gated(ctx):
        turn = ctx.model_turn

        async def model_turn(**kw):
            if len(ctx.trajectory.turn_lengths()) == 2 and not gate.is_set():
                tool_done.set()  # turn 1 and the tool are done: hold turn 2 until released
                await gate.wait()
            return await turn(**kw)

        ctx.model_turn = model_turn
        await calc.generate(ctx)

    async def load() -> int:
        async with aiohttp.ClientSession() as s, s.get(url + "/get_load") as r:
            return int((await r.json())[0]["num_waiting_reqs"])

    async def scenario():
        async with aiohttp.ClientSession() as s:
            await tool_done.wait()
            await post(s, url + "/pause_generation", {"mode": "in_place"})
            gate.set()
            for _ in range(600):  # until turn 2's request waits in the paused engine
                if await load() >= 1:
                    break
                await asyncio.sleep(0.05)
            else:
                raise TimeoutError("turn 2 never reached the engine")
            await worker.pause()  # aborts it: the sample returns ABORTED with its prefix
            await post(s, url + "/update_weight_version", {"new_version": "1"})
            await post(s, url + "/continue_generation", {})
            worker.set_served_version(1)
            await worker.resume()

    client = GenerateClient(
        GenerateClientConfig(url=url, max_response_len=40, stop_token_ids=(EOS,)),
        num_layers=2,
        topk=2,
    )
    scored = ScoredGenerate(CustomGenerate(gated, client, eos_id=EOS), calc.reward, eos_id=EOS)

    async def abort_all() -> None:
        async with aiohttp.ClientSession() as s:
            await post(s, url + "/pause_generation", {"mode": "abort"})

    cfg = DataWorkerConfig(
        n_samples_per_prompt=1,
        groups_per_step=1,
        max_staleness=1,
        fifo_window=1,
        default_expected_len=8,
    )
    worker = RolloutDataWorker(cfg, InMemoryPromptSource(_prompts(1)), scored, abort_fn=abort_all)
    await worker.start()
    try:
        get = asyncio.create_task(worker.get_batch(1, current_version=1, timeout=60))
        await scenario()  # its errors surface here, not as a hang
        batch = await get
    finally:
        await worker.stop()
        await client.close()
    (s,) = batch.groups[0].samples
    mask = [m for p in s.payloads for m in p["loss_mask"]]
    versions = list(s.token_versions)
    runs = []
    for m, v in zip(mask, versions, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].add(v)
        else:
            runs.append((m, {v}))
    assert len(s.payloads) >= 2 and s.payloads[0]["finish"] == "abort"  # continued, not redone
    assert [(m, sorted(v)) for m, v in runs] == [(1, [0]), (0, [0]), (1, [1])]
    assert batch.groups[0].min_version == 0


async def test_slime_style_custom_generate_records_versions_through_append_response_tokens(engine):
    url, _ = engine

    async def slime_generate(args, sample, sampling_params):
        endpoint = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
        async with aiohttp.ClientSession() as s:
            for turn in range(2):
                body = {
                    "input_ids": sample.tokens,
                    "return_logprob": True,
                    "sampling_params": {**sampling_params, "max_new_tokens": 4},
                }
                async with s.post(endpoint, json=body) as r:
                    out = await r.json()
                lp = out["meta_info"]["output_token_logprobs"]
                sample.append_response_tokens(
                    args,
                    tokens=[x[1] for x in lp],
                    log_probs=[x[0] for x in lp],
                    meta_info=out["meta_info"],
                )
                if turn == 0:
                    sample.append_response_tokens(args, tokens=[9, 4, 3], trainable=False)
        return sample

    batch, _ = await _batch(url, lambda inp: 1.0, custom=slime_generate)
    for g in batch.groups:
        for s in g.samples:
            mask = [m for p in s.payloads for m in p["loss_mask"]]
            assert mask[-7:-4] == [0, 0, 0] and sum(mask) == len(mask) - 3
            assert set(s.token_versions) == {0}

    async def careless(args, sample, sampling_params):
        sample.tokens = [*sample.tokens, 5, 6]
        sample.response_length, sample.loss_mask, sample.rollout_log_probs = 2, [1, 1], [0.0, 0.0]
        return sample

    with pytest.raises(RuntimeError, match="append_response_tokens"):
        await _batch(url, lambda inp: 1.0, custom=careless)
