"""What machine a benchmark ran on, for its JSON: the CPU model and the ISA flags its kernels dispatch on, the
torch kernel dispatch actually chosen, the BLAS / oneDNN builds, threads and library versions.

Results differ by CPU (ATen, MKL and oneDNN pick code paths by ISA, and those round differently), so every
benchmark JSON records `host_info()`. Scripts in this folder import it as `from host import host_info` (they run as
`python benchmarks/NAME.py`, which puts this folder on the path).
"""

from __future__ import annotations

import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# The ISA features the CPU kernels of torch / MKL / oneDNN dispatch on (a subset of /proc/cpuinfo's flags)
ISA_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_bf16", "amx_tile", "asimd", "sve")  # fmt: skip
# Environment variables that change which kernels run (and so the bits of their results)
DISPATCH_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                "OMP_NUM_THREADS", "MKL_NUM_THREADS")  # fmt: skip
PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "ray", "triton")


def _cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none: not Linux)."""
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.is_file() else ""


def cpu_model(cpuinfo: str) -> str:
    """The CPU's model name (from /proc/cpuinfo's text; platform.processor() elsewhere)."""
    match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return match.group(1).strip() if match else platform.processor() or platform.machine()


def isa_flags(cpuinfo: str) -> list[str]:
    """Which of `ISA_FLAGS` the CPU reports in /proc/cpuinfo's text (none without it)."""
    match = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", cpuinfo, re.M)
    present = set(match.group(1).split()) if match else set()
    return [flag for flag in ISA_FLAGS if flag in present]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def host_info() -> dict[str, Any]:
    """The machine and software a benchmark ran on: CPU model, ISA flags, torch's chosen CPU capability, the
    MKL / oneDNN builds, threads, the dispatch-changing environment variables that are set, and versions."""
    import torch

    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([^\s]+)", config)
    onednn = re.search(r"MKL-DNN (v[^\s]+)", config)
    cpuinfo = _cpuinfo()
    return {
        "cpu": cpu_model(cpuinfo),
        "isa_flags": isa_flags(cpuinfo),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": mkl.group(1) if mkl else None,
        "onednn": onednn.group(1) if onednn else None,
        "threads": torch.get_num_threads(),
        "dispatch_env": {name: os.environ[name] for name in DISPATCH_ENV if name in os.environ},
        "python": sys.version.split()[0],
        "versions": {package: version for package in PACKAGES if (version := _version(package))},
    }


def write_results(out: str | Path, results: dict[str, Any], began: float) -> None:
    """`results` with its `wall_time_s` (since `began`, a `time.perf_counter()`) as indented JSON at `out`."""
    import json
    import time

    results["wall_time_s"] = round(time.perf_counter() - began, 1)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path} ({results['wall_time_s']} s)")
