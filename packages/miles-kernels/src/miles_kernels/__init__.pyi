"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .buckets import (
    BUCKET_FORMAT,
    Bucket,
    BucketAssembler,
    decode_bucket,
    encode_bucket,
    iter_buckets,
    plan_buckets,
    weights_checksum,
)
from .config import KernelConfig
from .hf_io import (
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
from .model import CausalLM, KVStore
from .model_config import ModelConfig
from .ops.attention import (
    NULL_PAGE,
    AttentionBatch,
    attention,
    build_attention_batch,
    build_packed_batch,
)
from .ops.linear import linear, tiled_matmul
from .ops.moe import experts_forward, select_experts
from .ops.norm import rms_norm
from .ops.rope import apply_rope, inv_frequencies, rope_cos_sin
from .ops.sampling import (
    RowSampling,
    full_logprobs,
    logprob_temperatures,
    sample,
    token_logprobs,
    uniform,
)
from .paged_runner import PagedRunner, greedy_generate, packed_logits
from .random_model import BENCHMARK_MODEL, random_model, save_random_model, tiny_config
from .registry import Backend, available_backends, get_backend, register_backend, registered_ops
from .tokenizer import DEFAULT_CORPUS, build_tokenizer
from .weight_group import (
    WeightUpdateGroup,
    broadcast_tensors,
    dtype_name,
    init_weight_update_group,
    parse_dtype,
)

__version__: str

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
