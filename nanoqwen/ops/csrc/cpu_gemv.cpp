// Matrix-vector products for batch-1..16 decode on CPUs with AVX2 + FMA (no AVX-512 needed).
//
//   bf16_gemv(x [M,K] bf16, w [N,K] bf16, bias [N] bf16 or None) -> y [M,N] bf16,  y = x @ w.T + bias
//   int8_gemv(x [M,K] bf16, q [N,K] int8, scale [N] bf16)        -> y [M,N] bf16,  y = (x @ q.T) * scale
//   int4_gemv(x [M,K] bf16, packed [N,K/2] uint8, scale, offset [N,K/G] bf16) -> y [M,N] bf16,
//                                  y = x' @ (offset + scale * q).T per group, x' = x quantised to int8 per group (below);
//                                  any M: above 8 rows a small GEMM on unpacked panels of W (int4_gemm)
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
//
// int4 layout (nanoqwen/quantization.py): row n is cut into groups of G consecutive elements (G % 16 == 0);
// group g has G/2 bytes, byte j holding element j in its low nibble and element j + G/2 in its high nibble,
// each a q in 0..15, and the weight is offset[n, g] + scale[n, g] * q.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NANOQWEN_AVX2 1
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define NANOQWEN_BF16_DOT 1  // vdpbf16ps: 16 bf16 products summed into 8 float32 lanes, one instruction
#endif
#endif

namespace {

constexpr int kMaxRows = 16;                 // rows of x handled per pass over the weights
constexpr int kStreams = 3;                  // weight rows read at once (rows() below)
constexpr int kGroupRows = 4;                // rows of x per register block (rows() below)
constexpr int64_t kTaskBytes = 256 << 10;    // weight bytes a parallel task reads at least
constexpr int kPrefetchBytes = 4096;         // how far ahead of the current weight line to prefetch (tuned)
constexpr int kOwnSharePercent = 85;         // of a product's rows, split evenly over threads (parallel_rows below)
constexpr int kChunksPerThread = 4;          // the other rows: this many chunks per thread

// bf16 -> float32: a bf16 is the upper 16 bits of a float32.
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t float_to_bf16(float f) { return at::BFloat16(f).x; }  // round to nearest even

#ifdef NANOQWEN_AVX2
// 8 bf16 -> 8 float32: zero-extend each 16-bit value to 32 bits, shift it into the upper half.
inline __m256 load8_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 int8 -> 8 float32: sign-extend to int32, convert (exact: |q| <= 128).
inline __m256 load8_int8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

inline __m256 load8(const uint16_t* p) { return load8_bf16(p); }
inline __m256 load8(const int8_t* p) { return load8_int8(p); }

// float32 -> bf16 bits (round to nearest even) in the low half of each int32 lane, as at::BFloat16 rounds
// finite values.
inline __m256i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
}
inline __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline void store8_bf16(uint16_t* p, __m256 v) {
  const __m256i r = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
// The sum of the 8 lanes of v.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           // 2 lanes
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                            // 1 lane
  return _mm_cvtss_f32(s);
}

// The largest of the 8 lanes of v.
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// The sum of the 8 int32 lanes of v.
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));  // swap 64-bit halves
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));  // swap 32-bit pairs
}
#endif

inline float to_float(uint16_t v) { return bf16_to_float(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }

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

// ---- int4 weights times int8-quantised activations (the q4 x q8 dot product llama.cpp uses).
//
// A float FMA per weight made the int4 kernel compute-bound, far below the read bandwidth (BENCHMARKS.md).
// Instead, x is quantised once per call to int8 in blocks of the weights' group size G (symmetric, one
// float32 scale per block: d = max|x| / 127, xq = round(x / d)), and each group's dot product
// sum_k q[k] * xq[k] is an integer one: 32 nibbles times 32 int8 in two instructions (maddubs: u8 x s8 pairs
// summed to int16, at most 4 * 15 * 127 after adding the low and high nibbles' sums; madd with ones: int16
// pairs to int32), or one (vpdpbusd) with AVX-512 VNNI. Per group g of row r and of x row m:
//     y[m, r] = sum_g scale[r, g] * d[m, g] * (sum_{k in g} q[r, k] xq[m, k])  +  sum_g offset[r, g] * xs[m, g]
// with xs[m, g] = d[m, g] * sum_{k in g} xq[m, k] (once per call): exactly x' @ W4.T for the dequantised
// activations x' = d * xq, which int4_gemv_reference in nanoqwen/ops/cpu_gemv.py computes. One float
// conversion and one FMA per group and row of x; the rest is integer work.

constexpr int kMaxRowsInt4 = 8;  // rows of x per pass over the weights

// x quantised for int4_gemv: xq [M, K] int8; d and xs [M, K / G] float32 as above.
struct QuantizedX {
  std::vector<int8_t> xq;
  std::vector<float> d, xs;
};

// Rows m0.. of a QuantizedX (what one pass over the weights reads).
struct QuantizedRows {
  const int8_t* xq;
  const float* d;
  const float* xs;
};

QuantizedX quantize_x(const uint16_t* x, int64_t M, int64_t K, int64_t G) {
  const int64_t blocks = M * (K / G);
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<float>(blocks), std::vector<float>(blocks)};
  // (a decode call's few blocks on this thread, a prompt's in parallel: at::parallel_for runs a range under its
  // grain inline)
  at::parallel_for(0, blocks, std::max<int64_t>(1, (64 << 10) / G), [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {  // block b: group b % (K / G) of row b / (K / G)
      const uint16_t* xb = x + b * G;
      int8_t* qb = out.xq.data() + b * G;
      int64_t k = 0;
      float amax = 0.0f;
#ifdef NANOQWEN_AVX2
      __m256 vmax = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (; k + 8 <= G; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8_bf16(xb + k)));  // |x|
      amax = hmax(vmax);
#endif
      for (; k < G; ++k) amax = std::max(amax, std::fabs(bf16_to_float(xb[k])));
      const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      k = 0;
#ifdef NANOQWEN_AVX2
      __m256i vsum = _mm256_setzero_si256();
      const __m256 inv8 = _mm256_set1_ps(inv);
      for (; k + 8 <= G; k += 8) {  // cvtps rounds half to even (the default rounding mode), as nearbyint does
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8_bf16(xb + k), inv8));
        vsum = _mm256_add_epi32(vsum, v);
        const __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(qb + k), _mm_packs_epi16(v16, v16));  // |v| <= 127: exact
      }
      sum = hsum_epi32(vsum);
#endif
      for (; k < G; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(bf16_to_float(xb[k]) * inv));  // half to even
        qb[k] = static_cast<int8_t>(v);
        sum += v;
      }
      out.d[b] = d;
      out.xs[b] = d * static_cast<float>(sum);
    }
  });
  return out;
}

#ifdef NANOQWEN_AVX2
// acc + the 64 products of 32 low nibbles with xq_lo and 32 high nibbles with xq_hi, summed to 8 int32 lanes.
inline __m256i dot64(__m256i acc, __m256i lo, __m256i xq_lo, __m256i hi, __m256i xq_hi) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, lo, xq_lo), hi, xq_hi);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xq_lo), _mm256_maddubs_epi16(hi, xq_hi));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
#endif

// dots[r][m] = y[m, r] above for R packed int4 rows (layout at the top) and M rows of quantised x.
template <int M, int R>
inline void dot_rows_int4(const QuantizedRows& x, int64_t K, int64_t G, const uint8_t* const* w,
                          const uint16_t* const* scale, const uint16_t* const* offset, float (*dots)[M]) {
  const int64_t groups = K / G, half = G / 2;
  int64_t g0 = 0;  // groups whose offsets the vector loop covered
#ifdef NANOQWEN_AVX2
  if (half % 32 == 0) {  // G a multiple of 64: 32 bytes hold 32 low and 32 high nibbles of the group
    const __m256i nibble = _mm256_set1_epi8(0xF);
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t g8 = 0; g8 < groups; g8 += 8) {
      // scale[r, g] * d[m, g] for the next 8 groups, computed 8 at a time; each group then broadcasts its
      // factor with one load, in place of a scalar bf16 conversion, multiply and broadcast per group and row
      // of x, a large share of a group's instructions next to its two integer dot products.
      const int64_t n8 = std::min<int64_t>(8, groups - g8);
      alignas(32) float sd[R][M][8];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) {
          const float* d = x.d + m * groups + g8;
          if (n8 == 8) {
            _mm256_store_ps(sd[r][m], _mm256_mul_ps(load8_bf16(scale[r] + g8), _mm256_loadu_ps(d)));
          } else {
            for (int64_t j = 0; j < n8; ++j) sd[r][m][j] = bf16_to_float(scale[r][g8 + j]) * d[j];
          }
        }
      for (int64_t j = 0; j < n8; ++j) {
        const int64_t g = g8 + j;
        __m256i isum[R][M];
        for (int r = 0; r < R; ++r) {
          _mm_prefetch(reinterpret_cast<const char*>(w[r] + g * half) + kPrefetchBytes, _MM_HINT_T0);
          for (int m = 0; m < M; ++m) isum[r][m] = _mm256_setzero_si256();
        }
        for (int64_t c = 0; c < half; c += 32)
          for (int r = 0; r < R; ++r) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + g * half + c));
            const __m256i lo = _mm256_and_si256(v, nibble);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            for (int m = 0; m < M; ++m) {
              const int8_t* xg = x.xq + m * K + g * G + c;  // elements c.. (low nibbles) and c + G/2.. (high)
              isum[r][m] = dot64(isum[r][m], lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg)), hi,
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + half)));
            }
          }
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < M; ++m)
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][m]), _mm256_broadcast_ss(&sd[r][m][j]),
                                        acc[r][m]);
      }
    }
    for (; g0 + 8 <= groups; g0 += 8)  // the offsets, 8 groups at a time
      for (int r = 0; r < R; ++r) {
        const __m256 o = load8_bf16(offset[r] + g0);
        for (int m = 0; m < M; ++m)
          acc[r][m] = _mm256_fmadd_ps(o, _mm256_loadu_ps(x.xs + m * groups + g0), acc[r][m]);
      }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) dots[r][m] = hsum(acc[r][m]);
  } else
#endif
  {  // scalar: group sizes 16 and 32, or no AVX2 (byte j of a group: element j low, element j + G/2 high)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t isum = 0;
          for (int64_t j = 0; j < half; ++j) {
            const uint8_t byte = w[r][g * half + j];
            isum += (byte & 0xF) * x.xq[m * K + g * G + j] + (byte >> 4) * x.xq[m * K + g * G + half + j];
          }
          total += bf16_to_float(scale[r][g]) * x.d[m * groups + g] * static_cast<float>(isum);
        }
        dots[r][m] = total;
      }
  }
  for (int r = 0; r < R; ++r)  // offsets of the groups left
    for (int m = 0; m < M; ++m)
      for (int64_t g = g0; g < groups; ++g) dots[r][m] += bf16_to_float(offset[r][g]) * x.xs[m * groups + g];
}

// y[m, n] for n in [begin, end): the int4 counterpart of rows() above (two streams for M <= 2).
template <int M>
__attribute__((noinline)) void rows_int4(const QuantizedRows& x, const uint8_t* w, const uint16_t* scale,
                                         const uint16_t* offset, int64_t K, int64_t G, int64_t N, int64_t begin,
                                         int64_t end, at::BFloat16* y) {
  constexpr int R = M <= 2 ? 2 : 1;
  const int64_t groups = K / G;
  float dots[R][M];
  auto run = [&](auto r_count, const int64_t* n) {
    constexpr int RR = decltype(r_count)::value;
    const uint8_t* wr[RR];
    const uint16_t *sr[RR], *orr[RR];
    for (int r = 0; r < RR; ++r) {
      wr[r] = w + n[r] * (K / 2);
      sr[r] = scale + n[r] * groups;
      orr[r] = offset + n[r] * groups;
    }
    dot_rows_int4<M, RR>(x, K, G, wr, sr, orr, dots);
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n[r]] = at::BFloat16(dots[r][m]);  // one rounding, RNE
  };
  const int64_t part = (end - begin) / R;
  for (int64_t i = 0; i < part; ++i) {
    int64_t n[R];
    for (int r = 0; r < R; ++r) n[r] = begin + r * part + i;
    run(std::integral_constant<int, R>{}, n);
  }
  for (int64_t n = begin + R * part; n < end; ++n) run(std::integral_constant<int, 1>{}, &n);
}

// body(begin, end) over the rows [0, N) on torch's threads: the work of at::parallel_for(0, N, grain, body),
// shared out so that a thread that streams its weights more slowly in this call does fewer rows. Each thread
// first takes its own contiguous share of the first kOwnSharePercent of the rows (one sequential stream per
// thread, no coordination), then the rest in chunks from a shared counter until none is left. Equal static
// shares made the first thread to finish wait for the other in every product (by 17-25% of its busy time at
// batch 1: the two threads' read speeds drift apart, BENCHMARKS.md); all-dynamic small chunks cost more in
// broken streams than they saved. A row's result depends only on where the chunks are cut (fixed for a given
// N and thread count), not on which thread runs it, so the output is the same from call to call.
template <typename F>
void parallel_rows(int64_t N, int64_t grain, const F& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), N / grain);
  if (threads <= 1) return at::parallel_for(0, N, grain, body);
  const int64_t own = N * kOwnSharePercent / 100;  // rows [0, own) in equal shares, one per thread
  const int64_t chunk = std::max<int64_t>(1, (N - own) / (threads * kChunksPerThread));
  std::atomic<int64_t> next{own};
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {  // one thread each (inline: all of them)
    for (int64_t t = first; t < last; ++t) body(own * t / threads, own * (t + 1) / threads);
    for (int64_t b; (b = next.fetch_add(chunk, std::memory_order_relaxed)) < N;) body(b, std::min(N, b + chunk));
  });
}

void check_vector(const torch::Tensor& t, const char* name, int64_t N) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N, name, " must have shape [", N, "], got ", t.sizes());
}

// Shared driver: checks, converts x to float32 once (not for AVX-512 BF16), runs passes of <= 16 rows over threads.
template <typename W>
torch::Tensor gemv(const torch::Tensor& x_in, const torch::Tensor& w_in, at::ScalarType w_type, const char* w_name,
                   const std::optional<torch::Tensor>& scale_in, const std::optional<torch::Tensor>& bias_in) {
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "x and ", w_name, " must be CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(w_in.scalar_type() == w_type, w_name, " must be ", w_type, ", got ", w_in.scalar_type());
  TORCH_CHECK(x_in.dim() == 2, "x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(w_in.dim() == 2, w_name, " must be 2-D [N, K], got ", w_in.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  TORCH_CHECK(w_in.size(1) == K, "x has K=", K, " but ", w_name, " has K=", w_in.size(1));

  // Non-contiguous inputs are copied (correct, but a copy of the weight costs a full extra pass).
  torch::Tensor x = x_in.contiguous();
  torch::Tensor w = w_in.contiguous();
  torch::Tensor scale, bias;
  if (scale_in) { check_vector(*scale_in, "scale", N); scale = scale_in->contiguous(); }
  if (bias_in) { check_vector(*bias_in, "bias", N); bias = bias_in->contiguous(); }
  torch::Tensor y = torch::empty({M, N}, x_in.options().dtype(at::kBFloat16));
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

torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias) {
  return gemv<uint16_t>(x, w, at::kBFloat16, "w", std::nullopt, bias);
}

torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  return gemv<int8_t>(x, q, at::kChar, "q", scale, std::nullopt);
}

// Checks of int4_gemv's weights; returns G (the group size).
int64_t check_int4(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& offset) {
  TORCH_CHECK(packed.device().is_cpu() && scale.device().is_cpu() && offset.device().is_cpu(),
              "packed, scale and offset must be CPU tensors");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 2, "packed must be 2-D [N, K/2], got ", packed.sizes());
  for (const auto* t : {&scale, &offset}) {
    const char* name = t == &scale ? "scale" : "offset";
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 2 && t->size(0) == packed.size(0) && t->size(1) > 0, name, " must be [N, K/G] with N=",
                packed.size(0), ", got ", t->sizes());
  }
  TORCH_CHECK(scale.sizes() == offset.sizes(), "scale and offset must have the same shape");
  const int64_t K = 2 * packed.size(1), groups = scale.size(1);
  TORCH_CHECK(K % groups == 0 && (K / groups) % 16 == 0, "K=", K, " and ", groups,
              " groups per row: the group size K/groups must be a whole multiple of 16");
  return K / groups;
}

// An int4 product's inputs, checked, made contiguous, and x quantised (int4_gemv and int4_gemm share it).
struct Int4Product {
  torch::Tensor x, packed, scale, offset, y;
  int64_t M, K, N, G;
  QuantizedX xq;
  const uint8_t* wp() const { return packed.data_ptr<uint8_t>(); }
  const uint16_t* sp() const { return reinterpret_cast<const uint16_t*>(scale.data_ptr()); }
  const uint16_t* op() const { return reinterpret_cast<const uint16_t*>(offset.data_ptr()); }
  at::BFloat16* yp() const { return y.data_ptr<at::BFloat16>(); }
};

Int4Product prepare_int4(const torch::Tensor& x_in, const torch::Tensor& packed_in, const torch::Tensor& scale_in,
                         const torch::Tensor& offset_in) {
  TORCH_CHECK(x_in.device().is_cpu(), "x must be a CPU tensor");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.dim() == 2, "x must be 2-D [M, K], got ", x_in.sizes());
  const int64_t G = check_int4(packed_in, scale_in, offset_in);
  const int64_t M = x_in.size(0), K = x_in.size(1), N = packed_in.size(0);
  TORCH_CHECK(2 * packed_in.size(1) == K, "x has K=", K, " but packed holds K=", 2 * packed_in.size(1));
  Int4Product p{x_in.contiguous(), packed_in.contiguous(), scale_in.contiguous(), offset_in.contiguous(),
                torch::empty({M, N}, x_in.options().dtype(at::kBFloat16)), M, K, N, G, {}};
  if (M > 0 && N > 0)  // x quantised to int8 once
    p.xq = quantize_x(reinterpret_cast<const uint16_t*>(p.x.data_ptr()), M, K, G);
  return p;
}

// Passes of kMaxRowsInt4 rows of x, each streaming the weights once (few rows: decode); rows_int4 above.
void int4_passes(const Int4Product& p) {
  const int64_t K = p.K, N = p.N, G = p.G, groups = K / G;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, K / 2));
  for (int64_t m0 = 0; m0 < p.M; m0 += kMaxRowsInt4) {
    const int m_rows = static_cast<int>(std::min<int64_t>(kMaxRowsInt4, p.M - m0));
    const QuantizedRows part{p.xq.xq.data() + m0 * K, p.xq.d.data() + m0 * groups, p.xq.xs.data() + m0 * groups};
    const uint8_t* wp = p.wp();
    const uint16_t *sp = p.sp(), *op = p.op();
    at::BFloat16* yo = p.yp() + m0 * N;
    parallel_rows(N, grain, [&](int64_t begin, int64_t end) {
      switch (m_rows) {
        case 1: return rows_int4<1>(part, wp, sp, op, K, G, N, begin, end, yo);
        case 2: return rows_int4<2>(part, wp, sp, op, K, G, N, begin, end, yo);
        case 3: return rows_int4<3>(part, wp, sp, op, K, G, N, begin, end, yo);
        case 4: return rows_int4<4>(part, wp, sp, op, K, G, N, begin, end, yo);
        case 5: return rows_int4<5>(part, wp, sp, op, K, G, N, begin, end, yo);
        case 6: return rows_int4<6>(part, wp, sp, op, K, G, N, begin, end, yo);
        case 7: return rows_int4<7>(part, wp, sp, op, K, G, N, begin, end, yo);
        default: return rows_int4<8>(part, wp, sp, op, K, G, N, begin, end, yo);
      }
    });
  }
}

// ---- int4 products over many rows of x (prefill, large batches): a small GEMM on packed panels.
//
// int4_passes above reads each weight row once per pass of 8 rows of x, summing each group's dot product along
// K inside a vector and then across its lanes: fine while the weights' bytes are the cost, but with hundreds
// of rows the same nibbles are unpacked again for every pass and every row's result needs a horizontal sum.
// int4_gemm computes the same function (x quantised per group as above; same integer dots, same per-group
// float32 FMAs, only the order of the float32 additions differs) the way GEMMs do: it cuts W into panels of
// kPanelRows rows, unpacks one panel at a time into a small buffer laid out for the integer dot instruction,
// and runs every row of x over it.
//
// Panel layout: for group g and each 4 consecutive elements (a "quad" kq of the group) the panel holds
// kPanelRows * 4 bytes, lane by lane: weight row n0 + lane, elements g * G + 4 * kq .. + 3, each 0..15. One
// 32-byte vector is then 8 weight rows x 4 elements, and one vpdpbusd (or maddubs + madd) with x's 4 int8 of
// that quad broadcast to all lanes adds the 4 products of each row into its int32 lane: the lanes are output
// columns, so a group's sum needs no horizontal add, and its scale and offset are vectors of 8 rows
// (panel_scale, panel_offset: float32 [groups][kPanelRows]). A register tile is kTileRows rows of x times the
// panel's 16 rows (2 vectors).
constexpr int kPanelRows = 16;  // weight rows per panel (a multiple of 8: vectors of 8 lanes)
constexpr int kPanelVectors = kPanelRows / 8;
constexpr int kTileRows = 4;  // rows of x per register tile (measured against 3, 5 and 6, and panels of 24, 32)

#ifdef NANOQWEN_AVX2
// The 8x8 matrix of int32 in r[0..7] transposed in place: r[i] lane j <- r[j] lane i.
inline void transpose8x8_epi32(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);      // r_i0 r_i+1,0 r_i1 r_i+1,1 | (same, lanes 4, 5)
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);  // lanes 2, 3 | 6, 7
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// isum + for each of the 8 int32 lanes the sum of its 4 products of u8 w (0..15) with s8 x.
// (vpdpbusd as inline assembly, not _mm256_dpbusd_epi32: in panel_tile's loop GCC 12 copies each accumulator to
// another register and back around every one of those, two extra instructions per product instruction; the
// panels ran 1.3-1.4x faster without them.)
inline __m256i dot4(__m256i isum, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm("vpdpbusd %2, %1, %0" : "+v"(isum) : "v"(w), "v"(x));
  return isum;
#else
  return _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
#endif

// Unpacks weight rows n0 .. n0 + kPanelRows - 1 (rows past N as zeros) into panel, panel_scale, panel_offset.
void pack_panel(const uint8_t* wp, const uint16_t* sp, const uint16_t* op, int64_t N, int64_t K, int64_t G,
                int64_t n0, uint8_t* panel, float* panel_scale, float* panel_offset) {
  const int64_t groups = K / G, half = G / 2, quads = G / 4;
  for (int64_t g = 0; g < groups; ++g)
    for (int lane = 0; lane < kPanelRows; ++lane) {
      const bool row = n0 + lane < N;
      panel_scale[g * kPanelRows + lane] = row ? bf16_to_float(sp[(n0 + lane) * groups + g]) : 0.0f;
      panel_offset[g * kPanelRows + lane] = row ? bf16_to_float(op[(n0 + lane) * groups + g]) : 0.0f;
    }
#ifdef NANOQWEN_AVX2
  if (G % 64 == 0 && n0 + kPanelRows <= N) {  // 8 rows at a time: 32 bytes of each unpack to 8 quads each
    const __m256i nibble = _mm256_set1_epi8(0xF);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t c = 0; c < half; c += 32)  // bytes c.. of the group: elements c.. (low), c + G/2.. (high)
        for (int v = 0; v < kPanelVectors; ++v) {
          __m256i lo[8], hi[8];
          for (int r = 0; r < 8; ++r) {
            const __m256i b = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(wp + (n0 + 8 * v + r) * (K / 2) + g * half + c));
            lo[r] = _mm256_and_si256(b, nibble);                         // quads c/4 .. c/4 + 7 of row r
            hi[r] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);  // quads (c + G/2)/4 ..
          }
          transpose8x8_epi32(lo);  // lo[i]: quad c/4 + i of the 8 rows
          transpose8x8_epi32(hi);
          for (int i = 0; i < 8; ++i) {
            uint8_t* at_lo = panel + ((g * quads + c / 4 + i) * kPanelRows + 8 * v) * 4;
            uint8_t* at_hi = panel + ((g * quads + (c + half) / 4 + i) * kPanelRows + 8 * v) * 4;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_lo), lo[i]);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_hi), hi[i]);
          }
        }
    return;
  }
#endif
  for (int lane = 0; lane < kPanelRows; ++lane)  // any G (a multiple of 16), and the last, partial panel
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / G, j = k % G;
      uint8_t q = 0;
      if (n0 + lane < N) {
        const uint8_t b = wp[(n0 + lane) * (K / 2) + g * half + j % half];
        q = j < half ? (b & 0xF) : (b >> 4);
      }
      panel[((g * quads + j / 4) * kPanelRows + lane) * 4 + j % 4] = q;
    }
}

// y[m, n0 ..] for rows m0 .. m0 + T - 1 of x over one packed panel; cols = how many of its rows are real.
template <int T>
void panel_tile(const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* panel,
                const float* panel_scale, const float* panel_offset, int64_t N, int64_t n0, int cols,
                at::BFloat16* y) {
  const int64_t groups = K / G, quads = G / 4;
  float out[T][kPanelRows];
#ifdef NANOQWEN_AVX2
  constexpr int V = kPanelVectors;
  __m256 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i isum[T][V];
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < V; ++v) isum[t][v] = _mm256_setzero_si256();
    const uint8_t* pg = panel + g * quads * kPanelRows * 4;
    for (int64_t kq = 0; kq < quads; ++kq) {
      __m256i w[V];
      for (int v = 0; v < V; ++v)
        w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + kq * kPanelRows * 4 + 32 * v));
      for (int t = 0; t < T; ++t) {
        int32_t four;  // x's 4 int8 of this quad
        std::memcpy(&four, x.xq + (m0 + t) * K + g * G + 4 * kq, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        for (int v = 0; v < V; ++v) isum[t][v] = dot4(isum[t][v], w[v], xb);
      }
    }
    for (int v = 0; v < V; ++v) {
      const __m256 s = _mm256_loadu_ps(panel_scale + g * kPanelRows + 8 * v);
      const __m256 o = _mm256_loadu_ps(panel_offset + g * kPanelRows + 8 * v);
      for (int t = 0; t < T; ++t) {  // as int4_gemv: (scale * d) * isum, then offset * xs
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(x.d[(m0 + t) * groups + g]));
        acc[t][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][v]), sd, acc[t][v]);
        acc[t][v] = _mm256_fmadd_ps(o, _mm256_set1_ps(x.xs[(m0 + t) * groups + g]), acc[t][v]);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(out[t] + 8 * v, acc[t][v]);
#else
  for (int t = 0; t < T; ++t)
    for (int lane = 0; lane < kPanelRows; ++lane) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t isum = 0;
        for (int64_t j = 0; j < G; ++j)
          isum += panel[((g * quads + j / 4) * kPanelRows + lane) * 4 + j % 4] * x.xq[(m0 + t) * K + g * G + j];
        total += panel_scale[g * kPanelRows + lane] * x.d[(m0 + t) * groups + g] * static_cast<float>(isum);
        total += panel_offset[g * kPanelRows + lane] * x.xs[(m0 + t) * groups + g];
      }
      out[t][lane] = total;
    }
#endif
  for (int t = 0; t < T; ++t) {
    at::BFloat16* row = y + (m0 + t) * N + n0;
#ifdef NANOQWEN_AVX2
    if (cols == kPanelRows) {
      for (int v = 0; v < kPanelVectors; ++v)
        store8_bf16(reinterpret_cast<uint16_t*>(row) + 8 * v, _mm256_loadu_ps(out[t] + 8 * v));
      continue;
    }
#endif
    for (int c = 0; c < cols; ++c) row[c] = at::BFloat16(out[t][c]);  // one rounding, RNE
  }
}

// panel_tile for T = rows (1 .. kTileRows) rows of x.
template <int T = kTileRows>
void panel_tiles(int rows, const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* panel,
                 const float* panel_scale, const float* panel_offset, int64_t N, int64_t n0, int cols,
                 at::BFloat16* y) {
  if constexpr (T > 1) {
    if (rows < T)
      return panel_tiles<T - 1>(rows, x, K, G, m0, panel, panel_scale, panel_offset, N, n0, cols, y);
  }
  panel_tile<T>(x, K, G, m0, panel, panel_scale, panel_offset, N, n0, cols, y);
}

void int4_panels(const Int4Product& p) {
  const int64_t M = p.M, K = p.K, N = p.N, G = p.G, groups = K / G;
  const QuantizedRows rows{p.xq.xq.data(), p.xq.d.data(), p.xq.xs.data()};
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> panel(kPanelRows * K);  // this thread's panel: 16 KB for K = 1024
    std::vector<float> panel_scale(kPanelRows * groups), panel_offset(kPanelRows * groups);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * kPanelRows;
      const int cols = static_cast<int>(std::min<int64_t>(kPanelRows, N - n0));
      pack_panel(p.wp(), p.sp(), p.op(), N, K, G, n0, panel.data(), panel_scale.data(), panel_offset.data());
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows)
        panel_tiles(static_cast<int>(std::min<int64_t>(kTileRows, M - m0)), rows, K, G, m0, panel.data(),
                    panel_scale.data(), panel_offset.data(), N, n0, cols, p.yp());
    }
  });
}

// Few rows: passes that stream the weights; more: the panels (measured: below 9 rows, the panels' unpacking
// costs more than it saves; at 16 the panels ran 1.2x (AVX2) to 1.4x (VNNI) two passes).
torch::Tensor int4_gemv(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                        const torch::Tensor& offset) {
  const Int4Product p = prepare_int4(x, packed, scale, offset);
  if (p.M == 0 || p.N == 0) return p.y;
  if (p.M <= kMaxRowsInt4)
    int4_passes(p);
  else
    int4_panels(p);
  return p.y;
}

// int4_gemv's product through the panels whatever the row count (int4_gemv takes them above kMaxRowsInt4 rows;
// exposed so that tests reach them with few rows too).
torch::Tensor int4_gemm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                        const torch::Tensor& offset) {
  const Int4Product p = prepare_int4(x, packed, scale, offset);
  if (p.M > 0 && p.N > 0) int4_panels(p);
  return p.y;
}

// ---- The rest of a decode step: elementwise ops for few rows, and attention over the paged KV cache.
//
// Each replaces several torch ops (each a dispatch, an allocation and a pass over memory) with one, and
// rounds where the plain-torch reference (nanoqwen/models/qwen3.py) rounds: intermediate bf16 results are
// rounded to bf16 exactly where torch would round them, the rest is float32.

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }
inline const uint16_t* bf16_ptr(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* bf16_ptr_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

#ifdef NANOQWEN_AVX2
// e^x for 8 floats (Cephes' expf: a degree-5 polynomial after range reduction, within 2 float32 ulps).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// sum_i a[i] * b[i] for float32 a and bf16 b (the positions attention_scores leaves over, fewer than eight).
inline float dot_bf16(const float* a, const uint16_t* b, int64_t D) {
  int64_t i = 0;
  float total = 0.0f;
#ifdef NANOQWEN_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8_bf16(b + i), acc);
  total = hsum(acc);
#endif
  for (; i < D; ++i) total += a[i] * bf16_to_float(b[i]);
  return total;
}

// s[p] = dot(q, k[p] + offset) * scale for the len positions p (float32 q, bf16 key vectors of D elements,
// offset elements into each position's row): eight positions at a time, each with its own accumulator (eight
// independent FMA chains, q loaded once for all eight), their lanes then summed by a transpose-add into one
// vector of eight scores.
inline void attention_scores(const float* q, const uint16_t* const* k, int64_t offset, int64_t len, int64_t D,
                             float scale, float* s) {
  int64_t p = 0;
#ifdef NANOQWEN_AVX2
  if (D % 8 == 0)
    for (; p + 8 <= len; p += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8_bf16(k[p + j] + offset + i), acc[j]);
      }
      // hadd pairs lanes within each 128-bit half: after two rounds, half h of s0123 holds the sums of half h
      // of acc[0..3] (in that order), likewise s4567; adding the halves gives the eight totals in order.
      const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
      const __m256 total = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
      _mm256_storeu_ps(s + p, _mm256_mul_ps(total, _mm256_set1_ps(scale)));
    }
#endif
  for (; p < len; ++p) s[p] = dot_bf16(q, k[p] + offset, D) * scale;
}

// out[i] += sum_p w[p] * (v[p] + offset)[i] for i < D, the positions p = 0 .. len - 1 added in order (each
// output element its own chain of FMAs, as a running sum over the positions would give). The sums of 64
// elements at a time stay in registers while the positions stream by, instead of a load and a store of the
// sum per position.
inline void weighted_sum_bf16(const float* w, const uint16_t* const* v, int64_t offset, int64_t len, float* out,
                              int64_t D) {
  int64_t i = 0;
#ifdef NANOQWEN_AVX2
  for (; i + 64 <= D; i += 64) {
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_loadu_ps(out + i + 8 * u);
    for (int64_t p = 0; p < len; ++p) {
      const __m256 wp = _mm256_set1_ps(w[p]);
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(wp, load8_bf16(v[p] + offset + i + 8 * u), acc[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + i + 8 * u, acc[u]);
  }
  for (; i + 8 <= D; i += 8) {
    __m256 acc = _mm256_loadu_ps(out + i);
    for (int64_t p = 0; p < len; ++p)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(w[p]), load8_bf16(v[p] + offset + i), acc);
    _mm256_storeu_ps(out + i, acc);
  }
#endif
  for (; i < D; ++i) {
    float acc = out[i];
    for (int64_t p = 0; p < len; ++p) acc = std::fma(w[p], bf16_to_float(v[p][offset + i]), acc);
    out[i] = acc;
  }
}

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// One row of rms_norm: y = weight * bf16(x / sqrt(mean(x^2) + eps)), D elements.
void rms_norm_row(const uint16_t* xr, const uint16_t* wp, int64_t D, float eps, uint16_t* yr) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef NANOQWEN_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) {
    const __m256 v = load8_bf16(xr + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  sum = hsum(acc);
#endif
  for (; i < D; ++i) sum += bf16_to_float(xr[i]) * bf16_to_float(xr[i]);
  const float inv = 1.0f / std::sqrt(sum / float(D) + eps);
  i = 0;
#ifdef NANOQWEN_AVX2
  for (; i + 8 <= D; i += 8)
    store8_bf16(yr + i, _mm256_mul_ps(load8_bf16(wp + i),
                                      round_bf16(_mm256_mul_ps(load8_bf16(xr + i), _mm256_set1_ps(inv)))));
#endif
  for (; i < D; ++i) yr[i] = float_to_bf16(bf16_to_float(wp[i]) * round_bf16(bf16_to_float(xr[i]) * inv));
}

// One head of apply_rope: y = x * cos + rotate_half(x) * sin, D elements (each product rounded to bf16, then
// the sum, as torch computes it in bf16).
void rope_row(const uint16_t* xr, const uint16_t* c, const uint16_t* s, int64_t D, uint16_t* yr) {
  const int64_t half = D / 2;
  // Element i < half pairs with i + half: y[i] = x[i] cos[i] - x[i + half] sin[i],
  // y[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half].
  int64_t i = 0;
#ifdef NANOQWEN_AVX2
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8_bf16(xr + i), x2 = load8_bf16(xr + half + i);
    const __m256 neg_x2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.0f));
    store8_bf16(yr + i, _mm256_add_ps(round_bf16(_mm256_mul_ps(x1, load8_bf16(c + i))),
                                      round_bf16(_mm256_mul_ps(neg_x2, load8_bf16(s + i)))));
    store8_bf16(yr + half + i, _mm256_add_ps(round_bf16(_mm256_mul_ps(x2, load8_bf16(c + half + i))),
                                             round_bf16(_mm256_mul_ps(x1, load8_bf16(s + half + i)))));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = bf16_to_float(xr[i]), x2 = bf16_to_float(xr[half + i]);
    yr[i] = float_to_bf16(round_bf16(x1 * bf16_to_float(c[i])) + round_bf16(-x2 * bf16_to_float(s[i])));
    yr[half + i] = float_to_bf16(round_bf16(x2 * bf16_to_float(c[half + i])) +
                                 round_bf16(x1 * bf16_to_float(s[half + i])));
  }
}

// rms_norm: weight * bf16(x / sqrt(mean(x^2) + eps)) over the last dimension D, for x [..., D].
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight, double eps) {
  torch::Tensor x = x_in.contiguous();
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "weight must have shape [", D, "], got ", weight.sizes());
  torch::Tensor y = torch::empty_like(x);
  const uint16_t *xp = bf16_ptr(x), *wp = bf16_ptr(weight);
  uint16_t* yp = bf16_ptr_mut(y);
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(xp + r * D, wp, D, float(eps), yp + r * D);
  return y;
}

void check_rope(const torch::Tensor& cos, const torch::Tensor& sin, int64_t N, int64_t D) {
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even, got ", D);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == N && cos.size(1) == D,
              "cos and sin must be [", N, ", ", D, "], got ", cos.sizes(), " and ", sin.sizes());
}

// apply_rope: x * cos + rotate_half(x) * sin for x [N, H, D], cos/sin [N, D].
torch::Tensor apply_rope(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin) {
  torch::Tensor x = x_in.contiguous();
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [N, heads, D], got ", x.sizes());
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  check_rope(cos, sin, N, D);
  torch::Tensor y = torch::empty_like(x);
  const uint16_t *xp = bf16_ptr(x), *cp = bf16_ptr(cos), *sp = bf16_ptr(sin);
  uint16_t* yp = bf16_ptr_mut(y);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) rope_row(xp + (n * H + h) * D, cp + n * D, sp + n * D, D, yp + (n * H + h) * D);
  return y;
}

// swiglu: bf16(silu(gate)) * up for gate_up [N, 2I] (gate, then up) -> [N, I].
torch::Tensor swiglu(const torch::Tensor& gate_up_in) {
  torch::Tensor gate_up = gate_up_in.contiguous();
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [N, 2I], got ", gate_up.sizes());
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  torch::Tensor y = torch::empty({N, I}, gate_up.options());
  const uint16_t* gp = bf16_ptr(gate_up);
  uint16_t* yp = bf16_ptr_mut(y);
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t *gate = gp + n * 2 * I, *up = gate + I;
    int64_t i = 0;
#ifdef NANOQWEN_AVX2
    for (; i + 8 <= I; i += 8) {
      const __m256 g = load8_bf16(gate + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      store8_bf16(yp + n * I + i, _mm256_mul_ps(round_bf16(silu), load8_bf16(up + i)));
    }
#endif
    for (; i < I; ++i) {
      const float g = bf16_to_float(gate[i]), u = bf16_to_float(up[i]);
      yp[n * I + i] = float_to_bf16(round_bf16(g / (1.0f + std::exp(-g))) * u);
    }
  }
  return y;
}

// Decode attention over the paged KV cache, in place (no gather): q [B, Hq, D]; k_cache, v_cache
// [num_blocks, block_size, Hkv, D]; block_tables [B, W] int32; context_lens [B] int32 -> [B, Hq, D].
// Row b's query attends to positions 0 .. context_lens[b] - 1 (position p: slot p % block_size of block
// block_tables[b, p / block_size]); the G = Hq / Hkv query heads of a kv head share its keys. Scores,
// softmax and the weighted sum are float32, the output rounded to bf16 once (as
// paged_decode_attention_reference). A row with context_len 0 gets zeros.
//
// Split-context ("flash decoding"): each row's positions are cut into equal spans of at most kSpan (and, while
// a row has fewer spans than its share of the threads, of at least kMinSpan: a 100-token context's attention
// then runs on both threads of a 2-core CPU, not one), and a task takes one span of one row for all heads. The
// cache holds a position's Hkv heads side by side (Hkv * D
// values), so a task reads its span's keys, then its values, as contiguous runs, a few positions at a time,
// all heads of those before the next: one head at a time over the whole context would read D values every
// Hkv * D, which waits on memory once the cache is larger than the caches (long contexts). A task leaves, per
// query head, its span's largest score m, the sum l of exp(s - m) and the sum o of exp(s - m) * v; the spans
// of a row are then combined: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, M the largest m_c.
constexpr int64_t kSpan = 256;  // positions per task
constexpr int64_t kMinSpan = 32;  // positions per span at least, when a row's spans are shortened for the threads
constexpr int64_t kGroup = 16;  // positions per weighted_sum_bf16 call: its sums loaded and stored once per 16

torch::Tensor paged_decode_attention(const torch::Tensor& q_in, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables_in,
                                     const torch::Tensor& context_lens_in, double scale) {
  torch::Tensor q = q_in.contiguous();
  check_bf16(q, "q");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q must be [B, Hq, D] and k_cache, v_cache [blocks, block_size, Hkv, D]");
  torch::Tensor block_tables = block_tables_in.to(at::kInt).contiguous();
  torch::Tensor context_lens = context_lens_in.to(at::kInt).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "q has ", Hq, " heads of ", D,
              " but the cache holds ", Hkv, " kv heads of ", k_cache.size(3));
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B,
              "block_tables must be [B, W] and context_lens [B] with B=", B);
  const int64_t G = Hq / Hkv, num_blocks = k_cache.size(0);
  const int* tables = block_tables.data_ptr<int>();
  const int* lens = context_lens.data_ptr<int>();
  // row b: spans of span[b] positions, tasks first_task[b] .. first_task[b + 1] - 1
  std::vector<int64_t> first_task(B + 1, 0), span(B);
  // (rows of fewer spans than threads get shorter spans, down to kMinSpan positions, so that every thread works)
  const int64_t threads_per_row = (at::get_num_threads() + B - 1) / B;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= W * bs, "context_lens[", b, "]=", lens[b], " is past its block table");
    for (int64_t p = 0; p < lens[b]; p += bs) {
      const int64_t block = tables[b * W + p / bs];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", b, "] names block ", block);
    }
    const int64_t spans = std::max((lens[b] + kSpan - 1) / kSpan, std::min(threads_per_row, lens[b] / kMinSpan));
    first_task[b + 1] = first_task[b] + spans;
    span[b] = spans == 0 ? 0 : (lens[b] + spans - 1) / spans;
  }
  const int64_t tasks = first_task[B], row = Hkv * D;  // row: one position's values in the cache
  torch::Tensor out = torch::empty_like(q);
  const uint16_t *qp = bf16_ptr(q), *kp = bf16_ptr(k_cache), *vp = bf16_ptr(v_cache);
  uint16_t* op = bf16_ptr_mut(out);
  std::vector<float> span_o(tasks * Hq * D, 0.0f), span_m(tasks * Hq), span_l(tasks * Hq);
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, span[b]);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), scores(Hq * longest);
    std::vector<const uint16_t*> k_rows(longest), v_rows(longest);  // the span's positions' rows, all heads
    int64_t b = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first_task[b + 1]) ++b;
      const int64_t start = (task - first_task[b]) * span[b], len = std::min<int64_t>(span[b], lens[b] - start);
      for (int64_t i = 0; i < Hq * D; ++i) qf[i] = bf16_to_float(qp[b * Hq * D + i]);
      for (int64_t j = 0; j < len; ++j) {  // position p: slot p % bs of block block_tables[b, p / bs]
        const int64_t p = start + j, offset = (tables[b * W + p / bs] * bs + p % bs) * row;
        k_rows[j] = kp + offset;
        v_rows[j] = vp + offset;
      }
      // scores[hq * longest + j]: query head hq = h * G + g against position start + j (kv head h)
      for (int64_t j = 0; j < len; j += 8)
        for (int64_t hq = 0; hq < Hq; ++hq)
          attention_scores(qf.data() + hq * D, k_rows.data() + j, (hq / G) * D, std::min<int64_t>(8, len - j), D,
                           float(scale), scores.data() + hq * longest + j);
      float* m = span_m.data() + task * Hq;
      float* l = span_l.data() + task * Hq;
      for (int64_t hq = 0; hq < Hq; ++hq) {  // scores -> exp(s - m), their sum l
        float* s = scores.data() + hq * longest;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < len; ++j) mx = std::max(mx, s[j]);
        int64_t j = 0;
#ifdef NANOQWEN_AVX2
        __m256 total = _mm256_setzero_ps();
        for (; j + 8 <= len; j += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
          _mm256_storeu_ps(s + j, e);
          total = _mm256_add_ps(total, e);
        }
        sum = hsum(total);
#endif
        for (; j < len; ++j) sum += (s[j] = std::exp(s[j] - mx));
        m[hq] = mx;
        l[hq] = sum;
      }
      float* o = span_o.data() + task * Hq * D;
      for (int64_t j = 0; j < len; j += kGroup)
        for (int64_t hq = 0; hq < Hq; ++hq)
          weighted_sum_bf16(scores.data() + hq * longest + j, v_rows.data() + j, (hq / G) * D,
                            std::min<int64_t>(kGroup, len - j), o + hq * D, D);
    }
  });
  std::vector<float> total(D), weight(tasks);  // weight[c]: e^(m_c - M) of span c
  for (int64_t b = 0; b < B; ++b)  // combine each row's spans
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t first = first_task[b], last = first_task[b + 1];
      float M = -INFINITY, denominator = 0.0f;
      for (int64_t c = first; c < last; ++c) M = std::max(M, span_m[c * Hq + hq]);
      for (int64_t c = first; c < last; ++c) {
        weight[c] = std::exp(span_m[c * Hq + hq] - M);
        denominator += weight[c] * span_l[c * Hq + hq];
      }
      std::fill(total.begin(), total.end(), 0.0f);
      for (int64_t c = first; c < last; ++c) {
        const float w = weight[c] / denominator;
        const float* o = span_o.data() + (c * Hq + hq) * D;
        for (int64_t i = 0; i < D; ++i) total[i] += w * o[i];
      }
      uint16_t* dst = op + (b * Hq + hq) * D;
      int64_t i = 0;
#ifdef NANOQWEN_AVX2
      for (; i + 8 <= D; i += 8) store8_bf16(dst + i, _mm256_loadu_ps(total.data() + i));
#endif
      for (; i < D; ++i) dst[i] = float_to_bf16(total[i]);  // (zeros for a row with nothing to attend to)
    }
  return out;
}

// What a decoder layer does between qkv_proj and attention, row by row in one pass (decode_layer's step): q and
// k through their per-head RMSNorm and RoPE, k and v written to their cache slots. qkv [M, (Hq + 2 Hkv) D]; k_cache,
// v_cache [blocks, block_size, Hkv, D]; slot_mapping [M] -> q [M, Hq, D]. The same row functions as rms_norm and
// apply_rope, so the same bits as those kernels and index_copy_ into the cache, without their tensors and calls.
torch::Tensor attention_inputs(const torch::Tensor& qkv_in, const torch::Tensor& q_norm, const torch::Tensor& k_norm,
                               double eps, int64_t num_heads, const torch::Tensor& cos, const torch::Tensor& sin,
                               const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slot_mapping_in) {
  torch::Tensor qkv = qkv_in.contiguous();
  check_bf16(qkv, "qkv");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be [blocks, block_size, Hkv, D], got ", k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t Hq = num_heads, Hkv = k_cache.size(2), D = k_cache.size(3), M = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (Hq + 2 * Hkv) * D, "qkv must be [M, ", (Hq + 2 * Hkv) * D,
              "] for ", Hq, " query and ", Hkv, " kv heads of ", D, ", got ", qkv.sizes());
  check_vector(q_norm, "q_norm", D);
  check_vector(k_norm, "k_norm", D);
  check_rope(cos, sin, M, D);
  torch::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == M, "slot_mapping must be [", M, "], got ", slots.sizes());
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), row = (Hq + 2 * Hkv) * D;
  torch::Tensor q = torch::empty({M, Hq, D}, qkv.options());
  const uint16_t *qkv_p = bf16_ptr(qkv), *qn = bf16_ptr(q_norm), *kn = bf16_ptr(k_norm);
  const uint16_t *cp = bf16_ptr(cos), *sp = bf16_ptr(sin);
  uint16_t *q_p = bf16_ptr_mut(q), *kp = reinterpret_cast<uint16_t*>(k_cache.data_ptr());
  uint16_t* vp = reinterpret_cast<uint16_t*>(v_cache.data_ptr());
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<uint16_t> normed(D);  // one head after its RMSNorm, before RoPE
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(slot[m] >= 0 && slot[m] < num_slots, "slot_mapping[", m, "]=", slot[m], " is outside the cache (",
                num_slots, " slots)");
    const uint16_t *r = qkv_p + m * row, *c = cp + m * D, *s = sp + m * D;
    for (int64_t h = 0; h < Hq; ++h) {
      rms_norm_row(r + h * D, qn, D, float(eps), normed.data());
      rope_row(normed.data(), c, s, D, q_p + (m * Hq + h) * D);
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      rms_norm_row(r + (Hq + h) * D, kn, D, float(eps), normed.data());
      rope_row(normed.data(), c, s, D, kp + (slot[m] * Hkv + h) * D);
    }
    std::memcpy(vp + slot[m] * Hkv * D, r + (Hq + Hkv) * D, Hkv * D * sizeof(uint16_t));
  }
  return q;
}

// ---- A whole decoder layer for decode rows, in one call (nanoqwen/ops/decode_step.py drives it).
//
// The same kernels in the same order as DecoderLayer.forward takes on this path (so the same bits), without
// a return to Python between them: x + attention(norm(x)), then h + mlp(norm(h)). Each linear is given as
// its tensors: (w) bf16, (q, scale) int8, (packed, scale, offset) int4.
torch::Tensor linear(const torch::Tensor& x, const std::vector<torch::Tensor>& t) {
  switch (t.size()) {
    case 1: return bf16_gemv(x, t[0], std::nullopt);
    case 2: return int8_gemv(x, t[0], t[1]);
    case 3: return int4_gemv(x, t[0], t[1], t[2]);
    default: TORCH_CHECK(false, "a linear is 1 (bf16), 2 (int8) or 3 (int4) tensors, got ", t.size());
  }
}

torch::Tensor decode_layer(const torch::Tensor& x, const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                           double eps, const std::vector<torch::Tensor>& qkv_proj, const torch::Tensor& q_norm,
                           const torch::Tensor& k_norm, const std::vector<torch::Tensor>& o_proj,
                           const std::vector<torch::Tensor>& gate_up_proj, const std::vector<torch::Tensor>& down_proj,
                           int64_t num_heads, const torch::Tensor& cos, const torch::Tensor& sin,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens) {
  const int64_t M = x.size(0), D = k_cache.size(3), q_size = num_heads * D;
  torch::Tensor qkv = linear(rms_norm(x, input_norm, eps), qkv_proj);  // [M, (Hq + 2 Hkv) D]
  torch::Tensor q = attention_inputs(qkv, q_norm, k_norm, eps, num_heads, cos, sin, k_cache, v_cache, slot_mapping);
  torch::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 1.0 / std::sqrt(double(D)));
  torch::Tensor h = x + linear(attn.view({M, q_size}), o_proj);
  return h + linear(swiglu(linear(rms_norm(h, post_norm, eps), gate_up_proj)), down_proj);
}

bool has_avx2() {
#ifdef NANOQWEN_AVX2
  return true;
#else
  return false;
#endif
}

bool has_bf16_dot() {
#ifdef NANOQWEN_BF16_DOT
  return true;
#else
  return false;
#endif
}

bool has_vnni() {
#if defined(NANOQWEN_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return true;
#else
  return false;
#endif
}

// The GIL is released while a kernel runs (it touches no Python objects), as torch's own ops do.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_gemv", &bf16_gemv, "y = x @ w.T + bias for few rows of x (bf16, float32 accumulation)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemv", &int8_gemv, "y = (x @ q.T) * scale for few rows of x (int8 weights, float32 accumulation)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("int4_gemv", &int4_gemv, "y = x @ (offset + scale * q).T for few rows of x (group-wise int4 weights)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("offset"), py::call_guard<py::gil_scoped_release>());
  m.def("int4_gemm", &int4_gemm, "int4_gemv's product for many rows of x: packed panels, a small GEMM",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("offset"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "models.qwen3.rms_norm for bf16 rows", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("apply_rope", &apply_rope, "models.qwen3.apply_rope for bf16 x [N, H, D]", py::arg("x"), py::arg("cos"),
        py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("swiglu", &swiglu, "models.qwen3.swiglu for bf16 gate_up [N, 2I]", py::arg("gate_up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("attention_inputs", &attention_inputs, "q, k normed and rotated, k and v stored: decode_layer's step "
        "between qkv_proj and attention", py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"),
        py::arg("num_heads"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention reading the paged KV cache in place",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_layer", &decode_layer, "one decoder layer for decode rows (see ops/decode_step.py)", py::arg("x"),
        py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv_proj"), py::arg("q_norm"),
        py::arg("k_norm"), py::arg("o_proj"), py::arg("gate_up_proj"), py::arg("down_proj"), py::arg("num_heads"),
        py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"),
        py::call_guard<py::gil_scoped_release>());
  m.def("has_avx2", &has_avx2, "whether this build uses the AVX2 + FMA kernels (else the scalar loops)");
  m.def("has_vnni", &has_vnni, "whether int4_gemv's integer dot products use AVX-512 VNNI (else AVX2)");
  m.def("has_bf16_dot", &has_bf16_dot,
        "whether bf16_gemv and int8_gemv multiply with AVX-512 BF16 dot products (else widened FMAs)");
}
