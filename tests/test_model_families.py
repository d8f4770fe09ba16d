"""The dense model families (Qwen2.5, Qwen3, Llama 3.2 with llama3 RoPE scaling, Mistral) from
shrunk copies of their published config.json files: HF model → our `--hf-checkpoint` path
(ModelSpec → megatron trainer via hf_convert) → same logits, exact weight round trip, and the
embedded engine's greedy tokens equal HF `generate`'s. Plus what is refused at parse time."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import torch

from slime_async.contracts.model import ModelSpec

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

CONFIGS = Path(__file__).parent / "data" / "configs"
FAMILIES = {
    "qwen2.5-tiny": "qwen2",
    "qwen3-tiny": "qwen3",
    "llama3.2-tiny": "llama",
    "mistral-tiny": "mistral",
}
LOGIT_TOL = 1e-5


def _raw(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def _hf_checkpoint(name: str, out: Path) -> Path:
    """A seeded random HF model of the shipped config, saved with `save_pretrained`. Biases
    and norm weights (zeros and ones at init) get noise so a mis-mapped one shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(CONFIGS / name))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    from slime_async.config import read_environment

    name = request.param
    ckpt = _hf_checkpoint(name, tmp_path_factory.mktemp(name) / "hf")
    env = read_environment(_args(ckpt, tmp_path_factory.mktemp("run")))
    return name, ckpt, env.model


def _args(ckpt: Path, run_dir: Path) -> argparse.Namespace:
    """The parsed command line `--hf-checkpoint CKPT --run-dir RUN_DIR`."""
    from slime_async.config import build_parser

    return build_parser().parse_args(["--hf-checkpoint", str(ckpt), "--run-dir", str(run_dir)])


def _trainer(spec: ModelSpec, ckpt: Path):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    return MegatronTrainer(TrainerConfig(seed=3, hf_checkpoint=str(ckpt)), spec)


def test_spec_reads_the_published_field_sets(family):
    name, _, spec = family
    raw = _raw(name)
    assert spec.family == FAMILIES[name] == raw["model_type"]
    assert spec.qkv_bias == (spec.family == "qwen2")
    assert spec.qk_norm == (spec.family == "qwen3")
    assert spec.tie_word_embeddings == raw["tie_word_embeddings"]
    assert spec.rope_theta == raw["rope_theta"]
    assert (spec.rope_scaling == "llama3") == (name == "llama3.2-tiny")
    assert ModelSpec.from_hf_config(raw) == spec  # the raw json and AutoConfig agree
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_llama3_inv_freq_equals_hf_and_scales_all_three_bands(tmp_path):
    from transformers import AutoModelForCausalLM

    from slime_async.trainer.model import rope_inv_freq

    spec = ModelSpec.from_hf_config(_raw("llama3.2-tiny"))
    hf = AutoModelForCausalLM.from_config(spec.to_hf_config())
    ours = rope_inv_freq(spec)
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq.float())
    plain = rope_inv_freq(ModelSpec.from_dict({**spec.to_dict(), "rope_scaling": None}))
    ratio = plain / ours
    kept = int((ratio == 1).sum())
    divided = int(torch.isclose(ratio, torch.tensor(spec.rope_factor)).sum())
    assert kept >= 1 and divided >= 1 and kept + divided < len(ratio)  # some interpolated


def test_trainer_logits_equal_hf_and_export_round_trips(family, tmp_path):
    from safetensors.torch import load_file

    from slime_async.trainer import weights_io
    from slime_async.trainer.forward import model_logits
    from slime_async.trainer.testing import load_hf

    name, ckpt, spec = family
    tr = _trainer(spec, ckpt)
    hf = load_hf(ckpt, torch.float32)
    # longer than the llama3 config's original context (256): every band of frequencies turns
    tokens = torch.randint(0, spec.vocab_size, (2, 320), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model_logits(tr.model, tokens).float()
        theirs = hf(tokens).logits.float()
    diff = (ours - theirs).abs().max().item()
    print(f"{name}: logits max |trainer - HF| = {diff:.3g}")
    assert diff <= LOGIT_TOL, diff
    assert theirs.std() > 0.05  # random weights with teeth
    # HF -> trainer -> HF: every tensor save_pretrained wrote comes back bit for bit
    written = load_file(str(ckpt / "model.safetensors"))
    exported = tr.export_weights()
    assert set(exported.tensors) == set(written)
    for k, v in written.items():
        assert torch.equal(exported.tensors[k], v), k
    out = weights_io.write_hf_dir(exported, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [spec.hf_architecture]
    assert ModelSpec.from_hf_config(cfg) == spec
    with torch.no_grad():
        again = load_hf(out, torch.float32)(tokens).logits.float()
    assert torch.equal(again, theirs)


async def test_engine_greedy_tokens_equal_hf_generate(family):
    from slime_async.engine import EngineConfig, EngineServer
    from slime_async.engine.testing import post
    from slime_async.trainer.testing import load_hf

    name, ckpt, spec = family
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 30)]
    new = 12
    hf = load_hf(ckpt, torch.float32)
    want = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
            )
            want.append(out[0, len(p) :].tolist())
    srv = EngineServer(EngineConfig(dtype="fp32", model_dir=str(ckpt)))
    url = srv.start(timeout=120)
    try:
        async with aiohttp.ClientSession() as s:
            answers = await asyncio.gather(
                *[
                    post(
                        s,
                        url + "/generate",
                        {
                            "input_ids": p,
                            "sampling_params": {
                                "max_new_tokens": new,
                                "temperature": 0.0,
                                "ignore_eos": True,
                            },
                        },
                    )
                    for p in prompts
                ]
            )
    finally:
        srv.stop()
    got = []
    for status, body in answers:
        assert status == 200, body
        got.append(body["output_ids"])
    assert got == want, name


@pytest.mark.parametrize(
    ("name", "edit", "field", "value"),
    [
        (
            "llama3.2-tiny",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_scaling.rope_type",
            "yarn",
        ),
        (
            "llama3.2-tiny",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type",
            "dynamic",
        ),
        (
            "llama3.2-tiny",
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            "rope_scaling.rope_type",
            "linear",
        ),
        ("llama3.2-tiny", {"attention_bias": True}, "attention_bias", True),
        ("llama3.2-tiny", {"mlp_bias": True}, "mlp_bias", True),
        ("llama3.2-tiny", {"hidden_act": "gelu"}, "hidden_act", "gelu"),
        ("mistral-tiny", {"sliding_window": 128}, "sliding_window", 128),
        ("qwen2.5-tiny", {"use_sliding_window": True}, "use_sliding_window", True),
        ("qwen3-tiny", {"use_sliding_window": True}, "use_sliding_window", True),
        ("qwen3-tiny", {"attention_bias": True}, "attention_bias", True),
        ("qwen3-tiny", {"model_type": "gemma2"}, "model_type", "gemma2"),
    ],
)
def test_unrepresentable_config_fields_are_refused_naming_the_field(
    name, edit, field, value, tmp_path
):
    from slime_async.config import read_environment

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**_raw(name), **edit}))
    with pytest.raises(ValueError) as err:
        read_environment(_args(d, tmp_path / "run"))
    msg = str(err.value)
    assert "--hf-checkpoint" in msg and field in msg and repr(value) in msg, msg


def test_mistral_window_at_least_the_context_is_full_attention():
    raw = {**_raw("mistral-tiny"), "sliding_window": 512}
    assert ModelSpec.from_hf_config(raw) == ModelSpec.from_hf_config(_raw("mistral-tiny"))


def test_qwen3_4b_published_config_is_accepted():
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(_raw("qwen3-4b"))
    assert spec == ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(CONFIGS / "qwen3-4b")))
    assert (spec.family, spec.hidden_size, spec.num_layers, spec.head_dim) == (
        "qwen3",
        2560,
        36,
        128,
    )
    assert (spec.num_attention_heads, spec.num_key_value_heads) == (32, 8)
    assert (spec.intermediate_size, spec.vocab_size) == (9728, 151936)
    assert spec.tie_word_embeddings and spec.qk_norm and not spec.qkv_bias
    assert spec.rope_theta == 1e6 and spec.rope_scaling is None
    assert spec.max_position_embeddings == 40960 and spec.rms_norm_eps == 1e-6


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_qkv_bias_shards_like_its_weight_rows_under_tp(monkeypatch, tp_rank):
    """Under TP=2 every rank's `linear_qkv.bias` holds the biases of exactly the rows its
    `linear_qkv.weight` shard holds (bias planted as the weight's first column)."""
    from slime_async.trainer import hf_convert

    class TwoRanks:
        tp, tp_rank, etp, etp_rank, ep, ep_rank = 2, 0, 1, 0, 1, 0

    ranks = TwoRanks()
    ranks.tp_rank = tp_rank
    monkeypatch.setattr(hf_convert, "_Ranks", lambda: ranks)
    spec = ModelSpec.from_hf_config(_raw("qwen2.5-tiny"))
    g = torch.Generator().manual_seed(2)
    hf = {k: torch.randn(s, generator=g) for k, s in hf_convert.hf_shapes(spec).items()}
    for proj in ("q", "k", "v"):
        pre = f"model.layers.0.self_attn.{proj}_proj."
        hf[pre + "weight"][:, 0] = hf[pre + "bias"]
    qkv = spec.head_dim * (spec.num_attention_heads + 2 * spec.num_key_value_heads)
    shapes = {
        "decoder.layers.0.self_attention.linear_qkv.weight": (qkv // 2, spec.hidden_size),
        "decoder.layers.0.self_attention.linear_qkv.bias": (qkv // 2,),
    }
    out = hf_convert.hf_to_megatron_tensors(hf, spec, shapes)
    w = out["decoder.layers.0.self_attention.linear_qkv.weight"]
    b = out["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert torch.equal(b, w[:, 0])
