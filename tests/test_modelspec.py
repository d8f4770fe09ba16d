from __future__ import annotations

import pytest

from slime_async.contracts.model import TINY_MOE, ModelSpec


def test_hf_round_trip_moe_and_llama(tmp_path):
    assert ModelSpec.from_hf_config(TINY_MOE.to_hf_config()) == TINY_MOE
    dense = ModelSpec(family="llama", num_layers=3)
    assert ModelSpec.from_hf_config(dense.to_hf_config()) == dense
    TINY_MOE.save(tmp_path / "spec.json")
    assert ModelSpec.load(tmp_path / "spec.json") == TINY_MOE


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"family": "gpt2"}, "unknown model family"),
        ({"num_attention_heads": 3, "num_key_value_heads": 2}, "multiple of"),
        ({"moe_topk": 5}, "moe_topk"),
    ],
)
def test_bad_specs_raise(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ModelSpec(**kwargs)


def test_unknown_fields_rejected():
    with pytest.raises(ValueError, match="unknown ModelSpec fields"):
        ModelSpec.from_dict({"hidden": 3})
