// int4_gemm: int4 weights times many rows of bf16 x (prompts, batches), a small GEMM on unpacked panels; int4_amx:
// the same product on AMX tiles (amx.cpp). int4.h says the layout and what the kernels share.
//
// int4_gemv's block_tile (int4_gemv.cpp) unpacks each nibble in registers for every tile of rows of x that reads
// it: fine while the weights' bytes are the cost, but with hundreds of rows the same nibbles would be unpacked again
// for every tile. int4_gemm computes the same function (x quantised per group as in int4.h; same integer dots, same
// per-group float32 FMAs, only the order of the float32 additions differs) the way GEMMs do: it unpacks one
// block of 16 weight rows at a time into a small buffer, a panel, and runs every row of x over it.
//
// Panel layout: for group g and each 4 consecutive elements (a "quad" kq of the group) the panel holds
// kBlockRows * 4 bytes, lane by lane: weight row n0 + lane, elements g * G + 4 * kq .. + 3, each 0..15 (rows past
// N as zeros); its scales and offsets as float32 [groups][kBlockRows]. The packed block's 4 bytes c of each row
// unpack to quads c (low nibbles) and G/8 + c (high): one AND, or a shift and an AND, per 32 bytes. A register
// tile is kPanelTileRows rows of x times the panel's 16 rows (two 256-bit vectors, or one 512-bit one).

#include "int4.h"

namespace nanoqwen {
namespace int4 {
namespace {

// rows of x per 256-bit register tile (measured against 3, 5 and 6, and panels of 24, 32)
constexpr int kTileRows = 4;

// Unpacks the block of weight rows n0 .. (L = min(16, N - n0) of them) into panel, panel_scale, panel_offset.
template <typename S>
void pack_panel(const uint8_t* wp, const Int4Product& p, int64_t N, int64_t K, int64_t G,
                int64_t n0, uint8_t* panel, float* panel_scale, float* panel_offset) {
  const int64_t groups = K / G, chunks = G / 8, quads = G / 4;
  const int L = static_cast<int>(std::min<int64_t>(kBlockRows, N - n0));
  const uint8_t* w = wp + n0 * (K / 2);
  const Scales<S> sc = p.scales<S>(n0, L);
#ifdef NANOQWEN_AVX2
  if (L == kBlockRows) {
    // (the vector loads compute scale_at / offset_at's values: the same products, so the same bits)
    for (int64_t g = 0; g < groups; ++g)
      for (int v = 0; v < kBlockVectors; ++v) {
        _mm256_storeu_ps(panel_scale + g * kBlockRows + 8 * v, sc.scale8(g, v));
        _mm256_storeu_ps(panel_offset + g * kBlockRows + 8 * v, sc.offset8(g, v));
      }
    const __m256i nibble = _mm256_set1_epi8(0xF);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t c = 0; c < chunks; ++c)
        for (int v = 0; v < kBlockVectors; ++v) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ((g * chunks + c) * 2 + v) * 32));
          uint8_t* at_lo = panel + ((g * quads + c) * kBlockRows + 8 * v) * 4;
          uint8_t* at_hi = panel + ((g * quads + chunks + c) * kBlockRows + 8 * v) * 4;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_lo), _mm256_and_si256(b, nibble));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(at_hi), _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble));
        }
    return;
  }
#endif
  for (int64_t g = 0; g < groups; ++g)  // the last, partial block (and any block without AVX2)
    for (int lane = 0; lane < kBlockRows; ++lane) {
      panel_scale[g * kBlockRows + lane] = lane < L ? sc.scale_at(g, lane) : 0.0f;
      panel_offset[g * kBlockRows + lane] = lane < L ? sc.offset_at(g, lane) : 0.0f;
    }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      for (int lane = 0; lane < kBlockRows; ++lane)
        for (int i = 0; i < 4; ++i) {
          const uint8_t b = lane < L ? w[((g * chunks + c) * L + lane) * 4 + i] : 0;
          panel[((g * quads + c) * kBlockRows + lane) * 4 + i] = b & 0xF;
          panel[((g * quads + chunks + c) * kBlockRows + lane) * 4 + i] = b >> 4;
        }
}

#ifdef NANOQWEN_AVX2
// Share g of `groups` of the bytes at ahead (none if null) asked for into L2: a panel tile fetches the next panel's
// packed weights a share a group while it computes.
inline void fetch_share(const uint8_t* ahead, int64_t bytes, int64_t g, int64_t groups) {
  if (ahead == nullptr) return;
  const int64_t share = (bytes + groups - 1) / groups;
  for (int64_t b = g * share; b < std::min(bytes, (g + 1) * share); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T1);
}
#endif

// y[m, n0 ..] for rows m0 .. m0 + T - 1 of x over one panel; cols = how many of its rows are real. ahead (or null):
// ahead_bytes of packed weights to fetch into the cache meanwhile, a share each group (the next panel's).
template <int T>
void panel_tile(const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* panel,
                const float* panel_scale, const float* panel_offset, int64_t N, int64_t n0, int cols,
                at::BFloat16* y, const uint8_t* ahead, int64_t ahead_bytes) {
#ifdef NANOQWEN_AVX2
  const int64_t groups = K / G, quads = G / 4;
  constexpr int V = kBlockVectors;
  __m256 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    fetch_share(ahead, ahead_bytes, g, groups);
    __m256i isum[T][V], sum16[T][V];  // sum16: without VNNI, the last quads' int16 pair sums (widen16)
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < V; ++v) isum[t][v] = sum16[t][v] = _mm256_setzero_si256();
    const uint8_t* pg = panel + g * quads * kBlockRows * 4;
    for (int64_t kq = 0; kq < quads; ++kq) {
      __m256i w[V];
      for (int v = 0; v < V; ++v)
        w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + kq * kBlockRows * 4 + 32 * v));
      for (int t = 0; t < T; ++t) {
        const __m256i xb = broadcast4(x.xq + (m0 + t) * K + g * G + 4 * kq);  // x's 4 int8 of this quad
        for (int v = 0; v < V; ++v) {
          if constexpr (kVnni)
            isum[t][v] = dot4(isum[t][v], w[v], xb);
          else
            sum16[t][v] = _mm256_add_epi16(sum16[t][v], pair_sums16(w[v], xb));
        }
      }
      if (!kVnni && ((kq + 1) % kPairSums16 == 0 || kq + 1 == quads))
        for (int t = 0; t < T; ++t)
          for (int v = 0; v < V; ++v) {
            isum[t][v] = widen16(isum[t][v], sum16[t][v]);
            sum16[t][v] = _mm256_setzero_si256();
          }
    }
    __m256 s[V], o[V];
    for (int v = 0; v < V; ++v) {
      s[v] = _mm256_loadu_ps(panel_scale + g * kBlockRows + 8 * v);
      o[v] = _mm256_loadu_ps(panel_offset + g * kBlockRows + 8 * v);
    }
    add_group<T>(acc, isum, s, o, x.d + m0 * groups + g, x.xs + m0 * groups + g, groups);
  }
  store_tile<T>(acc, N, m0, n0, cols, y);
#endif
}

#if defined(NANOQWEN_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512F__)
#define NANOQWEN_INT4_PANELS512
// panel_tile on 512-bit vectors, where the CPU has AVX-512 VNNI: a quad's 16 weight rows are one vector (its 16 int32
// lanes the 16 output rows) and one vpdpbusd adds 64 products, where the 256-bit kernel needs two instructions (AMD's
// Zen 4 adds more products a cycle so; bench/bench_batch_decode.py --formats int4 measures the steps). The same
// integers and the same float32 operations lane by lane as panel_tile, so the same bits.
constexpr int kPanelTileRows = 8;  // rows of x per register tile: 8 sums and 8 accumulators of the 32 registers

template <int T>
void panel_tile512(const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* panel,
                   const float* panel_scale, const float* panel_offset, int64_t N, int64_t n0, int cols,
                   at::BFloat16* y, const uint8_t* ahead, int64_t ahead_bytes) {
  const int64_t groups = K / G, quads = G / 4;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    fetch_share(ahead, ahead_bytes, g, groups);
    __m512i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm512_setzero_si512();
    const uint8_t* pg = panel + g * quads * kBlockRows * 4;
    for (int64_t kq = 0; kq < quads; ++kq) {
      const __m512i w = _mm512_loadu_si512(pg + kq * kBlockRows * 4);
      for (int t = 0; t < T; ++t) {
        int32_t four;
        std::memcpy(&four, x.xq + (m0 + t) * K + g * G + 4 * kq, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        isum[t] = _mm512_dpbusd_epi32(isum[t], w, xb);
      }
    }
    const __m512 sc = _mm512_loadu_ps(panel_scale + g * kBlockRows);
    const __m512 off = _mm512_loadu_ps(panel_offset + g * kBlockRows);
    const float* d = x.d + m0 * groups + g;
    const float* xs = x.xs + m0 * groups + g;
    for (int t = 0; t < T; ++t) {  // add_group's operations
      const __m512 sd = _mm512_mul_ps(sc, _mm512_set1_ps(d[t * groups]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), sd, acc[t]);
      acc[t] = _mm512_fmadd_ps(off, _mm512_set1_ps(xs[t * groups]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {  // (the 256-bit halves: lanes 0-7 and 8-15)
    const __m256 row[1][kBlockVectors] = {
        {_mm512_castps512_ps256(acc[t]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1))}};
    store_tile<1>(row, N, m0 + t, n0, cols, y);
  }
}
#else
constexpr int kPanelTileRows = kTileRows;
#endif

// panel_tile (panel_tile512 where built) for T = rows (1 .. kPanelTileRows) rows of x.
template <int T = kPanelTileRows>
void panel_tiles(int rows, const QuantizedRows& x, int64_t K, int64_t G, int64_t m0, const uint8_t* panel,
                 const float* panel_scale, const float* panel_offset, int64_t N, int64_t n0, int cols,
                 at::BFloat16* y, const uint8_t* ahead, int64_t ahead_bytes) {
  if constexpr (T > 1) {
    if (rows < T)
      return panel_tiles<T - 1>(rows, x, K, G, m0, panel, panel_scale, panel_offset, N, n0, cols, y, ahead,
                                ahead_bytes);
  }
#ifdef NANOQWEN_INT4_PANELS512
  panel_tile512<T>(x, K, G, m0, panel, panel_scale, panel_offset, N, n0, cols, y, ahead, ahead_bytes);
#else
  panel_tile<T>(x, K, G, m0, panel, panel_scale, panel_offset, N, n0, cols, y, ahead, ahead_bytes);
#endif
}

template <typename S>
void int4_panels(const Int4Product& p) {
#ifndef NANOQWEN_AVX2
  // without AVX2 every block of weight rows goes through block_scalar: the same bits, with nothing to unpack
  passes(p);
#else
  const int64_t M = p.M, K = p.K, N = p.N, G = p.G, groups = K / G;
  const QuantizedRows rows{p.xq.xq.data(), p.xq.d.data(), p.xq.xs.data()};
  const int64_t panels = (N + kBlockRows - 1) / kBlockRows;
  // The panels shared out by work stealing (as int4_gemv's blocks): with static halves one thread waited for the
  // other at the end of most products (docs/tried-and-not-kept.md). A panel's result does not depend on which
  // thread computes it.
  parallel_rows_stealing(panels, 1, claim_blocks(K), [&](int64_t begin, int64_t end) {
    // this thread's panel (16 KB for K = 1024), kept from claim to claim
    thread_local std::vector<uint8_t> panel;
    thread_local std::vector<float> panel_scale, panel_offset;
    panel.resize(kBlockRows * K);
    panel_scale.resize(kBlockRows * groups);
    panel_offset.resize(kBlockRows * groups);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * kBlockRows;
      const int cols = static_cast<int>(std::min<int64_t>(kBlockRows, N - n0));
      pack_panel<S>(p.wp(), p, N, K, G, n0, panel.data(), panel_scale.data(), panel_offset.data());
      // the next block's packed weights (this thread's next claim, usually), fetched while the first tile of rows
      // computes: unpacking it then reads from the cache, not from memory with nothing else to do
      const int64_t next = n0 + kBlockRows, next_rows = i + 1 < panels ? std::min(N, next + kBlockRows) - next : 0;
      const uint8_t* ahead = next_rows > 0 ? p.wp() + next * (K / 2) : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kPanelTileRows)
        panel_tiles(static_cast<int>(std::min<int64_t>(kPanelTileRows, M - m0)), rows, K, G, m0, panel.data(),
                    panel_scale.data(), panel_offset.data(), N, n0, cols, p.yp(), m0 == 0 ? ahead : nullptr,
                    next_rows * (K / 2));
    }
  });
#endif
}

// ---- The panels' product on AMX tiles (amx.cpp): two panels (32 weight rows) at a time, x's rows 16 at a time
// (x's int8 copy padded with zero rows to a whole tile), the same function as int4_panels.

template <typename S>
void int4_amx_panels(const Int4Product& p) {
  const int64_t M = p.M, K = p.K, N = p.N, G = p.G, groups = K / G;
  std::vector<int8_t> xq((M + 15) / 16 * 16 * K, 0);
  std::memcpy(xq.data(), p.xq.xq.data(), M * K);
  const int64_t panels = (N + kBlockRows - 1) / kBlockRows, pairs = (panels + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> panel(2 * kBlockRows * K);
    std::vector<float> panel_scale(2 * kBlockRows * groups), panel_offset(2 * kBlockRows * groups);
    amx_int4_begin(G);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = 2 * i * kBlockRows;
      const int np = 2 * i + 1 < panels ? 2 : 1;
      int cols[2] = {0, 0};
      for (int j = 0; j < np; ++j) {
        cols[j] = static_cast<int>(std::min<int64_t>(kBlockRows, N - n0 - j * kBlockRows));
        pack_panel<S>(p.wp(), p, N, K, G, n0 + j * kBlockRows, panel.data() + j * kBlockRows * K,
                      panel_scale.data() + j * kBlockRows * groups, panel_offset.data() + j * kBlockRows * groups);
      }
      // the next pair's packed weights, fetched into L2 while this pair's first tile of rows computes
      const int64_t next = std::min(N, n0 + 2 * kBlockRows), next_rows = std::min(N, next + 2 * kBlockRows) - next;
      const uint8_t* ahead = i + 1 < end ? p.wp() + next * (K / 2) : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 16)
        amx_int4_tile(xq.data(), p.xq.d.data(), p.xq.xs.data(), K, G, m0,
                      static_cast<int>(std::min<int64_t>(16, M - m0)), panel.data(), panel_scale.data(),
                      panel_offset.data(), np, cols, N, n0, p.yp(), m0 == 0 ? ahead : nullptr, next_rows * (K / 2));
    }
    amx_end();
  });
}

}  // namespace

void panels(const Int4Product& p) {
  with_scale_type(p, [&](auto type) { int4_panels<typename decltype(type)::type>(p); });
}

void amx_panels(const Int4Product& p) {
  with_scale_type(p, [&](auto type) { int4_amx_panels<typename decltype(type)::type>(p); });
}

}  // namespace int4

// int4_gemv's product through the panels whatever the row count (int4_gemv takes them above kMaxRowsInt4 rows;
// exposed so that tests reach them with few rows too).
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& super_scale,
                     const std::optional<at::Tensor>& super_offset) {
  const int4::Int4Product p = int4::prepare_int4(x, packed, scale, offset, super_scale, super_offset);
  if (p.M > 0 && p.N > 0) int4::panels(p);
  return p.y;
}

// int4_gemv's product on AMX tiles whatever the row count (int4_gemv takes them from amx_min_rows rows on; exposed
// so that tests and the selection's probe reach them). Needs amx_int8_ready() and G <= 64 or a multiple of 64.
at::Tensor int4_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                    const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& super_scale,
                    const std::optional<at::Tensor>& super_offset) {
  TORCH_CHECK(amx_int8_ready(), "int4_amx: this CPU has no AMX-INT8 tiles, or Linux did not grant them");
  const int4::Int4Product p = int4::prepare_int4(x, packed, scale, offset, super_scale, super_offset);
  TORCH_CHECK(int4::amx_takes_group(p.G), "int4_amx: group size ", p.G, " is not <= 64 or a multiple of 64");
  if (p.M > 0 && p.N > 0) int4::amx_panels(p);
  return p.y;
}

}  // namespace nanoqwen

