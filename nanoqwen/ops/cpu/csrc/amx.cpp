// AMX tiles (Intel Xeon from Sapphire Rapids on: amx_tile, amx_int8) for int4 products over several rows of x.
//
// int4_gemm (int4_gemv.cpp) unpacks each block of 16 weight rows into a panel laid out for an integer dot product:
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
// int4_gemv.cpp's int4_amx takes the rows of x from its amx_min_rows argument on (nanoqwen/ops/cpu/selection.py
// measures where the tiles are faster; bench/bench_batch_decode.py measures a model's decode with them).

#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define NANOQWEN_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define NANOQWEN_AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl")))
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
    for (int j = 0; j < np; ++j) {  // int4_gemv.cpp add_group's float work, 16 columns a vector
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

#else  // no AMX in this compiler: never ready, and nothing calls the rest

bool amx_int8_ready() { return false; }
void amx_int4_begin(int64_t) { TORCH_CHECK(false, "AMX is not compiled in"); }
void amx_end() {}
void amx_int4_tile(const int8_t*, const float*, const float*, int64_t, int64_t, int64_t, int, const uint8_t*,
                   const float*, const float*, int, const int*, int64_t, int64_t, at::BFloat16*, const uint8_t*,
                   int64_t) {
  TORCH_CHECK(false, "AMX is not compiled in");
}

#endif

}  // namespace nanoqwen
