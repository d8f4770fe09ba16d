"""CompIS and baselines as pure tensor functions (public surface; see docs/architecture.md).

Must never import `slime_async`: this package is a leaf. See loss/README.md for the math.
"""

from __future__ import annotations

from loss.advantages import (
    DEFAULT_ADVANTAGE_ESTIMATOR,
    AdvantageFn,
    SamplingDecision,
    available_advantages,
    broadcast_to_tokens,
    compute_advantages,
    dynamic_sampling_decision,
    dynamic_sampling_keep,
    get_advantage,
    grpo_advantages,
    outcome_to_token_rewards,
    overlong_penalty,
    register_advantage,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    whiten,
)
from loss.aggregate import aggregate, denominators
from loss.baseline_configs import (
    DecoupledPPOConfig,
    GSPOConfig,
    M2POConfig,
    PrimeMaskedISConfig,
    SingleRatioConfig,
)
from loss.baselines import (
    decoupled_ppo_loss,
    gspo_loss,
    m2po_loss,
    m2po_mask,
    prime_masked_is_loss,
    single_ratio_denominators,
    single_ratio_loss,
)
from loss.cli import LossSettings, add_loss_args, loss_settings_from_args
from loss.compis import CompISTerms, compis_denominators, compis_loss, compis_terms, compis_weights
from loss.compis_metrics import compis_metrics
from loss.corrections import correct, correct_log
from loss.diagnostics import abs_diff_seq_mean, kl_estimators, percentiles, ratio_stats
from loss.filters import OffPolicyFilterResult, max_off_policy_filter
from loss.kl import KLType, kl_penalty
from loss.named import Registry, load_function
from loss.ppo import PPOTerms, ppo_core, ppo_surrogate
from loss.ratios import safe_log_ratio, safe_ratio
from loss.registry import (
    PLUGIN_NEEDS,
    available_losses,
    compis_config_from_args,
    get_loss,
    get_loss_spec,
    make_slime_loss,
    register_loss,
    resolve_loss,
    resolve_loss_spec,
    slime_compis_loss,
)
from loss.seq_weights import (
    batch_normalize,
    geometric_mask,
    geometric_mean_ratio,
    sequence_is_weights,
    veto_mask,
)
from loss.sft import SFTConfig, sft_loss
from loss.slime_adapter import SLIME_METRIC_KEYS
from loss.spec import LossNeeds, LossSelection, LossSpec
from loss.types import (
    AggMode,
    CompISConfig,
    Correction,
    Denom,
    LossInputs,
    LossOutputs,
    Method,
    PPOConfig,
    WeightedPPOConfig,
)
from loss.vocab_parallel import vocab_parallel_logprobs

__all__ = [
    "DEFAULT_ADVANTAGE_ESTIMATOR",
    "PLUGIN_NEEDS",
    "SLIME_METRIC_KEYS",
    "AdvantageFn",
    "AggMode",
    "CompISConfig",
    "CompISTerms",
    "Correction",
    "DecoupledPPOConfig",
    "Denom",
    "GSPOConfig",
    "KLType",
    "LossInputs",
    "LossNeeds",
    "LossOutputs",
    "LossSelection",
    "LossSettings",
    "LossSpec",
    "M2POConfig",
    "Method",
    "OffPolicyFilterResult",
    "PPOConfig",
    "PPOTerms",
    "PrimeMaskedISConfig",
    "Registry",
    "SFTConfig",
    "SamplingDecision",
    "SingleRatioConfig",
    "WeightedPPOConfig",
    "abs_diff_seq_mean",
    "add_loss_args",
    "aggregate",
    "available_advantages",
    "available_losses",
    "batch_normalize",
    "broadcast_to_tokens",
    "compis_config_from_args",
    "compis_denominators",
    "compis_loss",
    "compis_metrics",
    "compis_terms",
    "compis_weights",
    "compute_advantages",
    "correct",
    "correct_log",
    "decoupled_ppo_loss",
    "denominators",
    "dynamic_sampling_decision",
    "dynamic_sampling_keep",
    "geometric_mask",
    "geometric_mean_ratio",
    "get_advantage",
    "get_loss",
    "get_loss_spec",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimators",
    "kl_penalty",
    "load_function",
    "loss_settings_from_args",
    "m2po_loss",
    "m2po_mask",
    "make_slime_loss",
    "max_off_policy_filter",
    "outcome_to_token_rewards",
    "overlong_penalty",
    "percentiles",
    "ppo_core",
    "ppo_surrogate",
    "prime_masked_is_loss",
    "ratio_stats",
    "register_advantage",
    "register_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "resolve_loss",
    "resolve_loss_spec",
    "safe_log_ratio",
    "safe_ratio",
    "sequence_is_weights",
    "sft_loss",
    "single_ratio_denominators",
    "single_ratio_loss",
    "slime_compis_loss",
    "veto_mask",
    "vocab_parallel_logprobs",
    "whiten",
]
