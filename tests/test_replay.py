"""Rollout dumps and replay, slime's debug modes: `--save-debug-rollout-data` writes what each
step sampled and trained (checksummed JSON); `--load-debug-rollout-data` with
`--debug-train-only` trains from the dumps without engines and reproduces every step of the
original run bit for bit (its loss, gradient norm and final weights); `--debug-rollout-only`
generates and dumps without a trainer. The round trip of a dump and the refusals need no Ray."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from slime_async.config import parse_config
from slime_async.orchestrator.controller import train
from slime_async.rollout.generate.assemble import assemble
from slime_async.rollout.generate.dump import (
    DumpError,
    batch_of,
    dump_path,
    dump_record,
    read_dump,
    write_dump,
)
from tests.rollout_batches import one_group_batch, scored_sample

pytestmark = pytest.mark.timeout(600)


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from slime_async.trainer.weights_io import read_hf_dir

    return read_hf_dir(d).tensors


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss/total" in r]


def _argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        *("--run-dir", str(run_dir), "--num-steps", "2", "--warmstart-steps", "0"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "8", "--eval-interval", "0"),
        *("--max-staleness", "1", "--behavior-forward", "trainer"),
        *("--micro-batch-size", "4", "--lr", "1e-3", "--overlong-buffer-len", "4"),
        *extra,
    ]


async def test_a_replay_of_the_dumps_reproduces_each_step_bit_for_bit(tmp_path):
    dumps = tmp_path / "dumps" / "step_{rollout_id}.json"
    await train(parse_config(_argv(tmp_path / "a", "--save-debug-rollout-data", str(dumps))))
    first = read_dump(dump_path(str(dumps), 0))
    (group, *_) = first["groups"]
    sample = group["samples"][0]
    n = len(sample["response_ids"])
    assert len(sample["logprobs"]) == len(sample["token_versions"]) == n > 0
    assert sample["reward_status"] == "ok" and isinstance(sample["reward"], float)
    assert first["drops"] == {"stale": 0, "filtered": 0}
    assert math.isfinite(first["trained"]["loss/total"])
    assert "__ndarray__" in sample["segments"][-1]["routed_experts"]  # R3's routing kept

    cfg = parse_config(_argv(tmp_path / "b", "--load-debug-rollout-data", str(dumps)))
    assert cfg.debug_train_only and cfg.derived["--debug-train-only"].value is True
    await train(cfg)  # no engines: the trainer alone

    a, b = _steps(tmp_path / "a"), _steps(tmp_path / "b")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        assert y["replay/matches"] == 1.0
        for k in ("loss/total", "train/grad_norm", "rollout/reward", "rollout/overlong_penalty"):
            assert x[k] == y[k], k  # bit for bit
    wa, wb = _tensors(tmp_path / "a" / "hf"), _tensors(tmp_path / "b" / "hf")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (tmp_path / "b" / "roles.json").exists()  # no engine or router ever started


async def test_rollout_only_generates_and_dumps_without_a_trainer(tmp_path, caplog):
    from slime_async.engine.testing import chat_model_dir

    model = chat_model_dir(str(tmp_path / "m"))
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"say {i}", "label": str(i)}) + "\n" for i in range(4))
    )
    run = tmp_path / "run"
    argv = [
        *("--run-dir", str(run), "--hf-checkpoint", model, "--prompt-data", str(data)),
        *("--num-steps", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--rollout-max-response-len", "6", "--debug-rollout-only", "--max-staleness", "0"),
        *("--save-debug-rollout-data", str(tmp_path / "dumps")),
    ]
    # more steps than S + 1: no version is ever pushed, yet admission keeps up with the steps
    with caplog.at_level(logging.WARNING):
        summary = await train(parse_config(argv))
    assert not [r for r in caplog.records if "did not close cleanly" in r.getMessage()]
    assert summary["accounting/consumed"] == 6
    for step in (0, 1, 2):
        body = read_dump(tmp_path / "dumps" / f"{step}.json")
        assert body["trained"] is None and body["trainer_version"] == 0
        s = body["groups"][0]["samples"][0]
        assert s["response_text"] is not None and set(s["token_versions"]) == {0}
    assert not (run / "weights").exists()  # no trainer: nothing exported


def test_a_dump_round_trips_to_the_same_trainer_batch(tmp_path):
    samples = [scored_sample(i, [7, 8, 9][: i + 1], reward=float(i), version=i) for i in range(3)]
    s0 = samples[0]
    routed = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)  # prompt 3 + response 1 - 1
    extra = {"routed_experts": routed, "behavior_logprobs": [float("nan")], "loss_mask": [1]}
    samples[0] = type(s0)(
        sample_index=0,
        output_ids=s0.output_ids,
        token_versions=s0.token_versions,
        payloads=({**s0.payloads[0], **extra},),
        min_version=0,
        attempts=2,
    )
    batch = one_group_batch(samples, version=2)
    path = tmp_path / "d" / "0.json"
    write_dump(path, dump_record(batch, rollout_id=0, decode=lambda ids: "t" * len(ids)))
    body = read_dump(path)
    assert body["groups"][0]["samples"][1]["response_text"] == "tt"
    again = batch_of(body)
    (g0,), (g1,) = batch.groups, again.groups
    assert (g1.prompt, g1.samples[1:]) == (g0.prompt, g0.samples[1:])  # ids, versions, payloads
    p0, p1 = dict(g0.samples[0].payloads[0]), dict(g1.samples[0].payloads[0])
    got = p1.pop("routed_experts")
    assert got.dtype == np.int32 and np.array_equal(got, p0.pop("routed_experts"))
    assert math.isnan(p1.pop("behavior_logprobs")[0]) and math.isnan(p0.pop("behavior_logprobs")[0])
    assert p0 == p1 and g1.samples[0].attempts == 2
    x, y = assemble(batch, estimator="grpo").batch, assemble(again, estimator="grpo").batch
    for name in ("tokens", "loss_mask", "rollout_logprobs", "advantages", "token_versions"):
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    assert torch.equal(x.behavior_logprobs.nan_to_num(5.0), y.behavior_logprobs.nan_to_num(5.0))
    # an altered file is refused with the reason
    text = path.read_text().replace('"reward":1.0', '"reward":9.0')
    path.write_text(text)
    with pytest.raises(DumpError, match="checksum does not match"):
        read_dump(path)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--save-debug-rollout-data", "/tmp/x/{rollout_id}.pt"], "nothing is pickled"),
        (["--save-debug-rollout-data", "/tmp/x/{step}.json"], "only {rollout_id}"),
        (["--debug-train-only"], "from --load-debug-rollout-data PATH"),
        (["--debug-rollout-only", "--debug-train-only"], "--debug-train-only cannot apply"),
        (["--debug-rollout-only", "--warmstart-steps", "0"], "give --hf-checkpoint"),
        (
            ["--load-debug-rollout-data", "/tmp/d", "--save-debug-rollout-data", "/tmp/e"],
            "generates nothing to dump",
        ),
    ],
)
def test_debug_flags_refuse_what_cannot_work(extra, match, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--run-dir", "/tmp/never", "--dry-run", *extra])
    assert match in capsys.readouterr().err
