// Causal GQA attention over a paged KV store (the engine's cache, or the trainer's temporary store of its packed
// sequences), batch-invariant by construction: each (query token, head) row is computed on its own, from its
// position, its query and its sequence's keys alone, in one fixed order of operations.
//
// A row at position `pos` sees the keys lo..pos (lo = pos - window + 1 for a sliding window, else 0). It walks them
// in chunks of C = min(page size, 16) keys aligned to absolute positions, ascending, skipping chunks it sees none of,
// with an online softmax:
//     s_j = (q . k_j) * scale            (simd.h's lanes_dot: 16 lane chains over the head dim, a fixed tree)
//     m' = max(m, max_j s_j);  p_j = exp(s_j - m');  c = exp(m - m')      (simd.h's exp; m = -inf at first, c = 0)
//     l = l * c + p_0 + p_1 + ...;  acc[d] = acc[d] * c, then acc[d] = fma(p_j, v_j[d], acc[d]) for j ascending
// over the chunk's visible keys only, and out = acc / l, lse = m + log(l). Nothing here depends on the other rows of
// the call, on the thread count or on the vector width, so a row has the same bits alone or in any batch, in a
// prefill, a chunked prefill or a decode step, and on every instruction set.
//
// The backward (the trainer's) recomputes s_j with the same operations and p_j = exp(s_j - lse):
//     delta = dO . out;  dp_j = dO . v_j;  ds_j = p_j * (dp_j - delta) * scale
//     dq = sum_j ds_j k_j (one chain per element, keys ascending)
//     dk_j = sum over rows ds_j q, dv_j = sum over rows p_j dO (chains over the rows that read the key, sequences
//     ascending, then tokens, then heads)
// in two passes: rows in parallel for dq, (page, KV head) pairs in parallel for dk / dv (each owns its page).
//
// Shapes: q, out, dq (N, H, D) float32; K/V pages (num_pages, Hkv, P, D) float32 or bfloat16; tables (S, B) the
// page of each key block of each sequence; positions, seqs (N); lse (N, H).
//
// Or K/V rows (the trainer's): K and V (R, Hkv, D), one row per token, and `rows` (num_pages x P) the row each
// (page, offset) slot holds: the same keys in the same order as pages filled with those rows, so the same bits,
// without building the pages. The backward then accumulates dK / dV of slot (page, offset) in row
// `grad_rows[page * P + offset]` of dk, dv (G, Hkv, D): the chains a page store's slots would hold.
#include <vector>

#include "simd.h"

namespace {

constexpr int CHUNK = 16;  // keys per online-softmax step (the page size when that is smaller)
constexpr int64_t MAX_HEAD_DIM = 1024;

template <class T>
struct Attention {
  const float* q;
  const T* k;
  const T* v;
  int64_t N, H, Hkv, D, P;
  const int64_t* positions;
  const int64_t* seqs;
  const int64_t* tables;
  int64_t B;
  float scale;
  int64_t window;       // <= 0: none
  const int64_t* rows;  // null: K/V are pages; else K/V rows, slot (page, offset) in row rows[page * P + offset]

  int64_t group() const { return H / Hkv; }
  int chunk() const { return P < CHUNK ? static_cast<int>(P) : CHUNK; }
  int64_t first_key(int64_t pos) const { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }
  // key `key` of sequence `seq`, KV head `kvh`, in `kv` (the K or the V store)
  const T* at(const T* kv, int64_t seq, int64_t kvh, int64_t key) const {
    const int64_t page = tables[seq * B + key / P];
    if (rows) return kv + (rows[page * P + key % P] * Hkv + kvh) * D;
    return kv + ((page * Hkv + kvh) * P + key % P) * D;
  }
  // keys key0 .. key0 + n - 1 (n <= CHUNK, in one page): D apart in a page, anywhere as rows
  void keys(const T* kv, int64_t seq, int64_t kvh, int64_t key0, int n, const T** out) const {
    const T* first = at(kv, seq, kvh, key0);
    for (int j = 0; j < n; ++j) out[j] = rows ? at(kv, seq, kvh, key0 + j) : first + j * D;
  }
};

// s[j] = scale * (q . k[j]) for j < n (n <= CHUNK keys).
template <class T>
inline void chunk_scores(const Attention<T>& a, const float* q, const T* const* k, int n, float* s) {
  Lanes acc[CHUNK];
  for (int j = 0; j < n; ++j) {
    lanes_zero(acc[j]);
    lanes_dot(q, k[j], a.D, acc[j]);
  }
  reduce_many(acc, n, s);
  for (int j = 0; j < n; ++j) s[j] = s[j] * a.scale;
  for (int j = n; j < CHUNK; ++j) s[j] = -INFINITY;  // no key: its exp is 0
}

// p[j] = exp(s[j] - shift) for j < CHUNK (s padded to CHUNK entries)
inline void chunk_exp(const float* s, float shift, float* p) {
  for (int i = 0; i < CHUNK; i += W) vstore(p + i, vexp_nonpositive(vsub(vload(s + i), vbroadcast(shift))));
}

inline float exp1(float x) {
  alignas(64) float out[W];
  vstore(out, vexp_nonpositive(vbroadcast(x)));
  return out[0];
}

// acc[d] = fma(w_j, rows_j[d], ... fma(w_0, rows_0[d], acc[d] * c)) for d < D (c = 1: no product, the same bits).
template <class T>
inline void accumulate(float* acc, float c, const float* w, const T* const* rows, int n, int64_t D) {
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    V x = vload(acc + d);
    if (c != 1.0f) x = vmul(x, vbroadcast(c));
    for (int j = 0; j < n; ++j) x = vfma(vbroadcast(w[j]), vload16(rows[j] + d), x);
    vstore(acc + d, x);
  }
  for (; d < D; ++d) {
    float x = acc[d];
    if (c != 1.0f) x = x * c;
    for (int j = 0; j < n; ++j) x = fmaf(w[j], to_float(rows[j][d]), x);
    acc[d] = x;
  }
}

// The visible keys [lo, hi] of the chunk starting at key0, for a row at `pos` seeing keys from `first`.
struct Span {
  int64_t lo, hi;
  int n() const { return static_cast<int>(hi - lo + 1); }
};
inline Span visible(int64_t key0, int chunk, int64_t first, int64_t pos) {
  return {key0 > first ? key0 : first, key0 + chunk - 1 < pos ? key0 + chunk - 1 : pos};
}

template <class T>
void forward_row(const Attention<T>& a, int64_t t, int64_t h, float* out, float* lse) {
  const int64_t pos = a.positions[t], seq = a.seqs[t], kvh = h / a.group(), first = a.first_key(pos);
  const float* q = a.q + (t * a.H + h) * a.D;
  const int chunk = a.chunk();
  alignas(64) float acc[MAX_HEAD_DIM];
  memset(acc, 0, sizeof(float) * a.D);
  float m = -INFINITY, l = 0.0f;
  for (int64_t key0 = first / chunk * chunk; key0 <= pos; key0 += chunk) {
    const Span span = visible(key0, chunk, first, pos);
    alignas(64) float s[CHUNK], p[CHUNK];
    const T* rows[CHUNK];
    a.keys(a.k, seq, kvh, span.lo, span.n(), rows);
    chunk_scores(a, q, rows, span.n(), s);
    float chunk_max = s[0];
    for (int j = 1; j < span.n(); ++j) chunk_max = s[j] > chunk_max ? s[j] : chunk_max;
    const float m_new = m > chunk_max ? m : chunk_max;
    const float c = exp1(m - m_new);
    chunk_exp(s, m_new, p);
    l = l * c;
    for (int j = 0; j < span.n(); ++j) l = l + p[j];
    a.keys(a.v, seq, kvh, span.lo, span.n(), rows);
    accumulate(acc, c, p, rows, span.n(), a.D);
    m = m_new;
  }
  float* o = out + (t * a.H + h) * a.D;
  for (int64_t d = 0; d < a.D; ++d) o[d] = acc[d] / l;
  if (lse) lse[t * a.H + h] = m + logf(l);
}

// Multiply-adds of the rows' scores and weighted values (for `worth_threads`).
template <class T>
int64_t work(const Attention<T>& a) {
  int64_t keys = 0;
  for (int64_t t = 0; t < a.N; ++t) keys += a.positions[t] - a.first_key(a.positions[t]) + 1;
  return 2 * keys * a.H * a.D;
}

template <class T>
void forward(const Attention<T>& a, float* out, float* lse, int threads) {
  const int64_t rows = a.N * a.H;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) if (worth_threads(threads, rows, work(a)))
  for (int64_t r = 0; r < rows; ++r) forward_row(a, r / a.H, r % a.H, out, lse);
}

inline float dot1(const float* x, const float* y, int64_t n) {
  Lanes s;
  lanes_zero(s);
  lanes_dot(x, y, n, s);
  return reduce(s);
}

// A chunk's recomputed probabilities and score gradients for row (t, h): p[j], ds[j] for its visible span.
template <class T>
inline void chunk_grads(const Attention<T>& a, const float* q, const float* dout, float lse, float delta,
                        int64_t seq, int64_t kvh, const Span& span, float* p, float* ds) {
  alignas(64) float s[CHUNK], dp[CHUNK];
  const T* rows[CHUNK];
  a.keys(a.k, seq, kvh, span.lo, span.n(), rows);
  chunk_scores(a, q, rows, span.n(), s);
  chunk_exp(s, lse, p);
  a.keys(a.v, seq, kvh, span.lo, span.n(), rows);
  Lanes acc[CHUNK];
  for (int j = 0; j < span.n(); ++j) {
    lanes_zero(acc[j]);
    lanes_dot(dout, rows[j], a.D, acc[j]);
  }
  reduce_many(acc, span.n(), dp);
  for (int j = 0; j < span.n(); ++j) ds[j] = p[j] * (dp[j] - delta) * a.scale;
}

template <class T>
void backward(const Attention<T>& a, int64_t S, const int64_t* query_starts, int64_t num_pages,
              const int64_t* grad_rows, const float* out, const float* lse, const float* dout, float* dq, float* dk,
              float* dv, int threads) {
  const int64_t rows = a.N * a.H;
  const int chunk = a.chunk();
  std::vector<float> delta(rows);
  const int64_t total = 2 * work(a);  // each half recomputes the scores and forms its own gradients
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) if (worth_threads(threads, rows, total))
  for (int64_t r = 0; r < rows; ++r) {  // dq and delta, row by row
    const int64_t t = r / a.H, h = r % a.H, pos = a.positions[t], seq = a.seqs[t], first = a.first_key(pos);
    const float *q = a.q + r * a.D, *g = dout + r * a.D;
    delta[r] = dot1(g, out + r * a.D, a.D);
    float* grad = dq + r * a.D;
    memset(grad, 0, sizeof(float) * a.D);
    for (int64_t key0 = first / chunk * chunk; key0 <= pos; key0 += chunk) {
      const Span span = visible(key0, chunk, first, pos);
      alignas(64) float p[CHUNK], ds[CHUNK];
      chunk_grads(a, q, g, lse[r], delta[r], seq, h / a.group(), span, p, ds);
      const T* keys[CHUNK];
      a.keys(a.k, seq, h / a.group(), span.lo, span.n(), keys);
      accumulate(grad, 1.0f, ds, keys, span.n(), a.D);
    }
  }
  // the (sequence, block) pairs reading each page, sequences ascending
  std::vector<std::vector<std::pair<int64_t, int64_t>>> readers(num_pages);
  for (int64_t seq = 0; seq < S; ++seq) {
    if (query_starts[seq + 1] <= query_starts[seq]) continue;
    const int64_t blocks = a.positions[query_starts[seq + 1] - 1] / a.P + 1;
    for (int64_t b = 0; b < blocks; ++b) readers[a.tables[seq * a.B + b]].push_back({seq, b});
  }
  const int64_t tasks = num_pages * a.Hkv, G = a.group();
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (worth_threads(threads, tasks, total))
  for (int64_t task = 0; task < tasks; ++task) {  // dk and dv, (page, KV head) by (page, KV head)
    const int64_t page = task / a.Hkv, kvh = task % a.Hkv;
    auto slot = [&](float* grads, int64_t offset) {  // the gradient of slot (page, offset), KV head kvh
      if (a.rows) return grads + (grad_rows[page * a.P + offset] * a.Hkv + kvh) * a.D;
      return grads + ((page * a.Hkv + kvh) * a.P + offset) * a.D;
    };
    for (const auto& [seq, block] : readers[page]) {
      for (int64_t t = query_starts[seq]; t < query_starts[seq + 1]; ++t) {
        const int64_t pos = a.positions[t], first = a.first_key(pos);
        if (pos < block * a.P || first > block * a.P + a.P - 1) continue;  // sees no key of the block
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
          const int64_t r = t * a.H + h;
          const float *q = a.q + r * a.D, *g = dout + r * a.D;
          for (int64_t key0 = block * a.P; key0 < (block + 1) * a.P && key0 <= pos; key0 += chunk) {
            if (key0 + chunk - 1 < first) continue;
            const Span span = visible(key0, chunk, first, pos);
            alignas(64) float p[CHUNK], ds[CHUNK];
            chunk_grads(a, q, g, lse[r], delta[r], seq, kvh, span, p, ds);
            const int64_t j0 = span.lo % a.P;
            for (int j = 0; j < span.n(); ++j) {
              accumulate(slot(dv, j0 + j), 1.0f, p + j, &g, 1, a.D);
              accumulate(slot(dk, j0 + j), 1.0f, ds + j, &q, 1, a.D);
            }
          }
        }
      }
    }
  }
}

template <class T>
Attention<T> make(const float* q, const T* k, const T* v, int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t P,
                  const int64_t* positions, const int64_t* seqs, const int64_t* tables, int64_t B, float scale,
                  int64_t window, const int64_t* rows) {
  return {q, k, v, N, H, Hkv, D, P, positions, seqs, tables, B, scale, window, rows};
}

}  // namespace

#define MILES_ATTENTION(suffix, T)                                                                                 \
  extern "C" void MILES_EXPORT(miles_attention_fwd_##suffix)(                                                     \
      const float* q, const T* k, const T* v, int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t P,              \
      const int64_t* positions, const int64_t* seqs, const int64_t* tables, int64_t B, float scale, int64_t window, \
      const int64_t* rows, float* out, float* lse, int threads) {                                                   \
    forward(make(q, k, v, N, H, Hkv, D, P, positions, seqs, tables, B, scale, window, rows), out, lse, threads);    \
  }                                                                                                                 \
  extern "C" void MILES_EXPORT(miles_attention_bwd_##suffix)(                                                     \
      const float* q, const T* k, const T* v, int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t P,              \
      const int64_t* positions, const int64_t* seqs, const int64_t* tables, int64_t B, float scale, int64_t window, \
      const int64_t* rows, int64_t S, const int64_t* query_starts, int64_t num_pages, const int64_t* grad_rows,     \
      const float* out, const float* lse, const float* dout, float* dq, float* dk, float* dv, int threads) {        \
    backward(make(q, k, v, N, H, Hkv, D, P, positions, seqs, tables, B, scale, window, rows), S, query_starts,    \
             num_pages, grad_rows, out, lse, dout, dq, dk, dv, threads);                                            \
  }

MILES_ATTENTION(f32, float)
MILES_ATTENTION(bf16, uint16_t)
