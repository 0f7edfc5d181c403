"""Where offloaded bytes wait (docs/memory.md, "Offload and onload"): pinned host memory on a GPU (`HostStore`),
a file on a CPU, where host memory *is* the device (`FileStore`). Both take and give raw bytes, keyed by the
offload manager; nothing is pickled.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

import torch

CHUNK_BYTES = 16 * 1024**2  # FileStore streams through one buffer of this size: the host bound of a disk transfer


class OffloadStore(Protocol):
    """`put` a storage's bytes under a key, `get` them back into a tensor of the same size, `drop` the key."""

    def put(self, key: int, data: torch.Tensor) -> None: ...

    def get(self, key: int, out: torch.Tensor) -> None: ...

    def drop(self, key: int) -> None: ...

    @property
    def buffer_bytes(self) -> int:
        """Host bytes the store holds beyond the offloaded data itself (its transfer buffer)."""
        ...


class HostStore:
    """Host memory, pinned where a GPU is present (pageable where pinning is unavailable)."""

    buffer_bytes = 0

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def put(self, key: int, data: torch.Tensor) -> None:
        host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        host.copy_(data, non_blocking=True)
        self._buffers[key] = host

    def get(self, key: int, out: torch.Tensor) -> None:
        out.copy_(self._buffers[key], non_blocking=True)

    def drop(self, key: int) -> None:
        self._buffers.pop(key, None)

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())


class FileStore:
    """One scratch file under `directory`, written and read one storage at a time through one `CHUNK_BYTES` buffer,
    so a transfer never needs a second copy of what it moves in memory."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="miles-offload-", suffix=".bin", dir=self.directory)
        self._fd = fd  # kept open for the store's life: one descriptor, positioned reads and writes
        self.path = Path(name)
        self._offsets: dict[int, tuple[int, int]] = {}
        self._end = 0
        self._chunk = bytearray(CHUNK_BYTES)
        self._chunk_tensor = torch.frombuffer(self._chunk, dtype=torch.uint8)

    @property
    def buffer_bytes(self) -> int:
        return CHUNK_BYTES

    def put(self, key: int, data: torch.Tensor) -> None:
        # Copied through the chunk buffer: `data.numpy()` would mark the storage non-resizable for good.
        for start in range(0, data.numel(), CHUNK_BYTES):
            length = min(CHUNK_BYTES, data.numel() - start)
            self._chunk_tensor[:length].copy_(data[start : start + length])
            done = 0
            while done < length:  # os.pwrite may write less than asked
                done += os.pwrite(self._fd, memoryview(self._chunk)[done:length], self._end + start + done)
        self._offsets[key] = (self._end, data.numel())
        self._end += data.numel()

    def get(self, key: int, out: torch.Tensor) -> None:
        offset, size = self._offsets[key]
        for start in range(0, size, CHUNK_BYTES):
            length = min(CHUNK_BYTES, size - start)
            done = 0
            while done < length:  # os.preadv may read less than asked
                count = os.preadv(self._fd, [memoryview(self._chunk)[done:length]], offset + start + done)
                if count == 0:
                    raise OSError(f"offload file {self.path} is truncated: it lost the offloaded bytes")
                done += count
            out[start : start + length].copy_(self._chunk_tensor[:length])

    def drop(self, key: int) -> None:
        self._offsets.pop(key, None)
        if not self._offsets:
            # The file keeps its size: the next offload overwrites the same blocks (truncating and growing it
            # again cost ~8 ms of the 26 ms offload of a 39 MB trainer state, measured on 2 cores).
            self._end = 0

    def __del__(self) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)


def default_store(
    device: str | torch.device, to: str = "auto", directory: str | os.PathLike[str] | None = None
) -> OffloadStore:
    """`to`: "host", "disk" or "auto" (host memory for a GPU's tensors, a file for a CPU's)."""
    if to not in ("auto", "host", "disk"):
        raise ValueError(f"unknown offload target {to!r}; use auto, host or disk")
    is_cpu = torch.device(device).type == "cpu"
    return FileStore(directory) if to == "disk" or (to == "auto" and is_cpu) else HostStore()
