// Function-level instruction-set targets and the runtime check that picks one: kernels are
// compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA) and plain x86-64 (TorchLinear
// also for x86-64-v4 + AVX512_BF16), and every path computes the same bits (the summation
// order is fixed; fmaf is exact everywhere). Nothing is built with -march: the library
// loads on any x86-64 and picks a path at run time.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#define CSA_X86 1
#include <sys/syscall.h>
#include <unistd.h>
#define CSA_TARGET_AVX512 __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
#define CSA_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
// x86-64-v4 plus AVX512_BF16 (vdpbf16ps: Zen 4, Cooper Lake, Sapphire Rapids and later).
#define CSA_TARGET_AVX512BF16 \
  __attribute__((target("arch=x86-64-v4,avx512bf16,prefer-vector-width=512")))
// x86-64-v4 plus AVX512-VNNI (vpdpbusd: Ice Lake, Zen 4 and later).
#define CSA_TARGET_AVX512_VNNI \
  __attribute__((target("arch=x86-64-v4,avx512vnni,prefer-vector-width=512")))
// CSA_TARGET_AVX512_VNNI plus AMX-TILE and AMX-INT8 (TDPBUSD: Sapphire Rapids and later).
#define CSA_TARGET_AMX_INT8 \
  __attribute__((target("arch=x86-64-v4,avx512vnni,amx-tile,amx-int8,prefer-vector-width=512")))
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

inline bool cpu_has_avx512vnni() {
#ifdef CSA_X86
  return cpu_has_x86_64_v4() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

#ifdef CSA_X86
// CPUID leaf 7 (subleaf 0): the feature bits GCC 12's __builtin_cpu_supports does not know
// or misreports.
struct Leaf7 {
  unsigned ecx, edx;
  bool edx_bit(int i) const { return (edx >> i) & 1u; }
  bool ecx_bit(int i) const { return (ecx >> i) & 1u; }
};
inline Leaf7 cpuid_leaf7() {
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  return {c, d};
}
#endif

// AVX512-BF16 with AMX-BF16 and AMX-TILE (EDX bits 22 and 24): the Sapphire Rapids class,
// where vdpbf16ps runs at about half its Zen 4 rate (one port, by the rates measured) and
// the exact kernels' fmaf tiles beat it on large problems.
inline bool cpu_has_amx_bf16() {
#ifdef CSA_X86
  const Leaf7 leaf = cpuid_leaf7();
  return leaf.edx_bit(22) && leaf.edx_bit(24) && cpu_has_avx512bf16();
#else
  return false;
#endif
}

// AMX-INT8 with AMX-TILE (EDX bits 25 and 24) and AVX512-VNNI.
inline bool cpu_has_amx_int8() {
#ifdef CSA_X86
  const Leaf7 leaf = cpuid_leaf7();
  return leaf.edx_bit(25) && leaf.edx_bit(24) && cpu_has_avx512vnni();
#else
  return false;
#endif
}

// Whether Linux grants this process the AMX tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; asking again is harmless): needed before any tile
// instruction, on a CPU that has AMX-TILE.
inline bool amx_tiles_granted() {
#ifdef CSA_X86
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// AVX512-FP16 and GFNI (EDX bit 23, ECX bit 8; __builtin_cpu_supports reports AVX512-FP16
// absent): Sapphire Rapids and later Intel cores; not Zen 4 or Zen 5.
inline bool cpu_has_avx512fp16_gfni() {
#ifdef CSA_X86
  const Leaf7 leaf = cpuid_leaf7();
  return leaf.edx_bit(23) && leaf.ecx_bit(8) && cpu_has_x86_64_v4();
#else
  return false;
#endif
}

}  // namespace csa
