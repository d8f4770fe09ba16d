"""The vision-language family (Qwen2.5-VL) from a shrunk copy of its published config.json:
parse-time acceptance and refusals (video, audio, omni models), the trainer's vision tower and
mRoPE positions against `transformers`, per-token logits of trainer vs HF on the same image +
text input, and the HF → trainer → HF round trip bit for bit (through `--save-hf`'s writer)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from slime_async.contracts.model import ModelSpec
from slime_async.contracts.vision import refuse_data_modalities
from tests.vl_inputs import CONFIGS, image_prompt, seeded_vl
from tests.vl_inputs import raw_config as _raw

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

LOGIT_TOL = 1e-5  # what the text families meet (test_model_families.py)
GRIDS = [(1, 8, 12), (1, 4, 4)]  # two images of different sizes; the first spans 2 x 3 windows


def _hf_model(cfg):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(spec, checkpoint dir, fp32 HF model): a seeded random tiny Qwen2.5-VL, norms and biases
    given noise so a mis-mapped one shows."""

    def noise(p: torch.Tensor) -> None:
        if p.ndim == 1:
            p.add_(0.1 * torch.randn_like(p))

    return seeded_vl(tmp_path_factory.mktemp("vl"), "qwen2.5-vl-tiny", _hf_model, noise)


def _prompt(spec: ModelSpec) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(token ids with two images' placeholders, their pixel patches, their grids)."""
    return image_prompt(spec, GRIDS)


def _args(ckpt: Path, run_dir: Path) -> argparse.Namespace:
    from slime_async.config import build_parser

    return build_parser().parse_args(["--hf-checkpoint", str(ckpt), "--run-dir", str(run_dir)])


def test_published_and_tiny_vl_configs_are_read():
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(_raw("qwen2.5-vl-3b"))
    assert spec == ModelSpec.from_hf_config(
        AutoConfig.from_pretrained(str(CONFIGS / "qwen2.5-vl-3b"))
    )
    assert (spec.family, spec.hidden_size, spec.num_layers, spec.head_dim) == (
        "qwen2_5_vl",
        2048,
        36,
        128,
    )
    assert spec.mrope_section == (16, 24, 24) and spec.qkv_bias and spec.tie_word_embeddings
    v = spec.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size) == (32, 1280, 16, 2048)
    assert v.fullatt_block_indexes == (7, 15, 23, 31) and v.image_token_id == 151655
    tiny = ModelSpec.from_hf_config(_raw("qwen2.5-vl-tiny"))
    for s in (spec, tiny):
        assert ModelSpec.from_hf_config(s.to_hf_config()) == s
        assert ModelSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_vl_checkpoint_is_accepted_at_parse_time(vl, tmp_path):
    from slime_async.config import read_environment

    spec, ckpt, _ = vl
    assert read_environment(_args(ckpt, tmp_path / "run")).model == spec


@pytest.mark.parametrize(
    ("model_type", "needs"),
    [
        ("qwen2_audio", "audio"),
        ("qwen2_5_omni", "audio and video"),
        ("qwen3_omni_moe", "audio and video"),
        ("qwen2_vl", "Qwen2-VL"),
    ],
)
def test_other_modalities_are_refused_at_parse_time_in_one_line(model_type, needs, tmp_path):
    from slime_async.config import read_environment

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({**_raw("qwen2.5-vl-tiny"), "model_type": model_type})
    )
    with pytest.raises(ValueError) as err:
        read_environment(_args(d, tmp_path / "run"))
    msg = str(err.value)
    assert "\n" not in msg and model_type in msg and needs in msg, msg
    assert "qwen2_5_vl" in msg and "--hf-checkpoint" in msg, msg


def test_video_and_audio_data_keys_are_refused():
    refuse_data_modalities({"image": "images"})
    with pytest.raises(ValueError, match=r"video.*only images"):
        refuse_data_modalities({"image": "img", "video": "clip"})
    with pytest.raises(ValueError, match="audio"):
        refuse_data_modalities({"audio": "wav"})


def test_vision_tower_equals_hf(vl):
    from slime_async.trainer.vision import VisionTower

    spec, _, hf = vl
    tower = VisionTower(spec.vision)
    pre = "model.visual."
    tower.load_state_dict(
        {k[len(pre) :]: v for k, v in hf.state_dict().items() if k.startswith(pre)}
    )
    _, pixels, grids = _prompt(spec)
    with torch.no_grad():
        theirs = hf.model.visual(pixels, grid_thw=grids).pooler_output
        ours = tower(pixels, grids)
    assert ours.shape == (sum(spec.vision.image_tokens(g) for g in GRIDS), spec.hidden_size)
    assert (ours - theirs).abs().max().item() <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_tower_equals_hf_on_cuda(vl, dtype):
    """The tower's CUDA path (SDPA kernels, bf16 as a GPU trainer runs it) against HF's on the
    same device and dtype."""
    import copy

    from slime_async.trainer.vision import VisionTower

    spec, _, hf = vl
    visual = copy.deepcopy(hf.model.visual).to("cuda", dtype)
    tower = VisionTower(spec.vision)
    pre = "model.visual."
    tower.load_state_dict(
        {k[len(pre) :]: v for k, v in hf.state_dict().items() if k.startswith(pre)}
    )
    tower = tower.to("cuda", dtype)
    _, pixels, grids = _prompt(spec)
    pixels = pixels.to("cuda", dtype)
    with torch.no_grad():
        theirs = visual(pixels, grid_thw=grids.to("cuda")).pooler_output.float()
        ours = tower(pixels, grids.to("cuda")).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * theirs.abs().max().item()
    assert ours.is_cuda and (ours - theirs).abs().max().item() <= tol


def test_the_memory_plan_counts_every_parameter(vl):
    from slime_async.config.memory_plan import param_count

    spec, _, hf = vl
    assert param_count(spec) == sum(p.numel() for p in hf.parameters())


def test_mrope_positions_equal_hf_rope_index(vl):
    from slime_async.trainer.vl_inputs import mrope_positions

    spec, _, hf = vl
    ids, _, grids = _prompt(spec)
    x = torch.tensor([ids])
    theirs, delta = hf.model.get_rope_index(x, (x == spec.vision.image_token_id).int(), grids)
    ours, our_delta = mrope_positions(ids, GRIDS, spec.vision)
    assert torch.equal(ours, theirs[:, 0]) and our_delta == int(delta) < 0
    with pytest.raises(ValueError, match="placeholder"):
        mrope_positions(ids, GRIDS[:1], spec.vision)


def test_trainer_logits_equal_hf_with_images_and_weights_round_trip(vl, tmp_path):
    from safetensors.torch import load_file

    from slime_async.trainer import lm_head, weights_io
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer
    from slime_async.trainer.vl_inputs import mrope_positions, vl_forward

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
    diff = (ours.float() - theirs).abs().max().item()
    assert diff <= LOGIT_TOL, diff
    assert theirs.std() > 0.05
    written = load_file(str(ckpt / "model.safetensors"))
    exported = tr.export_weights()
    assert any(k.startswith("visual.") for k in written)
    assert set(exported.tensors) == set(written)
    for k, v in written.items():
        assert torch.equal(exported.tensors[k], v), k
    out_dir = weights_io.write_hf_dir(exported, tmp_path / "export")
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert ModelSpec.from_hf_config(cfg) == spec
    from transformers import Qwen2_5_VLForConditionalGeneration

    again = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(out_dir), dtype=torch.float32)
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
    mm = (x == spec.vision.image_token_id).int()
    torch.manual_seed(4)
    with torch.no_grad():
        out = hf.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=mm,
            do_sample=True,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            eos_token_id=None,
            pad_token_id=0,
        )[0].tolist()
        full = torch.tensor([out])
        mm_full = (full == spec.vision.image_token_id).int()
        logits = hf(
            input_ids=full, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=mm_full
        ).logits[0, :-1]
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
def test_trainer_logprobs_equal_hf_in_packed_and_padded_micro_batches(vl, packed):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    spec, ckpt, hf = vl
    batch, want = _batch(spec, hf)
    cfg = TrainerConfig(
        seed=3, hf_checkpoint=str(ckpt), micro_batch_size=2, qkv_format="thd" if packed else "bshd"
    )
    tr = MegatronTrainer(cfg, spec)
    lp, _ = tr.compute_logprobs(batch)
    n = int(batch.loss_mask[0].sum())
    got = lp[0][batch.loss_mask[0]].tolist()
    assert len(got) == n == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) <= LOGIT_TOL


@pytest.mark.parametrize("freeze", [True, False])
def test_train_step_with_images_and_the_frozen_vision_tower(vl, freeze):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    spec, ckpt, hf = vl
    batch, _ = _batch(spec, hf)
    cfg = TrainerConfig(seed=3, hf_checkpoint=str(ckpt), lr=1e-3, freeze_vision_tower=freeze)
    tr = MegatronTrainer(cfg, spec)
    before = {k: v.clone() for k, v in tr.export_weights().tensors.items()}
    metrics = tr.train_step(batch)
    assert metrics and tr.version == 1
    after = tr.export_weights().tensors
    vision_moved = any(not torch.equal(after[k], v) for k, v in before.items() if "visual." in k)
    lm_moved = any(not torch.equal(after[k], v) for k, v in before.items() if "visual." not in k)
    assert lm_moved and vision_moved == (not freeze)


def test_lora_on_the_language_model_trains_with_images(vl):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    spec, ckpt, hf = vl
    batch, want = _batch(spec, hf)
    cfg = TrainerConfig(seed=3, hf_checkpoint=str(ckpt), lr=1e-2, lora_rank=4)
    tr = MegatronTrainer(cfg, spec)
    lp0, _ = tr.compute_logprobs(batch)
    got = lp0[0][batch.loss_mask[0]].tolist()
    assert max(abs(a - b) for a, b in zip(got, want)) <= LOGIT_TOL  # B = 0: the base model
    base = tr.export_weights().tensors
    tr.train_step(batch)
    tr.train_step(batch)
    lp2, _ = tr.compute_logprobs(batch)
    assert not torch.equal(lp2, lp0)  # the adapters learned on image + text samples
    after = tr.export_weights().tensors  # the adapters merged in
    assert all(torch.equal(after[k], v) for k, v in base.items() if k.startswith("visual."))
    assert any(not torch.equal(after[k], v) for k, v in base.items() if "self_attn" in k)


def test_image_placeholders_in_the_loss_mask_are_refused(vl):
    import dataclasses

    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    spec, ckpt, hf = vl
    batch, _ = _batch(spec, hf)
    mask = batch.loss_mask.clone()
    mask[0, 5] = True  # an image placeholder of the first image
    assert batch.tokens[0, 5] == spec.vision.image_token_id
    tr = MegatronTrainer(TrainerConfig(seed=3, hf_checkpoint=str(ckpt)), spec)
    with pytest.raises(ValueError, match="placeholder in the loss mask"):
        tr.compute_logprobs(dataclasses.replace(batch, loss_mask=mask))


def test_a_sampled_image_token_is_trained_as_text(vl):
    """The engine never samples a vision token; another engine might: such a response token
    is in the loss mask, so the trainer reads it as text, not as an image's slot."""
    import dataclasses

    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    spec, ckpt, hf = vl
    batch, _ = _batch(spec, hf)
    tokens = batch.tokens.clone()
    last = int(batch.lengths[0]) - 1
    tokens[0, last] = spec.vision.image_token_id
    tr = MegatronTrainer(TrainerConfig(seed=3, hf_checkpoint=str(ckpt)), spec)
    lp, _ = tr.compute_logprobs(dataclasses.replace(batch, tokens=tokens))
    assert torch.isfinite(lp).all() and lp[0, last] < 0
