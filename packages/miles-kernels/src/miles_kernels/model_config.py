"""`ModelConfig`: the Qwen3 / Qwen2.5 / Llama 3.x dense and Qwen3-MoE / GLM-4.5 / DeepSeek-V3 (Kimi-K2) MoE
architectures, read from and written to a Hugging Face config.json (`from_hf` / `to_hf`: model_config_hf.py).

Unsupported options are errors that name the option, rather than silently different numerics.

The families differ in their MoE router and a few attention details (docs/architecture.md, "MoE: model families and
routing replay"):
- Qwen3 (`qwen3`): QK-norm, `attention_bias` on all four projections (off in released checkpoints).
- Qwen2.5 (`qwen2`): biases on q / k / v (always), none on o_proj, no QK-norm.
- Sliding-window attention (`use_sliding_window`, `sliding_window`; off in every released Qwen2.5 / Qwen3
  checkpoint): Qwen2.5 and Qwen3 window the layers `layer_types` names "sliding_attention" (by default those from
  `max_window_layers` on), Qwen3-MoE windows every layer (as transformers does); a row sees its last
  `sliding_window` keys, itself included. Llama and GLM-4.5 have none.
- Llama 3.x (`llama`): no QK-norm, `attention_bias` on all four projections, Llama 3 RoPE scaling (`rope_type:
  llama3`: `factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).
- Qwen3-MoE: softmax router (fp32), top-k, optional renormalization; no shared expert; `decoder_sparse_step` /
  `mlp_only_layers` pick the dense layers.
- GLM-4.5 (`glm4_moe`): sigmoid router scores in fp32 plus the fp32 `e_score_correction_bias` for the choice only,
  grouped top-k (`n_group` groups ranked by the sum of their two best scores, `topk_group` kept), the chosen raw
  scores renormalized and multiplied by `routed_scaling_factor`; `n_shared_experts` always-on experts; the first
  `first_k_dense_replace` layers dense; partial rotary (`partial_rotary_factor`), q/k/v biases
  (`attention_bias`, never on o_proj), optional QK-norm (`use_qk_norm`).
- DeepSeek-V3 / R1 and Kimi-K2 (`deepseek_v3`; Kimi-K2's `kimi_k2` config loads as it): GLM-4.5's router, shared
  experts and dense first layers, with multi-head latent attention (MLA, `is_mla`): q through a low-rank
  `q_lora_rank` (or a plain `q_proj`), keys and values from one shared latent of `kv_lora_rank` plus a
  `qk_rope_head_dim` rotary key part shared by all heads, `qk_nope_head_dim` + `qk_rope_head_dim` per query / key
  head, `v_head_dim` per value head; `head_dim` is `qk_rope_head_dim` (the rotary width, as transformers sets it);
  `rope_interleave` (DeepSeek's rotary pairs are adjacent dimensions); YaRN RoPE scaling (`rope_type: yarn`) whose
  `mscale_all_dim` also scales the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from miles_kernels.model_config_hf import (
    ARCHITECTURES,
    GLM4_MOE_FIELDS,
    GLM_ROUTER_TYPES,
    LAYER_TYPES,
    MLA_FIELDS,
    MOE_TYPES,
    NO_QK_NORM_TYPES,
    ROPE_TYPES,
    SLIDING_WINDOW_TYPES,
    config_to_hf,
    values_from_hf,
)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (Hugging Face field names)."""

    model_type: str = "qwen3"
    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    # MoE (qwen3_moe, glm4_moe); GLM-4.5's `n_routed_experts` is `num_experts`
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # qwen3_moe only: which layers are sparse
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    # glm4_moe and deepseek_v3 (GLM-4.5 / DeepSeek-V3 router, shared experts, dense first layers, attention details)
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    partial_rotary_factor: float = 1.0
    use_qk_norm: bool = True
    # deepseek_v3 only: multi-head latent attention (head_dim = qk_rope_head_dim; q_lora_rank None: a plain q_proj)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # RoPE scaling (Llama 3.x: rope_type "llama3" and its four parameters; DeepSeek-V3: "yarn", with `rope_factor`,
    # `rope_original_max_position_embeddings`, the betas and mscales (0: not given); "default": none)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    # Sliding-window attention (None: off); `layer_types` names each layer's attention when it is on
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    # MTP (multi-token prediction) modules after the trunk, DeepSeek-V3 / GLM-4.5 style (0: none)
    num_nextn_predict_layers: int = 0
    # Token ids (may be None in a bare config)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; Miles kernels support {sorted(ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers={self.num_nextn_predict_layers} must be >= 0")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError(
                f"a {self.model_type} config needs 0 < num_experts_per_tok <= num_experts and "
                f"moe_intermediate_size > 0 (got {self.num_experts_per_tok}, {self.num_experts}, "
                f"{self.moe_intermediate_size})"
            )
        if self.model_type in GLM_ROUTER_TYPES:
            self._check_glm()
        else:
            family = [name for name in GLM4_MOE_FIELDS if name != "use_qk_norm"]
            if any(getattr(self, name) != getattr(ModelConfig, name) for name in family):
                raise ValueError(f"{', '.join(family)} are glm4_moe settings; {self.model_type} has none of them")
            has_qk_norm = self.model_type not in NO_QK_NORM_TYPES
            if self.use_qk_norm != has_qk_norm:
                raise ValueError(
                    f"{self.model_type} {'has' if has_qk_norm else 'has no'} QK-norm: use_qk_norm={has_qk_norm}"
                )
        if self.is_mla:
            self._check_mla()
        elif any(getattr(self, name) != getattr(ModelConfig, name) for name in MLA_FIELDS):
            raise ValueError(f"{', '.join(MLA_FIELDS)} are deepseek_v3 (MLA) settings; {self.model_type} has none")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 (Qwen2.5) has biases on q / k / v: attention_bias=True")
        self._check_rope()
        self._check_sliding_window()

    def _check_sliding_window(self) -> None:
        if self.sliding_window is None:
            if self.layer_types:
                raise ValueError("layer_types is given without a sliding_window; set sliding_window or drop it")
            return
        if self.model_type not in SLIDING_WINDOW_TYPES:
            raise ValueError(
                f"{self.model_type} has no sliding-window attention (sliding_window={self.sliding_window}); "
                f"families with one: {list(SLIDING_WINDOW_TYPES)}"
            )
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (keys each query sees)")
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types needs one of {list(LAYER_TYPES)} per layer ({self.num_hidden_layers}); got "
                f"{list(self.layer_types)}"
            )
        if self.model_type == "qwen3_moe" and "full_attention" in self.layer_types:
            raise ValueError("qwen3_moe windows every layer when sliding_window is set (as transformers does)")

    def _check_rope(self) -> None:
        allowed = ROPE_TYPES.get(self.model_type, ("default",))
        if self.rope_type not in allowed:
            raise ValueError(
                f"unsupported RoPE scaling {self.rope_type!r} for {self.model_type}; implemented: {list(allowed)}"
            )
        if self.rope_type == "llama3" and not (
            self.rope_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_max_position_embeddings > 0
        ):  # fmt: skip
            raise ValueError(
                f"llama3 RoPE scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
                f"original_max_position_embeddings > 0 (got {self.rope_factor}, {self.rope_low_freq_factor}, "
                f"{self.rope_high_freq_factor}, {self.rope_original_max_position_embeddings})"
            )
        if self.rope_type == "yarn" and not (self.rope_factor >= 1 and self.rope_original_max_position_embeddings > 0):
            raise ValueError(
                f"yarn RoPE scaling needs factor >= 1 and original_max_position_embeddings > 0 (got "
                f"{self.rope_factor}, {self.rope_original_max_position_embeddings})"
            )

    def _check_mla(self) -> None:
        if self.kv_lora_rank < 1 or self.qk_nope_head_dim < 1 or self.v_head_dim < 1 or self.qk_rope_head_dim < 2:
            raise ValueError(
                f"deepseek_v3 needs kv_lora_rank, qk_nope_head_dim, v_head_dim >= 1 and an even qk_rope_head_dim "
                f"(got {self.kv_lora_rank}, {self.qk_nope_head_dim}, {self.v_head_dim}, {self.qk_rope_head_dim})"
            )
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"deepseek_v3: head_dim={self.head_dim} must be qk_rope_head_dim={self.qk_rope_head_dim} (the rotary "
                "width, as transformers sets it)"
            )
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be >= 1, or None for a plain q_proj")
        if self.use_qk_norm or self.partial_rotary_factor != 1.0:
            raise ValueError("deepseek_v3 has no QK-norm and rotates its whole qk_rope_head_dim: use_qk_norm=False, "
                             "partial_rotary_factor=1.0")  # fmt: skip

    def _check_glm(self) -> None:
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={self.num_experts}")
        per_group = self.num_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"grouped routing ranks a group by its two best scores: {per_group} expert(s) per group")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {self.topk_group * per_group} experts "
                f"of the topk_group={self.topk_group} groups kept"
            )
        if self.n_shared_experts < 0 or not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"n_shared_experts={self.n_shared_experts} must be >= 0 and first_k_dense_replace="
                f"{self.first_k_dense_replace} in [0, num_hidden_layers]"
            )
        if self.first_k_dense_replace and self.intermediate_size <= 0:
            raise ValueError("first_k_dense_replace > 0 needs intermediate_size > 0 (the dense layers' MLP)")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and give an even rotary "
                f"dimension (head_dim * factor = {self.head_dim * self.partial_rotary_factor})"
            )

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_TYPES

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3 / Kimi-K2)."""
        return self.model_type == "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        """Width of a query / key head: qk_nope_head_dim + qk_rope_head_dim under MLA, else head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_cache_width(self) -> int:
        """Values the KV cache holds per token and layer: MLA's latent (kv_lora_rank + qk_rope_head_dim, shared by
        every head), else K and V of every KV head."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        """The attention's score scale: qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN
        with `mscale_all_dim` (DeepSeek-V3's `yarn_get_mscale`, as transformers applies it)."""
        scale: float = self.qk_head_dim**-0.5
        all_dim = self.rope_mscale_all_dim
        if self.rope_type == "yarn" and all_dim:
            mscale = yarn_mscale(self.rope_factor, all_dim)
            scale = scale * mscale * mscale
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's factor on cos / sin (transformers' `attention_factor`): yarn_mscale(factor, mscale) /
        yarn_mscale(factor, mscale_all_dim) when both are given (1 for DeepSeek-V3 and Kimi-K2), else
        yarn_mscale(factor); 1 for every other RoPE."""
        if self.rope_type != "yarn":
            return 1.0
        if self.rope_mscale and self.rope_mscale_all_dim:
            factor = self.rope_factor
            return yarn_mscale(factor, self.rope_mscale) / yarn_mscale(factor, self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_factor)

    @property
    def router(self) -> str:
        """The MoE router: "softmax" (Qwen3-MoE) or "sigmoid" (GLM-4.5 / DeepSeek-V3, grouped, biased choice)."""
        return "sigmoid" if self.model_type in GLM_ROUTER_TYPES else "softmax"

    @property
    def rotary_dim(self) -> int:
        """The leading head dimensions RoPE rotates (the rest pass through), as transformers computes it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def o_proj_bias(self) -> bool:
        """Qwen3, Llama and DeepSeek-V3 (MLA: q_a_proj, kv_a_proj_with_mqa, o_proj) put `attention_bias` on o_proj
        too, GLM-4.5 and Qwen2.5 on q / k / v only."""
        return self.attention_bias and self.model_type not in ("glm4_moe", "qwen2")

    @property
    def rope_scaling(self) -> dict[str, float] | None:
        """The scaling parameters, in transformers' `rope_parameters` names: Llama 3's (ops/rope.py,
        `llama3_inv_frequencies`) or YaRN's (`yarn_inv_frequencies`); None for the default RoPE."""
        if self.rope_type == "default":
            return None
        if self.rope_type == "yarn":
            mscales = {"mscale": self.rope_mscale, "mscale_all_dim": self.rope_mscale_all_dim}
            return {"factor": self.rope_factor,
                    "original_max_position_embeddings": self.rope_original_max_position_embeddings,
                    "beta_fast": self.rope_beta_fast, "beta_slow": self.rope_beta_slow,
                    **{k: v for k, v in mscales.items() if v}}  # fmt: skip
        return {"factor": self.rope_factor, "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_max_position_embeddings}  # fmt: skip

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`'s attention (None: full causal attention; MTP modules, whose
        index follows the trunk's, have none)."""
        if self.sliding_window is None or layer >= self.num_hidden_layers:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MLP (Qwen3-MoE's and GLM-4.5's rules; an MTP module's layer
        index follows the trunk's)."""
        if self.model_type in GLM_ROUTER_TYPES:
            return layer >= self.first_k_dense_replace
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config.json dict; raise ValueError naming any unsupported setting."""
        return cls(**values_from_hf(hf))

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that `transformers` loads as the same architecture."""
        return config_to_hf(self, dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 without scaling). DeepSeek-V3 multiplies cos /
    sin by `yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)` (1 for its own config) and the
    attention's softmax scale by `yarn_mscale(factor, mscale_all_dim) ** 2`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
