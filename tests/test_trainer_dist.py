"""Multi-rank layouts against the single-rank reference (gloo processes, one torch thread each).

For every layout the loss and grad norm of two train steps, the per-token log-probs (plain,
R2-trained, π_j snapshots, R3-replayed) and the weights after the two steps match DP1, and the
exported and pushed weights are the reference's bit for bit. The default suite runs world size
2 (DP2 with the distributed optimizer, TP2+SP, EP2, PP2 1F1B, and TP2 × ETP1: the experts' own
tensor parallelism apart from TP) with packed sequences; `slow` tests add padded sequences with
token-budget micro-batches, activation recompute with R3 replay, world size 4 (TP2×PP2,
TP2×EP2×DP2, TP2×ETP1 with EP1 and EP2), TP2×ETP1×EP2 at world size 2 and the interleaved
pipeline schedule (PP2 × 2 virtual stages). Checkpoints written by a distributed-optimizer
layout and a TP2 layout resume at DP1 exactly.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp

from slime_async.contracts.model import TINY_MOE, ModelSpec

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)

WS2 = {"dp2": (1, 1, 1), "tp2": (2, 1, 1), "ep2": (1, 2, 1), "pp2": (1, 1, 2)}  # tp, ep, pp
WS4 = {"tp2pp2": (2, 1, 2), "tp2ep2dp2": (2, 2, 1)}
VARIANTS = {
    "packed": {},
    "padded_dynamic": dict(qkv_format="bshd", use_dynamic_batch_size=True, max_tokens_per_gpu=30),
    "recompute_r3": dict(
        routing_replay="r3",
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    ),
}
DEEP = ModelSpec(num_layers=4)  # 4 layers: PP2 × 2 virtual stages, one layer per chunk
STEPS = 2


def _cfg(**kw):
    from slime_async.trainer.config import TrainerConfig

    # adam_eps 1e-4: near-zero grads (rare tokens) then move weights ∝ grad, not ±lr noise
    base = dict(
        lr=1e-3,
        micro_batch_size=2,
        seed=5,
        clip_grad=0.0,
        keep_old_actor=True,
        adam_eps=1e-4,
        routing_replay="r2",
        max_snapshots=3,
    )
    base.update(kw)
    return TrainerConfig(**base)


def _batch(spec: ModelSpec = TINY_MOE):
    """Ragged batch with random (fixed) engine routing (used by R3 only)."""
    import numpy as np

    from slime_async.trainer.testing import random_batch

    lengths = [18, 9, 12, 7, 10, 8, 6, 11]
    b = random_batch(spec, batch=8, width=18, prompt=5, seed=9, lengths=lengths)
    rng = np.random.default_rng(4)
    nl, k, e = spec.num_layers, spec.moe_topk, spec.num_experts
    routed = tuple(
        np.stack([rng.permutation(e)[:k] for _ in range((n - 1) * nl)]).reshape(n - 1, nl, k)
        for n in b.lengths.tolist()
    )
    return dataclasses.replace(b, routed_experts=routed)


def _r3_logprobs(tr, batch):
    from slime_async.trainer.replay import RoutingReplay

    old = tr.cfg
    tr.cfg = dataclasses.replace(old, routing_replay=RoutingReplay.R3)
    try:
        return tr.compute_logprobs(batch)[0]
    finally:
        tr.cfg = old


def _run(tr, spec: ModelSpec) -> dict[str, object]:
    """Two steps, then every kind of log-prob forward; the reference and the layouts alike."""
    b = _batch(spec)
    init = tr.export_weights().tensors
    # what a weight push sends (views of the parameters where the layout allows): cloned now
    pushed = {k: v.clone() for k, v in tr.export_weights(copy=False).tensors.items()}
    metrics = [tr.train_step(b) for _ in range(STEPS)]
    return {
        "init": init,
        "pushed": pushed,
        "loss": torch.tensor([m["loss/total"] for m in metrics], dtype=torch.float64),
        "gnorm": torch.tensor([m["train/grad_norm"] for m in metrics], dtype=torch.float64),
        "lp": tr.compute_logprobs(b)[0],
        "lp_j": tr.compute_behavior_logprobs(b),
        "lp_r3": _r3_logprobs(tr, b),
        "final": tr.export_weights().tensors,
        "state_bytes": torch.tensor(tr.optim.state_bytes()),
        "distributed": torch.tensor(tr.optim.distributed),
    }


def _worker(rank, world, port, layouts, variant, spec_d, hf_dir, out_dir) -> None:
    torch.set_num_threads(1)
    from slime_async.trainer.trainer import MegatronTrainer

    spec = ModelSpec.from_dict(spec_d)
    results: dict[str, object] = {}
    for name, (tp, ep, pp, vp, *etp) in layouts.items():
        cfg = _cfg(
            hf_checkpoint=hf_dir,
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp[0] if etp else None,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            save=os.path.join(out_dir, f"ck_{name}"),
            **VARIANTS[variant],
        )
        tr = MegatronTrainer(cfg, spec, rank=rank, world_size=world, master_port=port)
        res = _run(tr, spec)
        if name in ("dp2", "tp2", "tp2etp1"):
            tr.save_checkpoint()
        from megatron.core import parallel_state as ps

        lay, etp = tr.layout, ps.get_expert_tensor_parallel_world_size()  # megatron's own
        res["layout"] = torch.tensor([lay.tp, lay.ep, lay.pp, lay.dp, etp])
        if rank == 0:
            results[name] = res
        tr.shutdown()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


def _compare(tmp_path, *, world, layouts, variant="packed", spec=TINY_MOE):
    """Run the DP1 reference here and `layouts` in `world` spawned ranks; assert agreement.
    Returns (reference trainer, its results, the layouts' results)."""
    from slime_async.trainer.trainer import MegatronTrainer, free_port

    ref = MegatronTrainer(_cfg(**VARIANTS[variant]), spec)
    hf_dir = ref.save_weights(tmp_path / "init")
    want = _run(ref, spec)
    if ref.cfg.routing_replay.value != "r3":  # (under R3 `lp` already replays the routing)
        assert (want["lp_r3"] - want["lp"]).abs().max() > 1e-2  # random routing: teeth
    args = (world, free_port(), layouts, variant, spec.to_dict(), str(hf_dir), str(tmp_path))
    mp.spawn(_worker, args=args, nprocs=world, join=True)
    res = torch.load(tmp_path / "results.pt", weights_only=True)
    for name, r in res.items():
        # the exported (gathered) shards are exactly the weights they were sliced from
        assert r["init"].keys() == want["init"].keys()
        for k in want["init"]:
            assert torch.equal(r["init"][k], want["init"][k]), (name, k)
            assert torch.equal(r["pushed"][k], want["init"][k]), (name, k)
        assert (r["loss"] - want["loss"]).abs().max() <= 1e-5, (name, r["loss"], want["loss"])
        assert torch.allclose(r["gnorm"], want["gnorm"], rtol=1e-4), (name, r["gnorm"])
        for key in ("lp", "lp_j", "lp_r3"):  # per token: TP partial sums differ ~1e-5
            assert (r[key] - want[key]).abs().max() <= 1e-4, (name, key)
        for k in want["final"]:
            assert (r["final"][k] - want["final"][k]).abs().max() <= 1e-5, (name, k)
        tp, ep, pp, _, *etp = layouts[name]
        assert r["layout"].tolist()[:3] == [tp, ep, pp], name
        assert int(r["layout"][4]) == (etp[0] if etp else tp), name
        # DP > 1: the distributed optimizer (default) holds its share of the Adam state
        dp = int(r["layout"][3])
        assert bool(r["distributed"]) == (dp > 1), name
        if dp > 1 and tp == pp == 1:
            assert int(r["state_bytes"]) <= 0.55 * int(want["state_bytes"]), name
    return ref, want, res


def _resume_matches(tmp_path, ref, name: str) -> None:
    """A checkpoint of layout `name` loads at DP1 (resharded, state gathered) and continues
    exactly like the uninterrupted reference."""
    from slime_async.trainer.trainer import MegatronTrainer

    resumed = MegatronTrainer(_cfg(load=str(tmp_path / f"ck_{name}")), TINY_MOE)
    assert resumed.version == STEPS
    b = _batch()
    # snapshots are not checkpointed: train on version-2 tokens so both sides have π_j^Meg
    b = dataclasses.replace(b, token_versions=torch.where(b.loss_mask, STEPS, -1))
    cont = resumed.train_step(b)
    again = ref.train_step(b)
    assert cont["loss/compis_fallback"] == again["loss/compis_fallback"] == 0.0
    assert abs(cont["loss/total"] - again["loss/total"]) <= 1e-5
    got, want = resumed.export_weights().tensors, ref.export_weights().tensors
    for k in want:  # one more Adam update: the moments were restored too
        assert (got[k] - want[k]).abs().max() <= 1e-5, (name, k)
    resumed.shutdown()


def test_world_size_2_layouts_match_dp1(tmp_path):
    layouts = {k: (*v, None) for k, v in WS2.items()}
    ref, _, res = _compare(tmp_path, world=2, layouts=layouts)
    _resume_matches(tmp_path, ref, "dp2")  # distributed-optimizer shards gathered
    ref2 = _compare_ref_again(tmp_path)
    _resume_matches(tmp_path, ref2, "tp2")  # TP shards gathered
    assert res["tp2"]["layout"][0] == 2


def _compare_ref_again(tmp_path):
    """A fresh reference at version STEPS (the first one moved on in `_resume_matches`)."""
    from slime_async.trainer.trainer import MegatronTrainer

    ref = MegatronTrainer(_cfg(hf_checkpoint=str(tmp_path / "init")), TINY_MOE)
    _run(ref, TINY_MOE)
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["padded_dynamic", "recompute_r3"])
def test_world_size_2_layouts_match_dp1_variants(tmp_path, variant):
    _compare(tmp_path, world=2, layouts={k: (*v, None) for k, v in WS2.items()}, variant=variant)


@pytest.mark.slow
def test_world_size_4_combinations_match_dp1(tmp_path):
    _compare(tmp_path, world=4, layouts={k: (*v, None) for k, v in WS4.items()})


def test_expert_tensor_parallel_apart_from_tp_matches_dp1(tmp_path):
    """The experts' own tensor parallelism: the dense layers split by TP 2, each expert whole
    on both TP ranks (ETP 1, EP 1): its gradient is summed over the experts' DP group (both
    ranks), not the dense layers' (one). Its checkpoint (the experts' Adam state sharded over
    the experts' DP group) resumes at DP1 exactly."""
    ref, _, _ = _compare(tmp_path, world=2, layouts={"tp2etp1": (2, 1, 1, None, 1)})
    _resume_matches(tmp_path, ref, "tp2etp1")


@pytest.mark.slow
def test_expert_tensor_parallel_with_expert_parallel_matches_dp1(tmp_path):
    """slime's Qwen3-30B-A3B layout in small: TP 2, ETP 1, EP 2 on 2 ranks; and on 4 ranks
    ETP 1 under TP 2 x DP 2 with the experts replicated (EP 1: the experts' DP is 4, the dense
    layers' 2) and split (EP 2: the experts' DP is 2)."""
    (tmp_path / "ws2").mkdir(), (tmp_path / "ws4").mkdir()
    _compare(tmp_path / "ws2", world=2, layouts={"tp2etp1ep2": (2, 2, 1, None, 1)})
    layouts = {"tp2etp1": (2, 1, 1, None, 1), "tp2etp1ep2dp2": (2, 2, 1, None, 1)}
    _compare(tmp_path / "ws4", world=4, layouts=layouts)


@pytest.mark.slow
def test_interleaved_pipeline_matches_dp1(tmp_path):
    _compare(tmp_path, world=2, layouts={"pp2vp2": (1, 1, 2, 2)}, spec=DEEP)


ONE_RANK = """
import socket, sys
from slime_async.trainer import parallel
with socket.socket() as held:  # another process's listener on the port the probe would give
    held.bind(("127.0.0.1", 0))
    held.listen()
    parallel.init_distributed(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=held.getsockname()[1]
    )
    import torch.distributed as dist
    print(dist.get_world_size())
"""


def test_a_one_rank_group_binds_no_port():
    """A one-rank trainer (or the forward-only role) rendezvouses in memory: a port another
    process holds does not stop it (before: EADDRINUSE when the probed port was taken)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", ONE_RANK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1"
