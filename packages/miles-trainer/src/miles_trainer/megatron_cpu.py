"""The Megatron backend's CPU device mode (`trainer.backend.device=cpu`, docs/megatron.md "On a CPU"): megatron-core's
local-implementation modules, its schedules, dispatchers and `dist_checkpointing` run on the CPU over gloo, for
development, CI and a laptop-sized rehearsal of a cluster layout. The arithmetic is megatron-core's own, unchanged.

megatron-core 0.16 assumes CUDA in places that are not arithmetic: RoPE moves its frequencies to
`torch.cuda.current_device()`, attention enters the CUDA RNG tracker's fork (for dropout, 0 here), the MoE router
tests a Transformer Engine symbol that is undefined without Transformer Engine (a NameError), a checkpoint save and
the pipeline's send / receive call `torch.cuda.synchronize()`, the pipeline schedules count tokens in a
`torch.zeros(..., device="cuda")`, a tied model's last pipeline stage moves its copy of the embedding with
`.cuda()`, the alltoall token dispatcher copies its split sizes to the host on a side CUDA stream, and activation
recompute saves and restores the CUDA generator's state around the recomputed forward (a no-op here: the CPU
generator's state is saved and restored as on a GPU). Inside
`megatron_on_cpu()` the device lookup answers "cpu", the fork and the synchronize are no-ops, the symbol is None, a
tensor asked for on "cuda" is made on the CPU, `.cuda()` leaves a CPU tensor where it is, streams and their events
are stand-ins that do nothing, and the dispatcher's host copy is the identity (as a NumPy array where it asks for
one).

`MegatronBackend` on a CPU device enters the context around each of its calls (building the model, a step, the
log-probs, a checkpoint, a weight export, offload / onload) and leaves it after, so nothing outside the backend
sees the stand-ins; the context nests (a call inside a call, or a test that holds it around the backend).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

_DEPTH = [0]  # how many `megatron_on_cpu()` contexts are open (the outermost one installs and restores)


def cpu_emulation_active() -> bool:
    """Whether `megatron_on_cpu()` is in force."""
    return _DEPTH[0] > 0


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
    """Let megatron-core modules run forward and backward on the CPU until the context exits (nested contexts are
    one: the outermost restores torch)."""
    if _DEPTH[0]:
        _DEPTH[0] += 1
        try:
            yield
        finally:
            _DEPTH[0] -= 1
        return
    import megatron.core.tensor_parallel.random as megatron_random
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
        # activation recompute saves and restores the CUDA generator's state around the recomputed forward
        (megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: None),
        (megatron_random, "_set_cuda_rng_state", lambda *args, **kwargs: None),
        (moe_utils, "te_general_gemm", None),
        (token_dispatcher, "maybe_move_tensor_to_cpu", host_copy),
        (torch, "zeros", cpu_zeros),
        (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
    ]
    saved = [(owner, name, getattr(owner, name, None)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    _DEPTH[0] = 1
    try:
        yield
    finally:
        _DEPTH[0] = 0
        for owner, name, value in saved:
            setattr(owner, name, value)


def device_mode(device: str | Any) -> contextlib.AbstractContextManager[None]:
    """The context a Megatron backend on `device` runs its calls in: `megatron_on_cpu()` on a CPU, none on CUDA."""
    return megatron_on_cpu() if str(device).split(":")[0] == "cpu" else contextlib.nullcontext()


Method = TypeVar("Method", bound=Callable[..., Any])


def in_device_mode(method: Method) -> Method:
    """Run a backend method (of an object with `.device`) in `device_mode(self.device)`."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with device_mode(self.device):
            return method(self, *args, **kwargs)

    return cast(Method, call)
