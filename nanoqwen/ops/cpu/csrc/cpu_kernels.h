// Shared by nanoqwen's CPU kernels (nanoqwen/ops/cpu/kernels.py builds the files beside this one into one
// extension): the CPU features they are compiled for, bf16 conversions and AVX2 helpers, how a product's rows
// are shared among threads, and the kernels' entry points, one file each:
//
//   gemv.cpp        bf16_gemv, int8_gemv: y = x @ w.T for few rows of x, streaming the weights once
//   gemm.cpp        bf16_gemm, int8_gemm: y = x @ w.T for many rows of x in float32 from bf16 / int8 weights;
//                   prefill_attention: a prompt chunk's attention, its two products through the same kernel;
//                   causal_softmax_: the softmax between torch's two products on the bf16 path
//   int4_gemv.cpp   int4_gemv: group-wise int4 weights times int8-quantised x (decode; more rows to int4_gemm)
//   int4_gemm.cpp   int4_gemm: the same product on unpacked panels (prompts, batches); int4_amx: on AMX tiles
//                   (amx.cpp), where the CPU has them; int4.h: what the int4 kernels share
//   decode_ops.cpp  rms_norm, add_rms_norm, apply_rope, swiglu: a decode step's elementwise rest; argmax: the
//                   sampler's greedy choice; top_p_threshold, exponential_race: its top-p filter and its draw
//   kv_cache_ops.cpp  paged_decode_attention, attention_inputs: attention over the paged KV cache and a decode
//                   step's store into it (a bf16 cache, or int8 / float8 codes with their scales)
//   module.cpp      decode_model (a decode step's whole forward in one call) and the Python bindings
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
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

namespace nanoqwen {

// The zero point of a symmetric int4 matrix (no offsets): each weight scale * (q - 8) (ops/quantize.py SYMMETRIC_ZERO)
constexpr float kSymmetricZero = 8.0f;
constexpr int64_t kTaskBytes = 256 << 10;    // weight bytes a parallel task reads at least
// int4: how far ahead of the current weight line to prefetch. Tuned: on an Intel Xeon, int4 decode faster at
// 2 KB than at 4 KB, 1 KB as 2 KB; on the AMD EPYC, int4_gemv alone read level or slower at 2 KB than at 4 KB
// (bench/ab_kernels.py measures it)
constexpr int kPrefetchBytes = 2048;
// gemv.cpp's bf16/int8 kernels read R weight rows side by side, R streams a thread: each row prefetched this far
// ahead (tuned: bench/ab_kernels.py)
constexpr int kRowPrefetchBytes = 1024;
constexpr int kOwnSharePercent = 85;         // of a product's rows, split evenly over threads (parallel_rows below)
constexpr int kChunksPerThread = 4;          // the other rows: this many chunks per thread
constexpr int64_t kClaimBytes = 16 << 10;    // weight bytes a claim takes at least (parallel_rows_stealing)

// A bf16 tensor's data as its bits.
inline const uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* bf16_ptr_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// bf16 -> float32: a bf16 is the upper 16 bits of a float32.
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t float_to_bf16(float f) { return at::BFloat16(f).x; }  // round to nearest even
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

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

// acc + the 16 products of int16 w and x, summed in pairs into 8 int32 lanes (int8_gemv, int8_group_gemv).
inline __m256i dot16_int16(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}
inline __m256 load8(const uint16_t* p) { return load8_bf16(p); }
inline __m256 load8(const int8_t* p) { return load8_int8(p); }
inline __m256 load8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
// 8 float16 -> 8 float32 (exact).
inline __m256 load8(const at::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}

// 8 float16 bit patterns (16-bit lanes) -> 8 float32 (exact).
inline __m256 half8_to_float(__m128i h) {
#ifdef __F16C__
  return _mm256_cvtph_ps(h);
#else
  alignas(16) uint16_t bits[8];
  alignas(32) float f[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(bits), h);
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(at::Half(bits[i], at::Half::from_bits()));
  return _mm256_load_ps(f);
#endif
}

// 8 e4m3 bytes (float8_e4m3fn) -> their values / 256 in float32, exact, normals and subnormals alike: a byte
// s eeee mmm as the float16 bits s 0eeee mmm 0000000 (the exponent's bias moves from 7 to 15). The byte sign-extended
// to 16 bits and shifted left by 7 has s at bits 15 and 14 and the rest in place: bit 14 cleared. (e4m3 has no
// infinities; its NaN patterns come out as float16 ones of other values.)
inline __m256 load8_e4m3_div256(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return half8_to_float(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF))));
}

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

#ifdef __AVX512F__
// exp8's function on 16 lanes (AVX-512).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365478515625f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
// load8_e4m3_div256 on 16 lanes.
inline __m512 load16_e4m3_div256(const uint8_t* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
}
// 16 bf16 -> 16 float32; 16 float32 -> 16 bf16 (round to nearest even, bf16_bits' rounding).
inline __m512 load16_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16_bf16(uint16_t* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#endif

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
inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }

// max |x[i]| for i < n (bf16 x): the scale of a block of x quantised to integers (int4_gemv, int8_gemv).
inline float absmax_bf16(const uint16_t* x, int64_t n) {
  int64_t i = 0;
  float amax = 0.0f;
#ifdef NANOQWEN_AVX2
  __m256 vmax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8_bf16(x + i)));  // |x|
  amax = hmax(vmax);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(bf16_to_float(x[i])));
  return amax;
}

// s[j] = e^(s[j] - mx) for j < n, in place; returns their sum (a softmax's numerators and its denominator).
inline float exp_minus_max(float* s, int64_t n, float mx) {
  int64_t j = 0;
  float sum = 0.0f;
#ifdef NANOQWEN_AVX2
  __m256 total = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  sum = hsum(total);
#endif
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  return sum;
}

// body(begin, end) over the rows [0, N) on torch's threads: the work of at::parallel_for(0, N, grain, body),
// shared out so that a thread that streams its weights more slowly in this call does fewer rows. Each thread
// first takes its own contiguous share of the first kOwnSharePercent of the rows (one sequential stream per
// thread, no coordination), then the rest in chunks from a shared counter until none is left. Equal static
// shares make the first thread to finish wait for the other in every product (at batch 1 the two threads'
// read speeds drift apart; bench/ab_kernels.py measures it); all-dynamic small chunks cost more in broken
// streams than they save. A row's result depends only on where the chunks are cut (fixed for a given
// N and thread count), not on which thread runs it, so the output is the same from call to call.
template <typename F>
inline void parallel_rows(int64_t N, int64_t grain, const F& body) {
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

// body(begin, end) over the rows [0, N) on torch's threads, shared out by work stealing: each thread streams its
// own equal share, taking `claim` rows at a time; a thread whose share is done takes the back half of what is
// left of the fullest other share, which becomes its own. Each thread reads one long sequential stream, then a
// few shorter ones, and the threads end within a claim of each other. Used where body reads each claim as one
// stream (int4_gemv; int4_gemm's panels), where it decodes faster than parallel_rows, whose tail is many small chunks
// (bench/ab_kernels.py measures it). bf16 and int8 keep parallel_rows: their body cuts its range into three
// streams, which needs long ranges. Where the ranges are cut changes from call to call, so a row's result must
// not depend on it (int4: blocks of 16 rows, each computed alone).
//
// A share [begin, end) is one 64-bit word (begin << 32 | end), so that its owner's claim from the front and a
// thief's cut of the back are each one compare-and-swap and never both take a row.
template <typename F>
inline void parallel_rows_stealing(int64_t N, int64_t grain, int64_t claim, const F& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), N / grain);
  if (threads <= 1) return at::parallel_for(0, N, grain, body);
  TORCH_CHECK(N < (int64_t(1) << 32), "parallel_rows_stealing: ", N, " rows do not fit its 32-bit ranges");
  struct alignas(64) Share { std::atomic<uint64_t> range; };  // a cache line each: claims stay on their core
  const std::unique_ptr<Share[]> shares(new Share[threads]);
  auto pack = [](int64_t begin, int64_t end) { return uint64_t(begin) << 32 | uint64_t(end); };
  auto begin_of = [](uint64_t range) { return int64_t(range >> 32); };
  auto end_of = [](uint64_t range) { return int64_t(range & 0xffffffffu); };
  for (int64_t t = 0; t < threads; ++t) shares[t].range.store(pack(N * t / threads, N * (t + 1) / threads));
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {  // one thread each (inline: all of them)
    for (int64_t t = first; t < last; ++t) {
      std::atomic<uint64_t>& mine = shares[t].range;
      while (true) {
        uint64_t r = mine.load(std::memory_order_relaxed);
        if (begin_of(r) < end_of(r)) {  // claim the next rows of my share
          const int64_t begin = begin_of(r), end = std::min(end_of(r), begin + claim);
          if (mine.compare_exchange_weak(r, pack(end, end_of(r)), std::memory_order_acq_rel)) body(begin, end);
          continue;
        }
        int64_t victim = -1, most = claim;  // a share of one claim or less left: its owner finishes it
        for (int64_t u = 0; u < threads; ++u) {
          const uint64_t x = shares[u].range.load(std::memory_order_relaxed);
          if (u != t && end_of(x) - begin_of(x) > most) {
            most = end_of(x) - begin_of(x);
            victim = u;
          }
        }
        if (victim < 0) break;  // (not return: run inline, the next shares are still to do)
        uint64_t x = shares[victim].range.load(std::memory_order_relaxed);
        const int64_t begin = begin_of(x), end = end_of(x), middle = begin + (end - begin + 1) / 2;
        if (end - begin > claim &&  // the owner keeps [begin, middle), the back half becomes mine
            shares[victim].range.compare_exchange_strong(x, pack(begin, middle), std::memory_order_acq_rel))
          mine.store(pack(middle, end), std::memory_order_relaxed);
      }
    }
  });
}

// ---- A decode step's outputs, recycled from step to step.
//
// decode_model calls some ten kernels a layer, and each allocates its output: at::empty in a decode step (its
// data cold after the weights streamed through the caches) costs as much as a small kernel's work.
// While a RecycledOutputs is alive on a thread (decode_model makes one), new_output hands out a tensor of this
// thread's pool that has the shape and dtype asked for and that nothing else holds any more (neither the tensor
// nor its storage is referenced outside the pool), and adds a new one to the pool when none is free; elsewhere it
// is at::empty (bench/ab_kernels.py measures what the pool buys). The pool holds one batch size's buffers, the last
// step's (a step of another size empties it first: a pool of every size would hold an LM head's output of each),
// until its thread ends.
struct OutputPool {
  int64_t rows = -1;  // the batch size its buffers are for
  std::vector<at::Tensor> buffers;
};
inline thread_local OutputPool* t_output_pool = nullptr;

class RecycledOutputs {
 public:
  explicit RecycledOutputs(int64_t rows) : previous_(t_output_pool) {
    OutputPool& p = pool();
    if (p.rows != rows) p.buffers.clear();
    p.rows = rows;
    t_output_pool = &p;
  }
  ~RecycledOutputs() { t_output_pool = previous_; }
  RecycledOutputs(const RecycledOutputs&) = delete;
  RecycledOutputs& operator=(const RecycledOutputs&) = delete;

 private:
  static OutputPool& pool() {
    static thread_local OutputPool this_thread;
    return this_thread;
  }
  OutputPool* previous_;
};

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (t_output_pool == nullptr) return at::empty(sizes, options);
  for (const at::Tensor& t : t_output_pool->buffers)
    if (t.use_count() == 1 && t.storage().use_count() == 1 && t.sizes() == sizes && t.dtype() == options.dtype())
      return t;
  return t_output_pool->buffers.emplace_back(at::empty(sizes, options));
}

inline void check_vector(const at::Tensor& t, const char* name, int64_t N) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N, name, " must have shape [", N, "], got ", t.sizes());
}

// ---- The entry points (shapes and what each computes: beside its definition).

// gemv.cpp
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
// fp8_gemv.cpp
at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor int8_group_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                           const std::optional<at::Tensor>& offset,
                           const std::optional<at::Tensor>& super_scale = std::nullopt,
                           const std::optional<at::Tensor>& super_offset = std::nullopt);
// bits a value of grouped int8 values q [N, ...] with `groups` groups a row (ops/quantize.py packed_bits)
int int8_group_bits(const at::Tensor& q, int64_t groups);
at::Tensor int8_group_dequantize(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                                 const std::optional<at::Tensor>& super_scale,
                                 const std::optional<at::Tensor>& super_offset, int64_t K);
// gemm.cpp
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w);
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_cached,
                             double scale, int64_t block);
void causal_softmax_(const at::Tensor& scores, int64_t block);
// int4_gemv.cpp, int4_gemm.cpp
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& offset,
                     const std::optional<at::Tensor>& super_scale = std::nullopt,
                     const std::optional<at::Tensor>& super_offset = std::nullopt, int64_t amx_min_rows = 0);
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& offset,
                     const std::optional<at::Tensor>& super_scale = std::nullopt,
                     const std::optional<at::Tensor>& super_offset = std::nullopt);
at::Tensor int4_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                    const std::optional<at::Tensor>& offset,
                    const std::optional<at::Tensor>& super_scale = std::nullopt,
                    const std::optional<at::Tensor>& super_offset = std::nullopt);
// amx.cpp: AMX tiles for int4_gemm.cpp's int4_amx (amx_int4_tile's comment says what it computes)
bool amx_int8_ready();
// From how many rows decode_model's int4 products run on AMX tiles (0, the default: never): the process's choice
// (nanoqwen/ops/cpu/selection.py sets it with its int4_amx_min_rows). The tiles compute the same bits as the other
// int4 kernels, so this changes only the speed.
void set_int4_amx_min_rows(int64_t rows);
int64_t int4_amx_min_rows();
void amx_int4_begin(int64_t G);
void amx_end();
bool amx_bf16_ready();
at::Tensor bf16_amx(const at::Tensor& x, const at::Tensor& w);
at::Tensor int8_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
void amx_int4_tile(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t G, int64_t m0, int rows,
                   const uint8_t* panel, const float* scale, const float* offset, int np, const int* cols, int64_t N,
                   int64_t n0, at::BFloat16* y, const uint8_t* ahead, int64_t ahead_bytes);
// decode_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                                double eps);
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor swiglu(const at::Tensor& gate_up);
at::Tensor argmax(const at::Tensor& values);
at::Tensor top_p_threshold(const at::Tensor& probs, const at::Tensor& top_p);
at::Tensor exponential_race(const at::Tensor& probs, const std::optional<at::Tensor>& token_ids,
                            const at::Tensor& keys);
// (their row functions and checks, shared with kv_cache_ops.cpp's attention_inputs)
void check_bf16(const at::Tensor& t, const char* name);
void rms_norm_row(const uint16_t* xr, const uint16_t* wp, int64_t D, float eps, uint16_t* yr);
void rope_row(const uint16_t* xr, const uint16_t* c, const uint16_t* s, int64_t D, uint16_t* yr);
void check_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t N, int64_t D);
// kv_cache_ops.cpp
at::Tensor attention_inputs(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm,
                            double eps, int64_t num_heads, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale = std::nullopt,
                            const std::optional<at::Tensor>& v_scale = std::nullopt);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  const std::optional<at::Tensor>& k_scale = std::nullopt,
                                  const std::optional<at::Tensor>& v_scale = std::nullopt);

}  // namespace nanoqwen
