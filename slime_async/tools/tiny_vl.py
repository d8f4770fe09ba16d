"""A tiny vision-language setup built on this machine: checkpoint, tokenizer, and a shapes task.

Owns: `word_tokenizer` (a word-level tokenizer over the tiny model's 256 ids with Qwen's chat
and vision special tokens and a chat template; no download), `write_checkpoint` (the shrunk
published Qwen2.5-VL config, `tests/data/configs/qwen2.5-vl-tiny`, or with
`family="qwen3_vl"` the shrunk Qwen3-VL one, `qwen3-vl-tiny`, with seeded random weights, that
tokenizer and the processor's `preprocessor_config.json`: the settings the data path already
uses without one, so SGLang's processor can load the checkpoint too), `draw_shapes` (a
procedurally drawn image: 1 to 3 filled shapes of one colour on a light background),
`write_shapes_dataset` (`--prompt-data` rows asking how many shapes or which colour, the image
by path, the answer as the label; the same rows as SFT conversations in `shapes_sft.jsonl`)
and `shapes_reward` (exact match of the first word of the response; `--custom-rm-path
slime_async.tools.tiny_vl.shapes_reward`).

    python -m slime_async.tools.tiny_vl OUT_DIR   # OUT_DIR/hf, OUT_DIR/shapes.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vision_start_token_id": 250,
    "vision_end_token_id": 251,
    "image_token_id": 252,
    "video_token_id": 253,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": 256,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "in_chans": 3,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}
"""Qwen2.5-VL-3B's config.json shrunk (2 + 2 layers, width 64 / 32, 256 ids)."""

QWEN3_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": 252,
    "video_token_id": 253,
    "vision_start_token_id": 250,
    "vision_end_token_id": 251,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_vl_text",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [2, 3, 3],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "vocab_size": 256,
    },
    "vision_config": {
        "model_type": "qwen3_vl",
        "deepstack_visual_indexes": [0, 2],
        "depth": 3,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 32,
        "in_channels": 3,
        "intermediate_size": 48,
        "num_heads": 2,
        "num_position_embeddings": 64,
        "out_hidden_size": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
"""Qwen3-VL's config shrunk (`tests/data/configs/qwen3-vl-tiny`: 3 + 3 layers with DeepStack,
width 64 / 32, the same 256 ids and vision token ids as `CONFIG`)."""

SPECIAL = {
    "<|im_start|>": 248,
    "<|im_end|>": 2,
    "<|vision_start|>": 250,
    "<|vision_end|>": 251,
    "<|image_pad|>": 252,
    "<|video_pad|>": 253,
}
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220)}
COUNTS = ("one", "two", "three")
WORDS = ("how", "many", "shapes", "?", "which", "colour", "user", "assistant", "system")


def word_tokenizer() -> Any:
    """The tiny model's tokenizer (whitespace-split words, the VL special tokens, a template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<|im_end|>", *COUNTS, *COLOURS, *WORDS]
    words += [f"w{i}" for i in range(40)]
    vocab = {w: i for i, w in enumerate(words)} | SPECIAL
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    fast.chat_template = TEMPLATE
    return fast


def write_checkpoint(out: str | Path, *, seed: int = 0, family: str = "qwen2_5_vl") -> Path:
    """A seeded random tiny Qwen2.5-VL (or, `family="qwen3_vl"`, Qwen3-VL) with its
    tokenizer and image processor config, saved as an HF directory."""
    import torch
    from transformers import (
        AutoConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    from slime_async.contracts.model import ModelSpec
    from slime_async.contracts.vision import image_processor

    configs = {"qwen2_5_vl": CONFIG, "qwen3_vl": QWEN3_CONFIG}
    if family not in configs:
        raise ValueError(f"family {family!r}: the tiny VL models are {', '.join(configs)}")
    config = configs[family]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    cfg = AutoConfig.from_pretrained(str(out))
    cls = (
        Qwen3VLForConditionalGeneration
        if family == "qwen3_vl"
        else Qwen2_5_VLForConditionalGeneration
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(config, indent=2))  # the published form
    word_tokenizer().save_pretrained(str(out))
    # the preprocessing the data path derives from the config when the file is absent, written
    # down (SGLang's processor needs the file); the same pixels and grids either way
    image_processor(None, ModelSpec.from_hf_config(config).vision).save_pretrained(str(out))
    return out


def draw_shapes(rng: random.Random, size: tuple[int, int] = (84, 84)) -> tuple[Any, int, str]:
    """(a PIL image of 1-3 filled squares or discs of one colour, their count, the colour)."""
    from PIL import Image, ImageDraw

    colour = rng.choice(sorted(COLOURS))
    count = rng.randint(1, 3)
    img = Image.new("RGB", size, (235, 235, 235))
    draw = ImageDraw.Draw(img)
    w, h = size
    for k in range(count):
        x0 = int(w * k / count) + 4
        x1 = int(w * (k + 1) / count) - 4
        y0 = rng.randint(4, h // 2)
        box = (x0, y0, x1, min(h - 4, y0 + (x1 - x0)))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=COLOURS[colour])
    return img, count, colour


def write_shapes_dataset(out: str | Path, n: int, *, seed: int = 0) -> Path:
    """`n` rows, half asking the count and half the colour, images as PNG files beside it."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        img, count, colour = draw_shapes(rng, (rng.choice((56, 84, 112)), 84))
        path = out / "images" / f"{i:05d}.png"
        img.save(path)
        if i % 2 == 0:
            rows.append({"prompt": "<image> how many shapes ?", "label": COUNTS[count - 1]})
        else:
            rows.append({"prompt": "<image> which colour ?", "label": colour})
        rows[-1]["images"] = str(path)
    data = out / "shapes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = [  # the same rows as conversations, for an SFT warm start (--loss-type sft_loss)
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["label"]},
            ],
            "images": r["images"],
        }
        for r in rows
    ]
    (out / "shapes_sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    return data


def shapes_reward(sample: Any) -> float:
    """1 when the response's first word is the label (`RewardInput`), else 0."""
    words = str(getattr(sample, "response_text", "") or "").split()
    return float(bool(words) and words[0] == str(sample.label))


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m slime_async.tools.tiny_vl OUT_DIR")
    out = Path(argv[0])
    print(write_checkpoint(out / "hf"))
    print(write_shapes_dataset(out, 256))


if __name__ == "__main__":
    main(sys.argv[1:])
