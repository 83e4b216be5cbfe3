// The fast kernel's vectorised exp (sparse_attention_fast.h VectorExp) against std::exp,
// the definition's: every `stride`-th float in [-150, 100] (both signs of zero included),
// then -inf, inf, NaN and arguments past the clamps, in runs of every length 1..16 (the
// masked tail). Prints "values=N differ=D beyond=B specials=S" last: D arguments one ulp
// apart, B further apart (must be 0), S special values wrong (must be 0); exits 1 if B or S.
// Build: g++ -O2 -std=c++17 -I custom_ops/src (x86-64; runs only where AVX512-BF16 is).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"
#include "sparse_attention_fast.h"

namespace fast = csa::sparse_attention::fast;

namespace {

CSA_TARGET_AVX512BF16 __attribute__((flatten)) void vector_exp(float* x, int64_t n) {
  fast::VectorExp::apply(x, n);
}

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  if (!csa::cpu_has_avx512bf16()) {
    std::printf("values=0 differ=0 beyond=0 specials=0 (no AVX512-BF16)\n");
    return 0;
  }
  const uint32_t stride = argc > 1 ? static_cast<uint32_t>(std::atoi(argv[1])) : 61;
  std::vector<float> x;
  for (uint32_t sign : {0x80000000u, 0u}) {
    const uint32_t top = bits_of(sign ? 150.0f : 100.0f);
    for (uint32_t b = 0; b <= top; b += stride) x.push_back(float_of(sign | b));
  }
  long long differ = 0, beyond = 0;
  for (size_t i0 = 0, len = 1; i0 < x.size(); i0 += len, len = len % 16 + 1) {
    const size_t n = i0 + len <= x.size() ? len : x.size() - i0;
    float y[16];
    std::memcpy(y, x.data() + i0, n * sizeof(float));
    vector_exp(y, static_cast<int64_t>(n));
    for (size_t i = 0; i < n; ++i) {
      const int64_t d = static_cast<int64_t>(bits_of(y[i])) - bits_of(std::exp(x[i0 + i]));
      differ += d != 0;
      if (d > 1 || d < -1) {
        if (beyond++ < 5) std::printf("exp(%a): %a, std::exp %a\n", x[i0 + i], y[i],
                                      std::exp(x[i0 + i]));
      }
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  float special[7] = {-inf, inf, std::nanf(""), -1e30f, 1e30f, -200.0f, 89.0f};
  vector_exp(special, 7);
  const int wrong = (special[0] != 0.0f) + (special[1] != inf) + !std::isnan(special[2]) +
                    (special[3] != 0.0f) + (special[4] != inf) + (special[5] != 0.0f) +
                    (special[6] != inf);
  std::printf("values=%zu differ=%lld beyond=%lld specials=%d\n", x.size(), differ, beyond,
              wrong);
  return beyond == 0 && wrong == 0 ? 0 : 1;
}
