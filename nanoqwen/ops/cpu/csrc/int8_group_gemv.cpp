// int8 weights with a float32 scale (and offset) per group of G inputs, times few rows of bf16 x (decode), on CPUs
// with AVX2 + FMA (AVX-512 VNNI's vpdpwssd where present): the format that holds a GGUF file's Q8_0, Q5_*, Q6_K
// matrices exactly (nanoqwen/quantization/int8_group.py).
//
//   int8_group_gemv(x [M,K] bf16, q [N,K] int8, scale [N,K/G], offset [N,K/G] or none, super_scale, super_offset)
//       -> y [M,N] bf16,   y = x' @ (q * scale + offset).T,  G = 16 or 32 (meant for few rows: each weight row
//          is read once and multiplied by every row of x; int8_group.py dequantises for prompts)
//   scale and offset each float32 or float16, or two levels as a GGUF file's K types hold them: small integers
//   (int8 or uint8) [N,K/G] times a float32 per super-block of S groups (super_scale, super_offset [N,K/(SG)]),
//   a group's value their product (exact in float32); each is widened to float32 once per weight row.
//
// x is quantised once per call to int16 per group of G (symmetric, one float32 scale per group: d = max|x| / 32767,
// xq = round(x / d), half to even; xs = d * sum(xq) for the offsets), as int8_gemv quantises it per 64 (gemv.cpp),
// so each group's dot product sum_k q[k] xq[k] is an integer one (16 weights widened to int16 and multiplied in
// pairs into 8 int32 lanes per instruction). Per weight row n and x row m:
//     y[m, n] = sum_g (scale[n, g] * d[m, g]) * isum[n, m, g]  +  sum_g offset[n, g] * xs[m, g]
// the first sum kept in 8 float32 lanes (one FMA per group and x row) and added across lanes once at the end;
// int8_group_gemv_reference (ops/cpu/kernels.py) computes the same function. Threads split the weight rows.
//
// q may also come packed (uint8), every 32 consecutive values in a chunk whose first 16 bytes hold their low 4 bits
// (byte j: value j in its low nibble, value j + 16 in its high one), so that one 256-bit register unpacks a chunk:
// - at 6 bits (uint8 [N, 3K/4]: values -32..31, as a GGUF file's Q6_K holds them), 24 bytes a chunk, the next 8 their
//   high 2 bits (byte b: values b, b + 8, b + 16, b + 24 at bits 0, 2, 4, 6), each value stored plus 32
//   (ops/quantize.py pack_int6 and unpack_int6 are the reference);
// - at 5 bits (uint8 [N, 5K/8]: values 0..31, as a GGUF file's Q5 types hold them), 20 bytes a chunk, the next 4
//   their fifth bits (byte i, bit b: value 8i + b) (pack_int5 and unpack_int5). Without offsets 5-bit values are
//   symmetric, scale * (q - 16) (a GGUF file's Q5_0): the offset -16 scale is made from the scale as it is read
//   (exact in float32, so the same bits as with those offsets given).
// K tells them apart: q's bytes a row are 3K/4 or 5K/8.

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

constexpr int kTile = 4;           // rows of x per register tile
constexpr float kSymmetricZero5 = 16.0f;  // 5-bit values without offsets: scale * (q - 16)

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

// One matrix's scales or offsets in any of the forms above; row() gives a weight row's as float32.
struct GroupValues {
  at::Tensor values, super;  // (contiguous; super undefined: one level)
  int64_t groups = 0, per_super = 1;
  at::ScalarType type = at::kFloat;
  const void* data = nullptr;  // values' and super's data
  const float* super_data = nullptr;

  bool present() const { return data != nullptr; }

  // Row n's values: the row itself where it is float32, else widened (and multiplied by its super-blocks' values)
  // into out.
  const float* row(int64_t n, float* out) const {
    const int64_t base = n * groups;
    const float* sup = super_data ? super_data + n * (groups / per_super) : nullptr;
    switch (type) {
      case at::kFloat:
        return static_cast<const float*>(data) + base;
      case at::kHalf:
        widen(static_cast<const at::Half*>(data) + base, nullptr, out);
        break;
      case at::kChar:
        widen(static_cast<const int8_t*>(data) + base, sup, out);
        break;
      default:
        widen(static_cast<const uint8_t*>(data) + base, sup, out);
    }
    return out;
  }

  // out[g] = v[g] as float32, times sup[g / per_super] where sup is given (each product exact for a file's values).
  template <typename T>
  void widen(const T* v, const float* sup, float* out) const {
    int64_t g = 0;
#ifdef NANOQWEN_AVX2
    if (per_super % 8 == 0 || sup == nullptr) {
      for (; g + 8 <= groups; g += 8) {
        const __m256 f = load8(v + g);
        _mm256_storeu_ps(out + g, sup ? _mm256_mul_ps(f, _mm256_set1_ps(sup[g / per_super])) : f);
      }
    }
#endif
    for (; g < groups; ++g) out[g] = sup ? sup[g / per_super] * static_cast<float>(v[g]) : static_cast<float>(v[g]);
  }
};

// Checks one matrix's scales (or offsets) and their super-block values; `what` names them in errors.
GroupValues group_values(const at::Tensor& values, const std::optional<at::Tensor>& super, int64_t N, int64_t groups,
                         const char* what, const char* super_name) {
  const auto type = values.scalar_type();
  TORCH_CHECK(values.dim() == 2 && values.size(0) == N && values.size(1) == groups, what, " must be [N, K/G] = [",
              N, ", ", groups, "], got ", values.sizes());
  GroupValues out{values.contiguous(), at::Tensor(), groups, 1, type};
  out.data = out.values.data_ptr();
  if (type == at::kFloat || type == at::kHalf) {
    TORCH_CHECK(!super, super_name, " goes with int8 or uint8 ", what, " (two levels), not ", type);
    return out;
  }
  TORCH_CHECK(type == at::kChar || type == at::kByte, what, " must be float32, float16, or int8/uint8 with ",
              super_name, ", got ", type);
  TORCH_CHECK(super.has_value(), what, " of type ", type, " needs ", super_name, " (two levels)");
  TORCH_CHECK(super->scalar_type() == at::kFloat && super->dim() == 2 && super->size(0) == N && super->size(1) > 0 &&
                  groups % super->size(1) == 0,
              super_name, " must be float32 [N, groups / S], got ", super->scalar_type(), " ", super->sizes());
  out.super = super->contiguous();
  out.super_data = out.super.data_ptr<float>();
  out.per_super = groups / super->size(1);
  return out;
}

// A matrix's offsets (none, or as group_values checks them).
GroupValues offset_values(const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& super_offset,
                          int64_t N, int64_t groups) {
  TORCH_CHECK(offset || !super_offset, "super_offset without offset");
  return offset ? group_values(*offset, super_offset, N, groups, "offset", "super_offset") : GroupValues{};
}

// A row's offsets: the given ones (float32, into out where widened), or for symmetric 5-bit values -16 times its
// scales s (into out); null where there are none.
const float* row_offsets(const GroupValues& offset, int bits, int64_t n, const float* s, int64_t groups, float* out) {
  if (offset.present()) return offset.row(n, out);
  if (bits != 5) return nullptr;
  for (int64_t g = 0; g < groups; ++g) out[g] = -kSymmetricZero5 * s[g];
  return out;
}

// Bits a value of q for rows of K values: 8 (int8), 6 or 5 (uint8 rows of 3K/4 or 5K/8 bytes).
int bits_for(const at::Tensor& q, int64_t K, const char* kernel) {
  const int64_t row_bytes = q.size(1);
  if (q.scalar_type() == at::kChar) {
    TORCH_CHECK(row_bytes == K, kernel, ": K=", K, " but q holds K=", row_bytes);
    return 8;
  }
  TORCH_CHECK(K % 32 == 0 && (row_bytes * 4 == K * 3 || row_bytes * 8 == K * 5), kernel, ": K=", K,
              " but q's rows of ", row_bytes, " bytes hold neither 6-bit (3K/4) nor 5-bit (5K/8) values for it",
              " (packed values need K a multiple of 32)");
  return row_bytes * 4 == K * 3 ? 6 : 5;
}

// Value k of a weight row: int8 as it is, or unpacked from the 6- or 5-bit layout above.
template <int Bits>
inline int32_t weight_at(const uint8_t* row, int64_t k) {
  if constexpr (Bits == 8) {
    return static_cast<int8_t>(row[k]);
  } else {
    const uint8_t* chunk = row + (k / 32) * (4 * Bits);
    const int e = static_cast<int>(k % 32);
    const int low = e < 16 ? chunk[e] & 15 : chunk[e - 16] >> 4;
    if constexpr (Bits == 6) {
      const int high = (chunk[16 + e % 8] >> (2 * (e / 8))) & 3;
      return (low | (high << 4)) - 32;
    } else {
      const int high = (chunk[16 + e / 8] >> (e % 8)) & 1;
      return low | (high << 4);
    }
  }
}

#ifdef NANOQWEN_AVX2
// Values 32c .. 32c + 31 of a weight row as 32 int8 (byte p: value 32c + p; at 5 bits 0..31, as unsigned).
template <int Bits>
inline __m256i load32_weights(const uint8_t* row, int64_t c) {
  if constexpr (Bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c));
  } else {
    const uint8_t* chunk = row + (4 * Bits) * c;
    // the 16 nibble bytes in both halves; the upper half shifted down 4 (32-bit shifts: the mask drops what crosses)
    const __m256i nibbles = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi32(nibbles, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm256_set1_epi8(0x0F));  // values 0..15
    if constexpr (Bits == 6) {
      int64_t plane8;
      std::memcpy(&plane8, chunk + 16, 8);
      // 64-bit lane i holds the plane's 8 bytes, byte b value 8i + b's high bits at bits 2i, 2i + 1: shifted down 2i
      const __m256i plane = _mm256_srlv_epi64(_mm256_set1_epi64x(plane8), _mm256_setr_epi64x(0, 2, 4, 6));
      // (2 bits shifted up 4 stay in their byte)
      const __m256i high = _mm256_slli_epi16(_mm256_and_si256(plane, _mm256_set1_epi8(0x03)), 4);
      return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
    } else {
      uint32_t plane4;
      std::memcpy(&plane4, chunk + 16, 4);
      // byte i of the plane to values 8i .. 8i + 7, each keeping its own bit; set bits become 16
      const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(plane4)),
                                                 _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                  2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
      const __m256i high =
          _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
      return _mm256_or_si256(low, high);
    }
  }
}

// Half h (values 16h .. 16h + 15) of load32_weights' bytes as 16 int16 (5-bit values, 0..31, widen as signed ones).
inline __m256i widen16(__m256i v, int h) {
  return _mm256_cvtepi8_epi16(h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v));
}
#endif

// y[m0 .. m0 + T - 1, n] for one weight row n (w: its K values, int8 or packed at 6 or 5 bits; s: its K / G scales,
// o: offsets or null).
template <int T, int G, int Bits>
void row_tile(const GroupX& x, int64_t K, int64_t m0, const uint8_t* w, const float* s, const float* o,
              int64_t N, int64_t n, at::BFloat16* y) {
  const int64_t groups = K / G;
  float total[T];
#ifdef NANOQWEN_AVX2
  constexpr int kPerChunk = 32 / G;  // groups a chunk of 32 values holds (1 or 2)
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c * 4 * Bits) + kRowPrefetchBytes, _MM_HINT_T0);
    __m256i wv[2];
    if constexpr (Bits == 8) {  // (int8 widens straight from memory)
      for (int h = 0; h < 2; ++h)
        wv[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 32 * c + 16 * h)));
    } else {
      const __m256i packed = load32_weights<Bits>(w, c);
      wv[0] = widen16(packed, 0);
      wv[1] = widen16(packed, 1);
    }
    for (int j = 0; j < kPerChunk; ++j) {
      const int64_t g = c * kPerChunk + j;
      const float sg = s[g];
      for (int t = 0; t < T; ++t) {
        const int16_t* xg = x.xq.data() + (m0 + t) * K + g * G;
        __m256i isum = _mm256_setzero_si256();
        for (int v = 0; v < G / 16; ++v)
          isum = dot16_int16(isum, wv[j * (G / 16) + v],
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16 * v)));
        const __m256 sd = _mm256_set1_ps(sg * x.d[(m0 + t) * groups + g]);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sd, acc[t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) total[t] = hsum(acc[t]);
#else
  for (int t = 0; t < T; ++t) {
    total[t] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t isum = 0;
      for (int k = 0; k < G; ++k) isum += weight_at<Bits>(w, g * G + k) * int32_t(x.xq[(m0 + t) * K + g * G + k]);
      total[t] = std::fma(static_cast<float>(isum), s[g] * x.d[(m0 + t) * groups + g], total[t]);
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

template <int G, int Bits, int T = kTile>
void row_tiles(int rows, const GroupX& x, int64_t K, int64_t m0, const uint8_t* w, const float* s, const float* o,
               int64_t N, int64_t n, at::BFloat16* y) {
  if constexpr (T > 1) {
    if (rows < T) return row_tiles<G, Bits, T - 1>(rows, x, K, m0, w, s, o, N, n, y);
  }
  row_tile<T, G, Bits>(x, K, m0, w, s, o, N, n, y);
}

template <int G, int Bits>
void group_passes(const GroupX& x, int64_t M, int64_t K, int64_t N, const uint8_t* q, const GroupValues& scale,
                  const GroupValues& offset, at::BFloat16* y) {
  const int64_t groups = K / G, row_bytes = K * Bits / 8;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, row_bytes));
  parallel_rows(N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s_row(groups), o_row(groups);
    for (int64_t n = begin; n < end; ++n) {
      const float* s = scale.row(n, s_row.data());
      const float* o = row_offsets(offset, Bits, n, s, groups, o_row.data());
      for (int64_t m0 = 0; m0 < M; m0 += kTile)
        row_tiles<G, Bits>(static_cast<int>(std::min<int64_t>(kTile, M - m0)), x, K, m0, q + n * row_bytes, s, o,
                           N, n, y);
    }
  });
}

template <int G>
void group_passes_bits(int bits, const GroupX& x, int64_t M, int64_t K, int64_t N, const uint8_t* q,
                       const GroupValues& scale, const GroupValues& offset, at::BFloat16* y) {
  if (bits == 8) return group_passes<G, 8>(x, M, K, N, q, scale, offset, y);
  if (bits == 6) return group_passes<G, 6>(x, M, K, N, q, scale, offset, y);
  group_passes<G, 5>(x, M, K, N, q, scale, offset, y);
}

}  // namespace

at::Tensor int8_group_gemv(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scale_in,
                           const std::optional<at::Tensor>& offset_in, const std::optional<at::Tensor>& super_in,
                           const std::optional<at::Tensor>& super_offset_in) {
  TORCH_CHECK(x_in.device().is_cpu() && q_in.device().is_cpu() && scale_in.device().is_cpu(),
              "x, q and scale must be CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(q_in.scalar_type() == at::kChar || q_in.scalar_type() == at::kByte,
              "q must be int8, or uint8 (values packed at 5 or 6 bits), got ", q_in.scalar_type());
  TORCH_CHECK(x_in.dim() == 2 && q_in.dim() == 2 && scale_in.dim() == 2, "x, q and scale must be 2-D");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = q_in.size(0);
  const int bits = bits_for(q_in, K, "int8_group_gemv");
  TORCH_CHECK(scale_in.size(1) > 0 && K % scale_in.size(1) == 0, "scale must be [N, K/G], got ", scale_in.sizes());
  const int64_t groups = scale_in.size(1), G = K / groups;
  TORCH_CHECK(G == 16 || G == 32, "int8_group_gemv's group size is 16 or 32, got ", G);
  TORCH_CHECK(K % 32 == 0, "int8_group_gemv reads 32 values at a time: K must be a multiple of 32, got ", K);
  const GroupValues scale = group_values(scale_in, super_in, N, groups, "scale", "super_scale");
  const GroupValues offset = offset_values(offset_in, super_offset_in, N, groups);
  at::Tensor x = x_in.contiguous(), q = q_in.contiguous();
  at::Tensor y = new_output({M, N}, x_in.options().dtype(at::kBFloat16));
  if (M == 0 || N == 0) return y;
  const GroupX xq = quantize_x_groups(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, G);
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  if (G == 32)
    group_passes_bits<32>(bits, xq, M, K, N, qp, scale, offset, yp);
  else
    group_passes_bits<16>(bits, xq, M, K, N, qp, scale, offset, yp);
  return y;
}

int int8_group_bits(const at::Tensor& q, int64_t groups) {
  // a group of G values (16 or 32) takes G bytes (int8), 3G/4 (6 bits: 12 or 24) or 5G/8 (5 bits: 10 or 20)
  return q.scalar_type() == at::kChar ? 8 : (q.size(1) / groups) % 5 == 0 ? 5 : 6;
}

at::Tensor int8_group_dequantize(const at::Tensor& q_in, const at::Tensor& scale_in,
                                 const std::optional<at::Tensor>& offset_in, const std::optional<at::Tensor>& super_in,
                                 const std::optional<at::Tensor>& super_offset_in, int64_t K) {
  TORCH_CHECK(q_in.device().is_cpu() && q_in.dim() == 2 && scale_in.dim() == 2 &&
                  (q_in.scalar_type() == at::kChar || q_in.scalar_type() == at::kByte),
              "int8_group_dequantize: q [N, K] int8 or packed uint8 on the CPU, scale [N, K/G]");
  const int64_t N = q_in.size(0), row_bytes = q_in.size(1);
  const int bits = bits_for(q_in, K, "int8_group_dequantize");
  const int64_t groups = scale_in.size(1);
  TORCH_CHECK(groups > 0 && K % groups == 0 && (K / groups) % 16 == 0 && K % 32 == 0,
              "int8_group_dequantize: scale ", scale_in.sizes(), " for K=", K, " (K a multiple of 32)");
  const int64_t G = K / groups;
  const GroupValues scale = group_values(scale_in, super_in, N, groups, "scale", "super_scale");
  const GroupValues offset = offset_values(offset_in, super_offset_in, N, groups);
  const at::Tensor q = q_in.contiguous();
  at::Tensor w = at::empty({N, K}, q_in.options().dtype(at::kFloat));
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, row_bytes)), [&](int64_t b, int64_t e) {
    std::vector<float> s_row(groups), o_row(groups);
    for (int64_t n = b; n < e; ++n) {
      const float* s = scale.row(n, s_row.data());
      const float* o = row_offsets(offset, bits, n, s, groups, o_row.data());
      const uint8_t* row = qp + n * row_bytes;
      float* out = wp + n * K;
      for (int64_t c = 0; c < K / 32; ++c) {  // 32 values a step
#ifdef NANOQWEN_AVX2
        const __m256i v = bits == 8 ? load32_weights<8>(row, c) : bits == 6 ? load32_weights<6>(row, c)
                                                                            : load32_weights<5>(row, c);
        for (int h = 0; h < 2; ++h) {
          const __m256i v16 = widen16(v, h);
          const int64_t g = (32 * c + 16 * h) / G;
          for (int e = 0; e < 2; ++e) {
            const __m128i part = e ? _mm256_extracti128_si256(v16, 1) : _mm256_castsi256_si128(v16);
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(part)), _mm256_set1_ps(s[g]));
            // a product, then a sum, each rounded: the reference's (the empty asm keeps the compiler from fusing them)
            asm("" : "+x"(f));
            if (o) f = _mm256_add_ps(f, _mm256_set1_ps(o[g]));
            _mm256_storeu_ps(out + 32 * c + 16 * h + 8 * e, f);
          }
        }
#else
        for (int64_t k = 32 * c; k < 32 * c + 32; ++k) {
          const int64_t g = k / G;
          const int32_t value =
              bits == 8 ? weight_at<8>(row, k) : bits == 6 ? weight_at<6>(row, k) : weight_at<5>(row, k);
          volatile float product = static_cast<float>(value) * s[g];  // (rounded before the sum, as the reference)
          out[k] = o ? product + o[g] : product;
        }
#endif
      }
    }
  });
  return w;
}

}  // namespace nanoqwen
