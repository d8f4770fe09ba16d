"""The LoRA adapter over the distributed weight group, against two real embedded engine servers
(LoRA on, a dense tiny llama) over gloo on 127.0.0.1, the router in front.

* a distributed adapter push serves exactly what a disk (PEFT directory) push of the same
  adapter serves: greedy tokens and log-probs equal on both engines;
* the bytes pushed are the rank formula `4 · Σ r · (d_in + d_out)` and nothing else;
* the activation is a logged weight call: replayed on an engine holding that version it
  succeeds; an engine without it refuses (no old adapter under a new label);
* a bucket corrupted on every send, or a NaN adapter, is refused by every engine: the push
  fails visibly and the old adapter keeps serving, under its old version.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import aiohttp
import pytest
import torch

from router import Router, RouterClient, RouterConfig
from slime_async.contracts.adapter import LoraSpec, adapter_numel, peft_shapes, write_peft_dir
from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weight_buckets import tensors_checksum, torch_dtype
from slime_async.contracts.weight_transfer import publish_checksum
from slime_async.engine import EngineConfig, EngineProcess
from slime_async.engine.testing import post, start_processes, stop_processes
from slime_async.weights import InProcessSender, WeightSyncConfig
from slime_async.weights.adapter import AdapterTransport, DistributedAdapterTransport

pytestmark = pytest.mark.timeout(300)
SPEC = ModelSpec(family="llama", num_layers=2, vocab_size=512)
LORA = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
CFG = WeightSyncConfig(bucket_bytes=4096, timeout_s=60.0)  # several buckets per adapter
PROMPT = [5, 17, 42, 9, 300, 77]
GEN = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    "return_logprob": True,
    "lora_path": "policy",
}


def adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 0.2 for k, s in peft_shapes(SPEC, LORA).items()}


class Adapter:
    """What rank 0 holds: version `v` and its adapter tensors (also a PEFT-directory writer)."""

    def __init__(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.version, self.tensors = version, tensors

    def __call__(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.version, self.tensors

    def save_adapter(self, path: str | Path) -> Path:
        return write_peft_dir(path, self.tensors, LORA, version=self.version)


class _CorruptingSender(InProcessSender):
    """Publishes each bucket's true checksum, then changes one value of bucket 1 on the wire,
    on every send (the resend is corrupted too)."""

    async def send(self, buckets, *, flatten: bool) -> int:
        version, tensors = self._weights()
        await asyncio.to_thread(self._corrupted, tensors, buckets)
        return version

    def _corrupted(self, tensors, buckets) -> None:
        g = self._group
        assert g is not None
        for i, b in enumerate(buckets):
            ts = [tensors[e.name].to(torch_dtype(e.dtype)) for e in b]
            publish_checksum(g, tensors_checksum(ts))
            flat = torch.cat([t.reshape(-1) for t in ts])
            if i == 1:
                flat[0] += 1.0
            g.broadcast(flat)
            g.buckets += 1
            g.mark_sent()


@pytest.fixture(scope="module")
def fleet():
    cfg = EngineConfig(
        dtype="fp32",
        model_spec=SPEC.to_dict(),
        seed=0,
        weight_version="0",
        num_threads=1,
        weight_group_timeout_s=60.0,
        enable_lora=True,
        max_lora_rank=8,
        max_loaded_loras=1,
    )
    engines = [EngineProcess(cfg), EngineProcess(cfg)]
    start_processes(engines)
    yield engines
    stop_processes(engines)


@contextlib.asynccontextmanager
async def _router(urls: list[str]):
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=60.0))
    rurl = await router.start()
    try:
        async with RouterClient(rurl) as rc, aiohttp.ClientSession() as s:
            yield router, rc, s
    finally:
        await router.stop()


_calls = iter(range(1 << 30))


async def _served(s: aiohttp.ClientSession, url: str) -> tuple[str, list[int], list[float]]:
    """(version, greedy tokens, their log-probs); a fresh `extra_key` each call, so no prefix
    is reused and every answer comes from the same full forward (bitwise comparable)."""
    async with s.get(url + "/model_info") as r:
        version = (await r.json())["weight_version"]
    st, res = await post(s, url + "/generate", {**GEN, "extra_key": f"k{next(_calls)}"})
    assert st == 200, res
    lps = [t[0] for t in res["meta_info"]["output_token_logprobs"]]
    return version, res["output_ids"], lps


async def test_distributed_push_serves_what_a_disk_push_serves(fleet, tmp_path: Path) -> None:
    urls = [e.url for e in fleet]
    x = Adapter(1, adapter(seed=1))
    async with _router(urls) as (router, rc, s):
        dist = DistributedAdapterTransport(
            lora=LORA, sender=InProcessSender(x), control=rc, engine_urls=lambda: urls, cfg=CFG
        )
        try:
            m = await dist.push(1)
            assert m["weights/push_failed_engines"] == 0.0
            # the rank formula, fp32, and nothing but tensor bytes
            assert m["weights/push_bytes"] == 4 * adapter_numel(SPEC, LORA)
            assert {e.dtype for e in dist._manifest.entries} == {"float32"}
            over_group = [await _served(s, u) for u in urls]
            assert [v for v, _, _ in over_group] == ["1", "1"]
            # the activation is logged; replayed on an engine holding that version it succeeds
            w = router.registry.all()[0]
            assert await router.control.catch_up(w, replay_all=True)
        finally:
            await dist.close()
        x.version = 2
        disk = AdapterTransport(tmp_path / "adapters", trainer=x, control=rc)
        assert (await disk.push(2))["weights/push_failed_engines"] == 0.0
        from_disk = [await _served(s, u) for u in urls]
        # an engine that never received version 3 over a group refuses to activate it
        body = {"lora_name": "policy", "weight_version": "3", "from_distributed": True}
        st, res = await post(s, urls[0] + "/load_lora_adapter", body)
        assert st == 400 and "received" in res["error_message"]
        st, res = await post(s, urls[0] + "/generate", {**GEN, "lora_path": None})
        base_tokens = res["output_ids"]
    assert [v for v, _, _ in from_disk] == ["2", "2"]
    for (_, t1, l1), (_, t2, l2) in zip(over_group, from_disk, strict=True):
        assert t1 == t2 and l1 == l2  # bit for bit: the same fp32 adapter
    assert over_group[0][1] != base_tokens  # and the adapter is what serves


@pytest.mark.parametrize("fault", ["corrupted", "nan"])
async def test_refused_adapter_keeps_the_old_one_serving(fleet, fault: str) -> None:
    urls = [e.url for e in fleet]
    good = Adapter(10, adapter(seed=10))
    async with _router(urls) as (_, rc, s):
        t = DistributedAdapterTransport(
            lora=LORA, sender=InProcessSender(good), control=rc, engine_urls=lambda: urls, cfg=CFG
        )
        try:
            assert (await t.push(10))["weights/push_failed_engines"] == 0.0
            before = [await _served(s, u) for u in urls]
        finally:
            await t.close()
        bad = Adapter(11, adapter(seed=11))
        if fault == "nan":
            k = sorted(bad.tensors)[3]
            bad.tensors[k][0, 0] = float("nan")
            sender = InProcessSender(bad)
        else:  # a value changed in transit: over the wire
            sender = _CorruptingSender(bad)
        cfg = CFG if fault == "nan" else dataclasses.replace(CFG, same_node=False)
        t = DistributedAdapterTransport(
            lora=LORA, sender=sender, control=rc, engine_urls=lambda: urls, cfg=cfg
        )
        try:
            m = await t.push(11)
        finally:
            await t.close()
        after = [await _served(s, u) for u in urls]
    assert m["weights/push_failed_engines"] == 2.0  # visibly failed
    assert after == before and [v for v, _, _ in after] == ["10", "10"]
