// torch 2.13 CPU's float32 sum over a contiguous last axis (aten SumKernel: the vectorised
// inner sum with 8-lane vectors, 4 interleaved accumulators, a 4-level cascade), and the
// reference's RMSNorm built on it. ONNX ReduceMean sums in another order; the variance then
// differs in the last bit for ~40% of rows, enough to flip a bf16 rounding now and then.
// This is the order's definition; TorchRMSNorm's portable body (custom_ops/portable.py)
// spells the same order in standard ops, and tests/test_torch_rms_norm.py checks the two
// give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

namespace csa {
namespace torch_sum {

constexpr int kLanes = 8;
constexpr int kIlp = 4;
constexpr int kLevels = 4;

struct Vec {
  float v[kLanes] = {};
  void add(const float* x) {
    for (int l = 0; l < kLanes; ++l) v[l] += x[l];
  }
  void add(const Vec& o) { add(o.v); }
};

inline int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) ++bits;
  return bits;
}

// multi_row_sum over `size` groups of kIlp consecutive 8-lane vectors of x.
inline void multi_row_sum(const float* x, int64_t size, Vec out[kIlp]) {
  const int level_power = size > 0 ? (ceil_log2(size) / kLevels > 4 ? ceil_log2(size) / kLevels : 4)
                                   : 4;
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  Vec acc[kLevels][kIlp];
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) acc[0][k].add(x + (i * kIlp + k) * kLanes);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k].add(acc[j - 1][k]);
        acc[j - 1][k] = Vec();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < kIlp; ++k) acc[0][k].add(x + (i * kIlp + k) * kLanes);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) acc[0][k].add(acc[j][k]);
  for (int k = 0; k < kIlp; ++k) out[k] = acc[0][k];
}

inline float sum(const float* x, int64_t n) {
  const int64_t vectors = n / kLanes;
  const int64_t groups = vectors / kIlp;
  Vec part[kIlp];
  multi_row_sum(x, groups, part);
  for (int64_t i = groups * kIlp; i < vectors; ++i) part[0].add(x + i * kLanes);
  for (int k = 1; k < kIlp; ++k) part[0].add(part[k]);
  float s = 0.0f;
  for (int64_t i = vectors * kLanes; i < n; ++i) s += x[i];  // the scalar tail comes first
  for (int l = 0; l < kLanes; ++l) s += part[0].v[l];
  return s;
}

}  // namespace torch_sum

// One row of the reference's RMSNorm before its cast to bf16:
// w * (x * rsqrt(mean(x^2) + eps)); `squares` is scratch for n floats.
template <typename LoadW>
inline void rms_norm_row(const float* x, int64_t n, LoadW w, float eps, float* squares,
                         float* y) {
  for (int64_t i = 0; i < n; ++i) squares[i] = x[i] * x[i];
  const float mean = torch_sum::sum(squares, n) / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(mean + eps);  // torch.rsqrt: 1 / sqrt, both rounded
  for (int64_t i = 0; i < n; ++i) y[i] = w(i) * (x[i] * r);
}

}  // namespace csa
