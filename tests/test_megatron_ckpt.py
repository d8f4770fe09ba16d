"""Weights from outside this project (`slime_async/trainer/megatron_ckpt.py`): a Megatron torch_dist
checkpoint in slime's converter's layout (`latest_checkpointed_iteration.txt` naming `release/`,
a dist_checkpointing directory of the model's sharded keys, bf16) or an HF directory, told apart
by what the directory holds; the torch_dist weights load into the trainer (--load, --ref-load)
exactly, and one of another architecture is refused naming it."""

from __future__ import annotations

import argparse
import fractions
import json
from pathlib import Path

import pytest
import torch

from loss import LossSelection
from loss.regularizers import RegularizerConfig
from slime_async.contracts.model import TINY_MOE
from slime_async.trainer.megatron_ckpt import TRACKER, WeightsDir, weights_dir

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)


def _trainer(spec=TINY_MOE, **kw):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    return MegatronTrainer(TrainerConfig(micro_batch_size=2, seed=kw.pop("seed", 3), **kw), spec)


def _slime_converted(tr, root: Path) -> Path:
    """What slime's convert_hf_to_torch_dist script leaves: the tracker file saying `release`, and
    `release/` written by megatron's dist_checkpointing from the model's sharded state dict."""
    from megatron.core import dist_checkpointing

    from slime_async.trainer.dist_ckpt import model_state

    (root / "release").mkdir(parents=True)
    (root / TRACKER).write_text("release")
    state = {
        "model": model_state(tr.chunks[0]),
        # Megatron's save_checkpoint also writes its args and counters into common.pt: pickled
        # objects, some of which torch.load(weights_only=True) refuses; never read here
        "args": argparse.Namespace(num_layers=2, hidden_size=128, extra=fractions.Fraction(1, 3)),
        "checkpoint_version": 3.0,
        "iteration": 1,
    }
    dist_checkpointing.save(state, str(root / "release"))
    return root


def _params(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in tr.model.named_parameters()}


def test_a_slime_torch_dist_checkpoint_loads_into_the_trainer(tmp_path):
    source = _trainer(bf16=True, seed=11)  # slime converts in bf16
    want = _params(source)
    ckpt = _slime_converted(source, tmp_path / "Qwen3-tiny_torch_dist")
    source.shutdown()

    found = weights_dir(ckpt)
    assert found == WeightsDir("torch_dist", ckpt / "release", "release")
    # --load naming slime's checkpoint (a new run from its weights) with it as --ref-load too
    kl = LossSelection(name="ppo", regularizers=RegularizerConfig(kl_coef=1.0, kl_type="k2"))
    started = _trainer(seed=5, start_from=str(ckpt), ref_load=str(ckpt), loss=kl)  # fp32
    got = _params(started)
    assert got.keys() == want.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)  # the bf16 values, exactly
    assert started.version == 0
    assert abs(started.train_step(_batch())["loss/kl_ref"]) < 1e-9  # π_θ = π_ref: same weights
    started.shutdown()
    other = _trainer(seed=5, ref_load=str(ckpt), loss=kl)  # its own initial weights
    assert any(not torch.equal(want[n], p) for n, p in _params(other).items())
    assert other.train_step(_batch())["loss/kl_ref"] > 1e-4
    other.shutdown()


def _batch():
    from slime_async.trainer.testing import random_batch

    return random_batch(TINY_MOE, batch=4, width=12, prompt=4, seed=0)


def test_a_checkpoint_of_another_model_is_refused_naming_it(tmp_path):
    import dataclasses

    other = _trainer(dataclasses.replace(TINY_MOE, hidden_size=64, head_dim=16))
    ckpt = _slime_converted(other, tmp_path / "other")
    other.shutdown()
    tr = _trainer()
    with pytest.raises(ValueError, match=r"release: its tensors do not fit this model"):
        tr.import_weights_dir(ckpt)
    tr.shutdown()


def _dist(path: Path, backend: str = "torch_dist") -> Path:
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": backend}))
    return path


@pytest.mark.parametrize(
    ("layout", "expect"),
    [
        ({TRACKER: "release", "release/": "dist"}, ("torch_dist", "release")),
        ({TRACKER: "20", "iter_0000020/": "dist"}, ("torch_dist", "iter_0000020")),
        ({"metadata.json": json.dumps({"sharded_backend": "torch_dist"})}, ("torch_dist", "")),
        ({"config.json": "{}", "model.safetensors": ""}, ("hf", "")),
        ({TRACKER: "20"}, "names iteration 20, but"),
        ({TRACKER: "latest", "release/": "dist"}, "not an iteration number or 'release'"),
        ({TRACKER: "release", "release/mp_rank_00/": "x"}, "legacy torch format"),
        ({TRACKER: "release", "release/": "zarr"}, "sharded_backend 'zarr'"),
        ({"config.json": "{}"}, "a config.json but no weights"),
        ({"notes.txt": ""}, "is neither a Hugging Face directory"),
    ],
)
def test_weights_dirs_are_told_apart(tmp_path, layout, expect):
    root = tmp_path / "w"
    root.mkdir()
    for name, content in layout.items():
        if name.endswith("/"):
            sub = root / name.rstrip("/")
            if content in ("dist", "zarr"):
                _dist(sub, "torch_dist" if content == "dist" else content)
            else:
                sub.mkdir(parents=True)
        else:
            (root / name).write_text(content)
    found = weights_dir(root)
    if isinstance(expect, str):
        assert isinstance(found, str) and expect in found, found
    else:
        kind, sub = expect
        assert isinstance(found, WeightsDir) and found.kind == kind, found
        assert found.path == (root / sub if sub else root)
