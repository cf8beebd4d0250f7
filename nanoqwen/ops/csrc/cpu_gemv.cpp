// Matrix-vector products for batch-1..8 decode on CPUs with AVX2 + FMA (no AVX-512 needed).
//
//   bf16_gemv(x [M,K] bf16, w [N,K] bf16, bias [N] bf16 or None) -> y [M,N] bf16,  y = x @ w.T + bias
//   int8_gemv(x [M,K] bf16, q [N,K] int8, scale [N] bf16)        -> y [M,N] bf16,  y = (x @ q.T) * scale
//
// With few rows of x, every weight element is used M times, so the product is bound by how fast the weights
// stream from memory. The kernels therefore read each weight row exactly once, use it for all M rows of x,
// and keep the rest cheap: x is converted to float32 once (it stays in L1/L2), each weight vector is widened
// to float32 in registers, products are accumulated in float32 with FMA, and each output is rounded to bf16
// once at the end (round-to-nearest-even, like torch's .to(torch.bfloat16)). The results equal the plain-torch
// references in nanoqwen/ops/cpu_gemv.py up to the order of the float32 additions.
//
// Threads split the output rows N into contiguous chunks (at::parallel_for); each thread streams its slice of
// the weight matrix as two sequential streams (its first and second half) for more requests in flight.
//
// More than 8 rows of x are processed in groups of 8 (each group reads the weights again).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NANOQWEN_AVX2 1
#endif

namespace {

constexpr int kMaxRows = 8;                  // rows of x handled per pass over the weights
constexpr int64_t kTaskBytes = 256 << 10;    // weight bytes a parallel task reads at least
constexpr int kPrefetchBytes = 4096;         // how far ahead of the current weight line to prefetch (tuned)

// bf16 -> float32: a bf16 is the upper 16 bits of a float32.
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

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

// The sum of the 8 lanes of v.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // 4 lanes
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           // 2 lanes
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                            // 1 lane
  return _mm_cvtss_f32(s);
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

// y[m, n] = dot(x[m], w[n]) * scale[n] + bias[n] for n in [begin, end); scale, bias may be null.
//
// For M <= 4 the range is read as two streams at once, its first and its second half, row by row: two
// independent sequential streams per thread keep more memory requests in flight than one (measured: clearly
// faster at M = 1 and 2 than one stream, whose speed stayed below a plain sum's). For larger M the
// accumulators of two rows would not fit the registers.
// noinline: compiled as its own function, GCC keeps the accumulators in registers; inlined into the
// dispatching lambda with the seven other M, it spilled them to the stack (several times slower).
template <int M, typename W>
__attribute__((noinline)) void rows(const float* x, const W* w, const uint16_t* scale, const uint16_t* bias,
                                    int64_t K, int64_t N, int64_t begin, int64_t end, at::BFloat16* y) {
  constexpr int R = M <= 4 ? 2 : 1;
  float dots[R][M];
  auto store = [&](int64_t n, const float* d) {
    float s = scale ? bf16_to_float(scale[n]) : 1.0f;
    float b = bias ? bf16_to_float(bias[n]) : 0.0f;
    for (int m = 0; m < M; ++m) y[m * N + n] = at::BFloat16(d[m] * s + b);  // one rounding, RNE
  };
  const int64_t part = (end - begin) / R;  // rows per stream
  for (int64_t i = 0; i < part; ++i) {
    const W* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (begin + r * part + i) * K;
    dot_rows<M, R>(x, K, wr, dots);
    for (int r = 0; r < R; ++r) store(begin + r * part + i, dots[r]);
  }
  for (int64_t n = begin + R * part; n < end; ++n) {  // the row left over when R does not divide the range
    const W* wr[1] = {w + n * K};
    dot_rows<M, 1>(x, K, wr, dots);
    store(n, dots[0]);
  }
}

// The M of this group as a template argument (1..8), so the accumulator arrays have a fixed size.
template <typename W>
void rows_any_m(int m_rows, const float* x, const W* w, const uint16_t* scale, const uint16_t* bias, int64_t K,
                int64_t N, int64_t begin, int64_t end, at::BFloat16* y) {
  switch (m_rows) {
    case 1: return rows<1>(x, w, scale, bias, K, N, begin, end, y);
    case 2: return rows<2>(x, w, scale, bias, K, N, begin, end, y);
    case 3: return rows<3>(x, w, scale, bias, K, N, begin, end, y);
    case 4: return rows<4>(x, w, scale, bias, K, N, begin, end, y);
    case 5: return rows<5>(x, w, scale, bias, K, N, begin, end, y);
    case 6: return rows<6>(x, w, scale, bias, K, N, begin, end, y);
    case 7: return rows<7>(x, w, scale, bias, K, N, begin, end, y);
    default: return rows<8>(x, w, scale, bias, K, N, begin, end, y);
  }
}

void check_vector(const torch::Tensor& t, const char* name, int64_t N) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N, name, " must have shape [", N, "], got ", t.sizes());
}

// Shared driver: checks, converts x to float32 once, runs groups of <= 8 rows over threads.
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

  // x in float32, once (a plain buffer: cheaper than a torch tensor for these few KB).
  std::vector<float> xf(M * K);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(xb[i]);

  const float* xp = xf.data();
  const W* wp = reinterpret_cast<const W*>(w.data_ptr());
  const uint16_t* sp = scale.defined() ? reinterpret_cast<const uint16_t*>(scale.data_ptr()) : nullptr;
  const uint16_t* bp = bias.defined() ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // Enough rows per task that it reads kTaskBytes of weights: small matrices stay on one thread.
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, K * int64_t(sizeof(W))));

  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int m_rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      rows_any_m<W>(m_rows, xp + m0 * K, wp, sp, bp, K, N, begin, end, yp + m0 * N);
    });
  }
  return y;
}

}  // namespace

torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias) {
  return gemv<uint16_t>(x, w, at::kBFloat16, "w", std::nullopt, bias);
}

torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  return gemv<int8_t>(x, q, at::kChar, "q", scale, std::nullopt);
}

bool has_avx2() {
#ifdef NANOQWEN_AVX2
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
  m.def("has_avx2", &has_avx2, "whether this build uses the AVX2 + FMA kernels (else the scalar loops)");
}
