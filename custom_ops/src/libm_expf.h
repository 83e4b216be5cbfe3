// std::exp(float) as glibc computes it, 8 values at a time, bit for bit. SparseAttention's
// softmax is defined with std::exp per value (sparse_attention.h); on x86-64 glibc (2.28 and
// later) with FMA that is __expf_fma (sysdeps/ieee754/flt-32/e_expf.c), which for |x| < 88
// computes in double
//   z = fma(x, InvLn2N, Shift), ki = bits(z), kd = z - Shift, r = fma(InvLn2N, x, -kd),
//   s = double with bits T[ki % 32] + (ki << 47),
//   y = fma(fma(C0, r, C1), r * r, fma(C2, r, 1)) * s, result float(y)
// with T[i] the bits of 2^(i/32) less i << 47 and the constants below (its __exp2f_data).
// Every other argument (|x| >= 88: the top 12 bits of x at least 0x42b; inf, NaN) is
// std::exp's own, called per value. Whether this process's libm is that function is decided
// once, by comparing the two on every 4099th float bit pattern and on the special values
// (matches_libm); where it is not, the caller keeps std::exp everywhere.
// (tests/cpp/libm_expf.cc compares them on every float.)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#ifdef CSA_X86
#include <immintrin.h>
#endif

namespace csa::libm_expf {

constexpr double kInvLn2N = 0x1.71547652b82fep+5;  // 32 / ln 2
constexpr double kShift = 0x1.8p+52;               // z + Shift rounds z to an integer
constexpr double kC0 = 0x1.c6af84b912394p-20, kC1 = 0x1.ebfce50fac4f3p-13,
                 kC2 = 0x1.62e42ff0c52d6p-6;
constexpr uint32_t kSpecialTop = 0x42b;  // (bits(x) >> 20) & 0x7ff from here: std::exp's path
alignas(64) constexpr uint64_t kTable[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

#ifdef CSA_X86
// 8 arguments (floats widened to double) -> the main path's results; lanes whose argument
// takes std::exp's special path get values nobody reads.
CSA_TARGET_AVX512 inline __m256 main_path8(__m256 xf) {
  const __m512d xd = _mm512_maskz_cvtps_pd(0xff, xf);
  const __m512d inv = _mm512_set1_pd(kInvLn2N), shift = _mm512_set1_pd(kShift);
  const __m512d z = _mm512_fmadd_pd(xd, inv, shift);
  const __m512i ki = _mm512_castpd_si512(z);
  const __m512d r = _mm512_fmsub_pd(inv, xd, _mm512_sub_pd(z, shift));
  // T[ki % 32]: entries 0-15 or 16-31 by index bits 0-3, bit 4 picks between them
  const __m512i lo =
      _mm512_permutex2var_epi64(_mm512_load_si512(kTable), ki, _mm512_load_si512(kTable + 8));
  const __m512i hi =
      _mm512_permutex2var_epi64(_mm512_load_si512(kTable + 16), ki, _mm512_load_si512(kTable + 24));
  const __mmask8 upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
  const __m512i t = _mm512_add_epi64(_mm512_mask_mov_epi64(lo, upper, hi),
                                     _mm512_maskz_slli_epi64(0xff, ki, 47));
  const __m512d zc = _mm512_fmadd_pd(_mm512_set1_pd(kC0), r, _mm512_set1_pd(kC1));
  const __m512d r2 = _mm512_mul_pd(r, r);
  const __m512d y1 = _mm512_fmadd_pd(r, _mm512_set1_pd(kC2), _mm512_set1_pd(1.0));
  const __m512d y = _mm512_fmadd_pd(zc, r2, y1);
  return _mm512_maskz_cvtpd_ps(0xff, _mm512_mul_pd(y, _mm512_castsi512_pd(t)));
}

// x[i] = std::exp(x[i]) for i < n, as glibc computes it (see above).
CSA_TARGET_AVX512 inline void apply_avx512(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t left = n - i < 8 ? n - i : 8;
    const __mmask8 in = static_cast<__mmask8>((1u << left) - 1u);
    const __m256 xf = _mm256_maskz_loadu_ps(in, x + i);
    const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(xf), 20),
                                         _mm256_set1_epi32(0x7ff));
    const __mmask8 special =
        static_cast<__mmask8>(_mm256_cmpge_epu32_mask(top, _mm256_set1_epi32(kSpecialTop)) & in);
    alignas(32) float arg[8];
    _mm256_store_ps(arg, xf);
    _mm256_mask_storeu_ps(x + i, in, main_path8(xf));
    for (unsigned m = special; m != 0; m &= m - 1) {
      const int l = __builtin_ctz(m);
      x[i + l] = std::exp(arg[l]);
    }
  }
}

// Whether apply_avx512 gives std::exp's bits on x[0, n) (n <= 1024; x is overwritten).
CSA_TARGET_AVX512 inline bool same_as_std_exp(float* x, int64_t n) {
  float want[1024];
  for (int64_t i = 0; i < n; ++i) want[i] = std::exp(x[i]);
  apply_avx512(x, n);
  return std::memcmp(x, want, static_cast<size_t>(n) * sizeof(float)) == 0;
}

// Whether apply_avx512 is this process's std::exp: the special values, then every 4099th
// float bit pattern (the stride is odd: every exponent and every low-bit pattern is met).
// Call only where AVX-512 runs.
CSA_TARGET_AVX512 inline bool matches_libm() {
  float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 88.0f, -88.0f,
                      0x1.62e42ep6f, 0x1.62e430p6f, -0x1.9fe368p6f, -0x1.9fe36ap6f,
                      -0x1.9d1d9ep6f, -0x1.9d1da0p6f, 87.99999f, -87.99999f};
  if (!same_as_std_exp(specials, sizeof specials / sizeof specials[0])) return false;
  float x[1024];
  for (uint64_t b = 0; b <= 0xFFFFFFFFull;) {
    int64_t n = 0;
    for (; n < 1024 && b <= 0xFFFFFFFFull; ++n, b += 4099) {
      const uint32_t u = static_cast<uint32_t>(b);
      std::memcpy(&x[n], &u, sizeof u);
    }
    if (!same_as_std_exp(x, n)) return false;
  }
  return true;
}
#endif

}  // namespace csa::libm_expf
