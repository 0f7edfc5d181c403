// Batch-invariant GEMM by construction: C[m][n] = sum over k of A[m][k] * B[k][n], every element one fused
// multiply-add chain over k = 0, 1, ..., K-1 in order, starting from 0. Nothing in an element's arithmetic depends
// on M, on the row's position, on the blocking or on the thread count, and the vector width does not enter it
// either (each lane is one element's chain), so the AVX-512, AVX2 and scalar builds of this file give the same bits.
//
// This file is compiled once per instruction set (simd.h) and dispatch.cpp picks one at run time.
//
// Blocking: the output is cut into panels of NR columns and chunks of ROWS_PER_TASK rows (the tasks, shared out
// over OpenMP threads); a task walks K in blocks of KC, packs that block of its panel of B into a KC x NR buffer
// (fp32, zero past the last column), and runs its rows through an MR x NR register-blocked micro-kernel (the tail
// in blocks of MR/2, ..., 1, each over several panels at once: `panels_for`). Between K blocks the accumulators rest
// in C as fp32: storing and reloading a float does not change it, so the chain is the same one.
//
// A linear layer's forward (x W^T) runs the same tasks on W packed once into all of its panels (`pack_panels`: the
// Python side keeps the packed copy of a server's weight, miles_kernels.native.hold_packed_weights): each K block is
// then read in place, so the bits are those of `gemm` on W^T, and a decode step reads the weight once.
#include "simd.h"

namespace {

constexpr int64_t KC = 256;            // K block: a packed KC x NR block of B stays in L1/L2
constexpr int64_t ROWS_PER_TASK = 96;  // rows per task (a multiple of every MR)
constexpr int64_t TASK_PANELS = 4;     // panels per task on prepacked panels at fewer than MR rows

#if defined(__AVX512F__)
constexpr int NV = 2, MR = 8;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int NV = 2, MR = 6;
#else
constexpr int NV = 8, MR = 4;
#endif
constexpr int NR = W * NV;

#if defined(__AVX2__)
// out[i * ldo + j] = in[j * ldi + i] for i, j < 8: the standard unpack / shuffle / lane-permute transpose (data
// movement only).
inline void transpose8x8(const float* in, int64_t ldi, float* out, int64_t ldo) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ldi);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ldo, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ldo, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}
#endif

// buf[k][j] = B[k0 + k][n0 + j] for k < kc, j < ncols; zero for j >= ncols.
template <class T>
void pack(const T* B, int64_t rs, int64_t cs, int64_t k0, int64_t kc, int64_t n0, int64_t ncols, float* buf) {
  if (ncols < NR) memset(buf, 0, sizeof(float) * kc * NR);
  if (cs == 1) {  // rows of B contiguous
    for (int64_t k = 0; k < kc; ++k) {
      const T* row = B + (k0 + k) * rs + n0;
      float* out = buf + k * NR;
      for (int64_t j = 0; j < ncols; ++j) out[j] = to_float(row[j]);
    }
    return;
  }
  // columns of B contiguous (rs == 1: B is a transposed weight, a linear layer's forward) or any strides: read
  // along k; float32 columns in 8 x 8 blocks transposed in registers where the build has AVX2
  int64_t j0 = 0, kb = 0;
#if defined(__AVX2__)
  if constexpr (sizeof(T) == sizeof(float)) {
    if (rs == 1) {
      kb = kc / 8 * 8;
      for (; j0 + 8 <= ncols; j0 += 8)
        for (int64_t k = 0; k < kb; k += 8)
          transpose8x8(reinterpret_cast<const float*>(B) + (n0 + j0) * cs + k0 + k, cs, buf + k * NR + j0, NR);
    }
  }
#endif
  for (int64_t j = 0; j < ncols; ++j) {  // what the blocks left: the last columns, then the last rows of the others
    const T* col = B + (n0 + j) * cs + k0 * rs;
    for (int64_t k = j < j0 ? kb : 0; k < kc; ++k) buf[k * NR + j] = to_float(col[k * rs]);
  }
}

// Panels one micro-kernel call covers for R rows: enough independent chains (R x NV x G accumulators) to hide the
// fused multiply-add's latency at a decode step's few rows, few enough to stay in registers (the panel loads of a
// call with one row fold into its multiply-adds).
#if defined(__AVX512F__)
constexpr int panels_for(int R) { return R >= 8 ? 1 : R >= 4 ? 2 : 4; }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int panels_for(int R) { return R >= 3 ? 1 : 4; }
#else
constexpr int panels_for(int) { return 1; }
#endif

// R rows x ncols (<= G NR) of C from `kc` steps of the chains, over G panels of B (panel g's block at
// buf + g * pstride, kc x NR); `first`: the chains start at 0, else they go on from C.
template <int R, int G, class T>
inline void micro(const T* A, int64_t rs, int64_t cs, const float* buf, int64_t pstride, int64_t kc, float* C,
                  int64_t ldc, int64_t ncols, bool first) {
  constexpr int NVG = NV * G, COLS = NR * G;
  V acc[R][NVG];
  alignas(64) float edge[COLS];
  for (int r = 0; r < R; ++r) {
    if (first) {
      for (int v = 0; v < NVG; ++v) acc[r][v] = vzero();
    } else if (ncols == COLS) {
      for (int v = 0; v < NVG; ++v) acc[r][v] = vload(C + r * ldc + v * W);
    } else {
      memset(edge, 0, sizeof edge);
      memcpy(edge, C + r * ldc, sizeof(float) * ncols);
      for (int v = 0; v < NVG; ++v) acc[r][v] = vload(edge + v * W);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    V b[NVG];
    for (int v = 0; v < NVG; ++v) b[v] = vload(buf + (v / NV) * pstride + k * NR + (v % NV) * W);
    for (int r = 0; r < R; ++r) {
      const V a = vbroadcast(to_float(A[r * rs + k * cs]));
      for (int v = 0; v < NVG; ++v) acc[r][v] = vfma(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (ncols == COLS) {
      for (int v = 0; v < NVG; ++v) vstore(C + r * ldc + v * W, acc[r][v]);
    } else {
      for (int v = 0; v < NVG; ++v) vstore(edge + v * W, acc[r][v]);
      memcpy(C + r * ldc, edge, sizeof(float) * ncols);
    }
  }
}

// R rows across the ncols columns of a task's panels (panels_for(R) at a time, the rest one by one).
template <int R, class T>
inline void row_block(const T* A, int64_t rs, int64_t cs, const float* buf, int64_t pstride, int64_t kc, float* C,
                      int64_t ldc, int64_t ncols, bool first) {
  constexpr int G = panels_for(R);
  const int64_t panels = (ncols + NR - 1) / NR;
  int64_t p = 0;
  if constexpr (G > 1) {
    for (; p + G <= panels; p += G) {
      const int64_t n = ncols - p * NR < G * NR ? ncols - p * NR : G * NR;
      micro<R, G>(A, rs, cs, buf + p * pstride, pstride, kc, C + p * NR, ldc, n, first);
    }
  }
  for (; p < panels; ++p) {
    const int64_t n = ncols - p * NR < NR ? ncols - p * NR : NR;
    micro<R, 1>(A, rs, cs, buf + p * pstride, pstride, kc, C + p * NR, ldc, n, first);
  }
}

template <int R, class T>
void rows(const T* A, int64_t rs, int64_t cs, const float* buf, int64_t pstride, int64_t kc, float* C, int64_t ldc,
          int64_t ncols, int64_t m, bool first) {
  int64_t r = 0;
  for (; r + R <= m; r += R) row_block<R>(A + r * rs, rs, cs, buf, pstride, kc, C + r * ldc, ldc, ncols, first);
  if constexpr (R > 1) {
    if (r < m) rows<R / 2>(A + r * rs, rs, cs, buf, pstride, kc, C + r * ldc, ldc, ncols, m - r, first);
  }
}

// The tasks: the output cut into groups of `gp` panels (NR columns each) and chunks of rows; `block(panel, k0, kc,
// ncols, buf)` gives the K block of the group's first panel as kc x NR floats (packed into `buf`: gp = 1, or a
// pointer into prepacked panels), the next panels' `pstride` floats apart.
template <class T, class Block>
void gemm_tasks(const T* A, int64_t a_rs, int64_t a_cs, float* C, int64_t ldc, int64_t M, int64_t N, int64_t K,
                int threads, int64_t gp, int64_t pstride, Block block) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) memset(C + m * ldc, 0, sizeof(float) * N);
    return;
  }
  // rows split only when the panel groups alone do not give every thread several tasks
  const int64_t groups = (N + gp * NR - 1) / (gp * NR), rows_per_task = groups >= 4 * threads ? M : ROWS_PER_TASK;
  const int64_t chunks = (M + rows_per_task - 1) / rows_per_task, tasks = groups * chunks;
#pragma omp parallel for num_threads(threads) schedule(static) if (worth_threads(threads, tasks, M * N * K))
  for (int64_t t = 0; t < tasks; ++t) {
    alignas(64) float buf[KC * NR];  // unused on prepacked panels
    const int64_t panel = (t / chunks) * gp, m0 = (t % chunks) * rows_per_task;
    const int64_t n0 = panel * NR, ncols = N - n0 < gp * NR ? N - n0 : gp * NR;
    const int64_t m = M - m0 < rows_per_task ? M - m0 : rows_per_task;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = K - k0 < KC ? K - k0 : KC;
      const float* first_block = block(panel, k0, kc, ncols, buf);
      rows<MR>(A + m0 * a_rs + k0 * a_cs, a_rs, a_cs, first_block, pstride, kc, C + m0 * ldc + n0, ldc, ncols, m,
               k0 == 0);
    }
  }
}

template <class T>
void gemm(const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t b_rs, int64_t b_cs, float* C, int64_t ldc,
          int64_t M, int64_t N, int64_t K, int threads) {
  auto pack_block = [&](int64_t panel, int64_t k0, int64_t kc, int64_t ncols, float* buf) -> const float* {
    pack(B, b_rs, b_cs, k0, kc, panel * NR, ncols, buf);
    return buf;
  };
  gemm_tasks(A, a_rs, a_cs, C, ldc, M, N, K, threads, 1, 0, pack_block);
}

// ---- Prepacked panels: a weight used for many calls (a frozen or served weight) packed once ----
// P[p][k][j] = W[p NR + j][k] (zero past N): B = W^T, all of its panels at once, in float32 (bfloat16 exactly).
// A call on P runs the tasks above with each K block read in place: the same chains, so the same bits as `gemm`
// on W^T, without the packing (a decode step reads the weight once, as the packed form).
template <class T>
void pack_panels(const T* weight, int64_t rs, int64_t cs, int64_t N, int64_t K, float* P, int threads) {
  const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static) if (worth_threads(threads, panels, N * K))
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * NR, ncols = N - n0 < NR ? N - n0 : NR;
    pack(weight, cs, rs, 0, K, n0, ncols, P + p * K * NR);  // B[k][n] = W[n][k]: B's row stride is W's column stride
  }
}

template <class T>
void packed_gemm(const T* A, int64_t a_rs, int64_t a_cs, const float* P, float* C, int64_t ldc, int64_t M, int64_t N,
                 int64_t K, int threads) {
  auto in_place = [&](int64_t panel, int64_t k0, int64_t, int64_t, float*) -> const float* {
    return P + (panel * K + k0) * NR;
  };
  // groups of panels where every row is in a tail block (a decode step: several panels per micro-kernel call)
  gemm_tasks(A, a_rs, a_cs, C, ldc, M, N, K, threads, M < MR ? TASK_PANELS : 1, K * NR, in_place);
}

}  // namespace

extern "C" int64_t MILES_EXPORT(miles_panel_width)() { return NR; }

extern "C" void MILES_EXPORT(miles_pack_f32)(const float* weight, int64_t rs, int64_t cs, int64_t N, int64_t K,
                                              float* P, int threads) {
  pack_panels(weight, rs, cs, N, K, P, threads);
}

extern "C" void MILES_EXPORT(miles_pack_bf16)(const uint16_t* weight, int64_t rs, int64_t cs, int64_t N, int64_t K,
                                               float* P, int threads) {
  pack_panels(weight, rs, cs, N, K, P, threads);
}

extern "C" void MILES_EXPORT(miles_packed_f32)(const float* A, int64_t a_rs, int64_t a_cs, const float* P, float* C,
                                                int64_t ldc, int64_t M, int64_t N, int64_t K, int threads) {
  packed_gemm(A, a_rs, a_cs, P, C, ldc, M, N, K, threads);
}

extern "C" void MILES_EXPORT(miles_packed_bf16)(const uint16_t* A, int64_t a_rs, int64_t a_cs, const float* P,
                                                 float* C, int64_t ldc, int64_t M, int64_t N, int64_t K, int threads) {
  packed_gemm(A, a_rs, a_cs, P, C, ldc, M, N, K, threads);
}

extern "C" void MILES_EXPORT(miles_gemm_f32)(const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                                              int64_t b_rs, int64_t b_cs, float* C, int64_t ldc, int64_t M, int64_t N,
                                              int64_t K, int threads) {
  gemm(A, a_rs, a_cs, B, b_rs, b_cs, C, ldc, M, N, K, threads);
}

extern "C" void MILES_EXPORT(miles_gemm_bf16)(const uint16_t* A, int64_t a_rs, int64_t a_cs, const uint16_t* B,
                                               int64_t b_rs, int64_t b_cs, float* C, int64_t ldc, int64_t M,
                                               int64_t N, int64_t K, int threads) {
  gemm(A, a_rs, a_cs, B, b_rs, b_cs, C, ldc, M, N, K, threads);
}
