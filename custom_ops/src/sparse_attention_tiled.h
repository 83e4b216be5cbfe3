// The SparseAttention kernel: sparse_attention.h's `row` (the definition) restructured so
// that all heads of a query share the work on one block of 64 indices, with every output
// summed in exactly the definition's order (same bits on every path):
//   - The block's valid rows are gathered once per task, as a list of row pointers: kv's own
//     rows when d is a multiple of the vector width (the tiles read them in place; a row is
//     contiguous and, after the logits pass, cache-resident for P @ V), else copies padded
//     with zeros in a tile [64][ldt]. With a packed compressed cache (Source), an index at or
//     past the window's rows names a packed row, unpacked into the tile on this gather, or
//     read where the op unpacked it once for all of a query's tasks (packed_quant.h:
//     value(code) * scale, the exact floats the unpacked cache would hold), so the result is
//     the one on the concatenated float rows, bit for bit, and no concatenated copy of the
//     cache is ever made. Entries that are -1 are left out (the definition skips them in
//     P @ V and masks their logits to -inf, so what they would compute never matters); the
//     list is padded to a multiple of 16 with a zero row.
//   - Logits: one tile of GV heads x J entries keeps its accumulators in registers,
//     vectorised across heads (Q is transposed once per task to [d][GP]); each logit is its
//     own chain over d in the definition's order (h >= 4: mkl_chunk chunks, a fmaf chain
//     from 0 per chunk, chunk sums added to 0 in order; h <= 3: the 4-lane order). The
//     loops over heads and entries only interleave independent chains.
//   - Softmax: the definition's operations per head, vectorised across heads (max,
//     subtract, scale, bf16 rounding are one exact operation per lane; the block sum runs
//     torch_sum's fixed 64-term tree lane by lane); exp is std::exp per value, as defined.
//   - P @ V: a tile of HB heads x EC columns of d in registers, vectorised across d; each
//     output element is the definition's chain over the block's valid entries in order,
//     then acc * alpha + chain.
//   - On CPUs with AVX512-BF16 (CfgAvx512Bf16), h >= 4: both products on vdpbf16ps, which per
//     float lane adds the product of a pair's second bf16 elements, then of its first, each
//     with one rounding (an fmaf: a product of two bf16 values is exact in float), reading
//     denormals as zero and flushing denormal results (TorchLinear's kOneDnnPairs order rests
//     on the same, on both CPU classes). Pairs stored swapped, (x[e+1], x[e]) as (low, high),
//     make one instruction two steps of the definition's chain, in order. Where every value
//     is a finite bf16 value and the exponents of the two sides (q and the block's rows;
//     bf16(p) and the rows) rule out a denormal or an overflow anywhere in the chains
//     (pairs::chains_exact), the result is the fmaf chain's, bit for bit. A task whose q is
//     not bf16, a block whose rows are not (or too small or large), and a block's P @ V whose
//     bf16(p) are too small take the fmaf tiles instead (counted:
//     csa2onnx_sparse_attention_pair_counts).
// Padding (heads up to GP, entries up to a multiple of 16, columns up to dp) computes
// values nobody reads: each output's chain involves only its own head, entry and column.
// Tile shapes come from a Cfg per instruction set, sized so the accumulators fit the
// register file; the arithmetic is spelled out with a vector type per instruction set (one
// fma, multiply or add per lane, as the order says), so the compiler can neither fuse nor
// reassociate anything (the file is also compiled with -ffp-contract=off) nor vectorise a
// loop the wrong way round.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <limits>

#include "libm_expf.h"
#include "packed_quant.h"
#include "simd.h"
#include "sparse_attention.h"

#ifdef CSA_X86
#include <immintrin.h>
#endif

// The templates below pass __m512/__m256 between inline functions compiled without AVX;
// GCC warns that such calls would change the ABI, but every one of them is inlined into a
// flatten wrapper that has the target, so no such call exists.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"


namespace csa::sparse_attention::tiled {

// Vector types: V::T holds V::W floats. fma is one rounding (vfmadd, or libm's fmaf
// without SIMD), mul and add one each: the same values on every path. The AVX types' members
// carry their target; the target wrappers are `flatten`, so that everything below is
// inlined into them (a plain always_inline chain would have to inline an AVX intrinsic
// into a function compiled without AVX, which GCC refuses).
#ifdef CSA_X86
struct VAvx512 {
  using T = __m512;
  static constexpr int W = 16;
  CSA_TARGET_AVX512 static inline T zero() { return _mm512_setzero_ps(); }
  CSA_TARGET_AVX512 static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  CSA_TARGET_AVX512 static inline void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  CSA_TARGET_AVX512 static inline T bcast(float x) { return _mm512_set1_ps(x); }
  CSA_TARGET_AVX512 static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  CSA_TARGET_AVX512 static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  CSA_TARGET_AVX512 static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
  CSA_TARGET_AVX512 static inline T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  // a > b ? a : b (maxps returns its second operand on equality and on NaN). The masked
  // forms with every lane set: the plain ones pass GCC 12 an "undefined" source that it
  // then warns about (-Wmaybe-uninitialized).
  CSA_TARGET_AVX512 static inline T max(T a, T b) { return _mm512_mask_max_ps(a, 0xffff, a, b); }
  CSA_TARGET_AVX512 static inline T round_bf16(T x) {  // sparse_attention::round_bf16
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i odd =
        _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(~0xffff)));
  }
};
struct VAvx2 {
  using T = __m256;
  static constexpr int W = 8;
  CSA_TARGET_AVX2 static inline T zero() { return _mm256_setzero_ps(); }
  CSA_TARGET_AVX2 static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  CSA_TARGET_AVX2 static inline void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  CSA_TARGET_AVX2 static inline T bcast(float x) { return _mm256_set1_ps(x); }
  CSA_TARGET_AVX2 static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  CSA_TARGET_AVX2 static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  CSA_TARGET_AVX2 static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
  CSA_TARGET_AVX2 static inline T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  CSA_TARGET_AVX2 static inline T max(T a, T b) { return _mm256_max_ps(a, b); }
  CSA_TARGET_AVX2 static inline T round_bf16(T x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    const __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan);
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(~0xffff)));
  }
};
#endif
struct VScalar {
  using T = float;
  static constexpr int W = 1;
  static inline T zero() { return 0.0f; }
  static inline T load(const float* p) { return *p; }
  static inline void store(float* p, T v) { *p = v; }
  static inline T bcast(float x) { return x; }
  static inline T fma(T a, T b, T c) { return __builtin_fmaf(a, b, c); }
  static inline T mul(T a, T b) { return a * b; }
  static inline T add(T a, T b) { return a + b; }
  static inline T sub(T a, T b) { return a - b; }
  static inline T max(T a, T b) { return a > b ? a : b; }
  static inline T round_bf16(T x) { return sparse_attention::round_bf16(x); }
};

// The softmax's exp, the definition's std::exp per value (Cfg::Exp).
struct StdExp {
  static inline void apply(float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
  }
};
#ifdef CSA_X86
// On AVX-512: std::exp as glibc computes it, 8 values a step, where this process's libm is
// that function (libm_expf.h; decided once, libm_expf_vector), else StdExp.
inline bool libm_expf_vector() {
  static const bool same = cpu_has_x86_64_v4() && libm_expf::matches_libm();
  return same;
}
struct LibmExp {
  CSA_TARGET_AVX512 static inline void apply(float* x, int64_t n) {
    if (libm_expf_vector()) {
      libm_expf::apply_avx512(x, n);
    } else {
      StdExp::apply(x, n);
    }
  }
};
#endif

// Tile shapes per instruction set (accumulators in registers).
// AVX-512 (32 zmm): logits 64 heads x 4 entries, 32 x 8 or 16 x 12... (16 accumulators),
// 4-lane logits 16 heads x 4 entries x 4 lanes; P @ V 4 heads x 64 columns.
#ifdef CSA_X86
struct CfgAvx512 {
  using V = VAvx512;
  using Exp = LibmExp;
  CSA_TARGET_AVX512 static inline void unpack(packed::Format f, const uint8_t* p, int64_t d,
                                              float* y) {
    packed::unpack_row_avx512(f, p, d, y);
  }
  static constexpr int kPad = 16;  // heads and columns are padded to a multiple of this
  static constexpr int kG1 = 64, kJ1 = 4, kG2 = 32, kJ2 = 8, kG3 = 16, kJ3 = 16;
  static constexpr int kLaneJ = 4;
  static constexpr int kPvHeads = 4, kPvCols = 64;
  static constexpr bool kPairs = false;
};
// AVX-512 with AVX512-BF16: the same tiles, both products on vdpbf16ps where exact.
struct CfgAvx512Bf16 : CfgAvx512 {
  static constexpr bool kPairs = true;
};
// AVX2 (16 ymm): 8 accumulators per tile.
struct CfgAvx2 {
  using V = VAvx2;
  using Exp = StdExp;
  CSA_TARGET_AVX2 static inline void unpack(packed::Format f, const uint8_t* p, int64_t d,
                                            float* y) {
    packed::unpack_row_avx2(f, p, d, y);
  }
  static constexpr int kPad = 8;
  static constexpr int kG1 = 32, kJ1 = 2, kG2 = 16, kJ2 = 4, kG3 = 8, kJ3 = 8;
  static constexpr int kLaneJ = 2;
  static constexpr int kPvHeads = 2, kPvCols = 32;
  static constexpr bool kPairs = false;
};
#endif
// Without SIMD: small tiles (fmaf is a libm call there; this path is for checking).
struct CfgScalar {
  using V = VScalar;
  using Exp = StdExp;
  static inline void unpack(packed::Format f, const uint8_t* p, int64_t d, float* y) {
    packed::unpack_row_scalar(f, p, d, y);
  }
  static constexpr int kPad = 4;
  static constexpr int kG1 = 4, kJ1 = 4, kG2 = 4, kJ2 = 4, kG3 = 4, kJ3 = 4;
  static constexpr int kLaneJ = 1;
  static constexpr int kPvHeads = 4, kPvCols = 4;
  static constexpr bool kPairs = false;
};

// Entries are computed in groups of J (every J above divides this); the tile's rows past
// the valid ones are zero.
constexpr int64_t kRowPad = 16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The shapes one task works with: heads [h0, h0 + g) of one query row.
struct Shape {
  int64_t g, gp;  // heads, padded
  int64_t d, dp;  // head dim, padded
  int64_t ldt;    // tile row stride: dp + 16, so that a column slice of 64 rows spreads over
                  // the L1 cache's sets instead of aliasing at a 2 KiB stride
  bool direct;    // d == dp: the tiles read kv's rows in place, nothing is copied
  bool tile;      // rows are copied or unpacked into a tile (!direct, or a packed cache)
  bool pairs;     // vdpbf16ps tiles where exact (CfgAvx512Bf16; d a multiple of 32, so that
                  // every chunk of the h >= 4 order starts at an even feature)
};

template <typename Cfg>
inline Shape shape_of(int64_t g, int64_t d, bool packed_rows = false) {
  const int64_t gp = round_up(g, Cfg::kPad), dp = round_up(d, Cfg::kPad);
  const bool pairs = Cfg::kPairs && d % 32 == 0 && torch_linear::mkl_chunk(d) % 2 == 0;
  return {g, gp, d, dp, dp + 16, d == dp, d != dp || packed_rows, pairs};
}

// Where a task's rows come from: index i < n_window reads kv's row i; with a packed
// compressed cache, i >= n_window reads its row i - n_window, unpacked (packed_quant.h) into
// the tile on the gather, or, when `unpacked` is set, already unpacked there: row j of the
// query's index list at unpacked + j * d (the op unpacks once per call when several tasks
// share a query's rows).
struct Source {
  const float* kv;                  // [n_window, d] of the batch entry
  int64_t n_window;
  const uint8_t* packed = nullptr;  // [n_cache, row_bytes] of the batch entry, or null
  int64_t row_bytes = 0;
  packed::Format format = packed::Format::kFp4E4m3;
  const float* unpacked = nullptr;  // [k, d] of the query row, or null
  // numerics="fast" only (sparse_attention_fast.h; the tiled kernel never reads these), rows
  // already converted to bf16, `bf16_stride` values apart, or null: kv's rows (`bf16`), or
  // every entry of the query row's index list (`gathered`: [k] rows, window and packed).
  const uint16_t* bf16 = nullptr;
  const uint16_t* gathered = nullptr;
  int64_t bf16_stride = 0;
};

// Unpacks the packed entries of one block of a query's index list (positions [j0, j1)) to
// out + j * d, the layout Source::unpacked reads.
template <typename Cfg, typename I>
inline void unpack_entries(const Source& src, int64_t d, const I* idx, int64_t j0, int64_t j1,
                           float* out) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t ix = static_cast<int64_t>(idx[j]);
    if (ix >= src.n_window)
      Cfg::unpack(src.format, src.packed + (ix - src.n_window) * src.row_bytes, d, out + j * d);
  }
}

// Scratch for one task, in floats.
inline int64_t scratch_floats(const Shape& s) {
  return s.d * s.gp            // qT
         + (s.tile ? kBlock * s.ldt : 0)  // tile (rows read in place need none)
         + kBlock * s.gp       // logit sums [entry][head]
         + kBlock * s.gp       // bf16(p) of the valid entries [entry][head]
         + s.gp * s.dp         // acc
         + 3 * s.gp            // m, total, alpha
         + s.dp                // a zero row
         + (s.pairs ? s.d / 2 * s.gp            // q2: Q's swapped pairs [d/2][gp]
                          + kBlock * (s.d / 2)  // r2: the rows' swapped pairs [64][d/2]
                          + kBlock / 2 * s.dp   // v2: entry pairs [32][dp]
                          + kBlock / 2 * s.gp   // p2: bf16(p) of entry pairs [32][gp]
                    : 0);
}

// One chunk [e0, e1) of the h >= 4 order for GV heads x J entries: fmaf chains from 0,
// then sum += chain (sum: [J][ldl]).
template <typename V, int GV, int J>
inline void logit_chunk(const float* qt, int64_t ldq, const float* const* rows, int64_t e0,
                        int64_t e1, float* sum, int64_t ldl) {
  constexpr int NV = GV / V::W;
  typename V::T acc[J][NV];
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = V::zero();
  for (int64_t e = e0; e < e1; ++e) {
    typename V::T qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = V::load(qt + e * ldq + v * V::W);
    for (int j = 0; j < J; ++j) {
      const typename V::T kv = V::bcast(rows[j][e]);
      for (int v = 0; v < NV; ++v) acc[j][v] = V::fma(qv[v], kv, acc[j][v]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < NV; ++v) {
      float* o = sum + j * ldl + v * V::W;
      V::store(o, V::add(V::load(o), acc[j][v]));
    }
}

// The h <= 3 order (kMklLanes) for GV heads x J entries over all of d: term e to lane 0
// while e < head, then to lane (e - head) % 4, multiply then add; out = (l0 + l2) + (l1 + l3).
template <typename V, int NV, int J>
inline void lane_step(typename V::T (&lane)[J][NV], const float* qe,
                      const float* const* rows, int64_t e) {
  typename V::T qv[NV];
  for (int v = 0; v < NV; ++v) qv[v] = V::load(qe + v * V::W);
  for (int j = 0; j < J; ++j) {
    const typename V::T kv = V::bcast(rows[j][e]);
    for (int v = 0; v < NV; ++v) lane[j][v] = V::add(lane[j][v], V::mul(qv[v], kv));
  }
}

template <typename V, int GV, int J>
inline void logit_lanes(const float* qt, int64_t ldq, const float* const* rows, int64_t d,
                        int64_t head, float* out, int64_t ldl) {
  constexpr int NV = GV / V::W;
  typename V::T l0[J][NV], l1[J][NV], l2[J][NV], l3[J][NV];
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < NV; ++v) l0[j][v] = l1[j][v] = l2[j][v] = l3[j][v] = V::zero();
  if (head > d) head = d;
  int64_t e = 0;
  for (; e < head; ++e) lane_step<V, NV, J>(l0, qt + e * ldq, rows, e);
  for (; e + 4 <= d; e += 4) {
    lane_step<V, NV, J>(l0, qt + e * ldq, rows, e);
    lane_step<V, NV, J>(l1, qt + (e + 1) * ldq, rows, e + 1);
    lane_step<V, NV, J>(l2, qt + (e + 2) * ldq, rows, e + 2);
    lane_step<V, NV, J>(l3, qt + (e + 3) * ldq, rows, e + 3);
  }
  if (e < d) lane_step<V, NV, J>(l0, qt + e * ldq, rows, e);
  if (e + 1 < d) lane_step<V, NV, J>(l1, qt + (e + 1) * ldq, rows, e + 1);
  if (e + 2 < d) lane_step<V, NV, J>(l2, qt + (e + 2) * ldq, rows, e + 2);
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < NV; ++v)
      V::store(out + j * ldl + v * V::W,
               V::add(V::add(l0[j][v], l2[j][v]), V::add(l1[j][v], l3[j][v])));
}

// Logit sums for heads [g0, g0 + GV) x the padded entries [0, nvp), chunk [e0, e1).
template <typename V, int GV, int J>
inline void logit_heads(const Shape& s, const float* qt, const float* const* rows,
                        int64_t nvp, int64_t g0, int64_t e0, int64_t e1, float* sum) {
  for (int64_t j = 0; j < nvp; j += J)
    logit_chunk<V, GV, J>(qt + g0, s.gp, rows + j, e0, e1, sum + j * s.gp + g0, s.gp);
}

// P @ V for heads [0, HB) x columns [e0, e0 + EC): pb [64][ldp] (valid entries in order x
// heads), acc [HB][dp]: blk = chain over the entries (fmaf, or multiply then add), then
// acc = acc * alpha + blk.
template <typename V, int HB, int EC, bool kFma>
inline void pv_tile(const float* pb, int64_t ldp, const float* const* rows, int64_t nv,
                    int64_t e0, const float* alpha, float* acc, int64_t dp) {
  constexpr int NV = EC / V::W;
  typename V::T blk[HB][NV];
  for (int i = 0; i < HB; ++i)
    for (int v = 0; v < NV; ++v) blk[i][v] = V::zero();
  for (int64_t j = 0; j < nv; ++j) {
    typename V::T r[NV];
    for (int v = 0; v < NV; ++v) r[v] = V::load(rows[j] + e0 + v * V::W);
    for (int i = 0; i < HB; ++i) {
      const typename V::T pv = V::bcast(pb[j * ldp + i]);
      for (int v = 0; v < NV; ++v)
        blk[i][v] = kFma ? V::fma(pv, r[v], blk[i][v]) : V::add(blk[i][v], V::mul(pv, r[v]));
    }
  }
  for (int i = 0; i < HB; ++i) {
    const typename V::T a = V::bcast(alpha[i]);
    for (int v = 0; v < NV; ++v) {
      float* o = acc + i * dp + e0 + v * V::W;
      V::store(o, V::add(V::mul(V::load(o), a), blk[i][v]));
    }
  }
}

template <typename Cfg, int EC, bool kFma>
inline void pv_columns(const Shape& s, const float* pb, const float* const* rows, int64_t nv,
                       int64_t e0, const float* alpha, float* acc) {
  for (int64_t i = 0; i < s.gp; i += Cfg::kPvHeads)
    pv_tile<typename Cfg::V, Cfg::kPvHeads, EC, kFma>(pb + i, s.gp, rows, nv, e0, alpha + i,
                                                       acc + i * s.dp, s.dp);
}

#ifdef CSA_X86
// ------------------------------------------------------------ vdpbf16ps where exact
// (CfgAvx512Bf16; see the header comment for why these chains are the fmaf chains.)
namespace pairs {

using u32 = uint32_t __attribute__((may_alias));  // float scratch read and written as bits

// A finite bf16 value of biased exponent E is a multiple of 2^(E - 134) below 2^(E - 126).
// So a chain of n products of values from two sets is exact on vdpbf16ps when (lo: smallest
// exponent of a nonzero value, hi: largest exponent)
//   lo1 + lo2 >= 142: every product and partial sum is 0 or a multiple of 2^-126 (a rounding
//     keeps that), never denormal, so nothing is flushed;
//   hi1 + hi2 + ceil(log2 n) <= 379: every partial sum stays below 2^127: no overflow (inf
//     and NaN would arise alike, but not necessarily with the same NaN bits).
struct Range {
  bool fine;         // every value a finite bf16 value
  uint32_t lo, hi;   // smallest nonzero and largest biased exponent (255, 0: all zero)
};
inline bool chains_exact(const Range& a, const Range& b, int64_t n) {
  uint32_t log2n = 0;
  while ((int64_t{1} << log2n) < n) ++log2n;
  return a.fine && b.fine && a.lo + b.lo >= 142 && a.hi + b.hi + log2n <= 379;
}

// Range of the values (float bits) added.
struct Scan {
  uint16_t bad = 0;
  alignas(64) uint32_t emin[16];
  alignas(64) uint32_t emax[16];
  Scan() {
    for (uint32_t& e : emin) e = 255;
    for (uint32_t& e : emax) e = 0;
  }
  CSA_TARGET_AVX512BF16 inline void add(__m512i x) {
    const __m512i a = _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 huge = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
    bad = static_cast<uint16_t>(bad | huge | _mm512_test_epi32_mask(x, _mm512_set1_epi32(0xffff)));
    const __m512i e = _mm512_maskz_srli_epi32(0xffff, a, 23);
    const __m512i lo = _mm512_load_si512(emin);
    _mm512_store_si512(emin, _mm512_mask_min_epu32(lo, _mm512_test_epi32_mask(a, a), lo, e));
    const __m512i hi = _mm512_load_si512(emax);
    _mm512_store_si512(emax, _mm512_mask_max_epu32(hi, 0xffff, hi, e));
  }
  Range range() const {
    Range r{bad == 0, 255, 0};
    for (uint32_t e : emin) r.lo = e < r.lo ? e : r.lo;
    for (uint32_t e : emax) r.hi = e > r.hi ? e : r.hi;
    return r;
  }
};

// Word indices taking 32 floats (two zmm, 64 words) to their 16 pairs swapped: word 2e of the
// result is x[2e + 1]'s high half (word 4e + 3), word 2e + 1 is x[2e]'s (word 4e + 1).
struct SwapIndex {
  alignas(64) uint16_t w[32];
  constexpr SwapIndex() : w() {
    for (int e = 0; e < 16; ++e) {
      w[2 * e] = static_cast<uint16_t>(4 * e + 3);
      w[2 * e + 1] = static_cast<uint16_t>(4 * e + 1);
    }
  }
};
inline constexpr SwapIndex kSwapIndex{};

// x (n floats, n a multiple of 32) as n/2 swapped pairs (x[2e+1] low, x[2e] high) at out.
CSA_TARGET_AVX512BF16 inline void swap_row(const float* x, int64_t n, u32* out, Scan& scan) {
  const __m512i idx = _mm512_load_si512(kSwapIndex.w);
  for (int64_t c = 0; c < n; c += 32) {
    const __m512i x0 = _mm512_loadu_si512(x + c), x1 = _mm512_loadu_si512(x + c + 16);
    scan.add(x0);
    scan.add(x1);
    _mm512_storeu_si512(out + c / 2, _mm512_permutex2var_epi16(x0, idx, x1));
  }
}

// Rows [0, rows) x [0, n) (n a multiple of 16, stride ld) into scan.
CSA_TARGET_AVX512BF16 inline void scan_rows(const float* x, int64_t rows, int64_t n, int64_t ld,
                                            Scan& scan) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; c += 16) scan.add(_mm512_loadu_si512(x + r * ld + c));
}

// Two rows of n bf16 values as floats (n a multiple of 16; b null: zeros) as n pairs
// (b[c] low, a[c] high).
CSA_TARGET_AVX512BF16 inline void pair_rows(const float* a, const float* b, int64_t n, u32* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t c = 0; c < n; c += 16) {
    const __m512i va = _mm512_and_si512(_mm512_loadu_si512(a + c), high);
    const __m512i vb = b != nullptr ? _mm512_maskz_srli_epi32(0xffff, _mm512_loadu_si512(b + c), 16)
                                    : _mm512_setzero_si512();
    _mm512_storeu_si512(out + c, _mm512_or_si512(va, vb));
  }
}

// logit_chunk on pairs: GV heads x J entries over pairs [p0, p1) of one chunk (q2 [pairs][ldq]
// swapped, r2 [entry][ldr] swapped); chains from 0, then sum += chain.
template <int GV, int J>
CSA_TARGET_AVX512BF16 inline void logit_chunk(const u32* q2, int64_t ldq, const u32* r2,
                                              int64_t ldr, int64_t p0, int64_t p1, float* sum,
                                              int64_t ldl) {
  constexpr int NV = GV / 16;
  __m512 acc[J][NV];
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(q2 + p * ldq + 16 * v);
    for (int j = 0; j < J; ++j) {
      const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(r2[j * ldr + p]));
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], qv[v], kv);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < NV; ++v) {
      float* o = sum + j * ldl + 16 * v;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[j][v]));
    }
}

template <int GV, int J>
CSA_TARGET_AVX512BF16 inline void logit_heads(const Shape& s, const u32* q2, const u32* r2,
                                              int64_t nvp, int64_t g0, int64_t p0, int64_t p1,
                                              float* sum) {
  for (int64_t j = 0; j < nvp; j += J)
    logit_chunk<GV, J>(q2 + g0, s.gp, r2 + j * (s.d / 2), s.d / 2, p0, p1,
                       sum + j * s.gp + g0, s.gp);
}

// pv_tile on pairs: HB heads x EC columns from e0 over entry pairs [0, np) (p2 [pair][ldp],
// v2 [pair][ldv]); then acc = acc * alpha + chain. (The fast kernel's P @ V too, on pairs
// in its own order.)
template <int HB, int EC>
CSA_TARGET_AVX512BF16 inline void pv_tile(const u32* p2, int64_t ldp, const u32* v2,
                                          int64_t ldv, int64_t np, int64_t e0,
                                          const float* alpha, float* acc, int64_t dp) {
  constexpr int NV = EC / 16;
  __m512 blk[HB][NV];
  for (int i = 0; i < HB; ++i)
    for (int v = 0; v < NV; ++v) blk[i][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < np; ++q) {
    __m512bh r[NV];
    for (int v = 0; v < NV; ++v) r[v] = (__m512bh)_mm512_loadu_si512(v2 + q * ldv + e0 + 16 * v);
    for (int i = 0; i < HB; ++i) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(p2[q * ldp + i]));
      for (int v = 0; v < NV; ++v) blk[i][v] = _mm512_dpbf16_ps(blk[i][v], r[v], p);
    }
  }
  for (int i = 0; i < HB; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int v = 0; v < NV; ++v) {
      float* o = acc + i * dp + e0 + 16 * v;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(o), a), blk[i][v]));
    }
  }
}

template <int EC>
CSA_TARGET_AVX512BF16 inline void pv_columns(const Shape& s, const u32* p2, const u32* v2,
                                             int64_t np, int64_t e0, const float* alpha,
                                             float* acc) {
  constexpr int HB = CfgAvx512::kPvHeads;
  for (int64_t i = 0; i < s.gp; i += HB)
    pv_tile<HB, EC>(p2 + i, s.gp, v2, s.dp, np, e0, alpha + i, acc + i * s.dp, s.dp);
}

}  // namespace pairs
#endif

// Blocks of CfgAvx512Bf16 tasks by path, over the process (tests read them): logits and
// P @ V on pairs; logits on pairs, P @ V on fmaf (some p too small); all on fmaf (the
// task's q or the block's rows do not fit).
struct PairCounts {
  std::atomic<uint64_t> pairs{0}, pv_fmaf{0}, fmaf{0};
};
inline PairCounts pair_counts;

// torch_sum::sum's order for n = 64, lane by lane over V::W heads: p [entries][ld] holds
// the block's valid entries, slot[j] the entry at position j (-1: p is 0 there). For 64
// terms that order is: acc_k = (((0 + x[8k + l]) + x[32 + 8k + l]) + 0) + 0) + 0 per
// k < 4 and lane l < 8 (multi_row_sum over 2 groups: no cascade, its 3 empty levels added),
// part_l = ((acc_0 + acc_1) + acc_2) + acc_3, then s = (0 + part_0) + ... + part_7.
// (The sum goes to out: a function returning a vector type by value draws GCC's -Wpsabi
// warning at its instantiation, where no pragma reaches.)
template <typename V>
inline void sum64(const float* p, int64_t ld, const int* slot, float* out) {
  static_assert(kBlock == 64, "the order below is torch_sum::sum's for 64 terms");
  using T = typename V::T;
  const T zero = V::zero();
  T total = zero;
  for (int l = 0; l < 8; ++l) {
    T acc[4];
    for (int k = 0; k < 4; ++k) {
      const int j0 = 8 * k + l, j1 = 32 + 8 * k + l;
      const T x0 = slot[j0] >= 0 ? V::load(p + slot[j0] * ld) : zero;
      const T x1 = slot[j1] >= 0 ? V::load(p + slot[j1] * ld) : zero;
      const T a = V::add(V::add(zero, x0), x1);
      acc[k] = V::add(V::add(V::add(a, zero), zero), zero);
    }
    total = V::add(total, V::add(V::add(V::add(acc[0], acc[1]), acc[2]), acc[3]));
  }
  V::store(out, total);
}

// The block's online softmax for heads [0, gp), vectorised across heads (the definition's
// operations per head, one rounding each; exp is Exp's: the definition's std::exp, per value
// or as libm computes it 8 at a time). lsum [64][gp]: the valid entries' logit sums,
// overwritten; pb [64][gp]: bf16(p) of the valid entries. Entries at -1 have logit -inf,
// which changes no maximum, and p = exp(-inf - m_new) = 0 exactly (m_new >= -1e30 is never
// NaN or -inf).
// Exp::apply(x, n): x[i] = exp(x[i]) for i < n (the definition's std::exp: Cfg::Exp; the
// fast kernel passes its own).

template <typename V, typename Exp>
inline void softmax(const Shape& s, float scale, int64_t nv, const int* slot, float* lsum,
                    float* pb, float* m, float* total, float* alpha) {
  using T = typename V::T;
  const int64_t gp = s.gp;
  const T sc = V::bcast(scale);
  for (int64_t i = 0; i < gp; i += V::W) {
    T bmax = V::bcast(-std::numeric_limits<float>::infinity());
    for (int64_t v = 0; v < nv; ++v) {
      const T l = V::mul(V::load(lsum + v * gp + i), sc);
      V::store(lsum + v * gp + i, l);
      bmax = V::max(l, bmax);  // li > bmax ? li : bmax, in entry order
    }
    const T m_old = V::load(m + i);
    const T m_new = V::max(bmax, m_old);
    for (int64_t v = 0; v < nv; ++v)
      V::store(lsum + v * gp + i, V::sub(V::load(lsum + v * gp + i), m_new));
    V::store(alpha + i, V::sub(m_old, m_new));
    V::store(m + i, m_new);
  }
  for (int64_t v = 0; v < nv; ++v) Exp::apply(lsum + v * gp, s.g);
  Exp::apply(alpha, s.g);
  for (int64_t i = 0; i < gp; i += V::W) {
    alignas(64) float block_sum[V::W];
    sum64<V>(lsum + i, gp, slot, block_sum);
    const T a = V::load(alpha + i);
    V::store(total + i, V::add(V::mul(V::load(total + i), a), V::load(block_sum)));
    for (int64_t v = 0; v < nv; ++v)
      V::store(pb + v * gp + i, V::round_bf16(V::load(lsum + v * gp + i)));
  }
}

// One task: heads [h0, h0 + s.g) of one query row. q: [h, d] of the row; src: the batch
// entry's rows (s.tile must be set when src has packed rows to unpack); idx: [k]; sink: [h]; out:
// [h, d] of the row. Indices already checked (-1, or below n_window + the packed rows).
// kRoundOut: as in sparse_attention::row.
template <typename Cfg, typename I, bool kRoundOut = true>
inline void task(const Problem& pr, const Shape& s, int64_t h0, const float* q,
                 const Source& src, const I* idx, const float* sink, float* scratch,
                 float* out) {
  const int64_t d = s.d, dp = s.dp, gp = s.gp, g = s.g, k = pr.k, ldt = s.ldt;
  float* qt = scratch;              // [d][gp]
  float* tile = qt + d * gp;        // [64][ldt]
  float* lsum = tile + (s.tile ? kBlock * ldt : 0);  // [64][gp]
  float* pb = lsum + kBlock * gp;   // [64][gp]
  float* acc = pb + gp * kBlock;    // [gp][dp]
  float* m = acc + gp * dp;         // [gp]
  float* total = m + gp;            // [gp]
  float* alpha = total + gp;        // [gp]
  float* zero = alpha + gp;         // [dp]

  // Q's rows are d floats apart: transposed in 16 x 16 blocks, so that both sides stay
  // within 16 cache lines.
  for (int64_t i0 = 0; i0 < gp; i0 += 16) {
    const int64_t i1 = i0 + 16 < gp ? i0 + 16 : gp;
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
      const int64_t e1 = e0 + 16 < d ? e0 + 16 : d;
      for (int64_t e = e0; e < e1; ++e)
        for (int64_t i = i0; i < i1; ++i) qt[e * gp + i] = i < g ? q[(h0 + i) * d + e] : 0.0f;
    }
  }
  for (int64_t i = 0; i < gp * kBlock; ++i) pb[i] = 0.0f;
  for (int64_t i = 0; i < gp * dp; ++i) acc[i] = 0.0f;
  for (int64_t e = 0; e < dp; ++e) zero[e] = 0.0f;
  for (int64_t i = 0; i < gp; ++i) {
    m[i] = kRunningMaxInit;
    total[i] = 0.0f;
    alpha[i] = 0.0f;
  }
  const bool blocked = pr.h >= 4;
  const int64_t chunk = torch_linear::mkl_chunk(d);
  const int64_t head = pr.h == 1 && d > 0 ? (d - 1) % 4 + 1 : 0;

#ifdef CSA_X86
  // vdpbf16ps: Q's swapped pairs [d/2][gp], if every value of the task's q fits
  bool q_pairs = false;
  pairs::u32* q2 = nullptr;
  pairs::u32* r2 = nullptr;  // the block's rows, swapped pairs [64][d/2]
  pairs::u32* v2 = nullptr;  // the block's entry pairs [32][dp]
  pairs::u32* p2 = nullptr;  // bf16(p) of the entry pairs [32][gp]
  uint64_t n_pairs = 0, n_pv_fmaf = 0, n_fmaf = 0;
  pairs::Scan q_scan;
  pairs::Range q_range{false, 255, 0}, kv_range{false, 255, 0};
  if constexpr (Cfg::kPairs) {
    if (s.pairs && blocked) {
      q2 = reinterpret_cast<pairs::u32*>(zero + dp);
      r2 = q2 + d / 2 * gp;
      v2 = r2 + kBlock * (d / 2);
      p2 = v2 + kBlock / 2 * dp;
      for (int64_t i = 0; i < gp; ++i) {
        if (i < g) pairs::swap_row(q + (h0 + i) * d, d, r2, q_scan);
        for (int64_t p = 0; p < d / 2; ++p) q2[p * gp + i] = i < g ? r2[p] : 0u;
      }
      q_range = q_scan.range();
      q_pairs = q_range.fine;
    }
  }
#endif

  for (int64_t j0 = 0; j0 < k; j0 += kBlock) {
    const int64_t len = k - j0 < kBlock ? k - j0 : kBlock;
    int slot[kBlock];           // the valid entry at each block position, -1 for none
    const float* rows[kBlock];  // each valid entry's row (kv's own, or its padded copy)
    int64_t nv = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t ix = j < len ? static_cast<int64_t>(idx[j0 + j]) : -1;
      slot[j] = ix < 0 ? -1 : static_cast<int>(nv);
      if (ix < 0) continue;
      if (ix < src.n_window && s.direct) {
        rows[nv] = src.kv + ix * d;
      } else if (ix >= src.n_window && src.unpacked != nullptr) {
        rows[nv] = src.unpacked + (j0 + j) * d;  // d is a multiple of 16: no padding
      } else {
        float* t = tile + nv * ldt;
        if (ix < src.n_window) {
          std::memcpy(t, src.kv + ix * d, static_cast<size_t>(d) * sizeof(float));
        } else {
          Cfg::unpack(src.format, src.packed + (ix - src.n_window) * src.row_bytes, d, t);
        }
        for (int64_t e = d; e < dp; ++e) t[e] = 0.0f;
        rows[nv] = t;
      }
      ++nv;
    }
    if (nv == 0) continue;  // the definition skips a block with nothing in it
    const int64_t nvp = round_up(nv, kRowPad);
    for (int64_t j = nv; j < nvp; ++j) rows[j] = zero;

    // the block on vdpbf16ps: its rows as swapped pairs, if every value fits
    bool block_pairs = false;
#ifdef CSA_X86
    if constexpr (Cfg::kPairs) {
      if (q_pairs) {
        pairs::Scan kv_scan;
        for (int64_t j = 0; j < nv; ++j) pairs::swap_row(rows[j], d, r2 + j * (d / 2), kv_scan);
        kv_range = kv_scan.range();
        block_pairs = pairs::chains_exact(q_range, kv_range, d);
        if (block_pairs)
          std::memset(r2 + nv * (d / 2), 0, static_cast<size_t>((nvp - nv) * (d / 2)) * 4);
        else
          ++n_fmaf;
      } else if (s.pairs && blocked) {
        ++n_fmaf;
      }
    }
#endif

    // logit sums [entry][head]
    if (blocked) {
      for (int64_t i = 0; i < nvp * gp; ++i) lsum[i] = 0.0f;
      for (int64_t e0 = 0; e0 < d; e0 += chunk) {
        const int64_t e1 = e0 + chunk < d ? e0 + chunk : d;
        int64_t g0 = 0;
#ifdef CSA_X86
        if constexpr (Cfg::kPairs) {
          if (block_pairs) {
            for (; g0 + Cfg::kG1 <= gp; g0 += Cfg::kG1)
              pairs::logit_heads<Cfg::kG1, Cfg::kJ1>(s, q2, r2, nvp, g0, e0 / 2, e1 / 2, lsum);
            for (; g0 + Cfg::kG2 <= gp; g0 += Cfg::kG2)
              pairs::logit_heads<Cfg::kG2, Cfg::kJ2>(s, q2, r2, nvp, g0, e0 / 2, e1 / 2, lsum);
            for (; g0 < gp; g0 += Cfg::kG3)
              pairs::logit_heads<Cfg::kG3, Cfg::kJ3>(s, q2, r2, nvp, g0, e0 / 2, e1 / 2, lsum);
          }
        }
#endif
        for (; !block_pairs && g0 + Cfg::kG1 <= gp; g0 += Cfg::kG1)
          logit_heads<typename Cfg::V, Cfg::kG1, Cfg::kJ1>(s, qt, rows, nvp, g0, e0, e1, lsum);
        for (; !block_pairs && g0 + Cfg::kG2 <= gp; g0 += Cfg::kG2)
          logit_heads<typename Cfg::V, Cfg::kG2, Cfg::kJ2>(s, qt, rows, nvp, g0, e0, e1, lsum);
        for (; !block_pairs && g0 < gp; g0 += Cfg::kG3)
          logit_heads<typename Cfg::V, Cfg::kG3, Cfg::kJ3>(s, qt, rows, nvp, g0, e0, e1, lsum);
      }
    } else {
      for (int64_t g0 = 0; g0 < gp; g0 += Cfg::kPad)
        for (int64_t j = 0; j < nvp; j += Cfg::kLaneJ)
          logit_lanes<typename Cfg::V, Cfg::kPad, Cfg::kLaneJ>(qt + g0, gp, rows + j, d, head,
                                              lsum + j * gp + g0, gp);
    }

    softmax<typename Cfg::V, typename Cfg::Exp>(s, pr.scale, nv, slot, lsum, pb, m, total,
                                                 alpha);

    // P @ V: column blocks outer, so a column slice of the tile serves every head
    int64_t e0 = 0;
#ifdef CSA_X86
    if constexpr (Cfg::kPairs) {
      pairs::Scan p_scan;
      if (block_pairs) pairs::scan_rows(pb, nv, gp, gp, p_scan);
      if (block_pairs && pairs::chains_exact(p_scan.range(), kv_range, nv)) {
        const int64_t np = (nv + 1) / 2;  // an odd last entry pairs with p = 0 and a zero row
        for (int64_t q = 0; q < np; ++q) {
          const bool two = 2 * q + 1 < nv;
          pairs::pair_rows(pb + 2 * q * gp, two ? pb + (2 * q + 1) * gp : nullptr, gp, p2 + q * gp);
          pairs::pair_rows(rows[2 * q], two ? rows[2 * q + 1] : nullptr, dp, v2 + q * dp);
        }
        for (; e0 + Cfg::kPvCols <= dp; e0 += Cfg::kPvCols)
          pairs::pv_columns<Cfg::kPvCols>(s, p2, v2, np, e0, alpha, acc);
        for (; e0 < dp; e0 += 16) pairs::pv_columns<16>(s, p2, v2, np, e0, alpha, acc);
        ++n_pairs;
        continue;
      }
      if (block_pairs) ++n_pv_fmaf;
    }
#endif
    if (blocked) {
      for (; e0 + Cfg::kPvCols <= dp; e0 += Cfg::kPvCols)
        pv_columns<Cfg, Cfg::kPvCols, true>(s, pb, rows, nv, e0, alpha, acc);
      for (; e0 < dp; e0 += Cfg::kPad)
        pv_columns<Cfg, Cfg::kPad, true>(s, pb, rows, nv, e0, alpha, acc);
    } else {
      for (; e0 + Cfg::kPvCols <= dp; e0 += Cfg::kPvCols)
        pv_columns<Cfg, Cfg::kPvCols, false>(s, pb, rows, nv, e0, alpha, acc);
      for (; e0 < dp; e0 += Cfg::kPad)
        pv_columns<Cfg, Cfg::kPad, false>(s, pb, rows, nv, e0, alpha, acc);
    }
  }
#ifdef CSA_X86
  if constexpr (Cfg::kPairs) {
    if (n_pairs) pair_counts.pairs.fetch_add(n_pairs, std::memory_order_relaxed);
    if (n_pv_fmaf) pair_counts.pv_fmaf.fetch_add(n_pv_fmaf, std::memory_order_relaxed);
    if (n_fmaf) pair_counts.fmaf.fetch_add(n_fmaf, std::memory_order_relaxed);
  }
#endif
  for (int64_t i = 0; i < g; ++i) {
    const float denom = total[i] + std::exp(sink[h0 + i] - m[i]);
    for (int64_t e = 0; e < d; ++e) {
      const float o = acc[i * dp + e] / denom;
      out[(h0 + i) * d + e] = kRoundOut ? round_bf16(o) : o;
    }
  }
}

// The same on float rows only (kv: [n, d] of the batch entry).
template <typename Cfg, typename I, bool kRoundOut = true>
inline void task(const Problem& pr, const Shape& s, int64_t h0, const float* q,
                 const float* kv, const I* idx, const float* sink, float* scratch,
                 float* out) {
  task<Cfg, I, kRoundOut>(pr, s, h0, q, Source{kv, pr.n}, idx, sink, scratch, out);
}

}  // namespace csa::sparse_attention::tiled

#pragma GCC diagnostic pop
