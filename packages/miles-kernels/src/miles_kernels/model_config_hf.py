"""The model families Miles runs and their Hugging Face config.json form: the tables of families (architectures,
routers, RoPE scalings, sliding windows, each family's own fields), and `ModelConfig` to and from a config.json dict
(`ModelConfig.from_hf` / `to_hf` call these): which keys each family reads and writes, transformers' defaults, and an
error naming every setting Miles does not implement. What the settings mean is model_config.py's."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_kernels.model_config import ModelConfig

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
# Each family's own ModelConfig fields (to_hf writes a family's only)
QWEN3_MOE_FIELDS = ("decoder_sparse_step", "mlp_only_layers")
GLM4_MOE_FIELDS = (
    "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
    "partial_rotary_factor", "use_qk_norm",
)  # fmt: skip
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")


def values_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig`'s fields from a Hugging Face config.json dict; ValueError naming any unsupported setting."""
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
            "partial_rotary_factor": float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
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
    return values


def config_to_hf(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A config.json dict that `transformers` loads as `config`'s architecture."""
    values = asdict(config)
    hf: dict[str, Any] = {
        "architectures": [config.architecture],
        "hidden_act": "silu",
        "dtype": dtype,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "use_cache": True,
    }
    own = {
        "qwen3": (),
        "qwen2": (),
        "llama": (),
        "qwen3_moe": MOE_FIELDS + QWEN3_MOE_FIELDS,
        "glm4_moe": MOE_FIELDS + GLM4_MOE_FIELDS,
        "deepseek_v3": MOE_FIELDS + GLM4_MOE_FIELDS[:5] + MLA_FIELDS,
    }[config.model_type]
    for key, value in values.items():
        if key in MOE_FIELDS + QWEN3_MOE_FIELDS + GLM4_MOE_FIELDS + MLA_FIELDS and key not in own:
            continue
        if key.startswith("rope_") and key not in ("rope_theta", "rope_interleave"):
            continue  # in rope_parameters
        if key == "num_nextn_predict_layers" and not value and config.model_type not in GLM_ROUTER_TYPES:
            continue  # a model without MTP modules keeps the plain Qwen3 config
        if key in ("sliding_window", "layer_types"):
            continue  # below
        hf[key] = list(value) if isinstance(value, tuple) else value
    if config.rope_scaling is not None:
        hf["rope_parameters"] = {"rope_type": config.rope_type, "rope_theta": config.rope_theta, **config.rope_scaling}
    if config.model_type == "llama":
        hf |= {"mlp_bias": False, "pretraining_tp": 1}
    if config.model_type == "qwen2":
        hf.pop("attention_bias")  # not a Qwen2Config field: q / k / v are always biased
    if config.sliding_window is not None:
        hf |= {"use_sliding_window": True, "sliding_window": config.sliding_window}
        if config.model_type != "qwen3_moe":  # Qwen3-MoE windows every layer; the others follow layer_types
            windowed = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
            first = windowed[0] if windowed else config.num_hidden_layers
            suffix = windowed == list(range(first, config.num_hidden_layers))
            hf["max_window_layers"] = first if suffix else config.num_hidden_layers
            hf["layer_types"] = list(config.layer_types)
    elif config.model_type == "qwen2":
        hf["max_window_layers"] = config.num_hidden_layers
    if config.model_type in GLM_ROUTER_TYPES:
        hf["n_routed_experts"] = hf.pop("num_experts")
        hf["topk_method"] = "noaux_tc"
    if config.model_type == "glm4_moe":
        hf["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
    if config.model_type == "deepseek_v3":
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
