"""AdamW with its state in host memory (`trainer.optimizer.offload`; docs/memory.md, "Host-memory optimizer").

DeepSpeed's ZeRO-Offload idea on FSDP2: the AdamW moments (`offload=moments`), or the moments and the float32 master
weights with their gradients (`offload=moments_and_master`), live in (pinned) host memory and the update runs on the
CPU, so a device holds no optimizer state: 8 bytes per parameter (4 with `moments_dtype=bfloat16`) of a 16-byte
float32 AdamW footprint leave it, or 16 of 16 with the masters.

- `moments`: the parameters and gradients stay on the device. The step walks every parameter's shard in chunks of
  `chunk_bytes`: the chunk's parameter and gradient are copied to a pinned staging buffer (device to host, on a copy
  stream), the CPU updates it in place beside the host moments, and the result goes back (host to device, on another
  stream). Two staging slots alternate, so the next chunk's download and the previous chunk's upload run while the
  CPU steps the current one.
- `moments_and_master`: the sharded parameters and their gradients are in host memory already (FSDP2's
  `CPUOffloadPolicy`: its all-gather uploads each layer's weights when the forward needs them, its reduce-scatter
  downloads the gradients), so the step updates them in place, chunk by chunk, with no copy.

The update is torch's fused AdamW kernel (`torch._fused_adamw_`, what `torch.optim.AdamW(fused=True)` calls) on each
chunk: an elementwise update, so with float32 moments the result is bit for bit `torch.optim.AdamW(fused=True)`'s on
the CPU (chunks are whole multiples of the kernel's vector width: the same lanes round the same way). With
`moments_dtype=bfloat16` each chunk's moments are widened to float32, updated, and rounded back to bfloat16
(round-to-nearest-even): 4 instead of 8 bytes per parameter in host memory and on the bus, at the cost of the
moments' precision (8 bits of mantissa).

The state has torch AdamW's keys (`step`, `exp_avg`, `exp_avg_sq`), as DTensors over the parameters' mesh when the
parameters are (local tensors in host memory), so a distributed checkpoint holds it sharded as it holds AdamW's, and a
checkpoint resumes with or without the offload, in either moments dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

MOMENTS = ("exp_avg", "exp_avg_sq")
VECTOR_ELEMENTS = 1024  # chunk lengths are multiples of this: every SIMD width's lanes line up with a whole tensor's
DEFAULT_CHUNK_BYTES = 32 << 20
FUSED_ADAMW_FLAGS = {
    "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": True,
    "decoupled_weight_decay": True,
}  # fmt: skip


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("HostAdamW steps contiguous parameters and gradients only")
    return tensor.view(-1)


class _Staging:
    """Two pinned host slots of a chunk's parameter and gradient, and the streams and events that move them: the
    download of chunk i+1 and the upload of chunk i-1 overlap the CPU's step of chunk i. On a CPU device the copies
    are plain synchronous copies (the path still runs, for the tests)."""

    def __init__(self, device: torch.device, num_elements: int) -> None:
        self.is_cuda = device.type == "cuda"
        pin = self.is_cuda
        self.params = [torch.empty(num_elements, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.grads = [torch.empty(num_elements, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        if self.is_cuda:
            self.down, self.up = torch.cuda.Stream(device), torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self.downloaded = [torch.cuda.Event() for _ in range(2)]  # type: ignore[no-untyped-call]
            self.uploaded = [torch.cuda.Event() for _ in range(2)]  # type: ignore[no-untyped-call]

    def begin(self, device: torch.device) -> None:
        if self.is_cuda:
            self.down.wait_stream(torch.cuda.current_stream(device))  # the step's gradients are ready

    def download(self, slot: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        n = param.numel()
        if not self.is_cuda:
            self.params[slot][:n].copy_(param)
            self.grads[slot][:n].copy_(grad)
            return
        with torch.cuda.stream(self.down):
            self.down.wait_event(self.uploaded[slot])  # the slot's previous chunk has left
            self.params[slot][:n].copy_(param, non_blocking=True)
            self.grads[slot][:n].copy_(grad, non_blocking=True)
            self.downloaded[slot].record()

    def wait(self, slot: int) -> None:
        if self.is_cuda:
            self.downloaded[slot].synchronize()

    def upload(self, slot: int, param: torch.Tensor) -> None:
        n = param.numel()
        if not self.is_cuda:
            param.copy_(self.params[slot][:n])
            return
        with torch.cuda.stream(self.up):
            param.copy_(self.params[slot][:n], non_blocking=True)
            self.uploaded[slot].record()

    def finish(self, device: torch.device) -> None:
        if self.is_cuda:  # the next forward reads the uploaded weights; the slots may be reused
            torch.cuda.current_stream(device).wait_stream(self.up)
            self.up.synchronize()


class HostAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's fused kernel) whose moments live in host memory (see the module
    docstring). `params`: float32 parameters, on a device (their chunks are staged through host memory) or in host
    memory (stepped in place). `moments_dtype`: float32 or bfloat16. `chunk_bytes`: the float32 bytes of a chunk.
    `staging`: copy every chunk through the staging slots (True), none (False), or those of parameters off the CPU
    (None, the default; True on a CPU runs a device's path with plain copies)."""

    def __init__(
        self, params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float], eps: float,
        weight_decay: float, moments_dtype: Literal["float32", "bfloat16"] = "float32",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES, staging: bool | None = None,
    ) -> None:  # fmt: skip
        if moments_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"moments_dtype={moments_dtype!r}: float32 or bfloat16")
        if chunk_bytes < 4 * VECTOR_ELEMENTS:
            raise ValueError(f"chunk_bytes={chunk_bytes}: at least {4 * VECTOR_ELEMENTS} (one chunk of 1024 floats)")
        # torch AdamW's group keys, those of the fused kernel this steps with: a checkpoint's param groups load into
        # `torch.optim.AdamW` as a fused one (torch takes a checkpoint's group settings over its own)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **FUSED_ADAMW_FLAGS}
        super().__init__(params, defaults)
        self.moments_dtype = getattr(torch, moments_dtype)
        self.chunk_elements = chunk_bytes // 4 // VECTOR_ELEMENTS * VECTOR_ELEMENTS
        self.staging = staging
        self._scratch: torch.Tensor | None = None
        self._staging: _Staging | None = None
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype != torch.float32:
                    raise ValueError(f"HostAdamW steps float32 parameters (masters), got {param.dtype}")

    def _host_like(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor of `param`'s local shape (pinned beside a GPU), as a DTensor like `param`."""
        shard = local(param)
        host = torch.zeros(shard.shape, dtype=dtype, pin_memory=shard.device.type == "cuda")
        if isinstance(param, DTensor):
            return DTensor.from_local(host, param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())  # fmt: skip
        return host

    def _init_state(self, param: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            for key in MOMENTS:
                state[key] = self._host_like(param, self.moments_dtype)
        return state

    def _chunks(self) -> Iterator[tuple[dict[str, Any], dict[str, Any], torch.Tensor, torch.Tensor, int, int]]:
        """(group, state, flat param shard, flat grad shard, start, end) of every chunk of every parameter with a
        gradient; each parameter's step counter advances once, before its first chunk."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._init_state(param)
                state["step"] += 1
                flat, grad = _flat(local(param)), _flat(local(param.grad))
                for start in range(0, flat.numel(), self.chunk_elements):
                    yield group, state, flat, grad, start, min(flat.numel(), start + self.chunk_elements)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chunks = list(self._chunks())
        staged = [c for c in chunks if self._is_staged(c[2])]
        for group, state, flat, grad, start, end in (c for c in chunks if not self._is_staged(c[2])):
            self._update(group, state, flat[start:end], grad[start:end], start, end)
        if staged:
            self._step_staged(staged)
        return loss

    def _is_staged(self, param: torch.Tensor) -> bool:
        return self.staging if self.staging is not None else param.device.type != "cpu"

    def _step_staged(self, chunks: list[tuple[dict[str, Any], dict[str, Any], torch.Tensor, torch.Tensor, int, int]]
                     ) -> None:  # fmt: skip
        device = chunks[0][2].device
        if self._staging is None:  # pinned slots are slow to allocate: once, then reused every step
            self._staging = _Staging(device, self.chunk_elements)
        staging = self._staging
        staging.begin(device)
        staging.download(0, chunks[0][2][chunks[0][4] : chunks[0][5]], chunks[0][3][chunks[0][4] : chunks[0][5]])
        for i, (group, state, flat, _, start, end) in enumerate(chunks):
            slot = i % 2
            if i + 1 < len(chunks):  # the next chunk comes down while this one steps
                _, _, nflat, ngrad, nstart, nend = chunks[i + 1]
                staging.download(1 - slot, nflat[nstart:nend], ngrad[nstart:nend])
            staging.wait(slot)
            n = end - start
            self._update(group, state, staging.params[slot][:n], staging.grads[slot][:n], start, end)
            staging.upload(slot, flat[start:end])
        staging.finish(device)

    def _update(
        self, group: dict[str, Any], state: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, start: int,
        end: int,
    ) -> None:  # fmt: skip
        """torch's fused AdamW on one chunk in host memory; bfloat16 moments widened and rounded back."""
        exp_avg, exp_avg_sq = (_flat(local(state[key]))[start:end] for key in MOMENTS)
        wide = self.moments_dtype != torch.float32
        if wide:  # widened into two float32 scratch chunks, allocated once (a fresh 2 x chunk every time costs more)
            if self._scratch is None:
                self._scratch = torch.empty(2, self.chunk_elements, dtype=torch.float32)
            m, v = self._scratch[0, : end - start].copy_(exp_avg), self._scratch[1, : end - start].copy_(exp_avg_sq)
        else:
            m, v = exp_avg, exp_avg_sq
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            [param], [grad], [m], [v], [], [state["step"]], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip
        if wide:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading, except that the moments go into this optimizer's host tensors (in its moments dtype)
        rather than to the parameters' device: a checkpoint of `torch.optim.AdamW` or of either moments dtype."""
        moments: dict[Any, dict[str, torch.Tensor]] = {}
        stripped = {**state_dict, "state": {}}
        for key, values in state_dict["state"].items():
            moments[key] = {k: v for k, v in values.items() if k in MOMENTS}
            stripped["state"][key] = {k: v for k, v in values.items() if k not in MOMENTS}
        super().load_state_dict(stripped)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(ids, params, strict=True):
            if not moments.get(saved_id):
                continue
            state = self.state[param]
            state["step"] = state["step"].to(device="cpu", dtype=torch.float32)
            for key in MOMENTS:
                host = self._host_like(param, self.moments_dtype)
                local(host).copy_(local(moments[saved_id][key]))
                state[key] = host
