// fp8_int_blocks.h's norm figure against integer brute force: sqrt_ceil(sq) is the least r
// with r * r >= sq for every sq below 2^20 and for r * r - 1, r * r, r * r + 1 with every r
// up to 2^21 (a block's squares sum below 32 * 2^36 = 2^41), and analyse_block's l2 on
// random blocks of units (every e4m3 magnitude, signs, zeros). Prints "checked=N bad=B"
// last; exits 1 if B > 0. Build: g++ -O2 -std=c++17 -I custom_ops/src.
#include <cstdint>
#include <cstdio>
#include <random>

#include "fp8_int_blocks.h"

namespace {

using ull = unsigned long long;

bool is_ceil_root(uint64_t sq, uint64_t r) {
  return r * r >= sq && (r == 0 || (r - 1) * (r - 1) < sq);
}

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
