// AMX tiles (Intel Xeon from Sapphire Rapids on: amx_tile, amx_int8, amx_bf16) for int4 and bf16 products over
// several rows of x.
//
// bf16_amx (bf16 weights, 2 to 64 rows of x: batched decode steps, short prompt chunks): the weights are the A
// operand as they are stored, 16 rows of 32 values (64 bytes each) a tile load straight from the matrix; x is the B
// operand, packed once a call into AMX's pair layout ([K / 2][16 rows][2 values], zero rows past M). One tdpbf16ps
// adds a 16 x 16 block of weight rows by rows of x (bf16 products summed in float32), two weight tiles by up to
// two blocks of x rows a pass (a third and fourth block of x, past 32 rows, read the weights again); the float32
// sums are rounded to bf16 once: bf16_gemv_reference's function, the sums in another order. Torch's bf16 product
// reads the weights well below the machine's bandwidth at these row counts (bench/bench_gemv.py --rows 16,
// bench/bench_batch_decode.py); selection.py measures where the tiles are faster.
//
// int8_amx (int8 weights with a bf16 scale per row, 2 to 64 rows of x): the same tiles, each 16 weight rows' 32 values
// of a depth step widened to bf16 first (exact: |q| <= 127 is a bf16 number) into a 1 KiB buffer the tile loads
// from; each float32 sum times its row's scale, rounded to bf16 once: int8_linear_reference's function (int8_gemm's),
// the sums in another order. int8_gemv, which rounds x to int16 and runs integer dot products a row of x at a time,
// is bound by arithmetic from some 16 rows on; the tiles multiply 16 rows of x at once.
//
// int4_gemm (int4_gemm.cpp) unpacks each block of 16 weight rows into a panel laid out for an integer dot product:
// for each 4 consecutive elements of a group (a quad), the 16 rows' 4 values side by side, 64 bytes. That is
// exactly the layout AMX's B operand takes (a row of a B tile: 4 consecutive depths of 16 columns), so a group of
// G = 64 weights of 16 rows is one B tile of 16 rows x 64 bytes, and the same group of x's int8 values (16 rows of
// x, 64 bytes each) is one A tile. One tdpbsud (s8 x times u8 q, summed in int32) computes a group's 16 x 16 integer
// dot products, the work of 64 vpdpbusd on 256-bit vectors. Per group each dot product then gets the same float
// work as int4_gemm's (scale * d, then two FMAs, in the same order: the same bits), here on 16-lane vectors from
// the tile stored to memory. Rows of x are taken 16 at a time (a last, shorter tile padded with zero rows).
//
// The code is compiled with per-function target attributes where the compiler knows AMX (GCC 11 and later), so
// the rest of the extension keeps its flags, and runs only where amx_int8_ready(): the CPU reports AMX-INT8 and
// AVX-512BW and Linux granted the process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, once a process).
// int4_gemv.cpp's int4_gemv takes the rows of x from its amx_min_rows argument on (nanoqwen/ops/cpu/selection.py
// measures where the tiles are faster; bench/bench_batch_decode.py measures a model's decode with them).

#include <type_traits>

#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define NANOQWEN_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define NANOQWEN_AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl")))
#define NANOQWEN_AMX_BF16_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl")))
#endif

namespace nanoqwen {

namespace {
std::atomic<int64_t> amx_min_rows{0};
}  // namespace

void set_int4_amx_min_rows(int64_t rows) { amx_min_rows.store(std::max<int64_t>(rows, 0)); }
int64_t int4_amx_min_rows() { return amx_min_rows.load(std::memory_order_relaxed); }

#ifdef NANOQWEN_AMX
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;     // the AMX tile data

// The tile configuration (palette 1): tmm0 x's rows (A), tmm1 and tmm2 two panels' groups (B), tmm3 and tmm4
// their 16 x 16 int32 dot products (C).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool cpu_has_amx_int8() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512bw = (b >> 30) & 1, avx512f = (b >> 16) & 1;
  const bool amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
  return avx512f && avx512bw && amx_tile && amx_int8;
}

// A tile's depth in bytes for group size G: the whole group up to 64 (G 16, 32 or 64), else 64 (G a multiple of 64).
inline int tile_depth(int64_t G) { return static_cast<int>(std::min<int64_t>(G, 64)); }

}  // namespace

bool amx_int8_ready() {
  static const bool ready = cpu_has_amx_int8() &&
                            syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
}

NANOQWEN_AMX_TARGET void amx_int4_begin(int64_t G) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  const int depth = tile_depth(G);
  cfg.rows[0] = 16, cfg.colsb[0] = depth;                                // A: 16 rows of x, depth int8 each
  for (int t = 1; t <= 2; ++t) cfg.rows[t] = depth / 4, cfg.colsb[t] = 64;  // B: depth / 4 quads of 16 columns
  for (int t = 3; t <= 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;         // C: 16 x 16 int32
  // (GCC 12 sees only the first byte of cfg read by ldtilecfg and drops the other stores without this barrier)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

NANOQWEN_AMX_TARGET void amx_end() { _tile_release(); }

// y[m0 + t, n0 + 16 j + c] for t < rows (1 .. 16), j < np (1 or 2 panels), c < cols[j]: x's quantised rows from m0
// (xq [.., K] int8, 16 rows readable; d and xs [.., K / G] float32) over np unpacked panels (panel j at
// panel + j * 16 K: int4_gemm's layout; its scales and offsets float32 [K / G][16] at scale + j * 16 K / G).
// amx_int4_begin(G) must have configured the tiles on this thread. ahead: bytes to fetch into L2 meanwhile (the next
// panels' packed weights, ahead_bytes of them, a share each group: the weights' stream keeps going while the tiles
// compute; the hardware prefetcher alone lets it stall), or nullptr.
NANOQWEN_AMX_TARGET void amx_int4_tile(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t G,
                                       int64_t m0, int rows, const uint8_t* panel, const float* scale,
                                       const float* offset, int np, const int* cols, int64_t N, int64_t n0,
                                       at::BFloat16* y, const uint8_t* ahead, int64_t ahead_bytes) {
  const int64_t groups = K / G, depth = tile_depth(G), steps = G / depth;
  const int64_t ahead_share = (ahead_bytes / groups + 63) / 64 * 64;
  alignas(64) float acc[16][32];   // [row of x][column of the panels]
  alignas(64) int32_t dots[2][16][16];
  std::memset(acc, 0, sizeof(acc));
  const int8_t* x0 = xq + m0 * K;
  for (int64_t g = 0; g < groups; ++g) {
    if (ahead)
      for (int64_t b = g * ahead_share; b < std::min(ahead_bytes, (g + 1) * ahead_share); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T1);
    _tile_zero(3);
    _tile_zero(4);
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k = g * G + s * depth;  // the step's first depth; panel bytes from k * 16
      _tile_loadd(0, x0 + k, K);
      _tile_loadd(1, panel + k * 16, 64);
      _tile_dpbsud(3, 0, 1);
      if (np == 2) {
        _tile_loadd(2, panel + 16 * K + k * 16, 64);
        _tile_dpbsud(4, 0, 2);
      }
    }
    _tile_stored(3, dots[0], 64);
    if (np == 2) _tile_stored(4, dots[1], 64);
    for (int j = 0; j < np; ++j) {  // int4.h add_group's float work, 16 columns a vector
      const __m512 sc = _mm512_loadu_ps(scale + j * 16 * groups + g * 16);
      const __m512 of = _mm512_loadu_ps(offset + j * 16 * groups + g * 16);
      for (int t = 0; t < rows; ++t) {
        const int64_t at_g = (m0 + t) * groups + g;
        const __m512 sd = _mm512_mul_ps(sc, _mm512_set1_ps(d[at_g]));
        __m512 a = _mm512_load_ps(acc[t] + 16 * j);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[j][t])), sd, a);
        a = _mm512_fmadd_ps(of, _mm512_set1_ps(xs[at_g]), a);
        _mm512_store_ps(acc[t] + 16 * j, a);
      }
    }
  }
  for (int t = 0; t < rows; ++t)
    for (int j = 0; j < np; ++j) {
      uint16_t* out = reinterpret_cast<uint16_t*>(y + (m0 + t) * N + n0 + 16 * j);
      for (int c = 0; c < cols[j]; ++c) out[c] = float_to_bf16(acc[t][16 * j + c]);  // one rounding, RNE
    }
}

namespace {
bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ((b >> 16) & 1) && ((b >> 30) & 1) && ((d >> 24) & 1) && ((d >> 22) & 1);  // avx512f, bw, amx_tile, bf16
}

// Tiles for bf16_amx: tmm0, tmm1 two blocks of 16 weight rows (A: 32 depths each, as stored), tmm2, tmm3 two blocks
// of 16 rows of x (B: AMX's pair layout), tmm4..tmm7 their four 16 x 16 float32 products (C, weight rows by x rows).
NANOQWEN_AMX_BF16_TARGET void amx_bf16_begin() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// 16 rows of int8 weights (row stride K) at depths k .. k + 31 as bf16 (exact: float32's upper half), 32 a row.
NANOQWEN_AMX_BF16_TARGET inline void widen_int8_rows(const int8_t* q, int64_t K, int64_t k, uint16_t* out) {
  for (int r = 0; r < 16; ++r) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + k));
    for (int h = 0; h < 2; ++h) {
      const __m128i part = h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
      const __m512i bits = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + r * 32 + 16 * h),
                         _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
    }
  }
}

// y[m][n] for the weight rows n0 .. n0 + 16 * na - 1 (na 1 or 2) and the x rows of B blocks mb0 .. mb0 + nb - 1
// (nb 1 or 2; xp: x packed as [blocks of 16 rows][K / 2][16][2] bf16). W: bf16 weights (uint16_t bits), loaded as
// stored, or int8 ones (int8_t), widened a depth step at a time, their sums times scale[n].
template <typename W>
NANOQWEN_AMX_BF16_TARGET void amx_bf16_tile(const W* w, const at::BFloat16* scale, int64_t K, const uint32_t* xp,
                                            int64_t M, int64_t mb0, int nb, int64_t N, int64_t n0, int na,
                                            uint16_t* y) {
  constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const int64_t block = K / 2 * 16;  // an x block's packed pairs
  const uint32_t* x0 = xp + mb0 * block;
  const W* w0 = w + n0 * K;
  alignas(64) uint16_t wide[2][16 * 32];  // (int8 weights) the two weight blocks at this depth, as bf16
  for (int64_t k = 0; k < K; k += 32) {
    if (k + 256 < K)  // the next lines of the 16 * na weight rows
      for (int r = 0; r < 16 * na; ++r) _mm_prefetch(reinterpret_cast<const char*>(w0 + r * K + k + 256), _MM_HINT_T0);
    if constexpr (kInt8) {
      widen_int8_rows(w0, K, k, wide[0]);
      // (the tile load's asm names no memory: barriers keep the buffer's stores before it, the next ones after)
      asm volatile("" : : "r"(wide[0]) : "memory");
      _tile_loadd(0, wide[0], 64);
      asm volatile("" : : : "memory");
    } else {
      _tile_loadd(0, w0 + k, K * 2);
    }
    _tile_loadd(2, x0 + k / 2 * 16, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (nb == 2) {
      _tile_loadd(3, x0 + block + k / 2 * 16, 64);
      _tile_dpbf16ps(5, 0, 3);
    }
    if (na == 2) {
      if constexpr (kInt8) {
        widen_int8_rows(w0 + 16 * K, K, k, wide[1]);
        asm volatile("" : : "r"(wide[1]) : "memory");
        _tile_loadd(1, wide[1], 64);
        asm volatile("" : : : "memory");
      } else {
        _tile_loadd(1, w0 + 16 * K + k, K * 2);
      }
      _tile_dpbf16ps(6, 1, 2);
      if (nb == 2) _tile_dpbf16ps(7, 1, 3);
    }
  }
  alignas(64) float c[16][16];
  for (int a = 0; a < na; ++a)
    for (int b = 0; b < nb; ++b) {
      switch (a * 2 + b) {
        case 0: _tile_stored(4, c, 64); break;
        case 1: _tile_stored(5, c, 64); break;
        case 2: _tile_stored(6, c, 64); break;
        default: _tile_stored(7, c, 64); break;
      }
      for (int j = 0; j < 16 && (mb0 + b) * 16 + j < M; ++j)
        for (int i = 0; i < 16; ++i) {
          const int64_t n = n0 + 16 * a + i;
          const float sum = kInt8 ? c[i][j] * static_cast<float>(scale[n]) : c[i][j];
          y[((mb0 + b) * 16 + j) * N + n] = float_to_bf16(sum);
        }
    }
}

// x [M, K] bf16 times the weights w [N, K] (bf16 bits, or int8 with scale [N]) on the tiles: x packed once, the
// threads taking 32 weight rows at a time.
template <typename W>
at::Tensor amx_product(const at::Tensor& x, const W* w, const at::BFloat16* scale, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = new_output({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t blocks = (M + 15) / 16;
  std::vector<uint32_t> xp(blocks * K / 2 * 16, 0);  // [block][K / 2][16 rows]: a pair of bf16 each
  const auto* x32 = reinterpret_cast<const uint32_t*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kp = 0; kp < K / 2; ++kp) xp[((m / 16) * (K / 2) + kp) * 16 + m % 16] = x32[m * (K / 2) + kp];
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t pairs = (N + 31) / 32;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    amx_bf16_begin();
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * 32;
      const int na = N - n0 >= 32 ? 2 : 1;
      for (int64_t mb = 0; mb < blocks; mb += 2)
        amx_bf16_tile(w, scale, K, xp.data(), M, mb, blocks - mb >= 2 ? 2 : 1, N, n0, na, yp);
    }
    amx_end();
  });
  return y;
}
}  // namespace

bool amx_bf16_ready() {
  static const bool ready = cpu_has_amx_bf16() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
}

at::Tensor bf16_amx(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(amx_bf16_ready(), "bf16_amx: this CPU has no AMX-BF16 tiles, or Linux did not grant them");
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 &&
                  w_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2 && w_in.dim() == 2,
              "bf16_amx: x [M, K] and w [N, K] must be 2-D bfloat16 CPU tensors");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  TORCH_CHECK(w_in.size(1) == K && K % 32 == 0 && N % 16 == 0, "bf16_amx: K a multiple of 32 and N of 16, got x ",
              x_in.sizes(), ", w ", w_in.sizes());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  return amx_product(x, reinterpret_cast<const uint16_t*>(w.data_ptr()), nullptr, N);
}

at::Tensor int8_amx(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scale_in) {
  TORCH_CHECK(amx_bf16_ready(), "int8_amx: this CPU has no AMX-BF16 tiles, or Linux did not grant them");
  TORCH_CHECK(x_in.device().is_cpu() && q_in.device().is_cpu() && scale_in.device().is_cpu() &&
                  x_in.scalar_type() == at::kBFloat16 && q_in.scalar_type() == at::kChar &&
                  scale_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2 && q_in.dim() == 2,
              "int8_amx: x [M, K] bfloat16, q [N, K] int8 and scale [N] bfloat16 CPU tensors");
  const int64_t K = x_in.size(1), N = q_in.size(0);
  TORCH_CHECK(q_in.size(1) == K && K % 32 == 0 && N % 16 == 0 && scale_in.numel() == N,
              "int8_amx: K a multiple of 32, N of 16 and a scale per row, got x ", x_in.sizes(), ", q ", q_in.sizes(),
              ", scale ", scale_in.sizes());
  const at::Tensor x = x_in.contiguous(), q = q_in.contiguous(), scale = scale_in.contiguous();
  return amx_product(x, q.data_ptr<int8_t>(), scale.data_ptr<at::BFloat16>(), N);
}

#else  // no AMX in this compiler: never ready, and nothing calls the rest

bool amx_int8_ready() { return false; }
bool amx_bf16_ready() { return false; }
at::Tensor bf16_amx(const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, "AMX is not compiled in"); }
at::Tensor int8_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "AMX is not compiled in");
}
void amx_int4_begin(int64_t) { TORCH_CHECK(false, "AMX is not compiled in"); }
void amx_end() {}
void amx_int4_tile(const int8_t*, const float*, const float*, int64_t, int64_t, int64_t, int, const uint8_t*,
                   const float*, const float*, int, const int*, int64_t, int64_t, at::BFloat16*, const uint8_t*,
                   int64_t) {
  TORCH_CHECK(false, "AMX is not compiled in");
}

#endif

}  // namespace nanoqwen
