"""miles-kernels: batch-invariant ops and the Qwen3 dense / MoE model shared by rollout engine and trainer.

- `KernelConfig`: dtype, mode (deterministic / fast) and tile sizes, with a fingerprint both sides report.
- `CausalLM` (+ `ModelConfig`, `KVStore`, `build_attention_batch`, `build_packed_batch`): the model, for paged
  KV decode / chunked prefill (engine) and packed sequences (trainer).
- Ops: `linear`, `attention`, `rms_norm`, RoPE, `sample` / `token_logprobs` (the log-prob contract),
  `select_experts` / `experts_forward` (MoE).
- Hugging Face I/O (`load_model`, `save_model`, `checkpoint_tensors`), small random models and tokenizers,
  the weight-bucket codec and the op backend registry.
"""

from miles_kernels.buckets import (
    BUCKET_FORMAT,
    Bucket,
    BucketAssembler,
    decode_bucket,
    encode_bucket,
    iter_buckets,
    plan_buckets,
    weights_checksum,
)
from miles_kernels.config import KernelConfig
from miles_kernels.hf_io import (
    MappedSafetensors,
    TensorSlot,
    checkpoint_tensors,
    in_shared_memory,
    iter_checkpoint,
    load_mapped,
    load_model,
    load_state,
    read_model_config,
    safetensors_layout,
    save_model,
)
from miles_kernels.model import CausalLM, KVStore
from miles_kernels.model_config import ModelConfig
from miles_kernels.ops.attention import (
    NULL_PAGE,
    AttentionBatch,
    attention,
    build_attention_batch,
    build_packed_batch,
)
from miles_kernels.ops.linear import linear, tiled_matmul
from miles_kernels.ops.moe import experts_forward, select_experts
from miles_kernels.ops.norm import rms_norm
from miles_kernels.ops.rope import apply_rope, inv_frequencies, rope_cos_sin
from miles_kernels.ops.sampling import (
    RowSampling,
    full_logprobs,
    logprob_temperatures,
    sample,
    token_logprobs,
    uniform,
)
from miles_kernels.paged_runner import PagedRunner, greedy_generate, packed_logits
from miles_kernels.random_model import BENCHMARK_MODEL, random_model, save_random_model, tiny_config
from miles_kernels.registry import Backend, available_backends, get_backend, register_backend, registered_ops
from miles_kernels.tokenizer import DEFAULT_CORPUS, build_tokenizer
from miles_kernels.weight_group import (
    WeightUpdateGroup,
    broadcast_tensors,
    dtype_name,
    init_weight_update_group,
    parse_dtype,
)

__version__ = "0.1.0"

__all__ = [
    "BENCHMARK_MODEL",
    "BUCKET_FORMAT",
    "DEFAULT_CORPUS",
    "NULL_PAGE",
    "AttentionBatch",
    "Backend",
    "Bucket",
    "BucketAssembler",
    "CausalLM",
    "KVStore",
    "KernelConfig",
    "MappedSafetensors",
    "ModelConfig",
    "PagedRunner",
    "RowSampling",
    "TensorSlot",
    "WeightUpdateGroup",
    "apply_rope",
    "attention",
    "available_backends",
    "broadcast_tensors",
    "build_attention_batch",
    "build_packed_batch",
    "build_tokenizer",
    "checkpoint_tensors",
    "decode_bucket",
    "dtype_name",
    "encode_bucket",
    "experts_forward",
    "full_logprobs",
    "get_backend",
    "greedy_generate",
    "in_shared_memory",
    "init_weight_update_group",
    "inv_frequencies",
    "iter_buckets",
    "iter_checkpoint",
    "linear",
    "load_mapped",
    "load_model",
    "load_state",
    "logprob_temperatures",
    "packed_logits",
    "parse_dtype",
    "plan_buckets",
    "random_model",
    "read_model_config",
    "register_backend",
    "registered_ops",
    "rms_norm",
    "rope_cos_sin",
    "safetensors_layout",
    "sample",
    "save_model",
    "save_random_model",
    "select_experts",
    "tiled_matmul",
    "tiny_config",
    "token_logprobs",
    "uniform",
    "weights_checksum",
]
