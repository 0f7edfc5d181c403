"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .budget import ActivationMeter, MemoryBudget, OOMReport, format_bytes, out_of_memory
from .census import PeakMeter, live_tensor_bytes
from .flops import ModelFlops, mfu, model_flops
from .hardware import HARDWARE, HardwareProfile, load_hardware
from .low_precision import WeightQuantSettings, qat_layer_bytes
from .memory_plan import Component, Lever, MemoryPlan
from .model_shape import MODELS, LoraSettings, ModelShape, load_model_profile
from .offload import OffloadManager, OffloadPlan, storage_bytes, unique_storages
from .plan_formulas import (
    NATIVE_PANEL_WIDTH,
    blocked_attention_elements,
    embedded_engine_bytes,
    engine_weight_bytes,
    fsdp2_bytes,
    lora_layer_bytes,
    native_attention_elements,
    native_packed_bytes,
    weight_sync_bytes,
)
from .planner import plan_memory
from .run_inputs import RUN_KEYS, read_run
from .stores import CHUNK_BYTES, FileStore, HostStore, OffloadStore, default_store

__all__ = [
    "CHUNK_BYTES",
    "HARDWARE",
    "MODELS",
    "NATIVE_PANEL_WIDTH",
    "RUN_KEYS",
    "ActivationMeter",
    "Component",
    "FileStore",
    "HardwareProfile",
    "HostStore",
    "Lever",
    "LoraSettings",
    "MemoryBudget",
    "MemoryPlan",
    "ModelFlops",
    "ModelShape",
    "OOMReport",
    "OffloadManager",
    "OffloadPlan",
    "OffloadStore",
    "PeakMeter",
    "WeightQuantSettings",
    "blocked_attention_elements",
    "default_store",
    "embedded_engine_bytes",
    "engine_weight_bytes",
    "format_bytes",
    "fsdp2_bytes",
    "live_tensor_bytes",
    "load_hardware",
    "load_model_profile",
    "lora_layer_bytes",
    "mfu",
    "model_flops",
    "native_attention_elements",
    "native_packed_bytes",
    "out_of_memory",
    "plan_memory",
    "qat_layer_bytes",
    "read_run",
    "storage_bytes",
    "unique_storages",
    "weight_sync_bytes",
]
