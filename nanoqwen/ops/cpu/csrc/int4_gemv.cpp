// int4 weights times few or many rows of bf16 x, on CPUs with AVX2 + FMA (AVX-512 VNNI where present).
//
//   int4_gemv(x [M,K] bf16, packed [N,K/2] uint8, scale, offset [N,K/G] bf16, float32 or float16) -> y [M,N] bf16,
//             y = x' @ (offset + scale * q).T per group, x' = x quantised to int8 per group (below);
//             any M: above 8 rows a small GEMM on unpacked panels of W (int4_gemm)
//   no offset (None): symmetric, each weight scale * (q - 8), as a GGUF file's Q4_0 holds them (the offset -8 scale,
//             exact in float32, made from the scale as it is read: 18 bytes a group of 32 weights with float16 scales)
//   two-level scales, as a GGUF file's Q4_K holds them: scale, offset [N,K/G] uint8 (6-bit) and super_scale,
//             super_offset [N,K/(8G)] float32, a group's scale super_scale * scale and offset super_offset * offset
//             (exact in float32: nanoqwen/quantization/prequantized.py), 152 bytes a block of 256 weights, not 192
//
// int4 layout (nanoqwen/quantization/int4.py): row n is cut into groups of G consecutive elements (G % 16 == 0);
// group g has G/2 bytes, byte j holding element j in its low nibble and element j + G/2 in its high nibble,
// each a q in 0..15, and the weight is offset[n, g] + scale[n, g] * q. The rows are stored in blocks of
// kBlockRows = 16 (the last block holds the N % 16 rows left, if any), a block of L rows lane by lane: for
// each group g and each 4 bytes c of it (c < G/8), the L rows' bytes 4c .. 4c + 3, one row after the other
// (4 L bytes); scale and offset for each group the L rows' values. 32 bytes then hold 4 bytes of each of 8
// rows, elements 4c .. 4c + 3 (low nibbles) and G/2 + 4c .. (high) of each, and one integer dot product
// instruction with x's 4 int8 of those elements broadcast adds each row's 4 products into that row's own lane:
// the lanes are output rows, so no sum crosses lanes, and a group's scales and offsets load as vectors of 8
// rows. (Rows one after the other, each summed along K inside a vector, take three times the instructions
// per weight byte, and such a kernel is slower from cache; bench/bench_gemv.py measures the kernels.)

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

constexpr int kBlockRows = 16;  // weight rows stored lane by lane (the layout above)
constexpr int kBlockVectors = kBlockRows / 8;

// ---- x quantised to int8 (the q4 x q8 dot product llama.cpp uses).
//
// A float FMA per weight makes the int4 kernel compute-bound, far below the read bandwidth (bench/bench_gemv.py
// measures both).
// Instead, x is quantised once per call to int8 in blocks of the weights' group size G (symmetric, one
// float32 scale per block: d = max|x| / 127, xq = round(x / d)), and each group's dot product
// sum_k q[k] * xq[k] is an integer one (vpdpbusd with AVX-512 VNNI; on AVX2 maddubs, u8 x s8 pairs summed to
// int16, a few of those added in int16, then madd with ones to int32: widen16 below). Per group g of row r and
// of x row m:
//     y[m, r] = sum_g scale[r, g] * d[m, g] * (sum_{k in g} q[r, k] xq[m, k])  +  sum_g offset[r, g] * xs[m, g]
// with xs[m, g] = d[m, g] * sum_{k in g} xq[m, k] (once per call): exactly x' @ W4.T for the dequantised
// activations x' = d * xq, which int4_gemv_reference in nanoqwen/ops/cpu/kernels.py computes. One float
// conversion and two FMAs per group and 8 rows; the rest is integer work.

// x quantised for int4_gemv: xq [M, K] int8; d and xs [M, K / G] float32 as above.
struct QuantizedX {
  std::vector<int8_t> xq;
  std::vector<float> d, xs;
};

// Rows m0.. of a QuantizedX (what a register tile reads).
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

#if defined(NANOQWEN_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;  // 256-bit integer dot products (vpdpbusd); the kernels' shape follows from this
#else
constexpr bool kVnni = false;
#endif

#ifdef NANOQWEN_AVX2
// Without VNNI, a dot product of 4 u8 w (0..15) with 4 s8 x per int32 lane takes three instructions: maddubs
// (u8 x s8 pairs summed to int16), madd with ones (int16 pairs to int32), add. The kernels below skip the middle
// one for most products: they add maddubs's int16 pair sums, each at most 2 * 15 * 127 = 3810 in size, in int16
// for up to kPairSums16 of them (30480 < 32767: exact), and widen the sum to int32 once (widen16). The same
// integers, so the same bits; faster products under the AVX2 limits (bench/bench_gemv.py measures them).
constexpr int kPairSums16 = 8;
inline __m256i pair_sums16(__m256i w, __m256i x) { return _mm256_maddubs_epi16(w, x); }
inline __m256i widen16(__m256i isum, __m256i sum16) {
  return _mm256_add_epi32(isum, _mm256_madd_epi16(sum16, _mm256_set1_epi16(1)));
}

// isum + for each of the 8 int32 lanes the sum of its 4 products of u8 w (0..15) with s8 x: one vpdpbusd.
// (As inline assembly, not _mm256_dpbusd_epi32: in panel_tile's loop GCC 12 copies each accumulator to another
// register and back around every one of those, two extra instructions per product instruction; the panels run
// faster without them.)
inline __m256i dot4(__m256i isum, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm("vpdpbusd %2, %1, %0" : "+v"(isum) : "v"(w), "v"(x));
  return isum;
#else
  return widen16(isum, pair_sums16(w, x));  // (the kernels take the two steps apart instead, as above)
#endif
}

// x's 4 int8 at p, broadcast to the 8 lanes.
inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}

// One group's float work for a register tile of T rows of x and 16 weight rows: acc[t][v] += (scale * d[t]) *
// isum[t][v] + offset * xs[t]. scale and offset: the group's 16 values as float32 (from a packed block's Scales, or
// a panel); d and xs: the tile's first row's (x.d, x.xs + m0 * groups + g; the next row's groups later).
template <int T>
inline void add_group(__m256 (&acc)[T][kBlockVectors], const __m256i (&isum)[T][kBlockVectors],
                      const __m256 (&scale)[kBlockVectors], const __m256 (&offset)[kBlockVectors], const float* d,
                      const float* xs, int64_t groups) {
  for (int v = 0; v < kBlockVectors; ++v) {
    const __m256 s = scale[v], o = offset[v];
    for (int t = 0; t < T; ++t) {
      const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(d[t * groups]));
      acc[t][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][v]), sd, acc[t][v]);
      acc[t][v] = _mm256_fmadd_ps(o, _mm256_set1_ps(xs[t * groups]), acc[t][v]);
    }
  }
}

// y[m0 + t, n0 .. n0 + cols - 1] from a tile's accumulators (each output rounded to bf16 once).
template <int T>
inline void store_tile(const __m256 (&acc)[T][kBlockVectors], int64_t N, int64_t m0, int64_t n0, int cols,
                       at::BFloat16* y) {
  for (int t = 0; t < T; ++t) {
    uint16_t* row = reinterpret_cast<uint16_t*>(y + (m0 + t) * N + n0);
    if (cols == kBlockRows) {
      for (int v = 0; v < kBlockVectors; ++v) store8_bf16(row + 8 * v, acc[t][v]);
      continue;
    }
    alignas(32) float out[kBlockRows];
    for (int v = 0; v < kBlockVectors; ++v) _mm256_store_ps(out + 8 * v, acc[t][v]);
    for (int c = 0; c < cols; ++c) row[c] = float_to_bf16(out[c]);
  }
}
#endif

// ---- Where a block's group scales and offsets come from.
//
// One value a group and row (S = uint16_t for bf16, float, at::Half), or two levels (S = uint8_t): a 6-bit sub-scale a group
// times a float32 a super-block of kSuperGroups groups, each lane by lane as the weights are (L lanes). Without offsets
// (offset null, one level only), a group's offset is -kSymmetricZero times its scale.
constexpr int kSuperGroups = 8;

template <typename S>
struct Scales {
  const S* scale;
  const S* offset;
  const float* super_scale;  // two levels only
  const float* super_offset;
  int L;
  float scale_at(int64_t g, int lane) const {
    if constexpr (std::is_same_v<S, uint8_t>)
      return super_scale[(g / kSuperGroups) * L + lane] * static_cast<float>(scale[g * L + lane]);
    else
      return to_float(scale[g * L + lane]);
  }
  float offset_at(int64_t g, int lane) const {
    if (offset == nullptr) return -kSymmetricZero * scale_at(g, lane);
    if constexpr (std::is_same_v<S, uint8_t>)
      return super_offset[(g / kSuperGroups) * L + lane] * static_cast<float>(offset[g * L + lane]);
    else
      return to_float(offset[g * L + lane]);
  }
#ifdef NANOQWEN_AVX2
  // lanes 8v .. 8v + 7 of group g (a whole block: L = kBlockRows)
  __m256 scale8(int64_t g, int v) const { return load(scale, super_scale, g, v); }
  __m256 offset8(int64_t g, int v) const {
    if (offset == nullptr) return _mm256_mul_ps(_mm256_set1_ps(-kSymmetricZero), scale8(g, v));
    return load(offset, super_offset, g, v);
  }
  static __m256 load(const S* sub, const float* super, int64_t g, int v) {
    if constexpr (std::is_same_v<S, uint8_t>) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + g * kBlockRows + 8 * v));
      return _mm256_mul_ps(load8(super + (g / kSuperGroups) * kBlockRows + 8 * v),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
    } else {
      return load8(sub + g * kBlockRows + 8 * v);
    }
  }
#endif
};

// The scales of the block of rows from n0 (L of them), from the whole matrix's (groups a row).
template <typename S>
Scales<S> block_scales(const S* scale, const S* offset, const float* super_scale, const float* super_offset,
                       int64_t n0, int64_t groups, int L) {
  const int64_t supers = groups / kSuperGroups;
  return {scale + n0 * groups, offset ? offset + n0 * groups : nullptr,
          super_scale ? super_scale + n0 * supers : nullptr, super_offset ? super_offset + n0 * supers : nullptr, L};
}

// ---- Few rows of x (decode): each block of 16 weight rows read once, its nibbles unpacked in registers.

constexpr int kMaxRowsInt4 = 8;  // rows of x that stream the weights; more go through the panels below
// rows of x per register tile: 4 with AVX-512's 32 vector registers, 2 with AVX2's 16
constexpr int kDecodeTile = kVnni ? 4 : 2;

// y[m0 .. m0 + T - 1, n0 .. n0 + 15] for one whole block of packed weights (w, scale, offset: the block's). C is
// the number of 4-byte chunks in a group (G / 8) where known at compile time (8 for the default G = 64: the
// chunk loop unrolls), 0 to take it from G.
template <int T, int C, typename S>
void block_tile(const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* w, const Scales<S>& sc,
                int64_t N, int64_t n0, at::BFloat16* y) {
#ifdef NANOQWEN_AVX2
  const int64_t groups = K / G, chunks = C > 0 ? C : G / 8;
  const __m256i nibble = _mm256_set1_epi8(0xF);
  __m256 acc[T][kBlockVectors];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < kBlockVectors; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // The scales and offsets 8 groups ahead: two slow streams of their own beside the weights', which the
    // hardware prefetcher alone lets fall behind (bench/ab_kernels.py measures it)
    _mm_prefetch(reinterpret_cast<const char*>(sc.scale + (g + 8) * kBlockRows), _MM_HINT_T0);
    if (sc.offset) _mm_prefetch(reinterpret_cast<const char*>(sc.offset + (g + 8) * kBlockRows), _MM_HINT_T0);
    // isum[P - 1]: the high nibbles' products. With one row of x and VNNI (S = 2) they have sums of their own,
    // two chains of dependent dot products per vector, not one; more rows of x give the chains without them.
    // Without VNNI, sum16: the int16 sums of the last chunks' products (2 pair sums a chunk; see widen16).
    constexpr int P = T == 1 && kVnni ? 2 : 1;
    __m256i isum[P][T][kBlockVectors], sum16[T][kBlockVectors];
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < kBlockVectors; ++v) {
        for (int i = 0; i < P; ++i) isum[i][t][v] = _mm256_setzero_si256();
        sum16[t][v] = _mm256_setzero_si256();
      }
    for (int64_t c = 0; c < chunks; ++c) {  // bytes 4c.. of the group's rows: elements 4c.. and G/2 + 4c..
      const uint8_t* wc = w + (g * chunks + c) * kBlockRows * 4;
      _mm_prefetch(reinterpret_cast<const char*>(wc) + kPrefetchBytes, _MM_HINT_T0);
      __m256i lo[kBlockVectors], hi[kBlockVectors];
      for (int v = 0; v < kBlockVectors; ++v) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * v));
        lo[v] = _mm256_and_si256(b, nibble);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
      }
      for (int t = 0; t < T; ++t) {
        const int8_t* xg = x.xq + (m0 + t) * K + g * G + 4 * c;
        const __m256i x_lo = broadcast4(xg), x_hi = broadcast4(xg + G / 2);
        for (int v = 0; v < kBlockVectors; ++v) {
          if constexpr (kVnni) {
            isum[0][t][v] = dot4(isum[0][t][v], lo[v], x_lo);
            isum[P - 1][t][v] = dot4(isum[P - 1][t][v], hi[v], x_hi);
          } else {
            const __m256i both = _mm256_add_epi16(pair_sums16(lo[v], x_lo), pair_sums16(hi[v], x_hi));
            sum16[t][v] = _mm256_add_epi16(sum16[t][v], both);
          }
        }
      }
      if (!kVnni && ((c + 1) % (kPairSums16 / 2) == 0 || c + 1 == chunks))
        for (int t = 0; t < T; ++t)
          for (int v = 0; v < kBlockVectors; ++v) {
            isum[0][t][v] = widen16(isum[0][t][v], sum16[t][v]);
            sum16[t][v] = _mm256_setzero_si256();
          }
    }
    if constexpr (P == 2)
      for (int t = 0; t < T; ++t)
        for (int v = 0; v < kBlockVectors; ++v) isum[0][t][v] = _mm256_add_epi32(isum[0][t][v], isum[1][t][v]);
    __m256 s[kBlockVectors], o[kBlockVectors];
    for (int v = 0; v < kBlockVectors; ++v) s[v] = sc.scale8(g, v), o[v] = sc.offset8(g, v);
    add_group<T>(acc, isum[0], s, o, x.d + m0 * groups + g, x.xs + m0 * groups + g, groups);
  }
  store_tile<T>(acc, N, m0, n0, kBlockRows, y);
#endif
}

// y[m, n0 + lane] for rows m0 .. m0 + rows - 1 of x and a block of L packed rows, one value at a time, with the
// vector loop's float operations in its order (so the same bits): the last block when N % 16 != 0 (the vector
// loop above takes whole blocks), and every block without AVX2.
template <typename S>
void block_scalar(const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, int rows, const uint8_t* w,
                  const Scales<S>& sc, int L, int64_t N, int64_t n0, at::BFloat16* y) {
  const int64_t groups = K / G, chunks = G / 8;
  for (int64_t m = m0; m < m0 + rows; ++m)
    for (int lane = 0; lane < L; ++lane) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t isum = 0;
        for (int64_t c = 0; c < chunks; ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = w[((g * chunks + c) * L + lane) * 4 + i];
            const int8_t* xg = x.xq + m * K + g * G + 4 * c + i;
            isum += (byte & 0xF) * xg[0] + (byte >> 4) * xg[G / 2];
          }
        const float sd = sc.scale_at(g, lane) * x.d[m * groups + g];  // as add_group, lane by lane
        total = std::fma(static_cast<float>(isum), sd, total);
        total = std::fma(sc.offset_at(g, lane), x.xs[m * groups + g], total);
      }
      y[m * N + n0 + lane] = at::BFloat16(total);  // one rounding, RNE
    }
}

// block_tile for T = rows (1 .. kDecodeTile) rows of x.
template <typename S, int T = kDecodeTile>
void block_tiles(int rows, const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* w,
                 const Scales<S>& sc, int64_t N, int64_t n0, at::BFloat16* y) {
  if constexpr (T > 1) {
    if (rows < T) return block_tiles<S, T - 1>(rows, x, K, G, m0, w, sc, N, n0, y);
  }
  if (G == 64)
    block_tile<T, 8>(x, K, G, m0, w, sc, N, n0, y);
  else if (G == 32)
    block_tile<T, 4>(x, K, G, m0, w, sc, N, n0, y);
  else
    block_tile<T, 0>(x, K, G, m0, w, sc, N, n0, y);
}

// Checks of int4_gemv's weights; returns G (the group size).
int64_t check_int4(const at::Tensor& packed, const at::Tensor& scale, const std::optional<at::Tensor>& offset_in,
                   const std::optional<at::Tensor>& super_scale, const std::optional<at::Tensor>& super_offset) {
  // no offset: the scale's values stand for both (Scales::offset_at)
  const at::Tensor& offset = offset_in ? *offset_in : scale;
  TORCH_CHECK(packed.device().is_cpu() && scale.device().is_cpu() && offset.device().is_cpu(),
              "packed, scale and offset must be CPU tensors");
  TORCH_CHECK(offset_in || !super_scale, "two-level scales need their offsets (only one level may omit them)");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 2, "packed must be 2-D [N, K/2], got ", packed.sizes());
  const bool two_level = scale.scalar_type() == at::kByte;
  TORCH_CHECK(two_level == (super_scale.has_value() && super_offset.has_value()),
              "uint8 scale and offset go with super_scale and super_offset (two levels), and only they do");
  if (two_level) {
    TORCH_CHECK(scale.size(1) % kSuperGroups == 0, "two-level scales need whole super-blocks of ", kSuperGroups,
                " groups, got ", scale.size(1), " groups");
    for (const auto* t : {&*super_scale, &*super_offset})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                      t->size(0) == packed.size(0) && t->size(1) * kSuperGroups == scale.size(1),
                  "super_scale and super_offset must be float32 [N, groups / ", kSuperGroups, "], got ",
                  t->scalar_type(), " ", t->sizes());
  }
  for (const auto* t : {&scale, &offset}) {
    const char* name = t == &scale ? "scale" : "offset";
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 || t->scalar_type() == at::kFloat ||
                    t->scalar_type() == at::kHalf || two_level,
                name, " must be bfloat16, float32, float16 or (two levels) uint8, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 2 && t->size(0) == packed.size(0) && t->size(1) > 0, name, " must be [N, K/G] with N=",
                packed.size(0), ", got ", t->sizes());
  }
  TORCH_CHECK(scale.sizes() == offset.sizes(), "scale and offset must have the same shape");
  TORCH_CHECK(scale.scalar_type() == offset.scalar_type(), "scale and offset must have the same dtype");
  const int64_t K = 2 * packed.size(1), groups = scale.size(1);
  TORCH_CHECK(K % groups == 0 && (K / groups) % 16 == 0, "K=", K, " and ", groups,
              " groups per row: the group size K/groups must be a whole multiple of 16");
  return K / groups;
}

// An int4 product's inputs, checked, made contiguous, and x quantised (int4_gemv and int4_gemm share it).
struct Int4Product {
  at::Tensor x, packed, scale, offset, super_scale, super_offset, y;  // offset undefined: symmetric
  int64_t M, K, N, G;
  QuantizedX xq;
  const uint8_t* wp() const { return packed.data_ptr<uint8_t>(); }
  // the scales of the L rows from n0, as S: uint16_t (bf16), float, or uint8_t (two levels), as scale's dtype says
  template <typename S>
  Scales<S> scales(int64_t n0, int L) const {
    const float* ss = super_scale.defined() ? super_scale.data_ptr<float>() : nullptr;
    const float* so = super_offset.defined() ? super_offset.data_ptr<float>() : nullptr;
    return block_scales(reinterpret_cast<const S*>(scale.data_ptr()),
                        offset.defined() ? reinterpret_cast<const S*>(offset.data_ptr()) : nullptr,
                        ss, so, n0, K / G, L);
  }
  at::BFloat16* yp() const { return y.data_ptr<at::BFloat16>(); }
};

// f(std::type_identity<S>) with S the scales' type.
template <typename F>
void with_scale_type(const Int4Product& p, const F& f) {
  switch (p.scale.scalar_type()) {
    case at::kFloat: return f(std::type_identity<float>{});
    case at::kHalf: return f(std::type_identity<at::Half>{});
    case at::kByte: return f(std::type_identity<uint8_t>{});
    default: return f(std::type_identity<uint16_t>{});
  }
}

Int4Product prepare_int4(const at::Tensor& x_in, const at::Tensor& packed_in, const at::Tensor& scale_in,
                         const std::optional<at::Tensor>& offset_in, const std::optional<at::Tensor>& super_scale,
                         const std::optional<at::Tensor>& super_offset) {
  TORCH_CHECK(x_in.device().is_cpu(), "x must be a CPU tensor");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.dim() == 2, "x must be 2-D [M, K], got ", x_in.sizes());
  const int64_t G = check_int4(packed_in, scale_in, offset_in, super_scale, super_offset);
  const int64_t M = x_in.size(0), K = x_in.size(1), N = packed_in.size(0);
  TORCH_CHECK(2 * packed_in.size(1) == K, "x has K=", K, " but packed holds K=", 2 * packed_in.size(1));
  Int4Product p{x_in.contiguous(), packed_in.contiguous(), scale_in.contiguous(),
                offset_in ? offset_in->contiguous() : at::Tensor(),
                super_scale ? super_scale->contiguous() : at::Tensor(),
                super_offset ? super_offset->contiguous() : at::Tensor(),
                new_output({M, N}, x_in.options().dtype(at::kBFloat16)), M, K, N, G, {}};
  if (M > 0 && N > 0)  // x quantised to int8 once
    p.xq = quantize_x(reinterpret_cast<const uint16_t*>(p.x.data_ptr()), M, K, G);
  return p;
}

// Few rows of x: the blocks of weight rows shared among the threads (parallel_rows_stealing, in claims of at least
// kClaimBytes), each block read from memory once and run by every tile of rows of x.
template <typename S>
void int4_passes(const Int4Product& p) {
  const int64_t K = p.K, N = p.N, G = p.G, groups = K / G;
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, kBlockRows * K / 2));
  const QuantizedRows x{p.xq.xq.data(), p.xq.d.data(), p.xq.xs.data()};
  const int64_t claim = std::max<int64_t>(1, kClaimBytes / (kBlockRows * K / 2));
  parallel_rows_stealing(blocks, grain, claim, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockRows;
      const int L = static_cast<int>(std::min<int64_t>(kBlockRows, N - n0));
      const uint8_t* w = p.wp() + n0 * (K / 2);
      const Scales<S> sc = p.scales<S>(n0, L);
      for (int64_t m0 = 0; m0 < p.M; m0 += kDecodeTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kDecodeTile, p.M - m0));
#ifdef NANOQWEN_AVX2
        if (L == kBlockRows) {
          block_tiles(rows, x, K, G, m0, w, sc, N, n0, p.yp());
          continue;
        }
#endif
        block_scalar(x, K, G, m0, rows, w, sc, L, N, n0, p.yp());
      }
    }
  });
}

// ---- int4 products over many rows of x (prefill, large batches): a small GEMM on unpacked panels.
//
// block_tile above unpacks each nibble in registers for every tile of rows of x that reads it: fine while the
// weights' bytes are the cost, but with hundreds of rows the same nibbles would be unpacked again for every
// tile. int4_gemm computes the same function (x quantised per group as above; same integer dots, same
// per-group float32 FMAs, only the order of the float32 additions differs) the way GEMMs do: it unpacks one
// block of 16 weight rows at a time into a small buffer, a panel, and runs every row of x over it.
//
// Panel layout: for group g and each 4 consecutive elements (a "quad" kq of the group) the panel holds
// kBlockRows * 4 bytes, lane by lane: weight row n0 + lane, elements g * G + 4 * kq .. + 3, each 0..15 (rows past
// N as zeros); its scales and offsets as float32 [groups][kBlockRows]. The packed block's 4 bytes c of each row
// unpack to quads c (low nibbles) and G/8 + c (high): one AND, or a shift and an AND, per 32 bytes. A register
// tile is kTileRows rows of x times the panel's 16 rows (2 vectors).
constexpr int kTileRows = 4;  // rows of x per register tile (measured against 3, 5 and 6, and panels of 24, 32)

// Unpacks the block of weight rows n0 .. (L = min(16, N - n0) of them) into panel, panel_scale, panel_offset.
template <typename S>
void pack_panel(const uint8_t* wp, const Int4Product& p, int64_t N, int64_t K, int64_t G,
                int64_t n0, uint8_t* panel, float* panel_scale, float* panel_offset) {
  const int64_t groups = K / G, chunks = G / 8, quads = G / 4;
  const int L = static_cast<int>(std::min<int64_t>(kBlockRows, N - n0));
  const uint8_t* w = wp + n0 * (K / 2);
  const Scales<S> sc = p.scales<S>(n0, L);
#ifdef NANOQWEN_AVX2
  if (L == kBlockRows) {
    // (the vector loads compute scale_at / offset_at's values: the same products, so the same bits)
    for (int64_t g = 0; g < groups; ++g)
      for (int v = 0; v < kBlockVectors; ++v) {
        _mm256_storeu_ps(panel_scale + g * kBlockRows + 8 * v, sc.scale8(g, v));
        _mm256_storeu_ps(panel_offset + g * kBlockRows + 8 * v, sc.offset8(g, v));
      }
    const __m256i nibble = _mm256_set1_epi8(0xF);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t c = 0; c < chunks; ++c)
        for (int v = 0; v < kBlockVectors; ++v) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ((g * chunks + c) * 2 + v) * 32));
          uint8_t* at_lo = panel + ((g * quads + c) * kBlockRows + 8 * v) * 4;
          uint8_t* at_hi = panel + ((g * quads + chunks + c) * kBlockRows + 8 * v) * 4;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_lo), _mm256_and_si256(b, nibble));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_hi), _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble));
        }
    return;
  }
#endif
  for (int64_t g = 0; g < groups; ++g)  // the last, partial block (and any block without AVX2)
    for (int lane = 0; lane < kBlockRows; ++lane) {
      panel_scale[g * kBlockRows + lane] = lane < L ? sc.scale_at(g, lane) : 0.0f;
      panel_offset[g * kBlockRows + lane] = lane < L ? sc.offset_at(g, lane) : 0.0f;
    }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      for (int lane = 0; lane < kBlockRows; ++lane)
        for (int i = 0; i < 4; ++i) {
          const uint8_t b = lane < L ? w[((g * chunks + c) * L + lane) * 4 + i] : 0;
          panel[((g * quads + c) * kBlockRows + lane) * 4 + i] = b & 0xF;
          panel[((g * quads + chunks + c) * kBlockRows + lane) * 4 + i] = b >> 4;
        }
}

#ifdef NANOQWEN_AVX2
// Share g of `groups` of the bytes at ahead (none if null) asked for into L2: a panel tile fetches the next panel's
// packed weights a share a group while it computes.
inline void fetch_share(const uint8_t* ahead, int64_t bytes, int64_t g, int64_t groups) {
  if (ahead == nullptr) return;
  const int64_t share = (bytes + groups - 1) / groups;
  for (int64_t b = g * share; b < std::min(bytes, (g + 1) * share); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T1);
}
#endif

// y[m, n0 ..] for rows m0 .. m0 + T - 1 of x over one panel; cols = how many of its rows are real. ahead (or null):
// ahead_bytes of packed weights to fetch into the cache meanwhile, a share each group (the next panel's).
template <int T>
void panel_tile(const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* panel,
                const float* panel_scale, const float* panel_offset, int64_t N, int64_t n0, int cols,
                at::BFloat16* y, const uint8_t* ahead, int64_t ahead_bytes) {
#ifdef NANOQWEN_AVX2
  const int64_t groups = K / G, quads = G / 4;
  constexpr int V = kBlockVectors;
  __m256 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    fetch_share(ahead, ahead_bytes, g, groups);
    __m256i isum[T][V], sum16[T][V];  // sum16: without VNNI, the last quads' int16 pair sums (widen16)
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < V; ++v) isum[t][v] = sum16[t][v] = _mm256_setzero_si256();
    const uint8_t* pg = panel + g * quads * kBlockRows * 4;
    for (int64_t kq = 0; kq < quads; ++kq) {
      __m256i w[V];
      for (int v = 0; v < V; ++v)
        w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + kq * kBlockRows * 4 + 32 * v));
      for (int t = 0; t < T; ++t) {
        const __m256i xb = broadcast4(x.xq + (m0 + t) * K + g * G + 4 * kq);  // x's 4 int8 of this quad
        for (int v = 0; v < V; ++v) {
          if constexpr (kVnni)
            isum[t][v] = dot4(isum[t][v], w[v], xb);
          else
            sum16[t][v] = _mm256_add_epi16(sum16[t][v], pair_sums16(w[v], xb));
        }
      }
      if (!kVnni && ((kq + 1) % kPairSums16 == 0 || kq + 1 == quads))
        for (int t = 0; t < T; ++t)
          for (int v = 0; v < V; ++v) {
            isum[t][v] = widen16(isum[t][v], sum16[t][v]);
            sum16[t][v] = _mm256_setzero_si256();
          }
    }
    __m256 s[V], o[V];
    for (int v = 0; v < V; ++v)
      s[v] = _mm256_loadu_ps(panel_scale + g * kBlockRows + 8 * v), o[v] = _mm256_loadu_ps(panel_offset + g * kBlockRows + 8 * v);
    add_group<T>(acc, isum, s, o, x.d + m0 * groups + g, x.xs + m0 * groups + g, groups);
  }
  store_tile<T>(acc, N, m0, n0, cols, y);
#endif
}

#if defined(NANOQWEN_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512F__)
#define NANOQWEN_INT4_PANELS512
// panel_tile on 512-bit vectors, where the CPU has AVX-512 VNNI: a quad's 16 weight rows are one vector (its 16 int32
// lanes the 16 output rows) and one vpdpbusd adds 64 products, where the 256-bit kernel needs two instructions (AMD's
// Zen 4 adds more products a cycle so; bench/bench_batch_decode.py --formats int4 measures the steps). The same
// integers and the same float32 operations lane by lane as panel_tile, so the same bits.
constexpr int kPanelTileRows = 8;  // rows of x per register tile: 8 sums and 8 accumulators of the 32 registers

template <int T>
void panel_tile512(const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* panel,
                   const float* panel_scale, const float* panel_offset, int64_t N, int64_t n0, int cols,
                   at::BFloat16* y, const uint8_t* ahead, int64_t ahead_bytes) {
  const int64_t groups = K / G, quads = G / 4;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    fetch_share(ahead, ahead_bytes, g, groups);
    __m512i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm512_setzero_si512();
    const uint8_t* pg = panel + g * quads * kBlockRows * 4;
    for (int64_t kq = 0; kq < quads; ++kq) {
      const __m512i w = _mm512_loadu_si512(pg + kq * kBlockRows * 4);
      for (int t = 0; t < T; ++t) {
        int32_t four;
        std::memcpy(&four, x.xq + (m0 + t) * K + g * G + 4 * kq, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        isum[t] = _mm512_dpbusd_epi32(isum[t], w, xb);
      }
    }
    const __m512 sc = _mm512_loadu_ps(panel_scale + g * kBlockRows);
    const __m512 off = _mm512_loadu_ps(panel_offset + g * kBlockRows);
    const float* d = x.d + m0 * groups + g;
    const float* xs = x.xs + m0 * groups + g;
    for (int t = 0; t < T; ++t) {  // add_group's operations
      const __m512 sd = _mm512_mul_ps(sc, _mm512_set1_ps(d[t * groups]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), sd, acc[t]);
      acc[t] = _mm512_fmadd_ps(off, _mm512_set1_ps(xs[t * groups]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {  // (the 256-bit halves: lanes 0-7 and 8-15)
    const __m256 row[1][kBlockVectors] = {
        {_mm512_castps512_ps256(acc[t]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1))}};
    store_tile<1>(row, N, m0 + t, n0, cols, y);
  }
}
#else
constexpr int kPanelTileRows = kTileRows;
#endif

// panel_tile (panel_tile512 where built) for T = rows (1 .. kPanelTileRows) rows of x.
template <int T = kPanelTileRows>
void panel_tiles(int rows, const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* panel,
                 const float* panel_scale, const float* panel_offset, int64_t N, int64_t n0, int cols,
                 at::BFloat16* y, const uint8_t* ahead, int64_t ahead_bytes) {
  if constexpr (T > 1) {
    if (rows < T)
      return panel_tiles<T - 1>(rows, x, K, G, m0, panel, panel_scale, panel_offset, N, n0, cols, y, ahead,
                                ahead_bytes);
  }
#ifdef NANOQWEN_INT4_PANELS512
  panel_tile512<T>(x, K, G, m0, panel, panel_scale, panel_offset, N, n0, cols, y, ahead, ahead_bytes);
#else
  panel_tile<T>(x, K, G, m0, panel, panel_scale, panel_offset, N, n0, cols, y, ahead, ahead_bytes);
#endif
}

template <typename S>
void int4_panels(const Int4Product& p) {
#ifndef NANOQWEN_AVX2
  // without AVX2 every block of weight rows goes through block_scalar: the same bits, with nothing to unpack
  int4_passes<S>(p);
#else
  const int64_t M = p.M, K = p.K, N = p.N, G = p.G, groups = K / G;
  const QuantizedRows rows{p.xq.xq.data(), p.xq.d.data(), p.xq.xs.data()};
  const int64_t panels = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> panel(kBlockRows * K);  // this thread's panel: 16 KB for K = 1024
    std::vector<float> panel_scale(kBlockRows * groups), panel_offset(kBlockRows * groups);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * kBlockRows;
      const int cols = static_cast<int>(std::min<int64_t>(kBlockRows, N - n0));
      pack_panel<S>(p.wp(), p, N, K, G, n0, panel.data(), panel_scale.data(), panel_offset.data());
      // the next block's packed weights, fetched while the first tile of rows computes: unpacking it then reads
      // from the cache, not from memory with nothing else to do
      const int64_t next = n0 + kBlockRows, next_rows = i + 1 < end ? std::min(N, next + kBlockRows) - next : 0;
      const uint8_t* ahead = next_rows > 0 ? p.wp() + next * (K / 2) : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kPanelTileRows)
        panel_tiles(static_cast<int>(std::min<int64_t>(kPanelTileRows, M - m0)), rows, K, G, m0, panel.data(),
                    panel_scale.data(), panel_offset.data(), N, n0, cols, p.yp(), m0 == 0 ? ahead : nullptr,
                    next_rows * (K / 2));
    }
  });
#endif
}

// ---- The panels' product on AMX tiles (amx.cpp): two panels (32 weight rows) at a time, x's rows 16 at a time
// (x's int8 copy padded with zero rows to a whole tile), the same function as int4_panels.
bool amx_takes_group(int64_t G) { return G <= 64 || G % 64 == 0; }

template <typename S>
void int4_amx_panels(const Int4Product& p) {
  const int64_t M = p.M, K = p.K, N = p.N, G = p.G, groups = K / G;
  std::vector<int8_t> xq((M + 15) / 16 * 16 * K, 0);
  std::memcpy(xq.data(), p.xq.xq.data(), M * K);
  const int64_t panels = (N + kBlockRows - 1) / kBlockRows, pairs = (panels + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> panel(2 * kBlockRows * K);
    std::vector<float> panel_scale(2 * kBlockRows * groups), panel_offset(2 * kBlockRows * groups);
    amx_int4_begin(G);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = 2 * i * kBlockRows;
      const int np = 2 * i + 1 < panels ? 2 : 1;
      int cols[2] = {0, 0};
      for (int j = 0; j < np; ++j) {
        cols[j] = static_cast<int>(std::min<int64_t>(kBlockRows, N - n0 - j * kBlockRows));
        pack_panel<S>(p.wp(), p, N, K, G, n0 + j * kBlockRows, panel.data() + j * kBlockRows * K,
                      panel_scale.data() + j * kBlockRows * groups, panel_offset.data() + j * kBlockRows * groups);
      }
      // the next pair's packed weights, fetched into L2 while this pair's first tile of rows computes
      const int64_t next = std::min(N, n0 + 2 * kBlockRows), next_rows = std::min(N, next + 2 * kBlockRows) - next;
      const uint8_t* ahead = i + 1 < end ? p.wp() + next * (K / 2) : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 16)
        amx_int4_tile(xq.data(), p.xq.d.data(), p.xq.xs.data(), K, G, m0, static_cast<int>(std::min<int64_t>(16, M - m0)),
                      panel.data(), panel_scale.data(), panel_offset.data(), np, cols, N, n0, p.yp(),
                      m0 == 0 ? ahead : nullptr, next_rows * (K / 2));
    }
    amx_end();
  });
}

}  // namespace

// Few rows: passes that stream the weights; more: the panels (bench/bench_gemv.py --rows measures it: below 9
// rows, the panels' unpacking costs more than it saves; at 16 the panels are faster than two passes).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& super_scale,
                     const std::optional<at::Tensor>& super_offset, int64_t amx_min_rows) {
  const Int4Product p = prepare_int4(x, packed, scale, offset, super_scale, super_offset);
  if (p.M == 0 || p.N == 0) return p.y;
  const bool amx = amx_min_rows > 0 && p.M >= amx_min_rows && amx_takes_group(p.G) && amx_int8_ready();
  with_scale_type(p, [&](auto type) {
    using S = typename decltype(type)::type;
    if (amx)
      int4_amx_panels<S>(p);
    else if (p.M <= kMaxRowsInt4)
      int4_passes<S>(p);
    else
      int4_panels<S>(p);
  });
  return p.y;
}

// int4_gemv's product through the panels whatever the row count (int4_gemv takes them above kMaxRowsInt4 rows;
// exposed so that tests reach them with few rows too).
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& super_scale,
                     const std::optional<at::Tensor>& super_offset) {
  const Int4Product p = prepare_int4(x, packed, scale, offset, super_scale, super_offset);
  if (p.M > 0 && p.N > 0)
    with_scale_type(p, [&](auto type) { int4_panels<typename decltype(type)::type>(p); });
  return p.y;
}

}  // namespace nanoqwen

namespace nanoqwen {

// int4_gemv's product on AMX tiles whatever the row count (int4_gemv takes them from amx_min_rows rows on; exposed
// so that tests and the selection's probe reach them). Needs amx_int8_ready() and G <= 64 or a multiple of 64.
at::Tensor int4_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                    const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& super_scale,
                    const std::optional<at::Tensor>& super_offset) {
  TORCH_CHECK(amx_int8_ready(), "int4_amx: this CPU has no AMX-INT8 tiles, or Linux did not grant them");
  const Int4Product p = prepare_int4(x, packed, scale, offset, super_scale, super_offset);
  TORCH_CHECK(amx_takes_group(p.G), "int4_amx: group size ", p.G, " is not <= 64 or a multiple of 64");
  if (p.M > 0 && p.N > 0)
    with_scale_type(p, [&](auto type) { int4_amx_panels<typename decltype(type)::type>(p); });
  return p.y;
}

}  // namespace nanoqwen
