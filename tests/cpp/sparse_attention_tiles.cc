// SparseAttention's tiled kernel (sparse_attention_tiled.h) against the per-row definition
// (sparse_attention.h `row`) on the float32 quotient acc / denom, before the op's final bf16
// rounding: there every last-bit difference in a logit, a block sum, a probability or a P @ V
// chain shows, where the bf16 outputs would hide all but about one in 2^16.
// Every instruction-set path this CPU has (avx512bf16: vdpbf16ps where exact, and its
// fallbacks, counted); random and adversarial inputs (tiny, denormal, overflowing); h 1, 3,
// 4, 5, 16, 64; d 8, 13, 128, 512; k with -1 entries anywhere, whole blocks of -1, duplicates. Then a
// packed compressed cache (tiled::Source, every packed format, d 32 .. 512, window rows from
// 0 to 200): the tiles gathering and unpacking packed rows against the definition on the
// concatenated float rows (window, then the packed rows unpacked).
// Prints "cases=N mismatches=M" last; exits 1 on a mismatch.
// Build: g++ -O2 -std=c++17 -ffp-contract=off -I custom_ops/src (the definition's orders
// keep multiplies and adds apart).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "packed_quant.h"
#include "simd.h"
#include "sparse_attention.h"
#include "sparse_attention_tiled.h"

namespace sa = csa::sparse_attention;
namespace tl = csa::sparse_attention::tiled;
namespace pk = csa::packed;

namespace {

using Tiles = void (*)(const sa::Problem&, const tl::Shape&, int64_t, const float*,
                       const tl::Source&, const int64_t*, const float*, float*, float*);

// The same wrappers as the op: flatten, so the vector members inline under the target.
__attribute__((flatten)) void tiles_scalar(const sa::Problem& pr, const tl::Shape& s,
                                           int64_t h0, const float* q, const tl::Source& kv,
                                           const int64_t* idx, const float* sink, float* w,
                                           float* out) {
  tl::task<tl::CfgScalar, int64_t, false>(pr, s, h0, q, kv, idx, sink, w, out);
}
#ifdef CSA_X86
CSA_TARGET_AVX2 __attribute__((flatten)) void tiles_avx2(
    const sa::Problem& pr, const tl::Shape& s, int64_t h0, const float* q, const tl::Source& kv,
    const int64_t* idx, const float* sink, float* w, float* out) {
  tl::task<tl::CfgAvx2, int64_t, false>(pr, s, h0, q, kv, idx, sink, w, out);
}
CSA_TARGET_AVX512 __attribute__((flatten)) void tiles_avx512(
    const sa::Problem& pr, const tl::Shape& s, int64_t h0, const float* q, const tl::Source& kv,
    const int64_t* idx, const float* sink, float* w, float* out) {
  tl::task<tl::CfgAvx512, int64_t, false>(pr, s, h0, q, kv, idx, sink, w, out);
}
CSA_TARGET_AVX512BF16 __attribute__((flatten)) void tiles_avx512bf16(
    const sa::Problem& pr, const tl::Shape& s, int64_t h0, const float* q, const tl::Source& kv,
    const int64_t* idx, const float* sink, float* w, float* out) {
  tl::task<tl::CfgAvx512Bf16, int64_t, false>(pr, s, h0, q, kv, idx, sink, w, out);
}
#endif

struct Path {
  const char* name;
  Tiles tiles;
  tl::Shape (*shape)(int64_t, int64_t, bool);
};

float bf16(float x) { return sa::round_bf16(x); }

struct Case {
  int64_t h, d, k, n;
  int kind;  // 0 random, 1 large logits, 2 all logits tied, 3 wide p range, 4 sparse rows,
             // 5 tiny bf16 values here and there (2^-60: the vdpbf16ps tiles' fallbacks),
             // 6 denormal bf16 values in a few rows, 7 huge bf16 values (logits overflow)
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
  if (c.kind == 5) {  // a few tiny values: some tasks' q and some blocks' rows too small
    for (float& x : q) x = unit(rng) < 0.002f ? bf16(x * 0x1p-60f) : x;
    for (float& x : kv) x = unit(rng) < 0.0005f ? bf16(x * 0x1p-60f) : x;
  }
  if (c.kind == 6)  // denormal values (flushed by vdpbf16ps: those blocks must fall back)
    for (int64_t r = 0; r < c.n; r += 37) kv[r * d] = bf16(0x1p-130f);
  if (c.kind == 7) {  // huge values: sums that overflow (those chains must fall back too)
    for (float& x : q) x = bf16(x * 0x1p60f);
    for (int64_t r = 0; r < c.n; r += 5)
      for (int64_t e = 0; e < d; ++e) kv[r * d + e] = bf16(kv[r * d + e] * 0x1p66f);
  }
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
        const tl::Shape s = p.shape(g, d, false);
        std::vector<float> w(tl::scratch_floats(s));
        p.tiles(pr, s, h0, q.data(), tl::Source{kv.data(), c.n}, idx.data(), sink.data(),
                w.data(), got.data());
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

// One query row over a window of n_window float rows and n_cache packed rows: the tiles
// (gathering and unpacking on the fly) against the definition on the concatenated rows.
int64_t check_packed(pk::Format f, int64_t h, int64_t d, int64_t k, int64_t n_window,
                     int64_t n_cache, std::mt19937_64& rng, const std::vector<Path>& paths,
                     int64_t* compared) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const int64_t n = n_window + n_cache, rb = pk::row_bytes(f, d);
  std::vector<float> q(h * d), window(n_window * d), source(n_cache * d), rows(n * d), sink(h);
  for (float& x : q) x = bf16(normal(rng) * 2.0f);
  for (float& x : window) x = bf16(normal(rng));
  for (float& x : source) x = bf16(normal(rng) * (unit(rng) < 0.1f ? 1e-3f : 1.0f));
  for (float& x : sink) x = normal(rng);
  std::vector<uint8_t> packed(static_cast<size_t>(n_cache * rb));
  std::copy(window.begin(), window.end(), rows.begin());
  for (int64_t r = 0; r < n_cache; ++r) {
    pk::pack_row<pk::PackScalar>(f, source.data() + r * d, d, packed.data() + r * rb);
    pk::unpack_row_scalar(f, packed.data() + r * rb, d, rows.data() + (n_window + r) * d);
  }
  std::uniform_int_distribution<int64_t> any(0, n - 1);
  std::vector<int64_t> idx(k);
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = unit(rng) < 0.15f ? -1 : any(rng);
    if (j < n_window && j < k / 4) idx[j] = j;  // window rows first, as the layer lists them
  }
  const sa::Problem pr{h, d, k, n, 1.0f / std::sqrt(static_cast<float>(d))};
  std::vector<float> want(h * d), work(sa::scratch_floats(pr));
  sa::row<int64_t, false>(pr, q.data(), rows.data(), idx.data(), sink.data(), work.data(),
                          want.data());
  tl::Source src{window.data(), n_window, packed.data(), rb, f};
  // The op's once-per-call variant: the packed entries unpacked to [k, d] beforehand.
  std::vector<float> listed(k * d, NAN);
  tl::unpack_entries<tl::CfgScalar>(src, d, idx.data(), 0, k, listed.data());
  const sa::Problem tiled_pr{h, d, k, n_window, pr.scale};
  int64_t bad = 0;
  for (const Path& p : paths) {
    for (int64_t group : {h, int64_t{16}, -int64_t{16}}) {  // negative: pre-unpacked rows
      std::vector<float> got(h * d, -7.0f);
      src.unpacked = group < 0 ? listed.data() : nullptr;
      const int64_t step = group < 0 ? -group : group;
      for (int64_t h0 = 0; h0 < h; h0 += step) {
        const int64_t g = h - h0 < step ? h - h0 : step;
        const tl::Shape s = p.shape(g, d, group > 0);
        std::vector<float> w(tl::scratch_floats(s));
        p.tiles(tiled_pr, s, h0, q.data(), src, idx.data(), sink.data(), w.data(), got.data());
      }
      *compared += h * d;
      if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
        std::printf("MISMATCH packed %s %s group=%lld h=%lld d=%lld k=%lld window=%lld\n",
                    pk::format_name(f), p.name, static_cast<long long>(group),
                    static_cast<long long>(h), static_cast<long long>(d),
                    static_cast<long long>(k), static_cast<long long>(n_window));
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
  if (csa::cpu_has_avx512bf16())
    paths.push_back({"avx512bf16", tiles_avx512bf16, tl::shape_of<tl::CfgAvx512Bf16>});
#endif
  int64_t cases = 0, mismatches = 0, compared = 0;
  for (int64_t h : {1, 3, 4, 5, 16, 64})
    for (int64_t d : {8, 13, 128, 512})
      for (int64_t k : {1, 64, 100, 200})
        for (int kind = 0; kind < 8; ++kind) {
          if (h * d * k > 64 * 512 * 100 && kind > 0) continue;  // keep the run short
          mismatches += check({h, d, k, 300, kind}, rng, paths, &compared);
          ++cases;
        }
  for (pk::Format f : {pk::Format::kFp4E4m3, pk::Format::kFp4E8m0, pk::Format::kFp8E8m0})
    for (int64_t h : {1, 4, 16, 64})
      for (int64_t d : {32, 96, 512})
        for (int64_t n_window : {0, 7, 128}) {
          if (h * d > 16 * 512) continue;  // keep the run short
          mismatches += check_packed(f, h, d, 200, n_window, 150, rng, paths, &compared);
          ++cases;
        }
  for (const Path& p : paths) std::printf("path %s\n", p.name);
  const tl::PairCounts& pc = tl::pair_counts;
  std::printf("pairs=%llu pv_fmaf=%llu fmaf=%llu\n",
              static_cast<unsigned long long>(pc.pairs.load()),
              static_cast<unsigned long long>(pc.pv_fmaf.load()),
              static_cast<unsigned long long>(pc.fmaf.load()));
  std::printf("cases=%lld values=%lld mismatches=%lld\n", static_cast<long long>(cases),
              static_cast<long long>(compared), static_cast<long long>(mismatches));
  return mismatches == 0 ? 0 : 1;
}
