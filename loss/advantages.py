"""Advantage estimators (docs/loss-spec.md §8) and DAPO extras (docs/loss-spec.md §9).

Owns: `grpo_advantages` (unbiased std; `std_normalize=False` is Dr.GRPO), `reinforce_pp_returns`,
`reinforce_pp_advantages` (global token whitening), `reinforce_pp_baseline_advantages`,
`outcome_to_token_rewards`, `broadcast_to_tokens`, `overlong_penalty`, `dynamic_sampling_keep`,
`dynamic_sampling_decision`, and the estimator registry: `register_advantage`, `get_advantage`,
`available_advantages`, `compute_advantages` (what the rollout side calls, by name, with slime's
raw rewards `raw_reward_advantages` and batch whitening). Pure
functions; must never import `slime_async`.

Worked example (spec A1): one group, rewards R = [1, 0, 0, 0]
    mean 0.25, unbiased std 0.5 → GRPO (R − 0.25)/(0.5 + 1e-6) = [1.499997, −0.499999, ...];
    Dr.GRPO R − 0.25 = [0.75, −0.25, −0.25, −0.25]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from clifields import StrEnum
from loss.named import Registry
from loss.ratios import broadcast_seq


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample GRPO advantages `[N]` from scalar rewards `[N]` and integer group ids `[N]`.

    A_i = (R_i − mean_g) / (std_g + eps) with the unbiased (Bessel) std; Dr.GRPO
    (`std_normalize=False`): A_i = R_i − mean_g. A group of size 1 uses mean 0, std 1 (verl
    parity): A = R/(1 + eps) (GRPO) or R (Dr.GRPO). All-equal groups give 0.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]."
        )
    r = rewards.detach().to(torch.float64)
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    g = counts.numel()
    sums = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, r)
    cnt = counts.to(torch.float64)
    mean = sums / cnt
    sq = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(
        0, inv, (r - mean[inv]) ** 2
    )
    std = (sq / (cnt - 1).clamp(min=1)).sqrt()
    single = counts == 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    adv = r - mean[inv]
    if std_normalize:
        adv = adv / (std[inv] + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def broadcast_to_tokens(
    values: torch.Tensor, mask: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sequence values `[B]` → per-token `[B, T]` / `[N]`, 0 outside `mask`."""
    return torch.where(
        mask,
        broadcast_seq(
            values.to(torch.float32 if not values.is_floating_point() else values.dtype),
            mask,
            cu_seqlens,
        ),
        0.0,
    )


def outcome_to_token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Put each sequence's scalar reward on its last valid token (0 elsewhere)."""
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    flat_mask = mask.reshape(-1)
    if cu_seqlens is None:
        t = mask.shape[1]
        pos = torch.arange(t, device=mask.device).expand_as(mask)
        last = torch.where(mask, pos, -1).amax(dim=1)
        rows = (last >= 0).nonzero().squeeze(1)
        out[rows, last[rows]] = rewards.detach().to(torch.float64)[rows]
        return out
    idx = torch.arange(flat_mask.numel(), device=mask.device)
    cu = cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        seg = idx[cu[i] : cu[i + 1]][flat_mask[cu[i] : cu[i + 1]]]
        if seg.numel():
            out[seg[-1]] = float(rewards[i])
    return out


def _to_padded(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None):
    if cu_seqlens is None:
        return x, mask, None
    cu = cu_seqlens.tolist()
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    t = max(lens) if lens else 0
    px = x.new_zeros((len(lens), t))
    pm = torch.zeros((len(lens), t), dtype=torch.bool, device=mask.device)
    for i, n in enumerate(lens):
        px[i, :n] = x[cu[i] : cu[i + 1]]
        pm[i, :n] = mask[cu[i] : cu[i + 1]]
    return px, pm, lens


def _from_padded(
    px: torch.Tensor, like: torch.Tensor, lens: list[int] | None, cu_seqlens: torch.Tensor | None
):
    if lens is None or cu_seqlens is None:
        return px
    out = like.new_zeros(like.shape, dtype=px.dtype)
    cu = cu_seqlens.tolist()
    for i, n in enumerate(lens):
        out[cu[i] : cu[i + 1]] = px[i, :n]
    return out


def reinforce_pp_returns(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Discounted returns G_t = Σ_{s ≥ t} γ^{s−t} r_s within each response (masked tokens carry
    no reward and do not break the discount chain); 0 outside `mask`."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must be in [0, 1] (REINFORCE++ default 1.0).")
    r, m, lens = _to_padded(
        torch.where(mask, token_rewards.to(torch.float64), 0.0), mask, cu_seqlens
    )
    if gamma == 1.0:
        g = r.flip(-1).cumsum(-1).flip(-1)
    else:
        g = torch.zeros_like(r)
        running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
        for t in range(r.shape[1] - 1, -1, -1):
            running = r[:, t] + gamma * running
            g[:, t] = running
    g = torch.where(m, g, 0.0)
    return _from_padded(g, token_rewards, lens, cu_seqlens)


def whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """Global token whitening over valid tokens: (x − μ)/sqrt(σ²_unbiased + eps); 0 elsewhere."""
    x = values.to(torch.float64)
    n = mask.sum()
    if int(n) == 0:
        return torch.zeros_like(x)
    mean = torch.where(mask, x, 0.0).sum() / n
    var = torch.where(mask, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
    return torch.where(mask, (x - mean) / torch.sqrt(var + eps), 0.0)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++: discounted returns, then global whitening over all valid tokens (longer
    responses weigh more)."""
    return whiten(
        reinforce_pp_returns(token_rewards, mask, gamma=gamma, cu_seqlens=cu_seqlens), mask
    )


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline: R − group mean, broadcast to the tokens, then global whitening."""
    centred = grpo_advantages(rewards, group_ids, std_normalize=False).to(torch.float64)
    return whiten(broadcast_to_tokens(centred, mask, cu_seqlens=cu_seqlens), mask)


# ------------------------------------------------------------------ estimators by name

AdvantageFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`fn(rewards [B], group_ids [B], mask [B, T] bool) -> advantages [B, T]` (0 outside `mask`)."""

DEFAULT_ADVANTAGE_ESTIMATOR = "grpo"
_ESTIMATORS: Registry[AdvantageFn] = Registry(
    "advantage estimator", hint=" (add your own with loss.register_advantage)"
)


def register_advantage(name: str, fn: AdvantageFn, *, replace: bool = False) -> AdvantageFn:
    """Register an outcome-reward estimator `fn(rewards, group_ids, mask) -> [B, T]`."""
    if not callable(fn):
        raise ValueError(f"advantage estimator {name!r} must be callable, got {fn!r}.")
    return _ESTIMATORS.register(name, fn, replace=replace)


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered as `name`; unknown names raise ValueError listing the choices."""
    return _ESTIMATORS.get(name)


def available_advantages() -> list[str]:
    """Registered estimator names, sorted."""
    return _ESTIMATORS.names()


RAW_REWARD_ESTIMATORS = ("grpo", "dr_grpo", "reinforce_plus_plus_baseline")
"""The estimators that normalise rewards within a group (subtract its mean, GRPO also divides by
its std), which slime's `--disable-rewards-normalization` turns off."""


def raw_reward_advantages(name: str, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """slime's `--disable-rewards-normalization`: the estimator `name` (one of
    `RAW_REWARD_ESTIMATORS`) on the raw rewards, no group mean subtracted: grpo and dr_grpo
    broadcast each sample's reward to its tokens; reinforce_plus_plus_baseline then whitens them
    over the batch, as it always does. `[B]` rewards, `[B, T]` mask -> `[B, T]`."""
    if name not in RAW_REWARD_ESTIMATORS:
        raise ValueError(
            f"raw rewards apply to {', '.join(RAW_REWARD_ESTIMATORS)}, not estimator {name!r}"
        )
    tokens = broadcast_to_tokens(rewards.to(torch.float64), mask)
    return whiten(tokens, mask) if name == "reinforce_plus_plus_baseline" else tokens


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalize_rewards: bool = True,
    whiten_advantages: bool = False,
) -> torch.Tensor:
    """Per-token advantages `[B, T]` (0 outside `mask`) by the estimator `name`.

    Samples that are not `valid` (e.g. their reward failed) become singleton groups (group id
    −1 − i), so they never shift another sample's group statistics; give them an empty mask.
    `normalize_rewards=False` (slime's `--disable-rewards-normalization`): the raw rewards
    (`raw_reward_advantages`); `whiten_advantages` (slime's `--normalize-advantages`): the
    advantages whitened over every valid token of the batch afterwards (`whiten`).

    Worked example: one group, rewards [1, 0], one token each: grpo [0.707, −0.707];
    raw rewards [1, 0]; raw then whitened [0.707, −0.707] (mean 0.5, unbiased std 0.707).
    """
    if normalize_rewards:
        fn = get_advantage(name)
        ids = torch.arange(len(group_ids), device=group_ids.device)
        adv = fn(rewards, torch.where(valid, group_ids, -1 - ids), mask)
    else:
        adv = raw_reward_advantages(name, rewards, mask)
    return whiten(adv, mask).to(adv.dtype) if whiten_advantages else adv


def _grpo(std_normalize: bool) -> AdvantageFn:
    def fn(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        per_sample = grpo_advantages(rewards, group_ids, std_normalize=std_normalize)
        return broadcast_to_tokens(per_sample, mask)

    return fn


def _reinforce_pp(rewards: torch.Tensor, _: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return reinforce_pp_advantages(outcome_to_token_rewards(rewards, mask), mask)


register_advantage("grpo", _grpo(std_normalize=True))
register_advantage("dr_grpo", _grpo(std_normalize=False))
register_advantage("reinforce_plus_plus", _reinforce_pp)
register_advantage("reinforce_plus_plus_baseline", reinforce_pp_baseline_advantages)


def overlong_penalty(
    lengths: torch.Tensor, *, max_len: int, buffer_len: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong penalty: min(−(L − (L_max − L_buf))/L_buf·κ, 0), per response."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}."
        )
    expected = max_len - buffer_len
    pen = -(lengths.to(torch.float64) - expected) / buffer_len * factor
    return pen.clamp(max=0.0)


def dynamic_sampling_keep(group_metrics: Sequence[Sequence[float]]) -> list[bool]:
    """DAPO dynamic sampling: keep a group unless it has > 1 sample and zero metric std."""
    keep = []
    for g in group_metrics:
        vals = [float(v) for v in g]
        keep.append(len(vals) <= 1 or max(vals) != min(vals))
    return keep


class SamplingDecision(StrEnum):
    """What the rollout loop does after filtering a generation batch."""

    ENOUGH = "enough"
    """The train batch is full: train."""
    SAMPLE_MORE = "sample_more"
    """Too few groups kept: generate another batch."""
    GIVE_UP = "give_up"
    """`max_num_gen_batches` reached: train on what there is (or stop), and log it."""


def dynamic_sampling_decision(
    num_kept_groups: int, train_groups: int, gen_batches_done: int, max_num_gen_batches: int
) -> SamplingDecision:
    """Spec D3: enough groups → ENOUGH; else more generation unless the cap was reached."""
    if num_kept_groups >= train_groups:
        return SamplingDecision.ENOUGH
    if max_num_gen_batches > 0 and gen_batches_done >= max_num_gen_batches:
        return SamplingDecision.GIVE_UP
    return SamplingDecision.SAMPLE_MORE
