"""miles-trainer: RL losses and advantages (pure functions; formulas in docstrings), sequence packing, the
trainer's log-probs under the log-prob contract, and the FSDP2 backend.

Checkpoints, offload and weight export land with the rest of the trainer issue.
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
from miles_trainer.fsdp import FSDP2Backend, OptimizerConfig
from miles_trainer.logprobs import micro_batch_logprobs, response_logprobs
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
from miles_trainer.packing import MicroBatch, build_micro_batch, pack_samples, plan_micro_batches
from miles_trainer.step import PolicyLossConfig, accumulate_policy_gradients, count_trained

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "AdvantageEstimator",
    "FSDP2Backend",
    "MicroBatch",
    "OptimizerConfig",
    "PolicyLossConfig",
    "accumulate_policy_gradients",
    "aggregate_loss",
    "build_micro_batch",
    "compute_advantages",
    "count_trained",
    "dr_grpo_advantages",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "expand_to_tokens",
    "gae_advantages",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "micro_batch_logprobs",
    "pack_samples",
    "plan_micro_batches",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "response_logprobs",
    "rloo_advantages",
    "sft_loss",
    "train_rollout_logprob_abs_diff",
]
