"""Numerical parity of Miles' model with Hugging Face `transformers`, per supported family, as JSON.

For each family (Qwen3 dense, Qwen2.5, Qwen2.5 with sliding-window attention on its second layer (a 16-key window),
Llama 3.x with Llama 3 RoPE scaling, Qwen3-MoE, GLM-4.5 MoE: `miles_kernels.testing.tiny_config`, tied and untied
embeddings, random weights, biases and GLM's router bias nonzero) and each kernel mode: the largest |difference| of the
logits and of the next-token log-probs (`log_softmax`, float32) between Miles (packed sequences, the trainer's
path) and `AutoModelForCausalLM` on the same directory, over random sequences of several lengths (no exact router
ties: transformers' `topk(sorted=False)` leaves their order unspecified). The tests (packages/miles-kernels/tests/
test_hf_parity.py) assert 1e-4; this records the measured margins.

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

from miles_kernels import KernelConfig, load_model
from miles_kernels.testing import packed_logits, save_random_model, tiny_config

SLIDING = {"sliding_window": 16, "layer_types": ("full_attention", "sliding_attention")}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("dense", {}), "qwen2": ("qwen2", {}), "qwen2_sliding_window": ("qwen2", SLIDING),
    "llama": ("llama", {}), "qwen3_moe": ("moe", {}), "glm4_moe": ("glm", {}),
}  # fmt: skip
MODES = {"deterministic": KernelConfig(), "fast": KernelConfig(mode="fast")}


def measure(model_dir: Path, seqs: list[torch.Tensor]) -> dict[str, dict[str, float]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    out = {}
    for mode, kernel in MODES.items():
        ours = packed_logits(load_model(model_dir, kernel), seqs)
        logits = max(float((a - b).abs().max()) for a, b in zip(ours, reference, strict=True))
        logprobs = max(float((a.log_softmax(-1) - b.log_softmax(-1)).abs().max())
                       for a, b in zip(ours, reference, strict=True))  # fmt: skip
        out[mode] = {"max_abs_logit_diff": logits, "max_abs_logprob_diff": logprobs}
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
              "dtype": "float32", "results": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
