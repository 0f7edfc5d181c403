"""`KernelConfig`: everything that decides the bits of a forward pass, shared by rollout engine and trainer.

True on-policy needs the engine and the trainer to run the same ops with the same tile sizes and dtype. Both
take one `KernelConfig`; each reports `fingerprint()`, and the orchestrator refuses true on-policy when the
two differ. The fingerprint includes the torch version, because a different torch can change the bits.
This module is torch-free (torch is imported only by the methods that need it), so a run config that nests a
`KernelConfig` validates without importing torch (docs/architecture.md, "Config").
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch


class KernelConfig(BaseModel):
    """Dtype, mode and every tile/page/split size of the model's ops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Parameter and activation dtype (attention softmax and log-probs are fp32)."
    )
    mode: Literal["deterministic", "fast"] = Field(
        default="deterministic",
        description="deterministic: batch-invariant ops (true on-policy); fast: plain torch ops (mismatch measured).",
    )
    linear_tile: int = Field(
        default=16, ge=1, le=1024, description="Rows per fixed-shape matmul tile in deterministic linear layers."
    )
    attention_query_tile: int = Field(
        default=4, ge=1, le=1024, description="Query rows per fixed-shape attention tile (per KV head group)."
    )
    page_size: int = Field(
        default=16, ge=1, le=4096, description="Tokens per KV-cache page; also the attention key block size."
    )
    moe_tile: int = Field(default=16, ge=1, le=1024, description="Rows per fixed-shape matmul tile in MoE experts.")
    attention_backend: str = Field(
        default="auto", description="Attention backend for this mode (see miles_kernels.registry); auto: best usable."
    )
    linear_backend: str = Field(
        default="auto", description="Linear backend for this mode (see miles_kernels.registry); auto: best usable."
    )
    norm_backend: str = Field(
        default="auto", description="RMSNorm backend for this mode (see miles_kernels.registry); auto: best usable."
    )

    @model_validator(mode="after")
    def _powers_of_two(self) -> KernelConfig:
        for name in ("linear_tile", "attention_query_tile", "page_size", "moe_tile"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two (e.g. {1 << (value.bit_length() - 1)})")
        return self

    @property
    def is_deterministic(self) -> bool:
        """True in batch-invariant mode."""
        return self.mode == "deterministic"

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def resolved_backends(self) -> dict[str, str]:
        """The backend each op runs here (`auto` resolved on this machine)."""
        import miles_kernels.ops.attention
        import miles_kernels.ops.linear
        import miles_kernels.ops.norm  # noqa: F401  (registers the backends)
        from miles_kernels.registry import get_backend

        ops = (("attention", self.attention_backend), ("linear", self.linear_backend), ("rms_norm", self.norm_backend))
        return {op: get_backend(f"{op}:{self.mode}", name).name for op, name in ops}

    def _identity(self, device_type: str = "cpu") -> dict[str, object]:
        import torch

        identity: dict[str, object] = {**self.model_dump(), **self.resolved_backends(), "torch": torch.__version__}
        if device_type != "cpu":  # CPU fingerprints predate devices: they keep their value (caches, checkpoints)
            identity["device_type"] = device_type
        return identity

    def fingerprint(self, device_type: str = "cpu") -> str:
        """Short hash of every field, the resolved backends, the torch version and the kind of device the ops run
        on (`torch.device(...).type`: the same config runs other code, so other bits, on CUDA than on the CPU):
        equal fingerprints run the same bits."""
        payload = json.dumps(self._identity(device_type), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def describe(self, device_type: str = "cpu") -> dict[str, object]:
        """Fields, resolved backends, torch version, device type and fingerprint, as the engine and trainer report
        them."""
        identity = self._identity(device_type)
        return {**identity, "device_type": device_type, "fingerprint": self.fingerprint(device_type)}
