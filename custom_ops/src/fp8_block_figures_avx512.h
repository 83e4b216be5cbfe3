// The block figures of fp8_int_blocks.h (max, sum and norm of a block's units, the limits
// sum_limit derives from them) for 16 blocks at once with AVX-512: a transposing reduction
// leaves block b's figure in lane b, so that act_quant (fp8_linear_op.cc) does not reduce
// each block horizontally. The same integers as the scalar helpers, checked against them by
// tests/cpp/fp8_int_blocks.cc.
#pragma once

#include <cstdint>

#include "fp8_int_blocks.h"
#include "simd.h"

#ifdef CSA_X86
#include <immintrin.h>

namespace csa::fp8_int {

// GCC 12 flags the intrinsics' own _mm*_undefined_* placeholders as (maybe-)uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// One step of a transposing reduction over vectors of kN lanes: a and b hold nb = kN / kP
// blocks each, kP partials a block (lanes blk * kP + j); the step's result holds a's blocks
// then b's, kP / 2 partials each, every lane op(partial j, partial j + kP / 2) of its block.
// The two permutes' lane indices:
template <typename T, int kN>
struct FoldIndex {
  T lo[kN], hi[kN];
};
template <typename T, int kN, int kP>
constexpr FoldIndex<T, kN> fold_index() {
  FoldIndex<T, kN> t{};
  constexpr int h = kP / 2, nb = kN / kP;
  for (int o = 0; o < kN; ++o) {
    const int blk = o / h, j = o % h;
    const int src = blk < nb ? blk * kP + j : kN + (blk - nb) * kP + j;
    t.lo[o] = static_cast<T>(src);
    t.hi[o] = static_cast<T>(src + h);
  }
  return t;
}
template <int kP, typename Op>  // 16 uint32 lanes
CSA_TARGET_AVX512 __attribute__((always_inline)) inline __m512i fold32(__m512i a, __m512i b, Op op) {
  alignas(64) static constexpr FoldIndex<int32_t, 16> kIdx = fold_index<int32_t, 16, kP>();
  return op(_mm512_permutex2var_epi32(a, _mm512_load_si512(kIdx.lo), b),
            _mm512_permutex2var_epi32(a, _mm512_load_si512(kIdx.hi), b));
}
template <int kP>  // 8 uint64 lanes, sums
CSA_TARGET_AVX512 __attribute__((always_inline)) inline __m512i fold64(__m512i a, __m512i b) {
  alignas(64) static constexpr FoldIndex<int64_t, 8> kIdx = fold_index<int64_t, 8, kP>();
  return _mm512_add_epi64(_mm512_permutex2var_epi64(a, _mm512_load_si512(kIdx.lo), b),
                          _mm512_permutex2var_epi64(a, _mm512_load_si512(kIdx.hi), b));
}

struct MaxU32 {
  CSA_TARGET_AVX512 __attribute__((always_inline)) __m512i operator()(__m512i a, __m512i b) const { return _mm512_max_epu32(a, b); }
};
struct OrU32 {
  CSA_TARGET_AVX512 __attribute__((always_inline)) __m512i operator()(__m512i a, __m512i b) const { return _mm512_or_si512(a, b); }
};
struct AddU32 {
  CSA_TARGET_AVX512 __attribute__((always_inline)) __m512i operator()(__m512i a, __m512i b) const { return _mm512_add_epi32(a, b); }
};

// op over the 16 lanes of each v[b]: lane b of the result (v is overwritten).
template <typename Op>
CSA_TARGET_AVX512 __attribute__((always_inline)) inline __m512i reduce16(__m512i (&v)[16], Op op) {
  for (int i = 0; i < 8; ++i) v[i] = fold32<16>(v[2 * i], v[2 * i + 1], op);
  for (int i = 0; i < 4; ++i) v[i] = fold32<8>(v[2 * i], v[2 * i + 1], op);
  for (int i = 0; i < 2; ++i) v[i] = fold32<4>(v[2 * i], v[2 * i + 1], op);
  return fold32<2>(v[0], v[1], op);
}

// sum_limit of 16 lanes: floor(kSumLimit / q) in double (exact: for q >= 2 the quotient is at
// least 2^-31 of itself away from the next integer), all of uint32 where q == 0.
CSA_TARGET_AVX512 __attribute__((always_inline)) inline __m512i sum_limit16(__m512i q) {
  const __m512d a = _mm512_set1_pd(static_cast<double>(kSumLimit));
  const __m256i lo = _mm512_cvttpd_epu32(_mm512_div_pd(a, _mm512_cvtepu32_pd(_mm512_castsi512_si256(q))));
  const __m256i hi = _mm512_cvttpd_epu32(_mm512_div_pd(a, _mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(q, 1))));
  const __m512i lim = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_mask_mov_epi32(lim, _mm512_cmpeq_epi32_mask(q, _mm512_setzero_si512()),
                               _mm512_set1_epi32(-1));
}

// sqrt_ceil of 8 uint64 lanes (each below 2^52): the double's root, corrected either way.
CSA_TARGET_AVX512 __attribute__((always_inline)) inline __m256i sqrt_ceil8(__m512i sq) {
  __m512i r = _mm512_cvttpd_epu64(_mm512_sqrt_pd(_mm512_cvtepu64_pd(sq)));
  const __m512i one = _mm512_set1_epi64(1);
  for (int i = 0; i < 2; ++i)  // r * r < sq: one more
    r = _mm512_mask_add_epi64(r, _mm512_cmplt_epu64_mask(_mm512_mullo_epi64(r, r), sq), r, one);
  for (int i = 0; i < 2; ++i) {  // (r - 1)^2 >= sq (r > 0): one less
    const __m512i d = _mm512_sub_epi64(r, one);
    const __mmask8 down = _mm512_cmpge_epu64_mask(_mm512_mullo_epi64(d, d), sq) &
                          _mm512_cmpneq_epi64_mask(r, _mm512_setzero_si512());
    r = _mm512_mask_mov_epi64(r, down, d);
  }
  return _mm512_cvtepi64_epi32(r);
}

#pragma GCC diagnostic pop

}  // namespace csa::fp8_int
#endif  // CSA_X86
