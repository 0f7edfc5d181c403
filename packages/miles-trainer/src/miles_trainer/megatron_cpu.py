"""`megatron_on_cpu()`: run megatron-core's local-implementation modules on the CPU, for the CPU tests of the
Megatron backend (docs/megatron.md, "Testing on a CPU"). Not a training path: the backend refuses a CPU device
outside this context.

megatron-core 0.16 assumes CUDA in places that are not arithmetic: RoPE moves its frequencies to
`torch.cuda.current_device()`, attention enters the CUDA RNG tracker's fork (for dropout, 0 here), the MoE router
tests a Transformer Engine symbol that is undefined without Transformer Engine (a NameError), and a checkpoint save
calls `torch.cuda.synchronize()`. Inside the context the device lookup answers "cpu", the fork and the synchronize
are no-ops and the symbol is None; the modules' arithmetic is megatron-core's own, unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_ACTIVE = [False]


def cpu_emulation_active() -> bool:
    """Whether `megatron_on_cpu()` is in force."""
    return _ACTIVE[0]


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Let megatron-core modules run forward and backward on the CPU until the context exits."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", torch.cuda.current_device),
        (torch.cuda, "synchronize", torch.cuda.synchronize),
        (tracker, "fork", tracker.fork),
        (moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None)),
    ]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *args, **kwargs: None
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    _ACTIVE[0] = True
    try:
        yield
    finally:
        _ACTIVE[0] = False
        for owner, name, value in saved:
            setattr(owner, name, value)
