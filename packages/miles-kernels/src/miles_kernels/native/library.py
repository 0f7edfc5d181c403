"""Loading the native library (`python -m miles_kernels.native build` makes it): which instruction-set build this
CPU runs, its kernels by name (`kernels()`), or why it cannot be used (`status()`), and the call that runs a kernel
(`run`: a profiler range when torch.profiler records)."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import torch
from torch._C._autograd import _profiler_enabled

from miles_kernels.native import build as _build

logger = logging.getLogger("miles_kernels.native")

# The widest first. MILES_NATIVE_ISA=<name> restricts the choice to that build (tests compare them).
ISAS = tuple(name for name, _ in _build.isas())
# The dtypes the kernels read, by the suffix of their names (float16 goes through float32: exact).
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_LOCK = threading.Lock()
# the kernels by name, "lib", "isa" and "panel_width" once loaded; "reason" when the library cannot be
_STATE: dict[str, object] = {}


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
    for suffix in DTYPES.values():
        for kernel, argtypes in kernels:
            fn = getattr(lib, f"miles_{kernel}_{suffix}_{isa}")
            fn.argtypes, fn.restype = argtypes, None
            _STATE[f"{kernel}_{suffix}"] = fn
    rope_args = [pointer, pointer, pointer, pointer, size, size, size, size, ctypes.c_int]
    for direction in ("fwd", "bwd"):  # float32 only (rope.cpp)
        fn = getattr(lib, f"miles_rope_{direction}_f32_{isa}")
        fn.argtypes, fn.restype = rope_args, None
        _STATE[f"rope_{direction}"] = fn
    ptrs = ctypes.POINTER(pointer)  # fused.cpp's decoder layer: its six weights' panels, four biases
    layer_args = [pointer, *[size] * 6, pointer, pointer, real, pointer, pointer, real, ptrs, ptrs, pointer, pointer,
                  size, pointer, pointer, size, pointer, size, pointer, pointer, pointer, pointer, size, real, size,
                  pointer, pointer, pointer, ctypes.c_int]  # fmt: skip
    layer = getattr(lib, f"miles_decoder_attention_f32_{isa}")
    layer.argtypes, layer.restype = layer_args, None
    _STATE["decoder_attention"] = layer
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
    return str(kernels()["isa"])


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


def kernels() -> dict[str, object]:
    """The loaded library's kernels by name (and "isa", "panel_width"); RuntimeError saying why when it is not
    usable here."""
    state = _STATE
    if "lib" in state:
        return state
    state = _state()
    if "lib" not in state:
        raise RuntimeError(str(state["reason"]))
    return state


def run(name: str, fn: object, *args: object) -> None:
    """Call a kernel; under torch.profiler the call is a range named `native::<name>` (a trace shows the kernels
    beside the aten ops; not recording, the check costs ~0.2 us)."""
    if _profiler_enabled():
        with torch.profiler.record_function(f"native::{name}"):
            fn(*args)  # type: ignore[operator]
        return
    fn(*args)  # type: ignore[operator]


def panel_width() -> int:
    """Columns per panel of the loaded build's packed weights (`pack_weight`): 32 on AVX-512, 16 on AVX2, 8 generic."""
    width = kernels()["panel_width"]
    assert isinstance(width, int)
    return width
