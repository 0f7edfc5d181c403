"""A standalone `torch.distributed` group for weight sync between a trainer (rank 0) and rollout engines.

The trainer and each engine join a group of their own, outside any default process group, rendezvousing on a
TCPStore at (master_address, master_port). Rank 0 broadcasts tensors under their Hugging Face names; engines
receive into fresh buffers. gloo on CPU, NCCL on GPU. Used by miles-rollout's `/init_weights_update_group` /
`/update_weights_from_distributed` and by the trainer's sender, so both sides share one implementation.

Listening: torch's TCPStore server listens on every interface of its node, whatever address it is given, and gloo
on the address the host name resolves to. Here the store (`rendezvous_store`, also the trainer ranks' own
rendezvous) listens on the given address only, and rank 0's gloo device too (every rank's when that address is
loopback: they are all on one node): a group meeting on 127.0.0.1 is not reachable from the network.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
    "int32": torch.int32, "float8_e4m3fn": torch.float8_e4m3fn,  # low-precision weights (quantization.py)
}  # fmt: skip


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
    store = rendezvous_store(master_address, master_port, world_size, is_host=rank == 0, timeout=timeout)
    # SGLang's (and slime's) ranks join with `init_custom_process_group`: PrefixStore(group_name), then torch's
    # `_new_process_group_helper` adds "{group_name}/" and "{device}/": the same keys here, so either side may host
    prefixed: Any = store
    for prefix in (group_name, f"{group_name}/", "cpu/" if backend == "gloo" else "cuda/"):
        prefixed = dist.PrefixStore(prefix, prefixed)  # type: ignore[attr-defined]
    group: Any
    if backend == "gloo":
        if rank == 0 or is_loopback(master_address):  # listen where the group meets, not on the host name's address
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]  # type: ignore[attr-defined]
            options._timeout = timeout
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, dist.ProcessGroupNCCL.Options())
    return WeightUpdateGroup(group, store, rank, world_size, backend)


def rendezvous_store(host: str, port: int, world_size: int, is_host: bool, timeout: timedelta) -> Any:
    """A TCPStore at host:port; `is_host`: this rank serves it, listening on `host` only (torch's own server binds
    every interface). Blocks until every rank has connected, as a TCPStore does."""
    if not is_host:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.fileno()
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now and closes it with the store
    return store


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def broadcast_tensors(group: WeightUpdateGroup, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast each tensor from `src` in order (in place on receivers)."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    for tensor in tensors:
        # FP8 travels as its bytes (gloo reduces no float8 dtype); the view shares the storage, so receivers fill it
        wire = tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor
        group.group.broadcast([wire], options).wait()


def destroy_weight_update_group(group: WeightUpdateGroup) -> None:
    """Leave a weight-update group: shut its process group down where the backend can (NCCL aborts its
    communicators); the store and the group are freed when the last reference goes."""
    shutdown = getattr(group.group, "shutdown", None)
    if callable(shutdown):
        with contextlib.suppress(RuntimeError):  # a backend without shutdown support: dropping it is enough
            shutdown()
