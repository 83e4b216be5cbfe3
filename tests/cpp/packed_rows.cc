// packed_quant.h's building blocks against the definitions they replace, over the float
// range rather than on sample rows:
//   - fp4_scale_bits<SF> (no libm) against fp4_quant.h's fp4_block_scale, both scale formats,
//     for every float bit pattern of amax in steps of 61 plus every pattern within 64 of each
//     value where a result changes (6 x every power of two, 6 x every e4m3 value and midpoint);
//   - e4m3_code_rne against round_e4m3_saturating (the Fp4QuantDequant scale rounding) and
//     Fp8::e4m3_rne (act_quant's), the code's value read back with e4m3_value, for every float
//     bit pattern with |v| <= 448 in steps of 29 and around every e4m3 value and midpoint;
//   - every path's pack and unpack of random rows of every format: the same bytes and bits.
// Prints "checked=N mismatches=M" last; exits 1 on a mismatch.
// Build: g++ -O2 -std=c++17 -ffp-contract=off -I custom_ops/src
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "packed_quant.h"

namespace pk = csa::packed;

namespace {

int64_t checked = 0, mismatches = 0;

void expect_same(float got, float want, const char* what, float input) {
  ++checked;
  uint32_t a, b;
  std::memcpy(&a, &got, 4);
  std::memcpy(&b, &want, 4);
  const bool both_nan = got != got && want != want;
  if (a != b && !both_nan) {
    if (mismatches < 10)
      std::printf("MISMATCH %s(%a): %a, want %a\n", what, static_cast<double>(input),
                  static_cast<double>(got), static_cast<double>(want));
    ++mismatches;
  }
}

void check_scale(float amax) {
  expect_same(pk::fp4_scale_bits<csa::ScaleFormat::kE8M0>(amax),
              csa::fp4_block_scale(amax, csa::ScaleFormat::kE8M0), "e8m0 scale", amax);
  expect_same(pk::fp4_scale_bits<csa::ScaleFormat::kE4M3>(amax),
              csa::fp4_block_scale(amax, csa::ScaleFormat::kE4M3), "e4m3 scale", amax);
}

void check_code(float v) {
  if (!(std::fabs(v) <= 448.0f)) return;
  const float value = pk::e4m3_value(pk::e4m3_code_rne(v));
  expect_same(value, csa::round_e4m3_saturating(v), "e4m3 code (saturating)", v);
  expect_same(value, csa::Fp8::e4m3_rne(v), "e4m3 code (act_quant)", v);
}

// Every float within 64 patterns of x (both signs for the codes).
template <typename F>
void around(float x, F check) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  for (int64_t k = -64; k <= 64; ++k) {
    const int64_t w = static_cast<int64_t>(u) + k;
    if (w < 0 || w >= 0x7F800000) continue;
    const uint32_t b = static_cast<uint32_t>(w);
    float y;
    std::memcpy(&y, &b, 4);
    check(y);
  }
}

using PackFn = void (*)(pk::Format, const float*, int64_t, uint8_t*);
using UnpackFn = void (*)(pk::Format, const uint8_t*, int64_t, float*);

__attribute__((flatten)) void pack_scalar(pk::Format f, const float* x, int64_t d, uint8_t* p) {
  pk::pack_row<pk::PackScalar>(f, x, d, p);
}
#ifdef CSA_X86
CSA_TARGET_AVX512 __attribute__((flatten)) void pack_avx512(pk::Format f, const float* x,
                                                            int64_t d, uint8_t* p) {
  pk::pack_row<pk::PackAvx512>(f, x, d, p);
}
CSA_TARGET_AVX2 __attribute__((flatten)) void pack_avx2(pk::Format f, const float* x, int64_t d,
                                                        uint8_t* p) {
  pk::pack_row<pk::PackAvx2>(f, x, d, p);
}
CSA_TARGET_AVX512 __attribute__((flatten)) void unpack_avx512(pk::Format f, const uint8_t* p,
                                                              int64_t d, float* y) {
  pk::unpack_row_avx512(f, p, d, y);
}
CSA_TARGET_AVX2 __attribute__((flatten)) void unpack_avx2(pk::Format f, const uint8_t* p,
                                                          int64_t d, float* y) {
  pk::unpack_row_avx2(f, p, d, y);
}
#endif

void check_rows(std::mt19937_64& rng) {
  std::vector<std::pair<PackFn, UnpackFn>> paths{{pack_scalar, pk::unpack_row_scalar}};
#ifdef CSA_X86
  if (csa::cpu_has_x86_64_v3()) paths.push_back({pack_avx2, unpack_avx2});
  if (csa::cpu_has_x86_64_v4()) paths.push_back({pack_avx512, unpack_avx512});
#endif
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> binade(-140, 120);
  std::uniform_int_distribution<int> special(0, 63);
  const int64_t d = 512;
  std::vector<float> x(d), y0(d), y(d);
  for (pk::Format f : {pk::Format::kFp4E4m3, pk::Format::kFp4E8m0, pk::Format::kFp8E8m0}) {
    const int64_t rb = pk::row_bytes(f, d);
    std::vector<uint8_t> p0(rb), p(rb);
    for (int row = 0; row < 2000; ++row) {
      const int e = binade(rng);
      for (float& v : x) {
        v = std::ldexp(normal(rng), row % 2 ? e : binade(rng));
        const int s = special(rng);
        if (s == 0) v = INFINITY;
        if (s == 1) v = -INFINITY;
        if (s == 2 && row % 3 == 0) v = NAN;
        if (s == 3) v = -0.0f;
      }
      pack_scalar(f, x.data(), d, p0.data());
      pk::unpack_row_scalar(f, p0.data(), d, y0.data());
      for (const auto& path : paths) {
        path.first(f, x.data(), d, p.data());
        path.second(f, p.data(), d, y.data());
        checked += 2;
        if (std::memcmp(p.data(), p0.data(), rb) != 0 ||
            std::memcmp(y.data(), y0.data(), d * sizeof(float)) != 0) {
          if (mismatches < 10) std::printf("MISMATCH %s row %d\n", pk::format_name(f), row);
          ++mismatches;
        }
      }
    }
  }
}

}  // namespace

int main() {
  for (uint64_t u = 0; u < 0x7F800000u; u += 61) {
    float a;
    const uint32_t b = static_cast<uint32_t>(u);
    std::memcpy(&a, &b, 4);
    check_scale(a);
  }
  check_scale(INFINITY);
  check_scale(NAN);
  for (int e = -149; e < 128; ++e) around(6.0f * std::ldexp(1.0f, e), check_scale);
  for (uint32_t code = 0; code < 0x7F; ++code) {
    const float v = pk::e4m3_value(code), next = pk::e4m3_value(code + 1);
    around(6.0f * v, check_scale);
    around(6.0f * (v + (next - v) / 2), check_scale);  // scale ties
  }
  for (uint64_t u = 0; u <= 0x43E00000u; u += 29) {  // |v| <= 448
    float v;
    const uint32_t b = static_cast<uint32_t>(u);
    std::memcpy(&v, &b, 4);
    check_code(v);
    check_code(-v);
  }
  for (uint32_t code = 0; code < 0x7E; ++code) {
    const float v = pk::e4m3_value(code), next = pk::e4m3_value(code + 1);
    for (float w : {v, v + (next - v) / 2}) {
      around(w, check_code);
      around(-w, check_code);
    }
  }
  check_code(NAN);
  std::mt19937_64 rng(1);
  check_rows(rng);
  std::printf("checked=%lld mismatches=%lld\n", static_cast<long long>(checked),
              static_cast<long long>(mismatches));
  return mismatches == 0 ? 0 : 1;
}
