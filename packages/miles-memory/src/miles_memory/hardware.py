"""Hardware profiles of the memory planner: GPU memory per device, GPUs and host memory per node, interconnect, and
each GPU's dense BF16 peak FLOP/s (for MFU, flops.py).

The GPU profiles are data (`profiles/hardware.yaml`, each number with its source and its unit); `cpu` is this
machine, read at call time: one "device" whose memory is the host's RAM, shared by every trainer rank and the engine.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HARDWARE", "HardwareProfile", "load_hardware"]


class HardwareProfile(BaseModel):
    """One kind of node: its GPUs' memory and count, host memory and links (bytes, bytes/s)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(description="Profile name (h100, h200, b200, gb300, cpu).")
    name: str = Field(description="What the profile is.")
    capacity_bytes: int = Field(description="Memory of one device that its allocator can hold.")
    capacity_source: str = Field(description="Where capacity_bytes comes from.")
    gpus_per_node: int = Field(description="Devices per node (cpu: 1, the host).")
    host_bytes_per_node: int = Field(description="Host (CPU) memory per node.")
    host_source: str = Field(description="Where host_bytes_per_node comes from.")
    nvlink_bytes_per_s: int = Field(default=0, description="GPU-to-GPU bandwidth inside a node, per GPU.")
    network_bytes_per_s: int = Field(default=0, description="Network bandwidth between nodes, per GPU.")
    interconnect_source: str = Field(default="", description="Where the bandwidths come from.")
    nvlink_domain: int = Field(default=1, description="GPUs one NVLink domain joins.")
    nccl_channels: int = Field(default=0, description="NCCL channels assumed per communicator (0: gloo, no NCCL).")
    bf16_flops_per_s: int | None = Field(
        default=None,
        description="Peak dense BF16 tensor-core FLOP/s of one device (no 2:4 sparsity); None: unknown (cpu), no MFU.",
    )
    flops_source: str = Field(default="", description="Where bf16_flops_per_s comes from.")

    @property
    def is_cpu(self) -> bool:
        return self.key == "cpu"


@functools.cache
def _gpu_profiles() -> dict[str, dict[str, Any]]:
    text = resources.files("miles_memory").joinpath("profiles/hardware.yaml").read_text()
    data: dict[str, dict[str, Any]] = yaml.safe_load(text)
    return data


def _cpu_profile() -> HardwareProfile:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareProfile(
        key="cpu",
        name=f"this machine's CPU ({os.cpu_count()} cores): trainer ranks and engine share its RAM",
        capacity_bytes=total,
        capacity_source="os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')",
        gpus_per_node=1,
        host_bytes_per_node=total,
        host_source="the same RAM",
        flops_source="unknown for a CPU (bf16_flops_per_s None): no MFU is reported",
    )


HARDWARE: tuple[str, ...] = ("h100", "h200", "b200", "gb300", "cpu")


def load_hardware(name: str) -> HardwareProfile:
    """The profile called `name` (case-insensitive); ValueError listing the known ones otherwise."""
    key = name.lower()
    if key == "cpu":
        return _cpu_profile()
    profiles = _gpu_profiles()
    if key not in profiles:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
    return HardwareProfile(key=key, **profiles[key])
