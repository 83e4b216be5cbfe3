// AMX-BF16 tiles (TDPBF16PS) on 64-column panels of bf16 k-pairs, for numerics "fast" on
// CPUs with AMX (Sapphire Rapids and later). The same operands as dp_bf16_tiles.h:
//   xb:    rows of X as bf16 k-pairs (x[k] | x[k+1] << 16), ldxb pairs a row;
//   panel: [pairs][64] pairs of 64 columns of W: 16 pairs x 16 columns of it are one B tile
//          as TDPBF16PS reads it (rows 256 bytes apart), so W is multiplied where it lies;
//   out:   [rows][64] floats, out += the sum over pairs [p0, p1).
// NOT the exact numerics: TDPBF16PS sums its 32 products per output in its own way (not
// kOneDnnPairs' pair steps: tools/amx_probe.py measures it; swapping the pairs changes
// nothing, and no sequence of f32 roundings matches it), and it reads and writes denormals
// as zero. Its bits depend only on the operands and the chunking [p0, p1), never on the
// thread count. Included by files compiled with -ffp-contract=off.
#pragma once

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "simd.h"
#ifdef CSA_X86
#include <immintrin.h>
#endif

namespace csa::amx_bf16 {

constexpr int64_t kPanel = 64;    // columns per panel
constexpr int64_t kTile = 16;     // rows (and f32 columns) of a tile
constexpr int64_t kStepPairs = 16;  // k-pairs per TDPBF16PS

// Whether this process can run AMX-BF16: the CPU has it (simd.h cpu_has_amx_bf16) and Linux
// grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process; asking
// again is harmless). Called when a kernel is created.
inline bool enable() {
  return cpu_has_amx_bf16() && amx_tiles_granted();
}

#ifdef CSA_X86
// Tiles 0-3: C (rows x 16 f32), 4-5: A (rows x 16 pairs), 6-7: B (16 pairs x 16 columns).
// A 32-row strip is C0 C1 / C2 C3 over A4 (rows 0-15), A5 (rows 16-31) and B6, B7 (columns
// 0-15, 16-31 of a half panel). `lo` rows in tiles 0, 1, 4 and `hi` in 2, 3, 5 (0: unused).
__attribute__((target("amx-tile"))) inline void configure(int lo, int hi) {
  amx_tiles::TileConfig cfg;
  const int rows[8] = {lo, lo, hi, hi, lo, hi, kTile, kTile};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  amx_tiles::load(cfg);
}

// One 16-pair step of a strip: A from x (rows lx bytes apart), B from w (the columns' 16
// pairs, 256 bytes apart), into C0 C1 (and C2 C3 for the second 16 rows).
template <bool kTwo>
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void step(
    const uint32_t* x, long lx, const uint32_t* w) {
  constexpr long kW = kPanel * sizeof(uint32_t);
  _tile_loadd(4, x, lx);
  _tile_loadd(6, w, kW);
  _tile_loadd(7, w + kTile, kW);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (kTwo) {
    _tile_loadd(5, reinterpret_cast<const char*>(x) + kTile * lx, lx);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// One strip (lo + hi rows, hi 0 or lo 16) x 32 columns: C from out, the full 16-pair steps
// [p0, full) from xb and the panel where they lie, then (`tail`) the last partial step from
// zero-padded copies (x_tail: [32][16] pairs, w_tail: [16][64] pairs).
template <bool kTwo>
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void strip(
    const uint32_t* xb, int64_t ldxb, const uint32_t* panel, int64_t p0, int64_t full,
    bool tail, const uint32_t* x_tail, const uint32_t* w_tail, float* out) {
  constexpr long kOut = kPanel * sizeof(float);
  _tile_loadd(0, out, kOut);
  _tile_loadd(1, out + kTile, kOut);
  if (kTwo) {
    _tile_loadd(2, out + kTile * kPanel, kOut);
    _tile_loadd(3, out + kTile * kPanel + kTile, kOut);
  }
  for (int64_t p = p0; p < full; p += kStepPairs)
    step<kTwo>(xb + p, static_cast<long>(ldxb * sizeof(uint32_t)), panel + p * kPanel);
  if (tail) step<kTwo>(x_tail, kStepPairs * sizeof(uint32_t), w_tail);
  _tile_stored(0, out, kOut);
  _tile_stored(1, out + kTile, kOut);
  if (kTwo) {
    _tile_stored(2, out + kTile * kPanel, kOut);
    _tile_stored(3, out + kTile * kPanel + kTile, kOut);
  }
}

// Strips of lo + hi rows from row r0 to r1 (the tiles configured for them).
__attribute__((target("amx-tile,amx-bf16"))) inline void strips(
    const uint32_t* xb, int64_t ldxb, int64_t r0, int64_t r1, int64_t lo, int64_t hi,
    const uint32_t* panel, int64_t p0, int64_t full, int64_t rest, const uint32_t* w_tail,
    float* out) {
  alignas(64) uint32_t x_tail[2 * kTile * kStepPairs];
  for (int64_t r = r0; r < r1; r += lo + hi) {
    const uint32_t* x = xb + r * ldxb;
    if (rest) {
      std::memset(x_tail, 0, sizeof x_tail);
      for (int64_t i = 0; i < lo + hi; ++i)
        std::memcpy(x_tail + i * kStepPairs, x + i * ldxb + full,
                    static_cast<size_t>(rest) * sizeof(uint32_t));
    }
    for (int64_t half = 0; half < kPanel; half += 2 * kTile) {
      float* o = out + r * kPanel + half;
      if (hi) strip<true>(x, ldxb, panel + half, p0, full, rest != 0, x_tail, w_tail + half, o);
      else strip<false>(x, ldxb, panel + half, p0, full, rest != 0, x_tail, w_tail + half, o);
    }
  }
}

// `rows` rows (any count) x 64 columns, out += the sum over pairs [p0, p1) (p0 <= p1 <= the
// panel's pairs; xb holds rows x (at least) p1 pairs). The caller must have had enable()
// return true. Configures the tiles and releases them before it returns.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_rows(
    const uint32_t* xb, int64_t ldxb, int64_t rows, const uint32_t* panel, int64_t p0,
    int64_t p1, float* out) {
  const int64_t full = p0 + (p1 - p0) / kStepPairs * kStepPairs, rest = p1 - full;
  alignas(64) uint32_t w_tail[kStepPairs * kPanel];
  if (rest) {
    std::memset(w_tail, 0, sizeof w_tail);
    std::memcpy(w_tail, panel + full * kPanel,
                static_cast<size_t>(rest * kPanel) * sizeof(uint32_t));
  }
  const int64_t whole = rows / (2 * kTile) * (2 * kTile), left = rows - whole;
  if (whole) {
    configure(kTile, kTile);
    strips(xb, ldxb, 0, whole, kTile, kTile, panel, p0, full, rest, w_tail, out);
  }
  if (left) {  // the last rows: one strip of 17-31 (16 + hi) or of 1-16 (lo only)
    const int64_t lo = left < kTile ? left : kTile, hi = left - lo;
    configure(static_cast<int>(lo), static_cast<int>(hi));
    strips(xb, ldxb, whole, rows, lo, hi, panel, p0, full, rest, w_tail, out);
  }
  _tile_release();
}
#endif

}  // namespace csa::amx_bf16
