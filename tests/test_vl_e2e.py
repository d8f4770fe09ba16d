"""A vision-language model end to end: the tiny Qwen2.5-VL and Qwen3-VL built here
(`slime_async/tools/tiny_vl.py`) on procedurally drawn shapes (`--multimodal-keys`), fully
async with a weight push every step through the distributed transport; the engine's and the
trainer's log-probs of the same image + text samples agree, and `--save-hf` writes a VL
checkpoint transformers loads. The shapes task's pieces (drawing, labels, the verifiable
reward) and the tiny checkpoints' processor config (the preprocessing unchanged by it) are
checked on their own."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytestmark = pytest.mark.timeout(900)


def test_shapes_are_drawn_labelled_and_rewarded(tmp_path):
    from slime_async.rollout.data.rewards import RewardInput
    from slime_async.tools.tiny_vl import (
        COLOURS,
        draw_shapes,
        shapes_reward,
        word_tokenizer,
        write_shapes_dataset,
    )

    img, count, colour = draw_shapes(random.Random(3))
    px = torch.tensor(list(img.getdata()))
    assert (px == torch.tensor(COLOURS[colour])).all(-1).sum() > 50 and 1 <= count <= 3
    data = write_shapes_dataset(tmp_path, 6, seed=1)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert [r["label"] in ("one", "two", "three") for r in rows[::2]] == [True] * 3
    assert all(r["label"] in COLOURS for r in rows[1::2])
    assert all(
        (tmp_path / "images").joinpath(r["images"].rsplit("/", 1)[1]).is_file() for r in rows
    )
    tok = word_tokenizer()
    ids = tok("<|vision_start|> <|image_pad|> <|vision_end|> red", add_special_tokens=False)
    assert ids["input_ids"][:3] == [250, 252, 251]
    hit = RewardInput(response_ids=[5], label="red", response_text="red <|im_end|>")
    miss = RewardInput(response_ids=[5], label="red", response_text="blue")
    assert shapes_reward(hit) == 1.0 and shapes_reward(miss) == 0.0


@pytest.mark.parametrize(("family", "patch"), [("qwen2_5_vl", 14), ("qwen3_vl", 16)])
def test_the_tiny_checkpoint_carries_its_processor_with_unchanged_preprocessing(
    tmp_path, family, patch
):
    """`write_checkpoint` (Qwen2.5-VL, or Qwen3-VL) writes `preprocessor_config.json` (the
    SGLang launcher refuses a VL checkpoint without it), and loading it gives the very pixels
    and grids of the preprocessing derived from the config when the file was absent: earlier
    runs' inputs are unchanged."""
    import importlib.util

    from transformers import AutoImageProcessor

    from slime_async.config.engine_fleet import EngineFleetConfig
    from slime_async.contracts.engine import EngineLaunch
    from slime_async.contracts.model import ModelSpec
    from slime_async.contracts.vision import image_processor, preprocess
    from slime_async.engine.config import EngineConfig
    from slime_async.engine.sglang import build_command
    from slime_async.orchestrator.engines.sglang import sglang_config
    from slime_async.tools.tiny_vl import draw_shapes, write_checkpoint

    hf = write_checkpoint(tmp_path / "hf", family=family)
    assert (hf / "preprocessor_config.json").is_file()
    spec = ModelSpec.from_hf_config(json.loads((hf / "config.json").read_text()))
    vision = spec.vision
    assert spec.is_vl and vision.patch_size == patch and vision.qwen3 == (family == "qwen3_vl")
    derived = image_processor(None, vision)  # what the data path used without the file
    loaded = [
        image_processor(str(hf), vision),
        AutoImageProcessor.from_pretrained(hf, backend="pil"),
    ]
    rng = random.Random(5)
    for size in ((56, 84), (84, 84), (112, 84), (300, 200)):
        img = draw_shapes(rng, size)[0]
        want = preprocess(derived, [img])
        for proc in loaded:
            got = preprocess(proc, [img])
            assert got.grids == want.grids and torch.equal(got.pixels, want.pixels), size
    side = 2 * patch  # a merged token's side: 112 x 84 resized to multiples of it
    grid = (1, 2 * round(84 / side), 2 * round(112 / side))
    assert preprocess(derived, [draw_shapes(rng, (112, 84))[0]]).grids == (grid,)
    launch = EngineLaunch(index=0, model_dir=str(hf), weight_version=0, seed=1)
    fleet = EngineFleetConfig(backend="sglang")
    cmd = build_command(sglang_config(EngineConfig(), launch, port=30000, fleet=fleet))
    assert "--enable-multimodal" in cmd and "--skip-tokenizer-init" not in cmd
    if importlib.util.find_spec("torchvision") is not None:  # SGLang's AutoProcessor needs it
        from transformers import AutoProcessor

        out = AutoProcessor.from_pretrained(hf, backend="pil")(
            images=[img], text=["<|vision_start|> <|image_pad|> <|vision_end|>"]
        )
        assert [tuple(g) for g in out["image_grid_thw"].tolist()] == list(want.grids)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
async def test_async_vl_run_with_images_and_a_push_every_step(tmp_path, family):
    from slime_async.config import parse_config
    from slime_async.orchestrator.controller import train
    from slime_async.tools.tiny_vl import write_checkpoint, write_shapes_dataset

    hf = write_checkpoint(tmp_path / "hf", family=family)
    data = write_shapes_dataset(tmp_path / "data", 16, seed=2)
    run = tmp_path / "run"
    argv = [
        "--run-dir", str(run),
        "--hf-checkpoint", str(hf),
        "--prompt-data", str(data),
        "--multimodal-keys", '{"image": "images"}',
        "--apply-chat-template",
        "--custom-rm-path", "slime_async.tools.tiny_vl.shapes_reward",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4",
        "--num-steps", "3",
        "--update-weights-interval", "1",
        "--eval-interval", "0",
        "--micro-batch-size", "4",
        "--freeze-vision-tower",
    ]  # fmt: skip
    summary = await train(parse_config(argv))
    assert summary["train/version"] == 3
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train/version" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["weights/push_bytes"] > 0 and r["weights/push_failed_engines"] == 0
        # engine (bf16) vs trainer on the same image + text samples
        assert r["mismatch/train_rollout_logprob_abs_diff"] < 0.02, r
    assert steps[-1]["data/served_version"] == 3
    from transformers import AutoModelForImageTextToText

    from slime_async.contracts.model import ModelSpec

    saved = run / "hf"
    cfg = json.loads((saved / "config.json").read_text())
    assert ModelSpec.from_hf_config(cfg).is_vl and cfg["model_type"] == family
    model = AutoModelForImageTextToText.from_pretrained(str(saved), dtype=torch.float32)
    assert model.config.vision_config.depth == (3 if family == "qwen3_vl" else 2)
