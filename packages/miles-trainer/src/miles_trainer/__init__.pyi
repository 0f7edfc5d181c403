"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    dr_grpo_advantages,
    estimator_kwargs,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    load_advantage_estimator,
    outcome_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from .checkpoint import (
    dcp_to_hf,
    export_hf,
    hf_to_dcp,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from .config import (
    ADVANTAGE_ESTIMATOR_NAMES,
    AdvantageConfig,
    BackendConfig,
    CriticConfig,
    LoraTrainConfig,
    MegatronConfig,
    OptimizerConfig,
    PolicyLossConfig,
    SFTConfig,
)
from .critic import (
    JointValueLoss,
    ValueHead,
    ValueModel,
    accumulate_value_gradients,
    critic_values,
    explained_variance,
    value_loss,
)
from .fsdp import FSDP2Backend
from .fsdp_sharding import apply_activation_checkpointing
from .importance import importance_weight_sums, importance_weights, normalize_importance_weights
from .logprobs import micro_batch_forward, micro_batch_logprobs, response_logprobs
from .lora import TrainedWeights, attach_adapters, check_lora
from .losses import (
    AGGREGATION_MODES,
    aggregate_loss,
    entropy_bonus_loss,
    entropy_from_logits,
    kl_estimate,
    policy_loss,
    sft_loss,
    train_rollout_logprob_abs_diff,
)
from .megatron_backend import MegatronBackend
from .megatron_convert import RankLayout, hf_from_megatron, hf_to_megatron, rank_entries
from .megatron_cpu import megatron_on_cpu
from .megatron_lora import check_megatron_lora
from .megatron_model import MegatronCausalLM
from .packing import MicroBatch, build_micro_batch, pack_samples, plan_micro_batches, plan_samples
from .policy_step import PolicyStep, accumulate_policy_gradients
from .sft import SFTDataError, ensure_process_group, load_sft_samples, run_sft
from .step import (
    PolicyLossFn,
    StepStats,
    add_is_metrics,
    count_trained,
    mismatch_weights,
    resolve_loss_fn,
    token_advantages,
)
from .weight_sender import DEFAULT_BUCKET_BYTES, WeightSender, iter_weight_buckets

__version__: str

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_ESTIMATOR_NAMES",
    "AGGREGATION_MODES",
    "DEFAULT_BUCKET_BYTES",
    "AdvantageConfig",
    "AdvantageEstimator",
    "BackendConfig",
    "CriticConfig",
    "FSDP2Backend",
    "JointValueLoss",
    "LoraTrainConfig",
    "MegatronBackend",
    "MegatronCausalLM",
    "MegatronConfig",
    "MicroBatch",
    "OptimizerConfig",
    "PolicyLossConfig",
    "PolicyLossFn",
    "PolicyStep",
    "RankLayout",
    "SFTConfig",
    "SFTDataError",
    "StepStats",
    "TrainedWeights",
    "ValueHead",
    "ValueModel",
    "WeightSender",
    "accumulate_policy_gradients",
    "accumulate_value_gradients",
    "add_is_metrics",
    "aggregate_loss",
    "apply_activation_checkpointing",
    "attach_adapters",
    "build_micro_batch",
    "check_lora",
    "check_megatron_lora",
    "compute_advantages",
    "count_trained",
    "critic_values",
    "dcp_to_hf",
    "dr_grpo_advantages",
    "ensure_process_group",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "estimator_kwargs",
    "expand_to_tokens",
    "explained_variance",
    "export_hf",
    "gae_advantages",
    "grpo_advantages",
    "hf_from_megatron",
    "hf_to_dcp",
    "hf_to_megatron",
    "importance_weight_sums",
    "importance_weights",
    "iter_weight_buckets",
    "kl_estimate",
    "load_advantage_estimator",
    "load_checkpoint",
    "load_sft_samples",
    "megatron_on_cpu",
    "micro_batch_forward",
    "micro_batch_logprobs",
    "mismatch_weights",
    "normalize_importance_weights",
    "outcome_token_rewards",
    "pack_samples",
    "plan_micro_batches",
    "plan_samples",
    "policy_loss",
    "rank_entries",
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
    "value_loss",
]
