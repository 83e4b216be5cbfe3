// The exact softmax's vectorised exp (libm_expf.h apply_avx512) against std::exp, bit for bit:
// every `stride`-th float bit pattern (default 1: all 2^32 of them, NaNs and infinities
// included), in runs of every length 1..8 (the masked tail). Prints
// "values=N differ=D self_check=C" last: D arguments whose bits differ (must be 0), C whether
// the library's own check (matches_libm) accepts this libm; exits 1 if D > 0 or C disagrees.
// Build: g++ -O2 -std=c++17 -I custom_ops/src (x86-64; runs only where AVX-512 is).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "libm_expf.h"
#include "simd.h"

namespace {

CSA_TARGET_AVX512 __attribute__((flatten)) void vector_exp(float* x, int64_t n) {
  csa::libm_expf::apply_avx512(x, n);
}

CSA_TARGET_AVX512 __attribute__((flatten)) bool self_check() {
  return csa::libm_expf::matches_libm();
}

}  // namespace

int main(int argc, char** argv) {
  if (!csa::cpu_has_x86_64_v4()) {
    std::printf("values=0 differ=0 self_check=1 (no AVX-512)\n");
    return 0;
  }
  const uint64_t stride = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1;
  long long values = 0, differ = 0;
  uint64_t b = 0, len = 1;
  while (b <= 0xFFFFFFFFull) {
    float x[8], y[8];
    int64_t n = 0;
    for (; n < static_cast<int64_t>(len) && b <= 0xFFFFFFFFull; ++n, b += stride) {
      const uint32_t u = static_cast<uint32_t>(b);
      std::memcpy(&x[n], &u, sizeof u);
    }
    std::memcpy(y, x, sizeof x);
    vector_exp(y, n);
    for (int64_t i = 0; i < n; ++i) {
      const float want = std::exp(x[i]);
      if (std::memcmp(&y[i], &want, sizeof want) != 0 && differ++ < 5)
        std::printf("exp(%a): %a, std::exp %a\n", x[i], y[i], want);
    }
    values += n;
    len = len % 8 + 1;
  }
  const bool check = self_check();
  std::printf("values=%lld differ=%lld self_check=%d\n", values, differ, check ? 1 : 0);
  return differ == 0 && check ? 0 : 1;
}
