"""Sequence packing (THD) and token-budget micro-batches: the plan, the row layout, and that a
packed batch computes exactly what the padded one does (log-probs, gradients, loss), including
samples of length 1 and a micro-batch holding one very long sample."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from slime_async.contracts.model import TINY_MOE

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)


# ---------------------------------------------------------------- the plan (pure)
def test_token_budget_plan_is_balanced_deterministic_and_equal_across_dp():
    from slime_async.trainer.packing import plan_micro_batches

    # the docstring's worked example
    assert plan_micro_batches([7, 2, 5, 3, 1], dp=1, micro_batch_size=1, max_tokens=10) == [
        [[0, 1], [2, 3, 4]]
    ]
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in np.minimum(rng.pareto(1.2, 32) * 40 + 8, 300)]
    plans = plan_micro_batches(lengths, dp=2, micro_batch_size=1, max_tokens=256)
    assert plans == plan_micro_batches(lengths, dp=2, micro_batch_size=1, max_tokens=256)
    assert len(plans[0]) == len(plans[1])  # every DP rank runs the same number
    for r, plan in enumerate(plans):
        rows = sorted(i for mb in plan for i in mb)
        assert rows == list(range(16))  # each sample exactly once
        for mb in plan:
            tokens = sum(lengths[r * 16 + i] for i in mb)
            assert tokens <= 256 or len(mb) == 1  # within budget, or one over-long sample
    # the fixed plan: consecutive micro-batch-size slices of each shard
    assert plan_micro_batches([5] * 6, dp=2, micro_batch_size=2) == [[[0, 1], [2]]] * 2


def test_over_budget_sample_gets_its_own_micro_batch_and_interleaving_needs_a_multiple():
    from slime_async.trainer.packing import plan_micro_batches

    plan = plan_micro_batches([50, 3, 4, 5], dp=1, micro_batch_size=1, max_tokens=10)[0]
    assert [0] in plan and sorted(i for mb in plan for i in mb) == [0, 1, 2, 3]
    assert (
        len(plan_micro_batches([3] * 8, dp=1, micro_batch_size=1, max_tokens=100, multiple_of=2)[0])
        == 2
    )
    with pytest.raises(ValueError, match="multiple of PP=2 micro-batches"):
        plan_micro_batches([3] * 6, dp=1, micro_batch_size=2, multiple_of=2)
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 4"):
        plan_micro_batches([3] * 6, dp=4, micro_batch_size=2)


def test_packed_layout_positions_and_token_alignment():
    from slime_async.trainer.packing import (
        model_input,
        position_ids,
        row_layout,
        sample_index,
        to_samples,
    )

    lay = row_layout([3, 1, 4], packed=True, tp=3)
    assert (lay.rows, lay.width, lay.cu_seqlens) == (1, 9, (0, 3, 4, 8, 9))  # + pad segment
    assert position_ids(lay).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 0]]
    tokens = torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 7, 8]])
    ids = model_input(tokens, lay)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 0]]
    # a per-position value "predicted token" = the next input id: aligned back, it must equal
    # the token itself at every valid position, never a token of the neighbouring sample
    src, valid = sample_index(lay, 4)
    back = to_samples(ids[:, 1:].float(), src, valid)
    assert torch.equal(back, torch.where(valid, tokens.float(), 0.0))
    assert valid.tolist() == [[False, True, True, False], [False] * 4, [False, True, True, True]]
    padded = row_layout([3, 1, 4], packed=False, tp=1, min_rows=4)
    assert (padded.rows, padded.width, padded.starts) == (4, 4, ((0, 0), (1, 0), (2, 0)))


def test_engine_routing_is_placed_like_the_packed_tokens():
    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer.replay import engine_routing_to_replay

    spec = ModelSpec(num_layers=2, num_experts=4, moe_topk=2)
    a = np.arange(2 * 2 * 2).reshape(2, 2, 2) % 4  # 3 tokens → 2 rows
    b = (np.arange(3 * 2 * 2).reshape(3, 2, 2) + 1) % 4  # 4 tokens → 3 rows
    packed = engine_routing_to_replay([a, b], spec=spec, width=8, starts=[(0, 0), (0, 3)], rows=1)
    assert packed[1][1].tolist() == a[1, 1].tolist()
    assert packed[0][3 + 2].tolist() == b[2, 0].tolist()
    assert packed[0][2].tolist() == [0, 1]  # sample a's last token: never trained, synthetic
    halves = [
        engine_routing_to_replay(
            [a, b], spec=spec, width=8, tp=2, tp_rank=r, starts=[(0, 0), (0, 3)], rows=1
        )
        for r in (0, 1)
    ]
    assert torch.equal(torch.cat([halves[0][0], halves[1][0]]), packed[0])


# ---------------------------------------------------------------- exactness (world size 1)
def _batch():
    """Ragged, with two length-1 samples (nothing trained) and one very long sample."""
    from slime_async.contracts.batch import TrainerBatch

    g = torch.Generator().manual_seed(3)
    lengths = [9, 1, 64, 12, 5, 1, 17, 7]
    toks = [torch.randint(0, TINY_MOE.vocab_size, (n,), generator=g).tolist() for n in lengths]
    prompts = [min(3, n) for n in lengths]
    rng = np.random.default_rng(1)
    nl, k, e = TINY_MOE.num_layers, TINY_MOE.moe_topk, TINY_MOE.num_experts
    routed = [
        np.stack([rng.permutation(e)[:k] for _ in range((n - 1) * nl)]).reshape(n - 1, nl, k)
        if n > 1
        else np.zeros((0, nl, k), dtype=np.int64)
        for n in lengths
    ]
    return TrainerBatch.from_lists(
        tokens=toks,
        prompt_lengths=prompts,
        rollout_logprobs=[[-8.0] * (n - p) for n, p in zip(lengths, prompts)],
        advantages=[1.0, -1.0] * 4,
        versions=[0] * 8,
        routed_experts=routed,
    )


def _trainer(**kw):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    # adam_eps 1e-4: near-zero grads then move weights ∝ grad, not ±lr noise (comparisons)
    base = dict(
        lr=2e-3,
        seed=3,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=40,
        routing_replay="r3",
        adam_eps=1e-4,
    )
    base.update(kw)
    return MegatronTrainer(TrainerConfig(**base), TINY_MOE)


def _grads(tr) -> dict[str, torch.Tensor]:
    """The step's reduced gradients (megatron DDP's main_grad buffers; DP1: full tensors)."""
    return {n: p.main_grad.detach().clone() for n, p in tr.model.named_parameters()}


def test_packed_and_padded_give_the_same_logprobs_gradients_and_loss():
    b = _batch()
    out = {}
    for fmt in ("thd", "bshd"):
        tr = _trainer(qkv_format=fmt)
        lp, ent = tr.compute_logprobs(b)
        plan = [m.rows for m in tr._local(b)]
        m = tr.train_step(b)
        out[fmt] = (lp, ent, _grads(tr), m, plan)
        tr.shutdown()
    (lp_t, ent_t, g_t, m_t, plan_t), (lp_p, ent_p, g_p, m_p, plan_p) = out["thd"], out["bshd"]
    assert plan_t == plan_p and [2] in plan_t  # the 64-token sample alone (budget 40)
    assert (lp_t - lp_p).abs().max() <= 1e-5 and (ent_t - ent_p).abs().max() <= 1e-5
    assert (lp_t[b.lengths == 1] == 0).all()  # length-1 samples: nothing to score
    assert m_t["loss/total"] == pytest.approx(m_p["loss/total"], abs=1e-6)
    assert m_t["train/num_tokens"] == m_p["train/num_tokens"] == float(b.loss_mask.sum())
    for k in g_p:
        scale = g_p[k].abs().max().clamp(min=1e-3)
        assert (g_t[k] - g_p[k]).abs().max() / scale <= 1e-4, k


def test_token_budget_micro_batches_keep_the_loss_exact():
    """Uneven micro-batches (token budget) give the loss and update of fixed micro-batches."""
    b = _batch()
    fixed = _trainer(use_dynamic_batch_size=False, max_tokens_per_gpu=None, micro_batch_size=8)
    budget = _trainer()
    mf, mb = fixed.train_step(b), budget.train_step(b)
    assert mf["train/micro_batches"] == 1.0 and mb["train/micro_batches"] >= 3.0
    assert mb["loss/total"] == pytest.approx(mf["loss/total"], abs=1e-6)
    assert mb["train/grad_norm"] == pytest.approx(mf["train/grad_norm"], rel=1e-5)
    wf, wb = fixed.export_weights().tensors, budget.export_weights().tensors
    assert max((wf[k] - wb[k]).abs().max().item() for k in wf) <= 1e-6  # after one update


def test_recompute_replays_the_same_routing_in_the_backward():
    """R3 with full activation recompute equals R3 without it: the backward's re-forward
    replays each micro-batch's routing (megatron's REPLAY_BACKWARD). The engine routing is
    random, so a recompute that routed by itself would change the gradients."""
    b = _batch()
    rc = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    plain, rec, broken = _trainer(), _trainer(**rc), _trainer(**rc)
    broken.schedule.recompute = False  # negative control: recompute without the replay queue
    ms = [[t.train_step(b) for _ in range(2)] for t in (plain, rec, broken)]
    losses = [[m["loss/total"] for m in run] for run in ms]
    assert losses[1] == losses[0]
    assert losses[2][1] != pytest.approx(losses[0][1], abs=1e-4)
    w0, w1 = plain.export_weights().tensors, rec.export_weights().tensors
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_bf16_trains_with_fp32_main_params_and_resumes_exactly(tmp_path):
    b = dataclasses.replace(_batch(), routed_experts=None)
    tr = _trainer(bf16=True, routing_replay="none", save=str(tmp_path / "ck"))
    assert {p.dtype for p in tr.model.parameters()} == {torch.bfloat16}
    subs = tr.optim._subs()
    assert all(
        m.dtype == torch.float32 for s in subs for g in s.fp32_from_float16_groups for m in g
    )
    losses = [tr.train_step(b)["loss/total"] for _ in range(3)]
    assert losses[2] < losses[0]
    tr.save_checkpoint()
    again = tr.train_step(b)
    resumed = _trainer(bf16=True, routing_replay="none", load=str(tmp_path / "ck"))
    cont = resumed.train_step(b)
    assert cont["loss/total"] == again["loss/total"]
    w0, w1 = tr.export_weights().tensors, resumed.export_weights().tensors
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_batching_and_recompute_flags_are_checked():
    from slime_async.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="needs --max-tokens-per-gpu"):
        TrainerConfig(use_dynamic_batch_size=True)
    with pytest.raises(ValueError, match="is the budget of --use-dynamic-batch-size"):
        TrainerConfig(max_tokens_per_gpu=512)
    with pytest.raises(ValueError, match="needs --recompute-method uniform\\|block"):
        TrainerConfig(recompute_granularity="full")
    with pytest.raises(ValueError, match="apply to --recompute-granularity full only"):
        TrainerConfig(recompute_granularity="selective", recompute_method="block")
    with pytest.raises(ValueError, match="qkv_format='sbhd'"):
        TrainerConfig(qkv_format="sbhd")
    with pytest.raises(ValueError, match="needs a value >= 2 and --pipeline-model"):
        TrainerConfig(virtual_pipeline_model_parallel_size=2)
