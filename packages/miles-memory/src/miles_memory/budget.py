"""The allocation budget (docs/memory.md, "OOM handling"): `memory.limit_bytes` per trainer rank or engine, minus
the headroom kept free for collectives, enforced on the bytes the offload manager and the trainer account for. An
overrun raises `torch.OutOfMemoryError`, the type a CUDA OOM raises, so one handler serves both; its message and
its `report` say what held memory, by tag, and what was asked for.

`ActivationMeter` accounts the activations a forward pass saves for its backward (autograd's saved-tensor hooks,
counted once per storage; the gathered FSDP parameters are not counted: they are freed after the forward).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units: "1.50 GiB", "12.0 MiB", "512 B"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(nbytes)} B"


@dataclass
class OOMReport:
    """What an out-of-memory error found: the request, the budget, and the bytes held by tag."""

    what: str
    requested_bytes: int
    limit_bytes: int
    headroom_bytes: int
    held_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": self.what, "requested_bytes": self.requested_bytes, "limit_bytes": self.limit_bytes,
            "headroom_bytes": self.headroom_bytes, "held_bytes": dict(self.held_bytes),
        }  # fmt: skip

    def message(self) -> str:
        held = ", ".join(f"{tag} {format_bytes(n)}" for tag, n in self.held_bytes.items() if n) or "nothing"
        free = self.limit_bytes - self.headroom_bytes - sum(self.held_bytes.values())
        return (
            f"out of memory: {self.what} tried to allocate {format_bytes(self.requested_bytes)}; "
            f"budget {format_bytes(self.limit_bytes)} (memory.limit_bytes) less {format_bytes(self.headroom_bytes)} "
            f"headroom (memory.comm_headroom_bytes), {format_bytes(max(free, 0))} free; held: {held}"
        )


def out_of_memory(report: OOMReport) -> torch.OutOfMemoryError:
    """A `torch.OutOfMemoryError` carrying `report` (as `.report`)."""
    error = torch.OutOfMemoryError(report.message())
    error.report = report  # type: ignore[attr-defined]
    return error


class MemoryBudget:
    """`limit_bytes` of which `headroom_bytes` stay free for collectives."""

    def __init__(self, limit_bytes: int, headroom_bytes: int = 0) -> None:
        if headroom_bytes >= limit_bytes:
            raise ValueError(f"headroom {headroom_bytes} leaves nothing of the limit {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.headroom_bytes = headroom_bytes

    @property
    def available_bytes(self) -> int:
        return self.limit_bytes - self.headroom_bytes

    def report(self, held: Mapping[str, int], requested: int, what: str) -> OOMReport:
        return OOMReport(what, requested, self.limit_bytes, self.headroom_bytes, dict(held))

    def fits(self, held: Mapping[str, int], requested: int) -> bool:
        return sum(held.values()) + requested <= self.available_bytes

    def check(self, held: Mapping[str, int], requested: int, what: str) -> None:
        """Raise `torch.OutOfMemoryError` when `requested` more bytes would not fit beside `held`."""
        if not self.fits(held, requested):
            raise out_of_memory(self.report(held, requested, what))


class _Saved:
    """What autograd keeps of one saved tensor while an `ActivationMeter` is active: the tensor, and a release of
    its bytes when autograd drops it (after the backward that used it)."""

    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, ptr: int) -> None:
        self.meter, self.tensor, self.ptr = meter, tensor, ptr

    def __del__(self) -> None:
        self.meter._release(self.ptr)


class ActivationMeter:
    """Counts the bytes of the activations autograd holds for backward (saved-tensor hooks; each storage once,
    released when autograd frees it), while active (`with meter:`). With a budget and the bytes held beside the
    activations, an overrun either raises `torch.OutOfMemoryError` at once or, `deferred`, is only recorded
    (`overrun`), so that every rank of a sharded step finishes its collectives and all agree on the retry before
    the next one (docs/memory.md, "OOM handling"). Parameters and their views are not counted (FSDP frees its
    gathered copies)."""

    def __init__(
        self,
        budget: MemoryBudget | None = None,
        held: Mapping[str, int] | None = None,
        *,
        deferred: bool = False,
        held_storages: Iterable[int] = (),
    ) -> None:
        """`held_storages`: data pointers of storages already counted in `held` (parameters and their views,
        which autograd saves too): not counted again."""
        self.budget = budget
        self.held = dict(held or {})
        self.is_deferred = deferred
        self._held_storages = set(held_storages)
        self.saved_bytes = 0
        self.peak_bytes = 0
        self.overrun: OOMReport | None = None
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved references]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        # What is kept is `tensor.detach()`: the same storage and version counter without the grad_fn. A node that
        # saves its own output (exp, log_softmax, ...) would otherwise hold it through its grad_fn, back to the node:
        # a cycle through autograd's C++ graph that Python's collector cannot break, so a graph never backpropagated
        # (a metric computed with grad) would keep its saved tensors alive for good.
        if isinstance(tensor, torch.nn.Parameter):
            return tensor
        # Views of parameters (a transposed or expanded weight) are weights, not activations: FSDP's gathered copies
        # among them are freed after the forward whatever autograd keeps.
        if isinstance(tensor._base, torch.nn.Parameter) or tensor.device.type == "meta":
            return tensor.detach()
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if not storage.nbytes() or ptr in self._held_storages:
            return tensor.detach()
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [storage.nbytes(), 1]
            self.saved_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.saved_bytes)
            if self.budget is not None and self.overrun is None and not self.budget.fits(self.held, self.saved_bytes):
                self.overrun = self.budget.report(self.held, self.saved_bytes, "the forward's saved activations")
                if not self.is_deferred:
                    raise out_of_memory(self.overrun)
        else:
            entry[1] += 1
        return _Saved(self, tensor.detach(), ptr)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.saved_bytes -= entry[0]
                del self._live[ptr]

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
