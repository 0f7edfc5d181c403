// RoPE (the rotate-half layout) in one call, each (token, head) row on its own: for x (N, H, D) and its tokens'
// cos / sin (N, R), R <= D rotary dimensions, h = R / 2,
//     y[d] = x[d] * c[d] - x[d + h] * s[d]     (d < h)
//     y[d] = x[d] * c[d] + x[d - h] * s[d]     (h <= d < R)
//     y[d] = x[d]                              (R <= d: partial rotary passes them through)
// and its backward, with z = g * s:
//     dx[d] = g[d] * c[d] + z[d + h]           (d < h)
//     dx[d] = g[d] * c[d] - z[d - h]           (h <= d < R)
//     dx[d] = g[d]                             (R <= d)
// Each product and each sum rounded once in float32, no fused multiply-add: the arithmetic of the torch form
// (miles_kernels/ops/rope.py: `x * cos + cat(-x2, x1) * sin`; a + (-b) is a - b, (-a) * b is -(a * b), exactly),
// so the same bits, in one pass instead of five tensor ops. float32 only (bfloat16 rounds after each torch op:
// the torch form runs it).
#include "simd.h"

namespace {

// out[d] = a[d] * c[d] + sign * (b[d] * s[d]) for d < n (sign +1 or -1)
inline void rotate_half(const float* a, const float* b, const float* c, const float* s, float sign, float* out,
                        int64_t n) {
  int64_t d = 0;
  if (sign > 0) {
    for (; d + W <= n; d += W)
      vstore(out + d, vadd(vmul(vload(a + d), vload(c + d)), vmul(vload(b + d), vload(s + d))));
    for (; d < n; ++d) out[d] = a[d] * c[d] + b[d] * s[d];
  } else {
    for (; d + W <= n; d += W)
      vstore(out + d, vsub(vmul(vload(a + d), vload(c + d)), vmul(vload(b + d), vload(s + d))));
    for (; d < n; ++d) out[d] = a[d] * c[d] - b[d] * s[d];
  }
}

// y = the rotation of x's rows (forward), or dx = its transpose applied to g's rows (backward): the same two
// half-rotations, the backward taking each half's sine from the other half and the opposite signs
void rotate_rows(const float* x, const float* cos, const float* sin, float* y, int64_t N, int64_t H, int64_t D,
                 int64_t R, bool transpose, int threads) {
  const int64_t h = R / 2;
  const int64_t low_sin = transpose ? h : 0, high_sin = transpose ? 0 : h;
  const float low_sign = transpose ? 1.0f : -1.0f;
#pragma omp parallel for num_threads(threads) schedule(static) if (worth_threads(threads, N * H, N * H * D))
  for (int64_t row = 0; row < N * H; ++row) {
    const float *in = x + row * D, *c = cos + (row / H) * R, *s = sin + (row / H) * R;
    float* out = y + row * D;
    rotate_half(in, in + h, c, s + low_sin, low_sign, out, h);
    rotate_half(in + h, in, c + h, s + high_sin, -low_sign, out + h, h);
    for (int64_t d = R; d < D; ++d) out[d] = in[d];
  }
}

}  // namespace

extern "C" void MILES_EXPORT(miles_rope_fwd_f32)(const float* x, const float* cos, const float* sin, float* y,
                                                 int64_t N, int64_t H, int64_t D, int64_t R, int threads) {
  rotate_rows(x, cos, sin, y, N, H, D, R, false, threads);
}

extern "C" void MILES_EXPORT(miles_rope_bwd_f32)(const float* g, const float* cos, const float* sin, float* dx,
                                                 int64_t N, int64_t H, int64_t D, int64_t R, int threads) {
  rotate_rows(g, cos, sin, dx, N, H, D, R, true, threads);
}
