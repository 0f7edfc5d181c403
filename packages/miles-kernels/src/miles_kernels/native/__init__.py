"""The native CPU kernels: a C++ library (gemm.cpp, attention.cpp, norm.cpp, rope.cpp, noise.cpp, built by build.py
when the package installs) called through ctypes, with no torch headers in it, so one build serves every torch
version.

`native_mm(a, b)` is `a @ b` for 2-D CPU tensors of any strides (float32, or bfloat16 with float32 accumulation), each
output element one fused multiply-add chain over the inner dimension in order; `native_linear(x, w)` is `x @ w.T` with
the same chains (a server's weights packed once per version: `hold_packed_weights`); `native_attention` is causal
GQA attention over a paged KV store, each (token, head) row on its own in one fixed order, with its backward
(`native_attention_backward`); `native_rms_norm` is RMSNorm a row at a time, with its backward; `native_rope` is RoPE's
rotation (float32), with its backward, the bits of its torch form; `gumbel_uniforms` is
the sampler's noise uniforms (integer arithmetic: the bits of its torch form). All are batch-invariant by
construction: the same bits at any batch composition and thread count, and on every instruction set the library
dispatches to (AVX-512, AVX2, generic). `status()` says whether the library is usable here, or why
not; the op registry's `native` linear and attention backends are available exactly when it is (ops/linear.py,
ops/attention.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch._C._autograd import _profiler_enabled

from miles_kernels.native import build as _build

logger = logging.getLogger("miles_kernels.native")

# The widest first. MILES_NATIVE_ISA=<name> restricts the choice to that build (tests compare them).
ISAS = tuple(name for name, _ in _build.isas())
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "lib", "isa" once loaded; "reason" when it cannot be


def library_path() -> Path:
    """Where the installed library is (next to this file; an editable install builds it there)."""
    return Path(__file__).resolve().parent / _build.LIBRARY


def _load() -> None:
    path = library_path()
    if not path.exists():
        _STATE["reason"] = (
            f"the native library was not built ({path} is missing: no C++ compiler when the package installed?); "
            "build it with `python -m miles_kernels.native build`"
        )
        return
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _STATE["reason"] = f"the native library {path} does not load: {exc}"
        return
    lib.miles_native_source_hash.restype = ctypes.c_char_p
    built_from = lib.miles_native_source_hash().decode()
    if built_from != _build.source_hash():
        _STATE["reason"] = (
            f"the native library {path} was built from other sources ({built_from}, these are "
            f"{_build.source_hash()}); rebuild it with `python -m miles_kernels.native build`"
        )
        return
    lib.miles_native_cpu_supports.argtypes = [ctypes.c_char_p]
    wanted = os.environ.get("MILES_NATIVE_ISA")
    if wanted is not None and wanted not in ISAS:
        _STATE["reason"] = f"MILES_NATIVE_ISA={wanted!r} is not one of the builds {list(ISAS)}"
        return
    usable = [isa for isa in ISAS if lib.miles_native_cpu_supports(isa.encode()) and wanted in (None, isa)]
    if not usable:
        _STATE["reason"] = f"this CPU runs none of the native builds {[wanted] if wanted else list(ISAS)}"
        return
    isa = usable[0]
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    args = [pointer, size, size, pointer, size, size, pointer, size, size, size, size, ctypes.c_int]
    pack_args = [pointer, size, size, size, size, pointer, ctypes.c_int]
    packed_args = [pointer, size, size, pointer, pointer, size, size, size, size, ctypes.c_int]
    index, real = size, ctypes.c_float
    head = [pointer, pointer, pointer, size, size, size, size, size, pointer, pointer, pointer, size, real, index]
    head += [pointer]  # the K/V rows of the slots (0: pages)
    forward_args = [*head, pointer, pointer, ctypes.c_int]
    backward_args = [*head, size, pointer, size, pointer, *[pointer] * 6, ctypes.c_int]
    norm_forward_args = [pointer, pointer, pointer, pointer, size, size, real, ctypes.c_int]
    norm_backward_args = [pointer, pointer, pointer, pointer, pointer, size, size, real, ctypes.c_int]
    kernels = (("gemm", args), ("pack", pack_args), ("packed", packed_args), ("attention_fwd", forward_args),
               ("attention_bwd", backward_args), ("rms_norm_fwd", norm_forward_args),
               ("rms_norm_bwd", norm_backward_args))  # fmt: skip
    for suffix in _DTYPES.values():
        for kernel, argtypes in kernels:
            fn = getattr(lib, f"miles_{kernel}_{suffix}_{isa}")
            fn.argtypes, fn.restype = argtypes, None
            _STATE[f"{kernel}_{suffix}"] = fn
    rope_args = [pointer, pointer, pointer, pointer, size, size, size, size, ctypes.c_int]
    for direction in ("fwd", "bwd"):  # float32 only (rope.cpp)
        fn = getattr(lib, f"miles_rope_{direction}_f32_{isa}")
        fn.argtypes, fn.restype = rope_args, None
        _STATE[f"rope_{direction}"] = fn
    noise = lib.miles_gumbel_uniforms
    noise.argtypes, noise.restype = [pointer, pointer, size, size, pointer, ctypes.c_int], None
    _STATE["gumbel_uniforms"] = noise
    width = getattr(lib, f"miles_panel_width_{isa}")
    width.argtypes, width.restype = [], ctypes.c_int64
    _STATE["lib"], _STATE["isa"], _STATE["panel_width"] = lib, isa, width()


def _state() -> dict[str, object]:
    if not _STATE:
        with _LOCK:
            if not _STATE:
                _load()
                if "reason" in _STATE:  # once per process: the registry falls back to the torch-tiled kernels
                    logger.warning("native CPU kernels unavailable: %s", _STATE["reason"])
    return _STATE


def status() -> bool | str:
    """True when the native kernels run here, else why not (the registry's `is_available` answer)."""
    state = _state()
    return True if "lib" in state else str(state["reason"])


def isa() -> str:
    """The instruction-set build in use ("avx512", "avx2" or "generic"); RuntimeError when the library is not
    usable."""
    return str(_loaded()["isa"])


def cpu_vendor() -> str:
    """The CPU vendor string (`vendor_id` in /proc/cpuinfo: "GenuineIntel", "AuthenticAMD", ...; "" where it cannot
    be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def faster_than_mkl() -> bool | str:
    """True where the native GEMM is the faster plain GEMM for fast mode's linear layers: its AVX-512 or AVX2 build
    on a CPU that is not Intel's, where MKL runs its AVX2 code (AVX-512 build, AMD EPYC: 0.45-0.48x one MKL GEMM's
    time from 8 rows up, 1.13x at one row, benchmarks/results/tiled_gemm_amd_epyc.json; AVX2 build, an AMD EPYC
    without AVX-512: fast mode on MKL's GEMM took 1.1-2.1x deterministic mode's time per model step,
    kernels_amd_epyc_avx2_fast_mkl.json); else why not (the registry's `is_available` answer for fast mode's
    `native` linear). Intel CPUs keep MKL's AVX-512 GEMM until the packed native form is measured against it there."""
    usable = status()
    if usable is not True:
        return usable
    vendor, build = cpu_vendor(), isa()
    if vendor == "GenuineIntel" or build == "generic":
        return f"MKL's GEMM is fast mode's faster linear on this CPU ({vendor or 'unknown vendor'}, the {build} build)"
    return True


def _loaded() -> dict[str, object]:
    state = _state()
    if "lib" not in state:
        raise RuntimeError(str(state["reason"]))
    return state


def _operands(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Checked operands in a dtype the kernels take (float16 as float32: exact), and the dtype of the result."""
    if a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError(f"{name} runs on CPU tensors; got {a.device} and {b.device}")
    if a.dtype != b.dtype:
        raise ValueError(f"{name} needs one dtype; got {a.dtype} and {b.dtype}")
    dtype = a.dtype
    if dtype == torch.float16:
        return a.float(), b.float(), dtype
    if dtype not in _DTYPES:
        raise ValueError(f"{name} runs float32, bfloat16 and float16; got {dtype}")
    return a, b, dtype


def _run(name: str, fn: object, *args: object) -> None:
    """Call a kernel; under torch.profiler the call is a range named `native::<name>` (a trace shows the kernels
    beside the aten ops; not recording, the check costs ~0.2 us)."""
    if _profiler_enabled():
        with torch.profiler.record_function(f"native::{name}"):
            fn(*args)  # type: ignore[operator]
        return
    fn(*args)  # type: ignore[operator]


def _rounded(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out if dtype == torch.float32 else out.to(dtype)


def panel_width() -> int:
    """Columns per panel of the loaded build's packed weights (`pack_weight`): 32 on AVX-512, 16 on AVX2, 8 generic."""
    width = _loaded()["panel_width"]
    assert isinstance(width, int)
    return width


def pack_weight(weight_NK: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A linear weight (N, K) packed into the GEMM's panels, (ceil(N / NR), K, NR) float32 (`panel_width`; zero past
    N; bfloat16 and float16 exactly): `native_linear` runs on it without packing again. Any strides. `out`: panels of
    that shape to pack into (a weight's previous packing: no new allocation, whose first touch costs page faults)."""
    state = _loaded()
    if weight_NK.dim() != 2 or weight_NK.device.type != "cpu":
        raise ValueError(f"pack_weight packs a 2-D CPU weight; got {tuple(weight_NK.shape)} on {weight_NK.device}")
    if weight_NK.dtype == torch.float16:
        weight_NK = weight_NK.float()
    if weight_NK.dtype not in _DTYPES:
        raise ValueError(f"pack_weight packs float32, bfloat16 and float16 weights; got {weight_NK.dtype}")
    (n, k), width = weight_NK.shape, panel_width()
    shape = (-(-n // width), k, width)
    if out is None or out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        out = torch.empty(shape, dtype=torch.float32)
    _run("pack_weight", state[f"pack_{_DTYPES[weight_NK.dtype]}"], weight_NK.data_ptr(), weight_NK.stride(0),
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


def _held_panels(weight_NK: torch.Tensor) -> torch.Tensor | None:
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


_PACKED_KERNELS = {dtype: f"packed_{suffix}" for dtype, suffix in _DTYPES.items()}


def native_linear(x_MK: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` (a linear layer's forward): each element one fused multiply-add chain over k in order (gemm.cpp),
    the same bits as `native_mm(x, weight.T)`. A held weight (`hold_packed_weights`: a server's) runs from its packed
    copy; any other is packed block by block in the call. float32, or bfloat16 / float16 rounded once from the
    float32 result. (A decode step calls this for every layer: the common case, float32 or bfloat16 CPU operands of
    one dtype, is checked with the fewest tensor queries.)"""
    state = _STATE if "lib" in _STATE else _loaded()
    if x_MK.dim() != 2 or weight_NK.dim() != 2 or x_MK.shape[1] != weight_NK.shape[1]:
        raise ValueError(
            f"native_linear multiplies (M, K) by (N, K)^T; got {tuple(x_MK.shape)} and {tuple(weight_NK.shape)}"
        )
    dtype = x_MK.dtype
    kernel = _PACKED_KERNELS.get(dtype) if dtype is weight_NK.dtype and x_MK.is_cpu and weight_NK.is_cpu else None
    if kernel is None:  # operands to convert (float16) or refuse, by this function's name
        _operands("native_linear", x_MK, weight_NK)
        return native_mm(x_MK, weight_NK.t())
    panels = _held_panels(weight_NK)
    if panels is None:  # not a held weight: packed block by block in the call
        return native_mm(x_MK, weight_NK.t())
    (m, k), n = x_MK.shape, weight_NK.shape[0]
    row_stride, col_stride = x_MK.stride()
    out = torch.empty(m, n, dtype=torch.float32)
    _run("native_linear", state[kernel], x_MK.data_ptr(), row_stride, col_stride, panels.data_ptr(), out.data_ptr(), n,
         m, n, k, torch.get_num_threads())  # fmt: skip
    return _rounded(out, dtype)


def native_mm(a_MK: torch.Tensor, b_KN: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`a @ b` with fixed fused multiply-add chains (module docstring); any strides, no copies for float32 and
    bfloat16 (float16 goes through float32: exact). The result is float32 for float32 inputs and, for the others,
    the chains' float32 values rounded once to the inputs' dtype (or to `out_dtype`)."""
    state = _loaded()
    if a_MK.dim() != 2 or b_KN.dim() != 2 or a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"native_mm multiplies (M, K) by (K, N); got {tuple(a_MK.shape)} and {tuple(b_KN.shape)}")
    a_MK, b_KN, dtype = _operands("native_mm", a_MK, b_KN)
    (m, k), n = a_MK.shape, b_KN.shape[1]
    out = torch.empty(m, n, dtype=torch.float32)
    _run("native_mm", state[f"gemm_{_DTYPES[a_MK.dtype]}"], a_MK.data_ptr(), a_MK.stride(0), a_MK.stride(1),
         b_KN.data_ptr(), b_KN.stride(0), b_KN.stride(1), out.data_ptr(), n, m, n, k,
         torch.get_num_threads())  # fmt: skip
    return _rounded(out, out_dtype or dtype)


def gumbel_uniforms(seeds_M: torch.Tensor, positions_M: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sampler's float64 uniforms (M, vocab) of rows (seed, position) (int64 tensors holding their 64-bit
    patterns): `miles_kernels.ops.sampling.uniform` for every token id, the same bits as its torch form (noise.cpp:
    integer arithmetic and one exact conversion), threaded over the elements."""
    state = _loaded()
    seeds, positions = (t.to(torch.int64).contiguous() for t in (seeds_M, positions_M))
    if seeds.dim() != 1 or seeds.shape != positions.shape or seeds.device.type != "cpu":
        raise ValueError(f"gumbel_uniforms takes seeds and positions (M,) on the CPU; got {tuple(seeds.shape)} and "
                         f"{tuple(positions.shape)} on {seeds.device}")  # fmt: skip
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float64)
    _run("gumbel_uniforms", state["gumbel_uniforms"], seeds.data_ptr(), positions.data_ptr(), seeds.shape[0], vocab,
         out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


MAX_HEAD_DIM = 1024  # attention.cpp keeps a row's accumulator on the stack
_KV_LAYOUTS = {4: "pages (pages, Hkv, P, D)", 3: "rows (R, Hkv, D) with the rows of the slots (pages, P)"}


def _attention_operands(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables_SB: torch.Tensor,
    rows_PP: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked, contiguous operands: q as float32, the pages (or K/V rows, `rows_PP` given) in a dtype the kernels
    read (float16 as float32)."""
    tensors = (q_NHD, k_pages, v_pages, tables_SB) + (() if rows_PP is None else (rows_PP,))
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"native attention runs on CPU tensors; got {[str(t.device) for t in tensors]}")
    kv_dims = 4 if rows_PP is None else 3
    if q_NHD.dim() != 3 or k_pages.dim() != kv_dims or (rows_PP is not None and rows_PP.dim() != 2):
        raise ValueError(f"native attention takes q (N, H, D) and K / V {_KV_LAYOUTS[kv_dims]}; got q "
                         f"{tuple(q_NHD.shape)}, K {tuple(k_pages.shape)}")  # fmt: skip
    (_, heads, head_dim), kv_heads, page_dim = q_NHD.shape, k_pages.shape[1], k_pages.shape[-1]
    if k_pages.shape != v_pages.shape or page_dim != head_dim or heads % kv_heads or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"native attention takes q (N, H, D) and K / V {_KV_LAYOUTS[kv_dims]} of one shape, H a multiple of Hkv"
            f" and D <= {MAX_HEAD_DIM}; got q {tuple(q_NHD.shape)}, K {tuple(k_pages.shape)}, V {tuple(v_pages.shape)}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"native attention needs K and V pages of one dtype; got {k_pages.dtype} and {v_pages.dtype}")
    if k_pages.dtype not in _DTYPES:
        k_pages, v_pages = k_pages.float(), v_pages.float()
    return q_NHD.float().contiguous(), k_pages.contiguous(), v_pages.contiguous()


def native_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    positions_N: torch.Tensor,
    seqs_N: torch.Tensor,
    tables_SB: torch.Tensor,
    scale: float,
    window: int | None = None,
    rows_PP: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each query token (position `positions_N[t]`, sequence `seqs_N[t]`) over its sequence's
    keys in the page store (`tables_SB[s, b]`: the page of key block b; pages (num_pages, Hkv, P, D)), a row at a time
    in one fixed order (attention.cpp): batch-invariant by construction. `window`: a row sees its last `window` keys.
    `rows_PP` (num_pages, P): K / V are rows (R, Hkv, D) instead, slot (page, offset) holding row rows_PP[page,
    offset] (the trainer's tokens, no page store built; the same bits). Returns the float32 output (N, H, D) and
    log-sum-exp (N, H)."""
    state = _loaded()
    q, k, v = _attention_operands(q_NHD, k_pages, v_pages, tables_SB, rows_PP)
    (n, heads, head_dim), kv_heads = q.shape, k.shape[1]
    page = k.shape[2] if rows_PP is None else rows_PP.shape[1]
    out = torch.empty(n, heads, head_dim)
    lse = torch.empty(n, heads)
    ints = [t.to(torch.int64).contiguous() for t in (positions_N, seqs_N, tables_SB)]
    rows = 0 if rows_PP is None else rows_PP.to(torch.int64).contiguous()
    _run("native_attention", state[f"attention_fwd_{_DTYPES[k.dtype]}"], q.data_ptr(), k.data_ptr(), v.data_ptr(), n,
         heads, kv_heads, head_dim, page, *(t.data_ptr() for t in ints), ints[2].shape[1], scale, window or 0,
         _pointer(rows), out.data_ptr(), lse.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out, lse


def _pointer(t: torch.Tensor | int) -> int:
    return t if isinstance(t, int) else t.data_ptr()


def native_attention_backward(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    positions_N: torch.Tensor,
    seqs_N: torch.Tensor,
    tables_SB: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    window: int | None,
    out_NHD: torch.Tensor,
    lse_NH: torch.Tensor,
    grad_NHD: torch.Tensor,
    rows_PP: torch.Tensor | None = None,
    grad_rows_PP: torch.Tensor | None = None,
    num_grad_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq (N, H, D), dK and dV pages, float32) of `native_attention` given its float32 output and
    log-sum-exp and the output's gradient; the tokens of sequence s are query_starts[s] .. query_starts[s + 1] - 1,
    positions ascending. Deterministic: each sum runs in one fixed order (attention.cpp). K / V as rows (`rows_PP`,
    as `native_attention`): dK and dV are (num_grad_rows, Hkv, D), slot (page, offset)'s gradient in row
    grad_rows_PP[page, offset] (the sum a page store's slot would hold)."""
    state = _loaded()
    q, k, v = _attention_operands(q_NHD, k_pages, v_pages, tables_SB, rows_PP)
    (n, heads, head_dim), kv_heads = q.shape, k.shape[1]
    ints = [t.to(torch.int64).contiguous() for t in (positions_N, seqs_N, tables_SB, query_starts)]
    out, lse, grad = (t.float().contiguous() for t in (out_NHD, lse_NH, grad_NHD))
    dq = torch.empty(n, heads, head_dim)
    rows: torch.Tensor | int = 0  # 0: K / V are pages
    grad_rows: torch.Tensor | int = 0
    grad_shape: tuple[int, ...] = tuple(k.shape)
    if rows_PP is None:
        num_pages, _, page, _ = k.shape
    else:
        if grad_rows_PP is None or grad_rows_PP.shape != rows_PP.shape:
            raise ValueError("native attention over K / V rows takes the gradient row of each slot, grad_rows_PP, of "
                             f"the shape of rows_PP {tuple(rows_PP.shape)}")  # fmt: skip
        (num_pages, page), grad_shape = rows_PP.shape, (num_grad_rows, kv_heads, head_dim)
        rows, grad_rows = (t.to(torch.int64).contiguous() for t in (rows_PP, grad_rows_PP))
    dk, dv = torch.zeros(grad_shape), torch.zeros(grad_shape)
    _run("native_attention_backward", state[f"attention_bwd_{_DTYPES[k.dtype]}"], q.data_ptr(), k.data_ptr(),
         v.data_ptr(), n, heads, kv_heads, head_dim, page, *(t.data_ptr() for t in ints[:3]), ints[2].shape[1], scale,
         window or 0, _pointer(rows), ints[3].shape[0] - 1, ints[3].data_ptr(), num_pages, _pointer(grad_rows),
         out.data_ptr(), lse.data_ptr(), grad.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
         torch.get_num_threads())  # fmt: skip
    return dq, dk, dv


def _norm_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as contiguous rows (M, H) and the weight, in one dtype the kernels read (float16 as float32)."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"native RMSNorm runs on CPU tensors; got {x.device} and {weight.device}")
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"native RMSNorm takes x (..., H) and a weight (H,); got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    dtype = x.dtype if x.dtype in _DTYPES and weight.dtype == x.dtype else torch.float32
    return x.reshape(-1, x.shape[-1]).to(dtype).contiguous(), weight.to(dtype).contiguous()


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight * (x * r)`, r = 1 / sqrt(mean(x^2) + eps), each row in one fixed order (norm.cpp): float32 (M, H) rows
    (M = x's leading dims) for the caller to round once, and r (M,)."""
    state = _loaded()
    rows, w = _norm_operands(x, weight)
    out, inverse = torch.empty(rows.shape), torch.empty(rows.shape[0])
    _run("native_rms_norm", state[f"rms_norm_fwd_{_DTYPES[rows.dtype]}"], rows.data_ptr(), w.data_ptr(),
         out.data_ptr(), inverse.data_ptr(), *rows.shape, eps, torch.get_num_threads())  # fmt: skip
    return out, inverse


def native_rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float, weight_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dx (M, H) and dw (H,) (None unless `weight_grad`) of `native_rms_norm`, float32: dx = r (g - n mean(g n)),
    g = dy w, n = x r, row by row; dw = the sum over rows, in order, of dy n."""
    state = _loaded()
    rows, w = _norm_operands(x, weight)
    grad_rows = grad.reshape(rows.shape).to(rows.dtype).contiguous()
    dx = torch.empty(rows.shape)
    dw = torch.empty(rows.shape[1]) if weight_grad else None
    _run("native_rms_norm_backward", state[f"rms_norm_bwd_{_DTYPES[rows.dtype]}"], rows.data_ptr(), w.data_ptr(),
         grad_rows.data_ptr(), dx.data_ptr(), 0 if dw is None else dw.data_ptr(), *rows.shape, eps,
         torch.get_num_threads())  # fmt: skip
    return dx, dw


def _rope_operands(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int, int, int]:
    """(N, H, D, R) of x (N, H, D) and cos / sin (N, R): contiguous float32 CPU tensors, R even and <= D."""
    tensors = (x, cos, sin)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise ValueError(f"native RoPE takes contiguous float32 CPU tensors; got "
                         f"{[(t.dtype, str(t.device), t.is_contiguous()) for t in tensors]}")  # fmt: skip
    if x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0]:
        raise ValueError(f"native RoPE takes x (N, H, D) and cos / sin (N, R); got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")  # fmt: skip
    (n, heads, dim), rotary = x.shape, cos.shape[1]
    if rotary % 2 or rotary > dim:
        raise ValueError(f"native RoPE rotates an even number of dimensions <= the head's {dim}; got {rotary}")
    return n, heads, dim, rotary


def native_rope(x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    """`miles_kernels.ops.rope.apply_rope`'s rotation (rotate-half; the dimensions past R pass through) in one call
    (rope.cpp): the bits of its torch form. float32 (N, H, D) rows and (N, R) tables, contiguous, on the CPU."""
    return _rope("native_rope", "rope_fwd", x_NHD, cos_NR, sin_NR)


def native_rope_backward(grad_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    """The gradient of `native_rope` with respect to x, given the output's (the bits of the torch form's backward,
    `ops.rope._Rope`)."""
    return _rope("native_rope_backward", "rope_bwd", grad_NHD, cos_NR, sin_NR)


def _rope(name: str, kernel: str, x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    state = _STATE if "lib" in _STATE else _loaded()
    shape = _rope_operands(x_NHD, cos_NR, sin_NR)
    out = torch.empty_like(x_NHD)
    _run(name, state[kernel], x_NHD.data_ptr(), cos_NR.data_ptr(), sin_NR.data_ptr(), out.data_ptr(), *shape,
         torch.get_num_threads())  # fmt: skip
    return out
