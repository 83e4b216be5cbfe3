// Fp8Linear's arithmetic (reference.md, "fp8 linears" and "act_quant"), shared by the CPU
// kernel (fp8_linear_op.cc) and the CUDA kernel (fp8_linear_cuda.cu): plain scalar code,
// host and device (CSA_HD). Every step is either exact or one IEEE float32 operation, so
// any implementation that keeps the per-block rounding and the block order gives the same
// bits:
//   act_quant per row and block of 32 along K: amax = max|x| (NaN propagates), clamped
//     below at f32(1e-4); xs = 2^ceil(log2(amax * f32(1/448))) exactly (bit fields);
//     xq = e4m3 RNE of clamp(x / xs, -448, 448).
//   per output and K block kb in order: dot = sum of the 32 xq * w, exact (double), rounded
//     once to float; acc = acc + dot * (xs[m, kb] * wscale[n / 32, kb]) in float, from 0.
// NaN and inf: a NaN or +-inf in a row of X makes xs NaN or inf and its block's xq NaN, so
// that row of Y is NaN; a NaN weight (e4m3fn 0x7F / 0xFF) makes its column of Y NaN.
// Scales that are 0, inf or NaN follow IEEE float arithmetic.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "host_device.h"

namespace csa {

struct Fp8 {
  static constexpr int kBlock = 32;                   // act_quant / weight-scale block
  static constexpr float kMax = 448.0f;               // largest finite e4m3fn
  static constexpr float kAmaxFloor = 1e-4f;          // f32(1e-4)
  static constexpr float kMaxInv = (float)(1.0 / 448.0);  // tilelang's f32 immediate

  CSA_HD static uint32_t bits_of(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return b;
  }
  CSA_HD static float from_bits(uint32_t b) {
    float v;
    memcpy(&v, &b, sizeof v);
    return v;
  }

  // 2^ceil(log2 t) for positive t from the exponent and mantissa fields (exact where a
  // float log2 is not); NaN and inf pass through.
  CSA_HD static float pow2_ceil(float t) {
    const uint32_t b = bits_of(t);
    const uint32_t e = (b >> 23) & 0xFFu;
    if (e == 0xFFu) return t;
    const uint32_t k = e + ((b & 0x7FFFFFu) != 0u ? 1u : 0u);  // biased exponent of 2^ceil
    return from_bits(k << 23);
  }

  // For a scale xs = 2^e (pow2_ceil's) with 2^-126 <= xs <= 2^126, its reciprocal 2^-e,
  // a normal float, so that x * inv and x / xs are the same real number, rounded (or
  // flushed) alike for every x and MXCSR mode: a multiply where act_quant divides (a zmm
  // division takes about 16 cycles). 0 for other xs (2^127, inf, NaN): divide those.
  CSA_HD static float pow2_reciprocal(float xs) {
    const uint32_t e = (bits_of(xs) >> 23) & 0xFFu;
    return e >= 1u && e <= 253u && (bits_of(xs) & 0x807FFFFFu) == 0u ? from_bits((254u - e) << 23)
                                                                      : 0.0f;
  }

  // float -> nearest-even e4m3fn value (as float); |v| <= 448 or NaN (callers clamp).
  CSA_HD static float e4m3_rne(float v) {
    if (v != v) return v;
    const float a = fabsf(v);
    float q;
    if (a < 0x1p-6f) {
      // subnormal grid, multiples of 2^-9: a * 512 < 8, and adding then subtracting 2^23
      // rounds it to an integer, nearest even (no libm call, vectorisable)
      q = ((a * 512.0f + 0x1p23f) - 0x1p23f) * 0x1p-9f;
    } else {
      uint32_t b = bits_of(a);  // keep 3 mantissa bits, ties to even
      b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
      q = from_bits(b);
    }
    return copysignf(q, v);
  }

  // e4m3fn code -> value; 0x7F and 0xFF are NaN.
  CSA_HD static float e4m3_value(uint8_t code) {
    const uint32_t e = (code >> 3) & 15u, m = code & 7u;
    float mag;
    if (e == 15u && m == 7u) {
      mag = from_bits(0x7FC00000u);
    } else if (e == 0u) {
      mag = (float)m * 0x1p-9f;
    } else {
      mag = from_bits(((e + 120u) << 23) | (m << 20));
    }
    return (code & 0x80u) ? -mag : mag;
  }

  static constexpr bool is_nan_code(uint8_t code) { return (code & 0x7Fu) == 0x7Fu; }

  // act_quant of one block of 32: writes xq, returns the scale xs.
  CSA_HD static float quantize_block(const float* x, float* xq) {
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      const float a = fabsf(x[i]);
      if (a != a) { amax = a; break; }  // torch's amax propagates NaN
      amax = a > amax ? a : amax;
    }
    if (amax < kAmaxFloor) amax = kAmaxFloor;  // NaN stays NaN
    const float xs = pow2_ceil(amax * kMaxInv);
    for (int i = 0; i < kBlock; ++i) {
      float v = x[i] / xs;
      v = v < -kMax ? -kMax : (v > kMax ? kMax : v);  // NaN passes
      xq[i] = e4m3_rne(v);
    }
    return xs;
  }

  // acc + dot * (xs * ws) in float, each operation rounded on its own (never fused).
  CSA_HD static float accumulate(float acc, float dot, float xs, float ws) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(acc, __fmul_rn(dot, __fmul_rn(xs, ws)));
#else
    const float scale = xs * ws;
    const float term = dot * scale;
    return acc + term;
#endif
  }
  // W's layout "pairs16" ([N/16, K/32, 512], N a multiple of 16; fp8_linear_kernels.h says
  // why): the byte of code (n, k) in a W of K columns, n = 16g + 4l + c, k = 32kb + 2(2z +
  // h) + kp, at ((g * K/32 + kb) * 512 + 64z + 16l + 8h + 2c + kp.
  CSA_HD static int64_t pairs16_offset(int64_t K, int64_t n, int64_t k) {
    const int64_t p = (k % kBlock) / 2;
    return ((n / 16) * (K / kBlock) + k / kBlock) * 512 + 64 * (p / 2) + 16 * ((n % 16) / 4) +
           8 * (p % 2) + 2 * (n % 4) + k % 2;
  }
};

}  // namespace csa
