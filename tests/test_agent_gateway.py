"""The training gateway and agent rollouts, against the router in front of real embedded
engines: a 3-turn episode written with the `openai` client is trained on exactly the sampled
tokens (with their log-probs and versions) across weight pushes in the middle of turns 2 and 3;
pinned sampling; a raising or hanging agent fails only its episode; prefix mismatches are
counted and the sampled ids kept."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

from router import Router, RouterClient, RouterConfig
from slime_async.contracts.rollout import GenerationRequest, Prompt
from slime_async.rollout.agents.agent import AgentGenerate
from slime_async.rollout.agents.episode import Episode, Turn
from slime_async.rollout.agents.gateway import TrainingGateway
from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig

openai = pytest.importorskip("openai")
engine_mod = pytest.importorskip("slime_async.engine")
pytestmark = pytest.mark.timeout(300)
TOKEN = "gw-token"
EOS = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from slime_async.engine.testing import chat_model_dir

    return chat_model_dir(str(tmp_path_factory.mktemp("gw") / "m"), mute_eos=True)


@pytest.fixture(scope="module")
def engines(model_dir):
    torch.set_num_threads(1)
    cfg = engine_mod.EngineConfig(
        num_threads=1, model_dir=model_dir, dtype="fp32", api_key=TOKEN, weight_version="0"
    )
    servers = [engine_mod.EngineServer(cfg) for _ in range(2)]
    try:
        yield [s.start() for s in servers]
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture()
async def stack(engines, tok):
    router = Router(RouterConfig(worker_urls=tuple(engines), health_interval_s=0.2, api_key=TOKEN))
    url = await router.start()
    for _ in range(200):
        if len(router.registry.healthy()) == 2:
            break
        await asyncio.sleep(0.05)
    client = GenerateClient(
        GenerateClientConfig(
            url=url,
            max_response_len=1000,
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=(EOS,),
            api_key=TOKEN,
        )
    )
    gw = TrainingGateway(tokenizer=tok, eos_id=EOS, api_key=TOKEN)
    try:
        yield url, router, client, gw
    finally:
        await gw.stop()
        await client.close()
        await router.stop()


def _request(tok, i: int = 0, question: str = "add 2 and 3") -> GenerationRequest:
    msgs = [{"role": "user", "content": question}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    return GenerationRequest(
        prompt=Prompt(
            key=f"q{i}", prompt_ids=ids, payload={"label": "5", "metadata": {"messages": msgs}}
        ),
        group_seq=0,
        sample_index=i,
    )


def _check_exact(model_dir: str, req: GenerationRequest, ep: Episode, res) -> None:
    """The trajectory is the first prompt, then each turn's sampled ids, with the new prompt
    tokens between them; a teacher-forced forward of it reproduces every sampled log-prob
    (the context the trainer sees is the one each token was sampled in)."""
    from slime_async.engine.config import EngineConfig
    from slime_async.engine.model import load_model, teacher_forced

    full = [*req.prompt.prompt_ids, *res.output_ids]
    assert full == ep.ids
    mask = res.payload["loss_mask"]
    assert (
        len(mask) == len(res.output_ids) == len(res.token_versions) == len(res.payload["logprobs"])
    )
    pos = 0
    model_positions: list[int] = []
    for t in ep.turns:
        assert full[: len(t.prompt_ids)] == t.prompt_ids  # each prompt extends what was sampled
        start = len(t.prompt_ids)
        assert full[start : start + len(t.output_ids)] == t.output_ids
        model_positions += range(start, start + len(t.output_ids))
        pos = start + len(t.output_ids)
    assert pos == len(full)
    p = len(req.prompt.prompt_ids)
    assert [i + p for i, m in enumerate(mask) if m] == model_positions
    sampled_lp = [lp for t in ep.turns for lp in t.logprobs]
    assert [res.payload["logprobs"][i - p] for i in model_positions] == sampled_lp
    assert [res.token_versions[i - p] for i in model_positions] == [
        v for t in ep.turns for v in t.versions
    ]
    ref, _ = teacher_forced(load_model(EngineConfig(dtype="fp32", model_dir=model_dir)), full)
    got = torch.tensor(sampled_lp)
    want = ref[torch.tensor(model_positions) - 1]
    assert (got - want).abs().max() < 1e-3, (got - want).abs().max()


async def _wait_tokens(url: str, at_least: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        for _ in range(3000):
            for u in url:
                async with s.get(u + "/server_info") as r:
                    if (await r.json())["internal_states"][0]["num_tokens"] >= at_least:
                        return
            await asyncio.sleep(0.005)
    raise AssertionError("the turn did not progress")


async def test_three_turn_episode_is_exact_across_weight_pushes(
    stack, engines, tok, model_dir
) -> None:
    url, router, client, gw = stack
    turn_sent = [threading.Event() for _ in range(3)]
    seen: list[dict] = []

    def agent(c: openai.OpenAI, sample) -> float:
        msgs = list(sample.messages)
        for k in range(3):
            turn_sent[k].set()
            r = c.chat.completions.create(model="m", messages=msgs, temperature=0.3, max_tokens=7)
            seen.append(r.model_extra["meta_info"])
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            if k < 2:
                msgs.append({"role": "user", "content": f"the tool says {k + 40}"})
        return 1.0

    gen = AgentGenerate(agent, client, gw, timeout_s=120, decode=tok.decode, max_turn_tokens=120)
    req = _request(tok)
    task = asyncio.ensure_future(gen.episode(req))
    async with RouterClient(url, token=TOKEN) as rc:
        await asyncio.to_thread(turn_sent[1].wait)  # turn 2 sent: push in place mid-turn
        ep = next(iter(gw.episodes.values()))
        await _wait_tokens(engines, len(ep.ids) + 60)
        async with rc.paused(mode="in_place"):
            await rc.update_weight_version(1)
        await asyncio.to_thread(turn_sent[2].wait)  # turn 3: a push that aborts the turn
        await _wait_tokens(engines, len(ep.ids) + 60)
        await rc.fan_out("/update_weight_version", {"new_version": "2", "abort_all_requests": True})
        ep, ret = await task
    res = ep.trajectory()
    assert ret == 1.0 and len(ep.turns) == 3
    assert [len(t.output_ids) for t in ep.turns] == [120, 120, 120]  # pinned 120, not 7
    assert gw.stats.sampling_overrides == 3 and gw.stats.prefix_mismatches == 0
    assert gw.stats.resumed_turns >= 1  # the aborted turn 3 was continued
    v = [t.versions for t in ep.turns]
    assert set(v[0]) == {0}
    assert v[1][0] == 0 and v[1][-1] == 1 and v[1] == sorted(v[1])  # v0 then v1 inside turn 2
    assert v[2][0] == 1 and v[2][-1] == 2 and v[2] == sorted(v[2])
    assert [m["output_ids"] for m in seen] == [t.output_ids for t in ep.turns]
    # every turn of the episode went to one engine (session affinity)
    assert router.proxy.affinity.affine == router.proxy.affinity.session_requests >= 4
    _check_exact(model_dir, req, ep, res)
    await RouterClient(url, token=TOKEN).update_weight_version(0)


async def test_prefix_mismatch_is_counted_and_sampled_ids_kept(stack, tok, model_dir) -> None:
    _, _, client, gw = stack

    def agent(c: openai.OpenAI, sample) -> None:
        msgs = list(sample.messages)
        r = c.chat.completions.create(model="m", messages=msgs)
        edited = "(edited by the agent) " + r.choices[0].message.content
        msgs += [{"role": "assistant", "content": edited}, {"role": "user", "content": "go on"}]
        r2 = c.chat.completions.create(model="m", messages=msgs)
        assert r2.model_extra["meta_info"]["prefix_mismatch"] is True

    gen = AgentGenerate(agent, client, gw, timeout_s=120, decode=tok.decode, max_turn_tokens=16)
    req = _request(tok, question="hello")
    ep, _ = await gen.episode(req)
    res = ep.trajectory()
    assert gw.stats.prefix_mismatches == 1 and ep.prefix_mismatches == 1
    text = tok.decode(res.output_ids, skip_special_tokens=False)
    assert "edited by the agent" not in text  # never trained on the re-serialised text
    assert "go on" in text
    _check_exact(model_dir, req, ep, res)


async def test_a_raising_or_hanging_agent_fails_only_its_episode(stack, tok) -> None:
    _, _, client, gw = stack
    release = threading.Event()

    def agent(c: openai.OpenAI, sample) -> dict:
        if sample.index == 1:
            raise RuntimeError("the agent's tool crashed")
        if sample.index == 2:
            c.chat.completions.create(model="m", messages=list(sample.messages))
            release.wait(60)  # hangs past the timeout
            c.chat.completions.create(model="m", messages=list(sample.messages))
        c.chat.completions.create(model="m", messages=list(sample.messages))
        httpx.post(
            sample.reward_url, json={"reward": 0.25}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        return {"reward": 1.0}  # the posted reward wins

    gen = AgentGenerate(agent, client, gw, timeout_s=10, decode=tok.decode, max_turn_tokens=8)
    results = await asyncio.gather(*(gen(_request(tok, i), 0.0, 8) for i in range(4)))
    release.set()
    ok = [results[0], results[3]]
    for r in ok:
        assert r.payload["reward"] == 0.25 and r.payload["reward_status"] == "ok"
        assert sum(r.payload["loss_mask"]) == 8
    for r in (results[1], results[2]):
        assert r.payload["reward_status"] == "agent_failed" and not r.output_ids
    assert (gen.stats.finished, gen.stats.failed, gen.stats.timed_out) == (2, 1, 1)
    assert not gw.episodes  # every episode closed


async def test_an_engine_refusal_reaches_the_agent_as_its_4xx(stack) -> None:
    """A message that renders to ids outside the vocabulary: the engine's 400 is the agent's
    400 with the engine's reason, counted as a bad call (it was a 500 and a traceback); an
    engine that cannot be reached is a 503, not counted."""
    import aiohttp

    from slime_async.contracts.chat import IdText
    from slime_async.host import free_port

    _, _, client, _ = stack
    gw = TrainingGateway(tokenizer=IdText(), eos_id=EOS)  # message text is token ids
    await gw.start()
    gone = GenerateClient(
        GenerateClientConfig(
            url=f"http://127.0.0.1:{free_port()}", max_connection_retries=0, api_key=TOKEN
        )
    )
    body = {"messages": [{"role": "user", "content": "5 7 99999999"}]}
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {gw.api_key}"}) as s:
            ep = gw.open_episode(client)
            async with s.post(gw.episode_url(ep) + "/chat/completions", json=body) as r:
                assert r.status == 400, await r.text()
                msg = (await r.json())["error"]["message"]
            assert "the engine refused this turn" in msg and "99999999" in msg, msg
            assert gw.stats.bad_calls == 1
            body["messages"][0]["content"] = "5 7"
            ep = gw.open_episode(gone)
            async with s.post(gw.episode_url(ep) + "/chat/completions", json=body) as r:
                assert r.status == 503, await r.text()
            assert gw.stats.bad_calls == 1
    finally:
        await gone.close()
        await gw.stop()


def test_think_blocks_stripped_by_the_template_are_a_counted_mismatch() -> None:
    """The Qwen-style template drops an earlier turn's <think> block: the next prompt keeps the
    sampled ids, then the template's tokens after that turn (no engine needed)."""
    from slime_async.contracts.chat import normalize_messages
    from slime_async.engine.testing import QWEN_STYLE_TEMPLATE, ascii_chat_tokenizer

    tk = ascii_chat_tokenizer(QWEN_STYLE_TEMPLATE)
    gw = TrainingGateway(tokenizer=tk, eos_id=EOS)
    client = GenerateClient(GenerateClientConfig(url="http://127.0.0.1:9"))
    msgs = normalize_messages([{"role": "user", "content": "q"}])
    ep = gw.open_episode(client)
    prompt, mismatch = gw._prompt(ep, msgs, None)
    assert not mismatch
    sampled = [*tk.encode("<think>let me see</think>\nfour"), EOS]
    ep.ids = prompt + sampled
    ep.turns.append(
        Turn(
            prompt_ids=prompt,
            output_ids=sampled,
            logprobs=[],
            versions=[],
            finish="stop",
            prefix_mismatch=False,
        )
    )
    follow = msgs + normalize_messages(
        [
            {"role": "assistant", "content": "<think>let me see</think>\nfour"},
            {"role": "user", "content": "why"},
        ]
    )
    prompt2, mismatch2 = gw._prompt(ep, follow, None)
    assert mismatch2 and gw.stats.prefix_mismatches == 1
    assert prompt2[: len(ep.ids)] == ep.ids
    assert tk.decode(prompt2[len(ep.ids) :], skip_special_tokens=False) == (
        "\n<|im_start|>user\nwhy<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_gateway_renders_with_the_runs_chat_template_kwargs() -> None:
    """--apply-chat-template-kwargs: the gateway renders an episode's conversation as the data
    prompts were rendered (else the first turn would not begin with the data prompt)."""
    from slime_async.contracts.chat import normalize_messages
    from slime_async.engine.testing import THINKING_SWITCH_TEMPLATE, ascii_chat_tokenizer

    tk = ascii_chat_tokenizer(THINKING_SWITCH_TEMPLATE)
    msgs = normalize_messages([{"role": "user", "content": "q"}])
    client = GenerateClient(GenerateClientConfig(url="http://127.0.0.1:9"))
    plain = TrainingGateway(tokenizer=tk, eos_id=EOS)
    off = TrainingGateway(tokenizer=tk, eos_id=EOS, template_kwargs={"enable_thinking": False})
    p_plain, _ = plain._prompt(plain.open_episode(client), msgs, None)
    p_off, _ = off._prompt(off.open_episode(client), msgs, None)
    assert tk.decode(p_off[len(p_plain) :]) == "<think>\n\n</think>\n\n"
    p_on, _ = off._prompt(off.open_episode(client), msgs, None, {"enable_thinking": True})
    assert p_on == p_plain  # a request's chat_template_kwargs go over the run's


@pytest.mark.parametrize(
    "extra",
    [
        ["--custom-generate-function-path", "slime_async.examples.calculator_tool:generate"],
        ["--group-rm"],
        ["--agent-timeout", "0"],
    ],
)
def test_agent_flags_refuse_what_cannot_work(extra, capsys) -> None:
    from slime_async.config import parse_config

    with pytest.raises(SystemExit):
        parse_config(
            ["--agent-function-path", "slime_async.examples.agent_calculator:agent", *extra]
        )
    assert "agent" in capsys.readouterr().err


def test_agent_function_must_take_client_and_sample() -> None:
    from slime_async.rollout.agents.agent import load_agent_function

    with pytest.raises(ValueError, match="takes \\(client, sample\\)"):
        load_agent_function("slime_async.examples.agent_calculator:_ids")


async def test_a_turn_waits_out_an_abort_pause_and_comes_back_whole(stack, engines, tok) -> None:
    """The fleet paused in abort mode for a second mid-turn: the router answers every call
    aborted at once; the gateway waits (a few calls, not 64 in a row) and the agent gets the
    whole pinned turn after the continue, not one cut by the pause."""
    url, router, client, gw = stack
    sent = threading.Event()

    def agent(c: openai.OpenAI, sample) -> float:
        sent.set()
        c.chat.completions.create(model="m", messages=list(sample.messages), max_tokens=7)
        return 1.0

    gen = AgentGenerate(agent, client, gw, timeout_s=120, decode=tok.decode, max_turn_tokens=120)
    task = asyncio.ensure_future(gen.episode(_request(tok)))
    await asyncio.to_thread(sent.wait)
    ep = next(iter(gw.episodes.values()))
    await _wait_tokens(engines, len(ep.ids) + 30)
    before = router.proxy.stats.aborted_paused
    async with RouterClient(url, token=TOKEN).paused(mode="abort"):
        await asyncio.sleep(1.5)
    ep, ret = await task
    (turn,) = ep.turns
    assert ret == 1.0 and len(turn.output_ids) == 120  # whole: not cut by the pause
    assert gw.stats.resumed_turns == 1
    calls = router.proxy.stats.aborted_paused - before
    assert 2 <= calls <= 12 and gw.stats.resumed_calls == calls + 1  # +1: the turn's own abort
