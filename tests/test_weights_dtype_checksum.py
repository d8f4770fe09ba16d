"""Weights in the engine's dtype and per-bucket checksums, against real embedded engine servers
over gloo (the fleet of tests/test_weights_distributed.py): a bf16 push serves exactly the
sender's weights rounded to bf16 with half the bytes; a bucket corrupted on the wire is refused
by every engine before staging, the version is sent again, and the corrupted one is never
served; the run derives the dtype from the engines'."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
import torch

from slime_async.contracts.weight_buckets import (
    bucket_buffer,
    in_dtype,
    pack_bucket,
    plan_buckets,
    tensors_checksum,
    torch_dtype,
)
from slime_async.contracts.weight_transfer import publish_checksum
from slime_async.contracts.weights import WeightManifest
from slime_async.weights import InProcessSender, WeightSyncConfig
from tests.test_weights_distributed import CFG, Weights, _pushing, _served, fleet  # noqa: F401

pytestmark = pytest.mark.timeout(300)


class _CorruptingSender(InProcessSender):
    """Publishes each bucket's true checksum but, on its first send, changes one value of
    bucket `bad` on the wire (after the checksum): what a flipped bit in transit looks like."""

    def __init__(self, weights: Weights, *, bad: int = 1) -> None:
        super().__init__(weights)
        self.bad, self.sends = bad, 0

    async def send(self, buckets, *, flatten: bool) -> int:
        self.sends += 1
        if self.sends > 1:
            return await super().send(buckets, flatten=flatten)
        version, tensors = self._weights()
        await asyncio.to_thread(self._send_corrupted, tensors, buckets, flatten)
        return version

    def _send_corrupted(self, tensors, buckets, flatten: bool) -> None:
        g = self._group
        assert g is not None and flatten
        for i, b in enumerate(buckets):
            ts = [tensors[e.name].detach().to(g.device, torch_dtype(e.dtype)) for e in b]
            publish_checksum(g, tensors_checksum(ts))
            flat = torch.cat([t.reshape(-1) for t in ts])
            if i == self.bad:
                flat[0] += 1.0
            g.broadcast(flat)
            g.buckets += 1
            g.mark_sent()


def test_manifest_in_the_engine_dtype_halves_the_bytes():
    w = Weights()
    m = WeightManifest.of(w()[1], version=0)
    half = in_dtype(m, "bfloat16")
    assert {e.dtype for e in half.entries} == {"bfloat16"}
    nbytes = [
        sum(torch.Size(e.shape).numel() * torch_dtype(e.dtype).itemsize for e in x.entries)
        for x in (m, half)
    ]
    assert nbytes[1] * 2 == nbytes[0] > 0
    assert in_dtype(m, None) is m
    with pytest.raises(ValueError, match="unknown dtype"):
        in_dtype(m, "float8")


def test_crc_of_a_flat_bucket_equals_its_pieces():
    a, b = torch.randn(5), torch.randn(3, 2).to(torch.bfloat16)
    flat = torch.cat([a.view(torch.uint8), b.reshape(-1).view(torch.uint8)])
    assert tensors_checksum([a, b]) == tensors_checksum([flat])
    c = a.clone()
    c[0] += 1
    assert tensors_checksum([c, b]) != tensors_checksum([a, b])


@pytest.mark.parametrize("scale", [1, 64])  # under and over the size with a CRC thread
def test_a_packed_bucket_is_its_tensors_cast_back_to_back_with_their_crc(scale) -> None:
    """`pack_bucket` writes each tensor once, cast, into one buffer: exactly the concatenation
    of the casts (the flattened format), and the CRC of those bytes (computed alongside)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randn(scale * (100 + i), 97, generator=g).t()
        if i % 3 == 0
        else torch.randn(scale * (100 + i), 97, generator=g)
        for i in range(7)
    }  # every third one a transposed (non-contiguous) view
    for dtype in ("bfloat16", "float32"):
        (bucket,) = plan_buckets(in_dtype(WeightManifest.of(tensors, version=0), dtype), 1 << 30)
        flat, crc = pack_bucket(tensors, bucket, "cpu")
        want = torch.cat([tensors[e.name].to(torch_dtype(dtype)).reshape(-1) for e in bucket])
        assert flat.dtype == want.dtype and torch.equal(flat, want)
        assert crc == tensors_checksum([want])


def test_a_bucket_packs_without_a_copy_only_when_nothing_changes() -> None:
    w = torch.randn(300, 200)
    m = WeightManifest.of({"w": w}, version=0)
    (same,) = plan_buckets(m, 1 << 30)
    flat, crc = pack_bucket({"w": w}, same, "cpu")
    assert flat.data_ptr() == w.data_ptr() and crc == tensors_checksum([w])  # sent as it is
    (cast,) = plan_buckets(in_dtype(m, "bfloat16"), 1 << 30)
    assert pack_bucket({"w": w}, cast, "cpu")[0].data_ptr() != w.data_ptr()
    with pytest.raises(ValueError, match="'w' has shape \\(200, 300\\)"):
        pack_bucket({"w": w.t()}, same, "cpu")
    two = WeightManifest.of({"a": w, "b": w.to(torch.bfloat16)}, version=0)
    with pytest.raises(ValueError, match="one dtype"):
        pack_bucket({"a": w, "b": w}, two.entries, "cpu")


def test_bucket_buffers_are_fresh_writable_and_huge_page_aligned() -> None:
    import mmap

    for n in (100, 5 << 20):
        b = bucket_buffer(n)
        assert b.dtype == torch.uint8 and b.numel() == n
        b.fill_(7)
        assert int(b.sum()) == 7 * n
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: large buffers start on a 2 MiB boundary
        assert bucket_buffer(5 << 20).data_ptr() % (2 << 20) == 0


async def test_bf16_push_serves_the_sender_weights_rounded_to_bf16(fleet) -> None:  # noqa: F811
    from slime_async.engine.testing import check_against_reference

    urls = [e.url for e in fleet]
    weights = Weights()
    cfg = WeightSyncConfig(bucket_bytes=CFG.bucket_bytes, timeout_s=60.0, dtype="bfloat16")
    async with _pushing(urls, InProcessSender(weights), cfg=cfg) as (t, s, _rc):
        weights.set(70, 70)
        assert (await t.push(70))["weights/push_failed_engines"] == 0.0
        buckets = plan_buckets(t._manifest, cfg.bucket_bytes)
        assert {e.dtype for b in buckets for e in b} == {"bfloat16"}
        with torch.no_grad():  # what the engines must serve: each value rounded to bf16
            for p in weights.lm.model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        for u in urls:
            served, answer = await _served(s, u)
            assert served == "70"
            diff = check_against_reference(weights.lm, [3, 1, 4, 1, 5], answer).logprob_abs_diff
            assert diff.max() < 1e-4


async def test_corrupted_bucket_is_refused_resent_and_never_served(fleet, caplog) -> None:  # noqa: F811
    """Over the wire (the same-node path is off: the corruption is a changed value in transit;
    in shared memory: tests/test_weights_same_node.py)."""
    urls = [e.url for e in fleet]
    weights = Weights()
    sender = _CorruptingSender(weights)
    wire = dataclasses.replace(CFG, same_node=False)
    async with _pushing(urls, sender, cfg=wire) as (t, s, _rc):
        with caplog.at_level(logging.WARNING):
            weights.set(80, 80)
            m = await t.push(80)
        assert "arrived corrupted" in caplog.text  # every engine refused the bucket
        assert sender.sends == 2 and t.groups_formed == 2  # refused, re-formed, sent again
        assert m["weights/push_failed_engines"] == 0.0
        from slime_async.engine.testing import check_against_reference

        for u in urls:  # the resent, intact version is what is served
            served, answer = await _served(s, u)
            assert served == "80"
            diff = check_against_reference(weights.lm, [3, 1, 4, 1, 5], answer).logprob_abs_diff
            assert diff.max() < 1e-4


def test_the_run_ships_the_engines_dtype_and_keeps_a_given_one():
    from slime_async.config import Environment, build_parser, validate
    from slime_async.contracts.model import TINY_MOE

    def weights(*argv: str):
        cfg = validate(
            build_parser().parse_args(list(argv)), Environment(model=TINY_MOE, cpus=(0, 1))
        )
        return cfg.weights.dtype, cfg.derived.get("--update-weight-dtype")

    dtype, why = weights()  # embedded engines serve bf16 by default
    assert dtype == "bfloat16" and "--engine-dtype bf16" in why.why
    assert weights("--engine-dtype", "fp32")[0] == "float32"
    assert weights("--update-weight-dtype", "float32") == ("float32", None)
    assert weights("--bf16", "--engine-dtype", "fp32")[0] == "bfloat16"  # the trainer's own
