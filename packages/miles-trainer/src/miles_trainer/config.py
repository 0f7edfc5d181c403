"""The trainer's config models, torch-free: `OptimizerConfig`, `PolicyLossConfig`, `BackendConfig` (the backend) and
`SFTConfig`, with the names of the advantage estimators and of the loss options they accept.

Each setting is defined once, here: the FSDP2 backend and `miles-trainer sft` take these models, `miles-trainer sft
--help` is generated from them, and a run config nests them (`trainer.optimizer`, `trainer.loss`, `trainer.backend`),
so the orchestrator validates a whole run config without importing torch (docs/architecture.md, "Config"). Plug-in
paths (`module:function`) are checked for shape here and imported when the trainer starts.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles_contracts import PluginPath
from miles_kernels.config import LoraConfig
from miles_trainer.megatron_config import MegatronConfig as MegatronConfig  # BackendConfig nests it; importable here

AdvantageEstimatorName = Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum", "token-sum-norm"
]
RatioType = Literal["token", "sequence"]
Surrogate = Literal["ppo", "cispo"]
# k1 / k2 / k3 / abs and their verl names; a "+" suffix: the value of the estimator, the gradient of k2
KLEstimator = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "kl", "mse", "low_var_kl", "low_var_kl+"]
ISLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]
ISRejected = Literal["counted", "excluded"]
ScaleRewards = Literal["group", "batch", "none"]
MoEAuxLoss = Literal["none", "aux_loss", "seq_aux_loss"]

ADVANTAGE_ESTIMATOR_NAMES: tuple[str, ...] = get_args(AdvantageEstimatorName)
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)
RATIO_TYPES: tuple[str, ...] = get_args(RatioType)
SURROGATES: tuple[str, ...] = get_args(Surrogate)
KL_KINDS: tuple[str, ...] = get_args(KLEstimator)
IS_LEVELS: tuple[str, ...] = get_args(ISLevel)
IS_MODES: tuple[str, ...] = get_args(ISMode)
IS_REJECTED: tuple[str, ...] = get_args(ISRejected)
SCALE_REWARDS: tuple[str, ...] = get_args(ScaleRewards)


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimizerConfig(_Config):
    """AdamW (or Muon for the policy's matrices) and its learning-rate schedule (linear warm-up, then constant or
    cosine), with gradient clipping."""

    lr: float = Field(default=1e-5, gt=0, description="AdamW peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas (beta1, beta2), each in [0, 1).")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up optimizer steps.")
    schedule: Literal["constant", "cosine"] = Field(default="constant", description="Schedule after warm-up.")
    total_steps: int | None = Field(
        default=None,
        ge=1,
        description="Optimizer steps the cosine schedule spans; null: the whole job (a run: run.num_steps × "
        "trainer.steps_per_rollout; SFT: its number of steps).",
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="Cosine floor, as a fraction of lr.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    algorithm: Literal["adamw", "muon"] = Field(
        default="adamw",
        description="adamw; or muon: Muon for the policy's trunk weight matrices and AdamW for everything else "
        "(embeddings, LM head, norms, biases, routers), Moonlight's recipe (miles_trainer.muon; the FSDP2 policy's "
        "optimizer only: a critic and the MTP draft step with AdamW).",
    )
    muon_momentum: float = Field(
        default=0.95, ge=0, lt=1, description="algorithm=muon: the momentum of Muon's matrices."
    )
    muon_nesterov: bool = Field(default=True, description="algorithm=muon: Nesterov momentum.")
    muon_ns_steps: int = Field(
        default=5, ge=1, le=99, description="algorithm=muon: Newton-Schulz iterations that orthogonalize each update."
    )

    offload: Literal["none", "moments", "moments_and_master"] = Field(
        default="none",
        description="AdamW's state in host memory, stepped on the CPU (miles_trainer.host_adam; docs/memory.md): "
        "none; moments (exp_avg and exp_avg_sq in pinned host memory, the weights' chunks streamed through it); "
        "moments_and_master (also the float32 weights and gradients, FSDP2's CPU offload). FSDP2 backend, AdamW only.",
    )
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="offload: the host moments' dtype; bfloat16 halves them (4 instead of 8 bytes per parameter), "
        "each chunk widened to float32 for the update and rounded back.",
    )
    offload_chunk_mb: int = Field(
        default=32, ge=1, le=4096,
        description="offload: the float32 MiB of one chunk of the host step (two chunks are staged at a time).",
    )  # fmt: skip

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in value):
            raise ValueError(f"betas={list(value)}: each must be in [0, 1), e.g. [0.9, 0.999]")
        return value

    @model_validator(mode="after")
    def _offload(self) -> OptimizerConfig:
        if self.offload != "none" and self.algorithm == "muon":
            raise ValueError(
                f"offload={self.offload} is AdamW's host-memory optimizer; algorithm=muon steps on the device: set "
                "offload=none, or algorithm=adamw"
            )
        if self.moments_dtype != "float32" and self.offload == "none":
            raise ValueError(
                f"moments_dtype={self.moments_dtype} is the host-memory optimizer's: set offload=moments (or "
                "moments_and_master), or moments_dtype=float32"
            )
        return self

    @property
    def is_master_offloaded(self) -> bool:
        """The float32 weights and their gradients live in host memory (FSDP2's CPUOffloadPolicy)."""
        return self.offload == "moments_and_master"

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` at optimizer step `step` (0-based)."""
        import math

        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        if self.total_steps is None:
            raise ValueError("schedule='cosine' needs total_steps (the optimizer steps it spans)")
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LoraTrainConfig(LoraConfig):
    """LoRA RL / SFT: adapters (`miles_kernels.config.LoraConfig`: rank, alpha, rsLoRA, target modules) train on a
    frozen base; only they get gradients, optimizer state and checkpoint bytes, and weight sync sends only them."""

    base_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Dtype the trainer holds the frozen base in (adapters stay float32 masters): bfloat16 halves "
        "its memory and needs kernel.dtype=bfloat16 (the engine computes with the same rounded base).",
    )
    export_merged: bool = Field(
        default=False,
        description="Also export the merged model (base + adapters, a full Hugging Face checkpoint) next to the "
        "PEFT adapter in the run's final/ directory.",
    )

    def adapters(self) -> LoraConfig:
        """The adapters' own settings (what the engine needs to merge them)."""
        return LoraConfig.model_validate(self.model_dump(include=set(LoraConfig.model_fields)))


class PolicyLossConfig(_Config):
    """The policy loss (`miles_trainer.losses`): PPO-clip with clip-higher and dual-clip, or GSPO's sequence ratio;
    how token losses aggregate; entropy bonus, KL to the reference, and TIS / MIS mismatch correction."""

    surrogate: Surrogate = Field(
        default="ppo",
        description="The policy-gradient surrogate: 'ppo' (PPO-clip, with the options below) or 'cispo' "
        "(MiniMax-M1's CISPO: -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log p per token: clipped tokens keep "
        "their gradient, weighted by the clipped ratio; clip_low=1 leaves the ratio unbounded below, as MiniMax-M1).",
    )
    clip_low: float = Field(
        default=0.2, ge=0, le=1, description="PPO ratio clip below 1 (1 - clip_low; 1: no lower clip)."
    )
    clip_high: float = Field(default=0.2, ge=0, description="PPO ratio clip above 1 (clip-higher when > clip_low).")
    dual_clip: float | None = Field(
        default=None, gt=1, description="Dual-clip constant c > 1 for negative advantages; null: off."
    )
    ratio_type: RatioType = Field(default="token", description="'token': PPO's ratio; 'sequence': GSPO's.")
    agg_mode: AggregationMode = Field(
        default="token-mean",
        description="How token losses aggregate (N_tok tokens, N_seq sequences of the batch, L = max_response_len): "
        "token-mean: sum / N_tok; seq-mean-token-mean: mean over sequences of each one's token mean; "
        "seq-mean-token-sum: sum / N_seq; seq-mean-token-sum-norm: sum / (N_seq * L) (Dr.GRPO as TRL's dr_grpo and "
        "verl >= 0.8); token-sum-norm: sum / L (Dr.GRPO as verl <= 0.7); token-sum: the plain sum.",
    )
    max_response_len: int | None = Field(
        default=None,
        ge=1,
        description="L of seq-mean-token-sum-norm / token-sum-norm (Dr.GRPO's constant): the longest response the "
        "rollout may produce. A run config sets it from rollout.max_new_tokens.",
    )
    temperature: float = Field(
        default=1.0,
        ge=0,
        description="Temperature T of the rollout that made the samples: log-probs are log_softmax(logits / T) "
        "(0: greedy, T = 1). A run config sets it from rollout.temperature.",
    )
    entropy_coef: float = Field(default=0.0, ge=0, description="Entropy bonus weight (0: entropy only reported).")
    kl_coef: float = Field(default=0.0, ge=0, description="KL penalty weight against the initial policy (0: off).")
    opd_topk_coef: float = Field(
        default=0.0,
        ge=0,
        description="On-policy distillation from the teacher's top-k (a run's opd.top_k, which sets it to "
        "opd.kl_coef): weight of the loss term sum_j p_T(j) (log p_T(j) - log p_S(j)) over each trained token's "
        "teacher top-k (verl's compute_forward_kl_topk; miles_trainer.distillation); needs the samples' "
        "teacher_top_logprobs. 0: off.",
    )
    kl_estimator: KLEstimator = Field(
        default="k3",
        description="KL estimator: k1 (verl 'kl'), k2 ('mse'), k3 ('low_var_kl', TRL's), abs; with a '+' suffix "
        "(k1+, k3+, low_var_kl+, abs+) the value is the estimator's and the gradient k2's (verl's straight-through).",
    )
    kl_ratio_correction: bool = Field(
        default=False,
        description="Multiply the per-token KL by the token ratio pi / pi_old (with its gradient: the unbiased "
        "reverse-KL gradient for samples of pi_old; TRL's use_bias_correction_kl, on by default there).",
    )
    is_mode: ISMode | None = Field(
        default=None, description="Mismatch correction when not true on-policy: TIS ('truncate'), MIS ('mask')."
    )
    is_level: ISLevel = Field(default="token", description="Importance weights per token or per sequence.")
    is_threshold: float = Field(
        default=2.0, gt=0, description="Upper bound C: TIS truncates weights above it, MIS rejects them."
    )
    is_threshold_low: float | None = Field(
        default=None,
        ge=0,
        description="Lower bound: MIS rejects weights below it (null: 1 / is_threshold, verl's default); TIS "
        "raises weights below it to it (TRL's clip_min; null: no lower bound).",
    )
    is_rejected: ISRejected = Field(
        default="counted",
        description="Tokens MIS rejects (weight 0): 'counted' stay in the aggregation's token / sequence counts "
        "(TRL); 'excluded' leave them, as a loss mask would (verl's rejection sampling).",
    )
    is_batch_normalize: bool = Field(
        default=False,
        description="Divide the weights by their mean over the whole batch, so they average 1 (verl's "
        "rollout_is_batch_normalize; per token, or per sequence with is_level=sequence).",
    )
    loss_fn: PluginPath | None = Field(
        default=None, description="'module:function' PolicyLossFn replacing PPO-clip; null: the built-in loss."
    )
    moe_aux_loss: MoEAuxLoss = Field(
        default="none",
        description="MoE load-balancing loss (Megatron-Core's names and normalization, 1.0 at uniform routing, "
        "summed over MoE layers): 'aux_loss' over the micro-batch's tokens (Switch, Qwen3-MoE), 'seq_aux_loss' per "
        "sample (DeepSeek-V3, GLM-4.5), 'none' (the RL default: the router moves with the policy loss only).",
    )
    moe_aux_loss_coef: float = Field(default=1e-3, ge=0, description="Weight of moe_aux_loss when it is on.")
    moe_z_loss_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the MoE router z-loss (ST-MoE; Megatron-Core's moe_z_loss_coeff): per MoE layer the "
        "mean over tokens of logsumexp(router logits)^2, summed over MoE layers, reported as moe_z_loss; it keeps "
        "the router logits small. 0: off.",
    )

    @model_validator(mode="after")
    def _surrogate(self) -> PolicyLossConfig:
        if self.surrogate == "cispo":
            given = {"ratio_type=sequence": self.ratio_type == "sequence", "dual_clip": self.dual_clip is not None,
                     "loss_fn": self.loss_fn is not None}  # fmt: skip
            named = [name for name, is_set in given.items() if is_set]
            if named:
                raise ValueError(f"surrogate=cispo is a token-level loss of its own: it takes no {', '.join(named)}")
        return self

    @model_validator(mode="after")
    def _is_bounds(self) -> PolicyLossConfig:
        if self.is_threshold_low is not None and self.is_threshold_low > self.is_threshold:
            raise ValueError(
                f"is_threshold_low={self.is_threshold_low} is above is_threshold={self.is_threshold}; the lower "
                "bound of the importance weights must not exceed the upper one"
            )
        return self


class AdvantageConfig(_Config):
    """Knobs of the advantage estimators (`miles_trainer.advantages`); each applies to the estimators it names."""

    scale_rewards: ScaleRewards = Field(
        default="group",
        description="grpo: divide (reward - group mean) by the group's std ('group', GRPO), the whole batch's std "
        "('batch', TRL's scale_rewards=batch) or nothing ('none': Dr.GRPO's advantage).",
    )
    std_epsilon: float = Field(
        default=1e-6, ge=0, description="grpo: added to the std before dividing (verl 1e-6, TRL 1e-4)."
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="reinforce_plus_plus, gae: discount factor.")
    lam: float = Field(default=1.0, ge=0, le=1, description="gae: the GAE lambda.")
    whiten: bool = Field(
        default=True, description="reinforce_plus_plus, gae: whiten the advantages over the batch's valid tokens."
    )


CriticKind = Literal["separate", "value_head"]


def _critic_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-4)


class CriticConfig(_Config):
    """PPO's critic (`miles_trainer.critic`): the value model, its clipped value loss and its own optimizer."""

    kind: CriticKind = Field(
        default="separate",
        description="'separate': a critic initialized from the policy's checkpoint, trained alone (verl, "
        "OpenRLHF); 'value_head': a value head on the policy's hidden states, its loss joining the policy's.",
    )
    optimizer: OptimizerConfig = Field(
        default_factory=_critic_optimizer,
        description="The critic's own AdamW and schedule (here lr defaults to 1e-4); with kind=value_head it "
        "updates the head only (the trunk follows the policy's optimizer).",
    )
    value_clip: float | None = Field(
        default=0.5, gt=0, description="Clip of the value update around the old values (verl's cliprange_value)."
    )
    vf_coef: float = Field(
        default=0.5, gt=0, description="kind=value_head: weight of the value loss in the joint loss."
    )
    agg_mode: AggregationMode = Field(default="token-mean", description="How the value loss aggregates.")
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Optimizer steps that train the critic alone before the policy starts moving (verl's "
        "critic_warmup).",
    )


class BackendConfig(_Config):
    """The trainer backend: FSDP2 (Miles' own, batch-invariant kernels) or Megatron-core (TP / PP / EP / CP on
    CUDA); micro-batching, activation checkpointing and the device of each rank."""

    name: Literal["fsdp2", "megatron"] = Field(
        default="fsdp2",
        description="fsdp2: the miles-kernels model sharded with FSDP2 (CPU or CUDA; bitwise on-policy with the "
        "embedded engine). megatron: a Megatron-core GPTModel (CUDA only; the miles-trainer[megatron] extra).",
    )
    max_tokens_per_micro_batch: int = Field(default=4096, ge=1, description="Token budget of a packed micro-batch.")
    activation_checkpointing: bool = Field(default=False, description="Recompute activations in backward.")
    device: str = Field(
        default="cpu", description="torch device of each rank: cpu, or cuda (its current CUDA device)."
    )
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="The Megatron backend's layout (name=megatron only)."
    )

    @model_validator(mode="after")
    def _check_megatron(self) -> BackendConfig:
        layout = self.megatron
        if self.name == "fsdp2" and layout != MegatronConfig():
            raise ValueError("trainer.backend.megatron is set but trainer.backend.name is fsdp2: set name=megatron")
        if layout.sequence_parallel and layout.tp == 1:
            raise ValueError("megatron.sequence_parallel needs tp > 1")
        if (layout.etp or 1) > 1 and layout.ep == 1:
            raise ValueError(
                "megatron.etp > 1 needs ep > 1: with ep = 1 megatron-core reduces the experts' gradients as dense "
                "parameters over the data-parallel ranks, which hold different expert shards"
            )
        on_gloo = self.name == "megatron" and self.device == "cpu"
        if on_gloo and (layout.etp or 1) > 1 and layout.moe_token_dispatcher == "alltoall":
            raise ValueError(
                "megatron.etp > 1 with moe_token_dispatcher=alltoall on device=cpu: that dispatcher gathers the "
                "expert tensor-parallel ranks' tokens in uneven all-gathers, which gloo does not do; set "
                "moe_token_dispatcher=allgather (pp = 1), or etp = 1, on a CPU"
            )
        uneven = {k: v for k, v in (("decoder_first_pipeline_num_layers", layout.decoder_first_pipeline_num_layers),
                                    ("decoder_last_pipeline_num_layers", layout.decoder_last_pipeline_num_layers))
                  if v is not None}  # fmt: skip
        if uneven and layout.pp < 2:
            raise ValueError(f"megatron.{' and '.join(uneven)} set with pp={layout.pp}: uneven stages need pp >= 2")
        if len(uneven) == 2 and layout.pp == 2:
            raise ValueError(
                "megatron.decoder_first_pipeline_num_layers and decoder_last_pipeline_num_layers with pp=2: the two "
                "stages are the first and the last, so set one of them (the other stage holds the rest)"
            )
        if (layout.vpp or 1) > 1 and layout.pp < 3:
            raise ValueError(
                f"megatron.vpp={layout.vpp} (virtual pipeline stages) needs pp >= 3: with {layout.pp} stage(s) "
                "megatron-core's interleaved schedule sends to one peer in both directions at once and pairs the "
                "shapes of the packed micro-batches wrongly (Megatron-LM asks pp > 2 for it too)"
            )
        return self


def _sft_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-4, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)


class SFTConfig(_Config):
    """A supervised fine-tuning run (`miles-trainer sft`): shuffled batches of rows, the SFT loss on response
    tokens, AdamW (by default warm-up, then cosine to 10% of lr over the run)."""

    epochs: int = Field(default=3, ge=1, description="Passes over the data.")
    batch_size: int = Field(default=16, ge=1, description="Rows per optimizer step, all ranks together.")
    seed: int = Field(default=0, ge=0, description="Shuffle seed.")
    chat_template: bool = Field(
        default=False, description="Render prompt/response rows with the chat template (messages rows always are)."
    )
    optimizer: OptimizerConfig = Field(
        default_factory=_sft_optimizer,
        description="AdamW and its schedule (SFT defaults: lr 1e-4, 10 warm-up steps, cosine to 10% of lr over "
        "the run; warm-up is capped at the number of steps).",
    )
    backend: BackendConfig = Field(default_factory=BackendConfig, description="The FSDP2 backend.")
    lora: LoraTrainConfig = Field(
        default_factory=LoraTrainConfig,
        description="LoRA: rank > 0 trains adapters on a frozen base and exports a PEFT adapter (docs/lora.md).",
    )
