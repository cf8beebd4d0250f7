// Attention over the paged KV cache on the CPU, and the decode step's writes into it: paged_decode_attention
// (a bf16 cache, or a quantized one's int8 / float8 codes with their float32 scales, read in place) and
// attention_inputs (QK-norm, RoPE and the cache store of a decode step in one pass). Each computes what its
// reference in attention/backends/paged.py or models/qwen3.py computes, rounding where it rounds.

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

// ---- The elements paged_decode_attention reads from the cache: bf16 (its bits, uint16_t), or a quantized cache's
// codes (nanoqwen/attention/kv_cache.py quantize_kv: int8_t, at::Float8_e4m3fn, at::Float8_e5m2), each code times its
// vector's float32 scale. `widen` and `widen8` give an element in float32, for e4m3 its value / 256 (kCodeUnit: the
// factor 256 goes into the scales instead), the rest exactly their value.
template <typename T>
constexpr bool kCodes = !std::is_same_v<T, uint16_t>;  // a quantized cache's codes (with scales), not bf16
template <typename T>
constexpr float kCodeUnit = 1.0f;  // what `widen` leaves out of an element's value: value = widen * kCodeUnit
template <>
constexpr float kCodeUnit<at::Float8_e4m3fn> = 256.0f;

inline float widen(uint16_t v) { return bf16_to_float(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(at::Float8_e5m2 v) { return static_cast<float>(v); }
inline float widen(at::Float8_e4m3fn v) { return static_cast<float>(v) * (1.0f / 256.0f); }

#ifdef NANOQWEN_AVX2
inline __m256 widen8(const uint16_t* p) { return load8_bf16(p); }
inline __m256 widen8(const int8_t* p) { return load8_int8(p); }
// An e5m2 byte is the upper byte of the float16 of the same value.
inline __m256 widen8(const at::Float8_e5m2* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return half8_to_float(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
}
// Its value / 256 (cpu_kernels.h; e4m3's NaN, 0x7F, is never written: codes are at most 448).
inline __m256 widen8(const at::Float8_e4m3fn* p) { return load8_e4m3_div256(reinterpret_cast<const uint8_t*>(p)); }
#endif

// sum_i a[i] * widen(b[i]) for float32 a (the positions attention_scores leaves over, fewer than eight).
template <typename T>
inline float dot_widened(const float* a, const T* b, int64_t D) {
  int64_t i = 0;
  float total = 0.0f;
#ifdef NANOQWEN_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), widen8(b + i), acc);
  total = hsum(acc);
#endif
  for (; i < D; ++i) total += a[i] * widen(b[i]);
  return total;
}

// The largest of s[0 .. n - 1] (-inf for n = 0), 8 lanes at a time (a NaN passed over, as std::max(mx, s[j]) passes
// it over: max_ps gives its second operand then).
inline float max_of(const float* s, int64_t n) {
  int64_t j = 0;
  float mx = -INFINITY;
#ifdef NANOQWEN_AVX2
  __m256 v = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) v = _mm256_max_ps(_mm256_loadu_ps(s + j), v);
  mx = hmax(v);
#endif
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// s[h * s_stride + p] = dot(q + h * D, k[p] + offset) * scale for NH query heads h (float32, consecutive) that
// share the key vectors (D elements of the cache, offset elements into each position's row), over the len positions
// p; for a quantized cache (kCodes<T>), dot(q + h * D, widen(k[p] + offset)) * k_scale[p] instead (k_scale: each
// position's scale with `scale` and kCodeUnit folded in, one product after the dot).
// 8 / NH positions at a time for all NH heads: eight accumulators (eight independent FMA chains), each key vector
// widened once for the NH heads (GQA: 2 query heads a kv head in Qwen3-0.6B), their lanes then summed by a
// transpose-add into one vector of the eight scores.
template <int NH, typename T>
inline void attention_scores(const float* q, const T* const* k, int64_t offset, int64_t len, int64_t D,
                             float scale, const float* k_scale, float* s, int64_t s_stride) {
  static_assert(NH == 1 || NH == 2, "query heads a call: one, or a pair sharing a kv head");
  int64_t p = 0;
#ifdef NANOQWEN_AVX2
  constexpr int P = 8 / NH;  // positions per block
  if (D % 8 == 0)
    for (; p + P <= len; p += P) {
      __m256 acc[NH][P];
      for (int h = 0; h < NH; ++h)
        for (int j = 0; j < P; ++j) acc[h][j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        for (int j = 0; j < P; ++j) {
          const __m256 kv = widen8(k[p + j] + offset + i);
          for (int h = 0; h < NH; ++h) acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + i), kv, acc[h][j]);
        }
      }
      // hadd pairs lanes within each 128-bit half: after two rounds, half h of s0123 holds the sums of half h
      // of acc 0..3 (in that order), likewise s4567; adding the halves gives the eight totals in order.
      const __m256* a = &acc[0][0];
      const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m256 total = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
      __m256 factor = _mm256_set1_ps(scale);
      if constexpr (kCodes<T>)  // the P positions' scales, for each of the NH heads
        factor = NH == 1 ? _mm256_loadu_ps(k_scale + p)
                         : _mm256_broadcast_ps(reinterpret_cast<const __m128*>(k_scale + p));
      alignas(32) float t[8];
      _mm256_store_ps(t, _mm256_mul_ps(total, factor));
      for (int h = 0; h < NH; ++h)
        for (int j = 0; j < P; ++j) s[h * s_stride + p + j] = t[h * P + j];
    }
#endif
  for (; p < len; ++p)
    for (int h = 0; h < NH; ++h)
      s[h * s_stride + p] = dot_widened(q + h * D, k[p] + offset, D) * (kCodes<T> ? k_scale[p] : scale);
}

// out[h * D + i] += sum_p w[h * w_stride + p] * widen((v[p] + offset)[i]) for i < D and NH query heads h that share
// the value vectors (for a quantized cache, w holds each weight times its position's scale), the positions p = 0 ..
// len - 1 added in order (each output element its own chain of FMAs, as a running sum over the positions would
// give). The sums of 64 / NH elements of each head stay in registers while the positions stream by, each value
// vector widened once for the NH heads.
template <int NH, typename T>
inline void weighted_sum(const float* w, int64_t w_stride, const T* const* v, int64_t offset, int64_t len,
                         float* out, int64_t D) {
  int64_t i = 0;
#ifdef NANOQWEN_AVX2
  constexpr int C = 8 / NH;  // vectors of 8 per head in registers
  for (; i + 8 * C <= D; i += 8 * C) {
    __m256 acc[NH][C];
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < C; ++u) acc[h][u] = _mm256_loadu_ps(out + h * D + i + 8 * u);
    for (int64_t p = 0; p < len; ++p) {
      __m256 wp[NH];
      for (int h = 0; h < NH; ++h) wp[h] = _mm256_set1_ps(w[h * w_stride + p]);
      for (int u = 0; u < C; ++u) {
        const __m256 vv = widen8(v[p] + offset + i + 8 * u);
        for (int h = 0; h < NH; ++h) acc[h][u] = _mm256_fmadd_ps(wp[h], vv, acc[h][u]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < C; ++u) _mm256_storeu_ps(out + h * D + i + 8 * u, acc[h][u]);
  }
  for (; i + 8 <= D; i += 8)
    for (int h = 0; h < NH; ++h) {
      __m256 acc = _mm256_loadu_ps(out + h * D + i);
      for (int64_t p = 0; p < len; ++p)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(w[h * w_stride + p]), widen8(v[p] + offset + i), acc);
      _mm256_storeu_ps(out + h * D + i, acc);
    }
#endif
  for (; i < D; ++i)
    for (int h = 0; h < NH; ++h) {
      float acc = out[h * D + i];
      for (int64_t p = 0; p < len; ++p) acc = std::fma(w[h * w_stride + p], widen(v[p][offset + i]), acc);
      out[h * D + i] = acc;
    }
}

// A tensor's dtype as torch names it (torch.int8, not c10's Char), for the messages below.
std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    default: return c10::toString(type);
  }
}

// The KV cache as attention_inputs and paged_decode_attention take it: k_cache, v_cache [blocks, block_size, Hkv, D]
// bf16, or a quantized cache's codes (int8, float8_e4m3fn, float8_e5m2: nanoqwen/attention/kv_cache.py) with their
// float32 scales k_scale, v_scale [blocks, block_size, Hkv] (none for bf16). Returns the elements' type.
at::ScalarType check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const at::ScalarType type = k_cache.scalar_type();
  TORCH_CHECK(type == at::kBFloat16 || type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2,
              "k_cache must be bfloat16, or a quantized cache's int8, float8_e4m3fn or float8_e5m2 codes "
              "(kv_cache_dtype auto, int8, fp8_e4m3, fp8_e5m2), got ", dtype_name(type));
  TORCH_CHECK(v_cache.scalar_type() == type, "v_cache must be ", dtype_name(type), " as k_cache is, got ",
              dtype_name(v_cache.scalar_type()));
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu(), t == &k_cache ? "k_cache" : "v_cache", " must be a CPU tensor");
    TORCH_CHECK(t->is_contiguous(), t == &k_cache ? "k_cache" : "v_cache", " must be contiguous");
  }
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be [blocks, block_size, Hkv, D], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  if (type == at::kBFloat16) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(),
                "k_scale and v_scale are a quantized cache's scales: a bfloat16 cache has none");
    return type;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "a ", dtype_name(type),
              " cache needs its scales k_scale and v_scale [blocks, block_size, Hkv] (float32)");
  for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
    const char* name = t == &*k_scale ? "k_scale" : "v_scale";
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, name, " must be a CPU float32 tensor, got ",
                dtype_name(t->scalar_type()), " on ", t->device());
    TORCH_CHECK(t->sizes() == k_cache.sizes().slice(0, 3), name, " must be [", k_cache.size(0), ", ", k_cache.size(1),
                ", ", k_cache.size(2), "] as the cache's [blocks, block_size, Hkv], got ", t->sizes());
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
  }
  return type;
}

// The largest code magnitude of a quantized cache (nanoqwen/attention/kv_cache.py KV_QUANTIZATIONS' qmax).
template <typename C>
constexpr float kQmax = std::is_same_v<C, int8_t> ? 127.0f : std::is_same_v<C, at::Float8_e4m3fn> ? 448.0f : 57344.0f;

// One vector x of D bf16 values quantized as quantize_kv (nanoqwen/attention/kv_cache.py) does, to the same bits:
// scale = max|x| / qmax in float32, codes = x / scale (a float32 division) clamped to +-qmax, then rounded to C
// (int8: to nearest, ties to even, as torch.round; float8: c10's conversion, as torch's .to); zeros where the scale
// is not positive (a zero vector; a NaN's scale is NaN, its codes zeros, as torch.where gives them). Writes the codes,
// returns the scale. (A vector holding an infinity, and no NaN, gets an infinite scale and codes that need not be
// quantize_kv's: torch's clamp keeps the NaN of inf / inf, this one does not.)
template <typename C>
float quantize_row(const uint16_t* x, int64_t D, C* codes) {
  constexpr float qmax = kQmax<C>;
  int64_t i = 0;
  float amax = 0.0f;
  bool nan = false;
#ifdef NANOQWEN_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, load8_bf16(x + i));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, a);
  }
  amax = hmax(vmax);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < D; ++i) {
    const float a = std::fabs(bf16_to_float(x[i]));
    nan = nan || std::isnan(a);
    amax = std::max(amax, a);
  }
  const float scale = nan ? NAN : amax / qmax;
  if (!(scale > 0.0f)) {
    std::memset(static_cast<void*>(codes), 0, D * sizeof(C));
    return scale;
  }
  i = 0;
#ifdef NANOQWEN_AVX2
  const __m256 vscale = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
  for (; i + 8 <= D; i += 8) {
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(load8_bf16(x + i), vscale), lo), hi);
    if constexpr (std::is_same_v<C, int8_t>) {
      const __m256i r = _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(r16, r16));
    } else {
      alignas(32) float f[8];
      _mm256_store_ps(f, y);
      for (int j = 0; j < 8; ++j) codes[i + j] = C(f[j]);
    }
  }
#endif
  for (; i < D; ++i) {
    const float y = std::min(std::max(bf16_to_float(x[i]) / scale, -qmax), qmax);
    if constexpr (std::is_same_v<C, int8_t>) codes[i] = static_cast<int8_t>(std::nearbyint(y));
    else codes[i] = C(y);
  }
  return scale;
}

// f(pointer) with the cache's data pointer as its element type: const uint16_t* (bf16), const int8_t*, const
// at::Float8_e4m3fn*, const at::Float8_e5m2* (check_cache's types).
template <typename F>
void with_elements(at::ScalarType type, void* data, const F& f) {
  switch (type) {
    case at::kChar: return f(static_cast<int8_t*>(data));
    case at::kFloat8_e4m3fn: return f(static_cast<at::Float8_e4m3fn*>(data));
    case at::kFloat8_e5m2: return f(static_cast<at::Float8_e5m2*>(data));
    default: return f(static_cast<uint16_t*>(data));
  }
}

}  // namespace

// Decode attention over the paged KV cache, in place (no gather): q [B, Hq, D]; k_cache, v_cache
// [num_blocks, block_size, Hkv, D]; block_tables [B, W] int32; context_lens [B] int32 -> [B, Hq, D].
// Row b's query attends to positions 0 .. context_lens[b] - 1 (position p: slot p % block_size of block
// block_tables[b, p / block_size]); the G = Hq / Hkv query heads of a kv head share its keys. Scores,
// softmax and the weighted sum are float32, the output rounded to bf16 once (as
// paged_decode_attention_reference). A row with context_len 0 gets zeros.
//
// A quantized cache (check_cache: int8 or float8 codes, float32 scales k_scale, v_scale [num_blocks, block_size,
// Hkv], one a position and kv head) is read as it is, each code widened to float32 as it is used (no dequantized
// copy): a score is k_scale[p, h] * dot(q, codes) (the scale after the dot, one product a score), and the softmax's
// weight exp(s - m) of a position, once l (their sum) is taken, is multiplied by v_scale[p, h] before the weighted
// sum of the codes. The same function as the reference over the dequantized cache (codes * scale), up to float32
// rounding. A position's row is then Hkv * D bytes, not twice that: half the bytes to read, the same work on them.
//
// Split-context ("flash decoding"): each row's positions are cut into equal spans of at most kSpan (and, while
// a row has fewer spans than its share of the threads, of at least kMinSpan: a 100-token context's attention
// then runs on both threads of a 2-core CPU, not one), and a task takes one span of one row for all heads. The
// cache holds a position's Hkv heads side by side (Hkv * D values), so a task reads its span's keys, then its
// values, as contiguous runs, a few positions at a time, all heads of those before the next (and the next few
// positions' rows asked for meanwhile): one head at a time over the whole context would read D values every
// Hkv * D, which waits on memory once the cache is larger than the caches (long contexts). The query heads of
// a kv head go in pairs, so that each key and value vector is widened to float32 once for two. A task leaves, per
// query head, its span's largest score m, the sum l of exp(s - m) and the sum o of exp(s - m) * v; the spans
// of a row are then combined: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, M the largest m_c.
constexpr int64_t kSpan = 256;  // positions per task
constexpr int64_t kMinSpan = 32;  // positions per span at least, when a row's spans are shortened for the threads
constexpr int64_t kGroup = 16;  // positions per weighted_sum call: its sums loaded and stored once per 16

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                                  const at::Tensor& context_lens_in, double scale,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  at::Tensor q = q_in.contiguous();
  check_bf16(q, "q");
  const at::ScalarType cache_type = check_cache(k_cache, v_cache, k_scale, v_scale);
  TORCH_CHECK(q.dim() == 3, "q must be [B, Hq, D], got ", q.sizes());
  at::Tensor block_tables = block_tables_in.to(at::kInt).contiguous();
  at::Tensor context_lens = context_lens_in.to(at::kInt).contiguous();
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
  at::Tensor out = new_output(q.sizes(), q.options());
  const uint16_t* qp = bf16_ptr(q);
  uint16_t* op = bf16_ptr_mut(out);
  const float* ksp = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;
  const float* vsp = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;
  std::vector<float> span_o(tasks * Hq * D, 0.0f), span_m(tasks * Hq), span_l(tasks * Hq);
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, span[b]);
  // the spans' tasks, for the cache's element type T (kp, vp: its codes or bf16 values)
  auto attend_spans = [&](auto* kp_any) {
    using T = std::remove_pointer_t<decltype(kp_any)>;
    const T *kp = kp_any, *vp = static_cast<const T*>(v_cache.data_ptr());
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(Hq * D), scores(Hq * longest);
      std::vector<const T*> k_rows(longest), v_rows(longest);  // the span's positions' rows, all heads
      // a quantized cache's scales of the span's positions, [Hkv, longest]: k's times `scale` and kCodeUnit<T>, v's
      // times kCodeUnit<T>
      std::vector<float> k_scales(kCodes<T> ? Hkv * longest : 0), v_scales(kCodes<T> ? Hkv * longest : 0);
      int64_t b = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
      for (int64_t task = begin; task < end; ++task) {
        while (task >= first_task[b + 1]) ++b;
        const int64_t start = (task - first_task[b]) * span[b], len = std::min<int64_t>(span[b], lens[b] - start);
        for (int64_t i = 0; i < Hq * D; ++i) qf[i] = bf16_to_float(qp[b * Hq * D + i]);
        for (int64_t j = 0; j < len; ++j) {  // position p: slot p % bs of block block_tables[b, p / bs]
          const int64_t p = start + j, slot = tables[b * W + p / bs] * bs + p % bs;
          k_rows[j] = kp + slot * row;
          v_rows[j] = vp + slot * row;
          if constexpr (kCodes<T>)
            for (int64_t h = 0; h < Hkv; ++h) {
              k_scales[h * longest + j] = ksp[slot * Hkv + h] * (float(scale) * kCodeUnit<T>);
              v_scales[h * longest + j] = vsp[slot * Hkv + h] * kCodeUnit<T>;
            }
        }
        // Positions from .. to - 1 of the span, elements offset .. offset + D - 1 (one kv head: whole cache lines)
        // of each, asked for ahead of their use (to L2). One head's lines at a time, before each head's work, so
        // that the requests go out all along the loop and memory works while the scores and sums are computed (all
        // of a block's rows at once filled the miss queues, and the thread waited on them: no overlap, as slow as
        // memory and computing one after the other).
        auto prefetch = [&](const std::vector<const T*>& rows, int64_t from, int64_t to, int64_t offset) {
#ifdef NANOQWEN_AVX2
          constexpr int64_t line = 64 / sizeof(T);  // elements a cache line
          for (int64_t j = from; j < std::min(to, len); ++j)
            for (int64_t e = 0; e < D; e += line)
              _mm_prefetch(reinterpret_cast<const char*>(rows[j] + offset + e), _MM_HINT_T1);
#endif
        };
        // scores[hq * longest + j]: query head hq against position start + j, 8 positions at a time
        for (int64_t h = 0; h < Hkv; ++h) prefetch(k_rows, 0, 8, h * D);
        for (int64_t j = 0; j < len; j += 8) {
          // query heads hq = h * G + g two at a time where two share kv head h (its keys widened once for both)
          for (int64_t hq = 0, pair; hq < Hq; hq += pair ? 2 : 1) {
            pair = hq % G + 1 < G;
            const int64_t n = std::min<int64_t>(8, len - j), offset = (hq / G) * D;
            if (hq % G == 0) {  // this head's keys of the next 8 positions (after the last: its first values)
              if (j + 8 < len) prefetch(k_rows, j + 8, j + 16, offset);
              else prefetch(v_rows, 0, kGroup, offset);
            }
            const float* qh = qf.data() + hq * D;
            const float* ks = kCodes<T> ? k_scales.data() + (hq / G) * longest + j : nullptr;
            float* s = scores.data() + hq * longest + j;
            if (pair) attention_scores<2>(qh, k_rows.data() + j, offset, n, D, float(scale), ks, s, longest);
            else attention_scores<1>(qh, k_rows.data() + j, offset, n, D, float(scale), ks, s, longest);
          }
        }
        float* m = span_m.data() + task * Hq;
        float* l = span_l.data() + task * Hq;
        for (int64_t hq = 0; hq < Hq; ++hq) {  // scores -> exp(s - m), their sum l (then times v's scales)
          float* s = scores.data() + hq * longest;
          const float mx = max_of(s, len);
          m[hq] = mx;
          l[hq] = exp_minus_max(s, len, mx);
          if constexpr (kCodes<T>) {
            const float* vs = v_scales.data() + (hq / G) * longest;
            for (int64_t j = 0; j < len; ++j) s[j] *= vs[j];
          }
        }
        float* o = span_o.data() + task * Hq * D;
        for (int64_t j = 0; j < len; j += kGroup) {
          for (int64_t hq = 0, pair; hq < Hq; hq += pair ? 2 : 1) {  // (as above: values widened once for a pair)
            pair = hq % G + 1 < G;
            const float* w = scores.data() + hq * longest + j;
            const int64_t n = std::min<int64_t>(kGroup, len - j), offset = (hq / G) * D;
            if (hq % G == 0) prefetch(v_rows, j + kGroup, j + 2 * kGroup, offset);  // the next positions' values
            if (pair) weighted_sum<2>(w, longest, v_rows.data() + j, offset, n, o + hq * D, D);
            else weighted_sum<1>(w, longest, v_rows.data() + j, offset, n, o + hq * D, D);
          }
        }
      }
    });
  };
  with_elements(cache_type, k_cache.data_ptr(), attend_spans);
  std::vector<float> weight(tasks);  // weight[c]: e^(m_c - M) of span c
  at::parallel_for(0, B, 1, [&](int64_t row_begin, int64_t row_end) {  // combine each row's spans
    std::vector<float> total(D);
    for (int64_t b = row_begin; b < row_end; ++b)
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
  });
  return out;
}

// What a decoder layer does between qkv_proj and attention, row by row in one pass (decode_layer's step): q and
// k through their per-head RMSNorm and RoPE, k and v written to their cache slots. qkv [M, (Hq + 2 Hkv) D]; k_cache,
// v_cache [blocks, block_size, Hkv, D]; slot_mapping [M] -> q [M, Hq, D]. The same row functions as rms_norm and
// apply_rope, so the same bits as those kernels and index_copy_ into the cache, without their tensors and calls.
// A quantized cache (check_cache: codes, and scales k_scale, v_scale [blocks, block_size, Hkv]) gets each head's
// bf16 k (after RoPE, the bits above) and v quantized as KVCache.store quantizes them (quantize_row: quantize_kv's
// bits), its codes and scale at the slot.
at::Tensor attention_inputs(const at::Tensor& qkv_in, const at::Tensor& q_norm, const at::Tensor& k_norm,
                            double eps, int64_t num_heads, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slot_mapping_in, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  at::Tensor qkv = qkv_in.contiguous();
  check_bf16(qkv, "qkv");
  const at::ScalarType cache_type = check_cache(k_cache, v_cache, k_scale, v_scale);
  const int64_t Hq = num_heads, Hkv = k_cache.size(2), D = k_cache.size(3), M = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (Hq + 2 * Hkv) * D, "qkv must be [M, ", (Hq + 2 * Hkv) * D,
              "] for ", Hq, " query and ", Hkv, " kv heads of ", D, ", got ", qkv.sizes());
  check_vector(q_norm, "q_norm", D);
  check_vector(k_norm, "k_norm", D);
  check_rope(cos, sin, M, D);
  at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == M, "slot_mapping must be [", M, "], got ", slots.sizes());
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), row = (Hq + 2 * Hkv) * D;
  at::Tensor q = new_output({M, Hq, D}, qkv.options());
  const uint16_t *qkv_p = bf16_ptr(qkv), *qn = bf16_ptr(q_norm), *kn = bf16_ptr(k_norm);
  const uint16_t *cp = bf16_ptr(cos), *sp = bf16_ptr(sin);
  uint16_t* q_p = bf16_ptr_mut(q);
  float* ksp = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;
  float* vsp = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(slot[m] >= 0 && slot[m] < num_slots, "slot_mapping[", m, "]=", slot[m], " is outside the cache (",
                num_slots, " slots)");
  std::vector<uint16_t> normed(D), rotated(D);  // one head after its RMSNorm, and after RoPE
  with_elements(cache_type, k_cache.data_ptr(), [&](auto* kp) {
    using T = std::remove_pointer_t<decltype(kp)>;  // (uint16_t: bf16 values, else a quantized cache's codes)
    T* vp = static_cast<T*>(v_cache.data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t *r = qkv_p + m * row, *c = cp + m * D, *s = sp + m * D;
      for (int64_t h = 0; h < Hq; ++h) {
        rms_norm_row(r + h * D, qn, D, float(eps), normed.data());
        rope_row(normed.data(), c, s, D, q_p + (m * Hq + h) * D);
      }
      const int64_t at = slot[m] * Hkv;  // the slot's first head, in scales (its codes: at * D)
      for (int64_t h = 0; h < Hkv; ++h) {
        rms_norm_row(r + (Hq + h) * D, kn, D, float(eps), normed.data());
        if constexpr (kCodes<T>) {
          rope_row(normed.data(), c, s, D, rotated.data());
          ksp[at + h] = quantize_row(rotated.data(), D, kp + (at + h) * D);
          vsp[at + h] = quantize_row(r + (Hq + Hkv + h) * D, D, vp + (at + h) * D);
        } else {
          rope_row(normed.data(), c, s, D, kp + (at + h) * D);
        }
      }
      if constexpr (!kCodes<T>) std::memcpy(vp + at * D, r + (Hq + Hkv) * D, Hkv * D * sizeof(uint16_t));
    }
  });
  return q;
}

}  // namespace nanoqwen
