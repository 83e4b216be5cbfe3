// onnxruntime's Cast float -> bfloat16 -> float, bit for bit: round to nearest even, and a
// NaN becomes the quiet NaN 0x7fc00000 with its sign (payload dropped). Kernels that fuse a
// round trip the graph would otherwise do with two Casts use these, so the fused op gives the
// Casts' bits (scalar, AVX-512 and AVX2 forms, the same results).
#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"

#ifdef CSA_X86
#include <immintrin.h>
#endif

namespace csa::ort_cast {

inline float cast_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    u = (u & 0x80000000u) | 0x7fc00000u;
  } else {
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  }
  float y;
  std::memcpy(&y, &u, sizeof y);
  return y;
}

#ifdef CSA_X86
CSA_TARGET_AVX512 inline __m512 cast_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  // the maskz form: GCC 12 warns about the plain one's _mm512_undefined placeholder
  const __m512i odd =
      _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  r = _mm512_and_si512(r, _mm512_set1_epi32(~0xffff));
  const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32(INT32_MIN)),
                                        _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, quiet));
}

// cast_bf16 of values known not to be NaN (the rounding alone: those bits are the same).
CSA_TARGET_AVX512 inline __m512 cast_bf16_not_nan(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd =
      _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(~0xffff)));
}

CSA_TARGET_AVX2 inline __m256 cast_bf16_not_nan(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(~0xffff)));
}

CSA_TARGET_AVX2 inline __m256 cast_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  r = _mm256_and_si256(r, _mm256_set1_epi32(~0xffff));
  const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(INT32_MIN)),
                                        _mm256_set1_epi32(0x7fc00000));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan);
}
#endif

}  // namespace csa::ort_cast
