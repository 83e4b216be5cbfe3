// fp4 (e2m1) quantise-dequantise round trip with e8m0 or e4m3 block scales, as
// DeepSeek-V4.1's fp4_act_quant(x, block, inplace=True[, scale_dtype]) computes it.
// Plain scalar code shared by the CPU kernel and the CUDA kernel (CSA_HD).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define CSA_HD __host__ __device__ __forceinline__
#else
#define CSA_HD inline
#endif

namespace csa {

enum class ScaleFormat { kE8M0 = 0, kE4M3 = 1 };

CSA_HD uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

CSA_HD float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// float -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN).
CSA_HD uint16_t float_to_bf16_bits(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

CSA_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

CSA_HD float round_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

// Exact 2^ceil(log2(t)) for t > 0: the next power of two at or above t, read off the
// exponent (a floating log2 rounds 2^k * (1 + 2^-23) down to k and would be wrong).
CSA_HD float pow2_ceil(float t) {
  if (!(t > 0.0f) || t == INFINITY) return t;  // NaN and inf pass through as torch's would
  int e;
  const float m = frexpf(t, &e);  // t = m * 2^e, m in [0.5, 1)
  return m == 0.5f ? t : ldexpf(1.0f, e);
}

// float8 e4m3fn, round to nearest even, saturating at +-448 (no inf in e4m3fn).
CSA_HD float round_e4m3_saturating(float x) {
  if (x != x) return x;
  const float a = fabsf(x);
  if (a >= 448.0f) return copysignf(448.0f, x);
  int e;
  frexpf(a, &e);  // a in [2^(e-1), 2^e)
  // 3 mantissa bits: step 2^(e-4) for normals, 2^-9 below the smallest normal 2^-6.
  const int step_exp = (e - 1 < -6 ? -6 : e - 1) - 3;
  const float q = ldexpf(rintf(ldexpf(a, -step_exp)), step_exp);  // rint: ties to even
  return copysignf(q, x);
}

// |v| in [0, 6] onto the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code
// (codes 0..7 in grid order): .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
CSA_HD float e2m1_rne_magnitude(float a) {
  if (a <= 0.25f) return 0.0f;
  if (a < 0.75f) return 0.5f;
  if (a <= 1.25f) return 1.0f;
  if (a < 1.75f) return 1.5f;
  if (a <= 2.5f) return 2.0f;
  if (a < 3.5f) return 3.0f;
  if (a <= 5.0f) return 4.0f;
  return 6.0f;
}

// The block scale from the block's amax (max |x|; NaN if the block holds a NaN).
CSA_HD float fp4_block_scale(float amax, ScaleFormat format) {
  if (format == ScaleFormat::kE8M0) {
    const float floor_amax = 6.0f * 1.17549435e-38f;  // 6 * 2^-126
    const float a = amax < floor_amax ? floor_amax : amax;
    return pow2_ceil(a * (1.0f / 6.0f));
  }
  const float floor_amax = 6.0f * 0.001953125f;  // 6 * 2^-9
  const float a = amax < floor_amax ? floor_amax : amax;
  return round_e4m3_saturating(a / 6.0f);
}

// One element's round trip given its block scale; the result is bf16-valued.
CSA_HD float fp4_round_trip(float x, float scale) {
  float v = x / scale;
  if (v != v) return v;
  v = v > 6.0f ? 6.0f : (v < -6.0f ? -6.0f : v);
  const float q = copysignf(e2m1_rne_magnitude(fabsf(v)), v);
  return round_bf16(q * scale);
}

CSA_HD float block_amax(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = fabsf(x[i]);
    if (a != a) return a;  // torch's amax propagates NaN
    amax = a > amax ? a : amax;
  }
  return amax;
}

}  // namespace csa
