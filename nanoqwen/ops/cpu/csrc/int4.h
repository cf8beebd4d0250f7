// What the int4 kernels share (int4_gemv.cpp: few rows of x; int4_gemm.cpp: many, on panels, and on AMX tiles):
// the int4 layout, x quantised to int8, the integer dot products, the group scales, a product's checked inputs.
//
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

#pragma once

#include "cpu_kernels.h"

namespace nanoqwen::int4 {

constexpr int kBlockRows = 16;  // weight rows stored lane by lane (the layout above)
constexpr int kBlockVectors = kBlockRows / 8;

// Blocks of kBlockRows weight rows (K / 2 packed bytes each) a work-stealing claim takes: at least kClaimBytes of
// packed weights (parallel_rows_stealing; int4_gemv's blocks and int4_gemm's panels).
inline int64_t claim_blocks(int64_t K) { return std::max<int64_t>(1, kClaimBytes / (kBlockRows * K / 2)); }

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

QuantizedX quantize_x(const uint16_t* x, int64_t M, int64_t K, int64_t G);  // (int4_gemv.cpp)

#if defined(NANOQWEN_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;  // 256-bit integer dot products (vpdpbusd); the kernels' shape follows from this
#else
constexpr bool kVnni = false;
#endif

#ifdef NANOQWEN_AVX2
// Without VNNI, a dot product of 4 u8 w (0..15) with 4 s8 x per int32 lane takes three instructions: maddubs
// (u8 x s8 pairs summed to int16), madd with ones (int16 pairs to int32), add. The kernels skip the middle
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

// x's int4 product's inputs checked, made contiguous, x quantised (int4_gemv.cpp)
Int4Product prepare_int4(const at::Tensor& x_in, const at::Tensor& packed_in, const at::Tensor& scale_in,
                         const std::optional<at::Tensor>& offset_in, const std::optional<at::Tensor>& super_scale,
                         const std::optional<at::Tensor>& super_offset);

// Whether the AMX tiles take groups of G: G <= 64 or a multiple of 64.
inline bool amx_takes_group(int64_t G) { return G <= 64 || G % 64 == 0; }

// p.y = the product, for any scale type: few rows streaming the weights (int4_gemv.cpp), the panels, the panels on
// AMX tiles (int4_gemm.cpp)
void passes(const Int4Product& p);
void panels(const Int4Product& p);
void amx_panels(const Int4Product& p);

}  // namespace nanoqwen::int4
