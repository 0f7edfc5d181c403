// The sampler's noise uniforms (miles_kernels/ops/sampling.py): for each row (seed, position) and token id t,
//     key = splitmix64(splitmix64(seed) ^ position),  bits = splitmix64(key ^ t),
//     u = ((bits >> 11) + 0.5) * 2^-53                (float64 in (0, 1), exact)
// Integer arithmetic modulo 2^64 and one exact conversion: the same bits as the torch ops that compute it, on any
// thread count. Compiled once (no vector code to dispatch).
#include <cstdint>
#include <vector>

namespace {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr double kUnit = 1.0 / 9007199254740992.0;  // 2^-53
constexpr int64_t kMinParallel = 1 << 15;            // uniforms below which one thread does the call

}  // namespace

// seeds, positions: the rows' 64-bit patterns (int64); out: (rows, vocab) float64, row-major.
extern "C" void miles_gumbel_uniforms(const int64_t* seeds, const int64_t* positions, int64_t rows, int64_t vocab,
                                      double* out, int threads) {
  std::vector<uint64_t> keys(rows);
  for (int64_t r = 0; r < rows; ++r) {
    keys[r] = splitmix64(splitmix64(static_cast<uint64_t>(seeds[r])) ^ static_cast<uint64_t>(positions[r]));
  }
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if (threads > 1 && rows * vocab >= kMinParallel)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < vocab; ++t) {
      const uint64_t bits = splitmix64(keys[r] ^ static_cast<uint64_t>(t)) >> 11;
      out[r * vocab + t] = (static_cast<double>(bits) + 0.5) * kUnit;
    }
  }
}
