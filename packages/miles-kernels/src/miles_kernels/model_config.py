"""`ModelConfig`: the Qwen3 / Qwen2.5 / Llama 3.x dense and Qwen3-MoE / GLM-4.5 / DeepSeek-V3 (Kimi-K2) MoE
architectures, read from and written to a Hugging Face config.json.

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
from dataclasses import asdict, dataclass, field
from typing import Any

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}  # fmt: skip
# config.json model_types that load as another family: Kimi-K2 is DeepSeek-V3's architecture (its config says so)
ALIASES = {"kimi_k2": "deepseek_v3"}
MOE_TYPES = ("qwen3_moe", "glm4_moe", "deepseek_v3")
GLM_ROUTER_TYPES = ("glm4_moe", "deepseek_v3")  # sigmoid router, shared experts, dense first layers
NO_QK_NORM_TYPES = ("qwen2", "llama")  # families without QK-norm (GLM-4.5's is its `use_qk_norm`)
SLIDING_WINDOW_TYPES = ("qwen2", "qwen3", "qwen3_moe")  # families with (optional) sliding-window attention
LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE scalings each family may use; every other family: default
ROPE_TYPES = {"llama": ("default", "llama3"), "deepseek_v3": ("default", "yarn")}
_QWEN3_MOE_FIELDS = ("decoder_sparse_step", "mlp_only_layers")
_GLM4_MOE_FIELDS = (
    "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
    "partial_rotary_factor", "use_qk_norm",
)  # fmt: skip
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")


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
            family = [name for name in _GLM4_MOE_FIELDS if name != "use_qk_norm"]
            if any(getattr(self, name) != getattr(ModelConfig, name) for name in family):
                raise ValueError(f"{', '.join(family)} are glm4_moe settings; {self.model_type} has none of them")
            has_qk_norm = self.model_type not in NO_QK_NORM_TYPES
            if self.use_qk_norm != has_qk_norm:
                raise ValueError(
                    f"{self.model_type} {'has' if has_qk_norm else 'has no'} QK-norm: use_qk_norm={has_qk_norm}"
                )
        if self.is_mla:
            self._check_mla()
        elif any(getattr(self, name) != getattr(ModelConfig, name) for name in _MLA_FIELDS):
            raise ValueError(f"{', '.join(_MLA_FIELDS)} are deepseek_v3 (MLA) settings; {self.model_type} has none")
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
        model_type = hf.get("model_type")
        architectures = hf.get("architectures") or []
        model_type = ALIASES.get(str(model_type), model_type)
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r}, architectures={architectures}; "
                f"Miles kernels run {sorted(ARCHITECTURES.values())}"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES.get(model_type, ("default",)):
            raise ValueError(
                f"unsupported RoPE scaling {rope_type!r} for {model_type}; implemented: "
                f"{list(ROPE_TYPES.get(model_type, ('default',)))}"
            )
        if hf.get("use_sliding_window") and model_type not in SLIDING_WINDOW_TYPES:
            raise ValueError(
                f"unsupported: use_sliding_window=true; {model_type} has no sliding-window attention (families "
                f"with one: {list(SLIDING_WINDOW_TYPES)})"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r}; every supported family uses 'silu'")
        if hf.get("mlp_bias"):
            raise ValueError("unsupported: mlp_bias=true (biases on the MLP projections)")
        if model_type in GLM_ROUTER_TYPES and hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(
                f"unsupported topk_method {hf.get('topk_method')!r}; GLM-4.5 and DeepSeek-V3 route with 'noaux_tc'"
            )
        if model_type == "deepseek_v3":
            _check_deepseek_hf(hf, rope)
        theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
        num_heads = hf["num_attention_heads"]
        values: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf.get("intermediate_size", 0),
            "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": num_heads,
            "num_key_value_heads": hf.get("num_key_value_heads") or num_heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads,
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": float(theta),
            "max_position_embeddings": hf.get("max_position_embeddings", 32768),
            "tie_word_embeddings": hf.get("tie_word_embeddings", False),
            "attention_bias": hf.get("attention_bias", False),
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": hf.get("eos_token_id"),
            "pad_token_id": hf.get("pad_token_id"),
            "num_nextn_predict_layers": hf.get("num_nextn_predict_layers") or 0,
        }
        if model_type in NO_QK_NORM_TYPES:
            values["use_qk_norm"] = False
        if model_type == "qwen2":
            values["attention_bias"] = True  # Qwen2Attention: q / k / v always biased, o_proj never
        values |= _sliding_window_from_hf(hf, model_type)
        if rope_type == "yarn":
            values |= {
                "rope_type": "yarn", "rope_factor": float(rope["factor"]),
                "rope_original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
                "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
                "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
                "rope_mscale": float(rope.get("mscale") or 0.0),
                "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
            }  # fmt: skip
        if rope_type == "llama3":
            values |= {
                "rope_type": "llama3", "rope_factor": float(rope["factor"]),
                "rope_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_high_freq_factor": float(rope["high_freq_factor"]),
                "rope_original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            }  # fmt: skip
        if model_type == "deepseek_v3":
            values |= {
                "q_lora_rank": hf.get("q_lora_rank"), "kv_lora_rank": hf["kv_lora_rank"],
                "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
                "v_head_dim": hf["v_head_dim"], "head_dim": hf["qk_rope_head_dim"],
                "num_key_value_heads": num_heads, "rope_interleave": hf.get("rope_interleave", True),
            }  # fmt: skip
        if model_type in GLM_ROUTER_TYPES:
            values |= {
                "num_experts": hf.get("n_routed_experts", 0),
                "num_experts_per_tok": hf["num_experts_per_tok"],
                "moe_intermediate_size": hf["moe_intermediate_size"],
                "norm_topk_prob": hf.get("norm_topk_prob", True),
                "n_shared_experts": hf.get("n_shared_experts") or 0,
                "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                "n_group": hf.get("n_group") or 1,
                "topk_group": hf.get("topk_group") or 1,
                "first_k_dense_replace": hf.get("first_k_dense_replace", 0),
                "partial_rotary_factor": float(
                    rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
                ),
                "use_qk_norm": hf.get("use_qk_norm", False),
            }
            if model_type == "deepseek_v3":
                values["partial_rotary_factor"] = 1.0
        if model_type == "qwen3_moe":
            values |= {
                "num_experts": hf.get("num_experts", hf.get("num_local_experts", 0)),
                "num_experts_per_tok": hf["num_experts_per_tok"],
                "moe_intermediate_size": hf["moe_intermediate_size"],
                "norm_topk_prob": hf.get("norm_topk_prob", False),
                "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
                "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
            }
        return cls(**values)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that `transformers` loads as the same architecture."""
        values = asdict(self)
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "hidden_act": "silu",
            "dtype": dtype,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta,
            "use_cache": True,
        }
        own = {
            "qwen3": (),
            "qwen2": (),
            "llama": (),
            "qwen3_moe": _MOE_FIELDS + _QWEN3_MOE_FIELDS,
            "glm4_moe": _MOE_FIELDS + _GLM4_MOE_FIELDS,
            "deepseek_v3": _MOE_FIELDS + _GLM4_MOE_FIELDS[:5] + _MLA_FIELDS,
        }[self.model_type]
        for key, value in values.items():
            if key in _MOE_FIELDS + _QWEN3_MOE_FIELDS + _GLM4_MOE_FIELDS + _MLA_FIELDS and key not in own:
                continue
            if key.startswith("rope_") and key not in ("rope_theta", "rope_interleave"):
                continue  # in rope_parameters
            if key == "num_nextn_predict_layers" and not value and self.model_type not in GLM_ROUTER_TYPES:
                continue  # a model without MTP modules keeps the plain Qwen3 config
            if key in ("sliding_window", "layer_types"):
                continue  # below
            hf[key] = list(value) if isinstance(value, tuple) else value
        if self.rope_scaling is not None:
            hf["rope_parameters"] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta, **self.rope_scaling}
        if self.model_type == "llama":
            hf |= {"mlp_bias": False, "pretraining_tp": 1}
        if self.model_type == "qwen2":
            hf.pop("attention_bias")  # not a Qwen2Config field: q / k / v are always biased
        if self.sliding_window is not None:
            hf |= {"use_sliding_window": True, "sliding_window": self.sliding_window}
            if self.model_type != "qwen3_moe":  # Qwen3-MoE windows every layer; the others follow layer_types
                windowed = [i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention"]
                first = windowed[0] if windowed else self.num_hidden_layers
                suffix = windowed == list(range(first, self.num_hidden_layers))
                hf["max_window_layers"] = first if suffix else self.num_hidden_layers
                hf["layer_types"] = list(self.layer_types)
        elif self.model_type == "qwen2":
            hf["max_window_layers"] = self.num_hidden_layers
        if self.model_type in GLM_ROUTER_TYPES:
            hf["n_routed_experts"] = hf.pop("num_experts")
            hf["topk_method"] = "noaux_tc"
        if self.model_type == "glm4_moe":
            hf["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        if self.model_type == "deepseek_v3":
            hf |= {"scoring_func": "sigmoid", "moe_layer_freq": 1}
            hf.pop("head_dim")  # transformers derives it (qk_rope_head_dim)
        return hf


def _check_deepseek_hf(hf: dict[str, Any], rope: dict[str, Any]) -> None:
    """The DeepSeek-V3 settings Miles does not implement, by name (the released checkpoints use none of them)."""
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"unsupported scoring_func {hf.get('scoring_func')!r}; DeepSeek-V3 routes with 'sigmoid'")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"unsupported moe_layer_freq={hf.get('moe_layer_freq')}; every layer from "
                         "first_k_dense_replace on is sparse (1)")  # fmt: skip
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise ValueError("unsupported YaRN attention_factor / truncate=false; Miles derives the factor from mscale "
                         "and mscale_all_dim and truncates the ramp, as DeepSeek-V3 and Kimi-K2 do")  # fmt: skip


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 without scaling). DeepSeek-V3 multiplies cos /
    sin by `yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)` (1 for its own config) and the
    attention's softmax scale by `yarn_mscale(factor, mscale_all_dim) ** 2`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _sliding_window_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """`sliding_window` and `layer_types` as transformers resolves them (a window only under use_sliding_window)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
        return {}
    num_layers = hf["num_hidden_layers"]
    if model_type == "qwen3_moe":
        return {"sliding_window": window, "layer_types": ("sliding_attention",) * num_layers}
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(num_layers)
    ]
    return {"sliding_window": window, "layer_types": tuple(layer_types)}
