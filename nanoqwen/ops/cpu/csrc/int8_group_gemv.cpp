// int8 weights with a float32 scale (and offset) per group of G inputs, times few rows of bf16 x (decode), on CPUs
// with AVX2 + FMA (AVX-512 VNNI's vpdpwssd where present): the format that holds a GGUF file's Q8_0, Q5_*, Q6_K
// matrices exactly (nanoqwen/quantization/int8_group.py).
//
//   int8_group_gemv(x [M,K] bf16, q [N,K] int8, scale [N,K/G] float32, offset [N,K/G] float32 or none,
//                   super_scale none) or, two levels as a GGUF file's Q6_K holds them, scale [N,K/G] int8 and
//                   super_scale [N,K/(16G)] float32: a group's scale super_scale * scale (exact in float32)
//       -> y [M,N] bf16,   y = x' @ (q * scale + offset).T,  G = 16 or 32 (meant for few rows: each weight row
//          is read once and multiplied by every row of x; int8_group.py dequantises for prompts)
//
// x is quantised once per call to int16 per group of G (symmetric, one float32 scale per group: d = max|x| / 32767,
// xq = round(x / d), half to even; xs = d * sum(xq) for the offsets), as int8_gemv quantises it per 64 (gemv.cpp),
// so each group's dot product sum_k q[k] xq[k] is an integer one (16 weights widened to int16 and multiplied in
// pairs into 8 int32 lanes per instruction). Per weight row n and x row m:
//     y[m, n] = sum_g (scale[n, g] * d[m, g]) * isum[n, m, g]  +  sum_g offset[n, g] * xs[m, g]
// the first sum kept in 8 float32 lanes (one FMA per group and x row) and added across lanes once at the end;
// int8_group_gemv_reference (ops/cpu/kernels.py) computes the same function. Threads split the weight rows.
//
// q may also come packed at 6 bits (uint8 [N, 3K/4]: values -32..31, as a GGUF file's Q6_K holds them, so its
// matrices take 6.75 bits a weight rather than 8.625): every 16 consecutive values in 12 bytes, the first 8 bytes
// their low 4 bits (byte j: value j in its low nibble, value j + 8 in its high one), the next 4 their high 2 bits
// (byte b: values b, b + 4, b + 8, b + 12 at bits 0, 2, 4, 6), each value stored plus 32
// (ops/quantize.py pack_int6 and unpack_int6 are the reference).

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

constexpr int kTile = 4;           // rows of x per register tile

struct GroupX {
  std::vector<int16_t> xq;
  std::vector<float> d, xs;
};

GroupX quantize_x_groups(const uint16_t* x, int64_t M, int64_t K, int64_t G) {
  const int64_t blocks = M * (K / G);
  GroupX out{std::vector<int16_t>(M * K), std::vector<float>(blocks), std::vector<float>(blocks)};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* xb = x + b * G;
    int16_t* qb = out.xq.data() + b * G;
    const float d = absmax_bf16(xb, G) / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int64_t sum = 0;
    for (int64_t k = 0; k < G; ++k) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(bf16_to_float(xb[k]) * inv));  // half to even
      qb[k] = static_cast<int16_t>(v);
      sum += v;
    }
    out.d[b] = d;
    out.xs[b] = d * static_cast<float>(sum);
  }
  return out;
}

constexpr int64_t kSuperGroups = 16;  // groups a two-level super-scale covers (Q6_K: 16 groups of 16)

// One weight row's group scales: float32 (s), or int8 sub-scales (sub) times float32 per super-block (super).
struct RowScales {
  const float* s;
  const int8_t* sub;
  const float* super;
  float at(int64_t g) const { return s ? s[g] : super[g / kSuperGroups] * static_cast<float>(sub[g]); }
};

// Value k of a weight row: int8 as it is, or (Six) unpacked from the 6-bit layout above.
template <bool Six>
inline int32_t weight_at(const uint8_t* row, int64_t k) {
  if constexpr (!Six) {
    return static_cast<int8_t>(row[k]);
  } else {
    const uint8_t* chunk = row + (k / 16) * 12;
    const int e = static_cast<int>(k % 16);
    const int low = e < 8 ? chunk[e] & 15 : chunk[e - 8] >> 4;
    const int high = (chunk[8 + e % 4] >> (2 * (e / 4))) & 3;
    return (low | (high << 4)) - 32;
  }
}

#ifdef NANOQWEN_AVX2
// Values 16c .. 16c + 15 of a weight row as 16 int16.
template <bool Six>
inline __m256i load16_weights(const uint8_t* row, int64_t c) {
  if constexpr (!Six) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
  } else {
    const uint8_t* chunk = row + 12 * c;
    const __m128i nibbles = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk));
    const __m128i mask4 = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(nibbles, mask4),
                                           _mm_and_si128(_mm_srli_epi16(nibbles, 4), mask4));  // values 0..15
    int32_t plane4;
    std::memcpy(&plane4, chunk + 8, 4);
    const __m128i plane = _mm_set1_epi32(plane4);  // bytes b0 b1 b2 b3, four times
    // value 4i + b: bits 2i, 2i + 1 of byte b (16-bit shifts: what crosses into a byte is masked off)
    __m128i high = _mm_blend_epi16(plane, _mm_srli_epi16(plane, 2), 0x0C);
    high = _mm_blend_epi16(high, _mm_srli_epi16(plane, 4), 0x30);
    high = _mm_blend_epi16(high, _mm_srli_epi16(plane, 6), 0xC0);
    high = _mm_slli_epi16(_mm_and_si128(high, _mm_set1_epi8(0x03)), 4);  // (no bit crosses a byte: 2 bits << 4)
    const __m128i q = _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));
    return _mm256_cvtepi8_epi16(q);
  }
}
#endif

// y[m0 .. m0 + T - 1, n] for one weight row n (w: its K values, int8 or packed at 6 bits; s: its K / G scales, o:
// offsets or null).
template <int T, int G, bool Six>
void row_tile(const GroupX& x, int64_t K, int64_t m0, const uint8_t* w, const RowScales& s, const float* o,
              int64_t N, int64_t n, at::BFloat16* y) {
  const int64_t groups = K / G;
  float total[T];
#ifdef NANOQWEN_AVX2
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (Six ? g * G * 3 / 4 : g * G)) + kRowPrefetchBytes, _MM_HINT_T0);
    __m256i wv[G / 16];
    for (int v = 0; v < G / 16; ++v) wv[v] = load16_weights<Six>(w, g * (G / 16) + v);
    const float sg = s.at(g);
    for (int t = 0; t < T; ++t) {
      const int16_t* xg = x.xq.data() + (m0 + t) * K + g * G;
      __m256i isum = _mm256_setzero_si256();
      for (int v = 0; v < G / 16; ++v)
        isum = dot16_int16(isum, wv[v], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16 * v)));
      const __m256 sd = _mm256_set1_ps(sg * x.d[(m0 + t) * groups + g]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sd, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) total[t] = hsum(acc[t]);
#else
  for (int t = 0; t < T; ++t) {
    total[t] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t isum = 0;
      for (int k = 0; k < G; ++k) isum += weight_at<Six>(w, g * G + k) * int32_t(x.xq[(m0 + t) * K + g * G + k]);
      total[t] = std::fma(static_cast<float>(isum), s.at(g) * x.d[(m0 + t) * groups + g], total[t]);
    }
  }
#endif
  for (int t = 0; t < T; ++t) {
    if (o != nullptr) {
      const float* xs = x.xs.data() + (m0 + t) * groups;
      for (int64_t g = 0; g < groups; ++g) total[t] = std::fma(o[g], xs[g], total[t]);
    }
    y[(m0 + t) * N + n] = at::BFloat16(total[t]);  // one rounding, RNE
  }
}

template <int G, bool Six, int T = kTile>
void row_tiles(int rows, const GroupX& x, int64_t K, int64_t m0, const uint8_t* w, const RowScales& s,
               const float* o, int64_t N, int64_t n, at::BFloat16* y) {
  if constexpr (T > 1) {
    if (rows < T) return row_tiles<G, Six, T - 1>(rows, x, K, m0, w, s, o, N, n, y);
  }
  row_tile<T, G, Six>(x, K, m0, w, s, o, N, n, y);
}

template <int G, bool Six>
void group_passes(const GroupX& x, int64_t M, int64_t K, int64_t N, const uint8_t* q, const float* s,
                  const int8_t* sub, const float* super, const float* o, at::BFloat16* y) {
  const int64_t groups = K / G, supers = groups / kSuperGroups, row_bytes = Six ? K * 3 / 4 : K;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, row_bytes));
  parallel_rows(N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const RowScales row{s ? s + n * groups : nullptr, sub ? sub + n * groups : nullptr,
                          super ? super + n * supers : nullptr};
      for (int64_t m0 = 0; m0 < M; m0 += kTile)
        row_tiles<G, Six>(static_cast<int>(std::min<int64_t>(kTile, M - m0)), x, K, m0, q + n * row_bytes, row,
                     o ? o + n * groups : nullptr, N, n, y);
    }
  });
}

}  // namespace

at::Tensor int8_group_gemv(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scale_in,
                           const std::optional<at::Tensor>& offset_in, const std::optional<at::Tensor>& super_in) {
  TORCH_CHECK(x_in.device().is_cpu() && q_in.device().is_cpu() && scale_in.device().is_cpu(),
              "x, q and scale must be CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(q_in.scalar_type() == at::kChar || q_in.scalar_type() == at::kByte,
              "q must be int8, or uint8 (values packed at 6 bits), got ", q_in.scalar_type());
  const bool six = q_in.scalar_type() == at::kByte;
  const bool two_level = super_in.has_value();
  TORCH_CHECK(scale_in.scalar_type() == (two_level ? at::kChar : at::kFloat), "scale must be ",
              two_level ? "int8 (with super_scale)" : "float32", ", got ", scale_in.scalar_type());
  TORCH_CHECK(x_in.dim() == 2 && q_in.dim() == 2 && scale_in.dim() == 2, "x, q and scale must be 2-D");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = q_in.size(0);
  TORCH_CHECK(six ? q_in.size(1) * 4 == K * 3 && K % 16 == 0 : q_in.size(1) == K, "x has K=", K, " but q holds ",
              six ? "6-bit values for K=" : "K=", six ? q_in.size(1) * 4 / 3 : q_in.size(1));
  TORCH_CHECK(scale_in.size(0) == N && scale_in.size(1) > 0 && K % scale_in.size(1) == 0,
              "scale must be [N, K/G] with N=", N, ", got ", scale_in.sizes());
  const int64_t G = K / scale_in.size(1);
  TORCH_CHECK(G == 16 || G == 32, "int8_group_gemv's group size is 16 or 32, got ", G);
  at::Tensor x = x_in.contiguous(), q = q_in.contiguous(), scale = scale_in.contiguous(), offset, super;
  if (two_level) {
    TORCH_CHECK(!offset_in, "two-level scales take no offset");
    TORCH_CHECK(super_in->scalar_type() == at::kFloat && super_in->dim() == 2 && super_in->size(0) == N &&
                    super_in->size(1) * kSuperGroups == scale_in.size(1),
                "super_scale must be float32 [N, groups / ", kSuperGroups, "], got ", super_in->scalar_type(), " ",
                super_in->sizes());
    super = super_in->contiguous();
  }
  if (offset_in) {
    TORCH_CHECK(offset_in->scalar_type() == at::kFloat && offset_in->sizes() == scale_in.sizes(),
                "offset must be float32 shaped like scale, got ", offset_in->scalar_type(), " ", offset_in->sizes());
    offset = offset_in->contiguous();
  }
  at::Tensor y = new_output({M, N}, x_in.options().dtype(at::kBFloat16));
  if (M == 0 || N == 0) return y;
  const GroupX xq = quantize_x_groups(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, G);
  const float* o = offset.defined() ? offset.data_ptr<float>() : nullptr;
  const float* s = two_level ? nullptr : scale.data_ptr<float>();
  const int8_t* sub = two_level ? scale.data_ptr<int8_t>() : nullptr;
  const float* sup = two_level ? super.data_ptr<float>() : nullptr;
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  if (G == 32)
    six ? group_passes<32, true>(xq, M, K, N, qp, s, sub, sup, o, yp)
        : group_passes<32, false>(xq, M, K, N, qp, s, sub, sup, o, yp);
  else
    six ? group_passes<16, true>(xq, M, K, N, qp, s, sub, sup, o, yp)
        : group_passes<16, false>(xq, M, K, N, qp, s, sub, sup, o, yp);
  return y;
}

}  // namespace nanoqwen
