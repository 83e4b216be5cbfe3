// vdpbf16ps tiles on 64-column panels of bf16 k-pairs, shared by TorchLinear's vdpbf16ps
// path (torch_linear_op.cc) and Fp8Linear's fast numerics (fp8_linear_fast.cc):
//   xb:    rows of X as bf16 k-pairs (x[k] | x[k+1] << 16), ldxb pairs a row;
//   panel: [pairs][64] pairs of 64 columns of W (the layout vdpbf16ps multiplies);
//   out:   [rows][64] floats, out += the sum over pairs [p0, p1).
// One chunk: accumulators from 0, one vdpbf16ps per (row, 16 columns) and pair in order,
// then out = out + acc (one vaddps). The order is TorchLinear's kOneDnnPairs pair step
// (torch_linear.h), so its bits are the definition there. Included by files compiled with
// -ffp-contract=off.
#pragma once

#include <cstdint>

#include "simd.h"
#ifdef CSA_X86
#include <immintrin.h>

namespace csa::dp_bf16 {

constexpr int64_t kPanel = 64;  // columns per panel
constexpr int64_t kTileRows = 6;

// Few rows (decode) stream the panel from memory: each pair step asks for the lines 8 KiB
// ahead (measured on a 2-core Xeon with AMX, ten 80 MB linears in a row, 2 threads: 23 ->
// 29-32 GB/s at 1 row, 21-23 -> 25-27 GB/s at 4; 4, 12, 16 and 64 KiB ahead were 1-10%
// slower). Not at 2 rows: there the prefetches measured 20 GB/s against 28 without (not
// understood; the hardware prefetchers keep up there).
constexpr int64_t kPrefetchPairs = 32;

// MR rows x 64 columns of NP panels over pairs [p0, p1), the panels side by side in one pass
// (NP streams from memory): NP x MR x 4 zmm accumulators; kAhead: prefetch each panel
// kPrefetchPairs pairs ahead (a prefetch past the panel's end reads nothing). Each column's
// sum is one chain whatever NP is.
template <int MR, int NP, bool kAhead>
CSA_TARGET_AVX512BF16 __attribute__((always_inline)) inline void dp_panels(
    const uint32_t* xb, int64_t ldxb, const uint32_t* const (&panel)[NP], int64_t p0, int64_t p1,
    float* const (&out)[NP]) {
  static_assert(NP * MR <= 6, "at most 24 accumulators");
  __m512 acc[NP][MR][4];
  for (int h = 0; h < NP; ++h)
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < 4; ++c) acc[h][m][c] = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh w[NP][4];
    for (int h = 0; h < NP; ++h) {
      const uint32_t* wp = panel[h] + p * kPanel;
      if (kAhead)
        for (int c = 0; c < 4; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchPairs * kPanel + 16 * c),
                       _MM_HINT_T0);
      for (int c = 0; c < 4; ++c) w[h][c] = (__m512bh)_mm512_loadu_si512(wp + 16 * c);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[m * ldxb + p]));
      for (int h = 0; h < NP; ++h)
        for (int c = 0; c < 4; ++c) acc[h][m][c] = _mm512_dpbf16_ps(acc[h][m][c], xv, w[h][c]);
    }
  }
  for (int h = 0; h < NP; ++h)
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < 4; ++c) {
        float* o = out[h] + m * kPanel + 16 * c;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[h][m][c]));
      }
}

// MR rows x one panel.
template <int MR, bool kAhead = false>
CSA_TARGET_AVX512BF16 __attribute__((always_inline)) inline void dp_tile(
    const uint32_t* xb, int64_t ldxb, const uint32_t* panel, int64_t p0, int64_t p1, float* out) {
  dp_panels<MR, 1, kAhead>(xb, ldxb, {panel}, p0, p1, {out});
}

// `rows` rows (any count) in tiles of 6, the last tile smaller; 1, 3 or 4 rows prefetching.
CSA_TARGET_AVX512BF16 __attribute__((always_inline)) inline void dp_rows(
    const uint32_t* xb, int64_t ldxb, int64_t rows, const uint32_t* panel, int64_t p0,
    int64_t p1, float* out) {
  switch (rows) {
    case 1: return dp_tile<1, true>(xb, ldxb, panel, p0, p1, out);
    case 3: return dp_tile<3, true>(xb, ldxb, panel, p0, p1, out);
    case 4: return dp_tile<4, true>(xb, ldxb, panel, p0, p1, out);
    default: break;
  }
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    dp_tile<6>(xb + r * ldxb, ldxb, panel, p0, p1, out + r * kPanel);
  switch (rows - r) {
    case 5: dp_tile<5>(xb + r * ldxb, ldxb, panel, p0, p1, out + r * kPanel); break;
    case 4: dp_tile<4>(xb + r * ldxb, ldxb, panel, p0, p1, out + r * kPanel); break;
    case 3: dp_tile<3>(xb + r * ldxb, ldxb, panel, p0, p1, out + r * kPanel); break;
    case 2: dp_tile<2>(xb + r * ldxb, ldxb, panel, p0, p1, out + r * kPanel); break;
    case 1: dp_tile<1>(xb + r * ldxb, ldxb, panel, p0, p1, out + r * kPanel); break;
    default: break;
  }
}

// One to four rows (decode) x two panels a and b in one pass, prefetching: two streams from
// memory a thread where one panel is one. Four rows are rows 0-2 from memory, then row 3
// from the chunk that pass left in L2 (4 x 2 x 4 accumulators do not fit). Measured on a
// 2-core Xeon with AMX (tools/bench_decode_stream.py, ten 80 MB linears, 2 threads, fresh
// sessions in turns), against dp_rows: 0.79 -> 0.91 of the read probe at 1 row, 0.62 ->
// 0.90 at 2 (prefetching here, unlike dp_tile at 2 rows), 0.68-0.70 -> 0.81-0.84 at 3,
// 0.57-0.62 -> 0.70-0.71 at 4 (as 2 + 2 rows: no faster than dp_tile<4>).
CSA_TARGET_AVX512BF16 __attribute__((always_inline)) inline void dp_rows_two(
    const uint32_t* xb, int64_t ldxb, int64_t rows, const uint32_t* pa, const uint32_t* pb,
    int64_t p0, int64_t p1, float* oa, float* ob) {
  if (rows == 1) return dp_panels<1, 2, true>(xb, ldxb, {pa, pb}, p0, p1, {oa, ob});
  if (rows == 2) return dp_panels<2, 2, true>(xb, ldxb, {pa, pb}, p0, p1, {oa, ob});
  dp_panels<3, 2, true>(xb, ldxb, {pa, pb}, p0, p1, {oa, ob});
  if (rows == 4)
    dp_panels<1, 2, false>(xb + 3 * ldxb, ldxb, {pa, pb}, p0, p1, {oa + 3 * kPanel, ob + 3 * kPanel});
}

}  // namespace csa::dp_bf16
#endif  // CSA_X86
