// bf16 and int8 matrix-vector products for batch-1..16 decode on CPUs with AVX2 + FMA (no AVX-512 needed).
//
//   bf16_gemv(x [M,K] bf16, w [N,K] bf16, bias [N] bf16 or None) -> y [M,N] bf16,  y = x @ w.T + bias
//   int8_gemv(x [M,K] bf16, q [N,K] int8, scale [N] bf16)        -> y [M,N] bf16,  y = (x @ q.T) * scale
//
// With few rows of x, every weight element is used M times, so the product is bound by how fast the weights
// stream from memory. The kernels therefore read each weight row exactly once, use it for all M rows of x,
// and keep the rest cheap: x is converted to float32 once (it stays in L1/L2), each weight vector is widened
// to float32 in registers, products are accumulated in float32 with FMA, and each output is rounded to bf16
// once at the end (round-to-nearest-even, like torch's .to(torch.bfloat16)). On CPUs with AVX-512 BF16, bf16
// x and bf16 (or int8, converted in registers) weights go to vdpbf16ps as they are instead (exact products,
// float32 sums). The results equal the plain-torch references in nanoqwen/ops/cpu_gemv.py up to the order of
// the float32 additions.
//
// Threads split the output rows N into contiguous ranges (parallel_rows: most in equal shares, the rest in
// chunks to whichever thread is free); each thread streams a range of the weight matrix as three sequential
// streams (its thirds) for more requests in flight.
//
// Up to 16 rows of x are handled in one pass over the weights (more rows: passes of 16, each reading the
// weights again).

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

constexpr int kMaxRows = 16;                 // rows of x handled per pass over the weights
constexpr int kStreams = 3;                  // weight rows read at once (rows() below)
constexpr int kGroupRows = 4;                // rows of x per register block (rows() below)

// dots[r][m] = sum_k x[m, k] * w[r][k] for R weight rows w[r] (K elements each, bf16 or int8) and M rows of
// float32 x.
//
// The main loop consumes one 64-byte cache line of each weight row per step (V vectors of 8: bf16 4,
// int8 8), asks for the line kPrefetchBytes ahead, and uses every weight vector for all M rows of x.
// An FMA's result is ready only after ~4-5 cycles, so a single accumulator per output would make each step
// wait for the previous one. U accumulators per output (weight vector v goes to acc[r][m][v % U]) give
// R * M * U independent chains; R * M * U ~ 8 keeps both FMA units busy and fits the 16 AVX2 registers.
template <int M, int R, typename W>
inline void dot_rows(const float* x, int64_t K, const W* const* w, float (*dots)[M]) {
  int64_t k = 0;
#ifdef NANOQWEN_AVX2
  constexpr int V = 64 / (8 * sizeof(W));                 // 8-element vectors per cache line: bf16 4, int8 8
  constexpr int U = std::min(V, std::max(1, 8 / (R * M)));  // accumulators per output; divides V
  __m256 acc[R][M][U];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[r][m][u] = _mm256_setzero_ps();
  for (; k + 8 * V <= K; k += 8 * V) {
    for (int r = 0; r < R; ++r)  // a hint, harmless past the end of the weights (no fault)
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + kPrefetchBytes, _MM_HINT_T0);
    for (int v = 0; v < V; ++v)
      for (int r = 0; r < R; ++r) {
        __m256 wv = load8(w[r] + k + 8 * v);
        for (int m = 0; m < M; ++m)
          acc[r][m][v % U] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * v), wv, acc[r][m][v % U]);
      }
  }
  // Leftover whole vectors (K mod 8V >= 8) go to the first accumulator.
  for (; k + 8 <= K; k += 8)
    for (int r = 0; r < R; ++r) {
      __m256 wv = load8(w[r] + k);
      for (int m = 0; m < M; ++m)
        acc[r][m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[r][m][0]);
    }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      for (int u = 1; u < U; ++u) acc[r][m][0] = _mm256_add_ps(acc[r][m][0], acc[r][m][u]);
      dots[r][m] = hsum(acc[r][m][0]);
    }
#else
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) dots[r][m] = 0.0f;
#endif
  // Scalar tail (K mod 8 elements), or the whole rows without AVX2.
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      float wk = to_float(w[r][k]);
      for (int m = 0; m < M; ++m) dots[r][m] += x[m * K + k] * wk;
    }
}

#ifdef NANOQWEN_BF16_DOT
// dots[r][m] = sum_k x[m, k] * w[r][k] for bf16 x and bf16 or int8 weight rows, on CPUs with AVX-512 BF16:
// vdpbf16ps multiplies 16 bf16 pairs exactly and adds each pair's two products into one of 8 float32 lanes,
// so x stays bf16 (half the bytes of its float32 copy) and each weight vector is one instruction for one row
// of x: bf16 weights as they are, int8 ones converted to bf16 once (exact: |q| <= 128) for all M rows. The
// same R x M blocking as above, one accumulator per output: R * M = 12 chains for the usual 3 x 4.
inline __m256bh load16_bf16(const uint16_t* p) {
  return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256bh load16_bf16(const int8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtneps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
}

template <int M, int R, typename W>
inline void dot_rows(const uint16_t* x, int64_t K, const W* const* w, float (*dots)[M]) {
  constexpr int V = 64 / (16 * sizeof(W));  // 16-element vectors per 64-byte line: bf16 2, int8 4
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * V <= K; k += 16 * V) {  // one 64-byte line of each weight row
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + kPrefetchBytes, _MM_HINT_T0);
    for (int v = 0; v < V; ++v)
      for (int r = 0; r < R; ++r) {
        const __m256bh wv = load16_bf16(w[r] + k + 16 * v);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_dpbf16_ps(acc[r][m], load16_bf16(x + m * K + k + 16 * v), wv);
      }
  }
  for (; k + 16 <= K; k += 16)
    for (int r = 0; r < R; ++r) {
      const __m256bh wv = load16_bf16(w[r] + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_dpbf16_ps(acc[r][m], load16_bf16(x + m * K + k), wv);
    }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) dots[r][m] = hsum(acc[r][m]);
  for (; k < K; ++k)  // K mod 16 elements
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) dots[r][m] += bf16_to_float(x[m * K + k]) * to_float(w[r][k]);
}
#endif

// dots[r][m0 + m] = dot(x[m0 + m], w[r]) for the MG rows of x from m0 on (one group, below).
// noinline: compiled as its own function, GCC keeps the accumulators in registers; inlined into the
// dispatching code with the other group sizes, it spilled them to the stack (several times slower).
template <int MG, int R, typename W, typename X>
__attribute__((noinline)) void dot_group(const X* x, int64_t K, const W* const* w, int m0,
                                         float (*dots)[kMaxRows]) {
  float d[R][MG];
  dot_rows<MG, R>(x + m0 * K, K, w, d);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MG; ++m) dots[r][m0 + m] = d[r][m];
}

// y[m, n] = dot(x[m], w[n]) * scale[n] + bias[n] for the m_rows (<= kMaxRows) rows of x and n in [begin, end);
// scale, bias may be null.
//
// kStreams weight rows at a time, one from each kStreams-th of the range: independent sequential streams keep
// more memory requests in flight than one (measured: clearly faster at M = 1 and 2 than one stream, whose
// speed stayed below a plain sum's). The rows of x go in near-equal groups of at most kGroupRows; a group's
// kStreams * kGroupRows = 12 accumulators, the 3 widened weight vectors and one x vector fill the 16 AVX2
// registers, and every x vector loaded serves 3 weight rows. The weight rows stay in L1 across the groups, so
// memory sees them once; x (M * K floats) comes from L2 (keeping it in L1 instead, by blocking weight rows
// in L2, measured no faster). Of the blockings measured (weight rows x rows of x: 2 x 6, 3 x 3, 3 x 4, 4 x 2,
// 4 x 3), 3 x 4 was the fastest: 1.14-1.72x the previous 1 x 8 at 8 and 16 rows (BENCHMARKS.md), 60-71% of
// the FMA peak at 16.
template <typename W, typename X>
void rows(int m_rows, const X* x, const W* w, const uint16_t* scale, const uint16_t* bias, int64_t K,
          int64_t N, int64_t begin, int64_t end, at::BFloat16* y) {
  // rows of x per register block: 4 (12 accumulators of the 16 AVX2 registers), 8 with AVX-512 BF16's
  // bf16 x (24 accumulators of the 32 AVX-512 vector registers; an int8 weight vector is converted once
  // for twice the rows)
  constexpr int GR = std::is_same_v<X, uint16_t> ? 2 * kGroupRows : kGroupRows;
  static_assert(kGroupRows == 4, "dot_all's switch below dispatches group sizes 1 to 8");
  float dots[kStreams][kMaxRows];
  const int groups = (m_rows + GR - 1) / GR;
  // dots for R weight rows against every group of x rows.
  auto dot_all = [&](auto r_count, const W* const* wr) {
    constexpr int R = decltype(r_count)::value;
    for (int g = 0, m0 = 0; g < groups; ++g) {
      const int mg = (m_rows - m0) / (groups - g);  // near-equal groups: 6 rows -> 3 + 3, 13 -> 3 + 3 + 3 + 4
      switch (mg) {
        case 1: dot_group<1, R>(x, K, wr, m0, dots); break;
        case 2: dot_group<2, R>(x, K, wr, m0, dots); break;
        case 3: dot_group<3, R>(x, K, wr, m0, dots); break;
        case 4: dot_group<4, R>(x, K, wr, m0, dots); break;
        case 5: dot_group<std::min(5, GR), R>(x, K, wr, m0, dots); break;
        case 6: dot_group<std::min(6, GR), R>(x, K, wr, m0, dots); break;
        case 7: dot_group<std::min(7, GR), R>(x, K, wr, m0, dots); break;
        default: dot_group<GR, R>(x, K, wr, m0, dots); break;
      }
      m0 += mg;
    }
  };
  auto store = [&](int64_t n, const float* d) {
    float s = scale ? bf16_to_float(scale[n]) : 1.0f;
    float b = bias ? bf16_to_float(bias[n]) : 0.0f;
    for (int m = 0; m < m_rows; ++m) y[m * N + n] = at::BFloat16(d[m] * s + b);  // one rounding, RNE
  };
  const int64_t part = (end - begin) / kStreams;  // rows per stream
  for (int64_t i = 0; i < part; ++i) {
    const W* wr[kStreams];
    for (int r = 0; r < kStreams; ++r) wr[r] = w + (begin + r * part + i) * K;
    dot_all(std::integral_constant<int, kStreams>{}, wr);
    for (int r = 0; r < kStreams; ++r) store(begin + r * part + i, dots[r]);
  }
  for (int64_t n = begin + kStreams * part; n < end; ++n) {  // rows left over when kStreams does not divide
    const W* wr[1] = {w + n * K};
    dot_all(std::integral_constant<int, 1>{}, wr);
    store(n, dots[0]);
  }
}

// Shared driver: checks, converts x to float32 once (not for AVX-512 BF16), runs passes of <= 16 rows over threads.
template <typename W>
at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& w_in, at::ScalarType w_type, const char* w_name,
                const std::optional<at::Tensor>& scale_in, const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "x and ", w_name, " must be CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(w_in.scalar_type() == w_type, w_name, " must be ", w_type, ", got ", w_in.scalar_type());
  TORCH_CHECK(x_in.dim() == 2, "x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(w_in.dim() == 2, w_name, " must be 2-D [N, K], got ", w_in.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  TORCH_CHECK(w_in.size(1) == K, "x has K=", K, " but ", w_name, " has K=", w_in.size(1));

  // Non-contiguous inputs are copied (correct, but a copy of the weight costs a full extra pass).
  at::Tensor x = x_in.contiguous();
  at::Tensor w = w_in.contiguous();
  at::Tensor scale, bias;
  if (scale_in) { check_vector(*scale_in, "scale", N); scale = scale_in->contiguous(); }
  if (bias_in) { check_vector(*bias_in, "bias", N); bias = bias_in->contiguous(); }
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(at::kBFloat16));
  if (M == 0 || N == 0) return y;

  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const W* wp = reinterpret_cast<const W*>(w.data_ptr());
  const uint16_t* sp = scale.defined() ? reinterpret_cast<const uint16_t*>(scale.data_ptr()) : nullptr;
  const uint16_t* bp = bias.defined() ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // Enough rows per task that it reads kTaskBytes of weights: small matrices stay on one thread.
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, K * int64_t(sizeof(W))));

  auto passes = [&](const auto* xp) {  // passes of kMaxRows rows of x over the weights
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int m_rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      parallel_rows(N, grain, [&](int64_t begin, int64_t end) {
        rows<W>(m_rows, xp + m0 * K, wp, sp, bp, K, N, begin, end, yp + m0 * N);
      });
    }
  };
#ifdef NANOQWEN_BF16_DOT
  passes(xb);  // bf16 x as it is
#else
  // x in float32, once (a plain buffer: cheaper than a torch tensor for these few KB).
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(xb[i]);
  passes(static_cast<const float*>(xf.data()));
#endif
  return y;
}

}  // namespace

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return gemv<uint16_t>(x, w, at::kBFloat16, "w", std::nullopt, bias);
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return gemv<int8_t>(x, q, at::kChar, "q", scale, std::nullopt);
}

}  // namespace nanoqwen
