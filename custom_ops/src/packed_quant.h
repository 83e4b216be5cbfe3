// Packed quantised rows: the layer state's three quantisers stored as their codes and block
// scales instead of as float32 round-trip values (PackQuantized / UnpackQuantized, and
// SparseAttention's packed compressed cache). One row of d values is `row_bytes` bytes:
//
//   format        quantiser (as the graph computes it today)          bytes per row
//   fp4_e4m3_16   Fp4QuantDequant(block 16, e4m3 scales): compressed KV  d/2 + d/16  (4.5 bits)
//   fp4_e8m0_32   Fp4QuantDequant(block 32, e8m0 scales): index keys     d/2 + d/32  (4.25 bits)
//   fp8_e8m0_32   act_quant (e4m3 values, ue8m0 scale per 32): window    d + d/32    (8.25 bits)
//
// Layout: the codes first, then one scale byte per block, in order.
//   fp4 codes: two a byte, element 2i in bits 0-3 and element 2i+1 in bits 4-7; a code is
//     the e2m1 magnitude index (bits 0-2, grid order 0, .5, 1, 1.5, 2, 3, 4, 6) and the sign
//     (bit 3), i.e. the standard e2m1 encoding.
//   fp8 codes: one float8 e4m3fn byte per value (0x7F / 0xFF are NaN).
//   scale bytes: e4m3fn code of the scale (fp4_e4m3_16), or the e8m0 biased exponent
//     (scale = 2^(byte - 127); 0xFF = NaN, which also stands for an infinite scale).
//
// Unpacking gives Y = value(code) * scale in float32, bit for bit the round trip's bf16(q * s):
// q * s is exact in float32 and bf16 (at most 6 significant bits, never below 2^-127) or
// overflows to inf exactly as the round trip does (act_quant and e8m0 scales near the float
// maximum). A block whose amax is NaN or inf has a NaN or inf scale and the round trip makes
// every value of it NaN; here the scale byte is NaN (0x7F / 0xFF) and so is every unpacked
// value. NaN payloads and signs are not kept (the codes have no room for them): every NaN
// unpacks as the default quiet NaN 0x7FC00000 (the NaN codes' sign is dropped, so that a
// product of two NaNs has the same bits whichever operand the compiler puts first), and pack
// writes such a block's codes as 0, so that the packed bytes are defined everywhere.
//
// Pack follows the round trips' definitions step for step (fp4_quant.h for fp4, act_quant as
// fp8_linear.h's Fp8::quantize_block for fp8: a NaN anywhere in a block makes the whole block
// NaN, as torch's amax does). Everything is one exact or one IEEE float32 operation per value,
// so the plain code here, the AVX-512 / AVX2 pack (one template, PackSimd, over each width's
// primitives) and the AVX-512 / AVX2 unpack give the same bits; nothing depends on denormals-are-zero settings except an e8m0 scale byte 0 (2^-127),
// which pack never writes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "fp4_quant.h"
#include "fp8_linear.h"
#include "simd.h"

#ifdef CSA_X86
#include <immintrin.h>
#endif

// The vector helpers below pass __m512/__m256 between inline functions; every one is inlined
// into a function that carries the target (see sparse_attention_tiled.h), so no call changes
// the ABI.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace csa::packed {

// Block sizes per format (custom_ops/constants.py PACKED_FORMATS; tests/test_kernel_constants.py).
constexpr int64_t kFp4E4m3Block = 16;
constexpr int64_t kFp4E8m0Block = 32;
constexpr int64_t kFp8E8m0Block = 32;
constexpr int64_t kFp4CodesPerByte = 2;
constexpr int64_t kFp8CodesPerByte = 1;

enum class Format { kFp4E4m3 = 0, kFp4E8m0 = 1, kFp8E8m0 = 2 };

inline const char* format_name(Format f) {
  return f == Format::kFp4E4m3 ? "fp4_e4m3_16" : f == Format::kFp4E8m0 ? "fp4_e8m0_32"
                                                                          : "fp8_e8m0_32";
}

inline bool parse_format(const std::string& name, Format* f) {
  for (Format c : {Format::kFp4E4m3, Format::kFp4E8m0, Format::kFp8E8m0}) {
    if (name == format_name(c)) {
      *f = c;
      return true;
    }
  }
  return false;
}

constexpr const char* kFormatChoices = "\"fp4_e4m3_16\", \"fp4_e8m0_32\" or \"fp8_e8m0_32\"";

inline int64_t block_of(Format f) {
  return f == Format::kFp4E4m3 ? kFp4E4m3Block : f == Format::kFp4E8m0 ? kFp4E8m0Block
                                                                        : kFp8E8m0Block;
}
inline bool is_fp4(Format f) { return f != Format::kFp8E8m0; }
inline int64_t code_bytes(Format f, int64_t d) {
  return is_fp4(f) ? d / kFp4CodesPerByte : d / kFp8CodesPerByte;
}
inline int64_t row_bytes(Format f, int64_t d) { return code_bytes(f, d) + d / block_of(f); }

// Whether rows of d values can be packed in format f (d a non-negative multiple of the block).
inline bool dim_fits(Format f, int64_t d) { return d >= 0 && d % block_of(f) == 0; }

// ---------------------------------------------------------------- codes and their values

// Signed e2m1 values by code (sign bit 3).
alignas(64) constexpr float kE2m1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                               4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                               -2.0f, -3.0f, -4.0f, -6.0f};

// e2m1 magnitude index of |v| in [0, 6], ties to the even code: fp4_quant.h's
// e2m1_rne_magnitude as an index (.25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
inline uint32_t e2m1_index(float a) {
  return static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) +
         static_cast<uint32_t>(a > 1.25f) + static_cast<uint32_t>(a >= 1.75f) +
         static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
         static_cast<uint32_t>(a > 5.0f);
}

inline float quiet_nan() { return bits_float(0x7FC00000u); }

#ifdef CSA_X86
// AVX-512 code uses the zero-masked forms with every lane set: the plain ones pass GCC 12 an
// "undefined" source that it then warns about (-Wmaybe-uninitialized).
constexpr __mmask16 kAll16 = 0xFFFF;
#endif

// e4m3fn code -> value (0x7F / 0xFF NaN). Normals are the code's fields moved into a float's
// (exponent rebiased by 120), subnormals m * 2^-9.
inline float e4m3_value(uint32_t code) {
  const uint32_t m = code & 0x7Fu;
  if (m == 0x7Fu) return quiet_nan();
  const float mag = m < 8u ? static_cast<float>(m) * 0x1p-9f : bits_float((m << 20) + (120u << 23));
  return (code & 0x80u) ? -mag : mag;
}

// e8m0 byte -> 2^(byte - 127); 0xFF is NaN.
inline float e8m0_value(uint32_t byte) {
  if (byte == 0xFFu) return quiet_nan();
  return byte == 0u ? bits_float(0x00400000u) : bits_float(byte << 23);
}

// The e4m3fn code of v rounded to nearest even (|v| <= 448 or NaN; callers clamp), the same
// rounding as Fp8::e4m3_rne and fp4_quant.h's round_e4m3_saturating: the subnormal grid
// (multiples of 2^-9) by adding and subtracting 2^23, normals by rounding the float's bits to
// 3 mantissa bits. A NaN gives 0x7F.
inline uint32_t e4m3_code_rne(float v) {
  const float a = fabsf(v);
  const uint32_t sign = (float_bits(v) >> 24) & 0x80u;
  uint32_t mag;
  if (a < 0x1p-6f) {
    mag = static_cast<uint32_t>((a * 512.0f + 0x1p23f) - 0x1p23f);  // 0 .. 8 (8 = 2^-6)
  } else {
    const uint32_t b = float_bits(a);
    mag = (((b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u) >> 20) - (120u << 3);
  }
  return a != a ? 0x7Fu : (sign | mag);
}

// The e8m0 byte of a scale that is a power of two >= 2^-126, inf or NaN (both 0xFF).
inline uint32_t e8m0_code(float s) { return (float_bits(s) >> 23) & 0xFFu; }

// ---------------------------------------------------------------- pack
inline bool is_finite(float s) { return (float_bits(s) & 0x7F800000u) != 0x7F800000u; }

// Block amax as the round trips take it: max |x|, NaN if the block holds a NaN.
inline float block_amax_nan(const float* x, int64_t n) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = fabsf(x[i]);
    nan = nan || a != a;
    amax = a > amax ? a : amax;
  }
  return nan ? quiet_nan() : amax;
}

// fp4_block_scale (fp4_quant.h) without libm: the same floor and the same one float
// operation on amax, then 2^ceil(log2 t) from t's bit fields (t >= 2^-126 is normal here)
// or the e4m3 rounding of Fp8::e4m3_rne, saturating at 448 as round_e4m3_saturating does.
// tests/cpp/packed_rows.cc checks it against fp4_block_scale over the float range.
template <ScaleFormat SF>
inline float fp4_scale_bits(float amax) {
  if (SF == ScaleFormat::kE8M0) {
    const float floor_amax = 6.0f * 1.17549435e-38f;
    return Fp8::pow2_ceil((amax < floor_amax ? floor_amax : amax) * (1.0f / 6.0f));
  }
  const float floor_amax = 6.0f * 0.001953125f;
  const float t = (amax < floor_amax ? floor_amax : amax) / 6.0f;
  return t >= 448.0f ? 448.0f : Fp8::e4m3_rne(t);  // NaN passes
}

// act_quant's scale (Fp8::quantize_block) from the block's amax.
inline float fp8_scale(float amax) {
  if (amax < Fp8::kAmaxFloor) amax = Fp8::kAmaxFloor;  // NaN stays NaN
  return Fp8::pow2_ceil(amax * Fp8::kMaxInv);
}

// Plain code, the definitions' steps one value at a time (fp4_round_trip, quantize_block).
struct PackScalar {
  template <int64_t B, ScaleFormat SF>
  static void fp4(const float* x, uint8_t* codes, uint8_t* scale_byte) {
    const float s = fp4_block_scale(block_amax_nan(x, B), SF);
    *scale_byte =
        static_cast<uint8_t>(SF == ScaleFormat::kE8M0 ? e8m0_code(s) : e4m3_code_rne(s));
    const uint8_t keep = is_finite(s) ? 0xFF : 0x00;  // a NaN block's codes are all 0
    for (int64_t i = 0; i < B; i += 2) {
      uint32_t c[2];
      for (int k = 0; k < 2; ++k) {
        float v = x[i + k] / s;
        v = v > 6.0f ? 6.0f : (v < -6.0f ? -6.0f : v);
        c[k] = e2m1_index(fabsf(v)) | ((float_bits(v) >> 28) & 8u);
      }
      codes[i / 2] = static_cast<uint8_t>((c[0] | (c[1] << 4)) & keep);
    }
  }

  static void fp8(const float* x, uint8_t* codes, uint8_t* scale_byte) {
    const float xs = fp8_scale(block_amax_nan(x, kFp8E8m0Block));
    *scale_byte = static_cast<uint8_t>(e8m0_code(xs));
    const uint8_t keep = is_finite(xs) ? 0xFF : 0x00;
    for (int64_t i = 0; i < kFp8E8m0Block; ++i) {
      float v = x[i] / xs;
      v = v < -Fp8::kMax ? -Fp8::kMax : (v > Fp8::kMax ? Fp8::kMax : v);  // NaN passes
      codes[i] = static_cast<uint8_t>(e4m3_code_rne(v) & keep);
    }
  }
};

#ifdef CSA_X86
// AVX-512 and AVX2: the same steps on 16 / 8 values at a time, written once (PackSimd) over
// each width's primitives (Avx512Ops, Avx2Ops). The clamps use maxps/minps, which turn a NaN
// into the bound; a NaN quotient only occurs in a block whose scale is NaN or inf, whose codes
// are all written as 0. AVX-512 uses the zero-masked forms with every lane set (kAll16).
struct Avx512Ops {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr int kLanes = 16;
  CSA_TARGET_AVX512 static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  CSA_TARGET_AVX512 static inline F set1(float v) { return _mm512_set1_ps(v); }
  CSA_TARGET_AVX512 static inline I set1i(int v) { return _mm512_set1_epi32(v); }
  CSA_TARGET_AVX512 static inline I zero() { return _mm512_setzero_si512(); }
  CSA_TARGET_AVX512 static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  CSA_TARGET_AVX512 static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  CSA_TARGET_AVX512 static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  CSA_TARGET_AVX512 static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  CSA_TARGET_AVX512 static inline I bits(F v) { return _mm512_castps_si512(v); }
  CSA_TARGET_AVX512 static inline F abs(F v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bits(v), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  CSA_TARGET_AVX512 static inline I and_(I a, I b) { return _mm512_and_si512(a, b); }
  CSA_TARGET_AVX512 static inline I or_(I a, I b) { return _mm512_or_si512(a, b); }
  CSA_TARGET_AVX512 static inline I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  CSA_TARGET_AVX512 static inline I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  template <int N>
  CSA_TARGET_AVX512 static inline I srli(I a) { return _mm512_maskz_srli_epi32(kAll16, a, N); }
  CSA_TARGET_AVX512 static inline I cvtt(F v) { return _mm512_maskz_cvttps_epi32(kAll16, v); }
  template <int P>
  CSA_TARGET_AVX512 static inline M cmp(F a, float c) {
    return _mm512_cmp_ps_mask(a, _mm512_set1_ps(c), P);
  }
  CSA_TARGET_AVX512 static inline M is_nan(F v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
  CSA_TARGET_AVX512 static inline I blend(M m, I a, I b) {  // m ? b : a
    return _mm512_mask_blend_epi32(m, a, b);
  }
  CSA_TARGET_AVX512 static inline I count(I c, M k) {  // c + 1 where k is set
    return _mm512_mask_add_epi32(c, k, c, _mm512_set1_epi32(1));
  }
  CSA_TARGET_AVX512 static inline F clamp(F v, float bound) {
    return _mm512_maskz_min_ps(kAll16, _mm512_maskz_max_ps(kAll16, v, _mm512_set1_ps(-bound)),
                               _mm512_set1_ps(bound));
  }
  // max |x| over N vectors, NaN if any lane is NaN
  template <int N>
  CSA_TARGET_AVX512 static inline float amax(const F (&v)[N]) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int n = 0; n < N; ++n) {
      nan |= is_nan(v[n]);
      m = _mm512_maskz_max_ps(kAll16, m, abs(v[n]));
    }
    if (nan) return quiet_nan();
    const __m256 m8 = _mm256_max_ps(_mm512_maskz_extractf32x8_ps(0xFF, m, 0),
                                    _mm512_maskz_extractf32x8_ps(0xFF, m, 1));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
  // 16 codes (0..255 in int32 lanes) -> 16 bytes
  CSA_TARGET_AVX512 static inline __m128i bytes(I c) {
    return _mm512_maskz_cvtepi32_epi8(kAll16, c);
  }
  // the low kLanes / 2 bytes of b (the fp4 codes of kLanes values), the low kLanes (fp8)
  CSA_TARGET_AVX512 static inline void store_half(uint8_t* p, __m128i b) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), b);
  }
  CSA_TARGET_AVX512 static inline void store_lanes(uint8_t* p, __m128i b) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  }
};

struct Avx2Ops {
  using F = __m256;
  using I = __m256i;
  using M = __m256;  // all ones where set
  static constexpr int kLanes = 8;
  CSA_TARGET_AVX2 static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  CSA_TARGET_AVX2 static inline F set1(float v) { return _mm256_set1_ps(v); }
  CSA_TARGET_AVX2 static inline I set1i(int v) { return _mm256_set1_epi32(v); }
  CSA_TARGET_AVX2 static inline I zero() { return _mm256_setzero_si256(); }
  CSA_TARGET_AVX2 static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  CSA_TARGET_AVX2 static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  CSA_TARGET_AVX2 static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  CSA_TARGET_AVX2 static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  CSA_TARGET_AVX2 static inline I bits(F v) { return _mm256_castps_si256(v); }
  CSA_TARGET_AVX2 static inline F abs(F v) {
    return _mm256_castsi256_ps(_mm256_and_si256(bits(v), _mm256_set1_epi32(0x7FFFFFFF)));
  }
  CSA_TARGET_AVX2 static inline I and_(I a, I b) { return _mm256_and_si256(a, b); }
  CSA_TARGET_AVX2 static inline I or_(I a, I b) { return _mm256_or_si256(a, b); }
  CSA_TARGET_AVX2 static inline I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  CSA_TARGET_AVX2 static inline I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  template <int N>
  CSA_TARGET_AVX2 static inline I srli(I a) { return _mm256_srli_epi32(a, N); }
  CSA_TARGET_AVX2 static inline I cvtt(F v) { return _mm256_cvttps_epi32(v); }
  template <int P>
  CSA_TARGET_AVX2 static inline M cmp(F a, float c) {
    return _mm256_cmp_ps(a, _mm256_set1_ps(c), P);
  }
  CSA_TARGET_AVX2 static inline M is_nan(F v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
  CSA_TARGET_AVX2 static inline I blend(M m, I a, I b) {  // m ? b : a
    return _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), m));
  }
  CSA_TARGET_AVX2 static inline I count(I c, M k) {  // c - mask (all ones = -1)
    return _mm256_sub_epi32(c, _mm256_castps_si256(k));
  }
  CSA_TARGET_AVX2 static inline F clamp(F v, float bound) {
    return _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-bound)), _mm256_set1_ps(bound));
  }
  template <int N>
  CSA_TARGET_AVX2 static inline float amax(const F (&v)[N]) {
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int n = 0; n < N; ++n) {
      nan = _mm256_or_ps(nan, is_nan(v[n]));
      m = _mm256_max_ps(m, abs(v[n]));
    }
    if (_mm256_movemask_ps(nan)) return quiet_nan();
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
  }
  // 8 codes (0..255 in int32 lanes) -> 8 bytes in the low half
  CSA_TARGET_AVX2 static inline __m128i bytes(I c) {
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    return _mm_packus_epi16(w, w);
  }
  CSA_TARGET_AVX2 static inline void store_half(uint8_t* p, __m128i b) {
    const uint32_t four = static_cast<uint32_t>(_mm_cvtsi128_si32(b));
    std::memcpy(p, &four, sizeof four);
  }
  CSA_TARGET_AVX2 static inline void store_lanes(uint8_t* p, __m128i b) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), b);
  }
};

// The vector pack of either width (V: Avx512Ops or Avx2Ops). Not itself compiled for a
// target: it is inlined, with V's members, into the row loops that carry one (packed_ops.cc).
template <typename V>
struct PackSimd {
  using F = typename V::F;
  using I = typename V::I;

  template <int64_t B, ScaleFormat SF>
  static inline void fp4(const float* x, uint8_t* codes, uint8_t* scale_byte) {
    constexpr int N = static_cast<int>(B / V::kLanes);
    F v[N];
    for (int n = 0; n < N; ++n) v[n] = V::load(x + V::kLanes * n);
    const float s = fp4_scale_bits<SF>(V::template amax<N>(v));
    *scale_byte =
        static_cast<uint8_t>(SF == ScaleFormat::kE8M0 ? e8m0_code(s) : e4m3_code_rne(s));
    const __m128i keep = _mm_set1_epi8(static_cast<char>(is_finite(s) ? 0xFF : 0x00));
    const F sv = V::set1(s);
    for (int n = 0; n < N; ++n) {
      // q = x / s clamped, then its code: e2m1_index of |q| and the sign bit
      const F q = V::clamp(V::div(v[n], sv), 6.0f);
      const F a = V::abs(q);
      I code = V::zero();
      code = V::count(code, V::template cmp<_CMP_GT_OQ>(a, 0.25f));
      code = V::count(code, V::template cmp<_CMP_GE_OQ>(a, 0.75f));
      code = V::count(code, V::template cmp<_CMP_GT_OQ>(a, 1.25f));
      code = V::count(code, V::template cmp<_CMP_GE_OQ>(a, 1.75f));
      code = V::count(code, V::template cmp<_CMP_GT_OQ>(a, 2.5f));
      code = V::count(code, V::template cmp<_CMP_GE_OQ>(a, 3.5f));
      code = V::count(code, V::template cmp<_CMP_GT_OQ>(a, 5.0f));
      const I sign = V::and_(V::template srli<28>(V::bits(q)), V::set1i(8));
      const __m128i c = V::bytes(V::or_(code, sign));
      // the codes as u16 lanes (even code low): code_even | code_odd << 4, then bytes
      const __m128i nib = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi16(0x000F)),
                                       _mm_and_si128(_mm_srli_epi16(c, 4), _mm_set1_epi16(0x00F0)));
      V::store_half(codes + V::kLanes / 2 * n, _mm_and_si128(_mm_packus_epi16(nib, nib), keep));
    }
  }

  static inline void fp8(const float* x, uint8_t* codes, uint8_t* scale_byte) {
    constexpr int N = static_cast<int>(kFp8E8m0Block / V::kLanes);
    F v[N];
    for (int n = 0; n < N; ++n) v[n] = V::load(x + V::kLanes * n);
    const float xs = fp8_scale(V::template amax<N>(v));
    *scale_byte = static_cast<uint8_t>(e8m0_code(xs));
    const __m128i keep = _mm_set1_epi8(static_cast<char>(is_finite(xs) ? 0xFF : 0x00));
    const F sv = V::set1(xs);
    for (int n = 0; n < N; ++n) {
      // q = x / xs clamped, then e4m3_code_rne per lane
      const F q = V::clamp(V::div(v[n], sv), Fp8::kMax);
      const F a = V::abs(q);
      const I b = V::bits(a);
      const I sub = V::cvtt(
          V::sub(V::add(V::mul(a, V::set1(512.0f)), V::set1(0x1p23f)), V::set1(0x1p23f)));
      const I odd = V::and_(V::template srli<20>(b), V::set1i(1));
      const I r = V::and_(V::add_i(V::add_i(b, V::set1i(0x7FFFF)), odd),
                          V::set1i(static_cast<int>(0xFFF00000u)));
      const I normal = V::sub_i(V::template srli<20>(r), V::set1i(120 << 3));
      const I mag = V::blend(V::template cmp<_CMP_LT_OQ>(a, 0x1p-6f), normal, sub);
      const I sign = V::and_(V::template srli<24>(V::bits(q)), V::set1i(0x80));
      const __m128i c = V::bytes(V::blend(V::is_nan(q), V::or_(mag, sign), V::set1i(0x7F)));
      V::store_lanes(codes + V::kLanes * n, _mm_and_si128(c, keep));
    }
  }
};

using PackAvx512 = PackSimd<Avx512Ops>;
using PackAvx2 = PackSimd<Avx2Ops>;
#endif

// One row of d values (d a multiple of the format's block) into row_bytes(f, d) bytes.
template <typename P>
inline void pack_row(Format f, const float* x, int64_t d, uint8_t* out) {
  uint8_t* scales = out + code_bytes(f, d);
  const int64_t block = block_of(f);
  for (int64_t b = 0; b < d / block; ++b) {
    const float* xb = x + b * block;
    if (f == Format::kFp4E4m3) {
      P::template fp4<kFp4E4m3Block, ScaleFormat::kE4M3>(xb, out + b * block / 2, scales + b);
    } else if (f == Format::kFp4E8m0) {
      P::template fp4<kFp4E8m0Block, ScaleFormat::kE8M0>(xb, out + b * block / 2, scales + b);
    } else {
      P::fp8(xb, out + b * block, scales + b);
    }
  }
}

// ---------------------------------------------------------------- unpack
// The block's scale from its byte.
inline float block_scale(Format f, uint32_t byte) {
  return f == Format::kFp4E4m3 ? e4m3_value(byte) : e8m0_value(byte);
}

// Plain code: table lookups.
inline void unpack_row_scalar(Format f, const uint8_t* p, int64_t d, float* y) {
  const uint8_t* scales = p + code_bytes(f, d);
  const int64_t block = block_of(f);
  for (int64_t b = 0; b < d / block; ++b) {
    const float s = block_scale(f, scales[b]);
    float* yb = y + b * block;
    if (is_fp4(f)) {
      const uint8_t* cb = p + b * block / 2;
      for (int64_t i = 0; i < block / 2; ++i) {
        yb[2 * i] = kE2m1Values[cb[i] & 15u] * s;
        yb[2 * i + 1] = kE2m1Values[cb[i] >> 4] * s;
      }
    } else {
      const uint8_t* cb = p + b * block;
      for (int64_t i = 0; i < block; ++i) yb[i] = e4m3_value(cb[i]) * s;
    }
  }
}

#ifdef CSA_X86
// AVX-512: fp4 codes through vpermps on the 16 signed values; e4m3 codes by their fields.
CSA_TARGET_AVX512 inline __m512 e4m3_values_avx512(__m512i c) {
  const __m512i m = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_maskz_slli_epi32(kAll16, m, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(kAll16, m), _mm512_set1_ps(0x1p-9f));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(m, _mm512_set1_epi32(8));
  const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(m, _mm512_set1_epi32(0x7F));
  const __m512i sign =
      _mm512_maskz_slli_epi32(kAll16, _mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  const __m512 v = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(_mm512_mask_blend_ps(is_sub, normal, sub)), sign));
  return _mm512_mask_blend_ps(is_nan, v, _mm512_set1_ps(quiet_nan()));
}

// 16 fp4 codes (8 bytes) -> their code indices, element order.
CSA_TARGET_AVX512 inline __m512i fp4_indices_avx512(const uint8_t* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i n = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x000F)),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x00F0)), 4));
  return _mm512_maskz_cvtepu8_epi32(kAll16, n);
}

// block_scale of up to 16 scale bytes, one per lane (lanes past n: unspecified).
CSA_TARGET_AVX512 inline __m512 block_scales_avx512(Format f, const uint8_t* scales, int64_t n) {
  const __mmask16 in = n >= 16 ? kAll16 : static_cast<__mmask16>((1u << n) - 1u);
  const __m512i c = _mm512_maskz_cvtepu8_epi32(kAll16, _mm_maskz_loadu_epi8(in, scales));
  if (f == Format::kFp4E4m3) return e4m3_values_avx512(c);
  // e8m0_value: 2^(byte - 127) by the exponent field, byte 0 the denormal 2^-127, 0xFF NaN
  const __m512i bits = _mm512_mask_mov_epi32(_mm512_maskz_slli_epi32(kAll16, c, 23),
                                             _mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()),
                                             _mm512_set1_epi32(0x00400000));
  return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(0xFF)),
                              _mm512_castsi512_ps(bits), _mm512_set1_ps(quiet_nan()));
}

// The blocks' scales are decoded 16 at a time (measured in SparseAttention's decode, batch
// 4: unpacking its fp4_e4m3_16 rows took 13% of the samples with block_scale's branches a
// byte at a time, 9% this way).
CSA_TARGET_AVX512 inline void unpack_row_avx512(Format f, const uint8_t* p, int64_t d, float* y) {
  const uint8_t* scales = p + code_bytes(f, d);
  const int64_t block = block_of(f), blocks = d / block;
  const __m512 table = _mm512_load_ps(kE2m1Values);
  alignas(64) float s[16];
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    _mm512_store_ps(s, block_scales_avx512(f, scales + b0, blocks - b0));
    const int64_t b1 = blocks - b0 < 16 ? blocks : b0 + 16;
    for (int64_t b = b0; b < b1; ++b) {
      const __m512 sv = _mm512_set1_ps(s[b - b0]);
      for (int64_t i = 0; i < block; i += 16) {
        __m512 v;
        if (is_fp4(f)) {
          v = _mm512_maskz_permutexvar_ps(kAll16, fp4_indices_avx512(p + (b * block + i) / 2),
                                          table);
        } else {
          v = e4m3_values_avx512(_mm512_maskz_cvtepu8_epi32(
              kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * block + i))));
        }
        _mm512_storeu_ps(y + b * block + i, _mm512_mul_ps(v, sv));
      }
    }
  }
}

// AVX2: 8 values a vector; vpermps looks up the magnitude (low 3 bits), bit 3 the sign.
CSA_TARGET_AVX2 inline __m256 e4m3_values_avx2(__m256i c) {
  const __m256i m = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(m, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0x1p-9f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), m));
  const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, _mm256_set1_epi32(0x7F)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256 v = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_castps_si256(_mm256_blendv_ps(normal, sub, is_sub)), sign));
  return _mm256_blendv_ps(v, _mm256_set1_ps(quiet_nan()), is_nan);
}

CSA_TARGET_AVX2 inline __m256 fp4_values_avx2(const uint8_t* p, __m256 magnitudes) {
  uint32_t four;
  std::memcpy(&four, p, sizeof four);
  const __m128i w = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(static_cast<int>(four)));
  const __m128i n = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x000F)),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x00F0)), 4));
  const __m256i idx = _mm256_cvtepu8_epi32(n);
  const __m256 mag = _mm256_permutevar8x32_ps(magnitudes, idx);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
}

CSA_TARGET_AVX2 inline void unpack_row_avx2(Format f, const uint8_t* p, int64_t d, float* y) {
  const uint8_t* scales = p + code_bytes(f, d);
  const int64_t block = block_of(f);
  if (is_fp4(f)) {
    const __m256 magnitudes = _mm256_load_ps(kE2m1Values);
    for (int64_t b = 0; b < d / block; ++b) {
      const __m256 s = _mm256_set1_ps(block_scale(f, scales[b]));
      for (int64_t i = 0; i < block; i += 8)
        _mm256_storeu_ps(y + b * block + i,
                         _mm256_mul_ps(fp4_values_avx2(p + (b * block + i) / 2, magnitudes), s));
    }
  } else {
    for (int64_t b = 0; b < d / block; ++b) {
      const __m256 s = _mm256_set1_ps(block_scale(f, scales[b]));
      for (int64_t i = 0; i < block; i += 8) {
        const __m256i c = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + b * block + i)));
        _mm256_storeu_ps(y + b * block + i, _mm256_mul_ps(e4m3_values_avx2(c), s));
      }
    }
  }
}
#endif

}  // namespace csa::packed

#pragma GCC diagnostic pop
