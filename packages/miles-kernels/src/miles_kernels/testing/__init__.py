"""Scaffolding for tests, examples and benchmarks: small random models, a small chat tokenizer, and the simplest
drivers of the model (nothing is downloaded). Not part of the engine or the trainer.

- `tiny_config` / `random_model` / `save_random_model`, `BENCHMARK_MODEL`: small models of every family (Qwen3,
  Qwen2.5, Llama 3.x, Qwen3-MoE, GLM-4.5); `save_transformers_model`: the same written by `transformers` (as Hugging
  Face tooling writes a checkpoint: no MTP tensors); `random_adapter`: a LoRA adapter with random A and B;
- `build_tokenizer`, `DEFAULT_CORPUS`: a byte-level BPE tokenizer with a family's chat template (`CHAT_FORMATS`:
  plain ChatML, Qwen2.5, Qwen3, Llama 3.1);
- `family_tokenizer`, `family_model`, `FAMILIES`: tokenizers built the way Qwen3's, Llama 3's and GLM-4.5's
  tokenizer.json are (split regex, specials after the vocabulary), and models padded past them;
- `PagedRunner`, `greedy_generate`: paged decode without a scheduler (the reference for engine tests);
  `packed_logits`: the trainer's packed path.
"""

from miles_kernels.testing.chat_templates import CHAT_FORMATS
from miles_kernels.testing.family_tokenizers import FAMILIES, family_model, family_tokenizer
from miles_kernels.testing.paged_runner import PagedRunner, greedy_generate, packed_logits
from miles_kernels.testing.random_model import (
    BENCHMARK_MODEL,
    random_adapter,
    random_model,
    save_random_model,
    save_transformers_model,
    tiny_config,
)
from miles_kernels.testing.tokenizer import DEFAULT_CORPUS, build_tokenizer

__all__ = [
    "BENCHMARK_MODEL",
    "CHAT_FORMATS",
    "DEFAULT_CORPUS",
    "FAMILIES",
    "PagedRunner",
    "build_tokenizer",
    "family_model",
    "family_tokenizer",
    "greedy_generate",
    "packed_logits",
    "random_adapter",
    "random_model",
    "save_random_model",
    "save_transformers_model",
    "tiny_config",
]
