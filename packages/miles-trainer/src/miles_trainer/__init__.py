"""miles-trainer: RL losses and advantages (pure functions; formulas in docstrings).

The FSDP2 backend, checkpoints, offload and weight export land with the rest of the trainer issue.
"""

from miles_trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    dr_grpo_advantages,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from miles_trainer.losses import (
    AGGREGATION_MODES,
    aggregate_loss,
    entropy_bonus_loss,
    entropy_from_logits,
    importance_weights,
    kl_estimate,
    policy_loss,
    sft_loss,
    train_rollout_logprob_abs_diff,
)

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "AdvantageEstimator",
    "aggregate_loss",
    "compute_advantages",
    "dr_grpo_advantages",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "expand_to_tokens",
    "gae_advantages",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "sft_loss",
    "train_rollout_logprob_abs_diff",
]
