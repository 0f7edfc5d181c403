// RMSNorm in one call, each row on its own in one fixed order (batch-invariant by construction):
//     ss = x . x (simd.h's lanes_dot: 16 lane chains, a fixed tree);  r = 1 / sqrt(ss / H + eps)
//     y[d] = w[d] * (x[d] * r)                    (float32; the caller rounds once to the output dtype)
// and its backward, with n = x * r and g = dy * w (float32):
//     dx = r * (g - n * ((g . n) / H))            (row by row; g . n by lanes_dot)
//     dw[d] = sum over rows of dy[d] * n[d]       (one fused multiply-add chain per column, rows in order)
// Inputs float32 or bfloat16 (x, w and dy of one dtype), outputs float32.
#include <vector>

#include "simd.h"

namespace {

inline float inverse_rms(float sum_of_squares, int64_t H, float eps) {
  return 1.0f / sqrtf(sum_of_squares / static_cast<float>(H) + eps);
}

template <class T>
float row_inverse(const T* x, int64_t H, float eps) {
  Lanes s;
  lanes_zero(s);
  lanes_dot(x, x, H, s);
  return inverse_rms(reduce(s), H, eps);
}

template <class T>
void forward(const T* x, const T* w, float* y, float* inverse, int64_t M, int64_t H, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (worth_threads(threads, M, M * H))
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * H;
    const float r = row_inverse(row, H, eps);
    float* out = y + m * H;
    int64_t d = 0;
    for (; d + W <= H; d += W) vstore(out + d, vmul(vload16(w + d), vmul(vload16(row + d), vbroadcast(r))));
    for (; d < H; ++d) out[d] = to_float(w[d]) * (to_float(row[d]) * r);
    if (inverse) inverse[m] = r;
  }
}

constexpr int64_t COLUMNS_PER_TASK = 64;  // dw: columns a task sums over every row

template <class T>
void backward(const T* x, const T* w, const T* dy, float* dx, float* dw, int64_t M, int64_t H, float eps,
              int threads) {
  std::vector<float> inverse(M);
#pragma omp parallel num_threads(threads) if (worth_threads(threads, M, 3 * M * H))
  {
    std::vector<float> g(H), n(H);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      const T *row = x + m * H, *grad = dy + m * H;
      const float r = row_inverse(row, H, eps);
      inverse[m] = r;
      for (int64_t d = 0; d < H; ++d) {
        g[d] = to_float(grad[d]) * to_float(w[d]);
        n[d] = to_float(row[d]) * r;
      }
      Lanes s;
      lanes_zero(s);
      lanes_dot(g.data(), n.data(), H, s);
      const float mean = reduce(s) / static_cast<float>(H);
      float* out = dx + m * H;
      for (int64_t d = 0; d < H; ++d) out[d] = r * (g[d] - n[d] * mean);
    }
    if (dw) {
      const int64_t tasks = (H + COLUMNS_PER_TASK - 1) / COLUMNS_PER_TASK;
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tasks; ++t) {
        const int64_t d0 = t * COLUMNS_PER_TASK, d1 = d0 + COLUMNS_PER_TASK < H ? d0 + COLUMNS_PER_TASK : H;
        float* acc = dw + d0;
        for (int64_t d = d0; d < d1; ++d) dw[d] = 0.0f;
        for (int64_t m = 0; m < M; ++m) {
          const T *row = x + m * H + d0, *grad = dy + m * H + d0;
          const V r = vbroadcast(inverse[m]);
          int64_t d = 0;
          for (; d0 + d + W <= d1; d += W)
            vstore(acc + d, vfma(vload16(grad + d), vmul(vload16(row + d), r), vload(acc + d)));
          for (; d0 + d < d1; ++d) acc[d] = fmaf(to_float(grad[d]), to_float(row[d]) * inverse[m], acc[d]);
        }
      }
    }
  }
}

}  // namespace

#define MILES_NORM(suffix, T)                                                                                     \
  extern "C" void MILES_EXPORT(miles_rms_norm_fwd_##suffix)(const T* x, const T* w, float* y, float* inverse,    \
                                                            int64_t M, int64_t H, float eps, int threads) {        \
    forward(x, w, y, inverse, M, H, eps, threads);                                                                 \
  }                                                                                                                \
  extern "C" void MILES_EXPORT(miles_rms_norm_bwd_##suffix)(const T* x, const T* w, const T* dy, float* dx,      \
                                                            float* dw, int64_t M, int64_t H, float eps,            \
                                                            int threads) {                                         \
    backward(x, w, dy, dx, dw, M, H, eps, threads);                                                                \
  }

MILES_NORM(f32, float)
MILES_NORM(bf16, uint16_t)
