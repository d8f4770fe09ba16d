"""Only the positions whose log-prob is read go through the LM head: in the trainer (the train
step and its no-grad forwards), in the forward-only role and in the embedded engine's prefill.

Pinned against the path where every position goes through the head (the trainer's
`every_position_through_head`, the engine's teacher-forced forward and a prefill that returns
every prompt position's logits): log-probs and entropies within 1e-6 in fp32, the train step's
gradients within 1e-6 of their largest entry and its weights within fp32 rounding, and the
number of rows multiplied by the output weight is exactly the number of tokens read.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slime_async.contracts.model import ModelSpec
from slime_async.engine import EngineConfig

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)

SPEC = ModelSpec(family="qwen3", num_layers=2)  # dense: megatron's MoE router needs a GPU's TE


def _close(a: torch.Tensor, b: torch.Tensor, *, grad: bool = False) -> bool:
    """Values within 1e-6 (absolute or relative); gradients within 1e-6 of their largest entry."""
    if grad:
        return float((a - b).abs().max()) <= 1e-6 * max(1.0, float(b.abs().max()))
    return torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def _head_rows(monkeypatch) -> list[int]:
    """Rows of every chunked-head call (the real function runs; its inputs are recorded)."""
    from slime_async.trainer import forward

    rows: list[int] = []
    real = forward.chunked_logprobs

    def recording(hidden, *args, **kwargs):
        rows.append(int(hidden.shape[0]))
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(forward, "chunked_logprobs", recording)
    return rows


@pytest.mark.parametrize("chunk", [None, 0])
def test_position_logprobs_on_read_positions_equal_every_positions(chunk):
    """The head on the read positions (chunked, and the `[tokens, V]` path) against every
    position: the same values where read, 0 elsewhere, the same gradients."""
    from slime_async.trainer.forward import position_logprobs
    from slime_async.trainer.lm_head import Logits

    g = torch.Generator().manual_seed(0)
    r, w, h, v = 2, 9, 8, 37
    hidden = torch.randn(r, w, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    ids = torch.randint(0, v, (r, w), generator=g)
    read = torch.zeros(r, w - 1, dtype=torch.bool)
    read[0, 3:] = True
    read[1, 5:7] = True
    g_lp, g_ent = torch.randn(r, w - 1, generator=g), torch.randn(r, w - 1, generator=g)
    out = {}
    for name, mask in (("every", None), ("read", read)):
        hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = Logits(hidden=hd, weight=wt, group=None, chunk_tokens=3 if chunk is None else 0)
        lp, ent = position_logprobs(logits, ids, temperature=0.7, read=mask)
        ((lp * g_lp * read).sum() + (ent * g_ent * read).sum()).backward()
        out[name] = (lp.detach(), ent.detach(), hd.grad, wt.grad)
    (lp0, ent0, gh0, gw0), (lp1, ent1, gh1, gw1) = out["every"], out["read"]
    assert _close(lp1[read], lp0[read]) and _close(ent1[read], ent0[read])
    assert bool((lp1[~read] == 0).all() and (ent1[~read] == 0).all())
    assert _close(gh1, gh0, grad=True) and _close(gw1, gw0, grad=True)
    # the plain `[R, W, V]` logits tensor takes the same positions
    z = hidden @ weight.t()
    lp2, ent2 = position_logprobs(z, ids, temperature=0.7, read=read)
    assert _close(lp2[read], lp0[read]) and _close(ent2[read], ent0[read])
    assert bool((lp2[~read] == 0).all())


@pytest.mark.parametrize("qkv", ["thd", "bshd"])
def test_trainer_head_on_trained_tokens_equals_every_position(qkv, monkeypatch):
    """π_k of the trained tokens, the train step's gradients and its updated weights, with the
    head on the trained tokens only and with every position through it (packed and padded);
    the head multiplies exactly the trained tokens' positions."""
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    rows = _head_rows(monkeypatch)
    batch = random_batch(SPEC, batch=4, width=14, prompt=5, seed=0, lengths=[14, 9, 12, 7])
    mask = batch.loss_mask
    # adam_eps >> |grad|: the update is lr · grad, so a gradient's rounding is not amplified
    cfg = TrainerConfig(lr=1e-2, adam_eps=1.0, micro_batch_size=2, seed=3, qkv_format=qkv)
    res = {}
    for every in (True, False):
        tr = MegatronTrainer(cfg, SPEC)
        tr.every_position_through_head = every
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        rows.clear()
        lp, ent = tr.compute_logprobs(batch)
        forward_rows = sum(rows)
        tr.train_step(batch)
        grads = {n: p.main_grad.detach().clone() for n, p in tr.model.named_parameters()}
        after = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        res[every] = (lp, ent, grads, after, forward_rows)
        tr.shutdown()
    lp0, ent0, g0, w0, rows0 = res[True]
    lp1, ent1, g1, w1, rows1 = res[False]
    assert rows0 >= sum(n - 1 for n in batch.lengths.tolist())  # every position (and padding)
    assert rows1 == int(mask.sum())  # only the trained tokens'
    assert _close(lp1[mask], lp0[mask]) and _close(ent1[mask], ent0[mask])
    assert bool((lp1[~mask] == 0).all()) and bool((lp0[~mask] != 0).any())
    for n in g0:
        assert _close(g1[n], g0[n], grad=True), (n, float((g1[n] - g0[n]).abs().max()))
        assert torch.allclose(w1[n], w0[n], atol=1e-6, rtol=0), n
    moved = max(float((w0[n] - before[n]).abs().max()) for n in w0)
    assert moved > 1e-4  # the step changed the weights


def test_snapshot_forwards_multiply_each_versions_tokens_only(monkeypatch):
    """π_j^Meg in the trainer (`--keep-old-actor`, snapshots swapped in): the π_k pass multiplies
    the trained tokens, each older version's pass only the tokens it sampled; the values equal
    every position through the head."""
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, seed=3, keep_old_actor=True, max_snapshots=3)
    batch = random_batch(SPEC, batch=4, width=14, prompt=5, seed=2, lengths=[14, 9, 12, 7])
    tr = MegatronTrainer(cfg, SPEC)
    tr.train_step(batch)
    tr.train_step(batch)
    versions = torch.arange(batch.width).remainder(3).expand(batch.size, -1)
    mixed = dataclasses.replace(batch, token_versions=torch.where(batch.loss_mask, versions, -1))
    rows = _head_rows(monkeypatch)
    got = tr.compute_behavior_logprobs(mixed)
    read_rows = sum(rows)
    tr.every_position_through_head = True
    want = tr.compute_behavior_logprobs(mixed)
    tr.shutdown()
    m = mixed.loss_mask
    old = m & (mixed.token_versions != tr.version)
    assert read_rows == int(m.sum()) + int(old.sum())  # π_k of every trained token, then v0, v1
    assert _close(got[m], want[m])


def test_role_head_on_each_versions_tokens_equals_every_position(monkeypatch):
    """The forward-only role's π_j^Meg: each version's pass multiplies only the trained tokens of
    that version (rows mix versions), and the values equal every position through the head."""
    from slime_async.trainer.behavior_role import BehaviorForwarder
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, seed=3)
    batch = random_batch(SPEC, batch=4, width=14, prompt=5, seed=1, lengths=[14, 9, 12, 7])
    tr = MegatronTrainer(cfg, SPEC)
    w0 = tr.export_weights()
    tr.train_step(batch)
    w1 = tr.export_weights()
    tr.shutdown()
    versions = torch.arange(batch.width).remainder(2).expand(batch.size, -1)
    batch = dataclasses.replace(batch, token_versions=torch.where(batch.loss_mask, versions, -1))
    fwd = BehaviorForwarder(cfg, SPEC, max_versions=2)
    fwd.add_version(0, w0)
    fwd.add_version(1, w1)
    rows = _head_rows(monkeypatch)
    got = torch.as_tensor(fwd.logprobs(batch))
    read_rows = sum(rows)
    fwd.trainer.every_position_through_head = True
    want = torch.as_tensor(fwd.logprobs(batch))
    m = batch.loss_mask
    assert read_rows == int(m.sum())  # each trained token once, in its own version's pass
    assert _close(got[m], want[m]) and bool(got[~m].isnan().all())


def _prefill_rows(lm) -> tuple[list[int], object]:
    """Rows the engine model's output layer multiplies (a forward hook; removed by the handle)."""
    rows: list[int] = []
    head = lm.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, inp, _o: rows.append(inp[0][..., 0].numel()))
    return rows, hook


def test_engine_prefill_multiplies_only_the_last_and_the_asked_prompt_positions():
    """`batch.prefill` with prompt logits from position a equals the prefill returning every
    prompt position's logits (the engine before), sliced; the output layer then multiplies
    each row's last position and positions a..P − 2 only."""
    from slime_async.engine import batch as engine_batch
    from slime_async.engine.model import load_model

    lm = load_model(EngineConfig(dtype="fp32"))
    seqs = [list(range(3, 15)), list(range(20, 27))]  # 12 and 7 prompt tokens
    every = engine_batch.prefill(lm, seqs, prompt_logits_from=[0, 0], capture=False)
    rows, hook = _prefill_rows(lm)
    try:
        some = engine_batch.prefill(lm, seqs, prompt_logits_from=[8, None], capture=False)
        none = engine_batch.prefill(lm, seqs, prompt_logits_from=[None, None], capture=False)
    finally:
        hook.remove()
    assert rows == [2, 12 - 1 - 8, 2]  # the two last positions; 8..10 of the first; the last two
    assert every.prompt_logits[0].shape[0] == 11 and some.prompt_logits[1] is None
    assert _close(some.prompt_logits[0], every.prompt_logits[0][8:])
    assert _close(none.last_logits, every.last_logits)


async def test_engine_input_logprobs_from_logprob_start_len_equal_teacher_forced():
    """Over HTTP (the fp32 engine, its prefix cache on): `input_token_logprobs` from
    `logprob_start_len` equal the teacher-forced forward of the whole prompt (every position
    through the head), a second request reusing the cached prefix included, and the prefill
    multiplies only the positions asked for (+ the last)."""
    import aiohttp

    from slime_async.engine import EngineServer
    from slime_async.engine.model import load_model, teacher_forced
    from slime_async.engine.testing import post

    cfg = EngineConfig(dtype="fp32", weight_version="0")
    ref = load_model(cfg)
    prompt = [(7 * i + 3) % 4000 for i in range(12)]
    want, _ = teacher_forced(ref, prompt)
    with EngineServer(cfg) as srv:
        assert srv.engine is not None and srv.engine.lm is not None
        rows, hook = _prefill_rows(srv.engine.lm)
        try:
            async with aiohttp.ClientSession() as s:
                got = {}
                for start in (8, 10, 0):
                    rows.clear()
                    body = {
                        "input_ids": prompt,
                        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                        "return_logprob": True,
                        "logprob_start_len": start,
                    }
                    status, ans = await post(s, srv.url + "/generate", body)
                    assert status == 200, ans
                    got[start] = (ans["meta_info"]["input_token_logprobs"], sum(rows))
                    cached = ans["meta_info"]["cached_tokens"]
                    assert (cached > 0) == (start == 10), (start, cached)
        finally:
            hook.remove()
    for start, (entries, n_rows) in got.items():
        assert [e[1] for e in entries] == prompt[start:]
        assert n_rows == 1 + len(prompt) - max(start, 1)  # the last + positions start-1..P-2
        vals = [e[0] for e in entries]
        if start == 0:
            assert vals[0] is None
            vals = vals[1:]
        lo = max(start, 1) - 1
        assert _close(torch.tensor(vals), want[lo:]), (start, vals, want[lo:])
