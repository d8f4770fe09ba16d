"""Trainer offload (world size 1, the tiny default): a trainer that sleeps between its steps
(parameters, gradients and optimizer state written out and freed, the newest version kept in
the CPU weight cache) trains on exactly as one that never slept: the same losses and the same
parameters, bit for bit."""

from __future__ import annotations

import pytest
import torch

from slime_async.contracts.model import TINY_MOE

pytestmark = pytest.mark.timeout(150)
torch.set_num_threads(1)


def _trainer():
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    return MegatronTrainer(TrainerConfig(lr=2e-3, micro_batch_size=2, seed=3), TINY_MOE)


def _batch(seed: int):
    from slime_async.trainer.testing import random_batch

    return random_batch(TINY_MOE, batch=8, width=20, prompt=6, seed=seed)


def _params(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def test_a_trainer_that_slept_trains_exactly_as_one_that_never_did(tmp_path) -> None:
    b1, b2 = _batch(2), _batch(3)
    awake = _trainer()
    ref = [awake.train_step(b1)["loss/total"], awake.train_step(b2)["loss/total"]]
    want = _params(awake)
    awake.shutdown()

    tr = _trainer()
    tr.offload.spill_dir = str(tmp_path)
    got = [tr.train_step(b1)["loss/total"]]
    params_bytes = sum(p.numel() * p.element_size() for p in tr.model.parameters())
    freed = tr.sleep()
    # parameters, their gradients, Adam's two moments: well over twice the parameters' bytes
    assert freed > 2.5 * params_bytes
    assert all(p.untyped_storage().nbytes() == 0 for p in tr.model.parameters())
    assert len(list(tmp_path.iterdir())) == 1  # the spill file
    cached = tr.weight_cache.weights
    assert cached is not None and cached.version == 1 == tr.weight_cache.version
    tr.wake()
    assert list(tmp_path.iterdir()) == []
    assert tr.export_weights().tensors.keys() == cached.tensors.keys()
    assert all(torch.equal(v, cached.tensors[k]) for k, v in tr.export_weights().tensors.items())
    got.append(tr.train_step(b2)["loss/total"])
    assert got == ref
    have = _params(tr)
    assert all(torch.equal(have[k], want[k]) for k in want)
    tr.sleep()  # again, after the last step: a second cycle restores as well
    tr.wake()
    assert all(torch.equal(p, want[n]) for n, p in tr.model.named_parameters())
    tr.shutdown()
