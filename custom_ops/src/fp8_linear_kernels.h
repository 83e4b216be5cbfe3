// Fp8Linear's CPU kernels on packed int16 panels (fp8_linear_op.cc holds the op and the
// orchestration; fp8_int_blocks.h the exactness rule). Included by fp8_linear_op.cc only,
// which is compiled with -ffp-contract=off: the float epilogue must stay multiplies and an
// add, each rounded on its own.
//
// Data the kernels share (all int16 values exact, so every path computes the same sums):
// - a panel: 64 columns of W over a few K blocks as int16 k-pairs,
//   pw[kb][pair 0..15][column 0..63][2] = (w[n, 32kb+2p] , w[n, 32kb+2p+1]) >> t[n, kb]
//   (0 for columns past N and for blocks that are not int16), and g[kb][column] = 2^t;
// - X rows as int16 (act_quant's e4m3 units >> t_x per block; where a block is not int16,
//   its high digit, the low digit kept apart),
//   row-major [rows][K], and for the AVX-512 path the same pairs transposed, [K/2][rows16];
// - per (row, K block): t_x as cm = 2^(t_x - 18), the scale xs, and the column groups (16
//   columns) whose int32 sums are not known to be exact (flags; per lane: masks);
// - override slots: for a (K block, group) that has flagged rows or blocks that are not
//   int16, slot[row][16] holds the exact float(sum) of those lanes, computed by wider kernels
//   (f_lanes: one W block that is not int16 against every row, lanes over rows; row_patch:
//   one flagged row against a group, X in two digits; the AVX-512 tiles sum a row whose X
//   block is not int16 in two digits themselves, wide_rows_avx512).
// The tiles (rows x 64 columns per K block) sum in int32 lanes, then per lane
//   P = float(S) (or the slot's value), d = (P * 2^t_w) * 2^(t_x - 18)  (exact: the block dot),
//   out = out + d * (xs * ws)  (as the definition: one rounding for the product, one for +).
// (The AVX-512 tiles, where scales_fold holds: out = out + (P * 2^t_w) * ((xs * ws) *
// 2^(t_x - 18)), the same real product rounded once.)
#pragma once

#include <cstdint>
#include <cstring>

#include "fp8_int_blocks.h"
#include "fp8_linear.h"
#include "simd.h"
#ifdef CSA_X86
#include <immintrin.h>
#endif

#define CSA_INLINE __attribute__((always_inline)) inline

namespace csa::fp8_kernels {

using fp8_int::kUnits;

constexpr int64_t kBlock = Fp8::kBlock;     // K block (32)
constexpr int64_t kPairs = kBlock / 2;      // k-pairs per block
constexpr int64_t kLanes = 16;              // columns per group (one zmm of int32 lanes)
constexpr int64_t kPanel = 64;              // columns per panel
constexpr int64_t kGroups = kPanel / kLanes;
constexpr int64_t kChunkKb = 8;             // K blocks packed at a time (tiles)
// K blocks a few-rows task converts at a time, for any row count: whole W rows up to K =
// 8192, so that a task reads its panel as sequential runs. X's chunk (64 bytes of int16 a
// block a row) then outgrows L1 at 3-4 rows (48-64 KiB, read from L2 once per W row).
// Measured with W from DRAM (tools/bench_decode_stream.py --weights fp8, 2 threads): against
// 128 blocks at 2 rows and 64 at 3-4 (X kept in L1), 12.1 -> 12.5 GB/s at 2 rows and
// 8.6-8.9 -> 9.3-9.5 GB/s at 4; with W in L3 the same within noise.
constexpr int64_t kSmallChunkKb = 256;
constexpr int64_t kMaxChunkKb = kSmallChunkKb;

// W's per-block figures, computed once for a constant W (else per call).
// W's figures are stored per panel: a panel's entries for one block are one run.
// Index of (column n, block kb) in a [panels][KB][64] array:
inline int64_t panel_column_index(int64_t KB, int64_t kb, int64_t n) {
  return ((n / kPanel) * KB + kb) * kPanel + n % kPanel;
}
// and of (group grp of 16 columns, block kb) in a [panels][KB][4] array.
inline int64_t panel_group_index(int64_t KB, int64_t kb, int64_t grp) {
  return ((grp / kGroups) * KB + kb) * kGroups + grp % kGroups;
}

// W's layouts (the op's weight_layout attribute), both read in place:
// - plain: [N][K], as the checkpoint stores it;
// - pairs16 (N a multiple of 16): [N/16][KB][512], group g's block kb one run of 512 codes,
//   code (n = 16g + 4l + c, k = 32kb + 2(2z + h) + kp) at byte 64z + 16l + 8h + 2c + kp
//   (Fp8::pairs16_offset).
//   A zmm z of a run holds k-pairs 2z and 2z + 1 of the group's 16 columns, and the
//   conversions' vpunpck{l,h}bw (convert_codes) leave them as words in column order: lanes
//   over columns with no transpose, the layout the few-rows kernel (dot_groups_vbmi) and the
//   tiles' panels want. Written at export (custom_ops/weight_layout.py).
constexpr int64_t kPairs16Bytes = 512;  // a group's block
// The 32 codes of column n's block kb: in place (plain), or gathered into buf (pairs16).
inline const uint8_t* column_block(const uint8_t* w, int64_t K, bool pairs16, int64_t n, int64_t kb,
                                   uint8_t* buf) {
  if (!pairs16) return w + n * K + kb * kBlock;
  // per zmm z of the run: the column's pairs 2z (h = 0) and 2z + 1 (h = 1, 8 bytes on)
  const uint8_t* src = w + Fp8::pairs16_offset(K, n, kb * kBlock);
  for (int64_t z = 0; z < 8; ++z) {
    std::memcpy(buf + 4 * z, src + 64 * z, 2);
    std::memcpy(buf + 4 * z + 2, src + 64 * z + 8, 2);
  }
  return buf;
}

struct WView {
  const uint8_t* w;        // e4m3fn codes, read in place: [N][K], or pairs16
  int64_t N, K, KB;
  int64_t groups;          // ceil(N / 16)
  const uint8_t* shift;    // [panels][KB][64]: t of each (column, block), a panel's run per block
  const uint16_t* bad;     // [panels][KB][4 groups]: lanes whose block is not int16
  const uint8_t* shift_rows;  // [N][KB + 16]: t of each (column, block), a column in a row (plain)
  bool pairs16;            // W's layout
  // t of columns n.. (within n's panel) at block kb
  const uint8_t* shift_at(int64_t kb, int64_t n) const { return shift + panel_column_index(KB, kb, n); }
  // the lanes of group grp (16 columns) whose block kb is not int16
  uint16_t bad_at(int64_t grp, int64_t kb) const { return bad[panel_group_index(KB, kb, grp)]; }
  const uint8_t* codes(int64_t n, int64_t kb, uint8_t* buf) const { return column_block(w, K, pairs16, n, kb, buf); }
};

struct PackJob {
  WView w;
  int64_t panel, kb0, kbs;
  int16_t* pw;   // [kbs][kPairs][kPanel][2]
  float* g;      // [kbs][kPanel]
};

// Few rows (decode): W's rows are converted in order and go straight into vpdpwssd against
// every row of X (lanes over k, dot_rows_vbmi), and the int32 sums are stored for the
// epilogue (after the slots are filled); a group's pairs are stored too where a flagged row
// needs them (row_patch).
struct SmallJob {
  WView w;
  int64_t panel, kb0, kbs;
  const int16_t* xi;          // [rows][K], the task's first row
  int64_t K, rows;            // rows <= kSmallRows
  const uint8_t* flagged;     // [kbs]: bit c, group c has flagged rows (its pairs are kept)
  int16_t* pw;
  float* g;                   // GroupConverter's 2^t of those groups (the epilogue reads t)
  int32_t* sums;              // [kbs][kGroups][rows][16]
  int16_t* xp;                // scratch [rows][kXpRow] (X by quads)
  int32_t* tsum;              // scratch [rows][kLanes][kTsumLd] (a group's sums, lanes over k)
  // dot_groups_vbmi (pairs16 W, epilogue fused): fill(fill_ctx, kbi) before the block's
  // sums are used, where need[kbi] (its slots, and the pairs and patches of flagged rows)
  const uint8_t* need = nullptr;
  void (*fill)(void*, int64_t) = nullptr;
  void* fill_ctx = nullptr;
};
constexpr int64_t kSmallRows = 4;
constexpr int64_t kPrefetchBytes = 16384;  // dot_small asks for W's codes this far ahead (L2)
// dot_small's columns side by side, a slice of each in turn: sequential streams of W for the
// prefetchers. Measured (ten to twenty 8192 x 5120 linears from DRAM, one row, 1 thread):
// 7.1-7.3 GB/s with 1, 7.7 with 2, 7.9-8.2 with 4, 7.5 with 8, 7.3 with 16.
constexpr int64_t kStreams = 4;

struct TaskView {
  const int16_t* xi;      // [rows][K], the task's first row
  int64_t K, KB;
  const float* cm;        // [KB][ld] at the task's first row
  const float* xs;        // [KB][ld]
  int64_t ld;             // the chunk's rows (stride of cm / xs)
  int64_t rows;
  int64_t kb0, kbs;
  const int16_t* pw;
  const float* g;         // [kbs][kPanel]: 2^t_w (tiles)
  const uint8_t* tw;      // [KB][kPanel]: the panel's t_w (the few-rows epilogue)
  const float* ws0;       // WScale rows of the panel's two 32-column halves, [KB] each
  const float* ws1;
  const uint64_t* masks;  // [kbs][rows]: per group, the lanes taken from its slot
  const float* const* slot;  // [kbs][kGroups]: [rows][16] (a dummy where none is needed)
  const uint16_t* bad;       // [kbs][kGroups]
  float* out;             // [rows][kPanel]
  bool fold;              // (xs * ws) * 2^(t_x - 18) is exact for every row (scales_fold)
  const uint8_t* fits;    // [KB][ld] at the task's first row: the block is int16
  const uint8_t* xlo;     // [rows][K] at the task's first row: low digits (blocks not int16)
  // AVX-512 tiles: the task's count of (row, block)s they summed in two digits, or null where
  // act_quant flagged such rows for row patches instead (few rows)
  uint64_t* wide_rows;
  const int32_t* wide_w;  // [kbs][kGroups][16][32]: W blocks that are not int16, units >> t_w
  uint64_t* wide_sums;    // the task's count of (row, block, column)s summed exactly (int64 or double)
};

// Whether every (xs * ws) * 2^(t_x - 18) is a normal float's exact value: xs >= 2^-22
// (act_quant's amax floor) and 2^(t_x - 18) >= 2^-18, so it holds when every finite,
// nonzero |ws| is at least 2^-86 (an inf or NaN scale stays inf or NaN either way). Then
// dot * (xs * ws) = (float(S) * 2^t_w) * ((xs * ws) * 2^(t_x - 18)) in one rounding, the
// same real product as the definition's: the tiles take one multiply per lane, not two.
inline bool scales_fold(const float* ws, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = ws[i] < 0.0f ? -ws[i] : ws[i];
    if (a != 0.0f && a < 0x1p-86f) return false;
  }
  return true;
}

inline int32_t pair_of(int32_t lo, int32_t hi) {
  return static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) |
                              (static_cast<uint32_t>(hi) << 16));
}

struct FJob {               // one W block that is not int16, against every row
  const int16_t* xi;        // generic: [rows][K] at the block's first column
  int64_t K;
  const int32_t* xt;        // AVX-512: [kPairs][ldt] pairs at the block and the first row
  int64_t ldt;
  int64_t rows;
  const uint8_t* codes;     // the W block's 32 codes
  uint32_t t;               // and its shift
  float* f;                 // [rows16]: float(sum), exact
};

// A W block's units >> t (up to 18 bits) as two digits in int16 pairs: v = h * 2^8 + l.
CSA_INLINE void w_digits_generic(const uint8_t* codes, uint32_t t, int32_t* wh, int32_t* wl) {
  int32_t h[kBlock], l[kBlock];
  for (int64_t i = 0; i < kBlock; ++i) {
    const int32_t v = kUnits.v[codes[i]] >> t;
    h[i] = v >> fp8_int::kDigitBits;                      // [-2^10, 2^10)
    l[i] = v & ((1 << fp8_int::kDigitBits) - 1);          // [0, 2^8)
  }
  for (int64_t p = 0; p < kPairs; ++p) {
    wh[p] = pair_of(h[2 * p], h[2 * p + 1]);
    wl[p] = pair_of(l[2 * p], l[2 * p + 1]);
  }
}

struct RowJob {             // one flagged row of one K block against its flagged groups
  const int16_t* x;         // the row's block: units >> t_x, or their high digit (not int16)
  const uint8_t* xlo;       // the low digit (block not int16)
  bool fits;                // the block is int16
  const int16_t* pw;        // the panel at (block, pair 0, column 0)
  uint32_t groups;          // bit c: patch group c
  const uint16_t* bad;      // [kGroups]: lanes left alone (not int16: f_lanes' values)
  float* out[kGroups];      // the groups' slot rows (16 floats)
};

// The row's block as two digits, h * 2^8 + l (|h| < 2^10, 0 <= l < 2^8).
CSA_INLINE void row_digits(const RowJob& j, int32_t* h, int32_t* l) {
  for (int64_t i = 0; i < kBlock; ++i) {
    h[i] = j.fits ? j.x[i] >> fp8_int::kDigitBits : j.x[i];
    l[i] = j.fits ? j.x[i] & ((1 << fp8_int::kDigitBits) - 1) : j.xlo[i];
  }
}

struct FlagJob {
  const uint32_t* lim_l1;   // [KB][ld] at the task's first row
  const uint32_t* lim_max;
  const uint32_t* lim_l2;
  int64_t ld, rows, kb0, kbs;
  const uint32_t* l1max;    // [kbs][kGroups] of this panel
  const uint32_t* absmax;
  const uint32_t* l2max;
  const uint16_t* bad;      // [kbs][kGroups]
  uint8_t* flags;           // [kbs][rows]: bit c = group c's int32 sums may not be exact
  uint64_t* masks;          // [kbs][rows]: 16 bits per group, the lanes the tiles take from slots
};

// ------------------------------------------------------------------ generic kernels
// Plain C++, compiled into each instruction-set wrapper (and the scalar path).

CSA_INLINE void pack_generic(const PackJob& j) {
  for (int64_t kbi = 0; kbi < j.kbs; ++kbi) {
    const int64_t kb = j.kb0 + kbi;
    for (int64_t lane = 0; lane < kPanel; ++lane) {
      const int64_t n = j.panel * kPanel + lane;
      const int64_t grp = n / kLanes;
      uint32_t t = 0;
      bool valid = n < j.w.N;
      if (grp < j.w.groups) {
        t = *j.w.shift_at(kb, n);
        valid = valid && ((j.w.bad_at(grp, kb) >> (n % kLanes)) & 1u) == 0;
      }
      j.g[kbi * kPanel + lane] = fp8_int::pow2f(static_cast<int>(t));
      int16_t* dst = j.pw + (kbi * kPairs * kPanel + lane) * 2;
      uint8_t buf[kBlock];
      const uint8_t* codes = valid ? j.w.codes(n, kb, buf) : nullptr;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int16_t v = valid ? static_cast<int16_t>(kUnits.v[codes[i]] >> t) : int16_t{0};
        dst[(i / 2) * kPanel * 2 + i % 2] = v;
      }
    }
  }
}

CSA_INLINE void flags_generic(const FlagJob& j) {
  static_assert(kGroups == 4, "one flag bit per group");
  for (int64_t kbi = 0; kbi < j.kbs; ++kbi) {
    const uint32_t* __restrict l1 = j.lim_l1 + (j.kb0 + kbi) * j.ld;
    const uint32_t* __restrict mx = j.lim_max + (j.kb0 + kbi) * j.ld;
    const uint32_t* __restrict l2 = j.lim_l2 + (j.kb0 + kbi) * j.ld;
    const uint32_t a0 = j.l1max[kbi * kGroups], a1 = j.l1max[kbi * kGroups + 1];
    const uint32_t a2 = j.l1max[kbi * kGroups + 2], a3 = j.l1max[kbi * kGroups + 3];
    const uint32_t b0 = j.absmax[kbi * kGroups], b1 = j.absmax[kbi * kGroups + 1];
    const uint32_t b2 = j.absmax[kbi * kGroups + 2], b3 = j.absmax[kbi * kGroups + 3];
    const uint32_t c0 = j.l2max[kbi * kGroups], c1 = j.l2max[kbi * kGroups + 1];
    const uint32_t c2 = j.l2max[kbi * kGroups + 2], c3 = j.l2max[kbi * kGroups + 3];
    uint64_t base = 0;
    for (int64_t c = 0; c < kGroups; ++c) base |= uint64_t{j.bad[kbi * kGroups + c]} << (16 * c);
    uint8_t* __restrict f = j.flags + kbi * j.rows;
    uint64_t* __restrict mk = j.masks + kbi * j.rows;
    for (int64_t r = 0; r < j.rows; ++r) {
      const uint32_t p = l1[r], q = mx[r], s = l2[r];
      const uint32_t f0 = (a0 > p) & (b0 > q) & (c0 > s), f1 = (a1 > p) & (b1 > q) & (c1 > s);
      const uint32_t f2 = (a2 > p) & (b2 > q) & (c2 > s), f3 = (a3 > p) & (b3 > q) & (c3 > s);
      f[r] = static_cast<uint8_t>(f0 | (f1 << 1) | (f2 << 2) | (f3 << 3));
      mk[r] = base | (uint64_t{f0} * 0xFFFFu) | (uint64_t{f1} * 0xFFFF0000u) |
              (uint64_t{f2} * 0xFFFF00000000u) | (uint64_t{f3} * 0xFFFF000000000000u);
    }
  }
}

// The epilogue of one (row, lane): the same float operations on every path.
CSA_INLINE float block_term(float p, float g, float cm, float sc) {
  const float dot = (p * g) * cm;  // exact: float(sum) * 2^(t_w + t_x - 18)
  return dot * sc;
}

// One row x 64 columns for K block kbi, int64 sums (exact for every lane; lanes that the
// int16 packing zeroed or that are flagged take the slot's value).
CSA_INLINE void tile_row_generic(const TaskView& v, int64_t r, int64_t kbi) {
  const int64_t kb = v.kb0 + kbi;
  const int16_t* pw = v.pw + kbi * kPairs * kPanel * 2;
  const int16_t* x = v.xi + r * v.K + kb * kBlock;
  int64_t acc[kPanel] = {};
  for (int64_t p = 0; p < kPairs; ++p) {
    const int64_t x0 = x[2 * p], x1 = x[2 * p + 1];
    const int16_t* w = pw + p * kPanel * 2;
    for (int64_t lane = 0; lane < kPanel; ++lane)
      acc[lane] += x0 * w[2 * lane] + x1 * w[2 * lane + 1];
  }
  const float cm = v.cm[kb * v.ld + r], xs = v.xs[kb * v.ld + r];
  const float sc[2] = {xs * v.ws0[kb], xs * v.ws1[kb]};
  for (int64_t c = 0; c < kGroups; ++c) {
    const float* slot = v.slot[kbi * kGroups + c];
    const uint32_t mask = static_cast<uint32_t>(v.masks[kbi * v.rows + r] >> (16 * c)) & 0xFFFFu;
    for (int64_t i = 0; i < kLanes; ++i) {
      const int64_t lane = c * kLanes + i;
      float p = static_cast<float>(acc[lane]);
      if ((mask >> i) & 1u) p = slot[r * kLanes + i];
      float& o = v.out[r * kPanel + lane];
      o = o + block_term(p, v.g[kbi * kPanel + lane], cm, sc[c / 2]);
    }
  }
}

CSA_INLINE void tiles_generic(const TaskView& v, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t kbi = 0; kbi < v.kbs; ++kbi) tile_row_generic(v, r, kbi);
}

// sum = hi * 2^8 + lo, rounded once to float.
CSA_INLINE float digits_to_float(int64_t hi, int64_t lo) {
  return static_cast<float>(hi * (int64_t{1} << fp8_int::kDigitBits) + lo);
}

CSA_INLINE void f_lanes_generic(const FJob& j) {
  int32_t wh[kPairs], wl[kPairs];
  w_digits_generic(j.codes, j.t, wh, wl);
  for (int64_t r = 0; r < j.rows; ++r) {
    const int16_t* x = j.xi + r * j.K;
    int64_t h = 0, l = 0;
    for (int64_t p = 0; p < kPairs; ++p) {
      const int64_t x0 = x[2 * p], x1 = x[2 * p + 1];
      h += x0 * static_cast<int16_t>(wh[p] & 0xFFFF) + x1 * static_cast<int16_t>(wh[p] >> 16);
      l += x0 * static_cast<int16_t>(wl[p] & 0xFFFF) + x1 * static_cast<int16_t>(wl[p] >> 16);
    }
    j.f[r] = digits_to_float(h, l);
  }
}

CSA_INLINE void row_patch_generic(const RowJob& j) {
  int32_t h[kBlock], l[kBlock];
  row_digits(j, h, l);
  for (int64_t c = 0; c < kGroups; ++c) {
    if (((j.groups >> c) & 1u) == 0) continue;
    const int16_t* pw = j.pw + c * kLanes * 2;
    for (int64_t i = 0; i < kLanes; ++i) {
      if ((j.bad[c] >> i) & 1u) continue;
      int64_t hs = 0, ls = 0;
      for (int64_t k = 0; k < kBlock; ++k) {
        const int64_t w = pw[((k / 2) * kPanel + i) * 2 + k % 2];
        hs += w * h[k];
        ls += w * l[k];
      }
      j.out[c][i] = digits_to_float(hs, ls);
    }
  }
}

#ifdef CSA_X86
// GCC 12 flags the intrinsics' own _mm*_undefined_* placeholders as (maybe-)uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// Fp8::e4m3_rne of clamp(v, -448, 448) in 16 lanes, as values (the same IEEE and bit
// operations: the bit-field rounding, or below 2^-6 the 2^23 trick, then the sign), for the
// exact kernel's act_quant and the fast one's; a NaN lane gives an unspecified value that
// callers mask.
CSA_TARGET_AVX512 CSA_INLINE __m512 e4m3_rne_avx512(__m512 v) {
  const __m512 lim = _mm512_set1_ps(Fp8::kMax);
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v),
                                        _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 a = _mm512_abs_ps(v);
  const __m512 two23 = _mm512_set1_ps(0x1p23f);
  const __m512 small = _mm512_mul_ps(
      _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)), two23), two23),
      _mm512_set1_ps(0x1p-9f));
  const __m512i b = _mm512_castps_si512(a);
  const __m512i big = _mm512_and_si512(
      _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFFF)),
                       _mm512_and_si512(_mm512_srli_epi32(b, 20), _mm512_set1_epi32(1))),
      _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m512 q = _mm512_mask_mov_ps(_mm512_castsi512_ps(big),
                                      _mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ), small);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(q), sign));
}

// e4m3_rne_avx512 in 8 lanes (the same operations).
CSA_TARGET_AVX2 CSA_INLINE __m256 e4m3_rne_avx2(__m256 v) {
  const __m256 lim = _mm256_set1_ps(Fp8::kMax);
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
  const __m256i sign = _mm256_and_si256(_mm256_castps_si256(v),
                                        _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  const __m256 two23 = _mm256_set1_ps(0x1p23f);
  const __m256 small = _mm256_mul_ps(
      _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)), two23), two23),
      _mm256_set1_ps(0x1p-9f));
  const __m256i b = _mm256_castps_si256(a);
  const __m256i big = _mm256_and_si256(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFFF)),
                       _mm256_and_si256(_mm256_srli_epi32(b, 20), _mm256_set1_epi32(1))),
      _mm256_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m256 q = _mm256_blendv_ps(_mm256_castsi256_ps(big), small,
                                    _mm256_cmp_ps(a, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ));
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(q), sign));
}

// ---------------------------------------------------------------------- AVX2 tiles
// The epilogue of 8 lanes (the AVX2 tiles' and dot_groups_avx2's): the block dots (or the
// slot's, in the lanes whose bit of mask8 is set; slot is read only then), times 2^t_w (g),
// times cm unless folded into sc, times sc, added to out: each multiply rounded on its own.
template <bool kFold>
CSA_TARGET_AVX2 CSA_INLINE void add_block_dots8(__m256i sums, uint32_t mask8, const float* slot,
                                                __m256 g, float cm, float sc, float* out) {
  __m256 p = _mm256_cvtepi32_ps(sums);
  if (mask8 != 0) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 take = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(mask8)), lane_bit), lane_bit));
    p = _mm256_blendv_ps(p, _mm256_loadu_ps(slot), take);
  }
  p = _mm256_mul_ps(p, g);
  if (!kFold) p = _mm256_mul_ps(p, _mm256_set1_ps(cm));
  p = _mm256_mul_ps(p, _mm256_set1_ps(sc));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), p));
}

// 2 rows x 32 columns (4 ymm of 8 int32 lanes) per step, vpmaddwd + vpaddd (exact: the
// flagged lanes may wrap, and take their slot's value). The epilogue as the AVX-512 tiles':
// slots blended in only where a row of the tile takes one, 2^(t_x - 18) folded into the
// scale where scales_fold allows (kFold).
template <int MR, bool kFold>
CSA_TARGET_AVX2 CSA_INLINE void tile_avx2(const TaskView& v, int64_t r0, int64_t kbi,
                                          int64_t half) {
  const int64_t kb = v.kb0 + kbi;
  const int16_t* pw = v.pw + kbi * kPairs * kPanel * 2 + half * 32 * 2;
  const int16_t* x = v.xi + r0 * v.K + kb * kBlock;
  __m256i acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q) acc[m][q] = _mm256_setzero_si256();
  for (int64_t p = 0; p < kPairs; ++p) {
    __m256i w[4];
    for (int q = 0; q < 4; ++q)
      w[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (p * kPanel + 8 * q) * 2));
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * v.K + 2 * p, sizeof pair);
      const __m256i xv = _mm256_set1_epi32(pair);
      for (int q = 0; q < 4; ++q) acc[m][q] = _mm256_add_epi32(acc[m][q], _mm256_madd_epi16(xv, w[q]));
    }
  }
  const uint64_t* masks = v.masks + kbi * v.rows + r0;
  uint64_t any = 0;
  float sc[MR], cm[MR];
  for (int m = 0; m < MR; ++m) {
    any |= masks[m];
    cm[m] = v.cm[kb * v.ld + r0 + m];
    sc[m] = v.xs[kb * v.ld + r0 + m] * (half == 0 ? v.ws0 : v.ws1)[kb];
    if (kFold) sc[m] = sc[m] * cm[m];
  }
  for (int q = 0; q < 4; ++q) {
    const int64_t c = (half * 32 + 8 * q) / kLanes, i0 = (8 * q) % kLanes;
    const __m256 g = _mm256_loadu_ps(v.g + kbi * kPanel + half * 32 + 8 * q);
    for (int m = 0; m < MR; ++m) {
      const int64_t r = r0 + m;
      // every slot pointer is valid (a shared dummy under an all-zero mask)
      const uint32_t mask = any != 0 ? static_cast<uint32_t>(masks[m] >> (16 * c + i0)) & 0xFFu : 0u;
      add_block_dots8<kFold>(acc[m][q], mask, v.slot[kbi * kGroups + c] + r * kLanes + i0, g, cm[m],
                             sc[m], v.out + r * kPanel + half * 32 + 8 * q);
    }
  }
}

template <int MR, bool kFold>
CSA_TARGET_AVX2 __attribute__((noinline)) void tile_rows_avx2(const TaskView& v, int64_t r0) {
  for (int64_t kbi = 0; kbi < v.kbs; ++kbi)
    for (int64_t half = 0; half < 2; ++half) tile_avx2<MR, kFold>(v, r0, kbi, half);
}

template <bool kFold>
CSA_TARGET_AVX2 CSA_INLINE void tiles_avx2_rows(const TaskView& v, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) tile_rows_avx2<2, kFold>(v, r);
  if (r < r1) tile_rows_avx2<1, kFold>(v, r);
}

CSA_TARGET_AVX2 CSA_INLINE void tiles_avx2_body(const TaskView& v, int64_t r0, int64_t r1) {
  if (v.fold) {
    tiles_avx2_rows<true>(v, r0, r1);
  } else {
    tiles_avx2_rows<false>(v, r0, r1);
  }
}

// hi * 2^8 + lo for 4 int32 lanes, rounded once to float: AVX2 has no int64 -> float, so
// in double (exact: below 2^40), then to float (the one rounding, to nearest even, as
// digits_to_float's int64 -> float).
CSA_TARGET_AVX2 CSA_INLINE __m128 digits_to_float4(__m128i hi, __m128i lo) {
  const __m256d radix = _mm256_set1_pd(static_cast<double>(1 << fp8_int::kDigitBits));
  return _mm256_cvtpd_ps(_mm256_fmadd_pd(_mm256_cvtepi32_pd(hi), radix, _mm256_cvtepi32_pd(lo)));
}

// The same for 8 lanes.
CSA_TARGET_AVX2 CSA_INLINE __m256 digits_to_float8(__m256i hi, __m256i lo) {
  return _mm256_set_m128(digits_to_float4(_mm256_extracti128_si256(hi, 1), _mm256_extracti128_si256(lo, 1)),
                         digits_to_float4(_mm256_castsi256_si128(hi), _mm256_castsi256_si128(lo)));
}

// w_digits_generic in ymm (w_digits_avx512's twin): 8 codes' units at a time (M << sh, NaN
// codes 0, the sign last), >> t, the two digits; packed into int16 pairs in k order. The
// scalar loop took most of a one-row f_lanes call (AMD EPYC, AVX2: f_lanes 7.1% of an fp8
// decode step's samples).
CSA_TARGET_AVX2 CSA_INLINE void w_digits_avx2(const uint8_t* codes, uint32_t t, __m256i (&dh)[2],
                                              __m256i (&dl)[2]) {
  const __m256i zero = _mm256_setzero_si256();
  const __m128i count = _mm_cvtsi32_si128(static_cast<int>(t));
  __m256i h[4], l[4];
  for (int q = 0; q < 4; ++q) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * q)));
    const __m256i e = _mm256_and_si256(_mm256_srli_epi32(c, 3), _mm256_set1_epi32(15));
    const __m256i mant = _mm256_or_si256(_mm256_and_si256(c, _mm256_set1_epi32(7)),
                                         _mm256_and_si256(_mm256_cmpgt_epi32(e, zero), _mm256_set1_epi32(8)));
    const __m256i expo = _mm256_max_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), zero);
    const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7F)), _mm256_set1_epi32(0x7F));
    const __m256i u = _mm256_andnot_si256(nan, _mm256_sllv_epi32(mant, expo));
    const __m256i neg = _mm256_sub_epi32(zero, _mm256_srli_epi32(c, 7));  // -1 for a negative code
    const __m256i v = _mm256_sra_epi32(_mm256_sub_epi32(_mm256_xor_si256(u, neg), neg), count);  // exact
    h[q] = _mm256_srai_epi32(v, fp8_int::kDigitBits);
    l[q] = _mm256_and_si256(v, _mm256_set1_epi32(255));
  }
  // packs gives codes [0-3, 8-11 | 4-7, 12-15] of two registers; the 64-bit permute, k order
  for (int i = 0; i < 2; ++i) {
    dh[i] = _mm256_permute4x64_epi64(_mm256_packs_epi32(h[2 * i], h[2 * i + 1]), 0xD8);
    dl[i] = _mm256_permute4x64_epi64(_mm256_packs_epi32(l[2 * i], l[2 * i + 1]), 0xD8);
  }
}

// f_lanes_generic four rows at a time (the last ones padded): each row's block against the
// W block's digits, lanes over k (vpmaddwd; every int32 partial sum exact, as the AVX-512
// path's), the lanes summed by a vphaddd tree, hi * 2^8 + lo rounded once per row.
CSA_TARGET_AVX2 CSA_INLINE void f_lanes_avx2_body(const FJob& j) {
  __m256i dh[2], dl[2];
  w_digits_avx2(j.codes, j.t, dh, dl);
  for (int64_t r = 0; r < j.rows; r += 4) {
    const int64_t n = j.rows - r < 4 ? j.rows - r : 4;  // the last rows: the others 0
    __m256i h[4], l[4];
    for (int i = 0; i < 4; ++i) {
      h[i] = l[i] = _mm256_setzero_si256();
      if (i >= n) continue;
      const int16_t* x = j.xi + (r + i) * j.K;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      h[i] = _mm256_add_epi32(_mm256_madd_epi16(x0, dh[0]), _mm256_madd_epi16(x1, dh[1]));
      l[i] = _mm256_add_epi32(_mm256_madd_epi16(x0, dl[0]), _mm256_madd_epi16(x1, dl[1]));
    }
    const __m256i hs = _mm256_hadd_epi32(_mm256_hadd_epi32(h[0], h[1]), _mm256_hadd_epi32(h[2], h[3]));
    const __m256i ls = _mm256_hadd_epi32(_mm256_hadd_epi32(l[0], l[1]), _mm256_hadd_epi32(l[2], l[3]));
    const __m128i hsum = _mm_add_epi32(_mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1));
    const __m128i lsum = _mm_add_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1));
    alignas(16) float f[4];
    _mm_store_ps(f, digits_to_float4(hsum, lsum));
    std::memcpy(j.f + r, f, static_cast<size_t>(n) * sizeof(float));
  }
}

// row_patch_generic with a group's 16 lanes in two ymm: the row's digit pairs broadcast
// against the panel's pairs (vpmaddwd: each int32 lane exact, as the AVX-512 path's).
CSA_TARGET_AVX2 CSA_INLINE void row_patch_avx2_body(const RowJob& j) {
  alignas(32) int32_t hp[kPairs], lp[kPairs];  // the digits as int16 pairs
  for (int half = 0; half < 2; ++half) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(j.x + 16 * half));
    __m256i h = x, l;
    if (j.fits) {
      h = _mm256_srai_epi16(x, fp8_int::kDigitBits);
      l = _mm256_and_si256(x, _mm256_set1_epi16((1 << fp8_int::kDigitBits) - 1));
    } else {
      l = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(j.xlo + 16 * half)));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(hp + 8 * half), h);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lp + 8 * half), l);
  }
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t c = 0; c < kGroups; ++c) {
    if (((j.groups >> c) & 1u) == 0) continue;
    const int16_t* pw = j.pw + c * kLanes * 2;
    __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, l[2] = {h[0], h[0]};
    for (int64_t p = 0; p < kPairs; ++p) {
      const __m256i xh = _mm256_set1_epi32(hp[p]), xl = _mm256_set1_epi32(lp[p]);
      for (int q = 0; q < 2; ++q) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (p * kPanel + 8 * q) * 2));
        h[q] = _mm256_add_epi32(h[q], _mm256_madd_epi16(xh, w));
        l[q] = _mm256_add_epi32(l[q], _mm256_madd_epi16(xl, w));
      }
    }
    for (int q = 0; q < 2; ++q) {  // the lanes that are int16 (the others hold f_lanes' values)
      const __m256i keep = _mm256_cmpeq_epi32(
          _mm256_and_si256(_mm256_set1_epi32((~j.bad[c] >> (8 * q)) & 0xFF), lane_bit), lane_bit);
      _mm256_maskstore_ps(j.out[c] + 8 * q, keep, digits_to_float8(h[q], l[q]));
    }
  }
}

// kUnits.v[c] >> t for 32 codes of a pairs16 run, in int16 (the lanes a pack stores). A
// code's units are M * 2^sh (M = m, plus 8 where e > 0; sh = max(e - 1, 0)), and an int16
// lane's t leaves sh - t in [-3, 11] (t divides every unit of the block: tz(M) + sh >= t;
// v <= 32767 with M >= 8 for e > 0), so with d = sh + 4 - t in [1, 15] the value is
// (M * 2^12) * 2^d >> 16: vpmulhuw, both factors 16-bit. All per byte until then: sh by a
// saturating subtract, M * 2^4 by table lookups (vpshufb), d from each lane's 4 - t (-64
// zeroes a lane that is not int16: an index with bit 7 set looks up 0), 2^d's low and high
// bytes by one lookup each, joined into words by the unpacks that widen; the sign last (the
// code in the word's high byte is negative for a negative code, 0 only for 0). A NaN code
// is not zeroed (pack_generic's is): it gives some int16 in its own lane only, a column that
// the op sets to NaN after the tasks (Fp8LinearKernel's nan_columns); 3 of 22 operations,
// 11% of a one-row call.
struct UnitsAvx2 {
  __m256i m4, top, pow2_lo, pow2_hi;
};

CSA_TARGET_AVX2 CSA_INLINE UnitsAvx2 units_tables_avx2() {
  const __m128i m4 = _mm_setr_epi8(0, 16, 32, 48, 64, 80, 96, 112, 0, 16, 32, 48, 64, 80, 96, 112);
  const __m128i top = _mm_setr_epi8(0, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128,
                                    -128, -128, -128, -128, -128);
  const __m128i lo = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128i hi = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 8, 16, 32, 64, -128);
  return {_mm256_broadcastsi128_si256(m4), _mm256_broadcastsi128_si256(top),
          _mm256_broadcastsi128_si256(lo), _mm256_broadcastsi128_si256(hi)};
}

// codes: bytes [run 0, run 2 | run 1, run 3] (8 each); tneg: each byte's 4 - t (or -64);
// out: [run 0, run 1] and [run 2, run 3] as int16.
CSA_TARGET_AVX2 CSA_INLINE void units_shifted_avx2(const UnitsAvx2& k, __m256i codes, __m256i tneg,
                                                   __m256i* out) {
  const __m256i nib = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  const __m256i e = _mm256_and_si256(_mm256_srli_epi16(codes, 3), nib);
  const __m256i m4 = _mm256_or_si256(_mm256_shuffle_epi8(k.m4, _mm256_and_si256(codes, nib)),
                                     _mm256_shuffle_epi8(k.top, e));
  const __m256i d = _mm256_add_epi8(_mm256_subs_epu8(e, _mm256_set1_epi8(1)), tneg);
  const __m256i lo = _mm256_shuffle_epi8(k.pow2_lo, d), hi = _mm256_shuffle_epi8(k.pow2_hi, d);
  const __m256i v0 = _mm256_mulhi_epu16(_mm256_unpacklo_epi8(zero, m4), _mm256_unpacklo_epi8(lo, hi));
  const __m256i v1 = _mm256_mulhi_epu16(_mm256_unpackhi_epi8(zero, m4), _mm256_unpackhi_epi8(lo, hi));
  out[0] = _mm256_sign_epi16(v0, _mm256_unpacklo_epi8(zero, codes));
  out[1] = _mm256_sign_epi16(v1, _mm256_unpackhi_epi8(zero, codes));
}

// A group's block on AVX2 (either layout): g = 2^t of its 16 lanes, and per byte of the
// [cols 0-3, 8-11 | cols 4-7, 12-15] arrangement units_shifted_avx2 reads (each column's two
// codes of a k-pair), the lane's 4 - t, or -64 where the lane is not int16.
CSA_TARGET_AVX2 CSA_INLINE __m256i group_tneg_avx2(const WView& w, int64_t kb, int64_t grp, float* g) {
  const __m128i t16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.shift_at(kb, grp * kLanes)));
  const __m256i bias = _mm256_set1_epi32(127);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(g),
                      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtepu8_epi32(t16), bias), 23));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(g + 8),
                      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(t16, 8)), bias), 23));
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m128i bad = _mm_shuffle_epi8(_mm_cvtsi32_si128(w.bad_at(grp, kb)),
                                       _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i tl = _mm_blendv_epi8(_mm_sub_epi8(_mm_set1_epi8(4), t16), _mm_set1_epi8(-64),
                                     _mm_cmpeq_epi8(_mm_and_si128(bad, bit), bit));
  const __m128i lo = _mm_unpacklo_epi8(tl, tl), hi = _mm_unpackhi_epi8(tl, tl);
  return _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
}

// Pair p of a group's block (codes in units_shifted_avx2's arrangement) as the panel's two
// ymm: lanes 0-7 and 8-15, each the column's k-pair as int16 units.
CSA_TARGET_AVX2 CSA_INLINE void store_pair_avx2(const UnitsAvx2& k, __m256i codes, __m256i tneg,
                                                int16_t* dst, int64_t p) {
  __m256i v[2];
  units_shifted_avx2(k, codes, tneg, v);
  __m256i* out = reinterpret_cast<__m256i*>(dst + p * kPanel * 2);
  _mm256_storeu_si256(out, v[0]);
  _mm256_storeu_si256(out + 1, v[1]);
}

// Group grp past N: zero lanes, 2^0.
CSA_INLINE void pack_empty_group(int16_t* dst, float* g) {
  for (int64_t p = 0; p < kPairs; ++p) std::memset(dst + p * kPanel * 2, 0, kLanes * 2 * sizeof(int16_t));
  for (int64_t i = 0; i < kLanes; ++i) g[i] = 1.0f;
}

// A plain W's group block as units_shifted_avx2 reads a pairs16 run: the group's 16
// columns (a block each: 16 words, the k-pairs) transposed into pairs by four unpack
// stages, the last one leaving each pair in that arrangement: after the 16-, 32- and 64-bit
// unpacks of columns (0-3 with 8-11, 4-7 with 12-15) a ymm holds pair p's columns
// [0-3, 8-11 | ...] in its low lane and pair p + 8's in its high lane; vperm2i128 pairs the
// lanes. Columns past N read as zeros (their lanes are not int16 anyway).
CSA_TARGET_AVX2 CSA_INLINE void plain_pairs_avx2(const WView& w, int64_t grp, int64_t kb, __m256i* pairs) {
  __m256i r[16], s[16];
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t n = grp * kLanes + i;
    r[i] = n < w.N ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.w + n * w.K + kb * kBlock))
                   : _mm256_setzero_si256();
  }
  for (int i = 0; i < 8; ++i) {  // words of columns 2i, 2i + 1
    s[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    s[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  // s[2i + h]: columns 2i, 2i + 1 of pairs 4h..4h+3 (low lane) and 8 + 4h.. (high lane)
  for (int q = 0; q < 4; ++q)
    for (int h = 0; h < 2; ++h) {
      r[4 * q + 2 * h] = _mm256_unpacklo_epi32(s[4 * q + h], s[4 * q + 2 + h]);
      r[4 * q + 2 * h + 1] = _mm256_unpackhi_epi32(s[4 * q + h], s[4 * q + 2 + h]);
    }
  // r[4q + i]: columns 4q..4q+3 of pairs 2i, 2i + 1 (low lane) and 2i + 8, 2i + 9
  for (int q = 0; q < 2; ++q)
    for (int i = 0; i < 4; ++i) {
      s[8 * q + 2 * i] = _mm256_unpacklo_epi64(r[4 * q + i], r[4 * q + 8 + i]);
      s[8 * q + 2 * i + 1] = _mm256_unpackhi_epi64(r[4 * q + i], r[4 * q + 8 + i]);
    }
  // s[8q + p]: columns [4q..4q+3, 4q+8..4q+11] of pair p (low lane) and p + 8 (high)
  for (int p = 0; p < 8; ++p) {
    pairs[p] = _mm256_permute2x128_si256(s[p], s[8 + p], 0x20);
    pairs[p + 8] = _mm256_permute2x128_si256(s[p], s[8 + p], 0x31);
  }
}

// pack on AVX2: pack_generic's panel. A pairs16 W (the exported layout) from the runs as
// they lie: pair p = 2z + h of a group's block is 4 runs of 8 codes (columns 4l..4l+3, two k
// each) at 64z + 16l + 8h, each run the pair's 4 lanes in panel order, so the 64 bytes of z
// hold pairs 2z (even 8-byte words) and 2z + 1 (odd ones). A plain W by plain_pairs_avx2.
template <bool kPlain>
CSA_TARGET_AVX2 CSA_INLINE void pack_avx2_body(const PackJob& j) {
  const UnitsAvx2 k = units_tables_avx2();
  for (int64_t kbi = 0; kbi < j.kbs; ++kbi) {
    const int64_t kb = j.kb0 + kbi;
    for (int64_t c = 0; c < kGroups; ++c) {
      const int64_t grp = j.panel * kGroups + c;
      int16_t* dst = j.pw + (kbi * kPairs * kPanel + kLanes * c) * 2;
      float* g = j.g + kbi * kPanel + kLanes * c;
      if (grp >= j.w.groups) {
        pack_empty_group(dst, g);
        continue;
      }
      const __m256i tneg = group_tneg_avx2(j.w, kb, grp, g);
      if constexpr (kPlain) {
        __m256i pairs[kPairs];
        plain_pairs_avx2(j.w, grp, kb, pairs);
        for (int64_t p = 0; p < kPairs; ++p) store_pair_avx2(k, pairs[p], tneg, dst, p);
      } else {
        const uint8_t* run = j.w.w + Fp8::pairs16_offset(j.w.K, grp * kLanes, kb * kBlock);
        for (int64_t z = 0; z < kPairs / 2; ++z) {
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 64 * z));
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 64 * z + 32));
          store_pair_avx2(k, _mm256_unpacklo_epi64(a, b), tneg, dst, 2 * z);
          store_pair_avx2(k, _mm256_unpackhi_epi64(a, b), tneg, dst, 2 * z + 1);
        }
      }
    }
  }
}

// dot_groups_vbmi (and dot_groups_avx2) ask for each group's codes this far ahead in its run (four runs side by
// side: 8 KiB ahead in all). Measured (twenty 8192 x 5120 linears from DRAM, 2 threads, 8
// rounds, before the epilogue was fused): 16 KiB ahead (T1) 50.9 / 74.7 ms at 1 / 4 rows;
// 2 KiB 45.1 / 68.8 (T0), 45.5 / 64.9 (T1); 1 KiB (T0) 46.1 / 67.4; none 52.3 / 78.2.
constexpr int64_t kGroupPrefetchBytes = 2048;

// MR rows of X (decode, 1..4) against a pairs16 W on AVX2, the epilogue fused (the AVX2
// dot_groups_vbmi): per K block the panel's four groups side by side (four sequential streams
// of W), each group's pairs converted once (units_shifted_avx2, lanes over columns) and
// multiplied by vpmaddwd with each row's pair broadcast, the int32 lanes in registers (exact
// as the tiles': the same products, the flags keep the sums below 2^31); then per row the
// tiles' epilogue on those lanes, slots where masks say so (j.fill fills a block's slots and
// patches first, while its W is in cache). The pack and the tiles wrote and re-read every
// pair through a panel.
template <int MR>
CSA_TARGET_AVX2 __attribute__((noinline)) void dot_groups_avx2(const SmallJob& j, const TaskView& v) {
  const UnitsAvx2 k = units_tables_avx2();
  const int64_t g0 = j.panel * kGroups;
  const int64_t live = j.w.groups - g0 < kGroups ? j.w.groups - g0 : kGroups;  // N % 16 == 0
  for (int64_t kbi = 0; kbi < j.kbs; ++kbi) {
    if (j.need[kbi]) j.fill(j.fill_ctx, kbi);
    const int64_t kb = j.kb0 + kbi;
    const int16_t* x = j.xi + kb * kBlock;  // row m's block at x + m * K
    float cm[MR], sc[MR][2];
    for (int m = 0; m < MR; ++m) {
      const float xs = v.xs[kb * v.ld + m];
      cm[m] = v.cm[kb * v.ld + m];
      sc[m][0] = xs * v.ws0[kb];
      sc[m][1] = xs * v.ws1[kb];
    }
    for (int64_t c = 0; c < live; ++c) {  // groups past N: columns never stored
      const uint8_t* run = j.w.w + ((g0 + c) * j.w.KB + kb) * kPairs16Bytes;
      alignas(32) float g[kLanes];
      const __m256i tneg = group_tneg_avx2(j.w, kb, g0 + c, g);
      __m256i acc[MR][2];
      for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
      for (int z = 0; z < kPairs / 2; ++z) {
        _mm_prefetch(reinterpret_cast<const char*>(run + kGroupPrefetchBytes + 64 * z), _MM_HINT_T0);
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 64 * z));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 64 * z + 32));
        for (int h = 0; h < 2; ++h) {
          __m256i u[2];
          units_shifted_avx2(k, h ? _mm256_unpackhi_epi64(a, b) : _mm256_unpacklo_epi64(a, b), tneg, u);
          for (int m = 0; m < MR; ++m) {
            int32_t pair;  // row m's pair 2z + h
            std::memcpy(&pair, x + m * j.K + 4 * z + 2 * h, sizeof pair);
            const __m256i xv = _mm256_set1_epi32(pair);
            acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(xv, u[0]));
            acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(xv, u[1]));
          }
        }
      }
      const float* slot = v.slot[kbi * kGroups + c];
      for (int m = 0; m < MR; ++m) {
        const uint32_t mask = static_cast<uint32_t>(v.masks[kbi * v.rows + m] >> (kLanes * c)) & 0xFFFFu;
        for (int q = 0; q < 2; ++q)
          add_block_dots8<false>(acc[m][q], (mask >> (8 * q)) & 0xFFu, slot + m * kLanes + 8 * q,
                                 _mm256_load_ps(g + 8 * q), cm[m], sc[m][c / 2],
                                 v.out + m * kPanel + kLanes * c + 8 * q);
      }
    }
  }
}

CSA_TARGET_AVX2 CSA_INLINE void dot_fused_avx2_body(const SmallJob& j, const TaskView& v) {
  switch (j.rows) {
    case 1: dot_groups_avx2<1>(j, v); break;
    case 2: dot_groups_avx2<2>(j, v); break;
    case 3: dot_groups_avx2<3>(j, v); break;
    default: dot_groups_avx2<4>(j, v); break;
  }
}

// The pairs of a block's groups with flagged rows (their row patches read them) and their
// 2^t: the AVX2 pack of the block (all four groups; a pairs16 W, the one dot_groups_avx2 reads).
CSA_TARGET_AVX2 CSA_INLINE void flagged_pairs_avx2_body(const SmallJob& j) {
  pack_avx2_body<false>({j.w, j.panel, j.kb0, j.kbs, j.pw, j.g});
}

// -------------------------------------------------------------------- AVX-512 kernels
// hi * 2^8 + lo for 16 int32 lanes, in int64, each rounded once to float.
CSA_TARGET_AVX512 CSA_INLINE __m512 digits_to_float16(__m512i hi, __m512i lo) {
  const __m512i h0 = _mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(hi)), fp8_int::kDigitBits);
  const __m512i h1 = _mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(hi, 1)), fp8_int::kDigitBits);
  const __m512i s0 = _mm512_add_epi64(h0, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(lo)));
  const __m512i s1 = _mm512_add_epi64(h1, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(lo, 1)));
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtepi64_ps(s0)), _mm512_cvtepi64_ps(s1), 1);
}

// vpdpwssd through inline assembly: GCC 12 keeps the intrinsic's accumulators in memory
// (a store and a load around every instruction), which halves the tile's speed.
#define CSA_DP16(kVnni, acc, a, b)                                     \
  do {                                                                  \
    if (kVnni) {                                                        \
      asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));         \
    } else {                                                            \
      (acc) = _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)));     \
    }                                                                   \
  } while (0)

// The rows of a tile whose block kbi is not int16 (bit m of `wide`): the tile's sums `hi`
// are their high digit's (xi holds h = v >> 8, |h| < 2^10: exact in int32); here the low
// digit's (xlo, 0..255) against the same pairs, and hi * 2^8 + lo in int64, rounded once to
// float: row_patch's value, without its pass over the high digit and its first read of the
// row. The W lanes that are not int16 take their slot's value: the row's exact dot with
// them, written here (Patch's wide sums, while the row is in cache): products of units below
// 2^36, 32 of them, so every partial sum is an integer below 2^41 and exact in double. Out
// of line, so that the tile's pair loop keeps its registers.
template <int MR, bool kVnni>
CSA_TARGET_AVX512 __attribute__((noinline)) void wide_rows_avx512(const TaskView& v, int64_t r0,
                                                                  int64_t kbi, uint32_t wide,
                                                                  const __m512i (&hi)[MR][kGroups],
                                                                  float (&p)[MR][kGroups][kLanes]) {
  const int64_t kb = v.kb0 + kbi;
  const int16_t* pw = v.pw + kbi * kPairs * kPanel * 2;
  for (int m = 0; m < MR; ++m) {
    if (((wide >> m) & 1u) == 0) continue;
    alignas(64) int32_t lp[kPairs];  // the low digits as int16 pairs
    _mm512_store_si512(lp, _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                               reinterpret_cast<const __m256i*>(v.xlo + (r0 + m) * v.K + kb * kBlock))));
    __m512i lo[kGroups];
#pragma GCC unroll 4
    for (int c = 0; c < kGroups; ++c) lo[c] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int64_t q = 0; q < kPairs; ++q) {
      const __m512i xv = _mm512_set1_epi32(lp[q]);
#pragma GCC unroll 4
      for (int c = 0; c < kGroups; ++c)
        CSA_DP16(kVnni, lo[c], xv, _mm512_loadu_si512(pw + (q * kPanel + kLanes * c) * 2));
    }
#pragma GCC unroll 4
    for (int c = 0; c < kGroups; ++c) _mm512_store_ps(p[m][c], digits_to_float16(hi[m][c], lo[c]));
    uint64_t bad4;  // the block's lanes that are not int16, four groups
    std::memcpy(&bad4, v.bad + kbi * kGroups, sizeof bad4);
    if (bad4 == 0) continue;
    // the row's units >> t_x (h * 2^8 + l) as doubles
    const int16_t* x = v.xi + (r0 + m) * v.K + kb * kBlock;
    const uint8_t* xl = v.xlo + (r0 + m) * v.K + kb * kBlock;
    __m512d ux[4];
    for (int half = 0; half < 2; ++half) {
      const __m512i h = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * half)));
      const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xl + 16 * half)));
      const __m512i u = _mm512_add_epi32(_mm512_slli_epi32(h, fp8_int::kDigitBits), l);
      ux[2 * half] = _mm512_cvtepi32_pd(_mm512_castsi512_si256(u));
      ux[2 * half + 1] = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(u, 1));
    }
    for (int c = 0; c < kGroups; ++c) {
      float* slot = const_cast<float*>(v.slot[kbi * kGroups + c]) + (r0 + m) * kLanes;
      for (uint32_t bad = v.bad[kbi * kGroups + c]; bad != 0; bad &= bad - 1) {
        const int i = __builtin_ctz(bad);
        const int32_t* uw = v.wide_w + ((kbi * kGroups + c) * kLanes + i) * kBlock;
        __m512d sum = _mm512_setzero_pd();
        for (int q = 0; q < 4; ++q)
          sum = _mm512_fmadd_pd(ux[q], _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(uw + 8 * q))), sum);
        slot[i] = static_cast<float>(_mm512_reduce_add_pd(sum));
        ++*v.wide_sums;
      }
    }
  }
}

// tile_rows_avx512's epilogue of block kbi: per lane P = float(S) (kWide: the rows in `wide`
// take wide_rows_avx512's floats, wp [MR][kGroups][16]), or the slot's value where its mask
// says; out = out + d * (xs * ws) (kFold: as scales_fold allows).
template <int MR, bool kFold, bool kWide>
CSA_TARGET_AVX512 CSA_INLINE void tile_epilogue(const TaskView& v, int64_t r0, int64_t kbi,
                                               const __m512i (&acc)[MR][kGroups], uint32_t wide,
                                               const float* wp, __m512 (&out)[MR][kGroups]) {
  const int64_t kb = v.kb0 + kbi;
  const uint64_t* masks = v.masks + kbi * v.rows + r0;
  uint64_t any = 0;
  for (int m = 0; m < MR; ++m) any |= masks[m];
  const float ws[2] = {v.ws0[kb], v.ws1[kb]};
  float sc[MR][2];
  for (int m = 0; m < MR; ++m) {
    const float xs = v.xs[kb * v.ld + r0 + m];
    sc[m][0] = xs * ws[0];
    sc[m][1] = xs * ws[1];
    if (kFold) {
      const float cm = v.cm[kb * v.ld + r0 + m];
      sc[m][0] = sc[m][0] * cm;
      sc[m][1] = sc[m][1] * cm;
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    const int64_t r = r0 + m;
    const float* cm = v.cm + kb * v.ld + r;
#pragma GCC unroll 4
    for (int c = 0; c < kGroups; ++c) {
      __m512 p = kWide && ((wide >> m) & 1u) != 0 ? _mm512_load_ps(wp + (m * kGroups + c) * kLanes)
                                                  : _mm512_cvtepi32_ps(acc[m][c]);
      if (any != 0)  // every slot pointer is valid (a shared dummy under an all-zero mask)
        p = _mm512_mask_loadu_ps(p, static_cast<__mmask16>(masks[m] >> (16 * c)),
                                 v.slot[kbi * kGroups + c] + r * kLanes);
      p = _mm512_mul_ps(p, _mm512_loadu_ps(v.g + kbi * kPanel + kLanes * c));
      if (!kFold) p = _mm512_mul_ps(p, _mm512_set1_ps(*cm));
      p = _mm512_mul_ps(p, _mm512_set1_ps(sc[m][c / 2]));
      out[m][c] = _mm512_add_ps(out[m][c], p);
    }
  }
}

// MR rows (1..3) x 64 columns over the chunk's K blocks: per block 16 pairs of vpdpwssd
// into MR x 4 zmm, then the epilogue (slots by masked loads where a lane takes one) into
// outputs that stay in registers for the whole chunk: 12 accumulators and 12 outputs at
// MR = 3 (measured: 2-5% faster than 6 rows with the outputs in memory, 6-10% faster than 2
// rows). W's pairs are loaded by inline assembly: from intrinsics GCC 12 loads them again
// for later rows (8 loads a pair where 4 do; measured 10-19% slower). A row whose block is
// not int16 holds its high digit in xi: its sums here are exact, and wide_rows_avx512 adds
// its low digit's (where the task asks: v.wide_rows), so that act_quant leaves such rows
// unflagged. Measured against row patches (5120 x 512 / 1280, 1024 rows, 2 threads, call by
// call): 23.1 -> 21.6 ms on normal X, 30.9 -> 29.1 and 69.0 -> 63.4 ms on X with outlier
// features (bench_ops --fp8-x outliers: 7.5% of the blocks not int16).
template <int MR, bool kVnni, bool kFold>
CSA_TARGET_AVX512 __attribute__((noinline)) void tile_rows_avx512(const TaskView& v, int64_t r0) {
  __m512 out[MR][kGroups];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < kGroups; ++c) out[m][c] = _mm512_loadu_ps(v.out + (r0 + m) * kPanel + kLanes * c);
  for (int64_t kbi = 0; kbi < v.kbs; ++kbi) {
    const int64_t kb = v.kb0 + kbi;
    const int16_t* pw = v.pw + kbi * kPairs * kPanel * 2;
    const int16_t* x = v.xi + r0 * v.K + kb * kBlock;
    __m512i acc[MR][kGroups];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int c = 0; c < kGroups; ++c) acc[m][c] = _mm512_setzero_si512();
    // unrolled: in the loop GCC 12 kept some accumulators in other registers than the asm's
    // and copied them there and back every pair (27 zmm moves; 12 unrolled, outside the dp
    // chains): 1024 x 4096 x 4096, 1 thread, 248-292 -> 235-267 ms
#pragma GCC unroll 16
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512i w[kGroups];
#pragma GCC unroll 4
      for (int c = 0; c < kGroups; ++c)
        asm("vmovdqu64 %1, %0"
            : "=v"(w[c])
            : "m"(*reinterpret_cast<const __m512i*>(pw + (p * kPanel + kLanes * c) * 2)));
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * v.K + 2 * p, sizeof pair);
        const __m512i xv = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int c = 0; c < kGroups; ++c) CSA_DP16(kVnni, acc[m][c], xv, w[c]);
      }
    }
    // rows whose block is not int16: their low digit too (rare; row patches otherwise)
    uint32_t wide = 0;
    if (v.wide_rows != nullptr)
      for (int m = 0; m < MR; ++m) wide |= (v.fits[kb * v.ld + r0 + m] == 0 ? 1u : 0u) << m;
    if (__builtin_expect(wide != 0, 0)) {
      // the sums copied out by stores (handing `acc` itself to a call kept all of it in
      // memory, in the pair loop too)
      alignas(64) __m512i hi[MR][kGroups];
      alignas(64) float wp[MR][kGroups][kLanes];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
        for (int c = 0; c < kGroups; ++c) asm("vmovdqa64 %1, %0" : "=m"(hi[m][c]) : "v"(acc[m][c]));
      wide_rows_avx512<MR, kVnni>(v, r0, kbi, wide, hi, wp);
      *v.wide_rows += static_cast<uint64_t>(__builtin_popcount(wide));
      tile_epilogue<MR, kFold, true>(v, r0, kbi, acc, wide, &wp[0][0][0], out);
    } else {
      tile_epilogue<MR, kFold, false>(v, r0, kbi, acc, 0, nullptr, out);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < kGroups; ++c) _mm512_storeu_ps(v.out + (r0 + m) * kPanel + kLanes * c, out[m][c]);
}

template <bool kVnni, bool kFold>
CSA_TARGET_AVX512 CSA_INLINE void tiles_avx512_rows(const TaskView& v, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 3 <= r1; r += 3) tile_rows_avx512<3, kVnni, kFold>(v, r);
  if (r1 - r == 2) tile_rows_avx512<2, kVnni, kFold>(v, r);
  if (r1 - r == 1) tile_rows_avx512<1, kVnni, kFold>(v, r);
}

template <bool kVnni>
CSA_TARGET_AVX512 CSA_INLINE void tiles_avx512_body(const TaskView& v, int64_t r0, int64_t r1) {
  if (!v.fold) return tiles_avx512_rows<kVnni, false>(v, r0, r1);
  tiles_avx512_rows<kVnni, true>(v, r0, r1);
}

// Four uint32 into lanes 4i..4i+3 each.
CSA_TARGET_AVX512 CSA_INLINE __m512i spread4(__m512i spread, const uint32_t* v) {
  const __m128i four = _mm_load_si128(reinterpret_cast<const __m128i*>(v));
  return _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(four));
}

// flags_generic with 4 K blocks x 4 groups a zmm (lane 4i + c: block i, group c), any rows,
// used for one (decode at batch 1): the W figures are plain loads and a row's limits 4 values
// spread by one permute, where 16 rows a step (below) spent a step per block on one row.
CSA_TARGET_AVX512 CSA_INLINE void flags_by_blocks_avx512(const FlagJob& j) {
  static_assert(kGroups == 4, "4 groups x 4 blocks a zmm");
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t kbi = 0; kbi < j.kbs; kbi += 4) {
    const int64_t n = j.kbs - kbi < 4 ? j.kbs - kbi : 4;
    const __mmask16 in = static_cast<__mmask16>((1u << (4 * n)) - 1u);
    const __m512i a = _mm512_maskz_loadu_epi32(in, j.l1max + kbi * kGroups);
    const __m512i b = _mm512_maskz_loadu_epi32(in, j.absmax + kbi * kGroups);
    const __m512i c = _mm512_maskz_loadu_epi32(in, j.l2max + kbi * kGroups);
    const __m256i base = _mm256_maskz_loadu_epi16(in, j.bad + kbi * kGroups);
    for (int64_t r = 0; r < j.rows; ++r) {
      alignas(16) uint32_t p[4] = {}, q[4] = {}, s[4] = {};
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = (j.kb0 + kbi + i) * j.ld + r;
        p[i] = j.lim_l1[at];
        q[i] = j.lim_max[at];
        s[i] = j.lim_l2[at];
      }
      const __mmask16 k = in & _mm512_cmpgt_epu32_mask(a, spread4(spread, p)) &
                          _mm512_cmpgt_epu32_mask(b, spread4(spread, q)) &
                          _mm512_cmpgt_epu32_mask(c, spread4(spread, s));
      alignas(32) uint64_t m[4];  // block i's lanes: its bad ones, and 0xFFFF a flagged group
      _mm256_store_si256(reinterpret_cast<__m256i*>(m),
                         _mm256_or_si256(base, _mm256_movm_epi16(k)));
      for (int64_t i = 0; i < n; ++i) {
        j.flags[(kbi + i) * j.rows + r] = static_cast<uint8_t>((k >> (4 * i)) & 15u);
        j.masks[(kbi + i) * j.rows + r] = m[i];
      }
    }
  }
}

// flags_generic with 16 rows a step.
CSA_TARGET_AVX512 CSA_INLINE void flags_avx512_body(const FlagJob& j) {
  if (j.rows == 1) {  // whole calls: 1-5% faster at 1 row, 0-1% slower at 2, 2-6% at 4
    flags_by_blocks_avx512(j);
    return;
  }
  for (int64_t kbi = 0; kbi < j.kbs; ++kbi) {
    const uint32_t* l1 = j.lim_l1 + (j.kb0 + kbi) * j.ld;
    const uint32_t* mx = j.lim_max + (j.kb0 + kbi) * j.ld;
    const uint32_t* l2 = j.lim_l2 + (j.kb0 + kbi) * j.ld;
    __m512i a[kGroups], b[kGroups], n2[kGroups], lanes[kGroups];
    uint64_t base = 0;
    for (int64_t c = 0; c < kGroups; ++c) {
      a[c] = _mm512_set1_epi32(static_cast<int>(j.l1max[kbi * kGroups + c]));
      b[c] = _mm512_set1_epi32(static_cast<int>(j.absmax[kbi * kGroups + c]));
      n2[c] = _mm512_set1_epi32(static_cast<int>(j.l2max[kbi * kGroups + c]));
      lanes[c] = _mm512_set1_epi64(static_cast<long long>(uint64_t{0xFFFF} << (16 * c)));
      base |= uint64_t{j.bad[kbi * kGroups + c]} << (16 * c);
    }
    const __m512i base_v = _mm512_set1_epi64(static_cast<long long>(base));
    uint8_t* f = j.flags + kbi * j.rows;
    uint64_t* mk = j.masks + kbi * j.rows;
    for (int64_t r = 0; r < j.rows; r += kLanes) {
      const __mmask16 in = j.rows - r >= kLanes ? __mmask16{0xFFFF}
                                                 : static_cast<__mmask16>((1u << (j.rows - r)) - 1u);
      const __m512i p = _mm512_maskz_loadu_epi32(in, l1 + r), q = _mm512_maskz_loadu_epi32(in, mx + r);
      const __m512i s = _mm512_maskz_loadu_epi32(in, l2 + r);
      __m512i bits = _mm512_setzero_si512();
      __m512i m_lo = base_v, m_hi = base_v;
      for (int64_t c = 0; c < kGroups; ++c) {
        const __mmask16 k = _mm512_cmpgt_epu32_mask(a[c], p) & _mm512_cmpgt_epu32_mask(b[c], q) &
                            _mm512_cmpgt_epu32_mask(n2[c], s);
        bits = _mm512_mask_or_epi32(bits, k, bits, _mm512_set1_epi32(1 << c));
        m_lo = _mm512_mask_or_epi64(m_lo, static_cast<__mmask8>(k), m_lo, lanes[c]);
        m_hi = _mm512_mask_or_epi64(m_hi, static_cast<__mmask8>(k >> 8), m_hi, lanes[c]);
      }
      _mm_mask_storeu_epi8(f + r, in, _mm512_cvtepi32_epi8(bits));
      _mm512_mask_storeu_epi64(mk + r, static_cast<__mmask8>(in), m_lo);
      _mm512_mask_storeu_epi64(mk + r + 8, static_cast<__mmask8>(in >> 8), m_hi);
    }
  }
}


// w_digits_generic with vector operations: units = mantissa << E from the code's fields
// (e4m3fn: NaN codes 0), then >> t and the two digits, each digit's 32 int16 values (16 pairs)
// in one register, built there: two 256-bit stores read back as one zmm miss store forwarding
// (measured, one row: f_lanes 9.4% of a call's samples that way, 7.3% this way).
struct WDigits {
  __m512i hi, lo;
};

CSA_TARGET_AVX512 CSA_INLINE WDigits w_digits_avx512(const uint8_t* codes, uint32_t t) {
  const __m512i zero = _mm512_setzero_si512();
  __m256i h[2], l[2];
  for (int half = 0; half < 2; ++half) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * half)));
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(c, 3), _mm512_set1_epi32(15));
    __m512i mant = _mm512_and_si512(c, _mm512_set1_epi32(7));
    mant = _mm512_mask_or_epi32(mant, _mm512_test_epi32_mask(e, e), mant, _mm512_set1_epi32(8));
    const __m512i expo = _mm512_max_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), zero);
    __m512i u = _mm512_sllv_epi32(mant, expo);
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)),
                                                  _mm512_set1_epi32(0x7F));
    u = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~nan), u);
    u = _mm512_mask_sub_epi32(u, _mm512_test_epi32_mask(c, _mm512_set1_epi32(0x80)), zero, u);
    const __m512i v = _mm512_sra_epi32(u, _mm_cvtsi32_si128(static_cast<int>(t)));  // exact
    h[half] = _mm512_cvtepi32_epi16(_mm512_srai_epi32(v, fp8_int::kDigitBits));
    l[half] = _mm512_cvtepi32_epi16(_mm512_and_si512(v, _mm512_set1_epi32(255)));
  }
  return {_mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1),
          _mm512_inserti64x4(_mm512_castsi256_si512(l[0]), l[1], 1)};
}

// f_lanes with 16 rows per zmm: X^T pairs times the W block's digits broadcast.
// A few rows (decode): lanes over k instead (each row's block times the digits, summed
// across lanes), not a zmm of 16 rows with most lanes idle.
template <bool kVnni>
CSA_TARGET_AVX512 CSA_INLINE void f_lanes_avx512_body(const FJob& j) {
  const WDigits d = w_digits_avx512(j.codes, j.t);
  if (j.rows <= kSmallRows) {
    for (int64_t r = 0; r < j.rows; ++r) {
      const __m512i x = _mm512_loadu_si512(j.xi + r * j.K);
      __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
      CSA_DP16(kVnni, h, x, d.hi);
      CSA_DP16(kVnni, l, x, d.lo);
      j.f[r] = digits_to_float(_mm512_reduce_add_epi32(h), _mm512_reduce_add_epi32(l));
    }
    return;
  }
  alignas(64) int32_t wh[kPairs], wl[kPairs];  // one zmm store each, read back a pair at a time
  _mm512_store_si512(wh, d.hi);
  _mm512_store_si512(wl, d.lo);
  for (int64_t r = 0; r < j.rows; r += kLanes) {
    __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
    for (int64_t p = 0; p < kPairs; ++p) {
      const __m512i xv = _mm512_loadu_si512(j.xt + p * j.ldt + r);
      CSA_DP16(kVnni, h, xv, _mm512_set1_epi32(wh[p]));
      CSA_DP16(kVnni, l, xv, _mm512_set1_epi32(wl[p]));
    }
    _mm512_storeu_ps(j.f + r, digits_to_float16(h, l));
  }
}

template <bool kVnni>
CSA_TARGET_AVX512 CSA_INLINE void row_patch_avx512_body(const RowJob& j) {
  alignas(64) int32_t hp[kPairs], lp[kPairs];  // the digits as int16 pairs
  const __m512i x = _mm512_loadu_si512(j.x);
  if (j.fits) {
    _mm512_store_si512(hp, _mm512_srai_epi16(x, fp8_int::kDigitBits));
    _mm512_store_si512(lp, _mm512_and_si512(x, _mm512_set1_epi16((1 << fp8_int::kDigitBits) - 1)));
  } else {
    _mm512_store_si512(hp, x);
    _mm512_store_si512(lp, _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(j.xlo))));
  }
  for (int64_t c = 0; c < kGroups; ++c) {
    if (((j.groups >> c) & 1u) == 0) continue;
    const int16_t* pw = j.pw + c * kLanes * 2;
    __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
    for (int64_t p = 0; p < kPairs; ++p) {
      const __m512i w = _mm512_loadu_si512(pw + p * kPanel * 2);
      CSA_DP16(kVnni, h, _mm512_set1_epi32(hp[p]), w);
      CSA_DP16(kVnni, l, _mm512_set1_epi32(lp[p]), w);
    }
    _mm512_mask_storeu_ps(j.out[c], static_cast<__mmask16>(~j.bad[c]), digits_to_float16(h, l));
  }
}

// ---- W packing with AVX512-VBMI: 16 rows x 32 codes -> 16 pair vectors ----
// The 16 rows' 16-bit units (two codes each) are transposed in three rounds of vpermt2w
// (each swaps one register-index bit with one word-index bit), the last one placing the
// words so that vpunpck{l,h}bw yields pairs in column order; then per byte: a 128-entry
// table gives (|mantissa| << 3) (sign applied by a masked subtract) and another the
// exponent E, and vpsravw computes (mantissa << 11) >> (11 + t - E) = units >> t exactly
// (for an int16 block every code has E - t <= 11; zero codes give 0 at any count).
#define CSA_TARGET_AVX512_VBMI \
  __attribute__((target("arch=x86-64-v4,avx512vbmi,prefer-vector-width=512")))

struct PackTables {
  alignas(64) uint16_t round1[2][32], round2[2][32], round3[2][32];
  alignas(64) uint8_t mant[128], expo[128], lane_of_byte[64];
  PackTables() {
    for (int w = 0; w < 32; ++w) {
      const int b0 = w & 1, b1 = (w >> 1) & 1, b2 = (w >> 2) & 1, b3 = (w >> 3) & 1, b4 = w >> 4;
      for (int P = 0; P < 2; ++P) {
        round1[P][w] = static_cast<uint16_t>(b1 * 32 + ((w & ~2) | (P << 1)));
        round2[P][w] = static_cast<uint16_t>(b2 * 32 + ((w & ~4) | (P << 2)));
        // final word (r3 r2 p0 r1 r0) from the word (r0 p3 r2 r1 p0) of register r3
        round3[P][w] = static_cast<uint16_t>(b4 * 32 + (b0 << 4 | P << 3 | b3 << 2 | b1 << 1 | b2));
      }
    }
    for (int c = 0; c < 128; ++c) {
      const int e = c >> 3, m = c & 7;
      const bool nan = c == 0x7F;
      mant[c] = nan ? 0 : static_cast<uint8_t>((e == 0 ? m : 8 + m) << 3);
      expo[c] = nan ? 0 : static_cast<uint8_t>(e == 0 ? 0 : e - 1);
    }
    for (int b = 0; b < 64; ++b) {
      const int w = b >> 1;
      lane_of_byte[b] = static_cast<uint8_t>((((w >> 3) & 3) << 2) | (w & 3));
    }
  }
};
inline const PackTables kPackTables;

template <typename Sink>
CSA_TARGET_AVX512_VBMI CSA_INLINE void convert_pairs16(const uint8_t* src, __m128i t16, __mmask16 keep,
                                                      Sink& sink);

// Converts 16 columns of W over one K block (group n0 / 16, block kb) to int16 pairs: calls
// sink(p, v) for the 16 pairs p (v: 16 lanes of (w[2p], w[2p+1]) >> t; 0 in lanes past N or
// not int16), stores 2^t of the lanes at g, and returns false (no sink calls) when no lane
// is live.
struct GroupConverter {
  const PackTables& t = kPackTables;
  const WView& w;

  template <typename Sink>
  CSA_TARGET_AVX512_VBMI CSA_INLINE bool run(int64_t n0, int64_t kb, float* g, Sink&& sink) const {
    const __m512i zero = _mm512_setzero_si512();
    const int64_t grp = n0 / kLanes;
    __m128i t16 = _mm_setzero_si128();
    uint32_t live = 0, bad = 0;  // lanes that exist; lanes whose block is not int16
    if (grp < w.groups) {
      t16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.shift_at(kb, n0)));
      const int64_t count = w.N - n0 < kLanes ? w.N - n0 : kLanes;
      live = count == kLanes ? 0xFFFFu : (1u << count) - 1u;
      bad = w.bad_at(grp, kb);
    }
    _mm512_storeu_ps(g, _mm512_castsi512_ps(_mm512_add_epi32(
                            _mm512_slli_epi32(_mm512_cvtepu8_epi32(t16), 23), _mm512_set1_epi32(127 << 23))));
    const __mmask16 keep = static_cast<__mmask16>(live & ~bad);  // the others become 0
    if (keep == 0) return false;
    if (w.pairs16) {  // already k-pairs of the group's columns: converted, not transposed
      convert_pairs16(w.w + (grp * w.KB + kb) * kPairs16Bytes, t16, keep, sink);
      return true;
    }
    __m512i a[8], b[8];
    const uint8_t* src = w.w + n0 * w.K + kb * kBlock;
    if (live == 0xFFFFu) {
      for (int i = 0; i < 8; ++i) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (2 * i) * w.K));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (2 * i + 1) * w.K));
        a[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      if ((kb & 1) == 0) {  // the next group's rows (16 more rows at this block) into L2:
        for (int i = 0; i < kLanes; ++i)  // measured: twice the speed where W comes from DRAM
          _mm_prefetch(reinterpret_cast<const char*>(src + (kLanes + i) * w.K), _MM_HINT_T1);
      }
    } else {  // the last group: rows past N are never read
      for (int i = 0; i < 8; ++i) {
        __m256i row[2];
        for (int h = 0; h < 2; ++h) {
          const int64_t lane = 2 * i + h;
          const bool on = (live >> lane) & 1u;
          row[h] = _mm256_maskz_loadu_epi8(on ? ~__mmask32{0} : __mmask32{0}, on ? src + lane * w.K : w.w);
        }
        a[i] = _mm512_inserti64x4(_mm512_castsi256_si512(row[0]), row[1], 1);
      }
    }
    for (int i = 0; i < 8; ++i)
      b[i] = _mm512_permutex2var_epi16(a[i & ~1], _mm512_load_si512(t.round1[i & 1]), a[i | 1]);
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_permutex2var_epi16(b[i & ~2], _mm512_load_si512(t.round2[(i >> 1) & 1]), b[i | 2]);
    for (int i = 0; i < 8; ++i)
      b[i] = _mm512_permutex2var_epi16(a[i & 3], _mm512_load_si512(t.round3[i >> 2]), a[(i & 3) | 4]);
    const __m512i base = _mm512_add_epi8(
        _mm512_permutexvar_epi8(_mm512_load_si512(t.lane_of_byte), _mm512_castsi128_si512(t16)),
        _mm512_set1_epi8(11));
    const __m512i low4 = _mm512_set1_epi16(15), high8 = _mm512_set1_epi16(static_cast<int16_t>(0xFF00));
    for (int i = 0; i < 8; ++i) {
      const __m512i codes = b[i];
      __m512i m = _mm512_permutex2var_epi8(_mm512_load_si512(t.mant), codes, _mm512_load_si512(t.mant + 64));
      m = _mm512_mask_sub_epi8(m, _mm512_movepi8_mask(codes), zero, m);
      const __m512i count = _mm512_sub_epi8(
          base, _mm512_permutex2var_epi8(_mm512_load_si512(t.expo), codes, _mm512_load_si512(t.expo + 64)));
      // words (m << 8) | count: two unpacks, not four (shuffles are what this loop waits on).
      // A nonzero code's count is at most 14 (its units are at least 2^t: E + 4 > t); a zero
      // code's may be larger, but its m is 0
      const __m512i w0 = _mm512_unpacklo_epi8(count, m), w1 = _mm512_unpackhi_epi8(count, m);
      __m512i v0 = _mm512_srav_epi16(_mm512_and_si512(w0, high8), _mm512_and_si512(w0, low4));
      __m512i v1 = _mm512_srav_epi16(_mm512_and_si512(w1, high8), _mm512_and_si512(w1, low4));
      if (keep != 0xFFFF) {
        v0 = _mm512_maskz_mov_epi32(keep, v0);
        v1 = _mm512_maskz_mov_epi32(keep, v1);
      }
      sink(2 * i, v0);
      sink(2 * i + 1, v1);
    }
    return true;
  }
};

// Sinks of GroupConverter (structs: lambdas would not carry the target attribute).
struct StorePairs {
  int16_t* out;  // pair p at out + p * kPanel * 2
  CSA_TARGET_AVX512 CSA_INLINE void operator()(int p, __m512i v) const {
    _mm512_storeu_si512(out + p * kPanel * 2, v);
  }
};

CSA_TARGET_AVX512_VBMI CSA_INLINE void pack_vbmi_body(const PackJob& j) {
  const GroupConverter conv{kPackTables, j.w};
  for (int64_t c = 0; c < kGroups; ++c) {  // a group's rows through the chunk, then the next
    for (int64_t kbi = 0; kbi < j.kbs; ++kbi) {
      int16_t* out = j.pw + kbi * kPairs * kPanel * 2 + c * kLanes * 2;
      const bool any = conv.run(j.panel * kPanel + c * kLanes, j.kb0 + kbi, j.g + kbi * kPanel + c * kLanes,
                                StorePairs{out});
      if (!any)
        for (int64_t p = 0; p < kPairs; ++p) _mm512_storeu_si512(out + p * kPanel * 2, _mm512_setzero_si512());
    }
  }
}

// tsum's row stride: not a power of two (the transposes' loads would share cache sets)
constexpr int64_t kTsumLd = kMaxChunkKb + 16;
constexpr int64_t kXpRow = kMaxChunkKb * kBlock;  // xp's row: a chunk of X by quads

// A 16 x 16 int32 transpose in registers.
CSA_TARGET_AVX512 CSA_INLINE void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] holds rows 4a..4a+3, column b + 4 * lane128 in its 128-bit lanes
  for (int b = 0; b < 4; ++b) {
    for (int a = 0; a < 4; a += 2) {
      t[4 * a + b] = _mm512_shuffle_i32x4(r[4 * a + b], r[4 * (a + 1) + b], 0x88);
      t[4 * (a + 1) + b] = _mm512_shuffle_i32x4(r[4 * a + b], r[4 * (a + 1) + b], 0xDD);
    }
  }
  for (int b = 0; b < 4; ++b) {
    for (int a = 0; a < 2; ++a) {
      r[b + 4 * a] = _mm512_shuffle_i32x4(t[4 * a + b], t[4 * (a + 2) + b], 0x88);
      r[b + 4 * a + 8] = _mm512_shuffle_i32x4(t[4 * a + b], t[4 * (a + 2) + b], 0xDD);
    }
  }
}

// dot_rows_vbmi's tables.
struct RowTables {
  alignas(64) uint8_t expo[128];         // E of a nonzero code, 255 for zero (and NaN) codes
  alignas(64) uint8_t quad_base[4][64];  // vpermb index: quad u's 128-bit lane b takes block 4u + b
  alignas(64) int16_t quad_words[4][32]; // vpermw index: the same for a slice's 16 words
  alignas(64) int32_t natural[16];       // the tree's lane of block q
  alignas(64) uint8_t pairs16_column[64];  // pairs16: the column (in its group) of a zmm's byte b
  RowTables() {
    for (int b = 0; b < 64; ++b) pairs16_column[b] = static_cast<uint8_t>(4 * (b / 16) + (b % 8) / 2);
    for (int c = 0; c < 128; ++c) {
      const int e = c >> 3;
      expo[c] = (c == 0 || c == 0x7F) ? 255 : static_cast<uint8_t>(e == 0 ? 0 : e - 1);
    }
    for (int u = 0; u < 4; ++u) {
      for (int b = 0; b < 64; ++b) quad_base[u][b] = static_cast<uint8_t>(4 * u + b / 16);
      for (int w = 0; w < 32; ++w) quad_words[u][w] = static_cast<int16_t>(4 * u + w / 8);
    }
    // the tree leaves block q = 4u + b (quad u, 128-bit lane b) in lane 4b + u
    for (int q = 0; q < 16; ++q) natural[q] = 4 * (q % 4) + q / 4;
  }
};
inline const RowTables kRowTables;

// AVX512-FP16 and GFNI instructions by inline assembly, so that the kernels using them keep
// the VBMI target and run only where the CPU has both (cpu_has_avx512fp16_gfni decides).
CSA_TARGET_AVX512 CSA_INLINE __m512i fp16_scalef(__m512i a, __m512i b) {
  __m512i r;
  asm("vscalefph %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
  return r;
}
CSA_TARGET_AVX512 CSA_INLINE __m512i fp16_to_int16(__m512i a) {
  __m512i r;
  asm("vcvtph2w %1, %0" : "=v"(r) : "v"(a));
  return r;
}
CSA_TARGET_AVX512 CSA_INLINE __m512i int16_to_fp16(__m512i a) {
  __m512i r;
  asm("vcvtw2ph %1, %0" : "=v"(r) : "v"(a));
  return r;
}
// GFNI's affine byte transform (each byte x -> the bits matrix . x, per 64-bit lane).
template <uint64_t kMatrix>
CSA_TARGET_AVX512 CSA_INLINE __m512i gf2_affine(__m512i x) {
  __m512i r;
  asm("vgf2p8affineqb $0, %2, %1, %0" : "=v"(r) : "v"(x), "v"(_mm512_set1_epi64(static_cast<int64_t>(kMatrix))));
  return r;
}
// Output bit i of a byte takes the input bits of the matrix's byte 7 - i: the half float's
// high byte s 0 e3 e2 e1 e0 m2 m1 and low byte m0 0000000 of an e4m3 code s e3..e0 m2 m1 m0.
constexpr uint64_t kHalfHighByte = 0x0204081020400080ull, kHalfLowByte = 0x0000000000000001ull;

// The two conversions of a zmm of codes c (128-bit lane b: 16 codes of one block whose
// shift is t) to int16 units >> t, words 0-7 of each lane (lo) or 8-15 (hi), in the order
// vpunpck{l,h}bw gives:
// - VBMI (tables): bytes m = |mantissa| << 3 with the sign, count = (11 + t) - E saturated at
//   0 (E is 255 for zero codes), then words w = (m << 8) | count with count <= 14
//   (GroupConverter), and w >> (w & 15) = units >> t exactly: (m << 8) is a multiple of
//   2^count where units >> t is an integer, and count < 2^count adds nothing.
// - FP16 (arithmetic): the code's bits moved into a half float, s 0 eeee mmm 0000000 (its
//   two bytes made by GFNI bit transforms, then interleaved), is the code's value times
//   2^-8 for normal and subnormal codes alike; vscalefph by 17 - t makes it units >> t (an
//   integer below 2^15 in an int16 block: exact) and vcvtph2w the int16: 11 instructions
//   per 64 codes against the tables' ~17 (no vpermt2b). A NaN code gives a finite value and lanes
//   that are not int16 give any value: their columns are set to NaN, their sums taken from
//   slots.
// `scale` is a quad's per-lane figure: the bytes 11 + t (VBMI) or the half floats 17 - t.
struct QuadConstants {
  __m512i zero, low4, mant_lo, mant_hi, expo_lo, expo_hi;
};

template <bool kFp16>
CSA_TARGET_AVX512_VBMI CSA_INLINE void convert_codes(const QuadConstants& k, __m512i codes, __m512i scale,
                                                    __m512i& lo, __m512i& hi) {
  if constexpr (kFp16) {
    const __m512i hb = gf2_affine<kHalfHighByte>(codes), lb = gf2_affine<kHalfLowByte>(codes);
    const __m512i w0 = _mm512_unpacklo_epi8(lb, hb), w1 = _mm512_unpackhi_epi8(lb, hb);
    lo = fp16_to_int16(fp16_scalef(w0, scale));
    hi = fp16_to_int16(fp16_scalef(w1, scale));
  } else {
    __m512i mv = _mm512_permutex2var_epi8(k.mant_lo, codes, k.mant_hi);
    mv = _mm512_mask_sub_epi8(mv, _mm512_movepi8_mask(codes), k.zero, mv);
    const __m512i count = _mm512_subs_epu8(scale, _mm512_permutex2var_epi8(k.expo_lo, codes, k.expo_hi));
    const __m512i w0 = _mm512_unpacklo_epi8(count, mv), w1 = _mm512_unpackhi_epi8(count, mv);
    lo = _mm512_srav_epi16(w0, _mm512_and_si512(w0, k.low4));
    hi = _mm512_srav_epi16(w1, _mm512_and_si512(w1, k.low4));
  }
}

CSA_TARGET_AVX512_VBMI CSA_INLINE QuadConstants quad_constants() {
  const PackTables& pt = kPackTables;
  const RowTables& rt = kRowTables;
  return {_mm512_setzero_si512(),          _mm512_set1_epi16(15),
          _mm512_load_si512(pt.mant),      _mm512_load_si512(pt.mant + 64),
          _mm512_load_si512(rt.expo),      _mm512_load_si512(rt.expo + 64)};
}

// convert_codes' figure for a pairs16 zmm of group codes whose 16 columns' shifts are t16:
// the half floats 17 - t of each word's column (a column's pair is one dword), or the
// bytes 11 + t of each byte's column (tables).
template <bool kFp16>
CSA_TARGET_AVX512_VBMI CSA_INLINE __m512i pairs16_figure(__m128i t16) {
  if constexpr (kFp16) {
    const __m512i t32 = _mm512_cvtepu8_epi32(t16);
    return int16_to_fp16(
        _mm512_sub_epi16(_mm512_set1_epi16(17), _mm512_or_si512(t32, _mm512_slli_epi32(t32, 16))));
  } else {
    return _mm512_add_epi8(_mm512_permutexvar_epi8(_mm512_load_si512(kRowTables.pairs16_column),
                                                   _mm512_castsi128_si512(t16)),
                           _mm512_set1_epi8(11));
  }
}

// GroupConverter on a pairs16 W: zmm z of the group's block gives pairs 2z and 2z + 1
// (lanes not in keep: 0).
template <typename Sink>
CSA_TARGET_AVX512_VBMI CSA_INLINE void convert_pairs16(const uint8_t* src, __m128i t16, __mmask16 keep,
                                                      Sink& sink) {
  const QuadConstants k = quad_constants();
  const __m512i figure = pairs16_figure<false>(t16);
  for (int z = 0; z < 8; ++z) {
    __m512i v0, v1;
    convert_codes<false>(k, _mm512_loadu_si512(src + 64 * z), figure, v0, v1);
    sink(2 * z, _mm512_maskz_mov_epi32(keep, v0));
    sink(2 * z + 1, _mm512_maskz_mov_epi32(keep, v1));
  }
}

// One quad (four K blocks, 128 codes: ca holds blocks 0 and 1, cb blocks 2 and 3), converted
// once and multiplied with each row's four blocks (x: row 0's, rows kXpRow apart): lane
// 4b + i of acc[m] is part of row m's block b.
template <int MR, bool kVnni, bool kFp16>
CSA_TARGET_AVX512_VBMI CSA_INLINE void dot_quad(const QuadConstants& k, __m512i ca, __m512i cb, __m512i scale,
                                               const int16_t* x, __m512i (&acc)[MR]) {
  // lane b of v[2h + i]: words 8i..8i+7 of codes 16h..16h+15 of block b
  __m512i v[4];  // two calls, not a loop: the shuffle's immediate must be a constant at any -O
  convert_codes<kFp16>(k, _mm512_shuffle_i64x2(ca, cb, 0x88), scale, v[0], v[1]);
  convert_codes<kFp16>(k, _mm512_shuffle_i64x2(ca, cb, 0xDD), scale, v[2], v[3]);
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {  // each row of X against the same converted codes
    const int16_t* xm = x + m * kXpRow;
    __m512i a = _mm512_madd_epi16(v[0], _mm512_loadu_si512(xm));
    CSA_DP16(kVnni, a, v[1], _mm512_loadu_si512(xm + 32));
    CSA_DP16(kVnni, a, v[2], _mm512_loadu_si512(xm + 64));
    CSA_DP16(kVnni, a, v[3], _mm512_loadu_si512(xm + 96));
    acc[m] = a;
  }
}

// A slice's 16 blocks' figure for convert_codes (t_row: their shifts; past the chunk any
// value: their codes are zero), and quad u's lanes of it.
template <bool kFp16>
CSA_TARGET_AVX512_VBMI CSA_INLINE __m512i slice_figure(const uint8_t* t_row) {
  const __m128i t16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t_row));
  if constexpr (kFp16)
    return int16_to_fp16(_mm512_sub_epi16(_mm512_set1_epi16(17), _mm512_cvtepu8_epi16(_mm256_castsi128_si256(t16))));
  else
    return _mm512_castsi128_si512(_mm_add_epi8(t16, _mm_set1_epi8(11)));
}
template <bool kFp16>
CSA_TARGET_AVX512_VBMI CSA_INLINE __m512i quad_scale(const RowTables& rt, __m512i figure, int u) {
  if constexpr (kFp16)
    return _mm512_permutexvar_epi16(_mm512_load_si512(rt.quad_words[u]), figure);
  else
    return _mm512_permutexvar_epi8(_mm512_load_si512(rt.quad_base[u]), figure);
}

// A slice's block sums of MR rows from the four quads' accumulators: lane 4b + i of
// acc[u][m] is part of block 4u + b; three levels leave block 4u + b in lane 4b + u, and
// vpermd puts it in lane 4u + b. Row m's 16 sums go to ts + m * kLanes * kTsumLd.
template <int MR>
CSA_TARGET_AVX512_VBMI CSA_INLINE void store_slice_sums(__m512i (&acc)[4][MR], __m512i natural, int32_t* ts) {
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    const __m512i r01 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[0][m], acc[1][m]),
                                         _mm512_unpackhi_epi32(acc[0][m], acc[1][m]));
    const __m512i r23 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2][m], acc[3][m]),
                                         _mm512_unpackhi_epi32(acc[2][m], acc[3][m]));
    const __m512i sums = _mm512_add_epi32(_mm512_unpacklo_epi64(r01, r23), _mm512_unpackhi_epi64(r01, r23));
    _mm512_storeu_si512(ts + m * kLanes * kTsumLd, _mm512_permutexvar_epi32(natural, sums));
  }
}

// Slice s (blocks 16s..16s+15 of the chunk) of one column: its row of codes, its shifts
// t_row, X by quads xp; the MR rows' 16 block sums to ts (+ m * kLanes * kTsumLd) + 16s.
template <int MR, bool kVnni, bool kFp16>
CSA_TARGET_AVX512_VBMI CSA_INLINE void dot_slice(const QuadConstants& k, __m512i natural, const uint8_t* row,
                                                const uint8_t* t_row, const int16_t* xp, int64_t s, int64_t kbs,
                                                int32_t* ts) {
  const RowTables& rt = kRowTables;
  const __m512i figure = slice_figure<kFp16>(t_row + 16 * s);
  __m512i acc[4][MR];
  if (16 * s + 16 <= kbs) {  // a whole slice: plain loads, no branches
    const uint8_t* src = row + 16 * kBlock * s;
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + 128 * u), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + 128 * u + 64), _MM_HINT_T1);
      dot_quad<MR, kVnni, kFp16>(k, _mm512_loadu_si512(src + 128 * u), _mm512_loadu_si512(src + 128 * u + 64),
                                 quad_scale<kFp16>(rt, figure, u), xp + 16 * kBlock * s + 128 * u, acc[u]);
    }
  } else {  // the chunk's last, partial slice: whole quads and a partial one by masks
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const int64_t b0 = 16 * s + 4 * u;  // the quad's first block in the chunk
      if (b0 >= kbs) {
        for (int m = 0; m < MR; ++m) acc[u][m] = k.zero;
        continue;
      }
      const int64_t nb = kbs - b0;  // blocks past the chunk: zero codes and X, zero sums
      const __mmask64 first = nb >= 2 ? ~__mmask64{0} : __mmask64{0xFFFFFFFFu};
      const __mmask64 second = nb >= 4 ? ~__mmask64{0} : nb == 3 ? __mmask64{0xFFFFFFFFu} : __mmask64{0};
      const __m512i ca = _mm512_maskz_loadu_epi8(first, row + kBlock * b0);
      const __m512i cb = _mm512_maskz_loadu_epi8(second, nb >= 3 ? row + kBlock * b0 + 64 : row);
      dot_quad<MR, kVnni, kFp16>(k, ca, cb, quad_scale<kFp16>(rt, figure, u), xp + kBlock * b0, acc[u]);
    }
  }
  store_slice_sums<MR>(acc, natural, ts + 16 * s);
}

// The pairs of the groups a flagged row needs (row_patch reads them).
CSA_TARGET_AVX512_VBMI CSA_INLINE void store_flagged_pairs(const SmallJob& j) {
  const GroupConverter conv{kPackTables, j.w};
  for (int64_t kbi = 0; kbi < j.kbs; ++kbi) {
    for (int64_t c = 0; c < kGroups; ++c) {
      if (((j.flagged[kbi] >> c) & 1u) == 0) continue;
      int16_t* out = j.pw + (kbi * kPairs * kPanel + c * kLanes) * 2;
      if (!conv.run(j.panel * kPanel + c * kLanes, j.kb0 + kbi, j.g + kbi * kPanel + c * kLanes, StorePairs{out}))
        for (int64_t p = 0; p < kPairs; ++p) _mm512_storeu_si512(out + p * kPanel * 2, _mm512_setzero_si512());
    }
  }
}

// MR rows of X (decode, 1..4), lanes over k: each W row's codes are read in order (kStreams
// rows side by side, a slice of 16 blocks of each in turn), four K blocks (a "quad", 128
// codes) at a time, converted once to int16 units >> t (convert_codes: no transpose), and
// multiplied with each row's blocks by vpdpwssd (measured in a harness against the former
// 16-column path for 2..4 rows, which transposed W's codes: 1.35-2.1x faster, the same sums).
// The quad's two zmm of codes are regrouped by 128-bit lanes (vshufi64x2) so that lane b of
// each holds 16 codes of block 4u + b: then each int32 lane gathers 8 products of one block,
// a block's sum is 4 lanes, and a tree of three add levels over a slice's four quads (16
// blocks) makes one zmm of 16 block sums (exact: any order of an int32 sum whose |terms| add
// up below 2^31, which the flags decide as for the tiles). The unpacks take words 0-7 of
// each 128-bit lane first, 8-15 second, so X's blocks are stored in that order (xp: per
// quad, four zmm whose lane b holds words 8c..8c+7 of block 4u + b). Lanes past N are 0.
// The panel goes a group of 16 columns at a time: the group's block sums (tsum, 16 columns
// of the chunk) are transposed to lanes over columns for the epilogue while still in L1
// (after all 64 columns they came back from L2: 10% of the kernel's time, measured).
template <int MR, bool kVnni, bool kFp16>
CSA_TARGET_AVX512_VBMI __attribute__((noinline)) void dot_rows_vbmi(const SmallJob& j) {
  const RowTables& rt = kRowTables;
  const int64_t kbs = j.kbs;
  // X's chunk by quads, zero past the last block: a 4 x 4 transpose of 128-bit lanes
  const int64_t quads = (kbs + 3) / 4;
  for (int m = 0; m < MR; ++m) {
    for (int64_t q = 0; q < quads; ++q) {
      __m512i z[4];
      for (int b = 0; b < 4; ++b) {
        const bool on = 4 * q + b < kbs;
        z[b] = _mm512_maskz_loadu_epi16(on ? ~__mmask32{0} : __mmask32{0},
                                        on ? j.xi + m * j.K + (j.kb0 + 4 * q + b) * kBlock : j.xi);
      }
      const __m512i lo01 = _mm512_shuffle_i64x2(z[0], z[1], 0x44), hi01 = _mm512_shuffle_i64x2(z[0], z[1], 0xEE);
      const __m512i lo23 = _mm512_shuffle_i64x2(z[2], z[3], 0x44), hi23 = _mm512_shuffle_i64x2(z[2], z[3], 0xEE);
      int16_t* dst = j.xp + m * kXpRow + 4 * kBlock * q;
      _mm512_storeu_si512(dst, _mm512_shuffle_i64x2(lo01, lo23, 0x88));
      _mm512_storeu_si512(dst + 32, _mm512_shuffle_i64x2(lo01, lo23, 0xDD));
      _mm512_storeu_si512(dst + 64, _mm512_shuffle_i64x2(hi01, hi23, 0x88));
      _mm512_storeu_si512(dst + 96, _mm512_shuffle_i64x2(hi01, hi23, 0xDD));
    }
  }
  const QuadConstants k = quad_constants();
  const __m512i natural = _mm512_load_si512(rt.natural);
  const int64_t n_end = j.w.N - j.panel * kPanel < kPanel ? j.w.N - j.panel * kPanel : kPanel;
  for (int64_t c = 0; c < kGroups; ++c) {
    // kStreams columns side by side, a slice of each in turn: as many sequential streams of
    // W for the prefetchers
    for (int64_t l0 = 0; l0 < kLanes; l0 += kStreams) {
      for (int64_t s = 0; 16 * s < kbs; ++s) {
        for (int64_t l = l0; l < l0 + kStreams; ++l) {
          const int64_t col = c * kLanes + l;
          if (col >= n_end) continue;
          const int64_t n = j.panel * kPanel + col;
          const uint8_t* row = j.w.w + n * j.w.K + j.kb0 * kBlock;
          const uint8_t* t_row = j.w.shift_rows + n * (j.w.KB + kLanes) + j.kb0;  // padded by 16
          dot_slice<MR, kVnni, kFp16>(k, natural, row, t_row, j.xp, s, kbs, j.tsum + l * kTsumLd);
        }
      }
    }
    for (int64_t l = 0; l < kLanes; ++l)  // columns past N: zero sums
      if (c * kLanes + l >= n_end)
        for (int m = 0; m < MR; ++m) std::memset(j.tsum + (m * kLanes + l) * kTsumLd, 0, sizeof(int32_t) * kTsumLd);
    // the group's sums per block with lanes over columns: 16 x 16 tiles of tsum (columns x
    // blocks) transposed
    for (int m = 0; m < MR; ++m) {
      for (int64_t s = 0; s * 16 < kbs; ++s) {
        __m512i t[16];
        const int32_t* src = j.tsum + m * kLanes * kTsumLd + 16 * s;
        for (int i = 0; i < 16; ++i) t[i] = _mm512_loadu_si512(src + i * kTsumLd);
        transpose16(t);
        const int64_t nq = kbs - 16 * s < 16 ? kbs - 16 * s : 16;
        for (int64_t q = 0; q < nq; ++q)
          _mm512_storeu_si512(j.sums + (((16 * s + q) * kGroups + c) * j.rows + m) * kLanes, t[q]);
      }
    }
  }
  store_flagged_pairs(j);
}

// The few-rows epilogue's step for 16 columns of one row and K block (epilogue_small_body,
// dot_groups_vbmi): acc + (P * 2^(t_w + t_x - 18)) * (xs * ws), P the block dots (sums or
// slots), tw the columns' t_w, ex = t_x - 18 (the exponent of cm, a normal float).
CSA_TARGET_AVX512 CSA_INLINE __m512 add_block_dot(__m512 acc, __m512 p, __m512i tw, int32_t ex, __m512 sc) {
  const __m512 e = _mm512_cvtepi32_ps(_mm512_add_epi32(tw, _mm512_set1_epi32(ex)));
  return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_scalef_ps(p, e), sc));
}
CSA_TARGET_AVX512 CSA_INLINE int32_t cm_exponent(float cm) {
  return static_cast<int32_t>(Fp8::bits_of(cm) >> 23) - 127;
}


// MR rows of X (decode, 1..4) against a pairs16 W, lanes over columns, the epilogue fused:
// per K block, the panel's four groups side by side (four sequential streams of W for the
// prefetchers), each group's 512 codes converted once (convert_codes; zmm z gives k-pairs 2z
// and 2z + 1 of its 16 columns, as words in column order) and multiplied by vpdpwssd with
// each row's pair broadcast: lane i of a sum is column i's block dot, with no transpose and
// no add tree (exact as dot_rows_vbmi's: the int32 lanes add the same products, modulo 2^32,
// and the flags keep the true sums below 2^31). Then at once, per row, epilogue_small_body's
// arithmetic on those lanes (each output takes the blocks in order, as there), the slots
// where masks say so: a block that needs slots has them filled first (j.fill), while its W
// is in cache. Measured in a harness (8192 x 5120, W in L3, 1 thread, the sums only): 24-25
// Gcodes/s at one row, 16 at four, against 18-19 and 8.7 for dot_rows_vbmi.
template <int MR, bool kVnni, bool kFp16>
CSA_TARGET_AVX512_VBMI __attribute__((noinline)) void dot_groups_vbmi(const SmallJob& j, const TaskView& v) {
  const QuadConstants k = quad_constants();
  const int64_t g0 = j.panel * kGroups;
  const int64_t live = j.w.groups - g0 < kGroups ? j.w.groups - g0 : kGroups;  // N % 16 == 0
  for (int64_t kbi = 0; kbi < j.kbs; ++kbi) {
    if (j.need[kbi]) j.fill(j.fill_ctx, kbi);
    const int64_t kb = j.kb0 + kbi;
    const int16_t* x = j.xi + kb * kBlock;  // row m's block at x + m * K
    // the rows' block figures: t_x - 18 (the exponent of cm = 2^(t_x - 18), a normal
    // float) and xs * ws of each 32-column half
    int32_t ex[MR];
    float sc[MR][2];
    for (int m = 0; m < MR; ++m) {
      const float xs = v.xs[kb * v.ld + m];
      ex[m] = cm_exponent(v.cm[kb * v.ld + m]);
      sc[m][0] = xs * v.ws0[kb];
      sc[m][1] = xs * v.ws1[kb];
    }
    for (int64_t c = 0; c < live; ++c) {  // groups past N: columns never stored
      const uint8_t* src = j.w.w + ((g0 + c) * j.w.KB + kb) * kPairs16Bytes;
      const __m128i t16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(j.w.shift_at(kb, (g0 + c) * kLanes)));
      const __m512i figure = pairs16_figure<kFp16>(t16);
      __m512i acc[MR][2];
      for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = k.zero;
#pragma GCC unroll 8
      for (int z = 0; z < 8; ++z) {
        _mm_prefetch(reinterpret_cast<const char*>(src + kGroupPrefetchBytes + 64 * z), _MM_HINT_T0);
        __m512i p0, p1;
        convert_codes<kFp16>(k, _mm512_loadu_si512(src + 64 * z), figure, p0, p1);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          int32_t x0, x1;  // row m's pairs 2z and 2z + 1
          std::memcpy(&x0, x + m * j.K + 4 * z, sizeof x0);
          std::memcpy(&x1, x + m * j.K + 4 * z + 2, sizeof x1);
          CSA_DP16(kVnni, acc[m][0], p0, _mm512_set1_epi32(x0));
          CSA_DP16(kVnni, acc[m][1], p1, _mm512_set1_epi32(x1));
        }
      }
      const __m512i tw = _mm512_cvtepu8_epi32(t16);
      const float* slot = v.slot[kbi * kGroups + c];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[m][0], acc[m][1]));
        const __m512 p = _mm512_mask_loadu_ps(s, static_cast<__mmask16>(v.masks[kbi * v.rows + m] >> (16 * c)),
                                              slot + m * kLanes);
        float* o = v.out + m * kPanel + kLanes * c;
        _mm512_storeu_ps(o, add_block_dot(_mm512_loadu_ps(o), p, tw, ex[m], _mm512_set1_ps(sc[m][c / 2])));
      }
    }
  }
}

template <bool kVnni, bool kFp16>
CSA_TARGET_AVX512_VBMI CSA_INLINE void dot_fused_body(const SmallJob& j, const TaskView& v) {
  switch (j.rows) {
    case 1: dot_groups_vbmi<1, kVnni, kFp16>(j, v); break;
    case 2: dot_groups_vbmi<2, kVnni, kFp16>(j, v); break;
    case 3: dot_groups_vbmi<3, kVnni, kFp16>(j, v); break;
    default: dot_groups_vbmi<4, kVnni, kFp16>(j, v); break;
  }
}

template <bool kVnni, bool kFp16>
CSA_TARGET_AVX512_VBMI CSA_INLINE void dot_small_body(const SmallJob& j) {
  switch (j.rows) {
    case 1: dot_rows_vbmi<1, kVnni, kFp16>(j); break;
    case 2: dot_rows_vbmi<2, kVnni, kFp16>(j); break;
    case 3: dot_rows_vbmi<3, kVnni, kFp16>(j); break;
    default: dot_rows_vbmi<4, kVnni, kFp16>(j); break;
  }
}

// The epilogue of dot_small: per row, the blocks in order, the 4 groups side by side (one
// block's row scale and shift broadcast once for them all). The block dot (P * 2^t_w) *
// 2^(t_x - 18) is one vscalefps by t_w + t_x - 18 (t_w from W's table: no 2^t_w array to
// fill, which was 7% of dot_rows_vbmi's time at one row): the same value, as both are exact
// (P is an integer below 2^42 or 0, the result at least 2^-18: never denormal, so
// denormals-as-zero changes neither).
CSA_TARGET_AVX512 CSA_INLINE void epilogue_small_body(const TaskView& v, const int32_t* sums) {
  for (int64_t r = 0; r < v.rows; ++r) {
    float* o = v.out + r * kPanel;
    __m512 f[kGroups];
    for (int64_t c = 0; c < kGroups; ++c) f[c] = _mm512_loadu_ps(o + kLanes * c);
    for (int64_t kbi = 0; kbi < v.kbs; ++kbi) {
      const int64_t kb = v.kb0 + kbi;
      const float xs = v.xs[kb * v.ld + r];
      const int32_t ex = cm_exponent(v.cm[kb * v.ld + r]);  // t_x - 18
      const __m512 sc[2] = {_mm512_set1_ps(xs * v.ws0[kb]), _mm512_set1_ps(xs * v.ws1[kb])};
      const uint64_t take = v.masks[kbi * v.rows + r];
      for (int64_t c = 0; c < kGroups; ++c) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + ((kbi * kGroups + c) * v.rows + r) * kLanes));
        const __m512 p = _mm512_mask_loadu_ps(s, static_cast<__mmask16>(take >> (16 * c)),
                                              v.slot[kbi * kGroups + c] + r * kLanes);
        const __m128i tw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v.tw + kb * kPanel + kLanes * c));
        f[c] = add_block_dot(f[c], p, _mm512_cvtepu8_epi32(tw), ex, sc[c / 2]);
      }
    }
    for (int64_t c = 0; c < kGroups; ++c) _mm512_storeu_ps(o + kLanes * c, f[c]);
  }
}

#pragma GCC diagnostic pop
#endif  // CSA_X86

}  // namespace csa::fp8_kernels
