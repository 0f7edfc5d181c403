"""Build the native kernels (gemm.cpp, attention.cpp, norm.cpp, rope.cpp, fused.cpp, noise.cpp, dispatch.cpp) into
one shared library with a C++ compiler; standard library only, so the package's build hook (hatch_build.py, run by
`uv sync` / `pip install`) and `python -m miles_kernels.native build` share it without torch.

The first five are compiled once per instruction set (AVX-512, AVX2 + FMA, generic x86-64 / the host's
baseline elsewhere), noise.cpp (integer code) once, and the objects linked with dispatch.cpp, which tells the loader
what the CPU runs; `-fopenmp` links libgomp, the OpenMP runtime torch's Linux wheels load too (one thread pool). No
`-march=native`: the library built on one machine runs on any CPU of its architecture.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("simd.h", "gemm.cpp", "attention.cpp", "norm.cpp", "rope.cpp", "fused.cpp", "noise.cpp", "dispatch.cpp")
ONCE = ("noise.cpp",)  # compiled once: no vector code to dispatch
PER_ISA = ("gemm.cpp", "attention.cpp", "norm.cpp", "rope.cpp", "fused.cpp")  # compiled once per instruction set
LIBRARY = "_miles_native.so"
# (name, compiler flags) of each build of the PER_ISA sources; x86-64 only for the vector ones
ISAS_X86: tuple[tuple[str, list[str]], ...] = (
    ("avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]),
    ("avx2", ["-mavx2", "-mfma"]),
    ("generic", []),
)
FLAGS = ["-O3", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=c++17"]


def source_hash() -> str:
    """sha256 of the sources and this build recipe: the library reports it, the loader compares."""
    digest = hashlib.sha256()
    for name in (*SOURCES, "build.py"):
        digest.update((HERE / name).read_bytes())
    return digest.hexdigest()[:16]


def isas() -> tuple[tuple[str, list[str]], ...]:
    """The instruction-set builds of the PER_ISA sources for this machine's architecture."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return ISAS_X86
    return (("generic", []),)


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else c++ / g++ / clang++ on PATH."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    return next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def build(out_dir: Path = HERE) -> Path:
    """Compile and link the library into `out_dir`/_miles_native.so (replaced atomically); raises RuntimeError with
    the compiler's output when it fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++ / clang++)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        objects = []
        for isa, flags in isas():
            for source in PER_ISA:
                obj = Path(tmp) / f"{Path(source).stem}_{isa}.o"
                _run([cxx, *FLAGS, *flags, f"-DMILES_ISA_NAME={isa}", "-c", str(HERE / source), "-o", str(obj)])
                objects.append(str(obj))
        for source in ONCE:
            obj = Path(tmp) / f"{Path(source).stem}.o"
            _run([cxx, *FLAGS, "-c", str(HERE / source), "-o", str(obj)])
            objects.append(str(obj))
        dispatch = Path(tmp) / "dispatch.o"
        _run([cxx, *FLAGS, f'-DMILES_SOURCE_HASH="{source_hash()}"', "-c", str(HERE / "dispatch.cpp"),
              "-o", str(dispatch)])  # fmt: skip
        staged = Path(tmp) / LIBRARY
        _run([cxx, "-shared", "-fopenmp", *objects, str(dispatch), "-o", str(staged)])
        target = out_dir / LIBRARY
        os.replace(staged, target)
    return target


def _run(command: list[str]) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:  # the compiler named by CXX is not there or does not run
        raise RuntimeError(f"{command[0]} does not run: {exc}") from exc
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr or result.stdout}")


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
