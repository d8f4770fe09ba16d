"""Trainer model build, HF export/import and routing replay (single process, world size 1)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.contracts.weights import HFWeights

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

LLAMA = ModelSpec(family="llama", num_layers=2)


@pytest.fixture(scope="module")
def moe_trainer():
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    tr = MegatronTrainer(TrainerConfig(lr=3e-3, micro_batch_size=4, seed=7), TINY_MOE)
    batch = random_batch(TINY_MOE, batch=8, width=24, prompt=8, seed=3)
    for _ in range(3):  # a few steps so the distribution is no longer uniform
        tr.train_step(batch)
    return tr


def _routing_sets(
    caps: list[torch.Tensor], bsz: int, width: int, *, packed: bool = True
) -> torch.Tensor:
    """megatron routing maps per layer → [B, T, L, E] bool. Packed (THD, one row of equally
    long samples): [B*T, E] sample after sample; padded: seq-major [T*B, E]."""
    if packed:
        return torch.stack([c.view(bsz, width, -1) for c in caps], 2)
    return torch.stack([c.view(width, bsz, -1).permute(1, 0, 2) for c in caps], 2)


def _ids_to_sets(routed: list[np.ndarray], num_experts: int) -> torch.Tensor:
    out = []
    for r in routed:
        t = torch.zeros(*r.shape[:2], num_experts, dtype=torch.bool)
        t.scatter_(-1, torch.from_numpy(r.astype(np.int64)), True)
        out.append(t)
    return torch.stack(out)


def test_fp32_megatron_matches_fp32_hf_of_export(moe_trainer, tmp_path):
    from slime_async.trainer.replay import capture_routing
    from slime_async.trainer.testing import hf_teacher_forced, load_hf

    tr = moe_trainer
    out = tr.save_weights(tmp_path / "w")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    hf = load_hf(out, torch.float32)  # from_pretrained must accept what we wrote
    tokens = torch.randint(
        0, TINY_MOE.vocab_size, (4, 40), generator=torch.Generator().manual_seed(1)
    )
    from slime_async.contracts.batch import TrainerBatch

    batch = TrainerBatch.from_lists(
        tokens=tokens.tolist(),
        prompt_lengths=[1] * 4,
        rollout_logprobs=[[0.0] * 39] * 4,
        advantages=[0.0] * 4,
        versions=[0] * 4,
    )
    caps: list[torch.Tensor] = []
    with capture_routing(tr.model, caps):
        lp_meg, ent = tr.compute_logprobs(batch)
    lp_hf, routed_hf = hf_teacher_forced(hf, TINY_MOE, tokens)
    assert (lp_meg - lp_hf).abs().max().item() <= 1e-5
    assert lp_meg[:, 1:].std() > 0.05  # not a uniform model: the comparison has teeth
    meg_sets = _routing_sets(caps, 4, 40)[:, :-1]
    assert torch.equal(meg_sets, _ids_to_sets(routed_hf, TINY_MOE.num_experts))
    assert ent.shape == (4, 40) and (ent[:, 1:] > 0).all()


def test_llama_export_import_roundtrip(tmp_path):
    from slime_async.trainer import hf_convert, parallel, weights_io
    from slime_async.trainer.forward import model_logits, token_logprobs
    from slime_async.trainer.model import build_model
    from slime_async.trainer.testing import hf_teacher_forced, load_hf
    from slime_async.trainer.trainer import free_port

    parallel.init_distributed(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    layout = parallel.resolve_layout(world_size=1, tp=1, ep=1, pp=1)
    parallel.init_model_parallel(layout, seed=11)
    model = build_model(LLAMA, layout)
    w = HFWeights(version=5, spec=LLAMA, tensors=hf_convert.megatron_to_hf(model, LLAMA))
    d = weights_io.write_hf_dir(w, tmp_path / "llama")
    assert not list(tmp_path.glob(".*tmp*"))  # the temp dir was renamed away
    back = weights_io.read_hf_dir(d)
    assert back.version == 5 and back.spec == LLAMA
    model2 = build_model(LLAMA, layout)
    hf_convert.hf_to_megatron(model2, LLAMA, back.tensors)
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(a, b), n
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 16))
    with torch.no_grad():
        lp, _ = token_logprobs(model_logits(model2, tokens), tokens)
    lp_hf, _ = hf_teacher_forced(load_hf(d, torch.float32), LLAMA, tokens)
    assert (lp - lp_hf).abs().max().item() <= 1e-5


def test_a_one_file_version_maps_in_place_and_imports_in_its_own_dtype(tmp_path):
    """The one-file hand-off (`write_tensor_file` / `map_tensor_file`): a safetensors file
    (safetensors reads it), mapped as views in the written dtype and removed once mapped; the
    import takes one tensor at a time in that dtype (no fp32 copy of a bf16 model), and gives
    the parameters the values written."""
    from safetensors import safe_open

    from slime_async.trainer import hf_convert, parallel, weights_io
    from slime_async.trainer.model import build_model
    from slime_async.trainer.trainer import free_port

    parallel.init_distributed(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    layout = parallel.resolve_layout(world_size=1, tp=1, ep=1, pp=1)
    parallel.init_model_parallel(layout, seed=11)
    model = build_model(LLAMA, layout)
    views = hf_convert.megatron_to_hf(model, LLAMA, copy=False)
    path = tmp_path / "v3.safetensors"
    n = weights_io.write_tensor_file(
        views, path, dtype=torch.bfloat16, metadata={"weight_version": "3"}
    )
    params = sum(t.numel() for t in views.values())
    assert n == path.stat().st_size and 2 * params < n < 2 * params + 64 * 1024
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(views) and f.metadata()["weight_version"] == "3"
        k = next(iter(views))
        assert torch.equal(f.get_tensor(k), views[k].to(torch.bfloat16))
    mapped, meta = weights_io.map_tensor_file(path, unlink=True)
    assert meta["weight_version"] == "3" and not path.exists()
    assert all(t.dtype == torch.bfloat16 for t in mapped.values())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    first = next(hf_convert._iter_shards(mapped, LLAMA, shapes, upcast=False))[1]
    assert first.dtype == torch.bfloat16  # as written: no fp32 copy on the way in
    model2 = build_model(LLAMA, layout)
    hf_convert.hf_to_megatron(model2, LLAMA, mapped)
    for (name, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name


def test_a_push_packs_the_parameters_without_copying_the_model(moe_trainer):
    """What `send_weights` broadcasts: the export without copies (views of the parameters but
    for q/k/v, which megatron interleaves) packs into exactly the bytes of the copying fp32
    export, in fp32 and in bf16 on the wire, bucket by bucket."""
    from slime_async.contracts.weight_buckets import in_dtype, pack_bucket, plan_buckets

    tr = moe_trainer
    ref, views = tr.export_weights(), tr.export_weights(copy=False)
    assert ref.tensors.keys() == views.tensors.keys()
    live = {p.untyped_storage().data_ptr() for c in tr.chunks for p in c.parameters()}
    copied = [k for k, t in views.tensors.items() if t.untyped_storage().data_ptr() not in live]
    assert copied and all(re.search(r"\.self_attn\.[qkv]_proj\.", k) for k in copied), copied
    assert all(t.untyped_storage().data_ptr() not in live for t in ref.tensors.values())
    for dtype in (None, "bfloat16"):
        buckets = plan_buckets(in_dtype(ref.manifest(), dtype), 64 * 1024)
        assert len(buckets) > 3
        for b in buckets:
            want, want_crc = pack_bucket(ref.tensors, b, "cpu")
            got, crc = pack_bucket(views.tensors, b, "cpu")
            assert torch.equal(got, want) and crc == want_crc, [e.name for e in b]


def test_import_refuses_other_family_and_missing_tensors(moe_trainer, tmp_path):
    from slime_async.trainer import hf_convert, weights_io
    from slime_async.trainer.checkpoint import CheckpointError

    w = moe_trainer.export_weights()
    bad = dict(w.tensors)
    bad.pop("model.norm.weight")
    with pytest.raises(KeyError, match=r"missing tensor 'model.norm.weight'"):
        hf_convert.hf_to_megatron(moe_trainer.model, TINY_MOE, bad)
    other = ModelSpec(hidden_size=64, head_dim=16)
    d = weights_io.write_hf_dir(HFWeights(version=1, spec=other, tensors={}), tmp_path / "o")
    with pytest.raises(CheckpointError, match=r"another model config.*hidden_size"):
        moe_trainer.import_hf(d)
    with pytest.raises(FileNotFoundError, match=r"config.json is missing"):
        weights_io.read_hf_dir(tmp_path)


def test_hf_fused_expert_names_are_accepted(moe_trainer):
    from slime_async.trainer import hf_convert

    full = moe_trainer.export_weights().tensors
    fused = {k: v for k, v in full.items() if ".experts." not in k}
    for i in range(TINY_MOE.num_layers):
        pre = f"model.layers.{i}.mlp.experts."
        e = range(TINY_MOE.num_experts)
        fused[pre + "gate_up_proj"] = torch.stack(
            [
                torch.cat([full[f"{pre}{j}.gate_proj.weight"], full[f"{pre}{j}.up_proj.weight"]])
                for j in e
            ]
        )
        fused[pre + "down_proj"] = torch.stack([full[f"{pre}{j}.down_proj.weight"] for j in e])
    shapes = {n: tuple(p.shape) for n, p in moe_trainer.model.named_parameters()}
    a = hf_convert.hf_to_megatron_tensors(full, TINY_MOE, shapes)
    b = hf_convert.hf_to_megatron_tensors(fused, TINY_MOE, shapes)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_r3_replays_bf16_engine_routing_exactly(moe_trainer, tmp_path):
    """Engine = HF bf16 sampling with router hooks; trainer routing under R3 equals it."""
    import dataclasses

    from slime_async.trainer.replay import RoutingReplay, capture_routing
    from slime_async.trainer.testing import hf_sample, load_hf, rollout_batch

    tr = moe_trainer
    hf = load_hf(tr.save_weights(tmp_path / "w"), torch.bfloat16)
    prompts = torch.randint(
        0, TINY_MOE.vocab_size, (4, 6), generator=torch.Generator().manual_seed(5)
    )
    ro = hf_sample(hf, TINY_MOE, prompts, max_new_tokens=12, seed=2)
    batch = rollout_batch(ro, advantages=[1.0, -1.0, 1.0, -1.0])
    bsz, width = batch.tokens.shape
    engine = _ids_to_sets(ro.routed_experts, TINY_MOE.num_experts)
    old = tr.cfg
    try:
        tr.cfg = dataclasses.replace(old, routing_replay=RoutingReplay.NONE)
        caps: list[torch.Tensor] = []
        with capture_routing(tr.model, caps):
            lp_free, _ = tr.compute_logprobs(batch)
        free = _routing_sets(caps, bsz, width)[:, :-1]
        tr.cfg = dataclasses.replace(old, routing_replay=RoutingReplay.R3)
        caps = []
        with capture_routing(tr.model, caps):
            lp_r3, _ = tr.compute_logprobs(batch)
        replayed = _routing_sets(caps, bsz, width)[:, :-1]
        # an "engine" that routes at random: replay must follow it too (the test has teeth
        # even where fp32 and bf16 happen to agree)
        rng = np.random.default_rng(0)
        fake = [
            np.stack([rng.permutation(4)[:2] for _ in range(r.shape[0] * r.shape[1])]).reshape(
                r.shape
            )
            for r in ro.routed_experts
        ]
        caps = []
        with capture_routing(tr.model, caps):
            tr.compute_logprobs(dataclasses.replace(batch, routed_experts=tuple(fake)))
        forced = _routing_sets(caps, bsz, width)[:, :-1]
    finally:
        tr.cfg = old
    assert torch.equal(replayed, engine)  # exactly the engine's experts, every token and layer
    assert torch.equal(forced, _ids_to_sets(fake, 4))
    assert not torch.equal(forced, free)
    assert torch.isfinite(lp_r3).all()
    assert (lp_r3 - lp_free).abs().mean() < 0.05


def test_engine_routing_layout_padding_and_sp_slices():
    from slime_async.trainer.replay import engine_routing_to_replay

    spec = ModelSpec(num_layers=3, num_experts=4, moe_topk=2)
    a = np.arange(3 * 3 * 2).reshape(3, 3, 2) % 4  # sample 0: 3 rows
    b = (np.arange(1 * 3 * 2).reshape(1, 3, 2) + 1) % 4  # sample 1: 1 row
    full = engine_routing_to_replay([a, b], spec=spec, width=4)
    assert len(full) == 3 and full[0].shape == (8, 2)
    # seq-major: row s*B + b
    assert full[1][0 * 2 + 0].tolist() == a[0, 1].tolist()
    assert full[1][2 * 2 + 0].tolist() == a[2, 1].tolist()
    assert full[2][0 * 2 + 1].tolist() == b[0, 2].tolist()
    assert full[0][3 * 2 + 0].tolist() == [0, 1]  # padded row: synthetic distinct ids
    halves = [engine_routing_to_replay([a, b], spec=spec, width=4, tp=2, tp_rank=r) for r in (0, 1)]
    for layer in range(3):
        assert torch.equal(torch.cat([halves[0][layer], halves[1][layer]]), full[layer])
    with pytest.raises(ValueError, match="expected \\[T-1, 3, 2\\]"):
        engine_routing_to_replay([a[:, :2]], spec=spec, width=4)
    with pytest.raises(ValueError, match="outside \\[0, 4\\)"):
        engine_routing_to_replay([a + 4], spec=spec, width=4)


def test_batch_validation_messages():
    from slime_async.contracts.batch import TrainerBatch

    with pytest.raises(ValueError, match="1 log-probs for 2 tokens"):
        TrainerBatch.from_lists(
            tokens=[[1, 2, 3]],
            prompt_lengths=[1],
            rollout_logprobs=[[0.0]],
            advantages=[1.0],
            versions=[0],
        )
    ok = TrainerBatch.from_lists(
        tokens=[[1, 2, 3], [4, 5]],
        prompt_lengths=[1, 1],
        rollout_logprobs=[[0.1, 0.2], [0.3]],
        advantages=[1.0, -1.0],
        versions=[[3, 4], [4]],
    )
    assert ok.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    assert ok.token_versions.tolist() == [[-1, 3, 4], [-1, 4, -1]]
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 3"):
        ok.dp_shard(0, 3)
    with pytest.raises(ValueError, match="routed_experts\\[0\\] has shape"):
        TrainerBatch.from_lists(
            tokens=[[1, 2, 3]],
            prompt_lengths=[1],
            rollout_logprobs=[[0.0, 0.0]],
            advantages=[1.0],
            versions=[0],
            routed_experts=[np.zeros((3, 2, 2), dtype=np.int32)],
        )


@pytest.mark.parametrize(
    "spec",
    [
        TINY_MOE,
        LLAMA,
        ModelSpec(family="llama", tie_word_embeddings=True),
        ModelSpec(family="qwen2", hidden_size=128, head_dim=32),
        ModelSpec(family="qwen3"),
        ModelSpec(family="mistral"),
        ModelSpec(family="llama", rope_scaling="llama3", rope_original_max_position_embeddings=512),
    ],
)
def test_hf_shapes_match_what_save_pretrained_writes(spec, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from slime_async.trainer.hf_convert import hf_shapes

    AutoModelForCausalLM.from_config(spec.to_hf_config()).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert written == hf_shapes(spec)


def test_layout_errors_say_what_to_change():
    from slime_async.trainer.parallel import resolve_layout

    assert resolve_layout(world_size=4, tp=2, ep=1, pp=1).dp == 2
    assert resolve_layout(world_size=2, tp=1, ep=1, pp=2).dp == 1
    with pytest.raises(ValueError, match="not divisible by tp\\*pp=2"):
        resolve_layout(world_size=3, tp=2, ep=1, pp=1)
    with pytest.raises(ValueError, match="tensor-parallel size 2 x expert parallel size 2"):
        resolve_layout(world_size=2, tp=2, ep=2, pp=1)  # ETP = TP: EP divides DP
    lay = resolve_layout(world_size=2, tp=2, ep=2, pp=1, etp=1)  # ETP apart: ETP x EP x PP
    assert (lay.dp, lay.etp) == (1, 1)


def test_trainer_config_flags_schedule_and_errors():
    import argparse

    from slime_async.trainer.config import (
        TrainerConfig,
        add_trainer_args,
        trainer_config_from_args,
    )
    from slime_async.trainer.optim import lr_at
    from slime_async.trainer.replay import RoutingReplay

    p = add_trainer_args(argparse.ArgumentParser())
    args = p.parse_args(
        [
            "--use-rollout-routing-replay",
            "--keep-old-actor",
            "--lr",
            "2e-3",
            "--lr-warmup-iters",
            "2",
            "--lr-decay-iters",
            "4",
            "--lr-decay-style",
            "cosine",
            "--min-lr",
            "1e-4",
        ]
    )
    cfg = trainer_config_from_args(args)
    assert cfg.routing_replay is RoutingReplay.R3 and cfg.keep_old_actor
    # megatron's OptimizerParamScheduler: update k uses the LR at step k (warmup from
    # --lr-warmup-init, 0 here), cosine decay over steps 2..4, then min_lr
    lrs = [lr_at(s, cfg) for s in range(8)]
    assert lrs[:3] == pytest.approx([0.0, 1e-3, 2e-3])
    assert lrs[3] == pytest.approx((2e-3 + 1e-4) / 2) and lrs[4:] == pytest.approx([1e-4] * 4)
    warm = trainer_config_from_args(
        p.parse_args(["--lr-warmup-iters", "2", "--lr-warmup-init", "5e-5"])
    )
    assert [lr_at(s, warm) for s in range(3)] == pytest.approx([5e-5, 7.5e-5, 1e-4])
    with pytest.raises(ValueError, match="needs lr_decay_steps"):
        TrainerConfig(lr_decay_style="linear")
    with pytest.raises(ValueError, match=r"routing_replay='r4' .* none, r2, r3"):
        TrainerConfig(routing_replay="r4")


def test_bf16_export_loads_in_transformers(moe_trainer, tmp_path):
    from slime_async.trainer.testing import load_hf
    from slime_async.trainer.weights_io import read_hf_dir

    d = moe_trainer.save_weights(tmp_path / "bf16", dtype=torch.bfloat16)
    back = read_hf_dir(d)
    assert back.version == moe_trainer.version
    assert {t.dtype for t in back.tensors.values()} == {torch.bfloat16}
    hf = load_hf(d, torch.bfloat16)
    ref = moe_trainer.export_weights().tensors["model.norm.weight"].to(torch.bfloat16)
    assert torch.equal(hf.model.norm.weight.detach(), ref)
