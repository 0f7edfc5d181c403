// The vector abstraction every per-instruction-set source of the native library is written in (gemm.cpp,
// attention.cpp): a V is one register of W floats (AVX-512: 16, AVX2: 8, the generic build: one float), with the
// operations the kernels use. Each is the same IEEE operation on every build — a fused multiply-add rounds once
// (fmaf in the generic build), add / sub / mul / max are exact-then-rounded — so a kernel that gives each lane one
// element's own sequence of operations computes the same bits whatever W is.
//
// Included by sources compiled once per instruction set (build.py: -DMILES_ISA_NAME=avx512 with -mavx512f ...,
// avx2 with -mavx2 -mfma, generic with neither); everything here has internal linkage.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MILES_CAT2(a, b) a##_##b
#define MILES_CAT(a, b) MILES_CAT2(a, b)
#define MILES_EXPORT(name) MILES_CAT(name, MILES_ISA_NAME)

namespace {

#if defined(__AVX512F__)
using V = __m512;
constexpr int W = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vbroadcast(float a) { return _mm512_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vselect_ge(V x, V lo, V a) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), a); }
inline V vpow2(V n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
using V = __m256;
constexpr int W = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vbroadcast(float a) { return _mm256_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vselect_ge(V x, V lo, V a) { return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), a); }
inline V vpow2(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#else
using V = float;  // scalar: fmaf rounds once, like the vector FMAs
constexpr int W = 1;
inline V vzero() { return 0.0f; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vbroadcast(float a) { return a; }
inline V vfma(V a, V b, V c) { return fmaf(a, b, c); }
inline V vadd(V a, V b) { return a + b; }
inline V vsub(V a, V b) { return a - b; }
inline V vmul(V a, V b) { return a * b; }
inline V vmax(V a, V b) { return a > b ? a : b; }  // the operands are never NaN where it is used
inline V vselect_ge(V x, V lo, V a) { return x >= lo ? a : 0.0f; }
inline V vpow2(V n) {
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
#endif

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

// exp(x) for x <= 0 (or -inf), one fixed sequence of operations per lane (Cephes' expf: x = n ln2 + r, a degree-6
// polynomial in r, times 2^n); below ln(2^-126) the result is exactly 0, so exp(-inf) = 0 and exp(0) = 1 exactly.
constexpr float EXP_LO = -87.33654f;
inline V vexp_nonpositive(V x) {
  const V xc = vmax(x, vbroadcast(EXP_LO));  // finite from here on
  const V magic = vbroadcast(12582912.0f);    // 1.5 * 2^23: adding it rounds to an integer
  const V n = vsub(vfma(xc, vbroadcast(1.44269504088896341f), magic), magic);
  V r = vfma(n, vbroadcast(-0.693359375f), xc);
  r = vfma(n, vbroadcast(2.12194440e-4f), r);
  V p = vbroadcast(1.9875691500e-4f);
  p = vfma(p, r, vbroadcast(1.3981999507e-3f));
  p = vfma(p, r, vbroadcast(8.3334519073e-3f));
  p = vfma(p, r, vbroadcast(4.1665795894e-2f));
  p = vfma(p, r, vbroadcast(1.6666665459e-1f));
  p = vfma(p, r, vbroadcast(5.0000001201e-1f));
  const V y = vadd(vfma(p, vmul(r, r), r), vbroadcast(1.0f));
  return vselect_ge(x, vbroadcast(EXP_LO), vmul(y, vpow2(n)));
}

// ---- Dot products as 16 lane chains added in one fixed tree ----
// A dot product over k keeps LANES = 16 partial sums: lane l is the fused multiply-add chain over k = l, l + 16,
// l + 32, ... in order (a length that is not a multiple of 16 ends with one zero-padded step), and the lanes are then
// added in one fixed tree: l + (l + 8), then + 4, + 2, + 1. AVX-512 holds the 16 lanes in one register, AVX2 in
// two, the generic build in 16 floats: the same operations on the same values, so the same bits.
constexpr int LANES = 16;
constexpr int NL = LANES / W;  // vectors holding them

struct Lanes {
  V v[NL];
};

inline void lanes_zero(Lanes& s) {
  for (int i = 0; i < NL; ++i) s.v[i] = vzero();
}

// s += the chains of a[0..n) . b[0..n) (a float32, b float32 or bfloat16).
template <class A, class B>
inline void lanes_dot(const A* a, const B* b, int64_t n, Lanes& s) {
  const int64_t full = n / LANES * LANES;
  for (int64_t k = 0; k < full; k += LANES)
    for (int i = 0; i < NL; ++i) s.v[i] = vfma(vload16(a + k + i * W), vload16(b + k + i * W), s.v[i]);
  if (full < n) {  // the last, partial step: zero-padded copies
    alignas(64) A a_pad[LANES] = {};
    alignas(64) B b_pad[LANES] = {};
    memcpy(a_pad, a + full, sizeof(A) * (n - full));
    memcpy(b_pad, b + full, sizeof(B) * (n - full));
    for (int i = 0; i < NL; ++i) s.v[i] = vfma(vload16(a_pad + i * W), vload16(b_pad + i * W), s.v[i]);
  }
}

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
// level 2: quarter 0 + 1; level 3: lanes 0-1 + 2-3; level 4: lane 0 + 1). At the end lane 4q + j holds element
// q + 4j.
inline __m512 pair_level(__m512 x, __m512 y, int level) {
  switch (level) {
    case 1: return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    case 2: return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    case 3: return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
    default: return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// `reduce` of 8 elements at once, the same adds of the same pairs: level 1 adds an element's two registers (lane l
// and l + 8), level 2 its 128-bit halves (l and l + 4) two elements to a register, levels 3 and 4 shuffle four
// elements' partial sums into one register (l + 2, then l + 1). At the end lane j of the low half holds element 2j,
// lane j of the high half element 2j + 1.
inline void reduce8(const Lanes* s, int n, float* out) {
  __m256 l1[8], l2[4], l3[2];
  for (int e = 0; e < 8; ++e) l1[e] = e < n ? _mm256_add_ps(s[e].v[0], s[e].v[1]) : _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j)
    l2[j] = _mm256_add_ps(_mm256_permute2f128_ps(l1[2 * j], l1[2 * j + 1], 0x20),
                          _mm256_permute2f128_ps(l1[2 * j], l1[2 * j + 1], 0x31));
  for (int j = 0; j < 2; ++j)
    l3[j] = _mm256_add_ps(_mm256_shuffle_ps(l2[2 * j], l2[2 * j + 1], 0x44),
                          _mm256_shuffle_ps(l2[2 * j], l2[2 * j + 1], 0xEE));
  alignas(32) float sums[8];
  _mm256_store_ps(sums, _mm256_add_ps(_mm256_shuffle_ps(l3[0], l3[1], 0x88), _mm256_shuffle_ps(l3[0], l3[1], 0xDD)));
  for (int j = 0; j < 4; ++j) {  // lane j: element 2j; lane 4 + j: element 2j + 1
    if (2 * j < n) out[2 * j] = sums[j];
    if (2 * j + 1 < n) out[2 * j + 1] = sums[4 + j];
  }
}
#endif

// out[e] = reduce(s[e]) for e < n (AVX-512: 16 at a time, AVX2: 8, padded with zero sums, which no real element's
// adds touch; cheaper than `reduce` per element from two elements on).
inline void reduce_many(const Lanes* s, int n, float* out) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (n >= 2) {
    for (int g = 0; g < n; g += 8) reduce8(s + g, n - g < 8 ? n - g : 8, out + g);
    return;
  }
#endif
#if defined(__AVX512F__)
  if (n >= 2) {
    for (int g = 0; g < n; g += 16) {
      __m512 l1[8], l2[4], l3[2];
      auto at = [&](int i) { return g + i < n ? s[g + i].v[0] : _mm512_setzero_ps(); };
      for (int j = 0; j < 8; ++j) l1[j] = pair_level(at(2 * j), at(2 * j + 1), 1);
      for (int j = 0; j < 4; ++j) l2[j] = pair_level(l1[2 * j], l1[2 * j + 1], 2);
      for (int j = 0; j < 2; ++j) l3[j] = pair_level(l2[2 * j], l2[2 * j + 1], 3);
      alignas(64) float sums[16];
      _mm512_store_ps(sums, pair_level(l3[0], l3[1], 4));
      for (int q = 0; q < 4; ++q)
        for (int j = 0; j < 4; ++j)  // lane 4q + j: element q + 4j
          if (g + q + 4 * j < n) out[g + q + 4 * j] = sums[4 * q + j];
    }
    return;
  }
#endif
  for (int e = 0; e < n; ++e) out[e] = reduce(s[e]);
}

// Threads: a call runs on one thread when it has less than MIN_PARALLEL_WORK multiply-adds (or elements) to do —
// waking the others costs more than they save on a decode step's small calls. Which thread computes an element
// never enters its arithmetic, so this changes the wall time, never the bits.
constexpr int64_t MIN_PARALLEL_WORK = int64_t(1) << 17;
inline bool worth_threads(int threads, int64_t tasks, int64_t work) {
  return threads > 1 && tasks > 1 && work >= MIN_PARALLEL_WORK;
}

}  // namespace
