"""Helpers for tests and benchmarks that talk to an engine over HTTP and check its answers.

Owns: `post` (one JSON POST with aiohttp, returns status and parsed body),
`check_against_reference` (teacher-forced comparison of a `/generate` answer) and
`stock_sglang_router` (the real sglang-router binary in front of engines) and
`start_processes` / `stop_processes` (several `EngineProcess` children started or stopped at
once: each start is mostly the child's imports and model build, which overlap). Test support
only; production code must never import this module.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import numpy as np
import torch

from slime_async.contracts.rollout import decode_routed_experts
from slime_async.engine.model import LoadedModel, teacher_forced
from slime_async.engine.runner import EngineProcess


def start_processes(procs: Sequence[EngineProcess]) -> list[str]:
    """Start every child at once; their URLs in order. If any start fails, every child is
    stopped and the first error raised."""
    with concurrent.futures.ThreadPoolExecutor(len(procs) or 1) as ex:
        futures = [ex.submit(p.start) for p in procs]
        concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        stop_processes(procs)
        raise errors[0]  # type: ignore[misc]
    return [f.result() for f in futures]


def stop_processes(procs: Sequence[EngineProcess]) -> None:
    """Stop every child at once (each stop waits for its child's graceful exit)."""
    with concurrent.futures.ThreadPoolExecutor(len(procs) or 1) as ex:
        list(ex.map(lambda p: p.stop(), procs))


async def post(
    session: aiohttp.ClientSession, url: str, body: Any = None, *, raw: bytes | None = None
) -> tuple[int, Any]:
    """POST `body` as JSON (or `raw` bytes); returns `(status, parsed JSON or text or None)`."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return r.status, text


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """Engine answer vs a teacher-forced forward of prompt + output."""

    logprob_abs_diff: torch.Tensor
    """|engine - reference| per output token."""
    routed_equal: torch.Tensor | None
    """Per forwarded position: engine's expert set == reference's (all layers)."""


def check_against_reference(
    ref: LoadedModel, prompt: list[int], answer: dict[str, Any], *, temperature: float = 1.0
) -> Comparison:
    """Compare one `/generate` answer (with `return_logprob`, optionally routed experts from
    position 0) against `teacher_forced(ref, prompt + output)`."""
    out = answer["output_ids"]
    meta = answer["meta_info"]
    lps = torch.tensor([e[0] for e in meta["output_token_logprobs"]], dtype=torch.float32)
    assert [e[1] for e in meta["output_token_logprobs"]] == out
    ref_lp, ref_routed = teacher_forced(ref, prompt + out, temperature=temperature)
    diff = (ref_lp[len(prompt) - 1 :] - lps).abs()
    eq = None
    if "routed_experts" in meta:
        got = decode_routed_experts(
            meta["routed_experts"], num_layers=ref.num_layers, topk=ref.topk
        )
        got_t = torch.from_numpy(np.sort(got, axis=-1))
        want = ref_routed.sort(dim=-1).values
        assert got_t.shape == want.shape, (got_t.shape, want.shape)
        eq = (got_t == want).all(dim=-1).all(dim=-1)
    return Comparison(logprob_abs_diff=diff, routed_equal=eq)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def stock_sglang_router(
    worker_urls: Sequence[str],
    *,
    policy: str = "round_robin",
    timeout_s: float = 60.0,
    api_key: str | None = None,
) -> Iterator[str]:
    """The real `sglang-router` (PyPI wheel) in front of `worker_urls`; yields its URL once every
    worker is registered and healthy, stops it (by PID: it renames itself) afterwards. `api_key`:
    its one `--api-key` (asked of its clients, presented to its workers; on its command line,
    so a test's key only)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--log-level",
        "warn",
        "--prometheus-port",
        str(_free_port()),
        *(("--api-key", api_key) if api_key else ()),
    ]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {proc.returncode}")
            try:
                req = urllib.request.Request(url + "/workers", headers=headers)
                with urllib.request.urlopen(req, timeout=2) as r:
                    ws = json.loads(r.read())["workers"]
                if len(ws) == len(worker_urls) and all(w["is_healthy"] for w in ws):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router did not register {list(worker_urls)}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template (SmolLM2's shape, without its default system message)."""

THINKING_SWITCH_TEMPLATE = CHATML_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
"""`CHATML_TEMPLATE` with Qwen3's thinking switch: `enable_thinking=False` (a chat template
keyword argument) opens the answer with an empty think block; without it, the same prompt."""

QWEN_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}# Tools\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}"
    "<|im_end|>\n{% endif %}"
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'assistant' %}{% set c = m['content'] or '' %}"
    "{% if loop.index0 < ns.last_user and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ c }}{% for tc in m.get('tool_calls', []) %}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen-style template: tools in the system turn, `<tool_call>` blocks, tool results as user
turns, and `<think>` blocks of assistant turns before the last user turn stripped (the
re-serialisation that makes a later prompt differ from the tokens sampled earlier)."""


def ascii_chat_tokenizer(template: str = CHATML_TEMPLATE) -> Any:
    """A byte-level tokenizer over the 128 ASCII bytes plus `<|im_end|>` (128, EOS) and
    `<|im_start|>` (129) with `template`: any id sequence of it decodes to text that encodes back to
    the same ids, so a re-tokenization mismatch comes only from the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the byte-level pre-tokenizer's byte -> character table: printable bytes stand for
    # themselves, the others for 256 + their rank
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in keep]
    b2u = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(rest)}
    vocab = {b2u[b]: b for b in range(128)}
    assert set(vocab) <= set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>"], "eos_token": "<|im_end|>"}
    )
    fast.chat_template = template
    return fast


def chat_model_dir(
    path: str, *, template: str = CHATML_TEMPLATE, seed: int = 0, mute_eos: bool = False
) -> str:
    """Write a tiny random Qwen3-MoE whose vocabulary is `ascii_chat_tokenizer`'s (130 ids, EOS
    `<|im_end|>`) with that tokenizer to `path`: a chat model for CPU tests. `mute_eos`: its
    output layer is sharpened and EOS's row zeroed, so that a turn practically never ends on
    EOS (a long turn to push weights in the middle of)."""
    from slime_async.contracts.model import TINY_MOE
    from slime_async.engine.config import EngineConfig
    from slime_async.engine.model import load_model

    tok = ascii_chat_tokenizer(template)
    spec = dataclasses.replace(TINY_MOE, vocab_size=len(tok))
    lm = load_model(EngineConfig(dtype="fp32", model_spec=spec.to_dict(), seed=seed))
    eos = tok.eos_token_id
    lm.model.config.eos_token_id = eos
    lm.model.generation_config.eos_token_id = eos
    lm.model.config.bos_token_id = lm.model.generation_config.bos_token_id = None
    lm.model.config.pad_token_id = lm.model.generation_config.pad_token_id = None
    if mute_eos:
        import torch

        with torch.no_grad():
            head = lm.model.get_output_embeddings().weight
            head.mul_(50.0)
            head[eos] = 0.0
    lm.model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
