"""Images through the data path: `--multimodal-keys` rows (a path, base64, a data URI, or a
list) become prompts whose ids hold each image's placeholders expanded to its grid (the chat
template renders them, the processor runs once per row), prompts carry the images by
reference only, the generate client sends them to the engine as `image_data`, and the
trainer, given the references, computes the same log-probs as from pixels. Video and audio
keys are refused at parse time."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from tests.test_vl_family import _hf_model
from tests.vl_inputs import CONFIGS, random_png

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

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


def _tokenizer():
    """A word-level tokenizer over the tiny model's ids, with the VL special tokens and a
    chat template (no hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", *[f"w{i}" for i in range(3, 40)]]
    words += ["how", "many", "shapes", "?", "what", "colour", "user", "assistant", "system"]
    vocab = {w: i for i, w in enumerate(words) if i < 200}
    vocab["<pad>"], vocab["<unk>"] = 0, 1
    vocab |= SPECIAL
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    fast.chat_template = TEMPLATE
    return fast


def _png(size: tuple[int, int], seed: int) -> bytes:
    return random_png(seed, size)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(CONFIGS / "qwen2.5-vl-tiny"))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("vl-data") / "hf"
    _hf_model(cfg).save_pretrained(str(out))
    _tokenizer().save_pretrained(str(out))
    return out


def _rows(root: Path) -> Path:
    a = root / "a.png"
    a.write_bytes(_png((84, 56), 1))
    b64 = base64.b64encode(_png((56, 112), 2)).decode()
    rows = [
        {"prompt": "how many <image> shapes ?", "label": "3", "images": str(a)},
        {"prompt": [{"role": "user", "content": "what colour ?"}], "label": "w5", "images": [b64]},
        {
            "prompt": "w7 <image> w8 <image>",
            "label": "w9",
            "images": [str(a), "data:;base64," + b64],
        },
        {"prompt": "what colour ?", "label": "w5", "images": str(root / "missing.png")},
        {"prompt": "w3 w4", "label": "w5"},
    ]
    path = root / "vl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_multimodal_rows_become_prompts_with_expanded_placeholders(ckpt, tmp_path):
    from transformers import AutoConfig

    from slime_async.contracts.model import ModelSpec
    from slime_async.rollout.config import RolloutConfig
    from slime_async.rollout.data.plan import make_data_plan

    vision = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(ckpt))).vision
    rollout = RolloutConfig(
        prompt_data=str(_rows(tmp_path)),
        apply_chat_template=True,
        multimodal_keys='{"image": "images"}',
    )
    plan = make_data_plan(rollout, seed=0, hf_checkpoint=str(ckpt))
    assert plan.metrics["data/skipped"] == 1  # the missing file
    prompts = [plan.source.next_prompt() for _ in range(4)]
    by_label = {}
    for p in prompts:
        by_label.setdefault(p.payload["label"], []).append(p)
    (one,) = by_label["3"]  # 84x56 pixels: a 4x6 patch grid, 6 placeholders
    ids = list(one.prompt_ids)
    assert ids.count(vision.image_token_id) == 6
    i = ids.index(vision.image_token_id)
    assert ids[i - 1] == vision.vision_start_token_id and ids[i + 6] == vision.vision_end_token_id
    assert ids[0] == SPECIAL["<|im_start|>"]  # the chat template rendered it
    assert one.payload["images"] == [str(tmp_path / "a.png")]  # by reference, no pixels
    assert one.payload["image_tokens"] == 6
    (two,) = by_label["w9"]
    assert list(two.prompt_ids).count(vision.image_token_id) == 6 + 8
    text_only = by_label["w5"]
    assert any("images" not in p.payload for p in text_only)


def test_client_sends_the_images_and_the_trainer_reads_references(ckpt, tmp_path):
    from transformers import AutoConfig

    from data_worker.types import GenerationRequest, Prompt
    from slime_async.contracts.batch import TrainerBatch
    from slime_async.contracts.model import ModelSpec
    from slime_async.contracts.vision import ImageRefs, image_processor, preprocess, read_image
    from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(ckpt)))
    v = spec.vision
    path = tmp_path / "x.png"
    path.write_bytes(_png((84, 56), 3))
    ids = [5, v.vision_start_token_id, *[v.image_token_id] * 6, v.vision_end_token_id, 7]
    prompt = Prompt(key="k", prompt_ids=ids, payload={"images": [str(path)]})
    body = GenerateClient(GenerateClientConfig(url="http://127.0.0.1:1")).build_request(
        GenerationRequest(prompt=prompt, group_seq=0, sample_index=0)
    )
    (uri,) = body["image_data"]
    assert uri.startswith("data:image/png;base64,")
    assert base64.b64decode(uri.split(",", 1)[1]) == path.read_bytes()
    pixels = preprocess(image_processor(str(ckpt), v), [read_image(str(path))[0]])
    tr = MegatronTrainer(TrainerConfig(seed=3, hf_checkpoint=str(ckpt)), spec)

    def batch(images):
        return TrainerBatch.from_lists(
            tokens=[[*ids, 11, 12, 13]],
            prompt_lengths=[len(ids)],
            rollout_logprobs=[[0.0] * 3],
            advantages=[1.0],
            versions=[0],
            images=[images],
        )

    by_ref, _ = tr.compute_logprobs(batch(ImageRefs(refs=(str(path),))))
    by_pixels, _ = tr.compute_logprobs(batch(pixels))
    assert torch.equal(by_ref, by_pixels) and bool((by_ref != 0).any())
    other = tmp_path / "y.png"
    other.write_bytes(_png((84, 56), 4))
    changed, _ = tr.compute_logprobs(batch(ImageRefs(refs=(str(other),))))
    assert not torch.equal(changed, by_ref)  # the image is read, not ignored


@pytest.mark.parametrize("keys", ['{"video": "clip"}', '{"image": "img", "audio": "wav"}'])
def test_video_and_audio_keys_are_refused_at_parse_time(keys, capsys):
    from slime_async.config import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--multimodal-keys", keys])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "only images" in x]
    assert "--multimodal-keys" in line and '{"image": "<column>"}' in line


def test_sft_conversations_with_images_train_only_the_answer(tmp_path):
    from slime_async.contracts.vision import ImageRefs
    from slime_async.rollout.data.images import vision_data
    from slime_async.rollout.data.sft import SFTData
    from slime_async.tools.tiny_vl import word_tokenizer, write_checkpoint, write_shapes_dataset

    hf = write_checkpoint(tmp_path / "hf")
    write_shapes_dataset(tmp_path / "d", 4, seed=0)
    tok = word_tokenizer()
    data = SFTData(
        str(tmp_path / "d" / "shapes_sft.jsonl"),
        tokenizer=tok,
        input_key="messages",
        batch_size=4,
        seed=0,
        image_key="images",
        vision=vision_data(str(hf), tok),
    )
    tb, _ = data.batch(0, version=0)
    assert all(isinstance(i, ImageRefs) for i in tb.images)
    for r in range(4):
        ids = tb.tokens[r, : tb.lengths[r]]
        pads = ids == 252
        assert int(pads.sum()) >= 4 and not bool((tb.loss_mask[r] & (tb.tokens[r] == 252)).any())
        trained = tok.decode(tb.tokens[r][tb.loss_mask[r]].tolist()).split()
        assert trained[0] in ("one", "two", "three", "red", "green", "blue"), trained


def test_the_length_probe_counts_image_tokens_in_expected_work(ckpt, tmp_path):
    """Two prompts with the same text and different image sizes: the data worker's dispatch
    ranks and sends them with expected work = the expected response length + their image
    tokens (a 56x56 image: 4, a 112x112 one: 16), larger work first; the length cache keeps
    response lengths only."""
    from data_worker.config import DataWorkerConfig
    from data_worker.scheduler import SchedulerCore
    from data_worker.types import FinishStatus, GenerationResult, Prompt
    from slime_async.rollout.config import RolloutConfig
    from slime_async.rollout.data.plan import make_data_plan

    rows = []
    for name, side in (("small", 56), ("large", 112)):
        (tmp_path / f"{name}.png").write_bytes(_png((side, side), 3))
        rows.append({"prompt": "how many <image> shapes ?", "label": "3", "images": f"{name}.png"})
    rows = [{**r, "images": str(tmp_path / r["images"])} for r in rows]
    path = tmp_path / "same-text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rollout = RolloutConfig(
        prompt_data=str(path), apply_chat_template=True, multimodal_keys='{"image": "images"}'
    )
    source = make_data_plan(rollout, seed=0, hf_checkpoint=str(ckpt)).source
    cfg = DataWorkerConfig(
        n_samples_per_prompt=2, groups_per_step=2, default_expected_len=100, max_inflight=8
    )
    core = SchedulerCore(cfg, source, clock=lambda: 0.0)
    assert core.admit_one() and core.admit_one()

    def tokens(d) -> int:
        return list(d.request.prompt.prompt_ids).count(252)

    probes = [core.next_dispatch(), core.next_dispatch()]  # sample 0 of each, unknown length
    assert [d.request.sample_index for d in probes] == [0, 0]
    assert [tokens(d) for d in probes] == [4, 16]  # equal text: 4 vs 16 image tokens
    assert [d.expected_len for d in probes] == [100 + 4, 100 + 16]
    for d in probes:
        out = GenerationResult(
            output_ids=[1] * 10, token_versions=[0] * 10, status=FinishStatus.FINISHED
        )
        core.on_result(d, out)
    assert [core.cache.get(d.request.prompt.key) for d in probes] == [10.0, 10.0]
    p = probes[1].request.prompt  # a resumed worker re-issues it with the same work
    assert p.extra_work == 16 and Prompt.from_json(json.loads(json.dumps(p.to_json()))) == p
    rest = [core.next_dispatch(), core.next_dispatch()]  # re-ranked on work: 16 tokens first
    assert [(tokens(d), d.expected_len, d.priority) for d in rest] == [
        (16, 10 + 16, 10 + 16),
        (4, 10 + 4, 10 + 4),
    ]


async def test_the_router_hint_is_the_expected_work(tmp_path):
    """`X-Expected-Tokens` is the data worker's expected work, sent unchanged (the image
    tokens are in it already, counted once)."""
    from aiohttp import web

    from data_worker.types import GenerationRequest, Prompt
    from slime_async.rollout.generate.client import (
        GenerateClient,
        GenerateClientConfig,
        GenerateError,
    )

    seen = []

    async def handler(request):
        seen.append(request.headers["X-Expected-Tokens"])
        return web.json_response({"error": "captured"}, status=400)

    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    path = tmp_path / "x.png"
    path.write_bytes(_png((56, 56), 0))
    client = GenerateClient(GenerateClientConfig(url=url, max_connection_retries=0))
    try:
        for payload in ({"images": [str(path)], "image_tokens": 4}, {}):
            prompt = Prompt(key="k", prompt_ids=[5, 6], payload=payload)
            with pytest.raises(GenerateError):
                await client(GenerationRequest(prompt=prompt, group_seq=0, sample_index=0), 0, 10)
    finally:
        await client.close()
        await runner.cleanup()
    assert seen == ["10", "10"]
