// int4_gemv: int4 weights times few rows of bf16 x (decode), each block of 16 weight rows read once and unpacked in
// registers; more rows go to the panels (int4_gemm.cpp). int4.h says the layout and what the kernels share.

#include "int4.h"

namespace nanoqwen {
namespace int4 {
namespace {

// ---- Few rows of x (decode): each block of 16 weight rows read once, its nibbles unpacked in registers.

constexpr int kMaxRowsInt4 = 8;  // rows of x that stream the weights; more go through the panels (int4_gemm.cpp)
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

// Few rows of x: the blocks of weight rows shared among the threads (parallel_rows_stealing, in claims of at least
// kClaimBytes), each block read from memory once and run by every tile of rows of x.
template <typename S>
void int4_passes(const Int4Product& p) {
  const int64_t K = p.K, N = p.N, G = p.G, groups = K / G;
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, kBlockRows * K / 2));
  const QuantizedRows x{p.xq.xq.data(), p.xq.d.data(), p.xq.xs.data()};
  parallel_rows_stealing(blocks, grain, claim_blocks(K), [&](int64_t begin, int64_t end) {
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

}  // namespace

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

void passes(const Int4Product& p) {
  with_scale_type(p, [&](auto type) { int4_passes<typename decltype(type)::type>(p); });
}

}  // namespace int4

// Few rows: passes that stream the weights; more: the panels (bench/bench_gemv.py --rows measures it: below 9
// rows, the panels' unpacking costs more than it saves; at 16 the panels are faster than two passes).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& super_scale,
                     const std::optional<at::Tensor>& super_offset, int64_t amx_min_rows) {
  const int4::Int4Product p = int4::prepare_int4(x, packed, scale, offset, super_scale, super_offset);
  if (p.M == 0 || p.N == 0) return p.y;
  if (amx_min_rows > 0 && p.M >= amx_min_rows && int4::amx_takes_group(p.G) && amx_int8_ready())
    int4::amx_panels(p);
  else if (p.M <= int4::kMaxRowsInt4)
    int4::passes(p);
  else
    int4::panels(p);
  return p.y;
}

}  // namespace nanoqwen
