"""Trainer ⇄ embedded engine end to end: export → engine serves it (bf16) → R3 replays the
engine's `routed_experts` exactly; `/update_weights_from_disk` picks up the next version."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch

from slime_async.contracts.model import TINY_MOE

pytestmark = pytest.mark.timeout(180)
torch.set_num_threads(1)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _generate(url: str, prompts: list[list[int]], n: int) -> list[dict]:
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    return _post(url + "/generate", body)


def _batch_from_answers(prompts, answers, version: int):
    from slime_async.contracts.batch import TrainerBatch
    from slime_async.contracts.rollout import decode_routed_experts

    routed = [
        decode_routed_experts(
            a["meta_info"]["routed_experts"], num_layers=TINY_MOE.num_layers, topk=TINY_MOE.moe_topk
        )
        for a in answers
    ]
    return TrainerBatch.from_lists(
        tokens=[p + a["output_ids"] for p, a in zip(prompts, answers)],
        prompt_lengths=[len(p) for p in prompts],
        rollout_logprobs=[[e[0] for e in a["meta_info"]["output_token_logprobs"]] for a in answers],
        advantages=[1.0, -1.0, 1.0],
        versions=[version] * len(prompts),
        routed_experts=routed,
    )


def test_r3_replays_embedded_engine_routing_and_weight_update(tmp_path):
    import dataclasses

    from slime_async.engine.config import EngineConfig
    from slime_async.engine.runner import EngineServer
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.replay import RoutingReplay, capture_routing
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    tr = MegatronTrainer(
        TrainerConfig(lr=3e-3, micro_batch_size=4, seed=4, routing_replay="r3"), TINY_MOE
    )
    warm = random_batch(TINY_MOE, batch=8, width=24, prompt=6, seed=8)
    plain = dataclasses.replace(tr.cfg, routing_replay=RoutingReplay.NONE)
    r3 = tr.cfg
    tr.cfg = plain
    for _ in range(3):
        tr.train_step(warm)
    tr.cfg = r3
    w3 = tr.save_weights(tmp_path / "v3")
    srv = EngineServer(
        EngineConfig(model_dir=str(w3), dtype="bf16", weight_version="3", num_threads=1)
    )
    url = srv.start(timeout=120)
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, TINY_MOE.vocab_size, size=n).tolist() for n in (5, 7, 4)]
        answers = _generate(url, prompts, 10)
        assert {a["meta_info"]["weight_version"] for a in answers} == {"3"}
        batch = _batch_from_answers(prompts, answers, 3)
        caps: list[torch.Tensor] = []
        with capture_routing(tr.model, caps):
            lp, _ = tr.compute_logprobs(batch)
        starts = [0, *torch.cumsum(batch.lengths, 0).tolist()]  # packed: samples back to back
        for b in range(batch.size):
            n = int(batch.lengths[b]) - 1
            for layer, c in enumerate(caps):
                got = c[starts[b] : starts[b] + n]  # routing map of sample b's tokens
                want = torch.zeros_like(got)
                ids = torch.from_numpy(batch.routed_experts[b][:, layer].astype(np.int64))
                want.scatter_(-1, ids, True)
                assert torch.equal(got, want), (b, layer)
        m = batch.loss_mask
        assert (lp - batch.rollout_logprobs)[m].abs().mean() < 0.02  # same weights, bf16 vs fp32
        metrics = tr.train_step(batch)  # R3 train step on the engine's own sample
        assert np.isfinite(metrics["loss/total"]) and tr.version == 4
        w4 = tr.save_weights(tmp_path / "v4")
        res = _post(
            url + "/update_weights_from_disk", {"model_path": str(w4), "weight_version": "4"}
        )
        assert res["success"], res
        answers = _generate(url, prompts, 10)
        assert {a["meta_info"]["weight_version"] for a in answers} == {"4"}
        batch4 = _batch_from_answers(prompts, answers, 4)
        lp4, _ = tr.compute_logprobs(batch4)
        assert (lp4 - batch4.rollout_logprobs)[batch4.loss_mask].abs().mean() < 0.02
    finally:
        srv.stop()
