"""The native GEMM's Python side (gemm.cpp): `native_mm` (any strides), `native_linear` (a linear layer's forward) and
the packed copies of a server's weights (`hold_packed_weights`), each packed once per version into the kernel's
panels."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from miles_kernels.native.library import DTYPES, kernels, panel_width, run


def _operands(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Checked operands in a dtype the kernels take (float16 as float32: exact), and the dtype of the result."""
    if a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError(f"{name} runs on CPU tensors; got {a.device} and {b.device}")
    if a.dtype != b.dtype:
        raise ValueError(f"{name} needs one dtype; got {a.dtype} and {b.dtype}")
    dtype = a.dtype
    if dtype == torch.float16:
        return a.float(), b.float(), dtype
    if dtype not in DTYPES:
        raise ValueError(f"{name} runs float32, bfloat16 and float16; got {dtype}")
    return a, b, dtype


def _rounded(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out if dtype == torch.float32 else out.to(dtype)


def pack_weight(weight_NK: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A linear weight (N, K) packed into the GEMM's panels, (ceil(N / NR), K, NR) float32 (`panel_width`; zero past
    N; bfloat16 and float16 exactly): `native_linear` runs on it without packing again. Any strides. `out`: panels of
    that shape to pack into (a weight's previous packing: no new allocation, whose first touch costs page faults)."""
    state = kernels()
    if weight_NK.dim() != 2 or weight_NK.device.type != "cpu":
        raise ValueError(f"pack_weight packs a 2-D CPU weight; got {tuple(weight_NK.shape)} on {weight_NK.device}")
    if weight_NK.dtype == torch.float16:
        weight_NK = weight_NK.float()
    if weight_NK.dtype not in DTYPES:
        raise ValueError(f"pack_weight packs float32, bfloat16 and float16 weights; got {weight_NK.dtype}")
    (n, k), width = weight_NK.shape, panel_width()
    shape = (-(-n // width), k, width)
    if out is None or out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        out = torch.empty(shape, dtype=torch.float32)
    run("pack_weight", state[f"pack_{DTYPES[weight_NK.dtype]}"], weight_NK.data_ptr(), weight_NK.stride(0),
         weight_NK.stride(1), n, k, out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


# Packed panels of the weights a server holds (`hold_packed_weights`), per base tensor (the weight, or the stacked
# tensor an expert's weight is a view of), by its id: {(storage offset, shape, strides, dtype): (version, panels)}.
# An entry goes with its tensor (`weakref.finalize`), so an id is never reused while its entry is here.
_PACKED: dict[int, dict[tuple[object, ...] | None, tuple[tuple[object, ...], torch.Tensor]]] = {}


def hold_packed_weights(tensors: Iterable[torch.Tensor]) -> None:
    """Keep packed copies of these weights and of every view of them (an MoE layer's experts) for `native_linear`:
    each packed on its first use and again after any in-place change (a weight sync, a load: torch's version
    counter, which views share) or a new storage, released with the tensor. For a server's weights, used for many
    calls between updates: a decode step then reads each weight once, in the GEMM's layout. The copies are float32,
    as large as the weights in float32 (`packed_weights` lists them). Not for sharded or trained weights (FSDP
    gathers them anew each step): those are packed block by block in each call, with the same bits. In-place writes
    that bypass the version counter (`weight.data.copy_(...)`) are not seen."""
    for tensor in tensors:
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in _PACKED:
            _PACKED[id(base)] = {}
            weakref.finalize(base, _PACKED.pop, id(base), None)


def packed_weights(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The packed copies held for `tensors` and their views (`hold_packed_weights`): memory that goes with the
    weights (an engine releases and restores them with its weights)."""
    return [panels for t in tensors for _, panels in _PACKED.get(id(t), {}).values()]


def held_panels(weight_NK: torch.Tensor) -> torch.Tensor | None:
    """The current packed copy of a held weight (packed now if it is new or changed); None for any other weight."""
    base = weight_NK._base
    views = _PACKED.get(id(weight_NK if base is None else base))
    if views is None:
        return None
    # a held tensor itself, or one view of it (the key a view's place and layout)
    key = None if base is None else (weight_NK.storage_offset(), weight_NK.shape, weight_NK.stride(), weight_NK.dtype)
    version = (weight_NK._version, weight_NK.data_ptr(), weight_NK.shape, weight_NK.dtype)
    held = views.get(key)
    if held is None or held[0] != version:
        # packed again into the same panels, unless a memory release emptied their storage (it comes back zeroed)
        reuse = held[1] if held is not None and held[1].untyped_storage().nbytes() else None
        held = views[key] = (version, pack_weight(weight_NK, out=reuse))
    return held[1]


_PACKED_KERNELS = {dtype: f"packed_{suffix}" for dtype, suffix in DTYPES.items()}


def native_linear(x_MK: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` (a linear layer's forward): each element one fused multiply-add chain over k in order (gemm.cpp),
    the same bits as `native_mm(x, weight.T)`. A held weight (`hold_packed_weights`: a server's) runs from its packed
    copy; any other is packed block by block in the call. float32, or bfloat16 / float16 rounded once from the
    float32 result. (A decode step calls this for every layer: the common case, float32 or bfloat16 CPU operands of
    one dtype, is checked with the fewest tensor queries.)"""
    state = kernels()
    if x_MK.dim() != 2 or weight_NK.dim() != 2 or x_MK.shape[1] != weight_NK.shape[1]:
        raise ValueError(
            f"native_linear multiplies (M, K) by (N, K)^T; got {tuple(x_MK.shape)} and {tuple(weight_NK.shape)}"
        )
    dtype = x_MK.dtype
    kernel = _PACKED_KERNELS.get(dtype) if dtype is weight_NK.dtype and x_MK.is_cpu and weight_NK.is_cpu else None
    if kernel is None:  # operands to convert (float16) or refuse, by this function's name
        _operands("native_linear", x_MK, weight_NK)
        return native_mm(x_MK, weight_NK.t())
    panels = held_panels(weight_NK)
    if panels is None:  # not a held weight: packed block by block in the call
        return native_mm(x_MK, weight_NK.t())
    (m, k), n = x_MK.shape, weight_NK.shape[0]
    row_stride, col_stride = x_MK.stride()
    out = torch.empty(m, n, dtype=torch.float32)
    run("native_linear", state[kernel], x_MK.data_ptr(), row_stride, col_stride, panels.data_ptr(), out.data_ptr(), n,
         m, n, k, torch.get_num_threads())  # fmt: skip
    return _rounded(out, dtype)


def native_mm(a_MK: torch.Tensor, b_KN: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`a @ b` with fixed fused multiply-add chains (module docstring); any strides, no copies for float32 and
    bfloat16 (float16 goes through float32: exact). The result is float32 for float32 inputs and, for the others,
    the chains' float32 values rounded once to the inputs' dtype (or to `out_dtype`)."""
    state = kernels()
    if a_MK.dim() != 2 or b_KN.dim() != 2 or a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"native_mm multiplies (M, K) by (K, N); got {tuple(a_MK.shape)} and {tuple(b_KN.shape)}")
    a_MK, b_KN, dtype = _operands("native_mm", a_MK, b_KN)
    (m, k), n = a_MK.shape, b_KN.shape[1]
    out = torch.empty(m, n, dtype=torch.float32)
    run("native_mm", state[f"gemm_{DTYPES[a_MK.dtype]}"], a_MK.data_ptr(), a_MK.stride(0), a_MK.stride(1),
         b_KN.data_ptr(), b_KN.stride(0), b_KN.stride(1), out.data_ptr(), n, m, n, k,
         torch.get_num_threads())  # fmt: skip
    return _rounded(out, out_dtype or dtype)
