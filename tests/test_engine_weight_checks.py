"""`/update_weights_from_disk` refuses weights that do not fit or are not finite, before the swap
and at bounded memory, and the old weights keep serving (issue 17, High). Real engine, real
HTTP, real safetensors files."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.model import load_model
from slime_async.engine.testing import post

pytestmark = pytest.mark.timeout(180)
GREEDY = {"input_ids": [2, 7, 1, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}


@pytest.fixture(scope="module")
def engine():
    srv = EngineServer(EngineConfig(dtype="fp32", weight_version="0"))
    url = srv.start()
    yield url
    srv.stop()


def _export(d: Path, *, seed: int) -> Path:
    load_model(EngineConfig(dtype="fp32", seed=seed)).model.save_pretrained(str(d))
    return d


async def _refused(url: str, path: Path) -> dict:
    """POST the update; assert it failed and that outputs and version did not change."""
    async with aiohttp.ClientSession() as s:
        _, before = await post(s, url + "/generate", GREEDY)
        st, res = await post(
            s, url + "/update_weights_from_disk", {"model_path": str(path), "weight_version": "9"}
        )
        _, after = await post(s, url + "/generate", GREEDY)
    assert st == 400 and res["success"] is False, res
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"] != "9"
    return res


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
async def test_non_finite_weights_are_refused_naming_the_tensor(engine, tmp_path, bad) -> None:
    d = _export(tmp_path / "w", seed=3)
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[5] = bad
    save_file(tensors, str(f), metadata={"format": "pt"})
    res = await _refused(engine, d)
    assert name in res["message"] and "non-finite" in res["message"]
    assert "model.safetensors" in res["message"]


def _peak_rss_kb() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


async def test_wrong_shape_is_refused_from_the_header_without_loading_it(engine, tmp_path) -> None:
    """A file whose embedding is 256 MB of the wrong shape: refused naming the tensor and both
    shapes, and the process's peak RSS does not grow by the file's size (headers are checked
    before any tensor is read or any model is built)."""
    d = _export(tmp_path / "w", seed=3)
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    name = next(k for k in sorted(tensors) if "embed" in k)
    tensors[name] = torch.zeros(64 * 1024 * 1024 // tensors[name].shape[1], tensors[name].shape[1])
    save_file(tensors, str(f), metadata={"format": "pt"})
    del tensors
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS watermark
    start = _peak_rss_kb()
    res = await _refused(engine, d)
    grew_mb = (_peak_rss_kb() - start) / 1024
    assert name in res["message"] and "shape" in res["message"]
    assert grew_mb < 128, f"peak RSS grew by {grew_mb:.0f} MB on a 256 MB wrong file"


async def test_missing_and_unexpected_tensors_are_listed(engine, tmp_path) -> None:
    d = _export(tmp_path / "w", seed=3)
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    gone = sorted(tensors)[0]
    tensors["model.layers.99.extra.weight"] = tensors.pop(gone)
    save_file(tensors, str(f), metadata={"format": "pt"})
    res = await _refused(engine, d)
    assert f"missing tensor {gone!r}" in res["message"]
    assert "unexpected tensor 'model.layers.99.extra.weight'" in res["message"]


async def test_a_good_export_still_loads_after_refusals(engine, tmp_path) -> None:
    d = _export(tmp_path / "w", seed=3)
    async with aiohttp.ClientSession() as s:
        _, before = await post(s, engine + "/generate", GREEDY)
        st, res = await post(
            s, engine + "/update_weights_from_disk", {"model_path": str(d), "weight_version": "5"}
        )
        _, after = await post(s, engine + "/generate", GREEDY)
    assert st == 200 and res["success"], res
    assert after["meta_info"]["weight_version"] == "5"
    assert after["output_ids"] != before["output_ids"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_finite_check_finds_every_nan_and_infinity(dtype) -> None:
    """`all_finite` (one `aminmax` pass, what every receiver runs) finds a NaN or an infinity
    at any position, in the vectorised body and the tail, and in a strided view."""
    from slime_async.contracts.weights import all_finite

    for n in (1, 7, 16, 33, 64, 129, 1000):
        base = torch.randn(n).to(dtype)
        assert all_finite(base)
        for i in range(n):
            for v in (float("nan"), float("inf"), float("-inf")):
                t = base.clone()
                t[i] = v
                assert not all_finite(t), (dtype, n, i, v)
    big = torch.randn(1 << 20).to(dtype)
    big[(1 << 20) - 3] = float("nan")
    assert not all_finite(big) and all_finite(big[:-3])
    m = torch.randn(64, 64).to(dtype)
    m[3, 5] = float("inf")
    assert not all_finite(m.t()) and all_finite(m[:, 6:])
    assert all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.arange(5))
