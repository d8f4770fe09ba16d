"""Helpers for tests and benchmarks that talk to an engine over HTTP and check its answers.

Owns: `post` (one JSON POST with aiohttp, returns status and parsed body),
`check_against_reference` (teacher-forced comparison of a `/generate` answer) and
`stock_sglang_router` (the real sglang-router binary in front of engines). Test support
only; production code must never import this module.
"""

from __future__ import annotations

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
    worker_urls: Sequence[str], *, policy: str = "round_robin", timeout_s: float = 60.0
) -> Iterator[str]:
    """The real `sglang-router` (PyPI wheel) in front of `worker_urls`; yields its URL once every
    worker is registered and healthy, stops it (by PID: it renames itself) afterwards."""
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
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/workers", timeout=2) as r:
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
