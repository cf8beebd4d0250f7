// The rest of a decode step on the CPU: elementwise ops for few rows (RMSNorm, RoPE, SwiGLU) and the sampler's
// greedy choice, top-p filter and draw. Attention over the paged KV cache is in kv_cache_ops.cpp.
//
// Each replaces several torch ops (each a dispatch, an allocation and a pass over memory) with one, and
// rounds where the plain-torch reference (nanoqwen/models/qwen3.py) rounds: intermediate bf16 results are
// rounded to bf16 exactly where torch would round them, the rest is float32.

#include "cpu_kernels.h"

namespace nanoqwen {

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// One row of rms_norm: y = weight * bf16(x / sqrt(mean(x^2) + eps)), D elements.
void rms_norm_row(const uint16_t* xr, const uint16_t* wp, int64_t D, float eps, uint16_t* yr) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef NANOQWEN_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) {
    const __m256 v = load8_bf16(xr + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  sum = hsum(acc);
#endif
  for (; i < D; ++i) sum += bf16_to_float(xr[i]) * bf16_to_float(xr[i]);
  const float inv = 1.0f / std::sqrt(sum / float(D) + eps);
  i = 0;
#ifdef NANOQWEN_AVX2
  for (; i + 8 <= D; i += 8)
    store8_bf16(yr + i, _mm256_mul_ps(load8_bf16(wp + i),
                                      round_bf16(_mm256_mul_ps(load8_bf16(xr + i), _mm256_set1_ps(inv)))));
#endif
  for (; i < D; ++i) yr[i] = float_to_bf16(bf16_to_float(wp[i]) * round_bf16(bf16_to_float(xr[i]) * inv));
}

// One head of apply_rope: y = x * cos + rotate_half(x) * sin, D elements (each product rounded to bf16, then
// the sum, as torch computes it in bf16).
void rope_row(const uint16_t* xr, const uint16_t* c, const uint16_t* s, int64_t D, uint16_t* yr) {
  const int64_t half = D / 2;
  // Element i < half pairs with i + half: y[i] = x[i] cos[i] - x[i + half] sin[i],
  // y[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half].
  int64_t i = 0;
#ifdef NANOQWEN_AVX2
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8_bf16(xr + i), x2 = load8_bf16(xr + half + i);
    const __m256 neg_x2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.0f));
    store8_bf16(yr + i, _mm256_add_ps(round_bf16(_mm256_mul_ps(x1, load8_bf16(c + i))),
                                      round_bf16(_mm256_mul_ps(neg_x2, load8_bf16(s + i)))));
    store8_bf16(yr + half + i, _mm256_add_ps(round_bf16(_mm256_mul_ps(x2, load8_bf16(c + half + i))),
                                             round_bf16(_mm256_mul_ps(x1, load8_bf16(s + half + i)))));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = bf16_to_float(xr[i]), x2 = bf16_to_float(xr[half + i]);
    yr[i] = float_to_bf16(round_bf16(x1 * bf16_to_float(c[i])) + round_bf16(-x2 * bf16_to_float(s[i])));
    yr[half + i] = float_to_bf16(round_bf16(x2 * bf16_to_float(c[half + i])) +
                                 round_bf16(x1 * bf16_to_float(s[half + i])));
  }
}

void check_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t N, int64_t D) {
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even, got ", D);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == N && cos.size(1) == D,
              "cos and sin must be [", N, ", ", D, "], got ", cos.sizes(), " and ", sin.sizes());
}

// Rows a thread takes at least in rms_norm, apply_rope and swiglu, for rows of n elements: about 16K elements, so
// that a decode step's row or few stay on the calling thread (at::parallel_for runs a range of at most one grain
// inline) and a prompt's rows are shared.
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, n)); }


// rms_norm: weight * bf16(x / sqrt(mean(x^2) + eps)) over the last dimension D, for x [..., D].
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  at::Tensor x = x_in.contiguous();
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "weight must have shape [", D, "], got ", weight.sizes());
  at::Tensor y = new_output(x.sizes(), x.options());
  const uint16_t *xp = bf16_ptr(x), *wp = bf16_ptr(weight);
  uint16_t* yp = bf16_ptr_mut(y);
  at::parallel_for(0, rows, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * D, wp, D, float(eps), yp + r * D);
  });
  return y;
}

// add_rms_norm: h = x + y, rounded to bf16 as torch adds bf16 tensors, and rms_norm(h, weight), for x, y [M, D], in
// one pass over each row -> {h, normed}: a residual add and the norm after it (decode_layer's step), one call.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& y_in,
                                                const at::Tensor& weight, double eps) {
  at::Tensor x = x_in.contiguous(), y = y_in.contiguous();
  check_bf16(x, "x");
  check_bf16(y, "y");
  check_bf16(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == y.sizes(), "x and y must be [M, D] alike, got ", x.sizes(), " and ",
              y.sizes());
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "weight must have shape [", D, "], got ", weight.sizes());
  at::Tensor h = new_output(x.sizes(), x.options()), normed = new_output(x.sizes(), x.options());
  const uint16_t *xp = bf16_ptr(x), *yp = bf16_ptr(y), *wp = bf16_ptr(weight);
  uint16_t *hp = bf16_ptr_mut(h), *np = bf16_ptr_mut(normed);
  at::parallel_for(0, M, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t *xr = xp + r * D, *yr = yp + r * D;
      uint16_t* hr = hp + r * D;
      int64_t i = 0;
#ifdef NANOQWEN_AVX2
      for (; i + 8 <= D; i += 8) store8_bf16(hr + i, _mm256_add_ps(load8_bf16(xr + i), load8_bf16(yr + i)));
#endif
      for (; i < D; ++i) hr[i] = float_to_bf16(bf16_to_float(xr[i]) + bf16_to_float(yr[i]));
      rms_norm_row(hr, wp, D, float(eps), np + r * D);
    }
  });
  return {h, normed};
}

// apply_rope: x * cos + rotate_half(x) * sin for x [N, H, D], cos/sin [N, D].
at::Tensor apply_rope(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor x = x_in.contiguous();
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [N, heads, D], got ", x.sizes());
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  check_rope(cos, sin, N, D);
  at::Tensor y = at::empty_like(x);
  const uint16_t *xp = bf16_ptr(x), *cp = bf16_ptr(cos), *sp = bf16_ptr(sin);
  uint16_t* yp = bf16_ptr_mut(y);
  at::parallel_for(0, N, row_grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t h = 0; h < H; ++h) rope_row(xp + (n * H + h) * D, cp + n * D, sp + n * D, D, yp + (n * H + h) * D);
  });
  return y;
}

// swiglu: bf16(silu(gate)) * up for gate_up [N, 2I] (gate, then up) -> [N, I].
at::Tensor swiglu(const at::Tensor& gate_up_in) {
  at::Tensor gate_up = gate_up_in.contiguous();
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [N, 2I], got ", gate_up.sizes());
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor y = new_output({N, I}, gate_up.options());
  const uint16_t* gp = bf16_ptr(gate_up);
  uint16_t* yp = bf16_ptr_mut(y);
  at::parallel_for(0, N, row_grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint16_t *gate = gp + n * 2 * I, *up = gate + I;
      int64_t i = 0;
#ifdef NANOQWEN_AVX2
      for (; i + 8 <= I; i += 8) {
        const __m256 g = load8_bf16(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        store8_bf16(yp + n * I + i, _mm256_mul_ps(round_bf16(silu), load8_bf16(up + i)));
      }
#endif
      for (; i < I; ++i) {
        const float g = bf16_to_float(gate[i]), u = bf16_to_float(up[i]);
        yp[n * I + i] = float_to_bf16(round_bf16(g / (1.0f + std::exp(-g))) * u);
      }
    }
  });
  return y;
}

// The index of the largest of v[0 .. n - 1] (float32 or bf16 values), as torch.argmax gives it: the first of tied
// maxima, the first NaN where there is one (a NaN counts as the largest). Two passes over the row: its largest value
// (and whether it holds a NaN), 8 lanes at a time, then the first index holding that value.
namespace {
inline float value(const float* v, int64_t i) { return v[i]; }
inline float value(const uint16_t* v, int64_t i) { return bf16_to_float(v[i]); }

template <typename T>
int64_t argmax_row(const T* v, int64_t n) {
  int64_t i = 0;
  float mx = -INFINITY;
  bool nan = false;
#ifdef NANOQWEN_AVX2
  __m256 vmx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(v + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    vmx = _mm256_max_ps(x, vmx);  // (a NaN x gives vmx back: NaNs are found by `unordered`)
  }
  mx = hmax(vmx);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(value(v, i));
    mx = std::max(mx, value(v, i));
  }
  int64_t j = 0;
  if (nan) {
    while (!std::isnan(value(v, j))) ++j;
    return j;
  }
#ifdef NANOQWEN_AVX2
  const __m256 target = _mm256_set1_ps(mx);
  for (; j + 8 <= n; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(load8(v + j), target, _CMP_EQ_OQ));
    if (hits) return j + __builtin_ctz(hits);
  }
#endif
  while (value(v, j) != mx) ++j;  // (mx is one of the values)
  return j;
}
}  // namespace

// argmax: torch.argmax(values, dim=-1) for float32 or bf16 values [B, V] -> int64 [B] (the sampler's greedy choice:
// torch's CPU argmax reads a row one value at a time, several times slower than this). A bf16 value converts to
// float32 exactly, so bf16 logits give the index their float32 copy gives.
at::Tensor argmax(const at::Tensor& values_in) {
  at::Tensor values = values_in.contiguous();
  const auto dtype = values.scalar_type();
  TORCH_CHECK(values.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) && values.dim() == 2 &&
                  values.size(1) > 0,
              "values must be a CPU float32 or bfloat16 [B, V] tensor with V > 0, got ", dtype, " ", values.sizes());
  const int64_t B = values.size(0), V = values.size(1);
  at::Tensor out = at::empty({B}, values.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* fp = dtype == at::kFloat ? values.data_ptr<float>() : nullptr;
  const uint16_t* hp = dtype == at::kBFloat16 ? bf16_ptr(values) : nullptr;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) op[b] = fp ? argmax_row(fp + b * V, V) : argmax_row(hp + b * V, V);
  });
  return out;
}

// top_p_threshold: for each row of probabilities p [B, V] (float32, >= 0) and its top_p, the smallest positive value
// t of the row such that the values greater than t sum to at most top_p (sums in double): keeping the values >= t is
// top-p (nucleus) filtering with tied values kept together, without sorting the row (the sampler's reference,
// sampler.top_p_threshold_reference, sorts it). A radix select over the values' bits (a non-negative float's bits
// order as its value): the top 12 bits in 4096 buckets, each with its count and mass; walking them from the top,
// the value sits in the last non-empty bucket whose higher buckets sum to at most top_p; then the next 10 bits
// inside that bucket, then the last 10. A row holding a NaN gets NaN; a row with no positive value gets 0.
namespace {
float top_p_threshold_row(const float* p, int64_t n, double top_p) {
  constexpr int kWidths[3] = {12, 10, 10};
  std::vector<double> mass(1 << 12);
  std::vector<int64_t> count(1 << 12);
  uint32_t prefix = 0, fixed = 0;  // the bits chosen so far, and which bits they are
  double above = 0.0;              // the mass of the values above the bucket chosen so far
  int shift = 32;
  for (const int width : kWidths) {
    shift -= width;
    const uint32_t buckets = 1u << width;
    std::fill(mass.begin(), mass.begin() + buckets, 0.0);
    std::fill(count.begin(), count.begin() + buckets, 0);
    for (int64_t i = 0; i < n; ++i) {
      const float x = p[i];
      if (!(x > 0.0f)) {
        if (std::isnan(x)) return NAN;
        continue;
      }
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      if ((bits & fixed) != prefix) continue;
      const uint32_t b = (bits >> shift) & (buckets - 1);
      mass[b] += x;
      count[b] += 1;
    }
    int64_t chosen = -1;
    double run = above, at_chosen = above;
    for (int64_t b = buckets - 1; b >= 0; --b) {
      if (count[b] == 0) continue;
      if (run > top_p) break;
      chosen = b, at_chosen = run;
      run += mass[b];
    }
    if (chosen < 0) return 0.0f;  // no positive value (only at the first level)
    prefix |= static_cast<uint32_t>(chosen) << shift;
    fixed |= (buckets - 1) << shift;
    above = at_chosen;
  }
  float t;
  std::memcpy(&t, &prefix, sizeof(t));
  return t;
}
}  // namespace

at::Tensor top_p_threshold(const at::Tensor& probs_in, const at::Tensor& top_p_in) {
  at::Tensor probs = probs_in.contiguous();
  at::Tensor top_p = top_p_in.to(at::kDouble).contiguous();
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2,
              "probs must be a CPU float32 [B, V] tensor, got ", probs.scalar_type(), " ", probs.sizes());
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == probs.size(0), "top_p must be [B], got ", top_p.sizes());
  const int64_t B = probs.size(0), V = probs.size(1);
  at::Tensor out = at::empty({B}, probs.options());
  const float* pp = probs.data_ptr<float>();
  const double* tp = top_p.data_ptr<double>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) op[b] = top_p_threshold_row(pp + b * V, V, tp[b]);
  });
  return out;
}

// exponential_race: each row's sample from its probabilities p [B, K] (float32, >= 0): the column k of the largest
// p[k] / E, E an Exp(1) draw made from the row's key [B] (int64) and the column's token id (token_ids [B, K], or the
// column itself where None) by a counter-based hash, so that a token's noise depends on nothing but its request's
// key and its id (sample/sampler.py's exponential_noise computes the same noise with tensor operations). A zero p
// is skipped (its ratio is 0); a NaN p is taken at once, as torch.argmax takes the first NaN. Most logs are never
// taken: a column whose uniform shows it cannot beat the best ratio so far is passed over.
namespace {
inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The uniform in (0, 1) behind a token's draw, (m + 0.5) / 2^23 from the hash's top 23 bits (exact in float32:
// with 24 bits the largest would round up to 1); its Exp(1) draw is -log(u).
inline float race_uniform(uint64_t key, int64_t token) {
  const uint64_t z = splitmix64(key + static_cast<uint64_t>(token + 1) * 0x9E3779B97F4A7C15ull);
  return static_cast<float>((static_cast<double>(z >> 41) + 0.5) * (1.0 / 8388608.0));
}
}  // namespace

at::Tensor exponential_race(const at::Tensor& probs_in, const std::optional<at::Tensor>& token_ids_in,
                            const at::Tensor& keys_in) {
  at::Tensor probs = probs_in.contiguous();
  at::Tensor keys = keys_in.to(at::kLong).contiguous();
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2,
              "probs must be a CPU float32 [B, K] tensor, got ", probs.scalar_type(), " ", probs.sizes());
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == probs.size(0), "keys must be [B], got ", keys.sizes());
  const int64_t B = probs.size(0), K = probs.size(1);
  at::Tensor token_ids;
  if (token_ids_in.has_value()) {
    token_ids = token_ids_in->to(at::kLong).contiguous();
    TORCH_CHECK(token_ids.sizes() == probs.sizes(), "token_ids must be shaped as probs, got ", token_ids.sizes());
  }
  const int64_t* tp = token_ids.defined() ? token_ids.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty({B}, keys.options());
  const float* pp = probs.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* p = pp + b * K;
      const uint64_t key = static_cast<uint64_t>(kp[b]);
      float best = -INFINITY;
      int64_t choice = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float x = p[k];
        if (std::isnan(x)) {
          choice = k;
          break;
        }
        if (!(x > 0.0f)) {
          if (best < 0.0f) best = 0.0f, choice = k;  // (a ratio of 0)
          continue;
        }
        // -log(u) >= 1 - u: where x <= (1 - u) * best, x / -log(u) cannot beat best, and the log is not needed
        const float u = race_uniform(key, tp ? tp[b * K + k] : k);
        if (static_cast<double>(x) <= (1.0 - static_cast<double>(u)) * static_cast<double>(best)) continue;
        const float ratio = x / -std::log(u);
        if (ratio > best) best = ratio, choice = k;
      }
      op[b] = choice;
    }
  });
  return out;
}

}  // namespace nanoqwen
