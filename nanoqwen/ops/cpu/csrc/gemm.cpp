// bf16_gemm: y = x @ w.T for many rows of x (a prompt, a large batch), computed in float32 from bf16 weights,
// for CPUs without fast bf16 arithmetic; int8_gemm: the same with int8 weights and a scale per output,
// y = (x @ q.T) * scale (quantization/int8.py's format). The plain way there (ops/cpu/matmul.py's upcast_linear) converts
// the weights to float32 and calls torch's float32 product; this does the same arithmetic in one pass, as BLIS and
// OpenBLAS structure a GEMM (Goto's algorithm), converting bf16 while packing:
//
//   x is packed once into panels of kMR rows, [K][kMR] float32 each (so a kernel reads kMR values per step);
//   the threads take blocks of kNC output columns (weight rows) in turn and walk each in steps of kKC depth:
//   the step's weights are converted and packed into panels of kNR columns, [kKC][kNR] float32 (a panel
//   stays in L1 while the row panels of x stream past it from L2);
//   the kernel multiplies a kMR x kKC piece of x by a kKC x kNR panel into kMR x kNR float32 accumulators
//   (12 AVX2 registers of 8 lanes: 6 broadcasts and 2 panel loads feed 12 FMAs a step), added to the block's
//   float32 partial sums; the last depth block's sums are rounded to the output dtype once.
//
// It computes what torch.nn.functional.linear(x.float(), w.float()) computes, rounded to x's dtype, up to the
// order of float32 additions (tests/ops/cpu/test_kernels.py checks it against that reference). The block sizes were
// tuned on a Zen 3 (32 KiB L1, 512 KiB L2 a core); bench/bench_model.py's prefill measures them, and
// docs/tried-and-not-kept.md lists the sizes tried.

#include "cpu_kernels.h"

namespace nanoqwen {
namespace {

constexpr int64_t kMR = 6;     // rows of x a kernel call covers (6 x 2 accumulators + 2 panel + 1 broadcast
constexpr int64_t kNR = 16;    // registers = 15 of AVX2's 16); output columns: two 8-lane vectors
constexpr int64_t kKC = 256;   // depth of a block: a [kKC][kNR] float32 weight panel is 16 KiB, in L1
constexpr int64_t kNC = 128;   // output columns of a block: its packed weights are 128 KiB, in L2
constexpr int64_t kMC = 96;    // rows of x a kernel sweep covers per weight panel (96 x kKC float32 in L2)

inline float load_float(float v) { return v; }
inline float load_float(uint16_t v) { return bf16_to_float(v); }

// x rows [0, rows) of K values (row stride ld) -> [K][kMR] float32, rows past `rows` zero.
template <typename T>
void pack_rows(const T* x, int64_t ld, int64_t rows, int64_t K, float* dst) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t r = 0; r < kMR; ++r) dst[k * kMR + r] = r < rows ? load_float(x[r * ld + k]) : 0.0f;
}

#ifdef NANOQWEN_AVX2
// out[i] = lane i of each of r[0..7] (an 8 x 8 float32 transpose).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    s[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(s[i], s[4 + i], 0x31);
  }
}
#endif

// Weight rows [0, cols) (bf16 or int8, row stride ld), depth [0, kc) -> one panel [kc][kNR] float32, columns
// past `cols` zero.
template <typename TW>
void pack_panel(const TW* w, int64_t ld, int64_t cols, int64_t kc, float* dst) {
  int64_t k = 0;
#ifdef NANOQWEN_AVX2
  if (cols == kNR) {
    for (; k + 8 <= kc; k += 8)
      for (int64_t half = 0; half < kNR; half += 8) {
        __m256 r[8];
        for (int64_t j = 0; j < 8; ++j) r[j] = load8(w + (half + j) * ld + k);
        transpose8(r);  // r[i]: depth k + i of the 8 columns
        for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (k + i) * kNR + half, r[i]);
      }
  }
#endif
  for (; k < kc; ++k)
    for (int64_t j = 0; j < kNR; ++j) dst[k * kNR + j] = j < cols ? to_float(w[j * ld + k]) : 0.0f;
}

// Rows [0, kc) of a matrix stored depth-major (v [kc][ld], bf16), columns [0, cols) -> one panel [kc][kNR]
// float32, columns past `cols` zero (attention's values: no transpose).
void pack_panel_rows(const uint16_t* v, int64_t ld, int64_t cols, int64_t kc, float* dst) {
  for (int64_t k = 0; k < kc; ++k) {
    int64_t j = 0;
#ifdef NANOQWEN_AVX2
    if (cols == kNR) {
      _mm256_storeu_ps(dst + k * kNR, load8_bf16(v + k * ld));
      _mm256_storeu_ps(dst + k * kNR + 8, load8_bf16(v + k * ld + 8));
      continue;
    }
#endif
    for (; j < kNR; ++j) dst[k * kNR + j] = j < cols ? bf16_to_float(v[k * ld + j]) : 0.0f;
  }
}

// acc[kMR][ldc] (+)= a [kc][kMR] @ b [kc][kNR]; `first` overwrites acc instead of adding to it.
void kernel(int64_t kc, const float* a, const float* b, float* acc, int64_t ldc, bool first) {
#ifdef NANOQWEN_AVX2
  // (accumulators start at zero and acc is added after the loop: loading acc into them first made GCC keep
  // them on the stack, a store per FMA)
  if (!first)  // the partial sums are read after the loop; fetch them into L1 meanwhile
    for (int64_t r = 0; r < kMR; ++r) _mm_prefetch(reinterpret_cast<const char*>(acc + r * ldc), _MM_HINT_T0);
  __m256 c[kMR][2];
  _Pragma("GCC unroll 6") for (int64_t r = 0; r < kMR; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * kNR), b1 = _mm256_loadu_ps(b + k * kNR + 8);
    _Pragma("GCC unroll 6") for (int64_t r = 0; r < kMR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + k * kMR + r);
      c[r][0] = _mm256_fmadd_ps(ar, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(ar, b1, c[r][1]);
    }
  }
  if (!first)
    _Pragma("GCC unroll 6") for (int64_t r = 0; r < kMR; ++r)
      for (int64_t h = 0; h < 2; ++h) c[r][h] = _mm256_add_ps(c[r][h], _mm256_loadu_ps(acc + r * ldc + 8 * h));
  _Pragma("GCC unroll 6") for (int64_t r = 0; r < kMR; ++r)
    for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(acc + r * ldc + 8 * h, c[r][h]);
#else
  for (int64_t r = 0; r < kMR; ++r)
    for (int64_t j = 0; j < kNR; ++j) {
      float s = first ? 0.0f : acc[r * ldc + j];
      for (int64_t k = 0; k < kc; ++k) s += a[k * kMR + r] * b[k * kNR + j];
      acc[r * ldc + j] = s;
    }
#endif
}

// acc [row_panels * kMR][ldc], columns [0, np * kNR) = a @ b: a packed [row_panels][K][kMR], b's np column panels
// packed by pack(j, k0, kc, dst) one depth step [k0, k0 + kc) at a time into `panels` (np * kKC * kNR floats). Each
// panel stays in L1 while up to kMC rows of a stream past it.
template <typename Pack>
void block_product(const float* a, int64_t row_panels, int64_t K, int64_t np, const Pack& pack, float* panels,
                   float* acc, int64_t ldc) {
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t kc = std::min(kKC, K - k0);
    for (int64_t j = 0; j < np; ++j) pack(j, k0, kc, panels + j * kc * kNR);
    for (int64_t i0 = 0; i0 < row_panels; i0 += kMC / kMR)
      for (int64_t j = 0; j < np; ++j)
        for (int64_t i = i0; i < std::min(row_panels, i0 + kMC / kMR); ++i)
          kernel(kc, a + i * K * kMR + k0 * kMR, panels + j * kc * kNR, acc + i * kMR * ldc + j * kNR, ldc, k0 == 0);
  }
}

inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = at::BFloat16(v); }

// y [M, N] = (x [M, K] @ w [N, K].T) * scale [N] (bf16; none: 1), rounded to TY once.
template <typename TX, typename TW, typename TY>
void gemm(const TX* x, const TW* w, const uint16_t* scale, TY* y, int64_t M, int64_t N, int64_t K) {
  const int64_t row_panels = (M + kMR - 1) / kMR, col_panels = (N + kNR - 1) / kNR;
  std::vector<float> packed_x(row_panels * K * kMR);  // [row_panels][K][kMR]
  at::parallel_for(0, row_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      pack_rows(x + p * kMR * K, K, std::min(kMR, M - p * kMR), K, packed_x.data() + p * K * kMR);
  });
  // Threads take blocks of kNC columns from a shared counter, so that one that runs faster (the two cores of a
  // small machine drift apart) does more of them. An output's sum runs in the same order whoever computes it.
  constexpr int64_t block_panels = kNC / kNR;
  const int64_t blocks = (col_panels + block_panels - 1) / block_panels;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> panels(block_panels * kKC * kNR);  // a block's weights: [block_panels][kKC][kNR]
    std::vector<float> sums(row_panels * kMR * kNC);       // its partial sums: [rows][kNC]
    for (int64_t block; (block = next.fetch_add(1, std::memory_order_relaxed)) < blocks;) {
      const int64_t p0 = block * block_panels, np = std::min(block_panels, col_panels - p0), n0 = p0 * kNR;
      const auto pack = [&](int64_t j, int64_t k0, int64_t kc, float* dst) {
        pack_panel(w + (n0 + j * kNR) * K + k0, K, std::min(kNR, N - n0 - j * kNR), kc, dst);
      };
      block_product(packed_x.data(), row_panels, K, np, pack, panels.data(), sums.data(), kNC);
      const int64_t cols = std::min(np * kNR, N - n0);
      float col_scale[kNC];
      for (int64_t c = 0; c < cols; ++c) col_scale[c] = scale ? bf16_to_float(scale[n0 + c]) : 1.0f;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < cols; ++c) store(y + m * N + n0 + c, sums[m * kNC + c] * col_scale[c]);
    }
  });
}

}  // namespace

namespace {

// y [..., N] in x's dtype = (x [..., K] @ w [N, K].T) * scale [N], x bf16 or float32, w bf16 or int8.
template <typename TW>
at::Tensor gemm_entry(const char* name, const at::Tensor& x, const at::Tensor& w, const at::Tensor* scale) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), name, ": x and w must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, name,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
  const auto w_type = std::is_same_v<TW, int8_t> ? at::kChar : at::kBFloat16;
  TORCH_CHECK(w.scalar_type() == w_type && w.dim() == 2, name, ": ", scale ? "q" : "w", " must be a 2-D ",
              w_type, " tensor, got ", w.scalar_type(), " ", w.sizes());
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, name, ": x's last dimension must be ", K, ", got ", x.sizes());
  if (scale) check_vector(*scale, "scale", N);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const at::Tensor sc = scale ? scale->contiguous() : at::Tensor();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t M = y.numel() / std::max<int64_t>(N, 1);
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const auto* wp = reinterpret_cast<const TW*>(wc.data_ptr());
  const auto* sp = scale ? reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>()) : nullptr;
  if (x.scalar_type() == at::kFloat)
    gemm(xc.data_ptr<float>(), wp, sp, y.data_ptr<float>(), M, N, K);
  else
    gemm(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), wp, sp, y.data_ptr<at::BFloat16>(), M,
         N, K);
  return y;
}

}  // namespace

// x [..., K] bf16 or float32, w [N, K] bf16 -> y [..., N] in x's dtype: x @ w.T computed in float32.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w) { return gemm_entry<uint16_t>("bf16_gemm", x, w, nullptr); }

// x [..., K] bf16 or float32, q [N, K] int8, scale [N] bf16 -> y [..., N] in x's dtype: (x @ q.T) * scale in float32.
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return gemm_entry<int8_t>("int8_gemm", x, q, &scale);
}

// ---- Prompt attention: attention/attend.py prefill_attention_blocked's function on the float32 path, its two
// products through the kernel above.
//
// A task is one kv head h and one block of query positions [t0, t0 + b): its G query heads' rows, G * b of
// them, attend to keys [0, num_cached + t0 + b). scores = bf16(scale * q . k) (the keys packed as weight
// panels); a query's later keys masked; probs = bf16(softmax(scores)) in float32, written straight into x's
// packed layout; out = bf16(probs @ v) (v packed without a transpose: it is depth-major already). Tasks are
// taken from a shared counter. q [T, Hq, D], k and v [S, Hkv, D] (the paged cache's layout), out [T, Hq, D].
namespace {

void attention_task(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t h, int64_t t0,
                    int64_t b, int64_t num_cached, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                    std::vector<float>& buf) {
  const int64_t G = Hq / Hkv, rows = G * b, row_panels = (rows + kMR - 1) / kMR, keys = num_cached + t0 + b;
  const int64_t key_pad = (keys + kNR - 1) / kNR * kNR, d_pad = (D + kNR - 1) / kNR * kNR;
  buf.resize(row_panels * kMR * (D + 2 * key_pad + d_pad) + kKC * std::max(kNC, d_pad));
  float* qp = buf.data();                        // [row_panels][D][kMR]
  float* s = qp + row_panels * kMR * D;          // scores [rows][key_pad]
  float* pp = s + row_panels * kMR * key_pad;    // probs, packed [row_panels][keys][kMR]
  float* o = pp + row_panels * kMR * key_pad;    // out [rows][d_pad]
  float* panels = o + row_panels * kMR * d_pad;  // the panels of one depth step
  const auto row = [&](int64_t r) { return q + ((t0 + r % b) * Hq + h * G + r / b) * D; };  // r = g * b + i
  for (int64_t r = 0; r < row_panels * kMR; ++r)
    for (int64_t d = 0; d < D; ++d) qp[(r / kMR) * D * kMR + d * kMR + r % kMR] = r < rows ? bf16_to_float(row(r)[d]) : 0.0f;
  const int64_t ld = Hkv * D;  // a position's row in k and v
  for (int64_t n0 = 0; n0 < keys; n0 += kNC) {  // scores: q [rows, D] @ k [keys, D].T, kNC keys at a time
    const auto pack_keys = [&](int64_t j, int64_t k0, int64_t kc, float* dst) {
      pack_panel(k + (n0 + j * kNR) * ld + h * D + k0, ld, std::min(kNR, keys - n0 - j * kNR), kc, dst);
    };
    const int64_t np = (std::min(kNC, keys - n0) + kNR - 1) / kNR;
    block_product(qp, row_panels, D, np, pack_keys, panels, s + n0, key_pad);
  }
  for (int64_t r = 0; r < row_panels * kMR; ++r) {  // softmax over each row's visible keys, rounded as torch rounds
    float* sr = s + r * key_pad;
    float* pr = pp + (r / kMR) * keys * kMR + r % kMR;
    const int64_t visible = r < rows ? num_cached + t0 + r % b + 1 : 0;
    float mx = -INFINITY;
    for (int64_t j = 0; j < visible; ++j) mx = std::max(mx, sr[j] = round_bf16(scale * sr[j]));
    const float sum = exp_minus_max(sr, visible, mx);
    for (int64_t j = 0; j < keys; ++j) pr[j * kMR] = j < visible ? round_bf16(sr[j] / sum) : 0.0f;
  }
  const auto pack_values = [&](int64_t j, int64_t k0, int64_t kc, float* dst) {
    pack_panel_rows(v + k0 * ld + h * D + j * kNR, ld, std::min(kNR, D - j * kNR), kc, dst);
  };
  block_product(pp, row_panels, keys, d_pad / kNR, pack_values, panels, o, d_pad);  // out: probs @ v [keys, D]
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = out + (row(r) - q);
    for (int64_t d = 0; d < D; ++d) dst[d] = float_to_bf16(o[r * d_pad + d]);
  }
}

}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_cached,
                             double scale, int64_t block) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3,
                "prefill_attention: q, k and v must be 3-D bfloat16 CPU tensors, got ", t->scalar_type(), " ", t->sizes());
  }
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && k.size(2) == D && v.sizes() == k.sizes() && k.size(0) == num_cached + T &&
                  num_cached >= 0 && block > 0,
              "prefill_attention: q [T, Hq, D], k and v [num_cached + T, Hkv, D] with Hq a multiple of Hkv; got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", num_cached ", num_cached);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (out.numel() == 0) return out;
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t blocks = (T + block - 1) / block, tasks = Hkv * blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t h = task % Hkv, t0 = (blocks - 1 - task / Hkv) * block;  // the longest blocks first
      attention_task(qp, kp, vp, op, h, t0, std::min(block, T - t0), num_cached, Hq, Hkv, D, float(scale), buf);
    }
  });
  return out;
}

// ---- Prompt attention's softmax on the bf16 path (attention/backends/cpu_prefill.py): torch's products around it.
// scores [R, keys] bf16, in place: the rows of one block of b query positions (row r is query r % b, whose
// last visible key is keys - b + r % b) -> bf16(softmax) over the visible keys in float32, 0 after them. What
// prefill_attention_blocked's masked_fill and torch.softmax compute, in one pass over the scores instead of
// four, and without their float32 temporaries.
void causal_softmax_(const at::Tensor& scores, int64_t block) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kBFloat16 && scores.is_contiguous() &&
                  scores.dim() >= 2,
              "causal_softmax_: scores must be a contiguous bfloat16 CPU tensor [..., rows, keys], got ",
              scores.scalar_type(), " ", scores.sizes());
  const int64_t keys = scores.size(-1), R = scores.numel() / std::max<int64_t>(keys, 1);
  TORCH_CHECK(block > 0 && block <= keys && R % block == 0,
              "causal_softmax_: the rows must be whole blocks of ", block, " queries, at most one per key; got ",
              scores.sizes());
  auto* base = reinterpret_cast<uint16_t*>(scores.data_ptr());
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> e(keys);
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* row = base + r * keys;
      const int64_t visible = keys - block + r % block + 1;
      float mx = -INFINITY, sum = 0.0f;
      int64_t j = 0;
#ifdef __AVX512F__
      __m512 vmx = _mm512_set1_ps(-INFINITY);
      for (; j + 16 <= visible; j += 16) vmx = _mm512_max_ps(vmx, load16_bf16(row + j));
      mx = _mm512_reduce_max_ps(vmx);
#elif defined(NANOQWEN_AVX2)
      __m256 vmx = _mm256_set1_ps(-INFINITY);
      for (; j + 8 <= visible; j += 8) vmx = _mm256_max_ps(vmx, load8_bf16(row + j));
      mx = hmax(vmx);
#endif
      for (; j < visible; ++j) mx = std::max(mx, bf16_to_float(row[j]));
      j = 0;  // e = e^(s - mx), float32, and its sum
#ifdef __AVX512F__
      __m512 vsum = _mm512_setzero_ps();
      for (; j + 16 <= visible; j += 16) {
        const __m512 ej = exp16(_mm512_sub_ps(load16_bf16(row + j), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(e.data() + j, ej);
        vsum = _mm512_add_ps(vsum, ej);
      }
      sum = _mm512_reduce_add_ps(vsum);
#elif defined(NANOQWEN_AVX2)
      __m256 vsum = _mm256_setzero_ps();
      for (; j + 8 <= visible; j += 8) {
        const __m256 ej = exp8(_mm256_sub_ps(load8_bf16(row + j), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(e.data() + j, ej);
        vsum = _mm256_add_ps(vsum, ej);
      }
      sum = hsum(vsum);
#endif
      for (; j < visible; ++j) sum += (e[j] = std::exp(bf16_to_float(row[j]) - mx));
      const float inv = 1.0f / sum;  // e * (1 / sum), as torch's softmax normalises
      j = 0;
#ifdef __AVX512F__
      for (; j + 16 <= visible; j += 16)
        store16_bf16(row + j, _mm512_mul_ps(_mm512_loadu_ps(e.data() + j), _mm512_set1_ps(inv)));
#elif defined(NANOQWEN_AVX2)
      for (; j + 8 <= visible; j += 8)
        store8_bf16(row + j, _mm256_mul_ps(_mm256_loadu_ps(e.data() + j), _mm256_set1_ps(inv)));
#endif
      for (; j < visible; ++j) row[j] = float_to_bf16(e[j] * inv);
      std::fill(row + visible, row + keys, uint16_t{0});
    }
  });
}

}  // namespace nanoqwen
