"""The same-node weight-sync file: one safetensors file that the trainer overwrites in place and the engine
copies from, both through a mapping each keeps open between syncs (docs/architecture.md, "Weight sync").

`safetensors_layout` reads where each tensor's bytes sit from the header alone; `MappedSafetensors` keeps a file
mapped and hands out a byte view per tensor; `load_mapped` copies a file laid out like the model's checkpoint
straight into its parameters. Only a file in /dev/shm (`in_shared_memory`) is worth keeping mapped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from miles_kernels.hf_io import SINGLE_FILE, checkpoint_tensors
from miles_kernels.model import CausalLM

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes sit in a safetensors file: absolute byte offsets [begin, end)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_layout(file: str | os.PathLike[str]) -> dict[str, TensorSlot]:
    """Name → dtype, shape and byte range of every tensor of a safetensors file, from its header alone."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if not 0 < header_len <= size - 8:
            raise ValueError(f"{file} is not a safetensors file (header length {header_len}, file size {size})")
        try:
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            data_start = 8 + header_len
            slots = {
                name: TensorSlot(_SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]),
                                 data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1])
                for name, entry in header.items()
            }  # fmt: skip
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            raise ValueError(f"{file}: unreadable safetensors header ({type(error).__name__}: {error})") from None
    if any(slot.end > size for slot in slots.values()):
        raise ValueError(f"{file} is truncated: its header points past the end of the file")
    return slots


SHARED_MEMORY = Path("/dev/shm")


def in_shared_memory(file: str | os.PathLike[str]) -> bool:
    """True for a path in /dev/shm: a weight file there is worth keeping mapped (`MappedSafetensors`) between
    uses; a file on disk is better unmapped after each use, or deleting it would not free its space."""
    return Path(file).resolve().is_relative_to(SHARED_MEMORY)


class MappedSafetensors:
    """One safetensors file kept mapped into this process (a shared mapping of the file's own pages), with a byte
    view of each tensor: reads see what other processes wrote to the file, writes land in it.

    Copying through a mapping that stays open skips the page faults of mapping the file anew on every use (12.6 MB
    in /dev/shm, 2 CPU cores: 0.6 ms per copy instead of 4 ms). `slots(file)` re-reads the header on every call
    (cheap) and maps again when the file was replaced (another inode), resized or re-laid out, so a stale mapping
    is never used. The caller owns the protocol that makes concurrent use safe (who writes, and when the other
    side reads); holding the mapping keeps a deleted file's pages alive until `close()` or the next remap.
    """

    def __init__(self) -> None:
        self._key: tuple[str, int, int] | None = None
        self._slots: dict[str, TensorSlot] = {}
        self._bytes: dict[str, torch.Tensor] = {}

    def slots(self, file: str | os.PathLike[str]) -> dict[str, tuple[TensorSlot, torch.Tensor]]:
        """Name -> (slot, uint8 view of its bytes in the mapping). Raises ValueError for a file that is not
        safetensors, OSError for one that cannot be opened."""
        slots = safetensors_layout(file)
        stat = os.stat(file)
        key = (os.path.realpath(file), stat.st_ino, stat.st_size)
        if key != self._key or slots != self._slots:
            self.close()
            data = torch.from_file(os.fspath(file), shared=True, size=stat.st_size, dtype=torch.uint8)
            self._bytes = {name: data[slot.begin : slot.end] for name, slot in slots.items()}
            self._key, self._slots = key, slots
        return {name: (slot, self._bytes[name]) for name, slot in self._slots.items()}

    def views_for(
        self, file: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """Name -> uint8 view of its bytes in the mapping, when the file holds exactly `tensors`' names, dtypes and
        shapes; None (and the mapping dropped) otherwise. Raises like `slots`."""
        slots = self.slots(file)
        same = slots.keys() == tensors.keys() and all(
            slots[name][0].dtype == t.dtype and slots[name][0].shape == tuple(t.shape) for name, t in tensors.items()
        )
        if not same:
            self.close()
            return None
        return {name: data for name, (_, data) in slots.items()}

    def close(self) -> None:
        """Drop the mapping."""
        self._key, self._slots, self._bytes = None, {}, {}


def load_mapped(model: CausalLM, mapping: MappedSafetensors, model_dir: str | os.PathLike[str]) -> bool:
    """Copy a single-file checkpoint into the model's parameters straight from a kept mapping (one copy, no
    safetensors tensors in between). Only when the file holds exactly the model's checkpoint tensors with their
    dtypes and shapes, MTP copies left out as weight sync writes it (and the parameters are contiguous): then
    returns True after copying; otherwise returns False having changed nothing (load with
    `load_state(model, dict(iter_checkpoint(...)))`)."""
    file = Path(model_dir) / SINGLE_FILE
    targets = checkpoint_tensors(model, mtp_copies=False)
    if not file.is_file() or not all(t.is_contiguous() for t in targets.values()):
        return False
    try:
        views = mapping.views_for(file, targets)
    except ValueError:
        return False
    if views is None:
        return False
    with torch.no_grad():
        for name, target in targets.items():
            target.view(-1).view(torch.uint8).copy_(views[name])
    return True
