// Integer view of Fp8Linear's blocks (the CPU kernel, fp8_linear_op.cc): why a 32-value
// block dot of e4m3 values can be summed exactly in int32 lanes, and the scalar helpers
// every instruction-set path shares. Plain C++; the rule, not a kernel.
//
// Every finite e4m3fn value is an integer multiple of 2^-9 below 2^9 in magnitude: its
// "units" u = value * 2^9 are integers with |u| <= 448 * 512 = 229376 < 2^18. For a block of
// 32 values (a row m of act_quant(X) over K block kb, or a row n of W over kb) let t be the
// smallest trailing-zero count of the nonzero units (the bitwise OR's lowest set bit). Then
// u >> t is exact for every value of the block, and the block is "int16" when
// max |u >> t| < 2^15. For an int16 x block and an int16 w block the products are below
// 2^30 and the dot S = sum (ux >> tx) * (uw >> tw) is exact in int32 lanes, summed in any
// order, whenever |S| < 2^31: the lanes add modulo 2^32 (vpdpwssd, vpmaddwd and vpaddd wrap,
// and a pair of int16 products never reaches 2^31), so partial sums may wrap and come back.
// The kernel checks |S| < 2^31 with three bounds, any one enough:
//   max|x| * sum|w| < 2^31,  sum|x| * max|w| < 2^31,  or  ceil||x|| * ceil||w|| < 2^31
// (the last by Cauchy-Schwarz, ||.|| the Euclidean norm of the block's u >> t; per x block and
// per group of 16 w blocks: the largest sum, max and norm among them).
// The block's dot is then S * 2^(tx + tw - 18) exactly, and
//   float(dot) = float(S) * 2^tw * 2^(tx - 18)
// (one rounding, int32 -> float, then two exact power-of-two scalings: |S| < 2^31 and S is an
// integer, so every value stays a normal float). Blocks where that does not hold are summed
// exactly in wider arithmetic, so every output equals the definition (fp8_linear.h) bit for
// bit on every path: a block of up to 18 bits is split into two int16 digits, v = h * 2^8 + l
// with |h| < 2^10 and 0 <= l < 2^8, each digit's dot against an int16 block is below 2^30 in
// int32, and h_dot * 2^8 + l_dot is combined in int64 and rounded once (or, for two blocks
// that are both not int16, an int64 dot).
#pragma once

#include <cstdint>

#include "fp8_linear.h"

namespace csa::fp8_int {

static_assert((-9 >> 1) == -5, "arithmetic right shift of negative integers");

constexpr int32_t kUnitsPerOne = 512;     // 2^9: e4m3 values are multiples of 2^-9
constexpr uint32_t kInt16Limit = 1u << 15;  // |u >> t| below this fits an int16 lane
constexpr uint32_t kSumLimit = 0x7FFFFFFFu; // int32 partial sums stay at or below this
constexpr int kDigitBits = 8;              // wide blocks: v = (v >> 8) * 2^8 + (v & 255)

// e4m3fn code -> units (the value * 2^9, exact); the NaN codes 0x7F / 0xFF give 0 (their
// output columns are set to NaN separately).
struct UnitTable {
  int32_t v[256];
  UnitTable() {
    for (int c = 0; c < 256; ++c) {
      const int32_t e = (c >> 3) & 15, m = c & 7;
      int32_t mag = e == 0 ? m : (8 + m) << (e - 1);
      if ((c & 0x7F) == 0x7F) mag = 0;
      v[c] = (c & 0x80) ? -mag : mag;
    }
  }
};
inline const UnitTable kUnits;

// act_quant's e4m3 value (as float, on the grid, |q| <= 448, or NaN) -> units; NaN -> 0
// (its row's scale is NaN or inf, which makes the row's outputs NaN whatever the dot is).
inline int32_t units_of_value(float q) {
  return q == q ? static_cast<int32_t>(q * static_cast<float>(kUnitsPerOne)) : 0;
}

// The exactness figures of one block of 32 units.
struct BlockInts {
  uint32_t shift = 0;   // t: the power of two taken out of every value (0 for a zero block)
  uint32_t absmax = 0;  // max |u >> t|
  uint32_t l1 = 0;      // sum |u >> t| (< 2^23)
  uint32_t l2 = 0;      // ceil(||u >> t||), the Euclidean norm rounded up (< 2^21)
  bool fits() const { return absmax < kInt16Limit; }
};

// ceil(sqrt(sq)), exactly for sq < 2^52 (the double's square root corrected by integers).
inline uint32_t sqrt_ceil(uint64_t sq) {
  uint64_t r = static_cast<uint64_t>(__builtin_sqrt(static_cast<double>(sq)));
  while (r * r < sq) ++r;
  while (r > 0 && (r - 1) * (r - 1) >= sq) --r;
  return static_cast<uint32_t>(r);
}

inline BlockInts analyse_block(const int32_t* u) {
  uint32_t any = 0;
  for (int i = 0; i < Fp8::kBlock; ++i) any |= static_cast<uint32_t>(u[i] < 0 ? -u[i] : u[i]);
  BlockInts b;
  b.shift = any != 0 ? static_cast<uint32_t>(__builtin_ctz(any)) : 0u;
  uint64_t sq = 0;
  for (int i = 0; i < Fp8::kBlock; ++i) {
    const uint32_t a = static_cast<uint32_t>(u[i] < 0 ? -u[i] : u[i]) >> b.shift;
    b.absmax = a > b.absmax ? a : b.absmax;
    b.l1 += a;
    sq += uint64_t{a} * a;
  }
  b.l2 = sqrt_ceil(sq);
  return b;
}

// The largest value v with v * q <= kSumLimit (q > 0), or all of uint32 for q == 0: an x
// block pairs with a group of w blocks in int32 when the group's largest sum |w| is at most
// limit(max |x|), or its largest max |w| at most limit(sum |x|), or its largest norm at most
// limit(norm of x).
inline uint32_t sum_limit(uint32_t q) { return q == 0 ? 0xFFFFFFFFu : kSumLimit / q; }

// 2^e as a float, e in [-126, 127] (bit fields: exact).
inline float pow2f(int e) { return Fp8::from_bits(static_cast<uint32_t>(127 + e) << 23); }

// The exact dot of two blocks of units shifted right by tx and tw, rounded once to float:
// |x| < 2^18 and |w| < 2^18, so 32 products sum exactly in int64.
inline float exact_dot(const int32_t* ux, uint32_t tx, const int32_t* uw, uint32_t tw) {
  int64_t s = 0;
  for (int i = 0; i < Fp8::kBlock; ++i)
    s += static_cast<int64_t>(ux[i] >> tx) * static_cast<int64_t>(uw[i] >> tw);
  return static_cast<float>(s);
}

}  // namespace csa::fp8_int
