// FP8 (e4m3) weights with a float32 scale per row and block of B inputs, times few rows of bf16 x (decode), on CPUs
// with AVX2 + FMA: Qwen's FP8 checkpoints (nanoqwen/quantization/fp8.py).
//
//   fp8_gemv(x [M,K] bf16, w [N,K] float8_e4m3fn, scale [N,K/B] float32) -> y [M,N] bf16,
//       y[m, n] = sum_b scale[n, b] * (sum_{k in block b} x[m, k] * w[n, k])
//
// Each weight is widened to float32 as it is read (no dequantised copy), through the float16 conversion: an e4m3
// byte's bits moved into a float16's give its value / 256 exactly (cpu_kernels.h load8_e4m3_div256), and the 256
// goes into the block's scale. A tile multiplies R weight rows by T rows of x at once, each of the T * R products
// its own vector accumulator (independent FMA chains: one chain per output waits on each FMA's latency), 16 lanes
// with AVX-512 and 8 with AVX2. At the end of a block each accumulator's lanes are scaled by the block's scale into
// a running vector total, and each total's lanes are summed and rounded to bf16 once at the end: the same function as
// fp8_gemv_reference (ops/cpu/kernels.py), the products' sums in another order (tests/ops/cpu/test_kernels.py).
// Threads split the weight rows.

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

constexpr int kTileRows = 4;  // rows of x a tile takes at most
constexpr int64_t kChunkBytes = 64 << 10;  // weights a thread multiplies by every row of x before the next ones

inline float e4m3_to_float(uint8_t v) {
  const uint32_t e = (v >> 3) & 0xF, m = v & 7;
  const float magnitude = e == 0 ? static_cast<float>(m) * (1.0f / 512.0f)
                                 : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, static_cast<int>(e) - 7);
  return v & 0x80 ? -magnitude : magnitude;
}

// The vector a tile computes with: its lanes, and the operations the kernel needs.
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kProducts = 8;  // accumulators a tile (and as many running totals): 16 of the 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V weights(const uint8_t* p) { return load16_e4m3_div256(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(NANOQWEN_AVX2)
struct Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kProducts = 4;  // accumulators a tile (and as many totals): 8 of the 16 registers
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V weights(const uint8_t* p) { return load8_e4m3_div256(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) { return hsum(v); }
};
#endif

// y[m0 + t, n + r] for t < T, r < R: weight rows n .. n + R - 1 (w: row n's K bytes; s: row n's `blocks` scales)
// times x rows m0 .. m0 + T - 1 (xf: x in float32 [M, K]).
template <int T, int R>
void fp8_tile(const float* xf, int64_t K, int64_t B, int64_t blocks, int64_t m0, const uint8_t* w, const float* s,
              int64_t N, int64_t n, at::BFloat16* y) {
  float rest[T][R] = {};  // the positions past the last whole vector of a block, and every position without AVX2
#ifdef NANOQWEN_AVX2
  using V = Lanes::V;
  constexpr int L = Lanes::kWidth;
  V total[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) total[t][r] = Lanes::zero();
#else
  constexpr int L = 1 << 30;  // (no vectors)
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * B, last = std::min(K, first + B);
    int64_t k = first;
#ifdef NANOQWEN_AVX2
    V acc[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) acc[t][r] = Lanes::zero();
    for (; k + L <= last; k += L) {
      V wv[R];
      for (int r = 0; r < R; ++r) wv[r] = Lanes::weights(w + r * K + k);
      for (int t = 0; t < T; ++t) {
        const V xv = Lanes::load(xf + (m0 + t) * K + k);
        for (int r = 0; r < R; ++r) acc[t][r] = Lanes::fma(wv[r], xv, acc[t][r]);
      }
    }
    for (int r = 0; r < R; ++r) {  // (the 256 the weights were divided by, in the scale)
      const V scale = Lanes::set1(s[r * blocks + b] * 256.0f);
      for (int t = 0; t < T; ++t) total[t][r] = Lanes::fma(acc[t][r], scale, total[t][r]);
    }
#endif
    if (k < last)
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) {
          float part = 0.0f;
          for (int64_t j = k; j < last; ++j) part = std::fma(e4m3_to_float(w[r * K + j]), xf[(m0 + t) * K + j], part);
          rest[t][r] = std::fma(part, s[r * blocks + b], rest[t][r]);
        }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
#ifdef NANOQWEN_AVX2
      rest[t][r] += Lanes::sum(total[t][r]);
#endif
      y[(m0 + t) * N + n + r] = at::BFloat16(rest[t][r]);  // one rounding, RNE
    }
}

#ifdef NANOQWEN_AVX2
constexpr int kProducts = Lanes::kProducts;
#else
constexpr int kProducts = 4;
#endif

// Weight rows [begin, end) times x rows m0 .. m0 + T - 1: R = kProducts / T rows a tile, the last few one at a time.
template <int T>
void fp8_rows(const float* xf, int64_t K, int64_t B, int64_t blocks, int64_t m0, const uint8_t* w, const float* s,
              int64_t N, int64_t begin, int64_t end, at::BFloat16* y) {
  constexpr int R = std::max(1, kProducts / T);
  int64_t n = begin;
  for (; n + R <= end; n += R) fp8_tile<T, R>(xf, K, B, blocks, m0, w + n * K, s + n * blocks, N, n, y);
  for (; n < end; ++n) fp8_tile<T, 1>(xf, K, B, blocks, m0, w + n * K, s + n * blocks, N, n, y);
}

}  // namespace

at::Tensor fp8_gemv(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& scale_in) {
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu() && scale_in.device().is_cpu(),
              "x, w and scale must be CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(w_in.scalar_type() == at::kFloat8_e4m3fn, "w must be float8_e4m3fn, got ", w_in.scalar_type());
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat, "scale must be float32, got ", scale_in.scalar_type());
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && scale_in.dim() == 2, "x, w and scale must be 2-D");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  TORCH_CHECK(w_in.size(1) == K, "x has K=", K, " but w has K=", w_in.size(1));
  TORCH_CHECK(scale_in.size(0) == N && scale_in.size(1) > 0, "scale must be [N, K/B] with N=", N, ", got ",
              scale_in.sizes());
  const int64_t B = (K + scale_in.size(1) - 1) / scale_in.size(1);
  TORCH_CHECK((K + B - 1) / B == scale_in.size(1), "scale's ", scale_in.size(1), " blocks do not cover K=", K);
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), w = w_in.contiguous(), scale = scale_in.contiguous();
  at::Tensor y = new_output({M, N}, x_in.options().dtype(at::kBFloat16));
  if (M == 0 || N == 0) return y;
  const float* xf = x.data_ptr<float>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* sp = scale.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = scale.size(1);
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, K));
  const int64_t chunk = std::max<int64_t>(kProducts, kChunkBytes / K);  // weight rows all tiles of x take in turn
  parallel_rows(N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += chunk) {
      const int64_t n1 = std::min(end, n0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {  // (the chunk's weights read from L2 after the first tile)
        switch (std::min<int64_t>(kTileRows, M - m0)) {
          case 1: fp8_rows<1>(xf, K, B, blocks, m0, wp, sp, N, n0, n1, yp); break;
          case 2: fp8_rows<2>(xf, K, B, blocks, m0, wp, sp, N, n0, n1, yp); break;
          case 3: fp8_rows<3>(xf, K, B, blocks, m0, wp, sp, N, n0, n1, yp); break;
          default: fp8_rows<4>(xf, K, B, blocks, m0, wp, sp, N, n0, n1, yp); break;
        }
      }
    }
  });
  return y;
}

}  // namespace nanoqwen
