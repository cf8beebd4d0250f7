// bf16 and int8 matrix-vector products for batch-1..16 decode on CPUs with AVX2 + FMA (no AVX-512 needed).
//
//   bf16_gemv(x [M,K] bf16, w [N,K] bf16, bias [N] bf16 or None) -> y [M,N] bf16,  y = x @ w.T + bias
//   int8_gemv(x [M,K] bf16, q [N,K] int8, scale [N] bf16)        -> y [M,N] bf16,  y = (x' @ q.T) * scale,
//             x' = x quantised to int16 in blocks of kXBlock (below)
//
// With few rows of x, every weight element is used M times, so the product is bound by how fast the weights
// stream from memory. The kernels therefore read each weight row exactly once, use it for all M rows of x,
// and keep the rest cheap. bf16: x is converted to float32 once (it stays in L1/L2), each weight vector is
// widened to float32 in registers and products are accumulated in float32 with FMA; on CPUs with AVX-512 BF16,
// bf16 x and weights go to vdpbf16ps as they are instead (exact products, float32 sums). int8: integer dot
// products of the int8 weights with x quantised to int16 (below). Each output is rounded to bf16 once at the
// end (round-to-nearest-even, like torch's .to(torch.bfloat16)). The results equal the plain-torch references
// in nanoqwen/ops/cpu/kernels.py up to the order of the float32 additions.
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

// dots[r][m] = sum_k x[m, k] * w[r][k] for R bf16 weight rows w[r] (K elements each) and M rows of float32 x.
//
// The main loop consumes one 64-byte cache line of each weight row per step (4 vectors of 8), asks for the
// line kRowPrefetchBytes ahead, and uses every weight vector for all M rows of x.
// An FMA's result is ready only after ~4-5 cycles, so a single accumulator per output would make each step
// wait for the previous one. U accumulators per output (weight vector v goes to acc[r][m][v % U]) give
// R * M * U independent chains; R * M * U ~ 8 keeps both FMA units busy and fits the 16 AVX2 registers.
template <int M, int R>
inline void dot_rows(const float* x, int64_t K, const uint16_t* const* w, float (*dots)[M]) {
  int64_t k = 0;
#ifdef NANOQWEN_AVX2
  constexpr int V = 4;                                    // 8-element vectors per 64-byte cache line
  constexpr int U = std::min(V, std::max(1, 8 / (R * M)));  // accumulators per output; divides V
  __m256 acc[R][M][U];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[r][m][u] = _mm256_setzero_ps();
  for (; k + 8 * V <= K; k += 8 * V) {
    for (int r = 0; r < R; ++r)  // a hint, harmless past the end of the weights (no fault)
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + kRowPrefetchBytes, _MM_HINT_T0);
    for (int v = 0; v < V; ++v)
      for (int r = 0; r < R; ++r) {
        __m256 wv = load8_bf16(w[r] + k + 8 * v);
        for (int m = 0; m < M; ++m)
          acc[r][m][v % U] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * v), wv, acc[r][m][v % U]);
      }
  }
  // Leftover whole vectors (K mod 8V >= 8) go to the first accumulator.
  for (; k + 8 <= K; k += 8)
    for (int r = 0; r < R; ++r) {
      __m256 wv = load8_bf16(w[r] + k);
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
      float wk = bf16_to_float(w[r][k]);
      for (int m = 0; m < M; ++m) dots[r][m] += x[m * K + k] * wk;
    }
}

#ifdef NANOQWEN_BF16_DOT
// dots[r][m] = sum_k x[m, k] * w[r][k] for bf16 x and bf16 weight rows, on CPUs with AVX-512 BF16:
// vdpbf16ps multiplies 16 bf16 pairs exactly and adds each pair's two products into one of 8 float32 lanes,
// so x stays bf16 (half the bytes of its float32 copy) and each weight vector is one instruction for one row
// of x. The same R x M blocking as above, one accumulator per output: R * M = 24 chains for 3 x 8.
inline __m256bh load16_bf16(const uint16_t* p) {
  return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <int M, int R>
inline void dot_rows(const uint16_t* x, int64_t K, const uint16_t* const* w, float (*dots)[M]) {
  constexpr int V = 2;  // 16-element vectors per 64-byte line
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * V <= K; k += 16 * V) {  // one 64-byte line of each weight row
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + kRowPrefetchBytes, _MM_HINT_T0);
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
      for (int m = 0; m < M; ++m) dots[r][m] += bf16_to_float(x[m * K + k]) * bf16_to_float(w[r][k]);
}
#endif

// ---- int8 weights: integer dot products with x quantised to int16.
//
// Widening each int8 weight to float32 for an FMA (or to bf16 for vdpbf16ps) costs 2-3 instructions per 8-16
// weights, which keeps int8_gemv below the read bandwidth at batch 1 (bench/bench_gemv.py measures it).
// Instead x is quantised once per call to int16 in blocks of kXBlock elements (symmetric, one float32 scale per block:
// d = max|x| / 32767, xq = round(x / d), half to even), and each block's dot product sum_k q[k] * xq[k] is an
// integer one: 16 weights sign-extended to int16 in one instruction, multiplied with 16 xq and summed in
// pairs into 8 int32 lanes in one more (vpdpwssd with AVX-512 VNNI; vpmaddwd and an add without). At block
// end the int32 sums go to float32, times d. A block's sum is at most 64 * 128 * 32767 < 2^31. The rounding
// of x is at most 2^-16 of its block's largest element (a 256th of that element's bf16 step; smaller elements
// keep fewer bits): int8_gemv_reference computes with that x' = d * xq.
constexpr int64_t kXBlock = 64;

// x quantised for int8_gemv: xq [M, K] int16, d [M, blocks] float32, blocks = ceil(K / kXBlock) (the last
// block shorter when kXBlock does not divide K).
struct Int16X {
  std::vector<int16_t> xq;
  std::vector<float> d;
  int64_t blocks;
};

// Rows m0.. of an Int16X (what one register block of rows reads: rows_from below).
struct Int16Rows {
  const int16_t* xq;
  const float* d;
  int64_t blocks;
};

Int16X quantize_x_int16(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t blocks = (K + kXBlock - 1) / kXBlock;
  Int16X out{std::vector<int16_t>(M * K), std::vector<float>(M * blocks), blocks};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = b * kXBlock, n = std::min(K, first + kXBlock) - first;
      const uint16_t* xb = x + m * K + first;
      int16_t* qb = out.xq.data() + m * K + first;
      const float d = absmax_bf16(xb, n) / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
      int64_t k = 0;
#ifdef NANOQWEN_AVX2
      const __m256 inv8 = _mm256_set1_ps(inv);
      for (; k + 8 <= n; k += 8) {  // cvtps rounds half to even (the default rounding mode), as nearbyint does
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8_bf16(xb + k), inv8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + k),  // |v| <= 32767: packs is exact
                         _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
      }
#endif
      for (; k < n; ++k) qb[k] = static_cast<int16_t>(std::nearbyint(bf16_to_float(xb[k]) * inv));
      out.d[m * blocks + b] = d;
    }
  return out;
}


// dots[r][m] = sum_b d[m, b] * (sum_{k in b} q[r][k] * xq[m, k]) for R int8 weight rows and M rows of an
// Int16X: one int32 accumulator per output for a block's 4 vectors, then one conversion and FMA per block.
template <int M, int R>
inline void dot_rows(const Int16Rows& x, int64_t K, const int8_t* const* w, float (*dots)[M]) {
  int64_t k = 0, b = 0;
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) dots[r][m] = 0.0f;
#ifdef NANOQWEN_AVX2
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  for (; k + kXBlock <= K; k += kXBlock, ++b) {  // one 64-byte line of each weight row
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + kRowPrefetchBytes, _MM_HINT_T0);
    __m256i isum[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) isum[r][m] = _mm256_setzero_si256();
    for (int v = 0; v < kXBlock / 16; ++v)
      for (int r = 0; r < R; ++r) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + k + 16 * v));
        const __m256i wv = _mm256_cvtepi8_epi16(q);
        for (int m = 0; m < M; ++m) {
          const int16_t* xm = x.xq + m * K + k + 16 * v;
          isum[r][m] = dot16_int16(isum[r][m], wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm)));
        }
      }
    for (int m = 0; m < M; ++m) {
      const __m256 d = _mm256_set1_ps(x.d[m * x.blocks + b]);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][m]), d, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) dots[r][m] = hsum(acc[r][m]);
#endif
  for (; k < K; k += kXBlock, ++b) {  // a last, shorter block (or every block without AVX2)
    const int64_t end = std::min(K, k + kXBlock);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        int32_t sum = 0;
        for (int64_t j = k; j < end; ++j) sum += int32_t(x.xq[m * K + j]) * int32_t(w[r][j]);
        dots[r][m] += x.d[m * x.blocks + b] * static_cast<float>(sum);
      }
  }
}

// Rows m0.. of x as dot_rows takes them.
inline const float* rows_from(const float* x, int64_t m0, int64_t K) { return x + m0 * K; }
inline const uint16_t* rows_from(const uint16_t* x, int64_t m0, int64_t K) { return x + m0 * K; }
inline Int16Rows rows_from(const Int16X* x, int64_t m0, int64_t K) {
  return {x->xq.data() + m0 * K, x->d.data() + m0 * x->blocks, x->blocks};
}

// Rows of x per register block: float32 x with AVX2 4 (12 accumulators of the 16 registers); bf16 x with
// AVX-512 BF16 8 (24 of the 32 AVX-512 vector registers); int16 x: a float32 and an int32 accumulator per
// output, 4 with AVX-512's 32 registers, else 2.
template <typename X>
constexpr int group_rows() {
  if constexpr (std::is_same_v<X, uint16_t>) return 2 * kGroupRows;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<X, Int16X>) return kGroupRows;
#else
  if constexpr (std::is_same_v<X, Int16X>) return kGroupRows / 2;
#endif
  return kGroupRows;
}

// dots[r][m] = dot(x[first + m], w[r]) for the MG rows of x from row first + m0 on (one group, below).
// noinline: compiled as its own function, GCC keeps the accumulators in registers; inlined into the
// dispatching code with the other group sizes, it spilled them to the stack (several times slower).
template <int MG, int R, typename W, typename X>
__attribute__((noinline)) void dot_group(const X* x, int64_t first, int64_t K, const W* const* w, int m0,
                                         float (*dots)[kMaxRows]) {
  float d[R][MG];
  dot_rows<MG, R>(rows_from(x, first + m0, K), K, w, d);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MG; ++m) dots[r][m0 + m] = d[r][m];
}

// y[m, n] = dot(x[first + m], w[n]) * scale[n] + bias[n] for the m_rows (<= kMaxRows) rows of x from row
// first and n in [begin, end); scale, bias may be null.
//
// kStreams weight rows at a time, one from each kStreams-th of the range: independent sequential streams keep
// more memory requests in flight than one (measured: clearly faster at M = 1 and 2 than one stream, whose
// speed stayed below a plain sum's). The rows of x go in near-equal groups of at most kGroupRows; a group's
// kStreams * kGroupRows = 12 accumulators, the 3 widened weight vectors and one x vector fill the 16 AVX2
// registers, and every x vector loaded serves 3 weight rows. The weight rows stay in L1 across the groups, so
// memory sees them once; x (M * K floats) comes from L2 (keeping it in L1 instead, by blocking weight rows
// in L2, measured no faster). Of the blockings measured (weight rows x rows of x: 2 x 6, 3 x 3, 3 x 4, 4 x 2,
// 4 x 3, 1 x 8), 3 x 4 was the fastest at 8 and 16 rows (bench/bench_gemv.py --rows 8 16 measures it; the
// figures are in docs/tried-and-not-kept.md).
template <typename W, typename X>
void rows(int m_rows, const X* x, int64_t first, const W* w, const uint16_t* scale, const uint16_t* bias,
          int64_t K, int64_t N, int64_t begin, int64_t end, at::BFloat16* y) {
  constexpr int GR = group_rows<X>();
  static_assert(kGroupRows == 4, "dot_all's switch below dispatches group sizes 1 to 8");
  float dots[kStreams][kMaxRows];
  const int groups = (m_rows + GR - 1) / GR;
  // dots for R weight rows against every group of x rows.
  auto dot_all = [&](auto r_count, const W* const* wr) {
    constexpr int R = decltype(r_count)::value;
    for (int g = 0, m0 = 0; g < groups; ++g) {
      const int mg = (m_rows - m0) / (groups - g);  // near-equal groups: 6 rows -> 3 + 3, 13 -> 3 + 3 + 3 + 4
      switch (mg) {
        case 1: dot_group<1, R>(x, first, K, wr, m0, dots); break;
        case 2: dot_group<std::min(2, GR), R>(x, first, K, wr, m0, dots); break;
        case 3: dot_group<std::min(3, GR), R>(x, first, K, wr, m0, dots); break;
        case 4: dot_group<std::min(4, GR), R>(x, first, K, wr, m0, dots); break;
        case 5: dot_group<std::min(5, GR), R>(x, first, K, wr, m0, dots); break;
        case 6: dot_group<std::min(6, GR), R>(x, first, K, wr, m0, dots); break;
        case 7: dot_group<std::min(7, GR), R>(x, first, K, wr, m0, dots); break;
        default: dot_group<GR, R>(x, first, K, wr, m0, dots); break;
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

// Shared driver: checks; converts x once (bf16 weights: to float32, not for AVX-512 BF16; int8: to int16);
// runs passes of <= 16 rows over threads.
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
  at::Tensor y = new_output({M, N}, x_in.options().dtype(at::kBFloat16));
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
        rows<W>(m_rows, xp, m0, wp, sp, bp, K, N, begin, end, yp + m0 * N);
      });
    }
  };
  if constexpr (std::is_same_v<W, int8_t>) {
    const Int16X xq = quantize_x_int16(xb, M, K);
    passes(&xq);
  } else {
#ifdef NANOQWEN_BF16_DOT
    passes(xb);  // bf16 x as it is
#else
    // x in float32, once (a plain buffer: cheaper than a torch tensor for these few KB).
    std::vector<float> xf(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(xb[i]);
    passes(static_cast<const float*>(xf.data()));
#endif
  }
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
