"""Qwen3-VL from a shrunk copy of its published config (Qwen3-VL-4B-Instruct's): parse-time
acceptance, the vision tower with its DeepStack mergers and the interleaved mRoPE positions
against `transformers`, trainer logits and per-token log-probs vs HF on two images of different
sizes (packed and padded), the HF → trainer → HF round trip bit for bit (through `--save-hf`'s
writer), and the engine's greedy tokens equal to HF `generate` with images."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import aiohttp
import pytest
import torch

from slime_async.contracts.model import ModelSpec
from tests.test_vl_family import LOGIT_TOL
from tests.vl_inputs import CONFIGS, image_prompt, seeded_vl
from tests.vl_inputs import random_png as _png
from tests.vl_inputs import raw_config as _raw

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)
GRIDS = [(1, 8, 12), (1, 4, 4)]  # two images of different sizes
NEW = 8


def _hf_model(cfg):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(spec, checkpoint dir, fp32 HF model): a seeded random tiny Qwen3-VL, weights scaled
    up and norms and biases given noise so a mis-mapped or skipped piece shows."""

    def scale(p: torch.Tensor) -> None:
        p.mul_(3.0) if p.ndim > 1 else p.add_(0.1 * torch.randn_like(p))

    return seeded_vl(tmp_path_factory.mktemp("qwen3-vl"), "qwen3-vl-tiny", _hf_model, scale)


def _prompt(spec: ModelSpec) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    return image_prompt(spec, GRIDS)


def test_published_and_tiny_configs_are_read(tmp_path):
    from transformers import AutoConfig

    from slime_async.config import build_parser, read_environment

    spec = ModelSpec.from_hf_config(_raw("qwen3-vl-4b"))
    assert spec == ModelSpec.from_hf_config(
        AutoConfig.from_pretrained(str(CONFIGS / "qwen3-vl-4b"))
    )
    assert (spec.family, spec.hidden_size, spec.num_layers, spec.head_dim) == (
        "qwen3_vl",
        2560,
        36,
        128,
    )
    assert spec.mrope_section == (24, 20, 20) and spec.qk_norm and not spec.qkv_bias
    v = spec.vision
    assert (v.depth, v.hidden_size, v.patch_size, v.num_position_embeddings) == (24, 1024, 16, 2304)
    assert v.deepstack_visual_indexes == (5, 11, 17) and v.qwen3
    for s in (spec, ModelSpec.from_hf_config(_raw("qwen3-vl-tiny"))):
        assert ModelSpec.from_hf_config(s.to_hf_config()) == s
        assert ModelSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    flat = _raw("qwen3-vl-tiny")
    flat["text_config"]["rope_scaling"]["mrope_interleaved"] = False
    with pytest.raises(ValueError, match="mrope_interleaved"):
        ModelSpec.from_hf_config(flat)
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_raw("qwen3-vl-tiny")))
    args = build_parser().parse_args(["--hf-checkpoint", str(d), "--run-dir", str(tmp_path / "r")])
    assert read_environment(args).model.family == "qwen3_vl"
    (d / "config.json").write_text(
        json.dumps({**_raw("qwen3-vl-tiny"), "model_type": "qwen3_vl_moe"})
    )
    with pytest.raises(ValueError) as err:
        read_environment(args)
    assert "\n" not in str(err.value) and "qwen3_vl_moe" in str(err.value)


def test_vision_tower_and_deepstack_equal_hf(vl):
    from slime_async.config.memory_plan import param_count
    from slime_async.trainer.towers import build_tower

    spec, _, hf = vl
    tower = build_tower(spec.vision)
    pre = "model.visual."
    tower.load_state_dict(
        {k[len(pre) :]: v for k, v in hf.state_dict().items() if k.startswith(pre)}
    )
    _, pixels, grids = _prompt(spec)
    with torch.no_grad():
        theirs = hf.model.visual(pixels, grid_thw=grids)
        ours, deep = tower(pixels, grids)
    assert (ours - theirs.pooler_output).abs().max().item() <= 1e-6
    assert len(deep) == len(theirs.deepstack_features) == 2
    for a, b in zip(deep, theirs.deepstack_features):
        assert (a - b).abs().max().item() <= 1e-6
    assert param_count(spec) == sum(p.numel() for p in hf.parameters())


def test_mrope_positions_equal_hf_rope_index(vl):
    from slime_async.contracts.vision import mrope_positions
    from slime_async.trainer.deepstack import interleaved_axes

    spec, _, hf = vl
    ids, _, grids = _prompt(spec)
    x = torch.tensor([ids])
    theirs, delta = hf.model.get_rope_index(x, (x == spec.vision.image_token_id).int(), grids)
    ours, our_delta = mrope_positions(ids, GRIDS, spec.vision)
    assert torch.equal(ours, theirs[:, 0]) and our_delta == int(delta)
    assert interleaved_axes((24, 20, 20), 64)[:9].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert interleaved_axes((24, 20, 20), 64)[60:].tolist() == [0, 0, 0, 0]


def test_trainer_logits_equal_hf_and_weights_round_trip(vl, tmp_path):
    from safetensors.torch import load_file
    from transformers import Qwen3VLForConditionalGeneration

    from slime_async.contracts.vision import mrope_positions
    from slime_async.trainer import lm_head, weights_io
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer
    from slime_async.trainer.vl_inputs import vl_forward

    spec, ckpt, hf = vl
    tr = MegatronTrainer(TrainerConfig(seed=3, hf_checkpoint=str(ckpt)), spec)
    ids, pixels, grids = _prompt(spec)
    x = torch.tensor([ids])
    pos, _ = mrope_positions(ids, GRIDS, spec.vision)
    mm = (x == spec.vision.image_token_id).int()
    with torch.no_grad():
        theirs = hf(input_ids=x, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=mm)
        theirs = theirs.logits.float()
        out = vl_forward(tr.model, x, pos[:, None], pixels, grids)
        ours = lm_head.full_logits(out, lm_head.output_weight(tr.model), lm_head.tp_group())
        assert len(tr.model._deepstack) == 2  # both DeepStack layers get features
        bias = tr.model.vision.deepstack_merger_list[0].linear_fc2.bias
        kept = bias.clone()
        bias.add_(1.0)  # DeepStack's features reach the language model
        moved = lm_head.full_logits(
            vl_forward(tr.model, x, pos[:, None], pixels, grids),
            lm_head.output_weight(tr.model),
            lm_head.tp_group(),
        )
        bias.copy_(kept)
    diff = (ours.float() - theirs).abs().max().item()
    assert diff <= LOGIT_TOL, diff
    assert theirs.std() > 0.05 and (moved.float() - theirs).abs().max().item() > 100 * LOGIT_TOL
    written = load_file(str(ckpt / "model.safetensors"))
    exported = tr.export_weights()
    assert any(k.startswith("model.visual.deepstack_merger_list.") for k in written)
    assert set(exported.tensors) == set(written)
    for k, v in written.items():
        assert torch.equal(exported.tensors[k], v), k
    out_dir = weights_io.write_hf_dir(exported, tmp_path / "export")
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert ModelSpec.from_hf_config(cfg) == spec
    again = Qwen3VLForConditionalGeneration.from_pretrained(str(out_dir), dtype=torch.float32)
    with torch.no_grad():
        back = again.eval()(
            input_ids=x, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=mm
        )
    assert torch.equal(back.logits.float(), theirs)


def _batch(spec: ModelSpec, hf, *, n_new: int = 6):
    """Two samples (one with two images, one text-only) with HF-sampled responses: (batch,
    HF's per-token log-probs of the responses)."""
    from slime_async.contracts.batch import TrainerBatch
    from slime_async.contracts.vision import SampleImages

    ids, pixels, grids = _prompt(spec)
    x = torch.tensor([ids])
    torch.manual_seed(4)
    kw = dict(pixel_values=pixels, image_grid_thw=grids)
    with torch.no_grad():
        out = hf.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            mm_token_type_ids=(x == spec.vision.image_token_id).int(),
            do_sample=True,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )[0].tolist()
        full = torch.tensor([out])
        mm = (full == spec.vision.image_token_id).int()
        logits = hf(input_ids=full, mm_token_type_ids=mm, **kw).logits[0, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(1, full[0, 1:, None])[:, 0]
    want = lp[len(ids) - 1 :].tolist()
    text = [3, 4, 5, 6, 7, 8, 9]
    batch = TrainerBatch.from_lists(
        tokens=[out, [*text, 11, 12]],
        prompt_lengths=[len(ids), len(text)],
        rollout_logprobs=[want, [0.0, 0.0]],
        advantages=[1.0, -1.0],
        versions=[0, 0],
        images=[SampleImages(pixels=pixels, grids=GRIDS), None],
    )
    return batch, want


@pytest.mark.parametrize("packed", [True, False])
def test_trainer_logprobs_equal_hf_and_a_train_step(vl, packed):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    spec, ckpt, hf = vl
    batch, want = _batch(spec, hf)
    cfg = TrainerConfig(
        seed=3,
        hf_checkpoint=str(ckpt),
        micro_batch_size=2,
        qkv_format="thd" if packed else "bshd",
        lr=1e-3,
    )
    tr = MegatronTrainer(cfg, spec)
    lp, _ = tr.compute_logprobs(batch)
    got = lp[0][batch.loss_mask[0]].tolist()
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= LOGIT_TOL
    if packed:  # images train: the vision tower and its DeepStack mergers move too
        before = {k: v.clone() for k, v in tr.export_weights().tensors.items()}
        tr.train_step(batch)
        after = tr.export_weights().tensors
        assert not torch.equal(
            after["model.visual.deepstack_merger_list.1.linear_fc2.weight"],
            before["model.visual.deepstack_merger_list.1.linear_fc2.weight"],
        )


def _hf_greedy(spec, hf, png: bytes, prompt: list[int]) -> list[int]:
    from PIL import Image

    from slime_async.contracts.vision import image_processor, preprocess

    v = spec.vision
    img = preprocess(image_processor(None, v), [Image.open(io.BytesIO(png)).convert("RGB")])
    i = prompt.index(v.image_token_id)
    ids = prompt[:i] + [v.image_token_id] * v.image_tokens(img.grids[0]) + prompt[i + 1 :]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            pixel_values=img.pixels,
            image_grid_thw=torch.tensor(img.grids),
            mm_token_type_ids=(x == v.image_token_id).int(),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


async def test_engine_greedy_tokens_with_images_equal_hf_generate(vl):
    from slime_async.engine import EngineConfig, EngineServer
    from slime_async.engine.testing import post

    spec, ckpt, hf = vl
    v = spec.vision
    pngs = [_png(1, (128, 96)), _png(2, (64, 160))]  # two sizes: two grids
    prompts = [
        [5, v.vision_start_token_id, v.image_token_id, v.vision_end_token_id, *w]
        for w in ([7, 8, 9], [11, 12, 13, 14])
    ]
    want = [_hf_greedy(spec, hf, png, p) for png, p in zip(pngs, prompts)]
    srv = EngineServer(EngineConfig(dtype="fp32", model_dir=str(ckpt)))
    url = await asyncio.to_thread(srv.start, timeout=120)
    try:
        async with aiohttp.ClientSession() as s:
            got = await asyncio.gather(
                *[
                    post(
                        s,
                        url + "/generate",
                        {
                            "input_ids": p,
                            "image_data": "data:image/png;base64," + base64.b64encode(png).decode(),
                            "sampling_params": {
                                "max_new_tokens": NEW,
                                "temperature": 0.0,
                                "ignore_eos": True,
                            },
                        },
                    )
                    for png, p in zip(pngs, prompts)
                ]
            )
    finally:
        await asyncio.to_thread(srv.stop)
    for (status, body), tokens in zip(got, want):
        assert status == 200, body
        assert body["output_ids"] == tokens
    assert want[0] != want[1]
