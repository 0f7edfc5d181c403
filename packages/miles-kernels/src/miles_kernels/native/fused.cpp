// The attention half of a decoder layer's engine forward in one call (float32, no autograd): the library's own
// kernels, called in the order the model's modules call them, on the same operands, so each output has the bits of
// the module path (miles_kernels/model.py: DecoderLayer, Attention; ops/kv_pages.py: write_kv):
//     h = rms_norm(x, input_layernorm)                     (norm.cpp)
//     q, k, v = h Wq^T (+ bq), h Wk^T (+ bk), h Wv^T (+ bv)  (gemm.cpp's packed GEMM from the held panels)
//     q, k = rms_norm per head (QK-norm, when given)        (norm.cpp)
//     q, k = RoPE(q), RoPE(k)                              (rope.cpp)
//     K / V rows stored at the batch's slots (then its copies' rows)
//     a = attention(q, K / V pages)                        (attention.cpp)
//     x' = x + a Wo^T (+ bo)
//     gate, up = n Wg^T, n Wu^T with n = rms_norm(x', post_attention_layernorm)
// returning x', gate and up: the SwiGLU's silu stays torch's (its SLEEF exp is not this library's), then the down
// projection. What this saves is the Python around ~20 calls a layer, not arithmetic.
#include <memory>

#include "simd.h"

extern "C" {
void MILES_EXPORT(miles_packed_f32)(const float* A, int64_t a_rs, int64_t a_cs, const float* P, float* C, int64_t ldc,
                                    int64_t M, int64_t N, int64_t K, int threads);
void MILES_EXPORT(miles_rms_norm_fwd_f32)(const float* x, const float* w, float* y, float* inverse, int64_t M,
                                          int64_t H, float eps, int threads);
void MILES_EXPORT(miles_rope_fwd_f32)(const float* x, const float* cos, const float* sin, float* y, int64_t N,
                                      int64_t H, int64_t D, int64_t R, int threads);
void MILES_EXPORT(miles_attention_fwd_f32)(const float* q, const float* k, const float* v, int64_t N, int64_t H,
                                           int64_t Hkv, int64_t D, int64_t P, const int64_t* positions,
                                           const int64_t* seqs, const int64_t* tables, int64_t B, float scale,
                                           int64_t window, const int64_t* rows, float* out, float* lse, int threads);
}

namespace {

// y (M, N) = x (M, K) W^T from W's packed panels, then + bias[n] per row when given (torch's `out + bias`)
void linear(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, int64_t N, float* y,
            int threads) {
  MILES_EXPORT(miles_packed_f32)(x, K, 1, panels, y, N, M, N, K, threads);
  if (!bias) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] = y[m * N + n] + bias[n];
}

using Buffer = std::unique_ptr<float[]>;

Buffer buffer(int64_t size) { return Buffer(new float[size]); }  // uninitialized: every element is written first

void norm(const float* x, const float* w, float* y, int64_t rows, int64_t width, float eps, int threads) {
  Buffer inverse = buffer(rows);
  MILES_EXPORT(miles_rms_norm_fwd_f32)(x, w, y, inverse.get(), rows, width, eps, threads);
}

// rows (tokens x heads, D) to their slots' rows of a contiguous store (pages, Hkv, P, D) viewed as (-1, D); the
// copies' rows (their tokens' rows, in order) after the tokens' ones, as write_kv concatenates them
void store_rows(const float* rows, int64_t N, int64_t heads, int64_t D, const int64_t* slots, int64_t copies,
                const int64_t* copy_tokens, float* store) {
  for (int64_t r = 0; r < N * heads; ++r) memcpy(store + slots[r] * D, rows + r * D, sizeof(float) * D);
  for (int64_t c = 0; c < copies; ++c)
    for (int64_t h = 0; h < heads; ++h)
      memcpy(store + slots[(N + c) * heads + h] * D, rows + (copy_tokens[c] * heads + h) * D, sizeof(float) * D);
}

}  // namespace

extern "C" void MILES_EXPORT(miles_decoder_attention_f32)(
    const float* x, int64_t N, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t D, int64_t inter,
    const float* input_norm, const float* post_norm, float eps, const float* q_norm, const float* k_norm,
    float head_eps, const float* const* panels, const float* const* biases, const float* cos, const float* sin,
    int64_t R, float* k_pages, float* v_pages, int64_t P, const int64_t* slots, int64_t copies,
    const int64_t* copy_tokens, const int64_t* positions, const int64_t* seqs, const int64_t* tables, int64_t B,
    float scale, int64_t window, float* x_out, float* gate, float* up, int threads) {
  const int64_t nq = heads * D, nkv = kv_heads * D;
  Buffer h = buffer(N * hidden), q = buffer(N * nq), k = buffer(N * nkv), v = buffer(N * nkv);
  Buffer qr = buffer(N * nq), kr = buffer(N * nkv);
  norm(x, input_norm, h.get(), N, hidden, eps, threads);
  linear(h.get(), N, hidden, panels[0], biases[0], nq, q.get(), threads);
  linear(h.get(), N, hidden, panels[1], biases[1], nkv, k.get(), threads);
  if (q_norm && k_norm) {  // QK-norm: q and k normalized per head in place of the projections
    Buffer qn = buffer(N * nq), kn = buffer(N * nkv);
    norm(q.get(), q_norm, qn.get(), N * heads, D, head_eps, threads);
    norm(k.get(), k_norm, kn.get(), N * kv_heads, D, head_eps, threads);
    q.swap(qn);
    k.swap(kn);
  }
  MILES_EXPORT(miles_rope_fwd_f32)(q.get(), cos, sin, qr.get(), N, heads, D, R, threads);
  MILES_EXPORT(miles_rope_fwd_f32)(k.get(), cos, sin, kr.get(), N, kv_heads, D, R, threads);
  linear(h.get(), N, hidden, panels[2], biases[2], nkv, v.get(), threads);
  store_rows(kr.get(), N, kv_heads, D, slots, copies, copy_tokens, k_pages);
  store_rows(v.get(), N, kv_heads, D, slots, copies, copy_tokens, v_pages);
  Buffer attended = buffer(N * nq), lse = buffer(N * heads);
  MILES_EXPORT(miles_attention_fwd_f32)(qr.get(), k_pages, v_pages, N, heads, kv_heads, D, P, positions, seqs, tables,
                                        B, scale, window, nullptr, attended.get(), lse.get(), threads);
  linear(attended.get(), N, nq, panels[3], biases[3], hidden, x_out, threads);
  for (int64_t i = 0; i < N * hidden; ++i) x_out[i] = x[i] + x_out[i];
  norm(x_out, post_norm, h.get(), N, hidden, eps, threads);
  linear(h.get(), N, hidden, panels[4], nullptr, inter, gate, threads);
  linear(h.get(), N, hidden, panels[5], nullptr, inter, up, threads);
}
