"""Benchmark: the sampler's Gumbel noise on a CPU, the native uniforms (native/noise.cpp) against their torch form,
side by side in one run.

`miles_kernels.ops.sampling.gumbel_noise` draws one uniform per (row's seed, row's position, token id) and returns
`-log(-log u)` in float64. The uniforms are splitmix64 integer arithmetic: one threaded native call where the native
kernels run, else ~20 int64 torch passes over rows x vocab (`_uniforms`); the logs are torch's either way. Both forms
are checked equal bit for bit here before they are timed. Per (rows, vocab): the median of `--repeats` timed calls
of the whole noise (uniforms and logs) and of the uniforms alone, each way, and the torch / native ratios.

    uv run python benchmarks/sampling_noise.py --out benchmarks/results/sampling_noise.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from host import host_info
from kernels import median_seconds

from miles_kernels import native
from miles_kernels.ops.sampling import RowSampling, _uniforms, row_keys, row_uniforms

CPU = torch.device("cpu")
VOCABS = (264, 32_000, 151_936)  # the built-in task's tokenizer, Llama-2's, Qwen3's
ROWS = (1, 8, 64)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return median_seconds(fn, repeats, warmup=1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/sampling_noise.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if native.status() is not True:
        raise SystemExit(f"the native kernels do not run here: {native.status()}")
    results = {}
    for vocab in VOCABS:
        for num_rows in ROWS:
            rows = [RowSampling(seed=1000 + i, position=17 + i) for i in range(num_rows)]

            def torch_uniforms(rows: list[RowSampling] = rows, vocab: int = vocab) -> torch.Tensor:
                return _uniforms(row_keys(rows, CPU), vocab)

            def native_uniforms(rows: list[RowSampling] = rows, vocab: int = vocab) -> torch.Tensor:
                return row_uniforms(rows, vocab, CPU)

            if not torch.equal(torch_uniforms(), native_uniforms()):
                raise SystemExit(f"the native uniforms differ from the torch form at {num_rows} rows x {vocab}")
            repeats = args.repeats if vocab * num_rows < 1_000_000 else max(2, args.repeats // 2)
            times = {
                "native_uniforms_ms": median_ms(native_uniforms, repeats * 20 if vocab < 1000 else repeats),
                "torch_uniforms_ms": median_ms(torch_uniforms, repeats * 20 if vocab < 1000 else repeats),
                "native_noise_ms": median_ms(lambda f=native_uniforms: -torch.log(-torch.log(f())), repeats),
                "torch_noise_ms": median_ms(lambda f=torch_uniforms: -torch.log(-torch.log(f())), repeats),
            }
            times["uniforms_torch_over_native"] = times["torch_uniforms_ms"] / times["native_uniforms_ms"]
            times["noise_torch_over_native"] = times["torch_noise_ms"] / times["native_noise_ms"]
            results[f"{num_rows} rows x {vocab}"] = {k: round(v, 3) for k, v in times.items()}
            print(f"{num_rows:>3} rows x {vocab:>6}: noise {times['native_noise_ms']:.3f} ms native vs "
                  f"{times['torch_noise_ms']:.3f} ms torch ({times['noise_torch_over_native']:.2f}x)")  # fmt: skip
    out = {
        "script_command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": host_info(),
        "native_isa": native.isa(),
        "equal_bits": True,
        "unit": "milliseconds per call (median)",
        "per_shape": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
