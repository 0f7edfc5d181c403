"""miles-kernels: batch-invariant ops and the Qwen3 dense / MoE model shared by rollout engine and trainer.

- `KernelConfig`: dtype, mode (deterministic / fast) and tile sizes, with a fingerprint both sides report.
- `CausalLM` (+ `ModelConfig`, `KVStore`, `build_attention_batch`, `build_packed_batch`): the model, for paged
  KV decode / chunked prefill (engine) and packed sequences (trainer).
- Ops: `linear`, `attention`, `rms_norm`, RoPE, `sample` / `token_logprobs` (the log-prob contract),
  `select_experts` / `experts_forward` (MoE).
- Hugging Face I/O (`load_model`, `save_model`, `checkpoint_tensors`), the weight-sync formats (`weight_sync/`:
  buckets, the /dev/shm file, the torch.distributed group, the checksum) and the op backend registry.

Small random models, the test tokenizer and the simplest model drivers are scaffolding, in `miles_kernels.testing`.

Attributes load on first use (`lazy_loader`, from the imports listed in `__init__.pyi`): importing the package,
or its torch-free `miles_kernels.config`, does not import torch (docs/architecture.md, "Config").
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

__version__ = "0.1.0"
