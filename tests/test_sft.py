"""slime's SFT mode (`--loss-type sft_loss`) on the same trainer: the loss is the NLL of the
assistant tokens; conversations are marked through the chat template; a run trains on
`--prompt-data`'s conversations without engines and its NLL falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loss import LossInputs, get_loss_spec, sft_loss
from loss.sft import SFTConfig
from slime_async.config import parse_config
from slime_async.orchestrator.controller import train
from slime_async.rollout.data.datasets import DatasetError
from slime_async.rollout.data.sft import SFTData, render_trained

pytestmark = pytest.mark.timeout(600)


def _inputs(lp: torch.Tensor, mask: torch.Tensor) -> LossInputs:
    z = torch.zeros_like(lp)
    return LossInputs(
        logprobs=lp, proximal_logprobs=z, rollout_logprobs=z, advantages=z, loss_mask=mask
    )


def test_the_sft_loss_is_the_nll_of_the_trained_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -9.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = sft_loss(_inputs(lp, mask))
    assert float(out.loss.detach()) == pytest.approx(2.5) and out.metrics[
        "sft/nll"
    ] == pytest.approx(2.5)
    out.loss.backward()
    assert torch.equal(lp.grad, torch.where(mask, -0.25, 0.0))  # -1/N on trained tokens only
    per_seq = sft_loss(_inputs(lp.detach(), mask), SFTConfig(agg_mode="seq-mean-token-mean"))
    assert float(per_seq.loss) == pytest.approx(3.0)  # slime's per-sample mean
    needs = get_loss_spec("sft").needs  # the training forward alone: no pi_k, no engine
    assert not needs.proximal_logprobs and not needs.rollout_logprobs


def test_assistant_turns_are_the_trained_tokens():
    from slime_async.engine.testing import ascii_chat_tokenizer

    tok = ascii_chat_tokenizer()
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "ok"},
    ]
    c = render_trained(tok, msgs, where="row 1")
    text = [tok.decode([i], skip_special_tokens=False) for i in c.ids]
    trained = "".join(t for t, m in zip(text, c.trained, strict=True) if m)
    assert trained == "yo<|im_end|>\nok<|im_end|>\n"  # content and closing tokens, nothing else
    assert "".join(text).startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    strip = "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}X"
    strip += "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(DatasetError, match="row 1: the chat template renders assistant message 1"):
        render_trained(ascii_chat_tokenizer(strip), msgs, where="row 1")


def _chat_data(path: Path, n: int = 4) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": f"add {i} and 1"},
                      {"role": "assistant", "content": f"the sum is {i + 1}"}]}
        for i in range(n)
    ]  # fmt: skip
    rows.append(
        {"messages": [{"role": "user", "content": "no answer"}]}
    )  # skipped: nothing to train
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_step_takes_its_own_conversations_in_a_seeded_order(tmp_path):
    from slime_async.engine.testing import ascii_chat_tokenizer

    data = SFTData(
        str(_chat_data(tmp_path / "c.jsonl", n=5)),
        tokenizer=ascii_chat_tokenizer(),
        input_key="messages",
        batch_size=2,
        seed=3,
    )
    assert data.metrics == {"data/rows": 5.0, "data/skipped": 1.0}
    seen = [data.batch(s, version=0)[0].tokens for s in range(3)]  # rows 0-5: epoch 0, then 1
    again = SFTData(
        str(tmp_path / "c.jsonl"), tokenizer=ascii_chat_tokenizer(), input_key="messages",
        batch_size=2, seed=3,
    )  # fmt: skip
    assert torch.equal(again.batch(1, version=0)[0].tokens, seen[1])  # a resume repeats nothing
    assert sorted(data.order(0)) == list(range(5)) and data.order(0) != data.order(1)


async def test_an_sft_run_trains_without_engines_and_its_nll_falls(tmp_path):
    from slime_async.engine.testing import chat_model_dir

    model = chat_model_dir(str(tmp_path / "m"))
    run = tmp_path / "run"
    argv = [  # the SFT arguments of slime's Qwen3-4B-Base SFT script, scaled down
        *("--run-dir", str(run), "--hf-checkpoint", model),
        *("--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout"),
        *("--prompt-data", str(_chat_data(tmp_path / "c.jsonl")), "--input-key", "messages"),
        *("--rollout-batch-size", "4", "--n-samples-per-prompt", "1", "--loss-type", "sft_loss"),
        *("--calculate-per-token-loss", "--debug-train-only", "--rollout-shuffle"),
        *("--disable-compute-advantages-and-returns", "--num-epoch", "4"),  # 5 rows // 4: 4 steps
        *("--lr", "3e-3", "--micro-batch-size", "4"),
    ]
    cfg = parse_config(argv)
    assert cfg.trainer.loss.name == "sft" and cfg.debug_train_only
    last = await train(cfg)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    nll = [r["sft/nll"] for r in rows if "sft/nll" in r]
    assert len(nll) == 4 and last["train/version"] == 4
    assert nll[-1] < 0.7 * nll[0], nll  # it learns the answers
    assert not (run / "roles.json").exists()  # no engine, no router
