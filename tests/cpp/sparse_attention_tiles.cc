// SparseAttention's tiled kernel (sparse_attention_tiled.h) against the per-row definition
// (sparse_attention.h `row`) on the float32 quotient acc / denom, before the op's final bf16
// rounding: there every last-bit difference in a logit, a block sum, a probability or a P @ V
// chain shows, where the bf16 outputs would hide all but about one in 2^16.
// Every instruction-set path this CPU has; random and adversarial inputs; h 1, 3, 4, 5, 16,
// 64; d 8, 13, 128, 512; k with -1 entries anywhere, whole blocks of -1, duplicates.
// Prints "cases=N mismatches=M" last; exits 1 on a mismatch.
// Build: g++ -O2 -std=c++17 -ffp-contract=off -I custom_ops/src (the definition's orders
// keep multiplies and adds apart).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "simd.h"
#include "sparse_attention.h"
#include "sparse_attention_tiled.h"

namespace sa = csa::sparse_attention;
namespace tl = csa::sparse_attention::tiled;

namespace {

using Tiles = void (*)(const sa::Problem&, const tl::Shape&, int64_t, const float*,
                       const float*, const int64_t*, const float*, float*, float*);

// The same wrappers as the op: flatten, so the vector members inline under the target.
__attribute__((flatten)) void tiles_scalar(const sa::Problem& pr, const tl::Shape& s,
                                           int64_t h0, const float* q, const float* kv,
                                           const int64_t* idx, const float* sink, float* w,
                                           float* out) {
  tl::task<tl::CfgScalar, int64_t, false>(pr, s, h0, q, kv, idx, sink, w, out);
}
#ifdef CSA_X86
CSA_TARGET_AVX2 __attribute__((flatten)) void tiles_avx2(
    const sa::Problem& pr, const tl::Shape& s, int64_t h0, const float* q, const float* kv,
    const int64_t* idx, const float* sink, float* w, float* out) {
  tl::task<tl::CfgAvx2, int64_t, false>(pr, s, h0, q, kv, idx, sink, w, out);
}
CSA_TARGET_AVX512 __attribute__((flatten)) void tiles_avx512(
    const sa::Problem& pr, const tl::Shape& s, int64_t h0, const float* q, const float* kv,
    const int64_t* idx, const float* sink, float* w, float* out) {
  tl::task<tl::CfgAvx512, int64_t, false>(pr, s, h0, q, kv, idx, sink, w, out);
}
#endif

struct Path {
  const char* name;
  Tiles tiles;
  tl::Shape (*shape)(int64_t, int64_t);
};

float bf16(float x) { return sa::round_bf16(x); }

struct Case {
  int64_t h, d, k, n;
  int kind;  // 0 random, 1 large logits, 2 all logits tied, 3 wide p range, 4 sparse rows
};

// One query row: the definition vs every path, all head groups of 16 and the whole row.
int64_t check(const Case& c, std::mt19937_64& rng, const std::vector<Path>& paths,
              int64_t* compared) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int64_t> row(0, c.n - 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const int64_t h = c.h, d = c.d, k = c.k;
  std::vector<float> q(h * d), kv(c.n * d), sink(h);
  const float qs = c.kind == 1 ? 40.0f : c.kind == 3 ? 6.0f : 2.0f;
  // Kinds 0 and 3 take full float32 inputs (products are then inexact, so fmaf and multiply
  // then add differ), the others bf16 values as the model feeds them.
  const bool full = c.kind == 0 || c.kind == 3;
  for (float& x : q) x = c.kind == 2 ? 0.0f : full ? normal(rng) * qs : bf16(normal(rng) * qs);
  for (float& x : kv) x = full ? normal(rng) : bf16(normal(rng));
  for (float& x : sink) x = normal(rng);
  std::vector<int64_t> idx(k);
  for (int64_t j = 0; j < k; ++j) idx[j] = unit(rng) < (c.kind == 4 ? 0.8f : 0.2f) ? -1 : row(rng);
  if (k > 70) {
    for (int64_t j = 5; j < 30; ++j) idx[j] = idx[3];  // duplicates
    for (int64_t j = 64; j < 128 && j < k; ++j) idx[j] = -1;  // a whole block skipped
  }
  const sa::Problem pr{h, d, k, c.n, 1.0f / std::sqrt(static_cast<float>(d))};
  std::vector<float> want(h * d), work(sa::scratch_floats(pr));
  sa::row<int64_t, false>(pr, q.data(), kv.data(), idx.data(), sink.data(), work.data(),
                          want.data());
  int64_t bad = 0;
  for (const Path& p : paths) {
    for (int64_t group : {h, int64_t{16}}) {
      std::vector<float> got(h * d, -7.0f);
      for (int64_t h0 = 0; h0 < h; h0 += group) {
        const int64_t g = h - h0 < group ? h - h0 : group;
        const tl::Shape s = p.shape(g, d);
        std::vector<float> w(tl::scratch_floats(s));
        p.tiles(pr, s, h0, q.data(), kv.data(), idx.data(), sink.data(), w.data(), got.data());
      }
      *compared += h * d;
      if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
        int64_t n = 0;
        for (size_t i = 0; i < got.size(); ++i)
          n += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
        std::printf("MISMATCH %s group=%lld h=%lld d=%lld k=%lld kind=%d: %lld values\n",
                    p.name, static_cast<long long>(group), static_cast<long long>(h),
                    static_cast<long long>(d), static_cast<long long>(k), c.kind,
                    static_cast<long long>(n));
        ++bad;
      }
    }
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937_64 rng(argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1);
  std::vector<Path> paths{{"scalar", tiles_scalar, tl::shape_of<tl::CfgScalar>}};
#ifdef CSA_X86
  if (csa::cpu_has_x86_64_v3()) paths.push_back({"avx2", tiles_avx2, tl::shape_of<tl::CfgAvx2>});
  if (csa::cpu_has_x86_64_v4())
    paths.push_back({"avx512", tiles_avx512, tl::shape_of<tl::CfgAvx512>});
#endif
  int64_t cases = 0, mismatches = 0, compared = 0;
  for (int64_t h : {1, 3, 4, 5, 16, 64})
    for (int64_t d : {8, 13, 128, 512})
      for (int64_t k : {1, 64, 100, 200})
        for (int kind = 0; kind < 5; ++kind) {
          if (h * d * k > 64 * 512 * 100 && kind > 0) continue;  // keep the run short
          mismatches += check({h, d, k, 300, kind}, rng, paths, &compared);
          ++cases;
        }
  for (const Path& p : paths) std::printf("path %s\n", p.name);
  std::printf("cases=%lld values=%lld mismatches=%lld\n", static_cast<long long>(cases),
              static_cast<long long>(compared), static_cast<long long>(mismatches));
  return mismatches == 0 ? 0 : 1;
}
