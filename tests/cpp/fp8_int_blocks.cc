// fp8_int_blocks.h's norm figure against integer brute force: sqrt_ceil(sq) is the least r
// with r * r >= sq for every sq below 2^20 and for r * r - 1, r * r, r * r + 1 with every r
// up to 2^21 (a block's squares sum below 32 * 2^36 = 2^41), and analyse_block's l2 on
// random blocks of units (every e4m3 magnitude, signs, zeros); where the CPU has AVX-512,
// fp8_block_figures_avx512.h's sqrt_ceil8 and sum_limit16 against the scalar helpers on the
// same values (sum_limit for every q below 2^22 and around every power of two and k * 2^j).
// Prints "checked=N bad=B" last; exits 1 if B > 0. Build: g++ -O2 -std=c++17 -I custom_ops/src.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "fp8_block_figures_avx512.h"
#include "fp8_int_blocks.h"

namespace {

using ull = unsigned long long;

bool is_ceil_root(uint64_t sq, uint64_t r) {
  return r * r >= sq && (r == 0 || (r - 1) * (r - 1) < sq);
}

#ifdef CSA_X86
// The vector helpers on 8 (sqrt_ceil8) and 16 (sum_limit16) values against the scalar ones.
CSA_TARGET_AVX512 uint64_t vector_mismatches(const std::vector<uint64_t>& squares,
                                             const std::vector<uint32_t>& qs) {
  uint64_t bad = 0;
  for (size_t i = 0; i + 8 <= squares.size(); i += 8) {
    alignas(32) uint32_t got[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(got),
                       csa::fp8_int::sqrt_ceil8(_mm512_loadu_si512(squares.data() + i)));
    for (int j = 0; j < 8; ++j)
      if (got[j] != csa::fp8_int::sqrt_ceil(squares[i + j]) && ++bad <= 5)
        std::printf("sqrt_ceil8(%llu) = %u\n", static_cast<ull>(squares[i + j]), got[j]);
  }
  for (size_t i = 0; i + 16 <= qs.size(); i += 16) {
    alignas(64) uint32_t got[16];
    _mm512_store_si512(got, csa::fp8_int::sum_limit16(_mm512_loadu_si512(qs.data() + i)));
    for (int j = 0; j < 16; ++j)
      if (got[j] != csa::fp8_int::sum_limit(qs[i + j]) && ++bad <= 5)
        std::printf("sum_limit16(%u) = %u\n", qs[i + j], got[j]);
  }
  return bad;
}
#endif

}  // namespace

int main() {
  using csa::fp8_int::sqrt_ceil;
  uint64_t checked = 0, bad = 0;
  auto check = [&](uint64_t sq) {
    ++checked;
    if (!is_ceil_root(sq, sqrt_ceil(sq)) && ++bad <= 5)
      std::printf("sqrt_ceil(%llu) = %u\n", static_cast<ull>(sq), sqrt_ceil(sq));
  };
  for (uint64_t sq = 0; sq < (uint64_t{1} << 20); ++sq) check(sq);
  for (uint64_t r = 1; r <= (uint64_t{1} << 21); ++r) {
    check(r * r - 1);
    check(r * r);
    check(r * r + 1);
  }
#ifdef CSA_X86
  if (csa::cpu_has_x86_64_v4()) {
    std::vector<uint64_t> squares;
    for (uint64_t sq = 0; sq < (uint64_t{1} << 20); ++sq) squares.push_back(sq);
    for (uint64_t r = 1; r <= (uint64_t{1} << 21); ++r)
      for (uint64_t d : {r * r - 1, r * r, r * r + 1}) squares.push_back(d);
    for (uint64_t r = (uint64_t{1} << 25) - 64; r < (uint64_t{1} << 25) + 64; ++r)  // sums near 2^50
      for (uint64_t d : {r * r - 1, r * r, r * r + 1}) squares.push_back(d);
    std::vector<uint32_t> qs;
    for (uint32_t q = 0; q < (1u << 22); ++q) qs.push_back(q);
    for (uint32_t j = 0; j < 32; ++j)
      for (uint32_t k = 1; k < 64; ++k)
        for (int d = -1; d <= 1; ++d) qs.push_back(static_cast<uint32_t>((uint64_t{k} << j) + d));
    while (qs.size() % 16 != 0) qs.push_back(0xFFFFFFFFu);
    checked += squares.size() + qs.size();
    bad += vector_mismatches(squares, qs);
  } else {
    std::printf("no AVX-512: sqrt_ceil8 and sum_limit16 not checked\n");
  }
#endif
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200000; ++trial) {
    int32_t u[csa::Fp8::kBlock];
    for (int32_t& v : u) v = csa::fp8_int::kUnits.v[rng() & 0xFF];  // NaN codes give 0
    const csa::fp8_int::BlockInts b = csa::fp8_int::analyse_block(u);
    uint64_t sq = 0;
    for (const int32_t v : u) {
      const uint64_t a = static_cast<uint64_t>(v < 0 ? -v : v) >> b.shift;
      sq += a * a;
    }
    ++checked;
    if (!is_ceil_root(sq, b.l2) && ++bad <= 5)
      std::printf("block %d: l2 %u for the sum %llu\n", trial, b.l2, static_cast<ull>(sq));
  }
  std::printf("checked=%llu bad=%llu\n", static_cast<ull>(checked), static_cast<ull>(bad));
  return bad == 0 ? 0 : 1;
}
