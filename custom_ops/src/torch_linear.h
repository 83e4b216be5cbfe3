// The summation order of torch 2.13 CPU's F.linear(x, W) (y = x @ W^T, float32
// accumulation) on an x86-64 CPU with AVX512-BF16 and no AMX (read on an AMD EPYC; MKL
// picks other kernels on Intel), the machine class the goldens come from: the goldens'
// bf16 Linear outputs are reproduced bit for bit. Every output is one float32 sum of K products; which two partial sums meet at
// each addition decides the last bit, and a last-bit difference can cross a bf16 rounding
// boundary and cascade through the attention layer. The orders below were read off torch
// with summation-tree probes (two huge values of opposite sign among ones: the result
// counts the terms added outside their common subtree) and checked bit for bit on random
// data:
//
// bfloat16 W (bf16 x): torch hands M*K*N > 4096 to oneDNN (brg_matmul avx512_core_bf16,
//   vdpbf16ps) and smaller problems to its own vectorised dot product.
//   kOneDnnPairs: K is cut into chunks (K <= 512: one chunk; M == 1: 512; else 512 while
//     K <= 1024, then 1024). Within a chunk, from 0.0f, each pair (k, k+1) adds the product
//     of k+1 first, then that of k, one rounding each (fmaf); at each chunk end the
//     chunk's sum is added to the output (out = out + chunk).
//   kTorchDot (M*K*N <= 4096): at::native dot_with_fp32_arith with 8-lane vectors: the
//     first floor(K/64)*64 terms go to 8 registers x 8 lanes (term j+8r+l -> register r,
//     lane l, fmaf), registers fold r += r+4, r+2, r+1 and lanes l += l+4, l+2, l+1; the
//     next terms up to a multiple of 16 go to 8 lanes (two terms per lane per step), folded
//     the same way and added; the last K%16 terms are added one by one (fmaf).
// float32 W (f32 x, the compressor): torch calls MKL sgemm.
//   kMklBlocked (M >= 4 and N >= 12): K is cut into chunks (K <= 192: one; K <= 384: two
//     of floor(K/2) (and a last single term when K is odd); else 192); within a chunk a
//     sequential fmaf chain from 0.0f; out = out + chunk at each chunk end.
//   kMklLanes (M <= 3 or N < 12): 4 lanes, separate multiply and add (two roundings);
//     the first `head` terms go to lane 0 in order (M == 1: head = (K-1)%4 + 1, else 0),
//     then term head+4i+l to lane l; result (lane0 + lane2) + (lane1 + lane3).
//     Exact for columns n < 4*floor(N/4); MKL treats the last N%4 columns (and N < 4)
//     differently, there the result is only close.
//
// Both kinds are exact for float inputs: products of bf16 values are exact in float32,
// and everything else is fmaf or a single float addition or multiplication. Not modelled:
// vdpbf16ps flushes denormal inputs and results to zero (values below 2^-126). The op's
// own vdpbf16ps path (torch_linear_op.cc) follows this definition, not torch, there: it
// runs only on calls where no denormal can arise, the others go to the fmaf tiles.
// This file is the definition: plain scalar C++, compiled with -ffp-contract=off (a fused
// multiply-add where the order says multiply, then add, would change the result).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace csa::torch_linear {

enum class Order { kOneDnnPairs, kTorchDot, kMklBlocked, kMklLanes };

struct Plan {
  Order order;
  int64_t chunk;  // kOneDnnPairs, kMklBlocked: terms per chunk (>= 1)
  int64_t head;   // kMklLanes: terms summed into lane 0 before the 4-lane loop
};

inline int64_t mkl_chunk(int64_t K) {
  if (K <= 192) return K > 0 ? K : 1;
  if (K <= 384) return K / 2;
  return 192;
}

inline int64_t onednn_chunk(int64_t M, int64_t K) {
  if (K <= 512) return K > 0 ? K : 1;
  if (M == 1 || K <= 1024) return 512;
  return 1024;
}

inline Plan plan_linear(bool w_bf16, int64_t M, int64_t N, int64_t K) {
  if (w_bf16) {
    if (M * K * N > 4096) return {Order::kOneDnnPairs, onednn_chunk(M, K), 0};
    return {Order::kTorchDot, 0, 0};
  }
  if (M >= 4 && N >= 12) return {Order::kMklBlocked, mkl_chunk(K), 0};
  return {Order::kMklLanes, 0, M == 1 && K > 0 ? (K - 1) % 4 + 1 : 0};
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float weight_value(float w) { return w; }
inline float weight_value(uint16_t w) { return bf16_to_float(w); }

// One output, x[0..K) . w[0..K), in the plan's order (the reference every kernel must
// reproduce bit for bit; the op also runs it for kTorchDot, whose problems are tiny).
template <typename W>
float reference_dot(const Plan& plan, const float* x, const W* w, int64_t K) {
  auto term = [&](int64_t k, float acc) { return std::fma(x[k], weight_value(w[k]), acc); };
  switch (plan.order) {
    case Order::kOneDnnPairs:
    case Order::kMklBlocked: {
      float out = 0.0f;
      for (int64_t k0 = 0; k0 < K; k0 += plan.chunk) {
        const int64_t k1 = k0 + plan.chunk < K ? k0 + plan.chunk : K;
        float acc = 0.0f;
        if (plan.order == Order::kMklBlocked) {
          for (int64_t k = k0; k < k1; ++k) acc = term(k, acc);
        } else {
          int64_t k = k0;
          for (; k + 1 < k1; k += 2) acc = term(k, term(k + 1, acc));
          if (k < k1) acc = term(k, acc);
        }
        out = out + acc;
      }
      return out;
    }
    case Order::kMklLanes: {
      float lane[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const int64_t head = plan.head < K ? plan.head : K;
      for (int64_t k = 0; k < head; ++k) {
        const float p = x[k] * weight_value(w[k]);
        lane[0] = lane[0] + p;
      }
      for (int64_t k = head; k < K; ++k) {
        const float p = x[k] * weight_value(w[k]);
        lane[(k - head) % 4] = lane[(k - head) % 4] + p;
      }
      return (lane[0] + lane[2]) + (lane[1] + lane[3]);
    }
    case Order::kTorchDot: {
      const int64_t main_end = K & ~int64_t{63};
      const int64_t vec_end = K & ~int64_t{15};
      float reg[8][8] = {};
      for (int64_t j = 0; j < main_end; j += 64)
        for (int r = 0; r < 8; ++r)
          for (int l = 0; l < 8; ++l) reg[r][l] = term(j + 8 * r + l, reg[r][l]);
      for (int offset = 4; offset >= 1; offset /= 2)
        for (int r = 0; r < offset; ++r)
          for (int l = 0; l < 8; ++l) reg[r][l] = reg[r][l] + reg[r + offset][l];
      auto fold_lanes = [](float* v) {
        for (int offset = 4; offset >= 1; offset /= 2)
          for (int l = 0; l < offset; ++l) v[l] = v[l] + v[l + offset];
        return v[0];
      };
      float total = fold_lanes(reg[0]);
      float tail[8] = {};
      for (int64_t j = main_end; j < vec_end; j += 16) {
        for (int l = 0; l < 8; ++l) tail[l] = term(j + l, tail[l]);
        for (int l = 0; l < 8; ++l) tail[l] = term(j + 8 + l, tail[l]);
      }
      total = total + fold_lanes(tail);
      for (int64_t k = vec_end; k < K; ++k) total = term(k, total);
      return total;
    }
  }
  return 0.0f;
}

}  // namespace csa::torch_linear
