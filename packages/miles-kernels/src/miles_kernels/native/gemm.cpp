// Batch-invariant GEMM by construction: C[m][n] = sum over k of A[m][k] * B[k][n], every element one fused
// multiply-add chain over k = 0, 1, ..., K-1 in order, starting from 0. Nothing in an element's arithmetic depends
// on M, on the row's position, on the blocking or on the thread count, and the vector width does not enter it
// either (each lane is one element's chain), so the AVX-512, AVX2 and scalar builds of this file give the same bits.
//
// This file is compiled once per instruction set (build.py: -DMILES_ISA_NAME=avx512 with -mavx512f ..., avx2 with
// -mavx2 -mfma, generic with neither) and dispatch.cpp picks one at run time.
//
// Blocking: the output is cut into panels of NR columns and chunks of ROWS_PER_TASK rows (the tasks, shared out
// over OpenMP threads); a task walks K in blocks of KC, packs that block of its panel of B into a KC x NR buffer
// (fp32, zero past the last column), and runs its rows through an MR x NR register-blocked micro-kernel (the tail
// in blocks of MR/2, ..., 1). Between K blocks the accumulators rest in C as fp32: storing and reloading a float
// does not change it, so the chain is the same one.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MILES_CAT2(a, b) a##_##b
#define MILES_CAT(a, b) MILES_CAT2(a, b)
#define MILES_EXPORT(name) MILES_CAT(name, MILES_ISA_NAME)

namespace {

constexpr int64_t KC = 256;            // K block: a packed KC x NR block of B stays in L1/L2
constexpr int64_t ROWS_PER_TASK = 96;  // rows per task (a multiple of every MR)

#if defined(__AVX512F__)
using V = __m512;
constexpr int W = 16, NV = 2, MR = 8;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vbroadcast(float a) { return _mm512_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
using V = __m256;
constexpr int W = 8, NV = 2, MR = 6;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vbroadcast(float a) { return _mm256_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
#else
using V = float;  // scalar: fmaf rounds once, like the vector FMAs
constexpr int W = 1, NV = 8, MR = 4;
inline V vzero() { return 0.0f; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vbroadcast(float a) { return a; }
inline V vfma(V a, V b, V c) { return fmaf(a, b, c); }
#endif
constexpr int NR = W * NV;
constexpr int LANES = 16;        // the dot kernel's partial sums per element, on every instruction set
constexpr int NL = LANES / W;    // vectors holding them

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {  // bfloat16 -> float is exact: the bits shifted into the high half
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

inline V vload16(const float* p) { return vload(p); }
inline V vload16(const uint16_t* p) {  // W bfloat16 values -> floats
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
  return to_float(*p);
#endif
}

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
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
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
// Each element keeps LANES = 16 partial sums: lane l is the fused multiply-add chain over k = l, l + 16, l + 32, ...
// in order (a K that is not a multiple of 16 ends with one zero-padded step), and the lanes are then added in one
// fixed tree: l + (l + 8), then + 4, + 2, + 1. AVX-512 holds the 16 lanes in one register, AVX2 in two, the generic
// build in 16 floats: the same operations on the same values, so the same bits. Reading W in its own layout (no
// packing) keeps a decode step (M = 1) at the cost of reading W once.

struct Lanes {
  V v[NL];
};

inline float reduce(const Lanes& s) {
  alignas(64) float l[LANES];
  for (int i = 0; i < NL; ++i) vstore(l + i * W, s.v[i]);
  for (int half = LANES / 2; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) l[i] = l[i] + l[i + half];
  return l[0];
}

#if defined(__AVX512F__)
// `reduce` of 16 elements at once, the same adds of the same pairs: each level adds lane l and l + half of two
// elements' sums, shuffled so that the level's results fill one register (level 1: 128-bit quarters 0-1 + 2-3;
// level 2: quarter 0 + 1; level 3: lanes 0-1 + 2-3; level 4: lane 0 + 1). At the end lane 4q + j holds the
// element of row j, column q.
inline __m512 pair_level(__m512 x, __m512 y, int level) {
  switch (level) {
    case 1: return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    case 2: return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    case 3: return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
    default: return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
  }
}

// The R x CN elements of a block in groups of 16 (the last group padded with zero sums, which no real element's
// adds touch).
template <int R, int CN>
inline void reduce_block(const Lanes (&acc)[R][CN], float* C, int64_t ldc) {
  constexpr int E = R * CN, G = (E + 15) / 16;
  for (int g = 0; g < G; ++g) {
    __m512 l1[8], l2[4], l3[2];
    auto at = [&](int i) { const int e = 16 * g + i; return e < E ? acc[e / CN][e % CN].v[0] : _mm512_setzero_ps(); };
    for (int j = 0; j < 8; ++j) l1[j] = pair_level(at(2 * j), at(2 * j + 1), 1);
    for (int j = 0; j < 4; ++j) l2[j] = pair_level(l1[2 * j], l1[2 * j + 1], 2);
    for (int j = 0; j < 2; ++j) l3[j] = pair_level(l2[2 * j], l2[2 * j + 1], 3);
    alignas(64) float sums[16];
    _mm512_store_ps(sums, pair_level(l3[0], l3[1], 4));
    for (int q = 0; q < 4; ++q)
      for (int j = 0; j < 4; ++j) {  // lane 4q + j: element 16g + q + 4j
        const int e = 16 * g + q + 4 * j;
        if (e < E) C[(e / CN) * ldc + e % CN] = sums[4 * q + j];
      }
  }
}
#endif

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
#if defined(__AVX512F__)
  if constexpr (R * CN >= 8) {
    reduce_block<R, CN>(acc, C, ldc);
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CN; ++c) C[r * ldc + c] = reduce(acc[r][c]);
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
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
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
