"""`--ckpt-format torch_dist` at world size 2 (gloo processes, one torch thread each).

A DP2 (distributed optimizer, fp32) and a TP2 (bf16: fp32 main parameters too) checkpoint
resume bit-exactly at the same layout: the weights, Adam moments and step equal the saved
ones (`torch.equal`, gathered HF-named) and the next train step gives the same loss and
weights. At DP1 (a changed layout; the plain optimizer) the loaded state is again bit-equal
(dist_checkpointing reads each element from where it was saved); the next step then differs
only by the order of DP/TP reductions: the loss and weights ≤ 1e-5 in fp32; under bf16 the
loss ≤ 1e-4 (the weights are not compared: TP's bf16 partial sums change gradients near zero,
which Adam turns into ±lr steps; that is the layout's arithmetic, not the checkpoint's).
Checkpoints of the torch format are covered
in tests/test_trainer_train.py and tests/test_trainer_dist.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from slime_async.contracts.model import TINY_MOE

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

LAYOUTS = {"dp2": dict(), "tp2": dict(tensor_model_parallel_size=2, bf16=True)}
PRECISION = {"dp2": dict(), "tp2": dict(bf16=True)}  # what a DP1 resume needs


def _cfg(**kw):
    from slime_async.trainer.config import TrainerConfig

    base = dict(lr=1e-3, micro_batch_size=4, seed=5, clip_grad=0.0, adam_eps=1e-4)
    return TrainerConfig(**{**base, **kw})


def _batch():
    from slime_async.trainer.testing import random_batch

    return random_batch(TINY_MOE, batch=4, width=12, prompt=4, seed=9, lengths=[12, 9, 7, 10])


def _state(tr) -> dict[str, object]:
    """Gathered, HF-named weights and Adam state and the step (collective)."""
    from slime_async.trainer import checkpoint

    moments, step = checkpoint._optimizer_moments(tr)
    return {"w": tr.export_weights().tensors, "m": moments, "step": step, "v": tr.version}


def _assert_equal(got, want, where: str) -> None:
    assert (got["step"], got["v"]) == (want["step"], want["v"]), where
    for k, t in want["w"].items():
        assert torch.equal(got["w"][k], t), (where, k)
    assert got["m"].keys() == want["m"].keys(), where
    for key, tensors in want["m"].items():
        for k, t in tensors.items():
            assert torch.equal(got["m"][key][k], t), (where, key, k)


def _worker(rank: int, world: int, port: int, out: str, name: str) -> None:
    torch.set_num_threads(1)
    from slime_async.trainer.trainer import MegatronTrainer

    b = _batch()
    results = {}
    kw = LAYOUTS[name]
    save = os.path.join(out, f"ck_{name}")
    tr = MegatronTrainer(
        _cfg(save=save, **kw), TINY_MOE, rank=rank, world_size=world, master_port=port
    )
    tr.train_step(b)
    tr.train_step(b)
    tr.save_checkpoint()
    saved = _state(tr)
    loss = tr.train_step(b)["loss/total"]
    after = _state(tr)
    tr.shutdown()
    again = MegatronTrainer(
        _cfg(load=save, **kw), TINY_MOE, rank=rank, world_size=world, master_port=port
    )
    _assert_equal(_state(again), saved, f"{name} resumed at {name}")
    assert again.train_step(b)["loss/total"] == loss, name
    _assert_equal(_state(again), after, f"{name} resumed at {name}, one step on")
    again.shutdown()
    results[name] = {"saved": saved, "after": after, "loss": loss}
    if rank == 0:
        torch.save(results, os.path.join(out, "results.pt"))


@pytest.mark.parametrize("name", ["dp2", pytest.param("tp2", marks=pytest.mark.slow)])
def test_torch_dist_resumes_exactly_at_same_and_changed_layout(tmp_path, name):
    from slime_async.trainer.trainer import MegatronTrainer, free_port

    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), name), nprocs=2, join=True)
    res = torch.load(tmp_path / "results.pt", weights_only=True)
    b = _batch()
    meta = (Path(tmp_path) / f"ck_{name}" / "iter_0000002" / "meta.json").read_text()
    assert '"ckpt_format": "torch_dist"' in meta
    tr = MegatronTrainer(_cfg(load=str(tmp_path / f"ck_{name}"), **PRECISION[name]), TINY_MOE)
    assert tr.layout.dp == 1 and not tr.optim.distributed
    _assert_equal(_state(tr), res[name]["saved"], f"{name} resumed at DP1")
    bf16 = tr.optim.bf16
    loss = tr.train_step(b)["loss/total"]
    assert abs(loss - res[name]["loss"]) <= (1e-4 if bf16 else 1e-5), name
    got = tr.export_weights().tensors
    for k, want in res[name]["after"]["w"].items() if not bf16 else ():
        assert (got[k] - want).abs().max() <= 1e-5, (name, k)  # reductions in another order
    tr.shutdown()
