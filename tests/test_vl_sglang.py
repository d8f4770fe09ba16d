"""A vision-language model on the SGLang backend, with only the SGLang process replaced (the
stand-in `sglang.launch_server` of tests/fake_sglang serves our embedded engine): the launch
argv (`--enable-multimodal`, the tokenizer on, SGLang's own memory fraction), the refusals that
would leave SGLang unable to place images, and the `/generate` body in SGLang's form (one
`<|image_pad|>` per image, the images as data URIs in `image_data`) answered by the launched
server with the tokens of the expanded prompt."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import torch

from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.contracts.engine import EngineLaunch
from slime_async.engine.config import EngineConfig
from slime_async.engine.sglang import SGLangServer, build_command
from slime_async.orchestrator.engines.sglang import sglang_config
from tests.test_vl_data import _png, _tokenizer
from tests.test_vl_family import CONFIGS, _hf_model

pytestmark = [pytest.mark.timeout(300), pytest.mark.own_ray]
torch.set_num_threads(1)
FAKE = Path(__file__).resolve().parent / "fake_sglang"
REPO = FAKE.parents[1]
TOKEN = "sglang-vl-token-abcdef0123456789"
PAD = 252


def _processor_files(out: Path) -> None:
    """The checkpoint's tokenizer and processor config (what SGLang's processor loads)."""
    from slime_async.contracts.model import ModelSpec
    from slime_async.contracts.vision import image_processor

    spec = ModelSpec.from_hf_config(json.loads((out / "config.json").read_text()))
    _tokenizer().save_pretrained(str(out))
    image_processor(None, spec.vision).save_pretrained(str(out))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(CONFIGS / "qwen2.5-vl-tiny"))
    torch.manual_seed(0)
    hf = _hf_model(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4.0) if p.ndim > 1 else p.add_(0.1 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("vl-sglang") / "hf"
    hf.save_pretrained(str(out))
    _processor_files(out)
    return out


def _flags(model_dir: Path, **fleet: object) -> list[str]:
    launch = EngineLaunch(index=0, model_dir=str(model_dir), weight_version=0, seed=1)
    f = EngineFleetConfig(backend="sglang", **fleet)  # type: ignore[arg-type]
    return build_command(sglang_config(EngineConfig(), launch, port=30000, fleet=f))


def test_a_vl_checkpoint_launches_sglang_multimodal(tmp_path: Path) -> None:
    vl = tmp_path / "vl"
    vl.mkdir()
    shutil.copy(CONFIGS / "qwen2.5-vl-tiny" / "config.json", vl / "config.json")
    export = tmp_path / "weights" / "v000000"  # the trainer's export: config, no tokenizer
    export.mkdir(parents=True)
    shutil.copy(vl / "config.json", export / "config.json")
    with pytest.raises(ValueError, match=r"preprocessor_config\.json"):
        _flags(vl)  # nothing SGLang could decode or preprocess with
    _processor_files(vl)
    cmd = _flags(vl)
    assert cmd.count("--enable-multimodal") == 1 and "--skip-tokenizer-init" not in cmd
    assert "--mem-fraction-static" not in cmd  # SGLang's own, which reserves the ViT's room
    cmd = _flags(export, tokenizer_path=str(vl))
    assert "--enable-multimodal" in cmd and cmd[cmd.index("--tokenizer-path") + 1] == str(vl)
    cmd = _flags(vl, sglang_args=("--enable-multimodal", "--mem-fraction-static", "0.7"))
    assert cmd.count("--enable-multimodal") == 1  # the user's, untouched
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"
    with pytest.raises(ValueError, match=r"skip-tokenizer-init.*drop the flag"):
        _flags(vl, sglang_args=("--skip-tokenizer-init",))
    text = tmp_path / "text"
    text.mkdir()
    shutil.copy(CONFIGS / "qwen2.5-tiny" / "config.json", text / "config.json")
    assert "--enable-multimodal" not in _flags(text)


def test_the_client_body_is_sglangs_form() -> None:
    from slime_async.contracts.rollout import GenerationRequest, Prompt
    from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig

    png = "data:image/png;base64," + base64.b64encode(_png((56, 56), 0)).decode()
    ids = [5, 250, *[PAD] * 4, 251, 6, 250, *[PAD] * 16, 251, 7]
    prompt = Prompt(key="k", prompt_ids=ids, payload={"images": [png, png]})
    req = GenerationRequest(prompt=prompt, group_seq=0, sample_index=0, prefix_ids=[9, 9])
    body = GenerateClient(GenerateClientConfig(url="http://x", image_token_id=PAD)).build_request(
        req
    )
    assert body["input_ids"] == [5, 250, PAD, 251, 6, 250, PAD, 251, 7, 9, 9]
    assert body["image_data"] == [png, png]
    plain = GenerateClient(GenerateClientConfig(url="http://x", image_token_id=PAD))
    text = Prompt(key="t", prompt_ids=[PAD, PAD, 3])  # no images: ids untouched
    assert plain.build_request(GenerationRequest(prompt=text, group_seq=0, sample_index=0))[
        "input_ids"
    ] == [PAD, PAD, 3]


async def test_the_launched_server_answers_sglangs_form(ckpt, tmp_path: Path, monkeypatch):
    """Launch through the real SGLang launch path (argv recorded), send the client's body with
    a data-path prompt (placeholders expanded, the image by path): the same greedy tokens as
    the expanded prompt sent as is."""
    import socket

    from PIL import Image

    from slime_async.contracts.model import ModelSpec
    from slime_async.contracts.rollout import GenerationRequest, Prompt
    from slime_async.contracts.vision import image_processor, preprocess
    from slime_async.engine.testing import post
    from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig

    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{FAKE}:{REPO}")
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = EngineLaunch(index=0, model_dir=str(ckpt), weight_version=0, seed=1)
    fleet = EngineFleetConfig(backend="sglang")
    sg = sglang_config(EngineConfig(api_key=TOKEN), launch, port=port, fleet=fleet)
    srv = SGLangServer(sg, log_path=str(tmp_path / "server.log"))
    image = tmp_path / "img.png"
    image.write_bytes(_png((84, 112), 5))
    vision = ModelSpec.from_hf_config(json.loads((ckpt / "config.json").read_text())).vision
    grid = preprocess(image_processor(str(ckpt), vision), [Image.open(image)]).grids[0]
    n = vision.image_tokens(grid)
    ids = [5, 250, *[PAD] * n, 251, 7, 8]
    prompt = Prompt(key="p", prompt_ids=ids, payload={"images": [str(image)]})
    req = GenerationRequest(prompt=prompt, group_seq=0, sample_index=0)
    cfg = GenerateClientConfig(
        url=f"http://127.0.0.1:{port}",
        temperature=0.0,
        max_response_len=6,
        image_token_id=PAD,
        api_key=TOKEN,
    )
    client = GenerateClient(cfg)
    try:
        srv.start(timeout=120)
        (rec,) = [json.loads(p.read_text()) for p in record.glob("*.json")]
        assert "--enable-multimodal" in rec["argv"] and "--skip-tokenizer-init" not in rec["argv"]
        body = client.build_request(req)
        assert body["input_ids"].count(PAD) == 1 and n > 1
        assert body["image_data"][0].startswith("data:image/png;base64,")
        got = await client(req, 0.0, 6)
        expanded = {**body, "input_ids": ids}
        import aiohttp

        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=auth) as s:
            status, want = await post(s, cfg.url + "/generate", expanded)
        assert status == 200, want
        assert got.output_ids == want["output_ids"] and len(got.output_ids) == 6
        assert got.payload["prompt_len"] == len(ids)  # the trained (expanded) prompt
    finally:
        await client.close()
        srv.stop()
