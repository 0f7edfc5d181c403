"""Numerical parity of Miles' model with Hugging Face `transformers`, per supported family, as JSON.

For each family (Qwen3 dense, Qwen2.5, Qwen2.5 with sliding-window attention on its second layer (a 16-key window),
Llama 3.x with Llama 3 RoPE scaling, Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V3 with and without its q-LoRA (MLA, YaRN,
grouped routing): `miles_kernels.testing.tiny_config`, tied and untied embeddings, random weights, biases and the
router bias nonzero) and each kernel mode: the largest |difference| of the logits and of the next-token log-probs
(`log_softmax`, float32) between Miles (packed sequences, the trainer's path; for DeepSeek-V3 also the engine's
paged prefill over its latent cache, `engine_*`) and `AutoModelForCausalLM` on the same directory, over random
sequences of several lengths (no exact router ties: transformers' `topk(sorted=False)` leaves their order
unspecified). The tests (packages/miles-kernels/tests/test_hf_parity.py, test_deepseek.py) assert 1e-4; this
records the measured margins. `kv_cache_bytes_per_token` is MLA's point: the bytes a `KVStore` allocates per token
(every layer, bf16) for DeepSeek-V3's and Kimi-K2's shapes, against the same width with grouped-query attention
(8 KV heads of 128) and with full multi-head K / V (one KV head per query head).

    uv run python benchmarks/hf_parity.py --out benchmarks/results/hf_parity.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from host import host_info
from transformers import AutoModelForCausalLM

from miles_kernels import KernelConfig, KVStore, ModelConfig, load_model
from miles_kernels.testing import PagedRunner, packed_logits, save_random_model, tiny_config

SLIDING = {"sliding_window": 16, "layer_types": ("full_attention", "sliding_attention")}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("dense", {}), "qwen2": ("qwen2", {}), "qwen2_sliding_window": ("qwen2", SLIDING),
    "llama": ("llama", {}), "qwen3_moe": ("moe", {}), "glm4_moe": ("glm", {}), "deepseek_v3": ("deepseek", {}),
    "deepseek_v3_no_q_lora": ("deepseek", {"q_lora_rank": None}),
}  # fmt: skip
# The released shapes, from their config.json (one layer's worth is enough: the bytes scale with the layer count).
MLA_MODELS = {
    "DeepSeek-V3": {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128},
    "Kimi-K2": {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 64, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128},
}  # fmt: skip
MODES = {"deterministic": KernelConfig(), "fast": KernelConfig(mode="fast")}


def measure(model_dir: Path, seqs: list[torch.Tensor]) -> dict[str, dict[str, float]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    out = {}
    for mode, kernel in MODES.items():
        model = load_model(model_dir, kernel)
        paths = {"": packed_logits(model, seqs)}
        if model.config.is_mla:
            with torch.no_grad():
                engine = PagedRunner(model, num_pages=64).step(dict(enumerate(seqs)))
            paths["engine_"] = [engine[i] for i in range(len(seqs))]
        out[mode] = {}
        for prefix, ours in paths.items():
            logits = max(float((a - b).abs().max()) for a, b in zip(ours, reference, strict=True))
            logprobs = max(float((a.log_softmax(-1) - b.log_softmax(-1)).abs().max())
                           for a, b in zip(ours, reference, strict=True))  # fmt: skip
            out[mode] |= {f"{prefix}max_abs_logit_diff": logits, f"{prefix}max_abs_logprob_diff": logprobs}
    return out


def kv_cache_bytes() -> dict[str, dict[str, int]]:
    """Bytes per token (every layer, bf16) of a `KVStore` allocated for each MLA model and for the same width with
    GQA (8 KV heads) and full multi-head K / V (as many KV heads as query heads, head dim 128)."""
    out = {}
    for name, shape in MLA_MODELS.items():
        base = {"num_hidden_layers": shape["num_hidden_layers"], "hidden_size": shape["hidden_size"],
                "num_attention_heads": shape["num_attention_heads"]}  # fmt: skip
        mla = ModelConfig(
            model_type="deepseek_v3", **shape, head_dim=shape["qk_rope_head_dim"], use_qk_norm=False,
            num_key_value_heads=shape["num_attention_heads"], num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=64,
        )  # fmt: skip
        heads = shape["num_attention_heads"]
        configs = {"mla": mla, "gqa_8_kv_heads": ModelConfig(**base, num_key_value_heads=8, head_dim=128),
                   "mha": ModelConfig(**base, num_key_value_heads=heads, head_dim=128)}  # fmt: skip
        sizes = {key: KVStore.allocate(c, 1, 1, torch.bfloat16, "cpu").bytes_per_token for key, c in configs.items()}
        ratios = {"gqa_over_mla": sizes["gqa_8_kv_heads"] / sizes["mla"], "mha_over_mla": sizes["mha"] / sizes["mla"]}
        out[name] = sizes | ratios
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/hf_parity.json")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family, (kind, overrides) in FAMILIES.items():
            for tied in (True, False):
                worst: dict[str, dict[str, float]] = {}
                for seed in range(args.seeds):
                    model_dir = Path(tmp) / f"{family}-{tied}-{seed}"
                    config = tiny_config(kind, tie_word_embeddings=tied, **overrides)
                    save_random_model(model_dir, config, seed=seed)
                    generator = torch.Generator().manual_seed(seed)
                    seqs = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (1, 7, 33, 100)]
                    for mode, values in measure(model_dir, seqs).items():
                        row = worst.setdefault(mode, dict.fromkeys(values, 0.0))
                        for key, value in values.items():
                            row[key] = max(row[key], value)
                results[f"{family}/{'tied' if tied else 'untied'}"] = worst
                print(family, tied, json.dumps(worst), flush=True)
    report = {"script_command": f"python benchmarks/hf_parity.py --seeds {args.seeds}", "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "host": host_info(),
              "dtype": "float32", "results": results, "kv_cache_bytes_per_token": kv_cache_bytes()}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
