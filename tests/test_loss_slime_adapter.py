"""The slime custom-loss adapter against slime's contract: vocab-parallel logits from a real
megatron-core output layer at TP=2 over gloo (equal to TP=1), `--use-rollout-logprobs` (no
`log_probs` key), metrics exact under slime's reducer (summed over micro-batches and DP ranks,
divided by the step's samples or tokens), the same keys on an all-masked micro-batch, and slime's
entropy and KL terms.

slime's reducer is mirrored from its source (`get_sum_of_sample_mean` for CP = 1 and
`reduce_train_step_metrics`): per micro-batch, each metric is a scalar; the step value is
Σ_micro-batches Σ_DP-ranks value / (step samples, or step tokens with per-token loss)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from loss.kl import kl_penalty
from loss.slime_adapter import SLIME_METRIC_KEYS, make_slime_loss, response_logprobs

F64 = torch.float64
VOCAB, HIDDEN = 64, 16
torch.set_num_threads(1)


def reducer(response_lengths, loss_masks, *, per_token=False):
    """slime's `sum_of_sample_mean` (CP = 1): Σ_i Σ_t x·m / max(Σ_t m, 1), or Σ x·m per token."""

    def reduce(x):
        out, start = x.new_zeros(()), 0
        for n, m in zip(response_lengths, loss_masks):
            m = m.to(x.dtype)
            s = (x[start : start + n] * m).sum()
            out = out + (s if per_token else s / m.sum().clamp(min=1))
            start += n
        return out

    return reduce


def make_batch(seed=0, n=8, with_behavior=True, all_masked=False):
    """Packed tokens, full-vocabulary `hidden`/`weight` (logits = hidden @ weight.T) and
    slime's per-sample batch lists."""
    g = torch.Generator().manual_seed(seed)
    prompt = [int(x) for x in torch.randint(2, 5, (n,), generator=g)]
    resp = [int(x) for x in torch.randint(2, 7, (n,), generator=g)]
    tokens = [torch.randint(VOCAB, (p + r,), generator=g) for p, r in zip(prompt, resp)]
    hidden = torch.randn(sum(prompt) + sum(resp), HIDDEN, generator=g, dtype=F64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=F64)
    masks = [(torch.rand(r, generator=g) > 0.25).long() for r in resp]
    if all_masked:
        masks = [torch.zeros(r, dtype=torch.long) for r in resp]
    with torch.no_grad():
        cur, _ = response_logprobs(
            (hidden @ weight.T).unsqueeze(0),
            unconcat_tokens=tokens,
            total_lengths=[p + r for p, r in zip(prompt, resp)],
            response_lengths=resp,
        )

    advs = torch.randn(n, generator=g)

    def noisy(scale):
        return [c + scale * torch.randn(c.shape, generator=g, dtype=F64) for c in cur]

    batch = {
        "unconcat_tokens": tokens,
        "total_lengths": [p + r for p, r in zip(prompt, resp)],
        "response_lengths": resp,
        "loss_masks": masks,
        "advantages": [torch.full((r,), float(a), dtype=F64) for r, a in zip(resp, advs)],
        "log_probs": noisy(0.3),
        "rollout_log_probs": noisy(0.5),
        "ref_log_probs": noisy(0.4),
    }
    if with_behavior:
        batch["behavior_log_probs"] = noisy(0.2)
    return batch, hidden, weight


def sub_batch(batch, idx):
    """The micro-batch of samples `idx` (slime packs each micro-batch separately)."""
    out = {k: [v[i] for i in idx] for k, v in batch.items()}
    return out


def packed_rows(batch, idx, hidden):
    """Rows of `hidden` for the samples `idx`, packed in that order."""
    starts = [0]
    for t in batch["total_lengths"]:
        starts.append(starts[-1] + t)
    return torch.cat([hidden[starts[i] : starts[i + 1]] for i in idx])


ARGS = dict(
    eps_clip=0.2,
    eps_clip_high=0.28,
    rollout_temperature=0.9,
    entropy_coef=0.01,
    use_kl_loss=True,
    kl_loss_coef=0.05,
    kl_loss_type="low_var_kl",
)


def run_step(batch, hidden, weight, parts, *, per_token=False, args=None, cfg=None):
    """slime's step: the loss and metrics of each micro-batch (`parts` = lists of sample ids, one
    list per micro-batch, across all DP ranks), then slime's sum and division."""
    fn = make_slime_loss(cfg)
    args = SimpleNamespace(**(args or ARGS))
    total = {}
    for idx in parts:
        mb = sub_batch(batch, idx)
        logits = (packed_rows(batch, idx, hidden) @ weight.T).unsqueeze(0)
        red = reducer(mb["response_lengths"], mb["loss_masks"], per_token=per_token)
        _, metrics = fn(args, mb, logits, red)
        assert list(metrics) == [*SLIME_METRIC_KEYS, "entropy_loss", "kl_loss"]
        assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
        for k, v in metrics.items():
            total[k] = total.get(k, 0.0) + float(v)
    n = len(batch["response_lengths"])
    denom = sum(max(int(m.sum()), 1) for m in batch["loss_masks"]) if per_token else n
    return {k: v / denom for k, v in total.items()}


@pytest.mark.parametrize("per_token", [False, True])
def test_metrics_are_exact_under_slimes_reducer(per_token):
    """Any split into micro-batches and DP ranks reports the same step metrics, and they are
    the per-sample (per-token) means computed directly."""
    batch, hidden, weight = make_batch(seed=3)
    whole = run_step(batch, hidden, weight, [list(range(8))], per_token=per_token)
    split = run_step(batch, hidden, weight, [[0, 5], [1], [2, 3, 7], [4, 6]], per_token=per_token)
    for k in whole:
        assert split[k] == pytest.approx(whole[k], abs=1e-12), k
    # direct per-sample (per-token) means of two of them
    lp_k, lp_s = batch["log_probs"], batch["rollout_log_probs"]
    m = [x.bool() for x in batch["loss_masks"]]
    diffs = [(a - b).abs()[mm] for a, b, mm in zip(lp_k, lp_s, m)]
    if per_token:
        want = torch.cat(diffs).sum() / sum(max(int(x.sum()), 1) for x in m)
    else:
        want = sum(d.sum() / max(len(d), 1) for d in diffs) / 8
    assert whole["train_rollout_logprob_abs_diff"] == pytest.approx(float(want), rel=1e-12)
    assert whole["compis/fallback_frac"] == 0.0
    assert whole["is/engine/mean"] > 0.0 and 0.0 <= whole["pg_clipfrac"] <= 1.0


def test_all_masked_micro_batch_returns_every_key_as_zero():
    batch, hidden, weight = make_batch(seed=4, all_masked=True)
    fn = make_slime_loss()
    logits = (hidden @ weight.T).unsqueeze(0).requires_grad_()
    red = reducer(batch["response_lengths"], batch["loss_masks"])
    loss, metrics = fn(SimpleNamespace(**ARGS), batch, logits, red)
    assert list(metrics) == [*SLIME_METRIC_KEYS, "entropy_loss", "kl_loss"]
    assert all(float(v) == 0.0 for v in metrics.values())
    loss.backward()  # the graph stays connected
    assert logits.grad is not None and float(logits.grad.abs().sum()) == 0.0


def test_fallback_share_is_reported_per_sample():
    """Samples without π_j^Meg count in compis/fallback_frac; engine/staleness get 0 there."""
    with_b, hidden, weight = make_batch(seed=5)
    without = {k: v for k, v in with_b.items() if k != "behavior_log_probs"}
    fn = make_slime_loss()
    outs = []
    for mb in (sub_batch(with_b, range(4)), sub_batch(without, range(4, 8))):
        idx = range(4) if "behavior_log_probs" in mb else range(4, 8)
        logits = (packed_rows(with_b, list(idx), hidden) @ weight.T).unsqueeze(0)
        outs.append(
            fn(
                SimpleNamespace(**ARGS),
                mb,
                logits,
                reducer(mb["response_lengths"], mb["loss_masks"]),
            )[1]
        )
    step = {k: (float(outs[0][k]) + float(outs[1][k])) / 8 for k in outs[0]}
    n_valid = sum(int(m.sum() > 0) for m in without["loss_masks"][4:])
    assert step["compis/fallback_frac"] == pytest.approx(n_valid / 8)
    assert float(outs[1]["is/engine/mean"]) == 0.0 and float(outs[0]["is/engine/mean"]) > 0


def test_use_rollout_logprobs_takes_pi_k_from_the_training_forward():
    """slime's --use-rollout-logprobs sends no `log_probs`: π_k is the detached π_θ (exact for
    one optimizer step per rollout), so the loss equals passing log_probs = detached π_θ."""
    batch, hidden, weight = make_batch(seed=6)
    args = SimpleNamespace(**ARGS, use_rollout_logprobs=True)
    with torch.no_grad():
        cur, _ = response_logprobs(
            (hidden @ weight.T).unsqueeze(0),
            unconcat_tokens=batch["unconcat_tokens"],
            total_lengths=batch["total_lengths"],
            response_lengths=batch["response_lengths"],
            temperature=ARGS["rollout_temperature"],
        )
    no_key = {k: v for k, v in batch.items() if k != "log_probs"}
    given = {**batch, "log_probs": cur}
    red = reducer(batch["response_lengths"], batch["loss_masks"])
    grads, losses = [], []
    for b in (no_key, given):
        w = weight.clone().requires_grad_()
        loss, metrics = make_slime_loss()(args, b, (hidden @ w.T).unsqueeze(0), red)
        loss.backward()
        grads.append(w.grad)
        losses.append(float(loss.detach()))
        assert float(metrics["ppo_kl"]) == pytest.approx(0.0, abs=1e-12)  # r1 = 1
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-12, rtol=0)


def test_entropy_and_kl_terms_follow_slime():
    """loss = pg_loss − entropy_coef·entropy_loss + kl_loss_coef·kl_loss, each reduced."""
    batch, hidden, weight = make_batch(seed=7)
    red = reducer(batch["response_lengths"], batch["loss_masks"])
    logits = (hidden @ weight.T).unsqueeze(0)
    loss, m = make_slime_loss()(SimpleNamespace(**ARGS), batch, logits, red)
    assert float(loss) == pytest.approx(
        float(m["pg_loss"]) - 0.01 * float(m["entropy_loss"]) + 0.05 * float(m["kl_loss"]),
        abs=1e-12,
    )
    lps, ents = response_logprobs(
        logits / ARGS["rollout_temperature"],
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=True,
    )
    p = torch.softmax(logits[0] / ARGS["rollout_temperature"], -1)
    full_ent = -(p * p.log()).sum(-1)
    assert ents is not None
    # entropy of the response rows matches the full-vocabulary formula
    rows = torch.cat(
        [
            torch.arange(
                sum(batch["total_lengths"][:i]) + t - r - 1, sum(batch["total_lengths"][:i]) + t - 1
            )
            for i, (t, r) in enumerate(zip(batch["total_lengths"], batch["response_lengths"]))
        ]
    )
    torch.testing.assert_close(torch.cat(ents), full_ent[rows], atol=1e-12, rtol=0)
    kl = kl_penalty(torch.cat(lps), torch.cat(batch["ref_log_probs"]), "low_var_kl")
    assert float(m["kl_loss"]) == pytest.approx(float(red(kl)), abs=1e-12)


def test_refuses_slime_flags_a_custom_loss_would_drop():
    batch, hidden, weight = make_batch(seed=8)
    red = reducer(batch["response_lengths"], batch["loss_masks"])
    logits = (hidden @ weight.T).unsqueeze(0)
    for extra, match in [
        ({"use_tis": True}, "compis_engine_high"),
        ({"advantage_estimator": "gspo"}, "use grpo"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_slime_loss()(SimpleNamespace(**ARGS, **extra), batch, logits, red)


def test_tokens_outside_a_shard_without_a_group_are_a_clear_error():
    """The old bug: one TP shard's logits treated as the full vocabulary."""
    batch, hidden, weight = make_batch(seed=9)
    red = reducer(batch["response_lengths"], batch["loss_masks"])
    shard = (hidden @ weight[: VOCAB // 2].T).unsqueeze(0)
    with pytest.raises(ValueError, match="tensor-parallel group"):
        make_slime_loss()(SimpleNamespace(**ARGS), batch, shard, red)


# ------------------------------------------------------------------------- TP = 2 over gloo


def _tp_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from slime_async.trainer.parallel import ParallelLayout, init_distributed, init_model_parallel

    init_distributed(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    init_model_parallel(ParallelLayout(tp=2, ep=1, pp=1, dp=1), seed=0)
    batch, hidden, weight = make_batch(seed=11)
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=2,
        use_cpu_initialization=True,
        params_dtype=F64,
        perform_initialization=False,
    )
    layer = ColumnParallelLinear(
        HIDDEN, VOCAB, config=cfg, init_method=lambda w: None, bias=False, gather_output=False
    )
    shard = VOCAB // 2
    with torch.no_grad():
        layer.weight.copy_(weight[rank * shard : (rank + 1) * shard])
    h = hidden.clone().unsqueeze(1).requires_grad_()  # [T, 1, H], megatron's [s, b, h]
    logits, _ = layer(h)  # [T, 1, V/2]: this rank's vocabulary shard
    assert logits.shape[-1] == shard
    red = reducer(batch["response_lengths"], batch["loss_masks"])
    loss, metrics = make_slime_loss()(SimpleNamespace(**ARGS), batch, logits.transpose(0, 1), red)
    loss.backward()
    torch.save(
        {
            "loss": loss.detach(),
            "metrics": metrics,
            "h_grad": h.grad.squeeze(1),
            "w_grad": layer.weight.grad,
            "tp": ps.get_tensor_model_parallel_world_size(),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(240)
def test_tp2_vocab_parallel_logits_match_tp1(tmp_path):
    """Two gloo ranks, each holding half the vocabulary of a megatron-core ColumnParallelLinear
    output layer: the loss, every metric and the gradients equal the TP=1 run."""
    from slime_async.host import free_port

    batch, hidden, weight = make_batch(seed=11)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    red = reducer(batch["response_lengths"], batch["loss_masks"])
    ref_loss, ref_metrics = make_slime_loss()(
        SimpleNamespace(**ARGS), batch, (h @ w.T).unsqueeze(0), red
    )
    ref_loss.backward()
    mp.spawn(_tp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        assert r["tp"] == 2
        assert float(r["loss"]) == pytest.approx(float(ref_loss), abs=1e-12)
        for k, v in ref_metrics.items():
            assert float(r["metrics"][k]) == pytest.approx(float(v), abs=1e-12), k
        torch.testing.assert_close(r["h_grad"], h.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat([r["w_grad"] for r in ranks]), w.grad, atol=1e-12, rtol=0)
