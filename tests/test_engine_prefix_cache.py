"""The embedded engine's prefix (radix) cache: the tree itself (match, split, LRU eviction under
the token budget, per-epoch keys) and, over real HTTP, `meta_info.cached_tokens` true to what was
reused, answers equal to a teacher-forced forward, and no KV reused across a weight push (a
prefix cached under version k is never reused by a request served by k+1; a request in flight
across the push keeps its own KV and per-token versions, and its KV never enters the cache)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.model import load_model
from slime_async.engine.prefix_cache import PrefixCache
from slime_async.engine.testing import check_against_reference, post

pytestmark = pytest.mark.timeout(180)
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


# ---------------------------------------------------------------------------- the tree
def _kv(tokens: list[int], *, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake KV whose every entry is its token id (so a match shows which tokens it returns)."""
    t = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(1, len(tokens), 3)
    return [(t.clone() + layer, -t.clone()) for layer in range(layers)]


def test_match_returns_the_longest_prefix_and_splits_edges() -> None:
    c = PrefixCache(max_tokens=100)
    assert c.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]), epoch=0) == 4
    assert c.insert([1, 2, 9], _kv([1, 2, 9]), epoch=0) == 1  # splits the [1,2,3,4] edge
    m = c.match([1, 2, 3, 7], limit=3)
    assert m.length == 3 and m.kv is not None
    assert m.kv[1][0][0, :, 0].tolist() == [2.0, 3.0, 4.0]  # layer 1 keys = token + 1
    assert c.match([1, 2, 9, 9], limit=3).length == 3
    assert c.match([1, 2, 3, 4, 5], limit=2).length == 2  # never past the limit
    assert c.match([5, 1], limit=1).length == 0
    assert c.tokens == 5
    assert c.stats.cached_tokens == 8 and c.stats.hit_requests == 3


def test_eviction_keeps_the_budget_and_drops_least_recently_used_leaves() -> None:
    c = PrefixCache(max_tokens=10)
    c.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]), epoch=0)
    c.insert([5, 6, 7, 8], _kv([5, 6, 7, 8]), epoch=0)
    c.match([1, 2, 3, 4, 0], limit=4)  # [1..4] is now the most recently used
    c.insert([9, 10, 11, 12], _kv([9, 10, 11, 12]), epoch=0)
    assert c.tokens <= 10 and c.stats.evicted_tokens == 4
    assert c.match([5, 6, 7, 8, 0], limit=4).length == 0  # the LRU one went
    assert c.match([1, 2, 3, 4, 0], limit=4).length == 4
    c.insert(list(range(100, 150)), _kv(list(range(100, 150))), epoch=0)  # alone over budget
    assert c.tokens <= 10


@pytest.mark.parametrize("policy", ["flush", "salt"])
def test_a_prefix_of_one_epoch_is_never_reused_by_the_next(policy: str) -> None:
    c = PrefixCache(max_tokens=100, policy=policy)  # type: ignore[arg-type]
    c.insert([1, 2, 3], _kv([1, 2, 3]), epoch=0)
    c.activate(1)
    assert c.match([1, 2, 3, 4], limit=3).length == 0
    assert c.tokens_of(0) == (3 if policy == "salt" else 0)
    assert c.insert([1, 2, 3], _kv([1, 2, 3]), epoch=0) == 0  # old KV never enters
    assert c.stats.refused_inserts == 1
    c.insert([1, 2], _kv([1, 2]), epoch=1)
    assert c.match([1, 2, 3, 4], limit=3).length == 2  # only epoch 1's own KV
    assert c.stats.cross_version_hits == 0
    assert c.flush() == (5 if policy == "salt" else 2) and c.tokens == 0


# ---------------------------------------------------------------------------- over HTTP
def _save(dirpath: Path, *, seed: int) -> str:
    load_model(EngineConfig(dtype="fp32", seed=seed)).model.save_pretrained(str(dirpath))
    return str(dirpath)


@pytest.fixture
def serve():
    torch.set_num_threads(1)
    servers: list[EngineServer] = []

    def start(**kw) -> str:
        srv = EngineServer(EngineConfig(dtype="fp32", weight_version="0", **kw))
        servers.append(srv)
        return srv.start()

    yield start
    for srv in servers:
        srv.stop()


async def _cache_info(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/server_info") as r:
        return (await r.json())["internal_states"][0]["prefix_cache"]


async def test_cached_tokens_are_what_was_reused_and_change_nothing(serve) -> None:
    url = serve()
    prompt = list(range(3, 43))
    body = {
        "input_ids": prompt,
        "sampling_params": GREEDY,
        "return_logprob": True,
        "return_routed_experts": True,
    }
    async with aiohttp.ClientSession() as s:
        _, first = await post(s, url + "/generate", body)
        _, again = await post(s, url + "/generate", body)
        # a longer prompt sharing the first 30 tokens reuses exactly those
        _, longer = await post(s, url + "/generate", dict(body, input_ids=prompt[:30] + [7] * 5))
        # a multi-turn follow-up reuses the finished request's prompt and output KV
        turn2 = prompt + first["output_ids"] + [11, 12]
        _, follow = await post(s, url + "/generate", dict(body, input_ids=turn2))
        # input log-probs from position 5 need logits from position 4: at most 4 reused
        _, lp = await post(s, url + "/generate", dict(body, logprob_start_len=5))
        # n = 4 samples of one new prompt admitted together: the 3 later ones reuse the first's
        group = dict(body, input_ids=list(range(60, 80)))
        group["sampling_params"] = {"max_new_tokens": 4, "n": 4, "sampling_seed": 1}
        _, samples = await post(s, url + "/generate", group)
        info = await _cache_info(s, url)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # the last token is forwarded
    assert longer["meta_info"]["cached_tokens"] == 30
    assert follow["meta_info"]["cached_tokens"] == len(prompt) + len(first["output_ids"]) - 1
    assert lp["meta_info"]["cached_tokens"] == 4
    assert sorted(x["meta_info"]["cached_tokens"] for x in samples) == [0, 19, 19, 19]
    assert again["output_ids"] == first["output_ids"]
    ref = load_model(EngineConfig(dtype="fp32"))
    for inp, ans in [(prompt, again), (turn2, follow)]:
        c = check_against_reference(ref, inp, ans)
        assert c.logprob_abs_diff.max() < 1e-4 and bool(c.routed_equal.all())
    # input log-probs (positions 5..) equal to a forward without any cache
    full = check_against_reference(ref, prompt, lp)
    assert full.logprob_abs_diff.max() < 1e-4
    with torch.no_grad():
        logits = ref.model(torch.tensor([prompt])).logits[0].float()
    want = (
        torch.log_softmax(logits, -1)[4:-1]
        .gather(1, torch.tensor(prompt[5:])[:, None])[:, 0]
        .tolist()
    )
    got = [e[0] for e in lp["meta_info"]["input_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-4)
    assert info["cross_version_hits"] == 0 and info["cached_tokens"] >= 39 + 30


async def test_eviction_respects_the_token_budget(serve) -> None:
    url = serve(prefix_cache_tokens=64)
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            body = {"input_ids": [i + 1] * 30, "sampling_params": {"max_new_tokens": 1}}
            await post(s, url + "/generate", body)
            info = await _cache_info(s, url)
            assert info["tokens"] <= 64
        _, late = await post(
            s, url + "/generate", {"input_ids": [6] * 30, "sampling_params": {"max_new_tokens": 1}}
        )
        _, early = await post(
            s, url + "/generate", {"input_ids": [1] * 30, "sampling_params": {"max_new_tokens": 1}}
        )
    assert info["evicted_tokens"] > 0
    assert late["meta_info"]["cached_tokens"] == 29 and early["meta_info"]["cached_tokens"] == 0


async def test_flush_cache_and_disable(serve) -> None:
    url = serve()
    off = serve(disable_radix_cache=True)
    body = {"input_ids": list(range(1, 20)), "sampling_params": {"max_new_tokens": 2}}
    async with aiohttp.ClientSession() as s:
        await post(s, url + "/generate", body)
        async with s.post(url + "/flush_cache") as r:
            assert r.status == 200
        assert (await _cache_info(s, url))["tokens"] == 0
        _, ans = await post(s, url + "/generate", body)
        assert ans["meta_info"]["cached_tokens"] == 0
        for _ in range(2):
            _, ans = await post(s, off + "/generate", body)
            assert ans["meta_info"]["cached_tokens"] == 0
        assert (await _cache_info(s, off)) is None


@pytest.mark.parametrize("policy", ["flush", "salt"])
async def test_no_prefix_is_reused_across_a_push(serve, tmp_path: Path, policy: str) -> None:
    """pause in_place -> update_weights_from_disk(flush_cache=false) -> continue: a prompt
    cached under version 0 is prefilled anew under version 1, a request in flight across the
    push keeps its KV and records both versions, and its KV is never offered to the cache."""
    url = serve(prefix_cache_policy=policy)
    new_dir = _save(tmp_path / "w1", seed=1)
    prompt = list(range(5, 37))
    body = {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True}
    crossing_prompt = list(range(100, 120))
    long = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0}
    async with aiohttp.ClientSession() as s:
        await post(s, url + "/generate", body)
        _, hit0 = await post(s, url + "/generate", body)
        crossing = asyncio.ensure_future(
            post(
                s,
                url + "/generate",
                {"input_ids": crossing_prompt, "sampling_params": long, "return_logprob": True},
            )
        )
        for _ in range(400):
            async with s.get(url + "/server_info") as r:
                if (await r.json())["internal_states"][0]["num_tokens"] >= len(
                    crossing_prompt
                ) + 30:
                    break
            await asyncio.sleep(0.02)
        await post(s, url + "/pause_generation", {"mode": "in_place"})
        upd = {"model_path": new_dir, "weight_version": "1", "flush_cache": False}
        st, res = await post(s, url + "/update_weights_from_disk", upd)
        assert st == 200 and res["success"], res
        await post(s, url + "/continue_generation", {})
        _, after = await post(s, url + "/generate", body)
        _, after2 = await post(s, url + "/generate", body)
        _, crossed = await crossing
        # the crossing request's prompt + output: its KV (two versions) was never cached
        _, follow = await post(
            s,
            url + "/generate",
            {"input_ids": crossing_prompt + crossed["output_ids"], "sampling_params": GREEDY},
        )
        info = await _cache_info(s, url)
    assert hit0["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert after["meta_info"]["weight_version"] == "1"
    assert after["meta_info"]["cached_tokens"] == 0  # version 0's KV is not reused
    assert after2["meta_info"]["cached_tokens"] == len(prompt) - 1  # version 1's own is
    new = load_model(EngineConfig(dtype="fp32", model_dir=new_dir))
    for ans in (after, after2):
        c = check_against_reference(new, prompt, ans)
        assert c.logprob_abs_diff.max() < 1e-4  # computed by version 1 alone
    spans = crossed["meta_info"]["weight_versions"]
    assert [sp["version"] for sp in spans] == ["0", "1"] and spans[0]["end"] > 0
    assert crossed["meta_info"]["cached_tokens"] == 0
    assert follow["meta_info"]["cached_tokens"] == 0
    assert info["cross_version_hits"] == 0 and info["epoch"] == 1
    if policy == "flush":
        assert info["flushed_tokens"] > 0


async def test_extra_key_namespaces_the_cache_and_a_bad_one_is_a_400(serve) -> None:
    url = serve()
    body = {"input_ids": list(range(1, 20)), "sampling_params": {"max_new_tokens": 1}}
    async with aiohttp.ClientSession() as s:
        got = [
            (await post(s, url + "/generate", dict(body, extra_key=k)))[1]["meta_info"]
            for k in ("a", "b", "a", None)
        ]
        st, err = await post(s, url + "/generate", dict(body, extra_key=7))
    assert [m["cached_tokens"] for m in got] == [0, 0, 18, 0]
    assert st == 400 and "extra_key" in str(err)


def test_peek_sees_what_match_would_reuse_without_counting() -> None:
    c = PrefixCache(max_tokens=100)
    c.insert([1, 2, 3, 4], _kv([1, 2, 3, 4]), epoch=0)
    assert c.peek([1, 2, 3, 9]) == 3 and c.peek([1, 2, 3, 4, 5]) == 4 and c.peek([7]) == 0
    assert c.peek([1, 2], namespace="other") == 0 and c.stats.lookups == 0
    c.activate(1)
    assert c.peek([1, 2, 3, 4]) == 0
