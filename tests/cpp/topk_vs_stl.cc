// Checks torch_topk.h against libstdc++ itself: every replica algorithm against its std::
// counterpart (whole permutation compared, not just the front), and torch_topk_row against
// aten's topk_impl_loop written with std:: calls on (float, index) pairs and torch's float
// comparators. Rows are tie-heavy on purpose, since ties are where a replica could differ.
//
// Usage: topk_vs_stl [seed] [scale]. Prints one line of counts; exit status 1 on a mismatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "torch_topk.h"

using csa::TopKPair;
namespace lib = csa::libstdcxx;

namespace {

std::mt19937_64 rng;

int64_t uniform(int64_t lo, int64_t hi) {  // inclusive
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}
bool coin(double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }

uint32_t f32_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
float bits_f32(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}
float bf16_round(float x) { return bits_f32(f32_bits(x) & 0xFFFF0000u); }  // any bf16 value will do

// c10::BFloat16(float): round to nearest even, NaN -> 0x7FC0.
uint16_t c10_bf16_from_float(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t u = f32_bits(x);
  return static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
}

float half_to_float(uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}

// Value pools: small sets so that rows are full of exact ties.
const float kInf = INFINITY;
const float kNaN = NAN;
float pick_small() {
  static const float pool[] = {-2.0f, -1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f};
  return pool[uniform(0, 8)];
}
float pick_special() {
  static const float pool[] = {kNaN, -kNaN, kInf, -kInf, 0.0f, -0.0f, 1.0f, -1.0f, 2.0f,
                               bits_f32(0x00010000u) /* bf16 subnormal */, bits_f32(0x7FC10000u),
                               bits_f32(0xFFA00000u) /* signalling-pattern NaN */};
  return pool[uniform(0, 11)];
}

enum Kind {
  kNormals, kRepeats, kMostlyNegInf, kAllEqual, kNanInf, kZeros, kRuns, kGeneral, kNumKinds
};

std::vector<float> make_row(Kind kind, int64_t n) {
  std::vector<float> v(n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  switch (kind) {
    case kNormals:
      for (auto& x : v) x = bf16_round(normal(rng));
      break;
    case kRepeats:
      for (auto& x : v) x = pick_small();
      break;
    case kMostlyNegInf: {
      const double p = std::vector<double>{0.5, 0.9, 0.99, 1.0}[uniform(0, 3)];
      for (auto& x : v) x = coin(p) ? -kInf : (coin(0.5) ? pick_small() : bf16_round(normal(rng)));
      break;
    }
    case kAllEqual: {
      const float c = std::vector<float>{-kInf, 0.0f, 1.0f, kNaN, kInf}[uniform(0, 4)];
      for (auto& x : v) x = c;
      break;
    }
    case kNanInf:
      for (auto& x : v) x = coin(0.7) ? pick_special() : pick_small();
      break;
    case kZeros: {
      const float pool[] = {0.0f, -0.0f, bits_f32(0x00010000u), bits_f32(0x80010000u)};
      for (auto& x : v) x = pool[uniform(0, 3)];
      break;
    }
    case kRuns: {  // ascending / descending / organ-pipe with repeats: classic quicksort traps
      const int64_t shape = uniform(0, 2), step = uniform(1, 8);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t t = shape == 0 ? j : shape == 1 ? n - j : std::min(j, n - j);
        v[j] = static_cast<float>(t / step);
      }
      break;
    }
    default:
      for (auto& x : v) x = normal(rng);  // plain f32, no ties
  }
  return v;
}

// McIlroy's "killer adversary for quicksort": answers comparisons lazily so that the
// algorithm under test keeps choosing bad pivots, then fixes the values it implied. Rows
// built this way drive introselect / introsort into their heap fallbacks.
struct Adversary {
  std::vector<int64_t> val;
  int64_t gas, solid = 0, candidate = -1;
  explicit Adversary(int64_t n) : val(n, n), gas(n) {}
  bool before(int64_t x, int64_t y) {
    if (val[x] == gas && val[y] == gas) val[x == candidate ? x : y] = solid++;
    if (val[x] == gas)
      candidate = x;
    else if (val[y] == gas)
      candidate = y;
    return val[x] < val[y];
  }
};

// aten topk_impl_loop, verbatim in substance, with std:: algorithms.
using RefPair = std::pair<float, int64_t>;
template <typename Comp>
void ref_select(std::vector<RefPair>& q, int64_t k, bool sorted, Comp comp) {
  const int64_t n = static_cast<int64_t>(q.size());
  if (k * 64 <= n) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), comp);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), comp);
    if (sorted) std::sort(q.begin(), q.begin() + k - 1, comp);
  }
}
bool ref_largest(const RefPair& x, const RefPair& y) {
  return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
}
bool ref_smallest(const RefPair& x, const RefPair& y) {
  return (!std::isnan(x.first) && std::isnan(y.first)) || (x.first < y.first);
}

// Adversarial f32 row for torch's pipeline with this k / direction / sorted.
std::vector<float> adversarial_row(int64_t n, int64_t k, bool largest, bool sorted) {
  Adversary adv(n);
  std::vector<int64_t> ids(n);
  for (int64_t j = 0; j < n; ++j) ids[j] = j;
  auto before = [&adv](int64_t x, int64_t y) { return adv.before(x, y); };
  if (k * 64 <= n) {
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), before);
  } else {
    std::nth_element(ids.begin(), ids.begin() + k - 1, ids.end(), before);
    if (sorted) std::sort(ids.begin(), ids.begin() + k - 1, before);
  }
  std::vector<float> v(n);  // "before" = smaller val = first in the requested direction
  for (int64_t j = 0; j < n; ++j)
    v[j] = static_cast<float>(largest ? n - adv.val[j] : adv.val[j]);
  return v;
}

struct Counts {
  int64_t rows = 0, row_mismatches = 0, algo_checks = 0, algo_mismatches = 0;
  int64_t partial_sort_rows = 0, nth_element_rows = 0, reported = 0;
} counts;

void report(const char* what, int64_t n, int64_t k, bool largest, bool sorted, int64_t at) {
  if (counts.reported++ < 10)
    std::printf("MISMATCH %s n=%lld k=%lld largest=%d sorted=%d first_diff=%lld\n", what,
                static_cast<long long>(n), static_cast<long long>(k), largest, sorted,
                static_cast<long long>(at));
}

// One torch.topk row in format Fmt: storage holds the stored elements, widened what torch
// ranks them as; ref_out maps (queue value, index) to torch's output element bits.
template <typename Fmt, typename RefOut>
void check_row(const std::vector<typename Fmt::Storage>& storage, const std::vector<float>& widened,
               int64_t k, bool largest, bool sorted, RefOut ref_out) {
  using S = typename Fmt::Storage;
  const int64_t n = static_cast<int64_t>(storage.size());
  std::vector<TopKPair> scratch(n);
  std::vector<S> values(k);
  std::vector<int64_t> indices(k);
  csa::torch_topk_row<Fmt>(storage.data(), n, k, largest, sorted, scratch.data(), values.data(),
                           indices.data());

  std::vector<RefPair> q(n);
  for (int64_t j = 0; j < n; ++j) q[j] = {widened[j], j};
  if (k > 0) {
    if (largest)
      ref_select(q, k, sorted, ref_largest);
    else
      ref_select(q, k, sorted, ref_smallest);
  }
  ++counts.rows;
  (k * 64 <= n ? counts.partial_sort_rows : counts.nth_element_rows) += k > 0;
  for (int64_t j = 0; j < k; ++j) {
    const S want = ref_out(q[j]);
    if (indices[j] != q[j].second || std::memcmp(&values[j], &want, sizeof(S)) != 0) {
      ++counts.row_mismatches;
      report("row", n, k, largest, sorted, j);
      return;
    }
  }
}

int64_t pick_k(int64_t n) {
  switch (uniform(0, 7)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return n;
    case 3: return std::max<int64_t>(n - 1, 0);
    case 4: return std::min(n, n / 64);      // last partial_sort k
    case 5: return std::min(n, n / 64 + 1);  // first nth_element k
    case 6: return uniform(0, std::max<int64_t>(n / 64, 0));
    default: return uniform(0, n);
  }
}

int64_t pick_n() {
  switch (uniform(0, 3)) {
    case 0: return uniform(1, 70);
    case 1: return uniform(1, 400);
    default: return uniform(1, 4096);
  }
}

void check_torch_rows(int64_t count) {
  for (int64_t r = 0; r < count; ++r) {
    const int64_t n = pick_n(), k = pick_k(n);
    const bool largest = coin(0.7), sorted = coin(0.5);
    const int64_t fmt = uniform(0, 3);
    if (fmt == 3) {  // f16: random bits from a small pool of patterns, NaNs included
      static const uint16_t pool[] = {0x0000, 0x8000, 0x3C00, 0xBC00, 0x7C00, 0xFC00, 0x7E00,
                                      0xFE01, 0x0001, 0x8001, 0x4000, 0x3800, 0x7BFF};
      std::vector<uint16_t> h(n);
      std::vector<float> w(n);
      for (int64_t j = 0; j < n; ++j) {
        h[j] = coin(0.8) ? pool[uniform(0, 12)] : static_cast<uint16_t>(uniform(0, 0xFFFF));
        w[j] = half_to_float(h[j]);
      }
      check_row<csa::TopKF16>(h, w, k, largest, sorted,
                              [&h](const RefPair& p) { return h[p.second]; });
      continue;
    }
    const Kind kind = static_cast<Kind>(uniform(0, kNumKinds - 1));
    std::vector<float> v = make_row(kind, n);
    if (fmt == 0 || kind == kGeneral) {
      check_row<csa::TopKF32>(v, v, k, largest, sorted, [](const RefPair& p) { return p.first; });
    } else {
      std::vector<uint16_t> b(n);  // truncate: rows of kRuns are not all bf16 values
      for (int64_t j = 0; j < n; ++j) {
        b[j] = static_cast<uint16_t>(f32_bits(v[j]) >> 16);
        v[j] = bits_f32(static_cast<uint32_t>(b[j]) << 16);
      }
      check_row<csa::TopKBF16>(b, v, k, largest, sorted,
                               [](const RefPair& p) { return c10_bf16_from_float(p.first); });
    }
  }
}

void check_adversarial_rows(int64_t count) {
  for (int64_t r = 0; r < count; ++r) {
    const int64_t n = uniform(0, 3) == 0 ? uniform(17, 200) : uniform(200, 3000);
    const int64_t k =
        uniform(0, 1) ? uniform(n / 64 + 1, n) : uniform(1, std::max<int64_t>(n / 64, 1));
    const bool largest = coin(0.5), sorted = coin(0.7);
    std::vector<float> v = adversarial_row(n, k, largest, sorted);
    check_row<csa::TopKF32>(v, v, k, largest, sorted, [](const RefPair& p) { return p.first; });
  }
}

// Replica algorithm vs std:: on the same TopKPair array: the whole array must match.
bool same(const std::vector<TopKPair>& a, const std::vector<TopKPair>& b, int64_t* at) {
  for (size_t j = 0; j < a.size(); ++j)
    if (a[j].key != b[j].key || a[j].index != b[j].index) {
      *at = static_cast<int64_t>(j);
      return false;
    }
  return true;
}

template <typename Comp>
void check_algorithms_once(const std::vector<TopKPair>& input, Comp comp) {
  const int64_t n = static_cast<int64_t>(input.size());
  const int64_t m = uniform(0, n);
  const int64_t nth = n == 0 ? 0 : uniform(0, n - 1);
  for (int algo = 0; algo < 5; ++algo) {
    std::vector<TopKPair> mine = input, ref = input;
    TopKPair* p = mine.data();
    switch (algo) {
      case 0:
        lib::nth_element(p, p + nth, p + n, comp);
        std::nth_element(ref.begin(), ref.begin() + nth, ref.end(), comp);
        break;
      case 1:
        lib::partial_sort(p, p + m, p + n, comp);
        std::partial_sort(ref.begin(), ref.begin() + m, ref.end(), comp);
        break;
      case 2:
        lib::sort(p, p + n, comp);
        std::sort(ref.begin(), ref.end(), comp);
        break;
      case 3:
        lib::make_heap(p, p + n, comp);
        std::make_heap(ref.begin(), ref.end(), comp);
        break;
      default:  // sort_heap needs a heap: build it with std on both sides
        std::make_heap(mine.begin(), mine.end(), comp);
        std::make_heap(ref.begin(), ref.end(), comp);
        lib::sort_heap(p, p + n, comp);
        std::sort_heap(ref.begin(), ref.end(), comp);
    }
    int64_t at = -1;
    ++counts.algo_checks;
    if (!same(mine, ref, &at)) {
      ++counts.algo_mismatches;
      static const char* names[] = {"nth_element", "partial_sort", "sort", "make_heap",
                                    "sort_heap"};
      report(names[algo], n, algo == 0 ? nth : m, true, true, at);
    }
  }
}

void check_algorithms(int64_t count) {
  for (int64_t r = 0; r < count; ++r) {
    const int64_t n = uniform(0, 3) == 0 ? uniform(0, 40) : uniform(0, 2000);
    std::vector<TopKPair> a(n);
    const int64_t distinct = std::vector<int64_t>{1, 2, 3, 8, 100, 1 << 30}[uniform(0, 5)];
    for (int64_t j = 0; j < n; ++j) a[j] = {static_cast<uint32_t>(uniform(0, distinct - 1)), j};
    if (coin(0.1)) {  // adversarial order for std::sort / nth_element with these comparators
      Adversary adv(n);
      std::vector<int64_t> ids(n);
      for (int64_t j = 0; j < n; ++j) ids[j] = j;
      auto before = [&adv](int64_t x, int64_t y) { return adv.before(x, y); };
      if (coin(0.5))
        std::sort(ids.begin(), ids.end(), before);
      else if (n > 0)
        std::nth_element(ids.begin(), ids.begin() + uniform(0, n - 1), ids.end(), before);
      for (int64_t j = 0; j < n; ++j) a[j].key = static_cast<uint32_t>(adv.val[j]);
    }
    if (coin(0.5))
      check_algorithms_once(a, csa::TopKSmallestFirst{});
    else
      check_algorithms_once(a, csa::TopKLargestFirst{});
  }
}

// A few long rows (both branches), as torch sees them in prefill.
void check_large_rows() {
  for (int64_t n : {65536, 70000, 100000, 262144}) {
    for (int64_t k : {int64_t{1}, int64_t{64}, n / 64, n / 64 + 1, n / 2, n}) {
      const bool largest = coin(0.7), sorted = coin(0.5);
      std::vector<float> v = make_row(static_cast<Kind>(uniform(0, kNumKinds - 1)), n);
      check_row<csa::TopKF32>(v, v, k, largest, sorted, [](const RefPair& p) { return p.first; });
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1234;
  const int64_t scale = argc > 2 ? std::strtoll(argv[2], nullptr, 10) : 1;
  rng.seed(seed);
  check_torch_rows(24000 * scale);
  check_adversarial_rows(600 * scale);
  check_large_rows();
  check_algorithms(8000 * scale);
  std::printf(
      "rows=%lld row_mismatches=%lld partial_sort_rows=%lld nth_element_rows=%lld "
      "algo_checks=%lld algo_mismatches=%lld\n",
      static_cast<long long>(counts.rows), static_cast<long long>(counts.row_mismatches),
      static_cast<long long>(counts.partial_sort_rows),
      static_cast<long long>(counts.nth_element_rows),
      static_cast<long long>(counts.algo_checks), static_cast<long long>(counts.algo_mismatches));
  return counts.row_mismatches + counts.algo_mismatches == 0 ? 0 : 1;
}
