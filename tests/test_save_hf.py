"""Taking the model out: exports carry the source's identity, `--save-hf` directories load with
`transformers`, sharding, and the refusals that keep `--save-hf` from deleting anything.

The end-to-end runs (the embedded default with `--save-hf`, the export tool on its checkpoint,
the SmolLM2 recipe) are in tests/test_e2e_save_hf.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime_async.config import Environment, build_parser, validate
from slime_async.contracts.adapter import LoraSpec
from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.contracts.weights import HFWeights
from slime_async.trainer import hf_save, weights_io
from slime_async.trainer.hf_convert import hf_shapes

LLAMA = ModelSpec(
    family="llama",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    rope_theta=500000.0,
    rope_scaling="llama3",  # as the source below: the spec models Llama 3's rope scaling
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def _weights(spec: ModelSpec, version: int = 3) -> HFWeights:
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g) * 0.05 for k, s in hf_shapes(spec).items()}
    for k in tensors:
        if k.endswith("norm.weight"):
            tensors[k] = torch.ones_like(tensors[k])
    return HFWeights(version=version, spec=spec, tensors=tensors)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)} | {"<s>": 60, "</s>": 61, "<pad>": 62, "<unk>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def _source(tmp: Path, spec: ModelSpec = LLAMA) -> Path:
    """An HF directory like a Llama 3 one: ids the ModelSpec does not model, rope scaling, a
    field of its own, a tokenizer with a chat template and a generation config."""
    src = tmp / "src"
    src.mkdir()
    cfg = weights_io.export_config(spec, None)
    cfg.update(
        bos_token_id=128000,
        eos_token_id=[128001, 128009],
        pad_token_id=62,  # a Llama 3 pad id would not fit this small vocabulary
        rope_parameters={
            "rope_theta": 500000.0,
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        torch_dtype="bfloat16",
        custom_field="kept",
    )
    (src / "config.json").write_text(json.dumps(cfg))
    gen = {"bos_token_id": 128000, "eos_token_id": [128001, 128009], "temperature": 0.6}
    (src / "generation_config.json").write_text(json.dumps(gen))
    tok = _tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(str(src))
    return src


def test_export_carries_the_sources_ids_config_fields_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _source(tmp_path)
    out = weights_io.write_hf_dir(_weights(LLAMA), tmp_path / "out", source=src)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["bos_token_id"] == 128000 and cfg["eos_token_id"] == [128001, 128009]
    assert cfg["pad_token_id"] == 62 and cfg["custom_field"] == "kept"
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["dtype"] == "float32" and "torch_dtype" not in cfg  # the export's dtype
    assert ModelSpec.from_hf_config(cfg) == LLAMA
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.6
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("w1 w2", add_special_tokens=False) == [1, 2]
    assert tok.apply_chat_template([{"role": "user", "content": "w3"}], tokenize=False) == "w3 "
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.generation_config.eos_token_id == [128001, 128009]


def test_export_without_a_source_is_built_from_the_spec(tmp_path):
    out = weights_io.write_hf_dir(_weights(TINY_MOE), tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == json.loads(json.dumps(weights_io.export_config(TINY_MOE, None)))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_source_of_another_model_is_refused(tmp_path):
    src = _source(tmp_path, spec=LLAMA)
    other = ModelSpec(family="llama", vocab_size=64, hidden_size=32, head_dim=8, rope_theta=1e4)
    with pytest.raises(ValueError, match="another model"):
        weights_io.write_hf_dir(_weights(other), tmp_path / "out", source=src)


def test_large_exports_are_sharded_with_an_index_that_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    w = _weights(LLAMA)
    out = weights_io.write_hf_dir(w, tmp_path / "out", max_shard_size=20_000)
    index = json.loads((out / weights_io.INDEX_FILE).read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"]) == set(w.tensors)
    assert weights_io.read_hf_dir(out).tensors.keys() == w.tensors.keys()
    model = AutoModelForCausalLM.from_pretrained(str(out))
    sd = model.state_dict()
    for k, t in w.tensors.items():
        torch.testing.assert_close(sd[k], t, rtol=0, atol=0)


def test_an_export_is_written_tensor_by_tensor_from_views_cast_and_transformed(tmp_path):
    """Views of one buffer (as the trainer's parameters are) are written each on its own, cast
    to the export's dtype, through a transform (a LoRA fold); the shards are split by the
    bytes written (here bf16: half of each fp32 tensor's), as save_pretrained splits what it
    writes; a transform that changes a shape is refused before the export lands."""
    from huggingface_hub import split_torch_state_dict_into_shards

    w = _weights(LLAMA)
    flat = torch.cat([t.reshape(-1) for t in w.tensors.values()])
    views, at = {}, 0
    for k, t in w.tensors.items():  # every tensor a view of one flat buffer
        views[k] = flat[at : at + t.numel()].view(t.shape)
        at += t.numel()
    name = next(k for k in w.tensors if k.endswith("q_proj.weight"))
    out = weights_io.write_hf_dir(
        HFWeights(version=4, spec=LLAMA, tensors=views),
        tmp_path / "out",
        dtype=torch.bfloat16,
        max_shard_size=20_000,
        transform=lambda k, t: t * 2 if k == name else t,
    )
    got = weights_io.read_hf_dir(out)
    assert got.version == 4 and got.tensors.keys() == w.tensors.keys()
    for k, t in w.tensors.items():
        want = (t * 2 if k == name else t).to(torch.bfloat16)
        assert got.tensors[k].dtype == torch.bfloat16
        torch.testing.assert_close(got.tensors[k], want, rtol=0, atol=0)
    cast = {k: t.to(torch.bfloat16) for k, t in sorted(w.tensors.items())}  # as written
    want_split = split_torch_state_dict_into_shards(cast, max_shard_size=20_000)
    index = json.loads((out / weights_io.INDEX_FILE).read_text())
    assert index["weight_map"] == want_split.tensor_to_filename
    with pytest.raises(ValueError, match="must keep each tensor's shape"):
        weights_io.write_hf_dir(w, tmp_path / "bad", transform=lambda k, t: t.reshape(-1))
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left


def test_save_hf_replaces_its_own_output_atomically_and_never_user_data(tmp_path):
    out = tmp_path / "hf"
    hf_save.write(_weights(LLAMA, 1), out, source=None)
    assert hf_save.verify(out) is None
    hf_save.write(_weights(LLAMA, 2), out, source=None)
    marker = json.loads((out / hf_save.MARKER).read_text())
    assert marker["version"] == 2 and hf_save.verify(out) is None
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary or old directory left
    (out / "model.safetensors").write_bytes(b"x")
    assert "sha256" in hf_save.verify(out)
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not written by --save-hf"):
        hf_save.write(_weights(LLAMA, 3), user, source=None)
    assert (user / "notes.txt").read_text() == "keep"


ENV = Environment(model=TINY_MOE, cpus=(0, 1))


def _cfg(*argv: str):
    return validate(build_parser().parse_args(list(argv)), ENV)


def test_embedded_run_derives_save_hf_in_its_run_dir_and_none_turns_it_off(tmp_path):
    cfg = _cfg("--run-dir", str(tmp_path / "run"))
    assert cfg.trainer.save_hf == str(tmp_path / "run" / "hf")
    assert cfg.derived["--save-hf"].value == str(tmp_path / "run" / "hf")
    assert _cfg("--run-dir", str(tmp_path), "--save-hf", "none").trainer.save_hf is None
    given = _cfg("--run-dir", str(tmp_path), "--save-hf", str(tmp_path / "x"))
    assert given.trainer.save_hf == str(tmp_path / "x") and "--save-hf" not in given.derived


@pytest.mark.parametrize(
    ("save_hf", "save", "needle"),
    [
        ("ck", "ck", "contains --save"),  # the same directory
        ("ck", "ck/inner", "contains --save"),  # replacing it would delete the checkpoints
        ("ck/latest", "ck", "name 'latest'"),
        ("ck/iter_0000004", "ck", "name 'iter_0000004'"),
        ("run/weights/hf", None, "weight pushes"),
        ("run/..", None, "contains --run-dir"),
        ("user", None, "non-empty directory not written by --save-hf"),
    ],
)
def test_save_hf_targets_that_would_clash_are_refused_at_parse_time(
    tmp_path, save_hf, save, needle
):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "data.bin").write_bytes(b"1")
    argv = ["--run-dir", str(tmp_path / "run"), "--save-hf", str(tmp_path / save_hf)]
    if save:
        argv += ["--save", str(tmp_path / save)]
    with pytest.raises(ValueError, match="--save-hf") as e:
        _cfg(*argv)
    assert needle in str(e.value)


def test_a_lora_runs_adapter_directory_gets_the_same_ownership_rule(tmp_path):
    """`--save-hf DIR` of a LoRA run also replaces `DIR-adapter`: refused at parse time when
    that holds user data (or a path of the run), accepted when free or written by --save-hf."""
    argv = ["--run-dir", str(tmp_path / "run"), "--save-hf", str(tmp_path / "hf")]
    lora = ["--lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj"]  # the MoE's attention
    mine = tmp_path / "hf-adapter"
    mine.mkdir()
    (mine / "adapter_config.json").write_text("{}")  # the user's own adapter
    (mine / "README.md").write_text("mine")
    _cfg(*argv)  # a full fine-tune never writes DIR-adapter
    with pytest.raises(ValueError, match="LoRA adapter directory") as e:
        _cfg(*argv, *lora)
    assert str(mine) in str(e.value) and "not written by --save-hf" in str(e.value)
    with pytest.raises(ValueError, match="contains --save"):
        _cfg(*argv, *lora, "--save", str(mine / "ck"))
    hf_save.write_adapter(
        {}, LoraSpec(rank=4, alpha=8.0), tmp_path / "ours-adapter", version=1, base_model=None
    )
    cfg = _cfg("--run-dir", str(tmp_path / "run"), "--save-hf", str(tmp_path / "ours"), *lora)
    assert cfg.trainer.save_hf == str(tmp_path / "ours")
    assert (mine / "README.md").read_text() == "mine"


def test_save_hf_beside_the_checkpoints_and_over_its_own_output_is_accepted(tmp_path):
    hf_save.write(_weights(LLAMA, 1), tmp_path / "ck" / "hf", source=None)
    cfg = _cfg(
        "--run-dir",
        str(tmp_path),
        "--save",
        str(tmp_path / "ck"),
        "--save-hf",
        str(tmp_path / "ck" / "hf"),
    )
    assert cfg.trainer.save_hf == str(tmp_path / "ck" / "hf")


def test_a_derived_save_hf_over_user_data_says_how_to_move_it(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("mine")
    with pytest.raises(ValueError, match="--save-hf none"):
        _cfg("--run-dir", str(tmp_path))
