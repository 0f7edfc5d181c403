"""Live tensor bytes, counted from the tensors themselves (docs/memory.md, "Host peak memory").

RSS is the wrong yardstick for a small CPU model (it is mostly the torch runtime and allocator caches, and
flaky), so memory claims are checked by counting bytes: `live_tensor_bytes` walks every tensor the Python
interpreter can reach (plus each parameter's gradient) and sums their distinct storages on one device type;
`PeakMeter` samples it at the steps of a transfer and keeps the peak, beside what a transfer reports holding in
flight (its buffers) through `extra`. Counting walks the heap (milliseconds), so it is for measurements and tests,
never on a hot path.
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Callable

import torch

SCAN_SWITCH_INTERVAL_S = 10.0  # longer than any scan: the scanning thread keeps the GIL until it is done


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of the distinct non-empty storages of every reachable tensor on `device_type` (DTensors: their local
    shards; parameters: their gradients too). Storages that map a file (`torch.from_file`) are left out."""
    seen: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> None:
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        if tensor.device.type != device_type or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.filename is None:  # a mapped file's pages are the file's, not allocations
            seen[storage.data_ptr()] = storage.nbytes()

    tensors = _tracked_tensors()
    for obj in tensors:
        try:
            count(obj)
            if isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
                count(obj.grad)
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage (fakes, functional)
            continue
    return sum(seen.values())


def _tracked_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector tracks. While gc's list of all objects is alive no other thread may run
    (the switch interval is raised for the scan): from a sampling thread, the list would also hold an object another
    thread is still building, and CPython fails resizing that tuple (SystemError in _PyTuple_Resize) once it holds
    a second reference."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SCAN_SWITCH_INTERVAL_S)
    try:
        with warnings.catch_warnings():  # isinstance() on deprecated module attributes (torch.distributed.reduce_op)
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            tensors = [obj for obj in objects if isinstance(obj, torch.Tensor)]
            del objects
    finally:
        sys.setswitchinterval(interval)
    return tensors


class PeakMeter:
    """The peak of `live_tensor_bytes() + extra()` over the samples taken (`sample()`, e.g. an offload manager's
    `progress` hook), relative to the first sample (`baseline`)."""

    def __init__(self, device_type: str = "cpu", extra: Callable[[], int] | None = None) -> None:
        self.device_type = device_type
        self.extra = extra
        self.baseline = self._now()
        self.peak = self.baseline
        self.num_samples = 1

    def _now(self) -> int:
        return live_tensor_bytes(self.device_type) + (self.extra() if self.extra is not None else 0)

    def sample(self) -> None:
        self.peak = max(self.peak, self._now())
        self.num_samples += 1

    @property
    def growth(self) -> int:
        """How far the peak rose above the baseline."""
        return self.peak - self.baseline
