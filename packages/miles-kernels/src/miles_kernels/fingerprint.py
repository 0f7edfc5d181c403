"""What a `KernelConfig` runs on this machine, and its fingerprint: the op backends its `auto` settings resolve to
(`resolved_backends`), and a short hash of the config, those backends, the torch version and the kind of device
(`kernel_fingerprint`). Engine and trainer each report `describe_kernel(...)`; the orchestrator refuses true
on-policy when the fingerprints differ (docs/true-on-policy.md). Resolving a backend imports the op modules, which
register them: that is why this lives here and not in the torch-free config.py, which the ops themselves import.
"""

from __future__ import annotations

import hashlib
import json

import torch

import miles_kernels.ops.attention
import miles_kernels.ops.linear
import miles_kernels.ops.norm  # noqa: F401  (registers the backends)
from miles_kernels.config import KernelConfig, WeightQuantConfig
from miles_kernels.native import build as native_build
from miles_kernels.registry import get_backend


def resolved_backends(kernel: KernelConfig) -> dict[str, str]:
    """The backend each op runs here (`auto` resolved on this machine)."""
    ops = (
        ("attention", kernel.attention_backend),
        ("linear", kernel.linear_backend),
        ("rms_norm", kernel.norm_backend),
    )
    return {op: get_backend(f"{op}:{kernel.mode}", name).name for op, name in ops}


def _identity(kernel: KernelConfig, device_type: str, weights: WeightQuantConfig | None) -> dict[str, object]:
    backends = resolved_backends(kernel)
    identity: dict[str, object] = {**kernel.model_dump(), **backends, "torch": torch.__version__}
    if "native" in backends.values() and device_type == "cpu":  # the sources fix its arithmetic, not the ISA
        identity["native_sources"] = native_build.source_hash()
    if device_type != "cpu":  # CPU fingerprints predate devices: they keep their value (caches, checkpoints)
        identity["device_type"] = device_type
    if weights is not None and weights.is_enabled:  # likewise: kernel-dtype weights add nothing
        identity["weights"] = weights.model_dump(mode="json")
    return identity


def kernel_fingerprint(
    kernel: KernelConfig, device_type: str = "cpu", weights: WeightQuantConfig | None = None
) -> str:
    """Short hash of every field, the resolved backends, the torch version, the kind of device the ops run on
    (`torch.device(...).type`: the same config runs other code, so other bits, on CUDA than on the CPU) and the
    low-precision format the linear layers compute with (`weights`: the engine's stored one, a QAT trainer's fake
    one): equal fingerprints run the same bits."""
    payload = json.dumps(_identity(kernel, device_type, weights), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def describe_kernel(
    kernel: KernelConfig, device_type: str = "cpu", weights: WeightQuantConfig | None = None
) -> dict[str, object]:
    """Fields, resolved backends, torch version, device type, weight format and fingerprint, as the engine and
    trainer report them."""
    identity = _identity(kernel, device_type, weights)
    fingerprint = kernel_fingerprint(kernel, device_type, weights)
    return {**identity, "device_type": device_type, "fingerprint": fingerprint}
