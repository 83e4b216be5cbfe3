// The block max of BlockMax (block_max_op.cc), shared with IndexerTopK's block scores: the
// largest value of a block with +0 above -0 (IEEE 754-2019 maximum), NaN (0x7FC00000) for a
// block holding one; defined whatever the order of the comparisons.
#pragma once

#include <cstdint>

#include "simd.h"

#ifdef CSA_X86
#include <immintrin.h>
#endif

namespace csa {
namespace block_max {

// A float's place in the total order -inf < ... < -0 < +0 < ... < +inf, as an int32 (NaN is
// kept apart): negative floats have their magnitude bits flipped. Its own inverse.
inline int32_t order_key(uint32_t bits) {
  const int32_t b = static_cast<int32_t>(bits);
  return b ^ static_cast<int32_t>((static_cast<uint32_t>(b >> 31)) >> 1);
}
inline bool is_nan(uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }
inline uint32_t result(int32_t best, bool nan) {
  return nan ? 0x7FC00000u : static_cast<uint32_t>(order_key(static_cast<uint32_t>(best)));
}

// Y[block] for `count` consecutive blocks of one row, from X's first value of the first.
inline void blocks_of_row(const uint32_t* x, int64_t width, int64_t block, int64_t first,
                          int64_t count, uint32_t* y) {
  for (int64_t j = first; j < first + count; ++j) {
    const int64_t lo = j * block, hi = lo + block < width ? lo + block : width;
    int32_t best = order_key(x[lo]);
    bool nan = false;
    for (int64_t i = lo; i < hi; ++i) {
      const int32_t k = order_key(x[i]);
      best = k > best ? k : best;
      nan = nan || is_nan(x[i]);
    }
    y[j] = result(best, nan);
  }
}

#ifdef CSA_X86
// Pairs of whole blocks of 8 from x on AVX-512, one pair a vector: the order keys' max by
// three swaps within each half (128-bit lanes, 64-bit halves, neighbours), a NaN by a compare.
CSA_TARGET_AVX512 inline void pairs_of_8(const uint32_t* x, int64_t pairs, uint32_t* y) {
  for (int64_t p = 0; p < pairs; ++p) {
    constexpr __mmask16 kAll = 0xFFFF;
    const __m512i b = _mm512_loadu_si512(x + 16 * p);
    // order_key. The masked forms with every lane set: the plain ones pass GCC 12 an
    // "undefined" source that it then warns about
    const __m512i key = _mm512_xor_si512(
        b, _mm512_maskz_srli_epi32(kAll, _mm512_maskz_srai_epi32(kAll, b, 31), 1));
    __m512i m = _mm512_maskz_max_epi32(
        kAll, key, _mm512_maskz_shuffle_i32x4(kAll, key, key, _MM_SHUFFLE(2, 3, 0, 1)));
    m = _mm512_maskz_max_epi32(kAll, m, _mm512_maskz_shuffle_epi32(kAll, m, _MM_PERM_BADC));
    m = _mm512_maskz_max_epi32(kAll, m, _mm512_maskz_shuffle_epi32(kAll, m, _MM_PERM_CDAB));
    const __m512 v = _mm512_castsi512_ps(b);
    const unsigned nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const int32_t first = _mm512_cvtsi512_si32(m);
    const int32_t second = _mm_cvtsi128_si32(_mm512_maskz_extracti32x4_epi32(0xF, m, 2));
    y[2 * p] = (nan & 0xFFu) != 0 ? 0x7FC00000u : static_cast<uint32_t>(order_key(
                                                      static_cast<uint32_t>(first)));
    y[2 * p + 1] = (nan >> 8) != 0 ? 0x7FC00000u : static_cast<uint32_t>(order_key(
                                                       static_cast<uint32_t>(second)));
  }
}
#endif

// A row's block maxes with the row fed in pieces, in order: y[j] is written when block j is
// whole, the last (shorter) block by `finish`.
struct RowStream {
  uint32_t* y;
  int64_t block;
  int64_t at = 0;    // values of the current block seen
  int64_t done = 0;  // blocks written
  int32_t best = 0;
  bool nan = false;

  // A position counter, not a division per value: this runs on every score of a long
  // prefill chunk.
  void push(const uint32_t* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const int32_t k = order_key(x[i]);
      best = at == 0 || k > best ? k : best;
      nan = (at != 0 && nan) || is_nan(x[i]);
      if (++at == block) {
        y[done++] = result(best, nan);
        at = 0;
      }
    }
  }
  void finish() const {
    if (at != 0) y[done] = result(best, nan);
  }
};

}  // namespace block_max
}  // namespace csa
