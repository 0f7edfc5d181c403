"""Probe for a native batch-invariant GEMM (issue: fast deterministic CPU kernels): a register-blocked C++ kernel
whose every output element is one fused multiply-add chain over k = 0..K-1, against one MKL GEMM (`F.linear`, the
fast mode) and Miles' fixed-tile form (`tiled_matmul`, the deterministic mode today), side by side.

The kernel (built here with torch's `cpp_extension.load_inline`, `-O3 -march=native -fopenmp`: ATen's
`parallel_for` is a header that runs serially without OpenMP): W (N x K) packed once into
panels of NR columns (K x NR each, zero-padded), the panels shared out over threads (`at::parallel_for`), each
panel's rows in blocks of MR (the tail in blocks of MR/2, MR/4, ..., 1) into MR x NR accumulators. An element's
arithmetic never depends on M, on its row's block or on the thread count, so the kernel is batch-invariant by
construction; the probe checks it (every row alone against the batch, 1 thread against 2) and records the times of
each (MR, NR) at the vs-TRL policy's linear shapes for M = 1, 8, 64 (decode) and 600 (a train step's rows).
`avx512_8x32` is the 8 x 32 blocking written with AVX-512 intrinsics (the accumulators held in registers; the
generic loops leave that to the compiler); it is measured where the CPU has AVX-512. Forward GEMM, float32 only:
the backward GEMMs, bf16 inputs, dispatch without `-march=native` and the build at
`uv sync` are not done here.

    uv run python benchmarks/native_gemm_probe.py --out benchmarks/results/native_gemm_probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from host import host_info
from tiled_gemm import median_us

from miles_kernels import KernelConfig, tiled_matmul

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

template <int NR>
torch::Tensor pack(torch::Tensor W) {  // (N, K) -> (ceil(N / NR), K, NR), zero-padded columns
  W = W.contiguous();
  const int64_t N = W.size(0), K = W.size(1), np = (N + NR - 1) / NR;
  auto P = torch::zeros({np, K, NR}, W.options());
  const float* w = W.data_ptr<float>();
  float* p = P.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) p[((n / NR) * K + k) * NR + n % NR] = w[n * K + k];
  return P;
}

// MR rows x NR columns: each element a fused multiply-add chain over k in order
template <int MR, int NR>
static inline void micro(const float* __restrict A, int64_t lda, const float* __restrict P, int64_t K,
                         float* __restrict C, int64_t ldc, int64_t ncols) {
  float acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float* __restrict b = P + k * NR;
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];
      for (int c = 0; c < NR; ++c) acc[r][c] = __builtin_fmaf(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < ncols; ++c) C[r * ldc + c] = acc[r][c];
}

template <int MR, int NR>
static void rows(const float* A, int64_t lda, const float* P, int64_t K, float* C, int64_t ldc, int64_t ncols,
                 int64_t M) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) micro<MR, NR>(A + m * lda, lda, P, K, C + m * ldc, ldc, ncols);
  if constexpr (MR > 1) {
    if (M > m) rows<MR / 2, NR>(A + m * lda, lda, P, K, C + m * ldc, ldc, ncols, M - m);
  }
}

using Rows = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t);

// C = A W^T: the panels of NR columns shared out over the threads, each panel's rows by `panel_rows`
template <int NR>
torch::Tensor drive(torch::Tensor A, torch::Tensor P, int64_t N, Rows panel_rows) {
  A = A.contiguous();
  const int64_t M = A.size(0), K = A.size(1), np = P.size(0);
  auto C = torch::empty({M, N}, A.options());
  const float* a = A.data_ptr<float>();
  const float* p = P.data_ptr<float>();
  float* c = C.data_ptr<float>();
  at::parallel_for(0, np, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t q = p0; q < p1; ++q)
      panel_rows(a, K, p + q * K * NR, K, c + q * NR, N, std::min<int64_t>(NR, N - q * NR), M);
  });
  return C;
}

template <int MR, int NR>
torch::Tensor gemm(torch::Tensor A, torch::Tensor P, int64_t N) { return drive<NR>(A, P, N, rows<MR, NR>); }

#ifdef __AVX512F__
// the same chains with AVX-512 intrinsics: two 16-float vectors per row, the accumulators in registers
template <int MR>
static inline void micro512(const float* __restrict A, int64_t lda, const float* __restrict P, int64_t K,
                            float* __restrict C, int64_t ldc, int64_t ncols) {
  __m512 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(P + k * 32), b1 = _mm512_loadu_ps(P + k * 32 + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * lda + k]);
      lo[r] = _mm512_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm512_fmadd_ps(a, b1, hi[r]);
    }
  }
  alignas(64) float row[32];
  for (int r = 0; r < MR; ++r) {
    _mm512_store_ps(row, lo[r]);
    _mm512_store_ps(row + 16, hi[r]);
    for (int c = 0; c < ncols; ++c) C[r * ldc + c] = row[c];
  }
}

template <int MR>
static void rows512(const float* A, int64_t lda, const float* P, int64_t K, float* C, int64_t ldc, int64_t ncols,
                    int64_t M) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) micro512<MR>(A + m * lda, lda, P, K, C + m * ldc, ldc, ncols);
  if constexpr (MR > 1) {
    if (M > m) rows512<MR / 2>(A + m * lda, lda, P, K, C + m * ldc, ldc, ncols, M - m);
  }
}

torch::Tensor gemm_avx512_8x32(torch::Tensor A, torch::Tensor P, int64_t N) { return drive<32>(A, P, N, rows512<8>); }
#else
torch::Tensor gemm_avx512_8x32(torch::Tensor A, torch::Tensor P, int64_t N) {
  TORCH_CHECK(false, "this CPU has no AVX-512");
}
#endif

torch::Tensor pack32(torch::Tensor W) { return pack<32>(W); }
torch::Tensor pack48(torch::Tensor W) { return pack<48>(W); }
torch::Tensor gemm_4x32(torch::Tensor A, torch::Tensor P, int64_t N) { return gemm<4, 32>(A, P, N); }
torch::Tensor gemm_8x32(torch::Tensor A, torch::Tensor P, int64_t N) { return gemm<8, 32>(A, P, N); }
torch::Tensor gemm_4x48(torch::Tensor A, torch::Tensor P, int64_t N) { return gemm<4, 48>(A, P, N); }
"""
KERNELS = {"4x32": "pack32", "8x32": "pack32", "4x48": "pack48", "avx512_8x32": "pack32"}  # kernel: its packing
# (in, out) of each linear layer of the vs-TRL policy's decoder layer (benchmarks/tiled_gemm.py)
SHAPES = {
    "q_proj": (256, 256), "k_proj / v_proj": (256, 128), "gate_proj / up_proj": (256, 768), "down_proj": (768, 256),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/native_gemm_probe.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 600])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    from torch.utils.cpp_extension import load_inline

    has_avx512 = "avx512f" in host_info().get("isa_flags", [])
    if not has_avx512:
        KERNELS.pop("avx512_8x32")
    built = time.perf_counter()
    native = load_inline("miles_native_gemm_probe", cpp_sources=SOURCE, functions=[*set(KERNELS.values()),
                         *(f"gemm_{k}" for k in KERNELS)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                         extra_ldflags=["-fopenmp"])  # fmt: skip
    build_s = time.perf_counter() - built
    torch.manual_seed(0)
    tile = KernelConfig().linear_tile
    results: dict[str, Any] = {}
    for m in args.rows:
        for name, (k, n) in SHAPES.items():
            x, w = torch.randn(m, k), torch.randn(n, k)
            packed = {p: getattr(native, p)(w) for p in set(KERNELS.values())}
            want = F.linear(x, w)
            fns: dict[str, Callable[[], object]] = {
                "plain": lambda x=x, w=w: F.linear(x, w), "tiled": lambda x=x, w=w: tiled_matmul(x, w, tile),
            }  # fmt: skip
            checks = {}
            for kernel, pack in KERNELS.items():
                fn = getattr(native, f"gemm_{kernel}")
                fns[kernel] = lambda fn=fn, x=x, p=packed[pack], n=n: fn(x, p, n)
                out = fn(x, packed[pack], n)
                alone = torch.cat([fn(x[i : i + 1], packed[pack], n) for i in range(m)])
                torch.set_num_threads(1)
                one_thread = fn(x, packed[pack], n)
                torch.set_num_threads(2)
                checks[kernel] = {
                    "max_abs_diff_vs_mkl": float((out - want).abs().max()),
                    "rows_alone_equal": bool(torch.equal(alone, out)),
                    "one_thread_equal": bool(torch.equal(one_thread, out)),
                }
            times = median_us(fns, args.repeats)
            results[f"{name}_M{m}"] = {
                "us": times, "vs_plain": {f: round(t / times["plain"], 2) for f, t in times.items()}, "checks": checks,
            }  # fmt: skip
            print(f"{name:20s} M={m:4d}", results[f"{name}_M{m}"]["vs_plain"], flush=True)
    out = {"command": "uv run python benchmarks/native_gemm_probe.py", "host": host_info(),
           "threads": torch.get_num_threads(), "build_s": round(build_s, 1), "linear_tile": tile,
           "results": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
