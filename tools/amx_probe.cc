// Does AMX's TDPBF16PS sum bf16 pairs in the order csa2onnx's exact TorchLinear defines
// (torch_linear.h, kOneDnnPairs: per pair (k, k+1), from the running f32 sum, add the
// product of k+1, then that of k, one rounding each)? If it does, with some operand order,
// TorchLinear's exact numerics can run on AMX tiles (issue 10's AMX prefill); if no order
// matches, exact on AMX stays on vdpbf16ps. Built and run by tools/amx_probe.py.
//
// The SDM's pseudocode says TDPBF16PS adds the even product (2k) first, then the odd one,
// per k in order, and VDPBF16PS the odd one first: so AMX with each pair swapped in both
// operands would give vdpbf16ps's bits, IF the hardware rounds as its pseudocode reads.
// This program measures that instead of assuming it. Models compared per output:
//   odd_first  (the definition): acc = acc + a1*b1; acc = acc + a0*b0   (each rounded)
//   even_first:                  acc = acc + a0*b0; acc = acc + a1*b1
//   pair_once:                   acc = round(acc + (a0*b0 + a1*b1) exact)
//   block_once:                  acc = round(acc + the 32 products of one TDPBF16PS, exact)
// and, where none matches, the largest distance from odd_first in units in the last place.
// on sums of 512 terms (one kOneDnnPairs chunk) from 0, for vdpbf16ps (the check that the
// models are written right: it must be odd_first everywhere), AMX with the operands as
// stored, and AMX with every pair swapped. Data: normal values, wide exponents, and values
// with 2 significant bits (frequent rounding ties); all products and sums stay normal
// (both instructions flush denormals). Then one thread's throughput of each instruction
// on an L1-resident problem.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kK = 512;      // one kOneDnnPairs chunk
constexpr int kTile = 16;    // AMX: 16 rows x 16 fp32 columns of C
constexpr int kTileK = 32;   // bf16 values of K per TDPBF16PS

float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t f32_to_bf16_trunc(float f) {  // inputs are made bf16-exact: truncation is exact
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>(u >> 16);
}

bool has_amx() {
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  return ((d >> 22) & 1u) && ((d >> 24) & 1u);  // AMX-BF16, AMX-TILE
}

bool request_amx() {  // Linux: a process must ask for the tile data state
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// One test case: A [16][K] and B [K][16] (columns n), bf16.
struct Case {
  std::vector<uint16_t> a, b;  // a[m * K + k], b[k * 16 + n]
};

// kind 0: normal values; 1: exponents over +-16 (products within 2^+-40: their sums are
// exact in __float128); 2: 2 significant bits over +-12 (ties)
Case make_case(std::mt19937_64& rng, int kind) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> wide(-16, 16), narrow(-12, 12), bit(0, 1);
  auto value = [&]() {
    float v;
    if (kind == 0) v = normal(rng);
    else if (kind == 1) v = normal(rng) * std::ldexp(1.0f, wide(rng));
    else v = (bit(rng) ? 1.5f : 1.0f) * std::ldexp(1.0f, narrow(rng)) * (bit(rng) ? -1.0f : 1.0f);
    return f32_to_bf16_trunc(v);
  };
  Case c;
  c.a.resize(kTile * kK);
  c.b.resize(kK * kTile);
  for (auto& v : c.a) v = value();
  for (auto& v : c.b) v = value();
  return c;
}

constexpr int kModels = 4;

// The models for output (m, n).
void models(const Case& c, int m, int n, float out[kModels]) {
  float odd = 0.0f, even = 0.0f, once = 0.0f, block = 0.0f;
  __float128 block_exact = 0;
  for (int k = 0; k < kK; k += 2) {
    const float p0 = bf16_to_f32(c.a[m * kK + k]) * bf16_to_f32(c.b[k * kTile + n]);  // exact
    const float p1 = bf16_to_f32(c.a[m * kK + k + 1]) * bf16_to_f32(c.b[(k + 1) * kTile + n]);
    odd = odd + p1;
    odd = odd + p0;
    even = even + p0;
    even = even + p1;
    const __float128 exact = static_cast<__float128>(once) + p0 + p1;  // exact: 113 bits
    once = static_cast<float>(exact);                                    // one rounding
    block_exact += static_cast<__float128>(p0) + p1;
    if ((k + 2) % kTileK == 0) {  // one TDPBF16PS's 32 terms summed exactly, one rounding
      block = static_cast<float>(static_cast<__float128>(block) + block_exact);
      block_exact = 0;
    }
  }
  out[0] = odd;
  out[1] = even;
  out[2] = once;
  out[3] = block;
}

// |a - b| in units in the last place of b (floats of one sign: the distance of their bits).
long ulps(float a, float b) {
  int32_t x, y;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  if ((x < 0) != (y < 0)) return a == b ? 0 : 1L << 31;
  return std::labs(static_cast<long>(x) - static_cast<long>(y));
}

// vdpbf16ps: lanes over the 16 columns, each pair of a row broadcast.
__attribute__((target("avx512f,avx512bf16"))) void vdpbf16ps_sums(const Case& c, float* out) {
  std::vector<uint32_t> bp(kK / 2 * kTile);  // B as column pairs (b[k][n] | b[k+1][n] << 16)
  for (int p = 0; p < kK / 2; ++p)
    for (int n = 0; n < kTile; ++n)
      bp[p * kTile + n] = c.b[2 * p * kTile + n] | static_cast<uint32_t>(c.b[(2 * p + 1) * kTile + n]) << 16;
  for (int m = 0; m < kTile; ++m) {
    __m512 acc = _mm512_setzero_ps();
    for (int p = 0; p < kK / 2; ++p) {
      uint32_t pair;
      std::memcpy(&pair, &c.a[m * kK + 2 * p], sizeof pair);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)),
                             (__m512bh)_mm512_loadu_si512(&bp[p * kTile]));
    }
    _mm512_storeu_ps(out + m * kTile, acc);
  }
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 .. count-1, each 16 rows of 64 bytes (C: 16 x 16 f32; A: 16 x 32 bf16; B: 16 pairs
// x 16 columns).
__attribute__((target("amx-tile,amx-bf16"))) void configure_tiles(int count) {
  TileConfig cfg;
  for (int t = 0; t < count; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  // Not _tile_loadconfig: GCC 12's macro names only 8 bytes of the config as read, so -O2
  // dropped the stores to the rest and ldtilecfg faulted on a half-written config.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// C = A @ B over K by TDPBF16PS, pairs as stored or swapped (in both operands).
__attribute__((target("amx-tile,amx-bf16"))) void amx_sums(const Case& c, bool swap, float* out) {
  std::vector<uint16_t> a(c.a), bp(kK * kTile);  // bp: B in AMX's pair layout [K/2][16][2]
  for (int p = 0; p < kK / 2; ++p)
    for (int n = 0; n < kTile; ++n) {
      const uint16_t lo = c.b[2 * p * kTile + n], hi = c.b[(2 * p + 1) * kTile + n];
      bp[(p * kTile + n) * 2] = swap ? hi : lo;
      bp[(p * kTile + n) * 2 + 1] = swap ? lo : hi;
    }
  if (swap)
    for (int i = 0; i < kTile * kK; i += 2) std::swap(a[i], a[i + 1]);
  _tile_zero(0);
  for (int k = 0; k < kK; k += kTileK) {
    _tile_loadd(1, a.data() + k, kK * 2);
    _tile_loadd(2, bp.data() + k * kTile, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, out, 64);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

int same(float x, float y) { return std::memcmp(&x, &y, sizeof x) == 0; }

void report(const char* name, const std::vector<long>& hits, long total, long max_ulps) {
  std::printf("%-28s odd_first %ld/%ld  even_first %ld/%ld  pair_once %ld/%ld  block_once %ld/%ld"
              "  (max %ld ulp from odd_first)\n", name, hits[0], total, hits[1], total, hits[2],
              total, hits[3], total, max_ulps);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Throughput: vdpbf16ps on 6 x 4 zmm accumulators (TorchLinear's tile), and TDPBF16PS on
// 2 x 2 C tiles, both over L1-resident operands.
__attribute__((target("avx512f,avx512bf16"))) double vdpbf16ps_gflops() {
  alignas(64) uint32_t w[64 * 64];
  for (int i = 0; i < 64 * 64; ++i) w[i] = 0x3F803F80u;
  __m512 acc[6][4];
  for (auto& r : acc)
    for (auto& v : r) v = _mm512_setzero_ps();
  const long reps = 2000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < reps; ++i) {
    const uint32_t* p = w + (i & 63) * 64;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512bh b = (__m512bh)_mm512_load_si512(p + 16 * c);
#pragma GCC unroll 6
      for (int m = 0; m < 6; ++m)
        acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)_mm512_set1_epi32(static_cast<int>(p[m])), b);
    }
  }
  const double s = seconds_since(t0);
  __m512 total = _mm512_setzero_ps();  // keep the sums alive
  for (auto& r : acc)
    for (auto& v : r) total = _mm512_add_ps(total, v);
  alignas(64) float sink[16];
  _mm512_store_ps(sink, total);
  if (sink[0] == 1.0f) std::printf(" ");
  return reps * 24.0 * 32.0 * 2.0 / s / 1e9;  // 32 multiply-adds per vdpbf16ps
}

// One tile instruction's throughput on 2 x 2 C tiles over L1-resident operands, one thread,
// in giga multiply-adds per second: TDPBF16PS (kInt8 false; 32 bf16 of K a tile) or TDPBSSD
// (AMX-INT8: int8 products summed exactly into int32, `k_bytes` of K a tile: 64, the full
// tile, or 32, one fp8 K block an instruction as exact block sums would need; the lever
// for exact fp8 on AMX, where integer sums make the order irrelevant).
template <bool kInt8>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) double tile_gmacs(int k_bytes) {
  TileConfig cfg;  // 0-3: C, 4-5: A (16 rows of k_bytes), 6-7: B (k_bytes / 4 rows of 64)
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t >= 6 ? k_bytes / 4 : kTile);
    cfg.colsb[t] = static_cast<uint16_t>(t >= 4 && t < 6 ? k_bytes : 64);
  }
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
  alignas(64) static uint16_t a[2][kTile * kTileK], b[2][kTile * kTileK];
  for (int i = 0; i < kTile * kTileK; ++i) a[0][i] = a[1][i] = b[0][i] = b[1][i] = 0x3F80;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const long reps = 2000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < reps; ++i) {
    _tile_loadd(4, a[0], 64);
    _tile_loadd(5, a[1], 64);
    _tile_loadd(6, b[0], 64);
    _tile_loadd(7, b[1], 64);
    if constexpr (kInt8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const double s = seconds_since(t0);
  alignas(64) uint32_t sink[kTile * kTile];
  _tile_stored(0, sink, 64);
  _tile_release();
  if (sink[0] == 1) std::printf(" ");
  return reps * 4.0 * kTile * kTile * (kInt8 ? k_bytes : k_bytes / 2) / s / 1e9;
}

bool has_amx_int8() {
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  return ((d >> 25) & 1u) && ((d >> 24) & 1u);  // AMX-INT8, AMX-TILE
}

}  // namespace

// argv: [cases per kind (default 200)] [--no-amx: compare vdpbf16ps only]
int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 200;
  const bool skip_amx = argc > 2 && std::strcmp(argv[2], "--no-amx") == 0;
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("no AVX512-BF16 on this CPU: nothing to compare\n");
    return 0;
  }
  const bool amx = !skip_amx && has_amx() && request_amx();
  std::printf("AMX-BF16: %s\n", amx ? "yes" : skip_amx ? "not tried (--no-amx)"
                                   : has_amx() ? "present, but the OS refused the tile state" : "no");
  if (amx) configure_tiles(3);  // 0: C, 1: A, 2: B
  std::mt19937_64 rng(1);
  const char* kinds[3] = {"normal", "wide exponents", "2-bit values (ties)"};
  bool defined = true;
  for (int kind = 0; kind < 3; ++kind) {
    std::vector<long> v(kModels), plain(kModels), swapped(kModels);
    long total = 0, far_v = 0, far_plain = 0, far_swapped = 0;
    std::vector<float> vd(kTile * kTile), am(kTile * kTile), sw(kTile * kTile);
    for (int i = 0; i < cases; ++i) {
      const Case c = make_case(rng, kind);
      vdpbf16ps_sums(c, vd.data());
      if (amx) {
        amx_sums(c, false, am.data());
        amx_sums(c, true, sw.data());
      }
      for (int m = 0; m < kTile; ++m)
        for (int n = 0; n < kTile; ++n) {
          float ref[kModels];
          models(c, m, n, ref);
          const int o = m * kTile + n;
          for (int j = 0; j < kModels; ++j) {
            v[j] += same(vd[o], ref[j]);
            plain[j] += amx && same(am[o], ref[j]);
            swapped[j] += amx && same(sw[o], ref[j]);
          }
          far_v = std::max(far_v, ulps(vd[o], ref[0]));
          if (amx) {
            far_plain = std::max(far_plain, ulps(am[o], ref[0]));
            far_swapped = std::max(far_swapped, ulps(sw[o], ref[0]));
          }
          ++total;
        }
    }
    std::printf("%s, %ld sums of %d terms:\n", kinds[kind], total, kK);
    report("  vdpbf16ps", v, total, far_v);
    if (amx) {
      report("  tdpbf16ps, pairs as stored", plain, total, far_plain);
      report("  tdpbf16ps, pairs swapped", swapped, total, far_swapped);
    }
    defined = defined && v[0] == total;
  }
  if (amx) release_tiles();
  std::printf("vdpbf16ps is the definition (odd_first) on every sum: %s\n", defined ? "yes" : "NO");
  std::printf("one thread, L1-resident: vdpbf16ps %.0f GFLOP/s", vdpbf16ps_gflops());
  if (amx) std::printf(", tdpbf16ps %.0f GFLOP/s", 2 * tile_gmacs<false>(64));
  std::printf("\n");
  if (amx && has_amx_int8())
    std::printf("one thread, L1-resident: tdpbssd %.0f G int8 multiply-adds/s with K 64 a "
                "tile, %.0f with K 32\n", tile_gmacs<true>(64), tile_gmacs<true>(32));
  return defined ? 0 : 1;
}
