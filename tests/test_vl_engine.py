"""The embedded engine serving a vision-language model (a shrunk Qwen2.5-VL): SGLang's
`image_data` on `/generate` (base64 images, one `<|image_pad|>` per image expanded to its
grid, or the expanded run), greedy tokens equal to `transformers`' `generate` on the same
image and prompt, log-probs equal to HF's, images that change the answer, and the refusals
(URLs and paths, an image without placeholder, a text model given images)."""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import pytest
import torch

from tests.vl_inputs import CONFIGS
from tests.vl_inputs import random_png as _png

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)
NEW = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(spec, checkpoint, fp32 HF model, engine url)."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from slime_async.contracts.model import ModelSpec
    from slime_async.engine import EngineConfig, EngineServer

    cfg = AutoConfig.from_pretrained(str(CONFIGS / "qwen2.5-vl-tiny"))
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4.0) if p.ndim > 1 else p.add_(0.1 * torch.randn_like(p))
    ckpt = tmp_path_factory.mktemp("vl-engine") / "hf"
    hf.save_pretrained(str(ckpt))
    srv = EngineServer(EngineConfig(dtype="fp32", model_dir=str(ckpt)))
    url = srv.start(timeout=120)
    yield ModelSpec.from_hf_config(cfg), ckpt, hf, url
    srv.stop()


def _hf_greedy(spec, hf, png: bytes, prompt: list[int]) -> tuple[list[int], list[int]]:
    """(HF's greedy continuation, the expanded prompt) of `prompt` (one pad per image)."""
    from PIL import Image

    from slime_async.contracts.vision import image_processor, preprocess

    v = spec.vision
    img = preprocess(image_processor(None, v), [Image.open(io.BytesIO(png)).convert("RGB")])
    i = prompt.index(v.image_token_id)
    n = v.image_tokens(img.grids[0])
    ids = prompt[:i] + [v.image_token_id] * n + prompt[i + 1 :]
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
    return out[0, len(ids) :].tolist(), ids


def _prompt(spec, words: list[int]) -> list[int]:
    v = spec.vision
    return [5, v.vision_start_token_id, v.image_token_id, v.vision_end_token_id, *words]


def _body(ids: list[int], png: bytes | None, **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True},
        **extra,
    }
    if png is not None:
        body["image_data"] = "data:image/png;base64," + base64.b64encode(png).decode()
    return body


async def test_greedy_tokens_with_an_image_equal_hf_generate(served):
    from slime_async.engine.testing import post

    spec, _, hf, url = served
    pngs = [_png(1, (120, 90)), _png(2, (60, 150))]  # two sizes: two grids
    prompts = [_prompt(spec, [7, 8, 9]), _prompt(spec, [11, 12, 13, 14, 15])]
    want = [_hf_greedy(spec, hf, png, p) for png, p in zip(pngs, prompts)]
    async with aiohttp.ClientSession() as s:
        got = await asyncio.gather(
            *[
                post(s, url + "/generate", _body(p, png, return_logprob=True))
                for png, p in zip(pngs, prompts)
            ],
            post(s, url + "/generate", _body(want[0][1], pngs[0])),  # the expanded run
        )
    for (status, body), (tokens, ids) in zip(got, [*want, want[0]]):
        assert status == 200, body
        assert body["output_ids"] == tokens
        assert body["meta_info"]["prompt_tokens"] == len(ids)
    assert want[0][0] != want[1][0]


async def test_the_image_changes_the_answer_and_the_cache_keeps_them_apart(served):
    from slime_async.engine.testing import post

    spec, _, hf, url = served
    p = _prompt(spec, [21, 22, 23])
    a, b = _png(5, (84, 84)), _png(6, (84, 84))  # same size: same placeholders
    want_a, want_b = _hf_greedy(spec, hf, a, p)[0], _hf_greedy(spec, hf, b, p)[0]
    assert want_a != want_b
    async with aiohttp.ClientSession() as s:
        for png, want in ((a, want_a), (b, want_b), (a, want_a)):
            status, body = await post(s, url + "/generate", _body(p, png))
            assert status == 200 and body["output_ids"] == want, body


@pytest.mark.parametrize(
    ("image", "words"),
    [
        ("http://example.com/cat.png", "fetches no URLs"),
        ("/etc/passwd", "reads no files"),
        ("bm90IGFuIGltYWdl", "no decodable image"),
    ],
)
async def test_bad_image_data_is_a_400_naming_it(served, image, words):
    from slime_async.engine.testing import post

    spec, _, _, url = served
    async with aiohttp.ClientSession() as s:
        body = {**_body(_prompt(spec, [7]), None), "image_data": image}
        status, answer = await post(s, url + "/generate", body)
    assert status == 400 and words in str(answer), answer


async def test_placeholders_and_images_must_match(served):
    from slime_async.engine.testing import post

    spec, _, _, url = served
    png = _png(3, (56, 56))
    async with aiohttp.ClientSession() as s:
        no_pad = await post(s, url + "/generate", _body([5, 6, 7], png))
        no_image = await post(s, url + "/generate", _body(_prompt(spec, [7]), None))
    assert no_pad[0] == 400 and "placeholders" in str(no_pad[1])
    assert no_image[0] == 400 and "no image_data" in str(no_image[1])


async def test_chat_completions_take_image_content_parts(served):
    """An OpenAI chat request with an image part answers what `/generate` answers for the
    rendered prompt with that image (the id codec renders each message's ids)."""
    from slime_async.engine.testing import post

    spec, _, hf, url = served
    png = _png(8, (70, 98))
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    want, ids = _hf_greedy(spec, hf, png, _prompt(spec, [31, 32]))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "5"},
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "31 32"},
            ],
        }
    ]
    body = {"messages": messages, "max_tokens": NEW, "temperature": 0.0}
    async with aiohttp.ClientSession() as s:
        status, answer = await post(s, url + "/v1/chat/completions", body)
        bad_status, bad = await post(
            s,
            url + "/v1/chat/completions",
            {**body, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        )
    assert status == 200, answer
    got = answer["meta_info"]["output_ids"][0]  # eos may end it early
    assert got and got == want[: len(got)]
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert bad_status == 400 and "image_url.url" in str(bad)


async def test_the_engine_never_samples_vision_tokens(tmp_path):
    """A model whose favourite next token is `<|image_pad|>` still answers with text: a
    placeholder is an image's slot, never an answer."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from slime_async.contracts.model import ModelSpec
    from slime_async.engine import EngineConfig, EngineServer
    from slime_async.engine.testing import post

    cfg = AutoConfig.from_pretrained(str(CONFIGS / "qwen2.5-vl-tiny"))
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.float32).eval()
    v = ModelSpec.from_hf_config(cfg).vision
    with torch.no_grad():  # tied embeddings: a long pad row wins most dot products
        emb = hf.get_input_embeddings().weight
        emb[v.image_token_id] = emb[v.image_token_id] * 50
        emb[v.vision_start_token_id] = emb[v.vision_start_token_id] * 40
    x = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        top = int(hf(input_ids=x).logits[0, -1].argmax())
    assert top in (v.image_token_id, v.vision_start_token_id)  # what greedy would pick
    ckpt = tmp_path / "hf"
    hf.save_pretrained(str(ckpt))
    with EngineServer(EngineConfig(dtype="fp32", model_dir=str(ckpt))) as srv:
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, srv.url + "/generate", _body([5, 6, 7], None))
    assert status == 200, body
    vision = {v.image_token_id, v.video_token_id, v.vision_start_token_id, v.vision_end_token_id}
    assert len(body["output_ids"]) == NEW and not set(body["output_ids"]) & vision
