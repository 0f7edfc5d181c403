"""A standalone `torch.distributed` group for weight sync between a trainer (rank 0) and rollout engines.

The trainer and each engine join a group of their own, outside any default process group, rendezvousing on a
TCPStore at (master_address, master_port). Rank 0 broadcasts tensors under their Hugging Face names; engines
receive into fresh buffers. gloo on CPU, NCCL on GPU. Used by miles-rollout's `/init_weights_update_group` /
`/update_weights_from_distributed` and by the trainer's sender, so both sides share one implementation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype (`torch.float32` -> "float32")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """A dtype from its wire name; ValueError naming the allowed ones."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[key]


@dataclass(frozen=True)
class WeightUpdateGroup:
    """A process group and the TCPStore it rendezvoused on (kept alive with it)."""

    group: Any  # dist.ProcessGroupGloo | dist.ProcessGroupNCCL
    store: Any  # dist.TCPStore
    rank: int
    world_size: int
    backend: str = "gloo"  # "nccl": tensors broadcast over it live on the rank's current CUDA device


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> WeightUpdateGroup:
    """Join (rank > 0) or host (rank 0) a weight-update group; blocks until every rank has joined."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)  # type: ignore[attr-defined]
    # SGLang's (and slime's) ranks join with `init_custom_process_group`: PrefixStore(group_name), then torch's
    # `_new_process_group_helper` adds "{group_name}/" and "{device}/": the same keys here, so either side may host
    prefixed: Any = store
    for prefix in (group_name, f"{group_name}/", "cpu/" if backend == "gloo" else "cuda/"):
        prefixed = dist.PrefixStore(prefix, prefixed)  # type: ignore[attr-defined]
    group: Any
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, dist.ProcessGroupNCCL.Options())
    return WeightUpdateGroup(group, store, rank, world_size, backend)


def broadcast_tensors(group: WeightUpdateGroup, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast each tensor from `src` in order (in place on receivers)."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    for tensor in tensors:
        group.group.broadcast([tensor], options).wait()


def destroy_weight_update_group(group: WeightUpdateGroup) -> None:
    """Leave a weight-update group: shut its process group down where the backend can (NCCL aborts its
    communicators); the store and the group are freed when the last reference goes."""
    shutdown = getattr(group.group, "shutdown", None)
    if callable(shutdown):
        with contextlib.suppress(RuntimeError):  # a backend without shutdown support: dropping it is enough
            shutdown()
