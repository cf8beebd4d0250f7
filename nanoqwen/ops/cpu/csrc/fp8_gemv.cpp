// FP8 (e4m3) weights with a float32 scale per row and block of B inputs, times few rows of bf16 x (decode), on CPUs
// with AVX2 + FMA: Qwen's FP8 checkpoints (nanoqwen/quantization/fp8.py).
//
//   fp8_gemv(x [M,K] bf16, w [N,K] float8_e4m3fn, scale [N,K/B] float32) -> y [M,N] bf16,
//       y[m, n] = sum_b scale[n, b] * (sum_{k in block b} x[m, k] * w[n, k])
//
// Each weight is widened to float32 as it is read (no dequantised copy): an e4m3 byte s eeee mmm is, for e > 0,
// (-1)^s 2^(e - 7) (1 + m / 8), whose float32 bits are s << 31 | (eeee mmm) << 20 plus 120 << 23 (the exponent bias
// moved from 7 to 127); for e = 0 (subnormal) (-1)^s m 2^-9. (e4m3 has no infinities; its one NaN pattern does not
// occur in a checkpoint's weights.) The products accumulate in float32 per block, each block's sum is scaled once,
// and each output is rounded to bf16 once: fp8_gemv_reference (ops/cpu/kernels.py) computes the same function up to
// the order of float32 additions. Threads split the weight rows.

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

constexpr int kTileFp8 = 4;  // rows of x per register tile

inline float e4m3_to_float(uint8_t v) {
  const uint32_t e = (v >> 3) & 0xF, m = v & 7;
  const float magnitude = e == 0 ? static_cast<float>(m) * (1.0f / 512.0f)
                                 : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, static_cast<int>(e) - 7);
  return v & 0x80 ? -magnitude : magnitude;
}

#ifdef NANOQWEN_AVX2
// 8 e4m3 bytes -> 8 float32 (exact).
inline __m256 load8_e4m3(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20),
                                        _mm256_set1_epi32(120 << 23));
  const __m256i mant = _mm256_and_si256(v, _mm256_set1_epi32(7));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mant), _mm256_set1_ps(1.0f / 512.0f));
  const __m256i is_sub = _mm256_cmpeq_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
  const __m256 magnitude = _mm256_blendv_ps(_mm256_castsi256_ps(bits), subnormal, _mm256_castsi256_ps(is_sub));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(magnitude, _mm256_castsi256_ps(sign));
}
#endif

// y[m0 .. m0 + T - 1, n] for weight row n (w: its K bytes, s: its K / B scales); xf: x in float32 [M, K].
template <int T>
void fp8_row_tile(const float* xf, int64_t K, int64_t B, int64_t m0, const uint8_t* w, const float* s, int64_t N,
                  int64_t n, at::BFloat16* y) {
  float total[T] = {};
  for (int64_t b = 0; b * B < K; ++b) {
    const int64_t first = b * B, last = std::min(K, first + B);
    float block[T] = {};
    int64_t k = first;
#ifdef NANOQWEN_AVX2
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    for (; k + 8 <= last; k += 8) {
      const __m256 wv = load8_e4m3(w + k);
      for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + (m0 + t) * K + k), acc[t]);
    }
    for (int t = 0; t < T; ++t) block[t] = hsum(acc[t]);
#endif
    for (; k < last; ++k)
      for (int t = 0; t < T; ++t) block[t] = std::fma(e4m3_to_float(w[k]), xf[(m0 + t) * K + k], block[t]);
    for (int t = 0; t < T; ++t) total[t] = std::fma(block[t], s[b], total[t]);
  }
  for (int t = 0; t < T; ++t) y[(m0 + t) * N + n] = at::BFloat16(total[t]);  // one rounding, RNE
}

template <int T = kTileFp8>
void fp8_row_tiles(int rows, const float* xf, int64_t K, int64_t B, int64_t m0, const uint8_t* w, const float* s,
                   int64_t N, int64_t n, at::BFloat16* y) {
  if constexpr (T > 1) {
    if (rows < T) return fp8_row_tiles<T - 1>(rows, xf, K, B, m0, w, s, N, n, y);
  }
  fp8_row_tile<T>(xf, K, B, m0, w, s, N, n, y);
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
  parallel_rows(N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += kTileFp8)
        fp8_row_tiles(static_cast<int>(std::min<int64_t>(kTileFp8, M - m0)), xf, K, B, m0, wp + n * K,
                      sp + n * blocks, N, n, yp);
  });
  return y;
}

}  // namespace nanoqwen
