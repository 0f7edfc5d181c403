"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .config import KernelConfig
from .fingerprint import describe_kernel, kernel_fingerprint, resolved_backends
from .hf_io import (
    checkpoint_tensors,
    iter_checkpoint,
    load_model,
    load_state,
    num_absent_mtp_layers,
    read_model_config,
    save_model,
    tensor_files,
)
from .kv_cache import KVStore
from .lora import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    adapted_layers,
    adapter_tensors,
    add_lora,
    disabled_adapters,
    fold_adapters,
    folded_weights,
    initial_adapter,
    is_adapter_name,
    read_peft_adapter,
    save_peft_adapter,
    target_names,
)
from .lora_serving import AdapterSlots
from .model import CausalLM, MTPLayer, rotary_cos_sin
from .model_config import ModelConfig
from .ops.activation import swiglu
from .ops.attention import attention, packed_attention
from .ops.attention_batch import NULL_PAGE, AttentionBatch, build_attention_batch, build_packed_batch
from .ops.linear import linear, merge_lora, tiled_matmul
from .ops.moe import (
    Routing,
    combine_ranks,
    expert_mlp,
    experts_forward,
    route_grouped_sigmoid,
    route_softmax,
    select_experts,
)
from .ops.norm import rms_norm
from .ops.rope import apply_rope, inv_frequencies, rope_cos_sin
from .ops.sampling import (
    RowSampling,
    full_logprobs,
    logprob_temperatures,
    sample,
    token_logprobs,
    uniform,
    uniforms,
)
from .registry import Backend, available_backends, get_backend, register_backend, registered_ops
from .weight_sync.buckets import (
    BUCKET_FORMAT,
    Bucket,
    BucketAssembler,
    decode_bucket,
    encode_bucket,
    iter_buckets,
    plan_buckets,
)
from .weight_sync.checksum import weights_checksum
from .weight_sync.distributed import (
    WeightUpdateGroup,
    broadcast_tensors,
    destroy_weight_update_group,
    dtype_name,
    init_weight_update_group,
    parse_dtype,
    rendezvous_store,
)
from .weight_sync.mapped_file import (
    MappedSafetensors,
    TensorSlot,
    in_shared_memory,
    load_mapped,
    safetensors_layout,
)

__version__: str

__all__ = [
    "BUCKET_FORMAT",
    "NULL_PAGE",
    "PEFT_CONFIG",
    "PEFT_WEIGHTS",
    "AdapterSlots",
    "AttentionBatch",
    "Backend",
    "Bucket",
    "BucketAssembler",
    "CausalLM",
    "KVStore",
    "KernelConfig",
    "MTPLayer",
    "MappedSafetensors",
    "ModelConfig",
    "Routing",
    "RowSampling",
    "TensorSlot",
    "WeightUpdateGroup",
    "adapted_layers",
    "adapter_tensors",
    "add_lora",
    "apply_rope",
    "attention",
    "available_backends",
    "broadcast_tensors",
    "build_attention_batch",
    "build_packed_batch",
    "checkpoint_tensors",
    "combine_ranks",
    "decode_bucket",
    "describe_kernel",
    "destroy_weight_update_group",
    "disabled_adapters",
    "dtype_name",
    "encode_bucket",
    "expert_mlp",
    "experts_forward",
    "fold_adapters",
    "folded_weights",
    "full_logprobs",
    "get_backend",
    "in_shared_memory",
    "init_weight_update_group",
    "initial_adapter",
    "inv_frequencies",
    "is_adapter_name",
    "iter_buckets",
    "iter_checkpoint",
    "kernel_fingerprint",
    "linear",
    "load_mapped",
    "load_model",
    "load_state",
    "logprob_temperatures",
    "merge_lora",
    "num_absent_mtp_layers",
    "packed_attention",
    "parse_dtype",
    "plan_buckets",
    "read_model_config",
    "read_peft_adapter",
    "register_backend",
    "registered_ops",
    "rendezvous_store",
    "resolved_backends",
    "rms_norm",
    "rope_cos_sin",
    "rotary_cos_sin",
    "route_grouped_sigmoid",
    "route_softmax",
    "safetensors_layout",
    "sample",
    "save_model",
    "save_peft_adapter",
    "select_experts",
    "swiglu",
    "target_names",
    "tensor_files",
    "tiled_matmul",
    "token_logprobs",
    "uniform",
    "uniforms",
    "weights_checksum",
]
