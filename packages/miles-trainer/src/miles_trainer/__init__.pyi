"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .advantages import (
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
    FSDP2Config,
    OptimizerConfig,
    PolicyLossConfig,
    SFTConfig,
)
from .fsdp import FSDP2Backend, apply_activation_checkpointing
from .logprobs import micro_batch_forward, micro_batch_logprobs, response_logprobs
from .losses import (
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
from .offload import FileStore, HostStore, Offloader
from .packing import MicroBatch, build_micro_batch, pack_samples, plan_micro_batches, plan_samples
from .sft import SFTDataError, ensure_process_group, load_sft_samples, run_sft
from .step import (
    PolicyLossFn,
    StepStats,
    accumulate_policy_gradients,
    count_trained,
    resolve_loss_fn,
    token_advantages,
)
from .weight_sender import DEFAULT_BUCKET_BYTES, iter_weight_buckets

__version__: str

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_ESTIMATOR_NAMES",
    "AGGREGATION_MODES",
    "DEFAULT_BUCKET_BYTES",
    "AdvantageEstimator",
    "FSDP2Backend",
    "FSDP2Config",
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
    "ensure_process_group",
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
