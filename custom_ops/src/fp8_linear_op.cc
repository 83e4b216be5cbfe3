// Fp8Linear (domain csa2onnx): Y = fp8_gemm(act_quant(X), W, WScale) with the block rule
// of fp8_linear.h. Inputs X (float, [..., K], rank >= 1), W (float8e4m3fn, [N, K], one byte
// per weight), WScale (float, [ceil(N/32), K/32], the checkpoint's ue8m0 scales); attribute
// block_size (default 32, the only size supported); output Y (float, [..., N]). Attribute
// round_output (int, default 0): 1 rounds Y through bfloat16 as the graph's Cast pair would
// (ort_cast.h, fused into the tasks' stores). Attribute numerics: "exact" (the default:
// everything below) or "fast" (fp8_linear_fast.cc: the same terms in another summation
// order, where the CPU has its instructions; otherwise this exact kernel). Attribute
// weight_layout: "plain" (the default: W [N, K] as above) or "pairs16" (W
// [N/16, K/32, 512], N a multiple of 16: each group of 16 columns' K block as one run of
// k-pairs, fp8_linear_kernels.h; the few-rows kernel then reads lanes over columns with no
// transpose). numerics "fast" reads plain W only: with pairs16 it is this exact kernel.
//
// W is read in place: the kernel keeps no copy of it. For a constant W it keeps, computed
// once when the session creates the kernel, per (column, K block) the power of two t that
// every value of the block is a multiple of (1 byte), and per (16 columns, K block) the
// lanes whose block does not fit int16 and the largest sum, max and norm of |w >> t|
// (14 bytes): 1/32 + 14/512 ~ 0.06 bytes a weight. A W fed as a graph input gets the same
// figures on every call. For the few-rows kernel of a plain W t is kept a second time, per
// column (row of W) over its blocks, padded by 16: 1/32 + 14/512 + 1/32 ~ 0.09 bytes a
// weight in all (a pairs16 W's kernel reads the first copy: ~0.06).
//
// The block dots are integer sums (fp8_int_blocks.h): act_quant(X) and W become int16
// units >> t per block, and every int32 lane of a vpdpwssd accumulation (AVX512-VNNI; else
// vpmaddwd + vpaddd, AVX2 likewise; scalar: int64) is the exact dot of one (row, column)
// block when the precondition holds (both blocks int16, sums bounded below 2^31). A task
// (64 columns x up to 256 rows) converts its columns of W to int16 k-pairs 8 K blocks at a
// time (AVX512-VBMI: a 16x16 transpose by word permutes, table lookups, variable shifts)
// into a thread-local panel and multiplies them in tiles of 3 rows x 64 columns, one K block
// at a time (the outputs in registers over the 8 blocks; AVX2: 2 rows x 32 columns, outputs
// in memory); with at most 4 rows (decode) the pairs go straight from the conversion into
// vpdpwssd, up to 256 K blocks a step (fewer for 2 to 4 rows: X's chunk stays in L1),
// each W row in order against every row of X, 64 codes a zmm (lanes over k, block sums by
// an add/shuffle tree; a panel is one sequential stream, prefetched 16 KiB ahead); a
// pairs16 W's few rows, lanes over columns, the epilogue fused (AVX2 too: vpmaddwd on
// pairs from vpshufb tables and vpmulhuw; its few rows of a plain W take the pack). The
// blocks where the precondition fails are summed exactly first, into override slots the
// tiles read by masked loads: a W block that is not int16 as two int16 digits
// (v = h * 2^8 + l) against every row at once (16 rows a zmm, from X transposed; up to 4
// rows: each row's block against the digits, lanes over k), a flagged
// row the same way with X's block in two digits (the AVX-512 tiles sum a row whose block is
// not int16 in two digits themselves: no patch), and the rare pair where both blocks are
// not int16 in int64. Then per lane, in float, as the definition:
// dot = (float(sum) * 2^t_w) * 2^(t_x - 18) (exact), out = out + dot * (xs * ws). Every
// instruction-set path and thread count gives the same bits. This file is compiled with
// -ffp-contract=off: the float scaling must stay multiplies and an add, each rounded.
// Per calling thread the kernel keeps the last chunk of quantised X (up to 256 rows x K x
// 5 bytes) and per pool thread a task's buffers (a panel of 32 KiB and its slots), reused
// from call to call.
//
// NaN codes in W are zero in the sums and their columns are set to NaN at the end (their
// outputs are NaN whatever the rest is); NaN or inf in X makes xs NaN or inf, and the sums
// of such a block are 0, so those rows come out NaN as in the definition. A thread whose
// MXCSR flushes denormals to zero changes only outputs that are denormal (or products with a
// denormal WScale); the sums do not depend on it.
//
// CSA_FP8_LINEAR_ISA (or CSA2ONNX_ISA; read when a session creates the kernel) forces a path
// for tests: "avx512" (VBMI packing, VNNI and AVX512-FP16 where the CPU has them), "avx2",
// "scalar", "avx512-nofp16" (the same without AVX512-FP16: the few-rows kernel converts W by
// tables) and "avx512-novbmi" (AVX-512 without VBMI or VNNI: the generic packing, vpmaddwd
// tiles).
#include "ort_api.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "fp8_block_figures_avx512.h"
#include "fp8_int_blocks.h"
#include "fp8_linear.h"
#include "fp8_linear_fast.h"
#include "fp8_linear_kernels.h"
#include "fp8_linear_op.h"
#include "kernel_support.h"
#include "ort_cast.h"
#include "simd.h"
#ifdef CSA_WITH_CUDA
#include "fp8_linear_cuda.h"
#endif

namespace csa {
namespace {

using namespace fp8_kernels;  // NOLINT: the kernels' constants and job types
using fp8_int::BlockInts;

constexpr const char* kOp = "Fp8Linear";


// How often each way of summing ran, for the tests (csa2onnx_fp8_linear_counts): that a case
// built for a fallback did take it. Tasks add their counts once, at their end.
struct Counts {
  std::atomic<uint64_t> calls{0}, small_tasks{0}, lane_sums{0}, row_sums{0}, wide_sums{0};
  std::atomic<uint64_t> fast_calls{0};  // calls the fast kernel summed (numerics "fast")
  std::atomic<uint64_t> fast_amx_calls{0};  // ... of them on AMX tiles
  std::atomic<uint64_t> fp16_tasks{0};  // few-rows tasks that converted W by AVX512-FP16
  std::atomic<uint64_t> folded_calls{0};  // calls on the tiles whose WScale let them fold
  std::atomic<uint64_t> tile_wide_rows{0};  // (row, block, panel)s the tiles summed in two digits
};
Counts counts;

constexpr int64_t kTaskRows = 256;    // rows per task (and per quantised chunk of X)

struct Dims {
  int64_t M = 0, N = 0, K = 0, KB = 0, NB = 0;
};

// Checks shapes and returns (M, N, K); everything is checked before any memory is touched.
Dims check_shapes(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                  const std::vector<int64_t>& ws, bool pairs16) {
  if (x.empty()) fail(kOp, "X must have rank >= 1, got a scalar");
  Dims d;
  if (pairs16) {
    if (w.size() != 3 || w[2] != kPairs16Bytes)
      fail(kOp, "a pairs16 W must be [N/16, K/32, 512] (rank 3), got shape " + shape_string(w));
    d.N = w[0] * kLanes;
    d.K = w[1] * kBlock;
  } else {
    if (w.size() != 2) fail(kOp, "W must be [N, K] (rank 2), got shape " + shape_string(w));
    d.N = w[0];
    d.K = w[1];
  }
  if (d.K % kBlock != 0) {
    fail(kOp, "K (" + std::to_string(d.K) + ", the second dimension of W " + shape_string(w) +
         ") must be a multiple of the block size 32");
  }
  if (x.back() != d.K) {
    fail(kOp, "the last dimension of X (" + std::to_string(x.back()) +
         ") must equal K, the second dimension of W (" + std::to_string(d.K) + "); X shape " +
         shape_string(x) + ", W shape " + shape_string(w));
  }
  d.KB = d.K / kBlock;
  d.NB = (d.N + kBlock - 1) / kBlock;
  if (ws.size() != 2 || ws[0] != d.NB || ws[1] != d.KB) {
    fail(kOp, "WScale must be [ceil(N/32), K/32] = " + shape_string({d.NB, d.KB}) + " for W " +
         shape_string(w) + ", got shape " + shape_string(ws));
  }
  d.M = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) d.M *= x[i];
  return d;
}

// ------------------------------------------------------------------------ W figures
// What the kernel keeps of W (fp8_int_blocks.h): t per (column, block), and per (group of
// 16 columns, block) the lanes that are not int16 and the int16 lanes' largest sum, max and
// norm.
struct WMeta {
  int64_t n = -1, k = -1, kb = 0, groups = 0;
  bool pairs16 = false;           // W's layout
  std::vector<uint8_t> shift;     // [panels][KB][64] (WView::shift_at), 0 past N
  std::vector<uint8_t> shift_rows;  // [N][KB + 16]: the same, a column's blocks in a row (plain
                                    // W only: dot_rows_vbmi's)
  std::vector<uint8_t> nan_column;  // [groups * 16]
  std::vector<int64_t> nan_columns;
  bool any_bad = false;
  // per (group of 16 columns, block), stored per panel (64 columns) and block,
  // [panels][KB][4 groups] (0 past the last group), so that a task reads its chunk's as one
  // run: the lanes that are not int16, and the int16 lanes' largest sum, max and norm
  std::vector<uint16_t> panel_bad;
  std::vector<uint32_t> panel_l1max, panel_absmax, panel_l2max;

  void reset(int64_t N, int64_t K, bool pairs16_layout) {
    n = N;
    k = K;
    pairs16 = pairs16_layout;
    kb = K / kBlock;
    groups = (N + kLanes - 1) / kLanes;
    shift.assign(static_cast<size_t>((groups + kGroups - 1) / kGroups * kb * kPanel), 0);
    shift_rows.assign(pairs16 ? 0 : static_cast<size_t>(N * (kb + kLanes)), 0);
    const size_t figures = static_cast<size_t>((groups + kGroups - 1) / kGroups * kGroups * kb);
    panel_bad.assign(figures, 0);
    panel_l1max.assign(figures, 0);
    panel_absmax.assign(figures, 0);
    panel_l2max.assign(figures, 0);
    nan_column.assign(static_cast<size_t>(groups * kLanes), 0);
    nan_columns.clear();
    any_bad = false;
  }

  // Groups [g0, g1) (each group's figures are written by one caller only).
  void build(const uint8_t* w, int64_t g0, int64_t g1) {
    int32_t u[kBlock];
    uint8_t buf[kBlock];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const int64_t col = g * kLanes + lane;
        if (col >= n) break;
        bool nan = false;
        for (int64_t b = 0; b < kb; ++b) {
          const uint8_t* codes = column_block(w, k, pairs16, col, b, buf);
          for (int64_t i = 0; i < kBlock; ++i) {
            u[i] = fp8_int::kUnits.v[codes[i]];
            nan |= Fp8::is_nan_code(codes[i]);
          }
          const BlockInts bi = fp8_int::analyse_block(u);
          shift[static_cast<size_t>(panel_column_index(kb, b, col))] = static_cast<uint8_t>(bi.shift);
          if (!pairs16) shift_rows[col * (kb + kLanes) + b] = static_cast<uint8_t>(bi.shift);
          const size_t pat = static_cast<size_t>(panel_group_index(kb, b, g));
          if (!bi.fits()) {
            panel_bad[pat] = static_cast<uint16_t>(panel_bad[pat] | (1u << lane));
          } else {
            panel_l1max[pat] = bi.l1 > panel_l1max[pat] ? bi.l1 : panel_l1max[pat];
            panel_absmax[pat] = bi.absmax > panel_absmax[pat] ? bi.absmax : panel_absmax[pat];
            panel_l2max[pat] = bi.l2 > panel_l2max[pat] ? bi.l2 : panel_l2max[pat];
          }
        }
        nan_column[col] = nan ? 1 : 0;
      }
    }
  }

  void finish() {
    for (int64_t col = 0; col < n; ++col)
      if (nan_column[col]) nan_columns.push_back(col);
    for (const uint16_t b : panel_bad) any_bad |= b != 0;
  }

  WView view(const uint8_t* w) const {
    return {w, n, k, kb, groups, shift.data(), panel_bad.data(), shift_rows.data(), pairs16};
  }
};

// ------------------------------------------------------------------ X, quantised
// A chunk of rows of act_quant(X) as int16 units >> t_x (0 where a block is not int16),
// per (block, row) [KB][rows]: t_x, xs, 2^(t_x - 18), whether the block is int16, and the
// limits the W groups' figures must stay under (fp8_int::sum_limit).
struct XChunk {
  int64_t rows = 0, rows16 = 0, K = 0, KB = 0;
  std::vector<int16_t> xi;        // [rows][K]: units >> t_x, or its high digit (not int16)
  std::vector<uint8_t> xlo;       // [rows][K]: the low digit where the block is not int16
  std::vector<int32_t> xt;        // [K/2][rows16] (AVX-512 lanes-over-rows sums)
  std::vector<uint8_t> shift, fits;
  std::vector<uint32_t> lim_l1, lim_max, lim_l2;
  std::vector<float> xs, cm;
  bool tiles_sum_wide_rows = false;  // quantised with QuantJob::wide_limit all ones

  // Room for max_rows rows of K (buffers only grow).
  void reserve(int64_t max_rows, int64_t k) {
    K = k;
    KB = k / kBlock;
    const size_t cells = static_cast<size_t>(max_rows * KB);
    grow(xi, static_cast<size_t>(max_rows * K));
    grow(xlo, static_cast<size_t>(max_rows * K));
    grow(shift, cells);
    grow(fits, cells);
    grow(lim_l1, cells);
    grow(lim_max, cells);
    grow(lim_l2, cells);
    grow(xs, cells);
    grow(cm, cells);
  }
  template <typename T>
  static void grow(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  }
};

struct QuantJob {
  const float* x;  // the chunk's first row
  XChunk* xc;
  // the limits of a block that is not int16: 0 flags its row against every group (row
  // patches), all ones none (Kernels::tiles_sum_wide_rows: the tiles sum it in two digits)
  uint32_t wide_limit = 0;
};

// act_quant of one block: its scale xs and its values' units (value * 2^9, NaN 0).
CSA_INLINE float block_units_generic(const float* x, int32_t* u) {
  float v[kBlock];
  const float xs = Fp8::quantize_block(x, v);
  for (int64_t i = 0; i < kBlock; ++i) u[i] = fp8_int::units_of_value(v[i]);
  return xs;
}

template <float (*kBlockUnits)(const float*, int32_t*)>
CSA_INLINE void quantize_row_body(const QuantJob& q, int64_t r) {
  XChunk& c = *q.xc;
  const float* src = q.x + r * c.K;
  int16_t* dst = c.xi.data() + r * c.K;
  int32_t u[kBlock];
  for (int64_t kb = 0; kb < c.KB; ++kb) {
    const float xs = kBlockUnits(src + kb * kBlock, u);
    const BlockInts b = fp8_int::analyse_block(u);
    const size_t at = static_cast<size_t>(kb * c.rows + r);
    c.xs[at] = xs;
    c.shift[at] = static_cast<uint8_t>(b.shift);
    c.cm[at] = fp8_int::pow2f(static_cast<int>(b.shift) - 18);
    c.fits[at] = b.fits() ? 1 : 0;
    c.lim_l1[at] = b.fits() ? fp8_int::sum_limit(b.absmax) : q.wide_limit;
    c.lim_max[at] = b.fits() ? fp8_int::sum_limit(b.l1) : q.wide_limit;
    c.lim_l2[at] = b.fits() ? fp8_int::sum_limit(b.l2) : q.wide_limit;
    if (b.fits()) {
      for (int64_t i = 0; i < kBlock; ++i) dst[kb * kBlock + i] = static_cast<int16_t>(u[i] >> b.shift);
    } else {  // two digits (the tiles' sums of this row are replaced wherever they matter)
      uint8_t* lo = c.xlo.data() + r * c.K + kb * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t v = u[i] >> b.shift;
        dst[kb * kBlock + i] = static_cast<int16_t>(v >> fp8_int::kDigitBits);
        lo[i] = static_cast<uint8_t>(v & ((1 << fp8_int::kDigitBits) - 1));
      }
    }
  }
}

#ifdef CSA_X86
// GCC 12 flags the intrinsics' own _mm*_undefined_* placeholders as (maybe-)uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// block_units_generic in four ymm: the same IEEE operations (the amax, pow2_ceil, the
// multiply by xs's exact reciprocal or the division, the clamp and the rounding to e4m3 as
// e4m3_rne_avx2), so the same xs and units; a NaN amax as quantize_block_avx512's.
CSA_TARGET_AVX2 float block_units_avx2(const float* x, int32_t* u) {  // not inlined: a template argument
  __m256 v[4], amax8 = _mm256_setzero_ps(), nan8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  float amax;
  if (_mm256_movemask_ps(nan8) != 0) {
    amax = Fp8::from_bits(0x7FC00000u);  // torch's amax propagates NaN
  } else {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    if (amax < Fp8::kAmaxFloor) amax = Fp8::kAmaxFloor;
  }
  const float xs = Fp8::pow2_ceil(amax * Fp8::kMaxInv);
  const float inv = Fp8::pow2_reciprocal(xs);
  for (int i = 0; i < 4; ++i) {
    const __m256 q = inv != 0.0f ? _mm256_mul_ps(v[i], _mm256_set1_ps(inv))
                                 : _mm256_div_ps(v[i], _mm256_set1_ps(xs));
    const __m256i units = _mm256_cvttps_epi32(_mm256_mul_ps(e4m3_rne_avx2(q), _mm256_set1_ps(512.0f)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(q, q, _CMP_UNORD_Q));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + 8 * i), _mm256_andnot_si256(nan, units));
  }
  return xs;
}

// quantize_row_body with two zmm per block: the same IEEE operations (the division by xs,
// the clamp, the rounding to e4m3 of fp8_linear.h as bit operations), so the same values.
CSA_TARGET_AVX512 CSA_INLINE __m512i units_avx512(__m512 v) {
  // units = e4m3_rne(clamp(v)) * 512, exact integers with v's sign; NaN -> 0
  // (fp8_int::units_of_value)
  const __m512i units = _mm512_cvttps_epi32(_mm512_mul_ps(e4m3_rne_avx512(v), _mm512_set1_ps(512.0f)));
  return _mm512_maskz_mov_epi32(static_cast<__mmask16>(~_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)),
                                units);
}

// The digits of a block that is not int16 (as quantize_row_body).
CSA_TARGET_AVX512 CSA_INLINE void store_digits_avx512(XChunk& c, int16_t* d, int64_t r, int64_t kb,
                                                     __m512i s0, __m512i s1) {
  const __m512i lowbits = _mm512_set1_epi32((1 << fp8_int::kDigitBits) - 1);
  uint8_t* lo = c.xlo.data() + r * c.K + kb * kBlock;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm512_cvtepi32_epi16(_mm512_srai_epi32(s0, fp8_int::kDigitBits)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16), _mm512_cvtepi32_epi16(_mm512_srai_epi32(s1, fp8_int::kDigitBits)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(_mm512_and_si512(s0, lowbits)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(s1, lowbits)));
}

// One block kb of row r (quantize_row_body's loop body).
CSA_TARGET_AVX512 CSA_INLINE void quantize_block_avx512(XChunk& c, const float* src, int16_t* dst,
                                                       int64_t r, int64_t kb, uint32_t wide_limit) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 x0 = _mm512_loadu_ps(src + kb * kBlock), x1 = _mm512_loadu_ps(src + kb * kBlock + 16);
  float amax;
  if ((_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0) {
    amax = Fp8::from_bits(0x7FC00000u);  // torch's amax propagates NaN
  } else {
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
    if (amax < Fp8::kAmaxFloor) amax = Fp8::kAmaxFloor;
  }
  const float xs = Fp8::pow2_ceil(amax * Fp8::kMaxInv);
  const float inv = Fp8::pow2_reciprocal(xs);
  __m512 q0, q1;
  if (inv != 0.0f) {
    q0 = _mm512_mul_ps(x0, _mm512_set1_ps(inv));
    q1 = _mm512_mul_ps(x1, _mm512_set1_ps(inv));
  } else {
    q0 = _mm512_div_ps(x0, _mm512_set1_ps(xs));
    q1 = _mm512_div_ps(x1, _mm512_set1_ps(xs));
  }
  const __m512i u0 = units_avx512(q0), u1 = units_avx512(q1);
  const __m512i a0 = _mm512_abs_epi32(u0), a1 = _mm512_abs_epi32(u1);
  const uint32_t any = static_cast<uint32_t>(_mm512_reduce_or_epi32(_mm512_or_si512(a0, a1)));
  const uint32_t shift = any != 0 ? static_cast<uint32_t>(__builtin_ctz(any)) : 0u;
  const __m128i sh = _mm_cvtsi32_si128(static_cast<int>(shift));
  const __m512i s0 = _mm512_sra_epi32(u0, sh), s1 = _mm512_sra_epi32(u1, sh);  // exact
  const __m512i m0 = _mm512_srl_epi32(a0, sh), m1 = _mm512_srl_epi32(a1, sh);
  const uint32_t absmax = static_cast<uint32_t>(_mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1)));
  const uint32_t l1 = static_cast<uint32_t>(_mm512_reduce_add_epi32(_mm512_add_epi32(m0, m1)));
  const bool fits = absmax < fp8_int::kInt16Limit;
  uint32_t l2 = 0;
  if (fits) {  // squares below 2^30, two lanes' below 2^31; their sum in 64-bit lanes
    const __m512i sq = _mm512_add_epi32(_mm512_mullo_epi32(m0, m0), _mm512_mullo_epi32(m1, m1));
    const __m512i lo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(sq));
    const __m512i hi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(sq, 1));
    const __m512i wide = _mm512_add_epi64(lo, hi);
    l2 = fp8_int::sqrt_ceil(static_cast<uint64_t>(_mm512_reduce_add_epi64(wide)));
  }
  const size_t at = static_cast<size_t>(kb * c.rows + r);
  c.xs[at] = xs;
  c.shift[at] = static_cast<uint8_t>(shift);
  c.cm[at] = fp8_int::pow2f(static_cast<int>(shift) - 18);
  c.fits[at] = fits ? 1 : 0;
  c.lim_l1[at] = fits ? fp8_int::sum_limit(absmax) : wide_limit;
  c.lim_max[at] = fits ? fp8_int::sum_limit(l1) : wide_limit;
  c.lim_l2[at] = fits ? fp8_int::sum_limit(l2) : wide_limit;
  int16_t* d = dst + kb * kBlock;
  if (fits) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm512_cvtepi32_epi16(s0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16), _mm512_cvtepi32_epi16(s1));
  } else {
    store_digits_avx512(c, d, r, kb, s0, s1);
  }
}

// 16 blocks from kb0 at once, their reductions across blocks (reduce16) rather than one
// horizontal reduction per block: the same values as quantize_block_avx512. Returns false,
// having written nothing, where a block's scale has no exact reciprocal (amax NaN, inf or
// above 2^127 * 448): those take the per-block code.
CSA_TARGET_AVX512 bool quantize_16_blocks_avx512(XChunk& c, const float* src, int16_t* dst, int64_t r,
                                                 int64_t kb0, uint32_t wide_limit) {
  const __m512i abs_bits = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i v[16];
  for (int b = 0; b < 16; ++b) {
    const __m512i x0 = _mm512_loadu_si512(src + (kb0 + b) * kBlock);
    const __m512i x1 = _mm512_loadu_si512(src + (kb0 + b) * kBlock + 16);
    v[b] = _mm512_max_epu32(_mm512_and_si512(x0, abs_bits), _mm512_and_si512(x1, abs_bits));  // NaN: largest
  }
  const __m512i amax_bits = fp8_int::reduce16(v, fp8_int::MaxU32{});
  if (_mm512_cmpgt_epu32_mask(amax_bits, _mm512_set1_epi32(0x7F800000)) != 0) return false;  // NaN
  __m512 amax = _mm512_max_ps(_mm512_castsi512_ps(amax_bits), _mm512_set1_ps(Fp8::kAmaxFloor));
  const __m512i t = _mm512_castps_si512(_mm512_mul_ps(amax, _mm512_set1_ps(Fp8::kMaxInv)));  // > 0
  // Fp8::pow2_ceil (t is positive and finite or inf), then Fp8::pow2_reciprocal
  const __m512i e = _mm512_srli_epi32(t, 23);
  const __mmask16 frac = _mm512_test_epi32_mask(t, _mm512_set1_epi32(0x7FFFFF));
  const __m512i k = _mm512_mask_add_epi32(e, frac, e, _mm512_set1_epi32(1));
  if (_mm512_cmpgt_epu32_mask(k, _mm512_set1_epi32(253)) != 0) return false;  // no reciprocal
  alignas(64) float xs[16], inv[16];
  _mm512_store_si512(xs, _mm512_slli_epi32(k, 23));
  _mm512_store_si512(inv, _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(254), k), 23));

  // units (act_quant's values * 2^9), kept for the second pass; the shifts t_x
  alignas(64) int32_t units[16][kBlock];
  for (int b = 0; b < 16; ++b) {
    const __m512 s = _mm512_set1_ps(inv[b]);
    const __m512i u0 = units_avx512(_mm512_mul_ps(_mm512_loadu_ps(src + (kb0 + b) * kBlock), s));
    const __m512i u1 = units_avx512(_mm512_mul_ps(_mm512_loadu_ps(src + (kb0 + b) * kBlock + 16), s));
    _mm512_store_si512(units[b], u0);
    _mm512_store_si512(units[b] + 16, u1);
    v[b] = _mm512_or_si512(_mm512_abs_epi32(u0), _mm512_abs_epi32(u1));
  }
  const __m512i any = fp8_int::reduce16(v, fp8_int::OrU32{});
  // ctz(any), 0 where any == 0 (lzcnt(0) = 32)
  const __m512i low = _mm512_and_si512(any, _mm512_sub_epi32(_mm512_setzero_si512(), any));
  const __m512i shift = _mm512_max_epi32(_mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(low)),
                                         _mm512_setzero_si512());
  alignas(64) int32_t sh[16];
  _mm512_store_si512(sh, shift);

  // units >> t_x into xi (overwritten below for blocks that are not int16), and the figures
  __m512i vmax[16], vsq[16];
  for (int b = 0; b < 16; ++b) {
    const __m128i n = _mm_cvtsi32_si128(sh[b]);
    const __m512i u0 = _mm512_load_si512(units[b]), u1 = _mm512_load_si512(units[b] + 16);
    const __m512i m0 = _mm512_srl_epi32(_mm512_abs_epi32(u0), n), m1 = _mm512_srl_epi32(_mm512_abs_epi32(u1), n);
    int16_t* d = dst + (kb0 + b) * kBlock;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm512_cvtepi32_epi16(_mm512_sra_epi32(u0, n)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16), _mm512_cvtepi32_epi16(_mm512_sra_epi32(u1, n)));
    vmax[b] = _mm512_max_epu32(m0, m1);
    v[b] = _mm512_add_epi32(m0, m1);
    // squares below 2^30 where the block is int16 (else unused), two lanes' below 2^31
    const __m512i sq = _mm512_add_epi32(_mm512_mullo_epi32(m0, m0), _mm512_mullo_epi32(m1, m1));
    vsq[b] = _mm512_add_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(sq)),
                              _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(sq, 1)));
  }
  const __m512i absmax = fp8_int::reduce16(vmax, fp8_int::MaxU32{});
  const __m512i l1 = fp8_int::reduce16(v, fp8_int::AddU32{});
  for (int i = 0; i < 8; ++i) vsq[i] = fp8_int::fold64<8>(vsq[2 * i], vsq[2 * i + 1]);
  for (int i = 0; i < 4; ++i) vsq[i] = fp8_int::fold64<4>(vsq[2 * i], vsq[2 * i + 1]);
  for (int i = 0; i < 2; ++i) vsq[i] = fp8_int::fold64<2>(vsq[2 * i], vsq[2 * i + 1]);  // blocks 0-7, 8-15
  const __m512i l2 = _mm512_inserti64x4(_mm512_castsi256_si512(fp8_int::sqrt_ceil8(vsq[0])), fp8_int::sqrt_ceil8(vsq[1]), 1);
  const __mmask16 fits = _mm512_cmplt_epu32_mask(absmax, _mm512_set1_epi32(static_cast<int>(fp8_int::kInt16Limit)));

  alignas(64) uint32_t lim_l1[16], lim_max[16], lim_l2[16];
  alignas(64) float cm[16];
  const __m512i wide = _mm512_set1_epi32(static_cast<int>(wide_limit));
  _mm512_store_si512(lim_l1, _mm512_mask_mov_epi32(wide, fits, fp8_int::sum_limit16(absmax)));
  _mm512_store_si512(lim_max, _mm512_mask_mov_epi32(wide, fits, fp8_int::sum_limit16(l1)));
  _mm512_store_si512(lim_l2, _mm512_mask_mov_epi32(wide, fits, fp8_int::sum_limit16(l2)));
  _mm512_store_si512(cm, _mm512_slli_epi32(_mm512_add_epi32(shift, _mm512_set1_epi32(127 - 18)), 23));
  for (int b = 0; b < 16; ++b) {
    const size_t at = static_cast<size_t>((kb0 + b) * c.rows + r);
    const bool fit = (fits >> b) & 1u;
    c.xs[at] = xs[b];
    c.shift[at] = static_cast<uint8_t>(sh[b]);
    c.cm[at] = cm[b];
    c.fits[at] = fit ? 1 : 0;
    c.lim_l1[at] = lim_l1[b];
    c.lim_max[at] = lim_max[b];
    c.lim_l2[at] = lim_l2[b];
    if (!fit) {
      const __m128i n = _mm_cvtsi32_si128(sh[b]);
      store_digits_avx512(c, dst + (kb0 + b) * kBlock, r, kb0 + b, _mm512_sra_epi32(_mm512_load_si512(units[b]), n),
                          _mm512_sra_epi32(_mm512_load_si512(units[b] + 16), n));
    }
  }
  return true;
}

CSA_TARGET_AVX512 void quantize_avx512(const QuantJob& q, int64_t r) {
  XChunk& c = *q.xc;
  const float* src = q.x + r * c.K;
  int16_t* dst = c.xi.data() + r * c.K;
  int64_t kb = 0;
  for (; kb + 16 <= c.KB; kb += 16)
    if (!quantize_16_blocks_avx512(c, src, dst, r, kb, q.wide_limit))
      for (int64_t i = kb; i < kb + 16; ++i) quantize_block_avx512(c, src, dst, r, i, q.wide_limit);
  for (; kb < c.KB; ++kb) quantize_block_avx512(c, src, dst, r, kb, q.wide_limit);
}

// X^T as int16 pairs, rows padded with zeros to a multiple of 16, pairs [p0, p1) (a multiple
// of 16 each: K is one of 32): 16 rows x 16 pairs at a time, transposed in registers (a
// strided 4-byte copy per pair took 4-5% of a 5120 x 512 linear's samples at 1024 rows).
CSA_TARGET_AVX512 void transpose_x_avx512(XChunk& c, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; p += kLanes)
    for (int64_t r = 0; r < c.rows16; r += kLanes) {
      __m512i v[kLanes];
      for (int64_t i = 0; i < kLanes; ++i)
        v[i] = r + i < c.rows ? _mm512_loadu_si512(c.xi.data() + (r + i) * c.K + 2 * p) : _mm512_setzero_si512();
      transpose16(v);
      for (int64_t i = 0; i < kLanes; ++i) _mm512_storeu_si512(c.xt.data() + (p + i) * c.rows16 + r, v[i]);
    }
}
#pragma GCC diagnostic pop
#endif


// ------------------------------------------------------------- instruction-set paths
struct Kernels {
  void (*quantize)(const QuantJob&, int64_t row);
  void (*pack)(const PackJob&);
  void (*flags)(const FlagJob&);
  void (*tiles)(const TaskView&, int64_t r0, int64_t r1);  // rows [r0, r1)
  void (*f_lanes)(const FJob&);
  void (*row_patch)(const RowJob&);
  bool uses_xt;  // f_lanes reads X^T (for more than kSmallRows rows): AVX-512 paths only
  // few rows (<= kSmallRows): conversion and sums in one pass, then the epilogue (or null);
  // a pairs16 W: sums and epilogue in one pass, the flagged groups' pairs apart (AVX2 has
  // these two only: its few rows of a plain W take the pack and the tiles)
  void (*dot_small)(const SmallJob&) = nullptr;
  void (*epilogue_small)(const TaskView&, const int32_t* sums) = nullptr;
  void (*flagged_pairs)(const SmallJob&) = nullptr;
  void (*dot_fused)(const SmallJob&, const TaskView&) = nullptr;
  bool dot_small_fp16 = false;  // dot_small converts W by AVX512-FP16 (else by tables)
  // the tiles sum a row whose block is not int16 in two digits themselves (AVX-512): act_quant
  // then leaves such rows unflagged (QuantJob::wide_limit), with no row patches
  bool tiles_sum_wide_rows = false;
};

void quantize_scalar(const QuantJob& q, int64_t r) { quantize_row_body<block_units_generic>(q, r); }
void pack_scalar(const PackJob& j) { pack_generic(j); }
void flags_scalar(const FlagJob& j) { flags_generic(j); }
void tiles_scalar(const TaskView& v, int64_t r0, int64_t r1) { tiles_generic(v, r0, r1); }
void f_lanes_scalar(const FJob& j) { f_lanes_generic(j); }
void row_patch_scalar(const RowJob& j) { row_patch_generic(j); }
const Kernels kScalarKernels{quantize_scalar, pack_scalar, flags_scalar, tiles_scalar,
                             f_lanes_scalar, row_patch_scalar, false};

#ifdef CSA_X86
CSA_TARGET_AVX2 void quantize_avx2(const QuantJob& q, int64_t r) { quantize_row_body<block_units_avx2>(q, r); }
CSA_TARGET_AVX2 void pack_avx2(const PackJob& j) {
  if (j.w.pairs16) {
    pack_avx2_body<false>(j);
  } else {
    pack_avx2_body<true>(j);
  }
}
CSA_TARGET_AVX2 void flags_avx2(const FlagJob& j) { flags_generic(j); }
CSA_TARGET_AVX2 void tiles_avx2(const TaskView& v, int64_t r0, int64_t r1) { tiles_avx2_body(v, r0, r1); }
CSA_TARGET_AVX2 void f_lanes_avx2(const FJob& j) { f_lanes_avx2_body(j); }
CSA_TARGET_AVX2 void row_patch_avx2(const RowJob& j) { row_patch_avx2_body(j); }
CSA_TARGET_AVX2 void dot_fused_avx2(const SmallJob& j, const TaskView& v) { dot_fused_avx2_body(j, v); }
CSA_TARGET_AVX2 void flagged_pairs_avx2(const SmallJob& j) { flagged_pairs_avx2_body(j); }
Kernels avx2_kernels() {
  Kernels k{quantize_avx2, pack_avx2, flags_avx2, tiles_avx2, f_lanes_avx2, row_patch_avx2, false};
  k.flagged_pairs = flagged_pairs_avx2;  // few rows of a pairs16 W only (no dot_small)
  k.dot_fused = dot_fused_avx2;
  return k;
}

CSA_TARGET_AVX512 void pack_avx512(const PackJob& j) { pack_generic(j); }
CSA_TARGET_AVX512_VBMI void pack_avx512_vbmi(const PackJob& j) { pack_vbmi_body(j); }
CSA_TARGET_AVX512 void flags_avx512(const FlagJob& j) { flags_avx512_body(j); }
CSA_TARGET_AVX512 void tiles_avx512_madd(const TaskView& v, int64_t r0, int64_t r1) {
  tiles_avx512_body<false>(v, r0, r1);
}
CSA_TARGET_AVX512 void tiles_avx512_vnni(const TaskView& v, int64_t r0, int64_t r1) {
  tiles_avx512_body<true>(v, r0, r1);
}
CSA_TARGET_AVX512 void f_lanes_avx512_madd(const FJob& j) { f_lanes_avx512_body<false>(j); }
CSA_TARGET_AVX512 void f_lanes_avx512_vnni(const FJob& j) { f_lanes_avx512_body<true>(j); }
CSA_TARGET_AVX512 void row_patch_avx512_madd(const RowJob& j) { row_patch_avx512_body<false>(j); }
CSA_TARGET_AVX512 void row_patch_avx512_vnni(const RowJob& j) { row_patch_avx512_body<true>(j); }
CSA_TARGET_AVX512_VBMI void dot_small_madd(const SmallJob& j) { dot_small_body<false, false>(j); }
CSA_TARGET_AVX512_VBMI void dot_small_vnni(const SmallJob& j) { dot_small_body<true, false>(j); }
CSA_TARGET_AVX512_VBMI void dot_small_fp16_madd(const SmallJob& j) { dot_small_body<false, true>(j); }
CSA_TARGET_AVX512_VBMI void dot_small_fp16_vnni(const SmallJob& j) { dot_small_body<true, true>(j); }
CSA_TARGET_AVX512 void epilogue_small_avx512(const TaskView& v, const int32_t* sums) {
  epilogue_small_body(v, sums);
}
CSA_TARGET_AVX512_VBMI void flagged_pairs_vbmi(const SmallJob& j) { store_flagged_pairs(j); }
CSA_TARGET_AVX512_VBMI void dot_fused_madd(const SmallJob& j, const TaskView& v) { dot_fused_body<false, false>(j, v); }
CSA_TARGET_AVX512_VBMI void dot_fused_vnni(const SmallJob& j, const TaskView& v) { dot_fused_body<true, false>(j, v); }
CSA_TARGET_AVX512_VBMI void dot_fused_fp16_madd(const SmallJob& j, const TaskView& v) {
  dot_fused_body<false, true>(j, v);
}
CSA_TARGET_AVX512_VBMI void dot_fused_fp16_vnni(const SmallJob& j, const TaskView& v) {
  dot_fused_body<true, true>(j, v);
}
#endif

enum class Path { kScalar, kAvx2, kAvx512Plain, kAvx512NoFp16, kAvx512 };

bool cpu_supports(const char* feature) {
#ifdef CSA_X86
  __builtin_cpu_init();
  if (std::strcmp(feature, "avx512vbmi") == 0) return __builtin_cpu_supports("avx512vbmi");
  if (std::strcmp(feature, "avx512vnni") == 0) return __builtin_cpu_supports("avx512vnni");
#endif
  (void)feature;
  return false;
}

Kernels kernels_for(Path path) {
#ifdef CSA_X86
  if (path == Path::kAvx2) return avx2_kernels();
  if (path == Path::kAvx512Plain) {
    Kernels k{quantize_avx512, pack_avx512, flags_avx512, tiles_avx512_madd, f_lanes_avx512_madd,
              row_patch_avx512_madd, true};
    k.tiles_sum_wide_rows = true;
    return k;
  }
  if (path == Path::kAvx512 || path == Path::kAvx512NoFp16) {
    const bool vnni = cpu_supports("avx512vnni"), vbmi = cpu_supports("avx512vbmi");
    const bool fp16 = path == Path::kAvx512 && cpu_has_avx512fp16_gfni();
    Kernels k{quantize_avx512, vbmi ? pack_avx512_vbmi : pack_avx512,
              flags_avx512, vnni ? tiles_avx512_vnni : tiles_avx512_madd,
              vnni ? f_lanes_avx512_vnni : f_lanes_avx512_madd,
              vnni ? row_patch_avx512_vnni : row_patch_avx512_madd, true};
    k.tiles_sum_wide_rows = true;
    if (vbmi) {
      k.dot_small = fp16 ? (vnni ? dot_small_fp16_vnni : dot_small_fp16_madd)
                         : (vnni ? dot_small_vnni : dot_small_madd);
      k.dot_small_fp16 = fp16;
      k.epilogue_small = epilogue_small_avx512;
      k.flagged_pairs = flagged_pairs_vbmi;
      k.dot_fused = fp16 ? (vnni ? dot_fused_fp16_vnni : dot_fused_fp16_madd)
                         : (vnni ? dot_fused_vnni : dot_fused_madd);
    }
    return k;
  }
#endif
  (void)path;
  return kScalarKernels;
}

Path select_path() {
  const char* forced = std::getenv("CSA_FP8_LINEAR_ISA");
  if (forced != nullptr && std::strcmp(forced, "avx512-novbmi") == 0) {
    if (!cpu_has(Isa::kAvx512))
      fail(kOp, "CSA_FP8_LINEAR_ISA=avx512-novbmi but this CPU does not support it");
    return Path::kAvx512Plain;
  }
  if (forced != nullptr && std::strcmp(forced, "avx512-nofp16") == 0) {
    if (!cpu_has(Isa::kAvx512))
      fail(kOp, "CSA_FP8_LINEAR_ISA=avx512-nofp16 but this CPU does not support it");
    return Path::kAvx512NoFp16;
  }
  switch (select_isa("CSA_FP8_LINEAR_ISA", /*has_reference=*/false, /*has_bf16=*/true)) {
    case Isa::kAvx512:
    case Isa::kAvx512Bf16: return Path::kAvx512;
    case Isa::kAvx2: return Path::kAvx2;
    default: return Path::kScalar;
  }
}

// ------------------------------------------------------------------ one task
// Everything a task reads; the task writes its rows x columns of Y only.
struct Call {
  Kernels kern;
  const WMeta* meta;
  const uint8_t* w;
  const float* ws;    // [NB][KB]
  const float* x;     // the chunk's first row
  const XChunk* xc;
  float* y;           // the chunk's first output row
  int64_t N, K, KB, NB, panels;
  bool round_output;  // Y through bfloat16 (the graph's Cast pair, fused)
  bool fold_scales;   // scales_fold(WScale): the tiles' one multiply per lane
};

// The override slots of one task and block chunk: exact float sums of the lanes the tiles'
// int32 sums do not cover.
struct Overrides {
  std::vector<float> pool;
  const float* slot[kMaxChunkKb * kGroups] = {};
  // the tiles' wide sums (XChunk::tiles_sum_wide_rows): each W block that is not int16 as
  // its 32 units >> t_w, [kbs][kGroups][16 lanes][32] (only its lanes that are not int16)
  std::vector<int32_t> wide_w;
  const uint16_t* bad = nullptr;  // [kbs][kGroups]: the chunk's run of WMeta::panel_bad

  // Whether block kbi has lanes that are not int16 in any group (four groups, one load).
  bool any_bad(int64_t kbi) const {
    uint64_t four;
    static_assert(kGroups * sizeof(uint16_t) == sizeof four);
    std::memcpy(&four, bad + kbi * kGroups, sizeof four);
    return four != 0;
  }
};

// The slot rows of flagged (row, block, group)s: the row's block in two digits against the
// group's int16 lanes (row_patch); for a row whose block is not int16, its lanes that are not
// int16 too (int64 per lane; f_lanes' values there assumed an int16 row). Where the tiles sum
// such rows themselves (XChunk::tiles_sum_wide_rows), they write those lanes too.
struct Patch {
  const Call& c;
  const XChunk& xc;
  const WMeta& meta;
  int64_t panel, r0, rows, kb0, kbs;
  const int16_t* pw;
  const uint8_t* flags;
  Overrides& ov;
  uint64_t& row_sums;   // (row, block, group)s summed in two digits
  uint64_t& wide_sums;  // (row, block, column)s summed in int64

  void rows_between(int64_t ra, int64_t rb) const {
    for (int64_t kbi = 0; kbi < kbs; ++kbi) rows_of_block(kbi, ra, rb);
  }

  // Block kbi's flagged rows in [ra, rb).
  void rows_of_block(int64_t kbi, int64_t ra, int64_t rb) const {
    int32_t h[kBlock], l[kBlock], ux[kBlock], uw[kBlock];
    uint8_t wbuf[kBlock];
    const WView wv = meta.view(c.w);
    const int64_t kb = kb0 + kbi;
    const bool any_bad = ov.any_bad(kbi);
    const uint8_t* fits_row = xc.fits.data() + kb * xc.rows + r0;
    const uint8_t* flag_row = flags + kbi * rows;
    // the flagged rows' blocks of X, fetched together rather than one miss at a time
    for (int64_t r = ra; r < rb; ++r) {
      if (r + 8 <= rb) {  // 8 flags at a time: most are 0
        uint64_t f8;
        std::memcpy(&f8, flag_row + r, 8);
        if (f8 == 0) {
          r += 7;
          continue;
        }
      }
      if (flag_row[r] != 0) __builtin_prefetch(xc.xi.data() + (r0 + r) * c.K + kb * kBlock);
    }
    for (int64_t r = ra; r < rb; ++r) {
      // 8 rows at a time while none of them needs anything
      if (r + 8 <= rb) {
        uint64_t f8, fits8;
        std::memcpy(&f8, flag_row + r, 8);
        std::memcpy(&fits8, fits_row + r, 8);
        if (f8 == 0 && (!any_bad || fits8 == 0x0101010101010101ull)) {
          r += 7;
          continue;
        }
      }
      const uint32_t fl = flag_row[r];
      const bool fits = fits_row[r] != 0;
      if (fl == 0 && (fits || !any_bad)) continue;
      RowJob job;
      job.x = xc.xi.data() + (r0 + r) * c.K + kb * kBlock;
      job.xlo = xc.xlo.data() + (r0 + r) * c.K + kb * kBlock;
      job.fits = fits;
      job.pw = pw + kbi * kPairs * kPanel * 2;
      job.groups = fl;
      job.bad = ov.bad + kbi * kGroups;
      for (int64_t gi = 0; gi < kGroups; ++gi)
        job.out[gi] = const_cast<float*>(ov.slot[kbi * kGroups + gi]) + r * kLanes;
      if (fl != 0) {
        c.kern.row_patch(job);
        row_sums += static_cast<uint64_t>(__builtin_popcount(fl));
      }
      if (fits || !any_bad || xc.tiles_sum_wide_rows) continue;  // (else the tiles' own)
      // a block that is not int16 against lanes that are not int16: int64 per lane
      row_digits(job, h, l);
      for (int64_t i = 0; i < kBlock; ++i) ux[i] = h[i] * (1 << fp8_int::kDigitBits) + l[i];
      for (int64_t gi = 0; gi < kGroups; ++gi) {
        for (uint32_t bad = ov.bad[kbi * kGroups + gi]; bad != 0; bad &= bad - 1) {
          const int64_t i = __builtin_ctz(bad);
          const int64_t col = panel * kPanel + gi * kLanes + i;
          const uint8_t* codes = wv.codes(col, kb, wbuf);
          for (int64_t e = 0; e < kBlock; ++e) uw[e] = fp8_int::kUnits.v[codes[e]];
          const uint32_t tw = *wv.shift_at(kb, col);
          job.out[gi][i] = fp8_int::exact_dot(ux, 0, uw, tw);
          ++wide_sums;
        }
      }
    }
  }
};

// A chunk's override slots, a K block at a time: a slot where a group has flagged rows or
// lanes that are not int16 (the pool has room for all, so that one pass assigns them; slot
// 0 is the dummy the others share: the tiles read it under an all-zero mask), and there the
// lanes that are not int16 against every row (f_lanes; exact when the row's block is int16).
// Most blocks need neither: a block's four groups are tested at once.
struct SlotFiller {
  const Call& c;
  const XChunk& xc;
  const WView& wv;
  Overrides& ov;
  int64_t panel, r0, rows, kb0;
  const uint8_t* any;  // [kbs]: bit c, group c has flagged rows
  float* f;            // f_lanes' output, [rows16]
  uint64_t& lane_sums;
  size_t slot_floats = static_cast<size_t>(rows * kLanes);
  size_t slots = 0;

  bool needs(int64_t kbi) const { return ov.any_bad(kbi) || any[kbi] != 0; }

  void block(int64_t kbi) {
    const uint16_t* bad4 = ov.bad + kbi * kGroups;
    if (!needs(kbi)) {
      for (int64_t gi = 0; gi < kGroups; ++gi) ov.slot[kbi * kGroups + gi] = ov.pool.data();
      return;
    }
    const int64_t kb = kb0 + kbi;
    uint8_t wbuf[kBlock];  // a pairs16 W block's codes
    for (int64_t gi = 0; gi < kGroups; ++gi) {
      const bool need = bad4[gi] != 0 || ((any[kbi] >> gi) & 1u);
      float* slot = ov.pool.data() + (need ? ++slots : 0) * slot_floats;
      ov.slot[kbi * kGroups + gi] = slot;
      for (uint32_t bad = bad4[gi]; bad != 0; bad &= bad - 1) {
        const int64_t i = __builtin_ctz(bad);
        const int64_t col = panel * kPanel + gi * kLanes + i;
        const FJob job{xc.xi.data() + r0 * c.K + kb * kBlock,
                       c.K,
                       !c.kern.uses_xt || xc.rows <= kSmallRows
                           ? nullptr
                           : xc.xt.data() + (kb * kPairs) * xc.rows16 + r0,
                       xc.rows16,
                       rows,
                       wv.codes(col, kb, wbuf),
                       *wv.shift_at(kb, col),  // the panel's run: cached, unlike shift_rows
                       f};
        c.kern.f_lanes(job);
        for (int64_t r = 0; r < rows; ++r) slot[r * kLanes + i] = f[r];
        ++lane_sums;
        if (xc.tiles_sum_wide_rows) {  // for the tiles' wide sums (rows not int16)
          int32_t* u = ov.wide_w.data() + ((kbi * kGroups + gi) * kLanes + i) * kBlock;
          for (int64_t e = 0; e < kBlock; ++e) u[e] = fp8_int::kUnits.v[job.codes[e]] >> job.t;
        }
      }
    }
  }
};

// What the fused few-rows kernel (pairs16 W) asks for before it reaches K block kbi
// (SmallJob::fill): the block's slots, the pairs of its groups with flagged rows and those
// rows' patches, computed while the block's W is in cache (the kernel prefetches it; done
// before the kernel, these scattered reads of W came first and missed: 1.5x the time).
struct BlockFill {
  SlotFiller& slots;
  const Patch& patch;
  const SmallJob& job;

  static void run(void* self, int64_t kbi) {
    BlockFill& b = *static_cast<BlockFill*>(self);
    b.slots.block(kbi);
    if (b.job.flagged[kbi] != 0) {
      SmallJob one = b.job;  // the block's own view: its pairs at pw, its 2^t at g
      one.kb0 += kbi;
      one.kbs = 1;
      one.flagged += kbi;
      one.pw += kbi * kPairs * kPanel * 2;
      one.g += kbi * kPanel;
      b.slots.c.kern.flagged_pairs(one);
    }
    b.patch.rows_of_block(kbi, 0, b.patch.rows);
  }
};

// A thread's buffers, kept between tasks and calls (they only grow): a task writes every
// element it reads.
struct Scratch {
  std::vector<int16_t> pw;
  std::vector<float> g, out, f;
  std::vector<uint8_t> flags;
  std::vector<uint64_t> masks;
  std::vector<int32_t> sums, tsum;
  std::vector<int16_t> xp;
  Overrides ov;

  template <typename T>
  static T* at_least(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

// What one task adds to the op's counters (summed by the caller once per call: two threads
// adding to one shared cache line at every task measurably slowed the few-rows path).
struct TaskCounts {
  uint64_t small_tasks = 0, fp16_tasks = 0, lane_sums = 0, row_sums = 0, wide_sums = 0;
  uint64_t tile_wide_rows = 0;
};

// The calling thread's buffers, reached once per task: with the thread_local named inside
// run_task, GCC re-derived its address (a __tls_get_addr call) after every opaque call, once
// per K block (1.6% of a one-row call's samples).
__attribute__((noinline)) Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

void run_task(const Call& c, int64_t task, TaskCounts& tally) {
  const XChunk& xc = *c.xc;
  const WMeta& meta = *c.meta;
  const int64_t panel = task % c.panels;
  const int64_t r0 = (task / c.panels) * kTaskRows;
  const int64_t rows = xc.rows - r0 < kTaskRows ? xc.rows - r0 : kTaskRows;
  const int64_t rows16 = (rows + kLanes - 1) / kLanes * kLanes;
  Scratch& scratch = thread_scratch();
  // pairs16 W: sums and epilogue in one pass (dot_fused), each block's slots filled as the
  // kernel reaches it (BlockFill); no sums buffer
  const bool fused = rows <= kSmallRows && c.meta->pairs16 && c.kern.dot_fused != nullptr;
  const bool small = fused || (rows <= kSmallRows && c.kern.dot_small != nullptr);
  const int64_t chunk = small ? kSmallChunkKb : kChunkKb;  // K blocks a step
  int16_t* pw = Scratch::at_least(scratch.pw, static_cast<size_t>(chunk * kPairs * kPanel * 2));
  float* g = Scratch::at_least(scratch.g, static_cast<size_t>(chunk * kPanel));
  float* out = Scratch::at_least(scratch.out, static_cast<size_t>(rows * kPanel));
  float* f = Scratch::at_least(scratch.f, static_cast<size_t>(rows16));
  uint8_t* flags = Scratch::at_least(scratch.flags, static_cast<size_t>(chunk * rows));
  uint64_t* masks = Scratch::at_least(scratch.masks, static_cast<size_t>(chunk * rows));
  // dot_rows_vbmi's sums and scratch
  const bool rows_kernel = small && !fused;
  int32_t* sums =
      rows_kernel ? Scratch::at_least(scratch.sums, static_cast<size_t>(chunk * kGroups * rows * kLanes))
                  : nullptr;
  int16_t* xp = rows_kernel ? Scratch::at_least(scratch.xp, static_cast<size_t>(rows * kXpRow)) : nullptr;
  int32_t* tsum =
      rows_kernel ? Scratch::at_least(scratch.tsum, static_cast<size_t>(rows * kPanel * kTsumLd)) : nullptr;
  Overrides& ov = scratch.ov;
  uint64_t lane_sums = 0, row_sums = 0, wide_sums = 0, tile_wide_rows = 0;
  std::memset(out, 0, static_cast<size_t>(rows * kPanel) * sizeof(float));
  const WView wv = meta.view(c.w);
  const float* ws0 = c.ws + (2 * panel) * c.KB;
  const float* ws1 = 2 * panel + 1 < c.NB ? ws0 + c.KB : ws0;  // no second half: unused
  for (int64_t kb0 = 0; kb0 < c.KB; kb0 += chunk) {
    const int64_t kbs = c.KB - kb0 < chunk ? c.KB - kb0 : chunk;

    // the flags of (row, block, group) whose int32 sums may overflow, from the groups'
    // figures (the chunk's entries only: a chunk of few rows spans up to 256 blocks)
    const size_t figures = static_cast<size_t>(panel_group_index(c.KB, kb0, panel * kGroups));
    ov.bad = meta.panel_bad.data() + figures;
    c.kern.flags({xc.lim_l1.data() + r0, xc.lim_max.data() + r0, xc.lim_l2.data() + r0, xc.rows,
                  rows, kb0, kbs, meta.panel_l1max.data() + figures,
                  meta.panel_absmax.data() + figures, meta.panel_l2max.data() + figures, ov.bad,
                  flags, masks});
    uint8_t any[kMaxChunkKb] = {};
    for (int64_t kbi = 0; kbi < kbs; ++kbi)
      for (int64_t r = 0; r < rows; ++r) any[kbi] = static_cast<uint8_t>(any[kbi] | flags[kbi * rows + r]);

    const size_t slot_floats = static_cast<size_t>(rows * kLanes);
    Scratch::at_least(ov.pool, static_cast<size_t>(kbs * kGroups + 1) * slot_floats);
    if (xc.tiles_sum_wide_rows && meta.any_bad)
      Scratch::at_least(ov.wide_w, static_cast<size_t>(kbs * kGroups * kLanes * kBlock));
    SlotFiller slots{c, xc, wv, ov, panel, r0, rows, kb0, any, f, lane_sums};
    const TaskView view{xc.xi.data() + r0 * c.K, c.K, c.KB, xc.cm.data() + r0,
                        xc.xs.data() + r0, xc.rows, rows, kb0, kbs, pw, g,
                        wv.shift_at(0, panel * kPanel), ws0, ws1, masks, ov.slot, ov.bad, out,
                        c.fold_scales, xc.fits.data() + r0, xc.xlo.data() + r0 * c.K,
                        xc.tiles_sum_wide_rows ? &tile_wide_rows : nullptr, ov.wide_w.data(),
                        &wide_sums};
    const Patch patch{c, xc, meta, panel, r0, rows, kb0, kbs, pw, flags, ov, row_sums, wide_sums};
    SmallJob job{wv, panel, kb0, kbs, xc.xi.data() + r0 * c.K, c.K, rows, any, pw, g, sums, xp, tsum};
    if (fused) {
      uint8_t need[kMaxChunkKb];
      for (int64_t kbi = 0; kbi < kbs; ++kbi) {
        need[kbi] = slots.needs(kbi) ? 1 : 0;
        if (!need[kbi]) slots.block(kbi);  // the dummy slots
      }
      BlockFill fill{slots, patch, job};
      job.need = need;
      job.fill = &BlockFill::run;
      job.fill_ctx = &fill;
      c.kern.dot_fused(job, view);
      continue;
    }

    // W's int16 pairs (few rows: straight into the sums, the pairs kept where flagged rows
    // need them)
    if (small) {
      c.kern.dot_small(job);
    } else {
      c.kern.pack({wv, panel, kb0, kbs, pw, g});
    }
    for (int64_t kbi = 0; kbi < kbs; ++kbi) slots.block(kbi);
    if (small) {
      patch.rows_between(0, rows);
      c.kern.epilogue_small(view, sums);
    } else {
      // a few rows at a time: their flagged blocks, then their tiles (X's rows still cached)
      constexpr int64_t kPatchRows = 48;
      for (int64_t r = 0; r < rows; r += kPatchRows) {
        const int64_t r1 = r + kPatchRows < rows ? r + kPatchRows : rows;
        patch.rows_between(r, r1);
        c.kern.tiles(view, r, r1);
      }
    }
  }

  const int64_t n0 = panel * kPanel;
  const int64_t cols = c.N - n0 < kPanel ? c.N - n0 : kPanel;
  for (int64_t r = 0; r < rows; ++r) {
    float* y = c.y + (r0 + r) * c.N + n0;
    const float* o = out + r * kPanel;
    if (c.round_output) {
      for (int64_t i = 0; i < cols; ++i) y[i] = ort_cast::cast_bf16(o[i]);
    } else {
      std::memcpy(y, o, static_cast<size_t>(cols) * sizeof(float));
    }
  }
  tally = {small ? 1u : 0u, small && c.kern.dot_small_fp16 ? 1u : 0u, lane_sums, row_sums, wide_sums,
           tile_wide_rows};
}

// Attributes and node I/O, checked when the session creates the kernel.
struct NodeAttributes {
  bool fast = false;          // numerics "fast"
  bool round_output = false;  // round_output 1
  bool pairs16 = false;       // weight_layout "pairs16"
};

NodeAttributes check_node(const OrtKernelInfo* info) {
  require_node_io(info, kOp, 3, 1);
  const int64_t block_size =
      optional_attribute<int64_t>(info, kOp, "block_size", "an int").value_or(kBlock);
  if (block_size != kBlock)
    fail(kOp, "block_size must be 32 (the only size supported), got " + std::to_string(block_size));
  const int64_t round =
      optional_attribute<int64_t>(info, kOp, "round_output", "an int").value_or(0);
  if (round != 0 && round != 1)
    fail(kOp, "round_output must be 0 or 1, got " + std::to_string(round));
  const std::string layout =
      optional_attribute<std::string>(info, kOp, "weight_layout", "a string").value_or("plain");
  if (layout != "plain" && layout != "pairs16")
    fail(kOp, "unknown weight_layout \"" + layout + "\" (expected \"plain\" or \"pairs16\")");
  return {numerics_is_fast(info, kOp), round == 1, layout == "pairs16"};
}

// numerics "fast" runs fp8_linear_fast.cc where the path is avx512bf16 (the default on a
// CPU with AVX512-BF16) and the CPU has AVX512-VBMI and GFNI too; elsewhere (and with
// CSA_FP8_LINEAR_ISA / CSA2ONNX_ISA = avx512, avx2, scalar, or the tests' avx512-novbmi and
// avx512-nofp16) it is the exact kernel, the fastest that CPU has.
bool fast_path_available() {
  const char* forced = std::getenv("CSA_FP8_LINEAR_ISA");
  const bool test_path = forced != nullptr && (std::strcmp(forced, "avx512-novbmi") == 0 ||
                                               std::strcmp(forced, "avx512-nofp16") == 0);
  if (test_path) return false;
  return select_isa("CSA_FP8_LINEAR_ISA", false, true) == Isa::kAvx512Bf16 &&
         fp8_fast::cpu_supported();
}

struct Fp8LinearKernel {
  Kernels kern;
  WMeta constant_meta;  // W's figures when W is a constant initializer
  bool fast = false;    // numerics "fast" on a CPU that has its kernel
  bool amx = false;     // ... and AMX-BF16 for its prefill tiles
  bool round_output = false;
  bool pairs16 = false;  // W's layout

  Fp8LinearKernel(const OrtApi*, const OrtKernelInfo* info) : kern(kernels_for(select_path())) {
    const NodeAttributes attributes = check_node(info);
    pairs16 = attributes.pairs16;
    fast = attributes.fast && fast_path_available() && !pairs16;  // fp8_fast reads plain W
    amx = fast && fp8_fast::amx_supported();
    round_output = attributes.round_output;
    const Ort::ConstValue w = constant_input(info, 1);
    if (w == nullptr) return;  // not a constant: its figures are computed on every call
    const std::vector<int64_t> shape = w.GetTensorTypeAndShapeInfo().GetShape();
    const size_t rank = pairs16 ? 3 : 2;
    if (shape.size() != rank || shape[0] < 0 || shape[1] < 0 ||
        (pairs16 ? shape[2] != kPairs16Bytes : shape[1] % kBlock != 0))
      return;  // Compute reports it
    constant_meta.reset(pairs16 ? shape[0] * kLanes : shape[0], pairs16 ? shape[1] * kBlock : shape[1],
                        pairs16);
    constant_meta.build(static_cast<const uint8_t*>(w.GetTensorRawData()), 0,
                        constant_meta.groups);
    constant_meta.finish();
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<Ort::Float8E4M3FN_t>& w,
                      const Ort::Custom::Tensor<float>& wscale, Ort::Custom::Tensor<float>& y) {
    return status_of([&] { Run(ctx, x, w, wscale, y); });
  }

  // fn(i) for i in [0, count): on onnxruntime's pool unless `work` is below `serial`
  // (kernel_support.h run_tasks); fn must not throw.
  template <typename Fn>
  static void for_each(OrtKernelContext* ctx, int64_t work, int64_t serial, int64_t count,
                       Fn& fn) {
    auto call = [](void* data, size_t i) { (*static_cast<Fn*>(data))(static_cast<int64_t>(i)); };
    run_tasks(ctx, work, serial, static_cast<size_t>(count), call, &fn);
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
           const Ort::Custom::Tensor<Ort::Float8E4M3FN_t>& w,
           const Ort::Custom::Tensor<float>& wscale, Ort::Custom::Tensor<float>& y) const {
    const std::vector<int64_t> x_shape = x.Shape();
    const Dims d = check_shapes(x_shape, w.Shape(), wscale.Shape(), pairs16);
    std::vector<int64_t> y_shape = x_shape;
    y_shape.back() = d.N;
    float* out = y.Allocate(y_shape);
    if (d.M == 0 || d.N == 0) return;
    if (d.K == 0) {
      for (int64_t i = 0; i < d.M * d.N; ++i) out[i] = 0.0f;
      return;
    }
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(w.Data());
    counts.calls.fetch_add(1, std::memory_order_relaxed);
    const int64_t work = d.M * d.N * d.K;  // multiply-adds
    const float nan = Fp8::from_bits(0x7FC00000u);
    if (fast &&
        fp8_fast::run(ctx, {x.Data(), codes, wscale.Data(), out, d.M, d.N, d.K, round_output,
                                amx})) {
      counts.fast_calls.fetch_add(1, std::memory_order_relaxed);
      if (amx && d.M >= fp8_fast::kAmxMinRows)
        counts.fast_amx_calls.fetch_add(1, std::memory_order_relaxed);
      const bool known = constant_meta.n == d.N && constant_meta.k == d.K;
      for (const int64_t col : known ? constant_meta.nan_columns
                                     : fp8_fast::nan_columns(codes, d.N, d.K))
        for (int64_t m = 0; m < d.M; ++m) out[m * d.N + col] = nan;  // a bf16 value already
      return;
    }

    WMeta per_call;
    const WMeta* meta = &constant_meta;
    if (constant_meta.n != d.N || constant_meta.k != d.K) {
      per_call.reset(d.N, d.K, pairs16);
      constexpr int64_t kGroupsPerTask = 8;
      const int64_t parts = (per_call.groups + kGroupsPerTask - 1) / kGroupsPerTask;
      auto build = [&](int64_t i) {
        const int64_t g1 = (i + 1) * kGroupsPerTask;
        per_call.build(codes, i * kGroupsPerTask, g1 < per_call.groups ? g1 : per_call.groups);
      };
      for_each(ctx, d.N * d.K, serial_below::kElements, parts, build);
      per_call.finish();
      meta = &per_call;
    }

    const int64_t chunk = d.M < kTaskRows ? d.M : kTaskRows;
    // kept between calls (no fresh pages to fault in on every call); the lambdas below run on
    // pool threads, so they must reach it through this reference, not the thread_local's name
    thread_local XChunk chunk_buffers;
    XChunk& xc = chunk_buffers;
    xc.reserve(chunk, d.K);
    const bool uses_xt = kern.uses_xt && meta->any_bad;
    std::atomic<bool> failed{false};
    Call call{kern, meta, codes, wscale.Data(), nullptr, &xc, nullptr,
              d.N, d.K, d.KB, d.NB, (d.N + kPanel - 1) / kPanel, round_output,
              d.M > kSmallRows && scales_fold(wscale.Data(), d.NB * d.KB)};
    if (call.fold_scales) counts.folded_calls.fetch_add(1, std::memory_order_relaxed);
    for (int64_t m0 = 0; m0 < d.M; m0 += chunk) {
      xc.rows = d.M - m0 < chunk ? d.M - m0 : chunk;
      xc.rows16 = (xc.rows + kLanes - 1) / kLanes * kLanes;
      xc.tiles_sum_wide_rows = kern.tiles_sum_wide_rows && xc.rows > kSmallRows;
      const QuantJob quant{x.Data() + m0 * d.K, &xc, xc.tiles_sum_wide_rows ? 0xFFFFFFFFu : 0u};
      auto quantize = [&](int64_t r) { kern.quantize(quant, r); };
      for_each(ctx, xc.rows * d.K, serial_below::kElements, xc.rows, quantize);
      if (uses_xt && xc.rows > kSmallRows) {
        XChunk::grow(xc.xt, static_cast<size_t>((d.K / 2) * xc.rows16));
        constexpr int64_t kPairsPerTask = 256;
        const int64_t parts = (d.K / 2 + kPairsPerTask - 1) / kPairsPerTask;
        auto transpose = [&](int64_t i) {
          const int64_t p1 = (i + 1) * kPairsPerTask;
#ifdef CSA_X86
          transpose_x_avx512(xc, i * kPairsPerTask, p1 < d.K / 2 ? p1 : d.K / 2);
#endif
        };
        for_each(ctx, xc.rows16 * d.K / 2, serial_below::kElements, parts, transpose);
      }
      call.x = x.Data() + m0 * d.K;
      call.y = out + m0 * d.N;
      const int64_t tasks = call.panels * ((xc.rows + kTaskRows - 1) / kTaskRows);
      std::vector<TaskCounts> tallies(static_cast<size_t>(tasks));
      auto task = [&](int64_t t) {
        try {
          run_task(call, t, tallies[static_cast<size_t>(t)]);
        } catch (...) {  // allocation failure inside a pool thread: reported below
          failed.store(true);
        }
      };
      for_each(ctx, work, serial_below::kMultiplyAdds, tasks, task);
      if (failed.load()) throw std::bad_alloc();
      TaskCounts sum;
      for (const TaskCounts& t : tallies) {
        sum.small_tasks += t.small_tasks;
        sum.fp16_tasks += t.fp16_tasks;
        sum.lane_sums += t.lane_sums;
        sum.row_sums += t.row_sums;
        sum.wide_sums += t.wide_sums;
        sum.tile_wide_rows += t.tile_wide_rows;
      }
      counts.small_tasks.fetch_add(sum.small_tasks, std::memory_order_relaxed);
      counts.fp16_tasks.fetch_add(sum.fp16_tasks, std::memory_order_relaxed);
      counts.lane_sums.fetch_add(sum.lane_sums, std::memory_order_relaxed);
      counts.row_sums.fetch_add(sum.row_sums, std::memory_order_relaxed);
      counts.wide_sums.fetch_add(sum.wide_sums, std::memory_order_relaxed);
      counts.tile_wide_rows.fetch_add(sum.tile_wide_rows, std::memory_order_relaxed);
    }
    for (const int64_t col : meta->nan_columns)
      for (int64_t m = 0; m < d.M; ++m) out[m * d.N + col] = nan;
  }
};

#ifdef CSA_WITH_CUDA
struct Fp8LinearCudaKernel {
  // numerics "fast" runs the exact CUDA kernel (it is already the fast one there)
  bool round_output = false;
  bool pairs16 = false;
  Fp8LinearCudaKernel(const OrtApi*, const OrtKernelInfo* info) {
    const NodeAttributes attributes = check_node(info);
    round_output = attributes.round_output;
    pairs16 = attributes.pairs16;
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<Ort::Float8E4M3FN_t>& w,
                      const Ort::Custom::Tensor<float>& wscale, Ort::Custom::Tensor<float>& y) {
    return status_of([&] {
      const std::vector<int64_t> x_shape = x.Shape();
      const Dims d = check_shapes(x_shape, w.Shape(), wscale.Shape(), pairs16);
      std::vector<int64_t> y_shape = x_shape;
      y_shape.back() = d.N;
      float* out = y.Allocate(y_shape);
      if (d.M == 0 || d.N == 0) return;
      void* stream = Ort::KernelContext(ctx).GetGPUComputeStream();
      const std::string error =
          launch_fp8_linear(x.Data(), reinterpret_cast<const uint8_t*>(w.Data()), wscale.Data(),
                            out, d.M, d.N, d.K, round_output, pairs16, stream);
      if (!error.empty()) ORT_CXX_API_THROW("Fp8Linear (CUDA): " + error, ORT_RUNTIME_EXCEPTION);
    });
  }
};
#endif

}  // namespace

void AppendFp8LinearOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<Fp8LinearKernel>("Fp8Linear", "CPUExecutionProvider"));
#ifdef CSA_WITH_CUDA
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<Fp8LinearCudaKernel>("Fp8Linear",
                                                                        "CUDAExecutionProvider"));
#endif
}

}  // namespace csa

// The counts (calls, tasks on the few-rows path, W blocks that are not int16 summed against
// every row, (row, block, group)s summed in two digits, (row, block, column)s summed in
// int64, calls the fast kernel summed, those of them on AMX tiles, few-rows tasks that
// converted W by AVX512-FP16, calls on the tiles whose WScale let them fold the scales,
// (row, block, panel)s the AVX-512 tiles summed in two digits) into out[0..n); returns how
// many there are.
extern "C" __attribute__((visibility("default"))) uint64_t csa2onnx_fp8_linear_counts(uint64_t* out,
                                                                                     uint64_t n) {
  const uint64_t values[] = {csa::counts.calls.load(), csa::counts.small_tasks.load(),
                             csa::counts.lane_sums.load(), csa::counts.row_sums.load(),
                             csa::counts.wide_sums.load(), csa::counts.fast_calls.load(),
                             csa::counts.fast_amx_calls.load(), csa::counts.fp16_tasks.load(),
                             csa::counts.folded_calls.load(), csa::counts.tile_wide_rows.load()};
  const uint64_t total = sizeof values / sizeof values[0];
  for (uint64_t i = 0; i < n && i < total; ++i) out[i] = values[i];
  return total;
}
