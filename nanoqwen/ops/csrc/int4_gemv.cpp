// int4 weights times few or many rows of bf16 x, on CPUs with AVX2 + FMA (AVX-512 VNNI where present).
//
//   int4_gemv(x [M,K] bf16, packed [N,K/2] uint8, scale, offset [N,K/G] bf16) -> y [M,N] bf16,
//             y = x' @ (offset + scale * q).T per group, x' = x quantised to int8 per group (below);
//             any M: above 8 rows a small GEMM on unpacked panels of W (int4_gemm)
//
// int4 layout (nanoqwen/quantization.py): row n is cut into groups of G consecutive elements (G % 16 == 0);
// group g has G/2 bytes, byte j holding element j in its low nibble and element j + G/2 in its high nibble,
// each a q in 0..15, and the weight is offset[n, g] + scale[n, g] * q.

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

// ---- Few rows of x (decode): int4 weights times int8-quantised activations (the q4 x q8 dot product
// llama.cpp uses).
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
      const float d = absmax_bf16(xb, G) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      int64_t k = 0;
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

// dots[r][m] = y[m, r] above for R packed int4 rows (layout at the top) and M rows of quantised x. C is the
// number of 32-byte chunks in a group when known at compile time (1 for the default G = 64, so the group loop
// unrolls with no inner loop: 1.1-1.3x the rate from cache, BENCHMARKS.md), 0 to take it from G.
template <int M, int R, int C>
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
        for (int64_t chunk = 0; chunk < (C > 0 ? C : half / 32); ++chunk)
          for (int r = 0; r < R; ++r) {
            const int64_t c = 32 * chunk;
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

// y[m, n] for n in [begin, end): the int4 counterpart of rows() in gemv.cpp (two streams for M <= 2).
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
    if (G == 64)
      dot_rows_int4<M, RR, 1>(x, K, G, wr, sr, orr, dots);
    else
      dot_rows_int4<M, RR, 0>(x, K, G, wr, sr, orr, dots);
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

// Checks of int4_gemv's weights; returns G (the group size).
int64_t check_int4(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offset) {
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
  at::Tensor x, packed, scale, offset, y;
  int64_t M, K, N, G;
  QuantizedX xq;
  const uint8_t* wp() const { return packed.data_ptr<uint8_t>(); }
  const uint16_t* sp() const { return reinterpret_cast<const uint16_t*>(scale.data_ptr()); }
  const uint16_t* op() const { return reinterpret_cast<const uint16_t*>(offset.data_ptr()); }
  at::BFloat16* yp() const { return y.data_ptr<at::BFloat16>(); }
};

Int4Product prepare_int4(const at::Tensor& x_in, const at::Tensor& packed_in, const at::Tensor& scale_in,
                         const at::Tensor& offset_in) {
  TORCH_CHECK(x_in.device().is_cpu(), "x must be a CPU tensor");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.dim() == 2, "x must be 2-D [M, K], got ", x_in.sizes());
  const int64_t G = check_int4(packed_in, scale_in, offset_in);
  const int64_t M = x_in.size(0), K = x_in.size(1), N = packed_in.size(0);
  TORCH_CHECK(2 * packed_in.size(1) == K, "x has K=", K, " but packed holds K=", 2 * packed_in.size(1));
  Int4Product p{x_in.contiguous(), packed_in.contiguous(), scale_in.contiguous(), offset_in.contiguous(),
                at::empty({M, N}, x_in.options().dtype(at::kBFloat16)), M, K, N, G, {}};
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

}  // namespace

// Few rows: passes that stream the weights; more: the panels (measured: below 9 rows, the panels' unpacking
// costs more than it saves; at 16 the panels ran 1.2x (AVX2) to 1.4x (VNNI) two passes).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& offset) {
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
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& offset) {
  const Int4Product p = prepare_int4(x, packed, scale, offset);
  if (p.M > 0 && p.N > 0) int4_panels(p);
  return p.y;
}

}  // namespace nanoqwen
