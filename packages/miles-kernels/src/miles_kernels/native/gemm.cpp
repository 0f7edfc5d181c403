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
// in blocks of MR/2, ..., 1). Between K blocks the accumulators rest in C as fp32: storing and reloading a float
// does not change it, so the chain is the same one.
#include "simd.h"

namespace {

constexpr int64_t KC = 256;            // K block: a packed KC x NR block of B stays in L1/L2
constexpr int64_t ROWS_PER_TASK = 96;  // rows per task (a multiple of every MR)

#if defined(__AVX512F__)
constexpr int NV = 2, MR = 8;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int NV = 2, MR = 6;
#else
constexpr int NV = 8, MR = 4;
#endif
constexpr int NR = W * NV;

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
  } else {  // columns of B contiguous (rs == 1: B is a transposed weight) or any strides: read along k
    for (int64_t j = 0; j < ncols; ++j) {
      const T* col = B + (n0 + j) * cs + k0 * rs;
      for (int64_t k = 0; k < kc; ++k) buf[k * NR + j] = to_float(col[k * rs]);
    }
  }
}

// rows x ncols of C from `kc` steps of the chains; `first`: the chains start at 0, else they go on from C.
template <int R, class T>
inline void micro(const T* A, int64_t rs, int64_t cs, const float* buf, int64_t kc, float* C, int64_t ldc,
                  int64_t ncols, bool first) {
  V acc[R][NV];
  alignas(64) float edge[NR];
  for (int r = 0; r < R; ++r) {
    if (first) {
      for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
    } else if (ncols == NR) {
      for (int v = 0; v < NV; ++v) acc[r][v] = vload(C + r * ldc + v * W);
    } else {
      memset(edge, 0, sizeof edge);
      memcpy(edge, C + r * ldc, sizeof(float) * ncols);
      for (int v = 0; v < NV; ++v) acc[r][v] = vload(edge + v * W);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload(buf + k * NR + v * W);
    for (int r = 0; r < R; ++r) {
      const V a = vbroadcast(to_float(A[r * rs + k * cs]));
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (ncols == NR) {
      for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * W, acc[r][v]);
    } else {
      for (int v = 0; v < NV; ++v) vstore(edge + v * W, acc[r][v]);
      memcpy(C + r * ldc, edge, sizeof(float) * ncols);
    }
  }
}

template <int R, class T>
void rows(const T* A, int64_t rs, int64_t cs, const float* buf, int64_t kc, float* C, int64_t ldc, int64_t ncols,
          int64_t m, bool first) {
  int64_t r = 0;
  for (; r + R <= m; r += R) micro<R>(A + r * rs, rs, cs, buf, kc, C + r * ldc, ldc, ncols, first);
  if constexpr (R > 1) {
    if (r < m) rows<R / 2>(A + r * rs, rs, cs, buf, kc, C + r * ldc, ldc, ncols, m - r, first);
  }
}

template <class T>
void gemm(const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t b_rs, int64_t b_cs, float* C, int64_t ldc,
          int64_t M, int64_t N, int64_t K, int threads) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) memset(C + m * ldc, 0, sizeof(float) * N);
    return;
  }
  // rows split only when the panels alone do not give every thread several tasks (each task packs its panel)
  const int64_t panels = (N + NR - 1) / NR, rows_per_task = panels >= 4 * threads ? M : ROWS_PER_TASK;
  const int64_t chunks = (M + rows_per_task - 1) / rows_per_task, tasks = panels * chunks;
#pragma omp parallel for num_threads(threads) schedule(static) if (worth_threads(threads, tasks, M * N * K))
  for (int64_t t = 0; t < tasks; ++t) {
    alignas(64) float buf[KC * NR];
    const int64_t panel = t / chunks, m0 = (t % chunks) * rows_per_task;
    const int64_t n0 = panel * NR, ncols = N - n0 < NR ? N - n0 : NR;
    const int64_t m = M - m0 < rows_per_task ? M - m0 : rows_per_task;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = K - k0 < KC ? K - k0 : KC;
      pack(B, b_rs, b_cs, k0, kc, n0, ncols, buf);
      rows<MR>(A + m0 * a_rs + k0 * a_cs, a_rs, a_cs, buf, kc, C + m0 * ldc + n0, ldc, ncols, m, k0 == 0);
    }
  }
}

// ---- The dot kernel: C[m][n] = A[m] . W[n], both rows contiguous along k (a linear layer's forward, x W^T) ----
// Each element is a `lanes_dot` (simd.h: 16 lane chains over k, added in one fixed tree), R x CN of them at a time. Reading W in its own
// layout (no packing) keeps a decode step (M = 1) at the cost of reading W once.

template <int R, int CN, class T>
inline void dot_block(const T* A, int64_t lda, const T* Wt, int64_t ldw, int64_t K, float* C, int64_t ldc) {
  Lanes acc[R][CN];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CN; ++c)
      for (int i = 0; i < NL; ++i) acc[r][c].v[i] = vzero();
  const int64_t full = K / LANES * LANES;
  for (int64_t k = 0; k < full; k += LANES) {
    V b[CN][NL];
    for (int c = 0; c < CN; ++c)
      for (int i = 0; i < NL; ++i) b[c][i] = vload16(Wt + c * ldw + k + i * W);
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < NL; ++i) {
        const V a = vload16(A + r * lda + k + i * W);
        for (int c = 0; c < CN; ++c) acc[r][c].v[i] = vfma(a, b[c][i], acc[r][c].v[i]);
      }
    }
  }
  if (full < K) {  // the last, partial step: zero-padded copies
    alignas(64) T a_pad[R][LANES] = {}, b_pad[CN][LANES] = {};
    for (int r = 0; r < R; ++r) memcpy(a_pad[r], A + r * lda + full, sizeof(T) * (K - full));
    for (int c = 0; c < CN; ++c) memcpy(b_pad[c], Wt + c * ldw + full, sizeof(T) * (K - full));
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CN; ++c)
        for (int i = 0; i < NL; ++i)
          acc[r][c].v[i] = vfma(vload16(a_pad[r] + i * W), vload16(b_pad[c] + i * W), acc[r][c].v[i]);
  }
  float sums[R * CN];
  reduce_many(&acc[0][0], R * CN, sums);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CN; ++c) C[r * ldc + c] = sums[r * CN + c];
}

#if defined(__AVX512F__)
constexpr int DOT_R = 4, DOT_C = 6;
#else
constexpr int DOT_R = 2, DOT_C = 2;
#endif

template <int R, int CN, class T>
void dot_cols(const T* A, int64_t lda, const T* Wt, int64_t ldw, int64_t K, float* C, int64_t ldc, int64_t n) {
  int64_t c = 0;
  for (; c + CN <= n; c += CN) dot_block<R, CN>(A, lda, Wt + c * ldw, ldw, K, C + c, ldc);
  if constexpr (CN > 1) {
    if (c < n) dot_cols<R, CN / 2>(A, lda, Wt + c * ldw, ldw, K, C + c, ldc, n - c);
  }
}

template <int R, class T>
void dot_rows(const T* A, int64_t lda, const T* Wt, int64_t ldw, int64_t K, float* C, int64_t ldc, int64_t m,
              int64_t n) {
  int64_t r = 0;
  for (; r + R <= m; r += R) dot_cols<R, DOT_C>(A + r * lda, lda, Wt, ldw, K, C + r * ldc, ldc, n);
  if constexpr (R > 1) {
    if (r < m) dot_rows<R / 2>(A + r * lda, lda, Wt, ldw, K, C + r * ldc, ldc, m - r, n);
  }
}

constexpr int64_t DOT_COLS_PER_TASK = 48;  // rows of W a task walks (they stay in cache across its rows of A)

template <class T>
void dot(const T* A, int64_t lda, const T* Wt, int64_t ldw, float* C, int64_t ldc, int64_t M, int64_t N, int64_t K,
         int threads) {
  if (M <= 0 || N <= 0) return;
  const int64_t col_tasks = (N + DOT_COLS_PER_TASK - 1) / DOT_COLS_PER_TASK;
  // rows split only when the columns alone do not give every thread several tasks
  const int64_t rows_per_task = col_tasks >= 4 * threads ? M : ROWS_PER_TASK;
  const int64_t row_tasks = (M + rows_per_task - 1) / rows_per_task, tasks = col_tasks * row_tasks;
#pragma omp parallel for num_threads(threads) schedule(static) if (worth_threads(threads, tasks, M * N * K))
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n0 = (t % col_tasks) * DOT_COLS_PER_TASK, m0 = (t / col_tasks) * rows_per_task;
    const int64_t n = N - n0 < DOT_COLS_PER_TASK ? N - n0 : DOT_COLS_PER_TASK;
    const int64_t m = M - m0 < rows_per_task ? M - m0 : rows_per_task;
    dot_rows<DOT_R>(A + m0 * lda, lda, Wt + n0 * ldw, ldw, K, C + m0 * ldc + n0, ldc, m, n);
  }
}

}  // namespace

extern "C" void MILES_EXPORT(miles_dot_f32)(const float* A, int64_t lda, const float* Wt, int64_t ldw, float* C,
                                             int64_t ldc, int64_t M, int64_t N, int64_t K, int threads) {
  dot(A, lda, Wt, ldw, C, ldc, M, N, K, threads);
}

extern "C" void MILES_EXPORT(miles_dot_bf16)(const uint16_t* A, int64_t lda, const uint16_t* Wt, int64_t ldw,
                                              float* C, int64_t ldc, int64_t M, int64_t N, int64_t K, int threads) {
  dot(A, lda, Wt, ldw, C, ldc, M, N, K, threads);
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
