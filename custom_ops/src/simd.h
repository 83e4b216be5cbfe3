// Function-level instruction-set targets and the runtime check that picks one: kernels are
// compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA) and plain x86-64 (TorchLinear
// also for x86-64-v4 + AVX512_BF16), and every path computes the same bits (the summation
// order is fixed; fmaf is exact everywhere). Nothing is built with -march: the library
// loads on any x86-64 and picks a path at run time.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#define CSA_X86 1
#define CSA_TARGET_AVX512 __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
#define CSA_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
// x86-64-v4 plus AVX512_BF16 (vdpbf16ps: Zen 4, Cooper Lake, Sapphire Rapids and later).
#define CSA_TARGET_AVX512BF16 \
  __attribute__((target("arch=x86-64-v4,avx512bf16,prefer-vector-width=512")))
#endif

namespace csa {

inline bool cpu_has_x86_64_v3() {
#ifdef CSA_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("movbe");
#else
  return false;
#endif
}

inline bool cpu_has_x86_64_v4() {
#ifdef CSA_X86
  return cpu_has_x86_64_v3() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512cd");
#else
  return false;
#endif
}

inline bool cpu_has_avx512bf16() {
#ifdef CSA_X86
  return cpu_has_x86_64_v4() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace csa
