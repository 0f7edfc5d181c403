"""Small random models for tests, examples and benchmarks (nothing is downloaded).

`tiny_config("dense" | "moe" | "glm", ...)` gives a small Qwen3 / Qwen3-MoE / GLM-4.5 MoE architecture;
`random_model` initializes one reproducibly from a seed (normal weights; norm weights near 1 so they matter);
`save_random_model` writes it as a Hugging Face directory, with a tokenizer if one is given;
`save_transformers_model` has `transformers` build, initialize and save the same architecture, as Hugging Face
tooling writes a checkpoint (no MTP tensors: transformers does not model the MTP modules config.json declares).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch

from miles_kernels.config import KernelConfig, LoraConfig
from miles_kernels.hf_io import save_model
from miles_kernels.lora import target_names
from miles_kernels.model import CausalLM
from miles_kernels.model_config import ModelConfig

# The fixed benchmark model of the kernel benchmarks: Qwen3, hidden 512, intermediate 1536, 8 layers, 8 heads / 4 KV
# heads (head dim 64), vocab 8192, untied embeddings. Shared by benchmarks/kernels.py and benchmarks/rollout.py.
BENCHMARK_MODEL: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "tie_word_embeddings": False,
}


def tiny_config(
    kind: Literal["dense", "moe", "glm", "qwen2", "llama", "deepseek"] = "dense", **overrides: Any
) -> ModelConfig:
    """A small Qwen3 (dense), Qwen3-MoE, GLM-4.5 MoE, Qwen2.5, Llama 3.x or DeepSeek-V3 config; keyword overrides use
    Miles' field names (HF's, with `n_routed_experts` as `num_experts`). The GLM config exercises every part of the
    family: grouped routing (2 groups, 1 kept), a shared expert, a dense first layer, partial rotary, q/k/v biases,
    QK-norm and a routed scaling factor. The Llama config uses Llama 3.1's RoPE scaling with a short original context
    (64 positions) so that its three frequency bands all occur at this head size. The DeepSeek config has MLA with a
    q-LoRA, value heads narrower than query / key heads, interleaved rotary pairs and YaRN (factor 4 over 32
    original positions, DeepSeek-V3's mscales: the softmax scale grows), with GLM's router layout."""
    values: dict[str, Any] = {
        "model_type": "qwen3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10_000.0,
        "tie_word_embeddings": True,
    }
    if kind == "moe":
        values |= {
            "model_type": "qwen3_moe",
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        }
    if kind == "glm":
        values |= {
            "model_type": "glm4_moe",
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": True,
        }
    if kind == "deepseek":
        values |= {
            "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": 4, "head_dim": 8,
            "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "rope_interleave": True, "rope_type": "yarn", "rope_factor": 4.0,
            "rope_original_max_position_embeddings": 32, "max_position_embeddings": 128, "rope_mscale": 1.0,
            "rope_mscale_all_dim": 1.0,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
            "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1,
            "first_k_dense_replace": 1, "use_qk_norm": False,
        }  # fmt: skip
    if kind == "qwen2":
        values |= {"model_type": "qwen2", "attention_bias": True, "use_qk_norm": False}
    if kind == "llama":
        values |= {
            "model_type": "llama", "use_qk_norm": False, "rope_theta": 500_000.0, "rms_norm_eps": 1e-5,
            "rope_type": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
            "rope_original_max_position_embeddings": 64,
        }  # fmt: skip
    values |= overrides
    if "mlp_only_layers" in values:
        values["mlp_only_layers"] = tuple(values["mlp_only_layers"])
    return ModelConfig(**values)


def random_model(
    config: ModelConfig, kernel: KernelConfig | None = None, seed: int = 0, std: float = 0.05
) -> CausalLM:
    """A `CausalLM` with reproducible random weights (same seed -> same bits on any machine's CPU). MTP modules
    draw theirs after the trunk's, so adding them leaves the trunk's bits as they were."""
    kernel = kernel or KernelConfig()
    model = CausalLM(config, kernel)
    generator = torch.Generator().manual_seed(seed)
    mtp_prefixes = tuple(
        f"model.layers.{config.num_hidden_layers + i}." for i in range(config.num_nextn_predict_layers)
    )
    named = sorted(model.named_parameters(), key=lambda item: item[0].startswith(mtp_prefixes))  # stable
    with torch.no_grad():
        for name, param in named:
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(std * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():  # GLM-4.5's router bias: nonzero, so it steers the choice
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return model.to(kernel.torch_dtype).eval()


def save_random_model(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    seed: int = 0,
    tokenizer: Any = None,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write a random model as a Hugging Face directory; returns the directory."""
    model = random_model(config, KernelConfig(dtype=dtype), seed)
    return save_model(model, model_dir, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)


def save_transformers_model(
    model_dir: str | os.PathLike[str], config: ModelConfig, seed: int = 0, tokenizer: Any = None
) -> Path:
    """Write `config`'s architecture as `transformers` writes it (`AutoModelForCausalLM.from_config`, its own
    initialization from `seed`, `save_pretrained`): what a model fine-tuned with Hugging Face tooling looks like.
    config.json keeps `num_nextn_predict_layers`, and no MTP tensor is written. GLM-4.5's router bias, which
    transformers initializes to zeros, gets small random values so that it steers the expert choice."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = config.to_hf()
    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.05)
    model.save_pretrained(model_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
    return Path(model_dir)


def random_adapter(model: CausalLM, config: LoraConfig, seed: int = 0, std: float = 0.1) -> dict[str, torch.Tensor]:
    """A LoRA adapter of `config` for `model` with random A and B (B nonzero, so it changes the output), under the
    model's tensor names (`...q_proj.lora_A`), as `miles_kernels.read_peft_adapter` returns them."""
    modules = dict(model.named_modules())
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in target_names(model, config):
        out_features, in_features = modules[name].weight.shape
        tensors[f"{name}.lora_A"] = std * torch.randn(config.rank, in_features, generator=generator)
        tensors[f"{name}.lora_B"] = std * torch.randn(out_features, config.rank, generator=generator)
    return tensors
