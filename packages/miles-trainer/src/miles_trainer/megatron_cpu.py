"""`megatron_on_cpu()`: run megatron-core's local-implementation modules on the CPU, for the CPU tests of the
Megatron backend (docs/megatron.md, "Testing on a CPU"). Not a training path: the backend refuses a CPU device
outside this context.

megatron-core 0.16 assumes CUDA in places that are not arithmetic: RoPE moves its frequencies to
`torch.cuda.current_device()`, attention enters the CUDA RNG tracker's fork (for dropout, 0 here), the MoE router
tests a Transformer Engine symbol that is undefined without Transformer Engine (a NameError), a checkpoint save and
the pipeline's send / receive call `torch.cuda.synchronize()`, the pipeline schedules count tokens in a
`torch.zeros(..., device="cuda")`, a tied model's last pipeline stage moves its copy of the embedding with
`.cuda()`, and the alltoall token dispatcher copies its split sizes to the host on a side CUDA stream. Inside the
context the device lookup answers "cpu", the fork and the synchronize are no-ops, the symbol is None, a tensor
asked for on "cuda" is made on the CPU, `.cuda()` leaves a CPU tensor where it is, streams and their events are
stand-ins that do nothing, and the dispatcher's host copy is the identity (as a NumPy array where it asks for one);
the modules' arithmetic is megatron-core's own, unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_ACTIVE = [False]


def cpu_emulation_active() -> bool:
    """Whether `megatron_on_cpu()` is in force."""
    return _ACTIVE[0]


class _Stream:
    """A CUDA stream stand-in: work on the CPU is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, *args: Any) -> Any:
        return self

    def synchronize(self) -> None:
        pass


_CURRENT_STREAM = _Stream()


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Let megatron-core modules run forward and backward on the CPU until the context exits."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    zeros = torch.zeros

    def cpu_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "cpu")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return zeros(*args, **kwargs)

    def host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if as_numpy and isinstance(tensor, torch.Tensor) else tensor

    replacements: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        (torch.cuda, "Stream", _Stream),
        (torch.cuda, "current_stream", lambda *args, **kwargs: _CURRENT_STREAM),
        (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
        (tracker, "fork", lambda *args, **kwargs: contextlib.nullcontext()),
        (moe_utils, "te_general_gemm", None),
        (token_dispatcher, "maybe_move_tensor_to_cpu", host_copy),
        (torch, "zeros", cpu_zeros),
        (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
    ]
    saved = [(owner, name, getattr(owner, name, None)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    _ACTIVE[0] = True
    try:
        yield
    finally:
        _ACTIVE[0] = False
        for owner, name, value in saved:
            setattr(owner, name, value)
