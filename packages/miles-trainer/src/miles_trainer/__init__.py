"""miles-trainer: RL losses and advantages (pure functions; formulas in docstrings), sequence packing, the
trainer's log-probs under the log-prob contract, the FSDP2 backend with its checkpoints, offload/onload and weight
export for sync, and supervised fine-tuning (`miles-trainer sft`).
"""

from miles_trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    dr_grpo_advantages,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    load_advantage_estimator,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from miles_trainer.checkpoint import (
    dcp_to_hf,
    export_hf,
    hf_to_dcp,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from miles_trainer.fsdp import FSDP2Backend, OptimizerConfig, apply_activation_checkpointing
from miles_trainer.logprobs import micro_batch_forward, micro_batch_logprobs, response_logprobs
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
from miles_trainer.offload import FileStore, HostStore, Offloader
from miles_trainer.packing import MicroBatch, build_micro_batch, pack_samples, plan_micro_batches, plan_samples
from miles_trainer.sft import SFTConfig, SFTDataError, load_sft_samples, run_sft
from miles_trainer.step import (
    PolicyLossConfig,
    PolicyLossFn,
    StepStats,
    accumulate_policy_gradients,
    count_trained,
    resolve_loss_fn,
    token_advantages,
)
from miles_trainer.weight_export import DEFAULT_BUCKET_BYTES, iter_weight_buckets

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "DEFAULT_BUCKET_BYTES",
    "AdvantageEstimator",
    "FSDP2Backend",
    "FileStore",
    "HostStore",
    "MicroBatch",
    "Offloader",
    "OptimizerConfig",
    "PolicyLossConfig",
    "PolicyLossFn",
    "SFTConfig",
    "SFTDataError",
    "StepStats",
    "accumulate_policy_gradients",
    "aggregate_loss",
    "apply_activation_checkpointing",
    "build_micro_batch",
    "compute_advantages",
    "count_trained",
    "dcp_to_hf",
    "dr_grpo_advantages",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "expand_to_tokens",
    "export_hf",
    "gae_advantages",
    "grpo_advantages",
    "hf_to_dcp",
    "importance_weights",
    "iter_weight_buckets",
    "kl_estimate",
    "load_advantage_estimator",
    "load_checkpoint",
    "load_sft_samples",
    "micro_batch_forward",
    "micro_batch_logprobs",
    "pack_samples",
    "plan_micro_batches",
    "plan_samples",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "resolve_checkpoint",
    "resolve_loss_fn",
    "response_logprobs",
    "rloo_advantages",
    "run_sft",
    "save_checkpoint",
    "sft_loss",
    "token_advantages",
    "train_rollout_logprob_abs_diff",
]
