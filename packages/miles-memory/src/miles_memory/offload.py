"""The offload manager (docs/memory.md, "Offload and onload"): one object, used by the trainer and the engine,
that moves the storages of tagged tensors out of the device and back between RL phases.

Colocated, the engine and the trainer take turns on the same memory: while the engine works, the trainer's
`weights`, `optimizer` state (and `mtp` modules) wait on the host or on disk; while the trainer works, the engine
drops its `kv_cache` and `weights`. The tensors stay the same Python objects (FSDP2, optimizers and autograd keep
their references): only each tensor's *storage* is emptied (`untyped_storage().resize_(0)`) and later re-allocated
and refilled, so the round trip is bit-exact and needs no re-wiring. A tag registered with `keep_contents=False`
(gradients, the engine's KV cache and weights) is dropped instead of saved: its storage comes back zeroed.

**Partial offload.** `offload(need_bytes=N)` moves only as much as the next phase needs room for: the largest
storages of the given tags first, until N bytes are free; the plan (what moves, what stays) is logged and returned.
**Host peak.** Storages move one at a time; a `FileStore` streams each through one 16 MiB buffer, so an offload
holds at most the resident bytes plus that buffer (`HostStore` holds the moved bytes on the host, which is the
point of it on a GPU). **Budget.** With a `MemoryBudget`, `onload` first checks that what comes back fits, and
raises `torch.OutOfMemoryError` (the type a CUDA OOM raises) with a report by tag when it does not.

Storages are de-duplicated across tags (tied embeddings, views, an MTP module's shared embedding): a storage
belongs to the first tag that yields it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from miles_memory.budget import MemoryBudget, format_bytes
from miles_memory.stores import OffloadStore

logger = logging.getLogger("miles_memory")

TensorSource = Callable[[], Iterable[torch.Tensor]]


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage`'s bytes (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # type: ignore[call-overload]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` (DTensors: their local shard), in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        if storage.nbytes() > 0 and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: what they hold, counted from the tensors themselves."""
    return sum(s.nbytes() for s in unique_storages(tensors))


def _bytes_by_tag(storages: dict[str, list[torch.UntypedStorage]]) -> dict[str, int]:
    return {tag: sum(s.nbytes() for s in group) for tag, group in storages.items()}


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    key: int | None  # the store's key; None: dropped, not saved


@dataclass
class OffloadPlan:
    """What one `offload` call moved: bytes per tag, what stayed resident, and the room it was asked for."""

    need_bytes: int | None
    moved_bytes: dict[str, int] = field(default_factory=dict)
    resident_bytes: dict[str, int] = field(default_factory=dict)
    num_storages: int = 0

    @property
    def freed_bytes(self) -> int:
        return sum(self.moved_bytes.values())

    def summary(self) -> str:
        moved = ", ".join(f"{tag} {format_bytes(n)}" for tag, n in self.moved_bytes.items() if n) or "nothing"
        kept = ", ".join(f"{tag} {format_bytes(n)}" for tag, n in self.resident_bytes.items() if n) or "nothing"
        need = "everything" if self.need_bytes is None else format_bytes(self.need_bytes)
        return f"offload (room for {need}): moved {moved} in {self.num_storages} storages; resident: {kept}"


class OffloadManager:
    """Per-tag offload / onload of tensor storages (see the module docstring)."""

    def __init__(self, store: OffloadStore, *, budget: MemoryBudget | None = None, name: str = "memory") -> None:
        self.store = store
        self.budget = budget
        self.name = name
        self._sources: dict[str, tuple[TensorSource, bool]] = {}
        self._moved: dict[str, list[_Moved]] = {}
        self._next_key = 0
        self.progress: Callable[[], None] | None = None  # called after each storage moves (peak measurements)

    def add(self, tag: str, tensors: TensorSource, *, keep_contents: bool = True) -> None:
        """Register `tag`: `tensors()` yields its tensors when called (optimizer state appears after a step, so the
        source is asked anew at every offload). `keep_contents=False`: drop the bytes instead of saving them."""
        if tag in self._sources:
            raise ValueError(f"memory tag {tag!r} is registered twice with {self.name}")
        self._sources[tag] = (tensors, keep_contents)
        self._moved[tag] = []

    @property
    def tags(self) -> list[str]:
        return list(self._sources)

    def _check_tags(self, tags: Sequence[str] | None) -> list[str]:
        unknown = [t for t in tags or () if t not in self._sources]
        if unknown:
            raise ValueError(f"unknown memory tag(s) {unknown} for {self.name}; it has {self.tags}")
        return list(tags) if tags is not None else self.tags

    def resident_storages(self) -> dict[str, list[torch.UntypedStorage]]:
        """Each tag's resident (non-empty) storages, each storage under the first tag that yields it."""
        seen: set[int] = set()
        out: dict[str, list[torch.UntypedStorage]] = {}
        for tag, (source, _) in self._sources.items():
            out[tag] = [s for s in unique_storages(source()) if s.data_ptr() not in seen]
            seen.update(s.data_ptr() for s in out[tag])
        return out

    def resident_bytes(self) -> dict[str, int]:
        """Bytes each tag holds on the device now."""
        return _bytes_by_tag(self.resident_storages())

    def is_offloaded(self, tag: str | None = None) -> bool:
        return any(self._moved[t] for t in ([tag] if tag is not None else self.tags))

    def offload(self, tags: Sequence[str] | None = None, *, need_bytes: int | None = None) -> OffloadPlan:
        """Move `tags` (None: all) off the device; with `need_bytes`, only the largest storages until that many
        bytes are free. Returns the plan, which is also logged."""
        tags = self._check_tags(tags)
        by_tag = self.resident_storages()
        candidates = [(tag, s) for tag in tags for s in by_tag[tag]]
        if need_bytes is not None:
            candidates.sort(key=lambda item: item[1].nbytes(), reverse=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        plan = OffloadPlan(need_bytes, moved_bytes=dict.fromkeys(tags, 0))
        for tag, storage in candidates:
            if need_bytes is not None and plan.freed_bytes >= need_bytes:
                break
            nbytes, key = storage.nbytes(), None
            if self._sources[tag][1]:
                key, self._next_key = self._next_key, self._next_key + 1
                self.store.put(key, _byte_view(storage))
                if storage.device.type == "cuda":
                    torch.cuda.synchronize()  # the host copy must land before the device memory goes
            storage.resize_(0)
            self._moved[tag].append(_Moved(storage, nbytes, key))
            plan.moved_bytes[tag] += nbytes
            plan.num_storages += 1
            if self.progress is not None:
                self.progress()
        plan.resident_bytes = _bytes_by_tag(by_tag)  # the moved storages are empty now
        logger.info("%s %s", self.name, plan.summary())
        return plan

    def onload(self, tags: Sequence[str] | None = None) -> int:
        """Re-allocate and refill what `offload` moved of `tags` (None: all); returns the bytes restored. With a
        budget, raises `torch.OutOfMemoryError` before allocating anything when they would not fit."""
        tags = self._check_tags(tags)
        incoming = sum(m.nbytes for tag in tags for m in self._moved[tag])
        if self.budget is not None and incoming:
            self.budget.check(self.resident_bytes(), incoming, f"{self.name} onload of {', '.join(tags)}")
        restored = 0
        for tag in tags:
            for moved in self._moved[tag]:
                moved.storage.resize_(moved.nbytes)
                if moved.key is not None:
                    self.store.get(moved.key, _byte_view(moved.storage))
                    self.store.drop(moved.key)
                else:
                    _byte_view(moved.storage).zero_()
                restored += moved.nbytes
                if self.progress is not None:
                    self.progress()
            self._moved[tag].clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return restored
