"""`ModelConfig`: the Qwen3 / Qwen2.5 / Llama 3.x dense and Qwen3-MoE / GLM-4.5 MoE architectures, read from and
written to a Hugging Face config.json.

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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
}  # fmt: skip
MOE_TYPES = ("qwen3_moe", "glm4_moe")
NO_QK_NORM_TYPES = ("qwen2", "llama")  # families without QK-norm (GLM-4.5's is its `use_qk_norm`)
SLIDING_WINDOW_TYPES = ("qwen2", "qwen3", "qwen3_moe")  # families with (optional) sliding-window attention
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = {"llama": ("default", "llama3")}  # RoPE scalings each family may use; every other family: default
# Architectures that are recognized but need a part Miles does not implement yet: model_type -> what is missing.
NOT_YET = {
    "deepseek_v3": "Multi-head Latent Attention (q_lora_rank, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, "
    "v_head_dim); its router (sigmoid, e_score_correction_bias, grouped top-k) is GLM-4.5's and is implemented",
}
_QWEN3_MOE_FIELDS = ("decoder_sparse_step", "mlp_only_layers")
_GLM4_MOE_FIELDS = (
    "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
    "partial_rotary_factor", "use_qk_norm",
)  # fmt: skip
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


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
    # glm4_moe only (GLM-4.5 / DeepSeek-V3 router, shared experts, dense first layers, attention details)
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    partial_rotary_factor: float = 1.0
    use_qk_norm: bool = True
    # RoPE scaling (Llama 3.x: rope_type "llama3" and its four parameters; "default": none)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
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
        if self.model_type == "glm4_moe":
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
    def router(self) -> str:
        """The MoE router: "softmax" (Qwen3-MoE) or "sigmoid" (GLM-4.5 / DeepSeek-V3, grouped, biased choice)."""
        return "sigmoid" if self.model_type == "glm4_moe" else "softmax"

    @property
    def rotary_dim(self) -> int:
        """The leading head dimensions RoPE rotates (the rest pass through), as transformers computes it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def o_proj_bias(self) -> bool:
        """Qwen3 and Llama put `attention_bias` on all four projections, GLM-4.5 and Qwen2.5 on q / k / v only."""
        return self.attention_bias and self.model_type not in ("glm4_moe", "qwen2")

    @property
    def rope_scaling(self) -> dict[str, float] | None:
        """The Llama 3 scaling parameters (ops/rope.py, `llama3_inv_frequencies`); None for the default RoPE."""
        if self.rope_type == "default":
            return None
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
        if self.model_type == "glm4_moe":
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
        if model_type in NOT_YET:
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r} needs {NOT_YET[model_type]}; Miles kernels "
                f"run {sorted(ARCHITECTURES.values())}"
            )
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
        if model_type == "glm4_moe" and hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"unsupported topk_method {hf.get('topk_method')!r}; GLM-4.5 routes with 'noaux_tc'")
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
        if rope_type == "llama3":
            values |= {
                "rope_type": "llama3", "rope_factor": float(rope["factor"]),
                "rope_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_high_freq_factor": float(rope["high_freq_factor"]),
                "rope_original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            }  # fmt: skip
        if model_type == "glm4_moe":
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
        }[self.model_type]
        for key, value in values.items():
            if key in _MOE_FIELDS + _QWEN3_MOE_FIELDS + _GLM4_MOE_FIELDS and key not in own:
                continue
            if key.startswith("rope_") and key != "rope_theta":
                continue  # in rope_parameters
            if key == "num_nextn_predict_layers" and not value and self.model_type != "glm4_moe":
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
        if self.model_type == "glm4_moe":
            hf["n_routed_experts"] = hf.pop("num_experts")
            hf["topk_method"] = "noaux_tc"
            hf["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        return hf


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
