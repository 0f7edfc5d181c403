"""`ModelConfig`: the Qwen3 / Qwen3-MoE architecture, read from and written to a Hugging Face config.json.

Unsupported options are errors that name the option, rather than silently different numerics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


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
    # MoE (qwen3_moe only)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
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
                "a qwen3_moe config needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0 "
                f"(got {self.num_experts_per_tok}, {self.num_experts}, {self.moe_intermediate_size})"
            )

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe"

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule for which decoder layers have a sparse MLP."""
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
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r}, architectures={architectures}; "
                f"Miles kernels run {sorted(ARCHITECTURES.values())}"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported RoPE scaling {rope_type!r}; only the default RoPE is implemented")
        if hf.get("use_sliding_window"):
            raise ValueError("unsupported: use_sliding_window=true (Qwen3 sliding-window attention)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r}; Qwen3 uses 'silu'")
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
        for key, value in values.items():
            if not self.is_moe and key in (
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers",
            ):  # fmt: skip
                continue
            if key == "num_nextn_predict_layers" and not value:
                continue  # a model without MTP modules keeps the plain Qwen3 config
            hf[key] = list(value) if isinstance(value, tuple) else value
        return hf
