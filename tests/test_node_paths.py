"""No shared filesystem assumed: what a trainer node sees of the paths a rank needs
(`slime_async.orchestrator.node_paths`), the refusals of layouts that cannot work (node, rank, path, fix),
and the start weights sent from rank 0 over a real two-process gloo group to a rank that has
no copy (`slime_async.trainer.share`). The whole path on two network namespaces:
tests/test_node_loss.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weights import HFWeights
from slime_async.orchestrator.node_paths import NodePathError, Seen, Wanted, decide, listing, look
from slime_async.trainer import weights_io

pytestmark = pytest.mark.timeout(120)
SPEC = ModelSpec(family="llama", num_layers=1)


def _hf_dir(path: Path) -> HFWeights:
    g = torch.Generator().manual_seed(0)
    w = HFWeights(
        version=3,
        spec=SPEC,
        tensors={
            "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
            "lm_head.weight": torch.randn(8, 4, generator=g),
        },
    )
    weights_io.write_hf_dir(w, path)
    return w


def test_look_compares_what_the_driver_sees(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    _hf_dir(hf)
    meta = tmp_path / "meta.json"
    meta.write_text('{"version": 2}')
    probe = tmp_path / "probe"
    probe.write_text("abc")
    from slime_async.host import file_sha256

    w = Wanted(
        hf_dir=str(hf),
        hf_listing=listing(hf),
        load_meta=str(meta),
        load_meta_sha256=file_sha256(meta),
        save_probe=str(probe),
        save_probe_text="abc",
    )
    assert look(w, node_ip="n") == Seen(node_ip="n")
    # another node: a different checkpoint at the same path, no probe, a stale HF directory
    meta.write_text('{"version": 1}')
    probe.unlink()
    (hf / "config.json").write_text("{}")
    seen = look(w, node_ip="n")
    assert (seen.hf_same, seen.load_same, seen.save_same) == (False, False, False)
    # an empty directory is never "the same" as a missing one
    assert not look(Wanted(hf_dir=str(tmp_path / "nope")), node_ip="n").hf_same


def test_decide_sends_from_rank0_or_refuses_with_node_rank_path_and_fix() -> None:
    w = Wanted(hf_dir="/run/warmstart", hf_listing=(("config.json", 1),))
    kw = {"hf_flag": "the warm start", "load": None, "save": None}
    assert decide(w, [Seen(node_ip="10.0.0.1"), Seen(node_ip="10.0.0.2")], **kw) == []
    far = [Seen(node_ip="10.0.0.1"), Seen(node_ip="10.0.0.2", hf_same=False)]
    assert decide(w, far, **kw) == ["10.0.0.2"]  # its rank receives them from rank 0
    with pytest.raises(NodePathError) as e:
        decide(w, [Seen(node_ip="10.0.0.1", hf_same=False), Seen(node_ip="10.0.0.2")], **kw)
    msg = str(e.value)
    assert "rank 0 on node 10.0.0.1" in msg and "/run/warmstart" in msg and "copy" in msg, msg

    w = Wanted(load_meta="/ck/iter_0000004/meta.json", save_probe="/ck/.probe")
    seen = [Seen(node_ip="10.0.0.1"), Seen(node_ip="10.0.0.2", load_same=False, save_same=False)]
    with pytest.raises(NodePathError) as e:
        decide(w, seen, hf_flag="--hf-checkpoint", load="/ck", save="/ck")
    msg = str(e.value)
    assert "rank 1 on node 10.0.0.2" in msg and "--load /ck" in msg and "--save /ck" in msg
    assert "mounts at the same path" in msg, msg


def test_rank0_must_see_the_run_directory() -> None:
    w = Wanted(run_probe="/runs/r1/.probe")
    kw = {"hf_flag": "--hf-checkpoint", "load": None, "save": None}
    assert decide(w, [Seen(node_ip="a"), Seen(node_ip="b", run_same=False)], **kw) == []
    with pytest.raises(NodePathError) as e:
        decide(w, [Seen(node_ip="b", run_same=False), Seen(node_ip="a")], **kw)
    assert "rank 0 on node b does not see the run directory /runs/r1" in str(e.value)


def _rank(rank: int, port: int, src: str, out: str) -> None:
    from slime_async.trainer.share import broadcast_hf_weights

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # rank 1 is given a path that does not exist on its "node": it never reads it
        path = src if rank == 0 else src + "-not-on-this-node"
        try:
            w = broadcast_hf_weights(path, rank=rank)
            torch.save({"version": w.version, "spec": w.spec.to_dict(), **w.tensors}, out)
        except FileNotFoundError as e:
            Path(out).write_text(f"error: {e}")
    finally:
        dist.destroy_process_group()


def _spawn(src: Path, tmp_path: Path) -> list[Path]:
    from slime_async.host import free_port

    port, outs = free_port(), [tmp_path / f"r{r}.out" for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, str(src), str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        assert p.exitcode == 0
    return outs


def test_rank0_sends_the_start_weights_to_a_rank_without_them(tmp_path: Path) -> None:
    w = _hf_dir(tmp_path / "hf")
    for out in _spawn(tmp_path / "hf", tmp_path):
        got = torch.load(out, weights_only=True)
        assert got.pop("version") == 3 and ModelSpec.from_dict(got.pop("spec")) == SPEC
        assert set(got) == set(w.tensors)
        assert all(torch.equal(got[k], w.tensors[k]) for k in got)


def test_rank0_that_cannot_read_fails_every_rank_with_its_reason(tmp_path: Path) -> None:
    outs = _spawn(tmp_path / "missing", tmp_path)
    texts = [o.read_text() for o in outs]
    assert all("trainer rank 0 could not read" in t and "config.json" in t for t in texts), texts
    assert os.path.exists(outs[1])
