"""The bounded caches of compiled CPU matmuls (`host.limit_kernel_caches`): a process whose
bf16 matmuls keep changing shape (micro-batches of varying token counts) stops growing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, sys
limit = json.loads(sys.argv[1])
from slime_async import host
values = host.limit_kernel_caches(limit) if limit else {}
import torch
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
def rss():
    libc.malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * 4096
w = torch.randn(1536, 576, dtype=torch.bfloat16)
(torch.randn(64, 576, dtype=torch.bfloat16) @ w.t()).sum()
before = rss()
for n in range(300, 560):  # a micro-batch's token count, a new one each time
    x = torch.randn(n, 576, dtype=torch.bfloat16)
    y = x @ w.t()
    g = y.t() @ x
del x, y, g
print(json.dumps({"grown": rss() - before, "values": values}))
"""


def _probe(limit: int, env: dict[str, str] | None = None) -> dict:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(limit)],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc")
def test_bounded_caches_stop_a_process_growing_with_each_new_matmul_shape() -> None:
    unbounded = _probe(0)
    bounded = _probe(8)
    assert bounded["values"] == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8",
        "LRU_CACHE_CAPACITY": "8",
    }
    # 260 shapes: the default caches keep every one (~1 MiB each on these shapes); bounded, a
    # handful stay
    assert unbounded["grown"] > 64 * 2**20, unbounded
    assert bounded["grown"] < unbounded["grown"] / 4, (bounded, unbounded)


def test_a_cache_size_the_user_set_is_kept() -> None:
    out = _probe(8, env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "512"})
    assert out["values"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "512", "LRU_CACHE_CAPACITY": "8"}
