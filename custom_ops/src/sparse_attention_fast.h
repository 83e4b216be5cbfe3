// SparseAttention numerics="fast": the tiled kernel's structure (sparse_attention_tiled.h:
// one task = heads [h0, h0 + g) of one query row, blocks of 64 indices, the online softmax of
// the definition) with both products on vdpbf16ps (AVX512-BF16: two bf16 products per float
// lane per instruction, twice the float FMA rate) instead of the definition's fmaf chains:
//   - Q and the block's rows are converted to bf16 with round-to-nearest-even. The model's q
//     (bf16-rounded) and KV rows (fp8/fp4 values, bf16-exact) are bf16 values, so this
//     changes nothing there; for arbitrary float inputs it rounds them (part of the fast
//     contract). vdpbf16ps and the conversion treat denormal inputs as zero and flush
//     denormal results to zero (values below 2^-126; never reached by the model's values).
//   - Logits: one float chain per (head, entry) over d in pairs of features (one vdpbf16ps
//     adds q[2e] * k[2e] + q[2e+1] * k[2e+1]), tiles of heads x entries vectorised across
//     heads; then the definition's separate multiply by softmax_scale.
//   - Softmax: the tiled kernel's own (tiled::softmax: running max from -1e30, torch_sum's
//     block sum, p rounded to bf16) with exp vectorised (VectorExp below: std::exp's value
//     but for one ulp on 7.6e-5 of the arguments); sink's exp stays std::exp.
//   - P @ V: the block's rows interleaved in pairs of entries ([entry pair][column] as bf16
//     pairs), bf16(p) of the same pairs broadcast: a chain over entry pairs per (head,
//     column), then acc = acc * alpha + chain; out = bf16(acc / (total + exp(sink - m))).
// Every output belongs to one task and every lane's chain has a fixed order, so the result
// does not depend on the thread count or on how heads are split over tasks (same bits).
// Outputs differ from numerics="exact" only by the float32 summation order of the two
// products, the bf16 conversion of inputs that are not bf16 values, and expf's last bit
// now and then: most are identical as bf16, the rest a bf16 ulp or a few apart
// (tests/test_sparse_attention_fast.py bounds them and counts them).
// Only for x86-64 with AVX512-BF16; the op runs the exact kernel on every other CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "packed_quant.h"
#include "simd.h"
#include "sparse_attention.h"
#include "sparse_attention_tiled.h"

#ifdef CSA_X86
#include <immintrin.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace csa::sparse_attention::fast {

using tiled::round_up;
using tiled::Source;

// The shapes one task works with (heads [h0, h0 + g) of one query row).
struct Shape {
  int64_t g, gp;  // heads, padded to a multiple of 16 (a vector of floats)
  int64_t d, dp;  // head dim, padded to a multiple of 32 (a vector of bf16)
  int64_t ldk;    // bf16 row stride of the converted rows: dp + 32 (spreads L1 sets)
  int64_t ldv;    // pair stride of the interleaved rows: dp + 16
  bool stage;     // packed rows are unpacked to float rows before conversion
};

inline Shape shape_of(int64_t g, int64_t d, bool packed_rows) {
  const int64_t dp = round_up(d, 32);
  return {g, round_up(g, 16), d, dp, dp + 32, dp + 16, packed_rows};
}

// Scratch for one task, in 4-byte units (bf16 rows take half a unit per value).
inline int64_t scratch_floats(const Shape& s) {
  return s.dp / 2 * s.gp               // qp: Q as bf16 pairs [dp / 2][gp]
         + kBlock * s.ldk / 2          // kr: the block's rows as bf16 [64][ldk]
         + kBlock / 2 * s.ldv          // vp: entry pairs interleaved [32][ldv]
         + (s.stage ? kBlock * s.d : 0)  // packed rows unpacked to floats
         + 2 * kBlock * s.gp           // logits [64][gp], bf16(p) [64][gp]
         + kBlock / 2 * s.gp           // pp: bf16(p) pairs [32][gp]
         + s.gp * s.dp                 // acc
         + 3 * s.gp                    // m, total, alpha
         + s.dp / 2;                   // a zero bf16 row
}

CSA_TARGET_AVX512BF16 inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// exp for the softmax, 16 floats at a time: in double, x = (32 i + j) ln2/32 + r with
// |r| <= ln2/64, exp(x) = 2^i * 2^(j/32) * (1 + r + ... + r^5/120) (relative error below
// 1e-13), then one rounding to float. Against glibc's expf (std::exp, the definition's) on
// every float in [-150, 100]: 7.6e-5 of them one ulp apart, none further (checked once on
// the AMD EPYC, all 2.2e9 arguments). x is clamped to [-150, 89] (0 and inf after the
// rounding, as expf gives there; -inf gives 0); NaN stays NaN.
struct ExpTable {
  alignas(64) double t[32];  // 2^(j/32)
  ExpTable() {
    for (int j = 0; j < 32; ++j) t[j] = std::exp2(j / 32.0);
  }
};
inline const ExpTable& exp_table() {
  static const ExpTable table;
  return table;
}

CSA_TARGET_AVX512BF16 inline __m512d exp_pd(__m512d x, const double* t) {
  x = _mm512_maskz_min_pd(0xff, _mm512_maskz_max_pd(0xff, x, _mm512_set1_pd(-150.0)),
                          _mm512_set1_pd(89.0));
  const double ln2 = 0.6931471805599453094;
  const __m512d kd =
      _mm512_maskz_roundscale_pd(0xff, _mm512_mul_pd(x, _mm512_set1_pd(32.0 / ln2)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512d r = _mm512_fmadd_pd(kd, _mm512_set1_pd(-ln2 / 32.0), x);
  const __m512i k = _mm512_cvtpd_epi64(kd);
  const __m512i j = _mm512_and_si512(k, _mm512_set1_epi64(31));
  const __m512d lo = _mm512_permutex2var_pd(_mm512_load_pd(t), j, _mm512_load_pd(t + 8));
  const __m512d hi = _mm512_permutex2var_pd(_mm512_load_pd(t + 16), j, _mm512_load_pd(t + 24));
  const __m512d tj = _mm512_mask_blend_pd(_mm512_test_epi64_mask(j, _mm512_set1_epi64(16)), lo, hi);
  // 2^i * 2^(j/32): i added to the exponent field (tj in [1, 2); |i| <= 217 stays normal)
  const __m512i i = _mm512_maskz_srai_epi64(0xff, k, 5);
  const __m512d scaled =
      _mm512_castsi512_pd(_mm512_add_epi64(_mm512_castpd_si512(tj), _mm512_maskz_slli_epi64(0xff, i, 52)));
  __m512d poly = _mm512_set1_pd(1.0 / 120);
  poly = _mm512_fmadd_pd(poly, r, _mm512_set1_pd(1.0 / 24));
  poly = _mm512_fmadd_pd(poly, r, _mm512_set1_pd(1.0 / 6));
  poly = _mm512_fmadd_pd(poly, r, _mm512_set1_pd(0.5));
  poly = _mm512_fmadd_pd(poly, r, _mm512_set1_pd(1.0));
  poly = _mm512_fmadd_pd(poly, r, _mm512_set1_pd(1.0));
  return _mm512_mul_pd(scaled, poly);
}

struct VectorExp {
  CSA_TARGET_AVX512BF16 static inline void apply(float* x, int64_t n) {
    const double* t = exp_table().t;
    for (int64_t i = 0; i < n; i += 16) {
      const int64_t left = n - i < 16 ? n - i : 16;
      const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
      const __m256 lo = _mm256_maskz_loadu_ps(static_cast<__mmask8>(mask), x + i);
      const __m256 hi = _mm256_maskz_loadu_ps(static_cast<__mmask8>(mask >> 8), x + i + 8);
      const __m256 a =
          _mm512_maskz_cvtpd_ps(0xff, exp_pd(_mm512_maskz_cvtps_pd(0xff, lo), t));
      const __m256 b =
          _mm512_maskz_cvtpd_ps(0xff, exp_pd(_mm512_maskz_cvtps_pd(0xff, hi), t));
      __m512 y = _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
      y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);  // NaN stays
      _mm512_mask_storeu_ps(x + i, mask, y);
    }
  }
};

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int A, int B>
CSA_TARGET_AVX512BF16 inline void zero_tile(__m512 (&tile)[A][B]) {
  for (int a = 0; a < A; ++a)
    for (int b = 0; b < B; ++b) tile[a][b] = _mm512_setzero_ps();
}

// Logits of GV heads x J entries over all of d (pairs [0, d2)): qp [d2][gp] pairs, kr[j]
// the entries' bf16 rows; out [J][gp] (entry-major, as tiled::softmax reads them).
template <int GV, int J>
CSA_TARGET_AVX512BF16 inline void logit_tile(const uint32_t* qp, int64_t gp,
                                             const uint16_t* const* kr, int64_t d2, float* out) {
  constexpr int NV = GV / 16;
  __m512 acc[J][NV];
  zero_tile(acc);
  for (int64_t e2 = 0; e2 < d2; ++e2) {
    __m512bh qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = as_bh(_mm512_loadu_si512(qp + e2 * gp + v * 16));
    for (int j = 0; j < J; ++j) {
      const __m512bh kv = as_bh(_mm512_set1_epi32(static_cast<int>(load_pair(kr[j] + 2 * e2))));
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], qv[v], kv);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + j * gp + v * 16, acc[j][v]);
}

template <int GV, int J>
CSA_TARGET_AVX512BF16 inline void logit_heads(const Shape& s, const uint32_t* qp,
                                              const uint16_t* const* kr, int64_t nvp,
                                              int64_t g0, float* lsum) {
  const int64_t d2 = (s.d + 1) / 2;
  for (int64_t j = 0; j < nvp; j += J)
    logit_tile<GV, J>(qp + g0, s.gp, kr + j, d2, lsum + j * s.gp + g0);
}

template <int EC>
CSA_TARGET_AVX512BF16 inline void pv_columns(const Shape& s, const uint32_t* pp,
                                             const uint32_t* vp, int64_t nv2, int64_t e0,
                                             const float* alpha, float* acc) {
  constexpr int kHeads = 4;
  for (int64_t i = 0; i < s.gp; i += kHeads)
    tiled::pairs::pv_tile<kHeads, EC>(pp + i, s.gp, vp, s.ldv, nv2, e0, alpha + i,
                                      acc + i * s.dp, s.dp);  // pp, vp: [pair][gp], [pair][ldv]
}

// 32 values to bf16 (RNE): x[0, left) and zeros past it (left <= 0: all zero).
CSA_TARGET_AVX512BF16 inline void convert_part(const float* x, int64_t left, uint16_t* y) {
  const int64_t lo = left < 0 ? 0 : (left < 16 ? left : 16);
  const int64_t hi = left - 16 < 0 ? 0 : (left - 16 < 16 ? left - 16 : 16);
  const __m512 a = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lo) - 1u), x);
  const __m512 b = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << hi) - 1u), x + 16);
  _mm512_storeu_si512(y, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// One float row of d values to bf16, zero-padded to dp; `next` (or null): the row converted
// after this one, fetched into the cache meanwhile (the rows are scattered over KV: each
// would otherwise stall on memory before its first conversion).
CSA_TARGET_AVX512BF16 inline void convert_row(const float* x, const float* next, int64_t d,
                                              int64_t dp, uint16_t* y) {
  for (int64_t e = 0; e < dp; e += 32) {
    if (next != nullptr && e < d) {
      _mm_prefetch(reinterpret_cast<const char*>(next + e), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + e + 16), _MM_HINT_T0);
    }
    convert_part(x + e, d - e, y + e);
  }
}

// `count` float rows of d values (x, d apart) to bf16 rows dp apart, zero-padded: KV
// converted once per call, when its rows are read more often than once on average.
CSA_TARGET_AVX512BF16 inline void convert_rows(const float* x, int64_t count, int64_t d,
                                               int64_t dp, uint16_t* y) {
  for (int64_t r = 0; r < count; ++r)
    convert_row(x + r * d, r + 1 < count ? x + (r + 1) * d : nullptr, d, dp, y + r * dp);
}

// The entries [j0, j1) of a query's index list (-1 left out) converted to bf16 rows dp apart
// at out + j * dp (Source::gathered): window rows from kv, packed ones from src.unpacked
// (which must then be set).
template <typename I>
CSA_TARGET_AVX512BF16 inline void gather_entries(const Source& src, int64_t d, int64_t dp,
                                                 const I* idx, int64_t j0, int64_t j1,
                                                 uint16_t* out) {
  auto row_of = [&](int64_t j) -> const float* {
    const int64_t ix = static_cast<int64_t>(idx[j]);
    if (ix < 0) return nullptr;
    return ix < src.n_window ? src.kv + ix * d : src.unpacked + j * d;
  };
  const float* row = j0 < j1 ? row_of(j0) : nullptr;
  for (int64_t j = j0; j < j1; ++j) {
    const float* next = j + 1 < j1 ? row_of(j + 1) : nullptr;
    if (row != nullptr) convert_row(row, next, d, dp, out + j * dp);
    row = next;
  }
}

// Rows a and b (bf16, dp values) interleaved: out[e] = a[e] | b[e] << 16; the next pair's
// rows (or null) fetched meanwhile.
CSA_TARGET_AVX512BF16 inline void interleave_rows(const uint16_t* a, const uint16_t* b,
                                                  const uint16_t* next_a,
                                                  const uint16_t* next_b, int64_t dp,
                                                  uint32_t* out) {
  alignas(64) static constexpr uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t e = 0; e < dp; e += 32) {
    if (next_a != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next_a + e), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next_b + e), _MM_HINT_T0);
    }
    const __m512i x = _mm512_loadu_si512(a + e), y = _mm512_loadu_si512(b + e);
    _mm512_storeu_si512(out + e, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(out + e + 16, _mm512_permutex2var_epi16(x, hi, y));
  }
}

// One task: as tiled::task (same arguments and index preconditions), on vdpbf16ps.
template <typename I>
CSA_TARGET_AVX512BF16 inline void task(const Problem& pr, const Shape& s, int64_t h0,
                                       const float* q, const Source& src, const I* idx,
                                       const float* sink, float* scratch, float* out) {
  const int64_t d = s.d, dp = s.dp, gp = s.gp, g = s.g, k = pr.k;
  uint32_t* qp = reinterpret_cast<uint32_t*>(scratch);                 // [dp / 2][gp]
  uint16_t* kr = reinterpret_cast<uint16_t*>(qp + dp / 2 * gp);        // [64][ldk]
  uint32_t* vp = reinterpret_cast<uint32_t*>(kr + kBlock * s.ldk);     // [32][ldv]
  float* stage = reinterpret_cast<float*>(vp + kBlock / 2 * s.ldv);    // [64][d]
  float* lsum = stage + (s.stage ? kBlock * d : 0);                     // [64][gp]
  float* pb = lsum + kBlock * gp;                                       // [64][gp]
  uint32_t* pp = reinterpret_cast<uint32_t*>(pb + kBlock * gp);        // [32][gp]
  float* acc = reinterpret_cast<float*>(pp + kBlock / 2 * gp);         // [gp][dp]
  float* m = acc + gp * dp;
  float* total = m + gp;
  float* alpha = total + gp;
  uint16_t* zero = reinterpret_cast<uint16_t*>(alpha + gp);            // [dp]
  std::memset(zero, 0, dp * sizeof(uint16_t));

  // Q as bf16 pairs along d, heads across: qp[e2][i] = bf16(q[i][2e2]) | bf16(q[i][2e2+1]) << 16
  // (each head's row converted in order, read once; padding heads and features are 0).
  for (int64_t i = 0; i < gp; ++i) {
    if (i < g) {
      for (int64_t e = 0; e < dp; e += 32) {
        alignas(64) uint32_t pairs[16];
        convert_part(q + (h0 + i) * d + e, d - e, reinterpret_cast<uint16_t*>(pairs));
        for (int64_t c = 0; c < 16; ++c) qp[(e / 2 + c) * gp + i] = pairs[c];
      }
    } else {
      for (int64_t e2 = 0; e2 < dp / 2; ++e2) qp[e2 * gp + i] = 0;
    }
  }
  for (int64_t i = 0; i < gp * kBlock; ++i) pb[i] = 0.0f;
  for (int64_t i = 0; i < gp * dp; ++i) acc[i] = 0.0f;
  for (int64_t i = 0; i < gp; ++i) {
    m[i] = kRunningMaxInit;
    total[i] = 0.0f;
    alpha[i] = 0.0f;
  }
  // tiled::softmax reads the head counts only.
  const tiled::Shape soft{g, gp, d, dp, dp, true, false, false};

  for (int64_t j0 = 0; j0 < k; j0 += kBlock) {
    const int64_t len = k - j0 < kBlock ? k - j0 : kBlock;
    int slot[kBlock];
    const float* rows[kBlock];     // each valid entry's float row, or null: converted already
    const uint16_t* kb[kBlock];    // each valid entry's bf16 row, then zero rows up to nvp
    int64_t nv = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t ix = j < len ? static_cast<int64_t>(idx[j0 + j]) : -1;
      slot[j] = ix < 0 ? -1 : static_cast<int>(nv);
      if (ix < 0) continue;
      rows[nv] = nullptr;
      kb[nv] = kr + nv * s.ldk;
      if (src.gathered != nullptr) {
        kb[nv] = src.gathered + (j0 + j) * src.bf16_stride;
      } else if (ix < src.n_window && src.bf16 != nullptr) {
        kb[nv] = src.bf16 + ix * src.bf16_stride;
      } else if (ix < src.n_window) {
        rows[nv] = src.kv + ix * d;
      } else if (src.unpacked != nullptr) {
        rows[nv] = src.unpacked + (j0 + j) * d;
      } else {
        float* t = stage + nv * d;
        packed::unpack_row_avx512(src.format, src.packed + (ix - src.n_window) * src.row_bytes,
                                  d, t);
        rows[nv] = t;
      }
      ++nv;
    }
    if (nv == 0) continue;  // the definition skips a block with nothing in it
    for (int64_t j = 0, next = 0; j < nv; j = next) {
      for (next = j + 1; next < nv && rows[next] == nullptr;) ++next;
      if (rows[j] != nullptr)
        convert_row(rows[j], next < nv ? rows[next] : nullptr, d, dp, kr + j * s.ldk);
    }
    const int64_t nvp = round_up(nv, tiled::kRowPad);
    for (int64_t j = nv; j < nvp; ++j) kb[j] = zero;
    const int64_t nv2 = (nv + 1) / 2;  // the zero row pairs with an odd last entry
    for (int64_t jj = 0; jj < nv2; ++jj) {
      const bool more = jj + 1 < nv2;
      interleave_rows(kb[2 * jj], kb[2 * jj + 1], more ? kb[2 * jj + 2] : nullptr,
                      more ? kb[2 * jj + 3] : nullptr, dp, vp + jj * s.ldv);
    }

    int64_t g0 = 0;
    for (; g0 + 64 <= gp; g0 += 64) logit_heads<64, 4>(s, qp, kb, nvp, g0, lsum);
    for (; g0 + 32 <= gp; g0 += 32) logit_heads<32, 8>(s, qp, kb, nvp, g0, lsum);
    for (; g0 < gp; g0 += 16) logit_heads<16, 16>(s, qp, kb, nvp, g0, lsum);

    tiled::softmax<tiled::VAvx512, VectorExp>(soft, pr.scale, nv, slot, lsum, pb, m, total, alpha);

    // bf16(p) in entry pairs: pp[jj][i] = p[2jj][i] | p[2jj+1][i] << 16 (p[nv] = 0).
    for (int64_t jj = 0; jj < nv2; ++jj) {
      for (int64_t i = 0; i < gp; i += 16) {
        const __m512i a = _mm512_loadu_si512(pb + 2 * jj * gp + i);
        const __m512i b = 2 * jj + 1 < nv ? _mm512_loadu_si512(pb + (2 * jj + 1) * gp + i)
                                          : _mm512_setzero_si512();
        // (masked forms here and in exp_pd: the plain ones draw GCC 12's
        // -Wmaybe-uninitialized)
        const __m512i pair = _mm512_or_si512(_mm512_maskz_srli_epi32(0xffff, a, 16),
                                             _mm512_and_si512(b, _mm512_set1_epi32(~0xffff)));
        _mm512_storeu_si512(pp + jj * gp + i, pair);
      }
    }

    int64_t e0 = 0;
    for (; e0 + 64 <= dp; e0 += 64) pv_columns<64>(s, pp, vp, nv2, e0, alpha, acc);
    for (; e0 < dp; e0 += 32) pv_columns<32>(s, pp, vp, nv2, e0, alpha, acc);
  }
  for (int64_t i = 0; i < g; ++i) {
    const float denom = total[i] + std::exp(sink[h0 + i] - m[i]);
    for (int64_t e = 0; e < d; ++e) out[(h0 + i) * d + e] = round_bf16(acc[i * dp + e] / denom);
  }
}

}  // namespace csa::sparse_attention::fast

#pragma GCC diagnostic pop
#endif  // CSA_X86
