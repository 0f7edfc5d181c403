"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .hardware import HARDWARE, HardwareProfile, load_hardware
from .memory_plan import Component, Lever, MemoryPlan
from .model_shape import MODELS, ModelShape, load_model_profile
from .plan_formulas import embedded_engine_bytes, fsdp2_bytes
from .planner import plan_memory, read_run

__all__ = [
    "HARDWARE",
    "MODELS",
    "Component",
    "HardwareProfile",
    "Lever",
    "MemoryPlan",
    "ModelShape",
    "embedded_engine_bytes",
    "fsdp2_bytes",
    "load_hardware",
    "load_model_profile",
    "plan_memory",
    "read_run",
]
