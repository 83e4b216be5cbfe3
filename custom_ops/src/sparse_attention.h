// The reference's sparse_attn (tools/torch_reference.py `sparse_attn`) for one query row
// (b, t): an online softmax over the row's index list in blocks of 64 (the last block
// padded with -1), in torch 2.13 CPU's float32 arithmetic order:
//   logits = einsum("bshd,bsnd->bshn", q, rows) * scale: a batched MKL sgemm [h, d] x
//     [d, 64]. h >= 4: d cut into chunks (torch_linear::mkl_chunk: one chunk up to 192,
//     two halves up to 384, else 192), a sequential fmaf chain from 0 per chunk, chunk sums
//     added in order. h <= 3: 4 lanes, separate multiply and add, term k to lane
//     (k - head) % 4 after `head` terms in lane 0 (h == 1: head = (d-1)%4 + 1; else 0),
//     result (l0 + l2) + (l1 + l3). The scale is a separate multiply.
//   p.sum(-1): torch_sum::sum over the 64 entries.
//   einsum("bshn,bsnd->bshd", bf16(p), rows): [h, 64] x [64, d], a sequential chain over
//     the 64 entries from 0 (h >= 4: fmaf; h <= 3: multiply then add; for h <= 3 MKL
//     treats the last d % 4 columns otherwise, there the result is only close).
//   These orders were read off torch.einsum on this machine class (AMD EPYC, AVX-512).
//   exp: std::exp (glibc expf). torch.exp on CPU goes through MKL VML, which differs from
//     expf in the last bit for ~1% of arguments; not reproduced.
// A block whose indices are all -1 changes nothing (alpha = 1, p = 0) and is skipped.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "torch_linear.h"
#include "torch_rms_norm.h"

namespace csa::sparse_attention {

constexpr int64_t kBlock = 64;
constexpr float kRunningMaxInit = -1e30f;

inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    u |= 0x00400000u;  // NaN stays NaN (quiet)
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
  }
  u &= 0xffff0000u;
  float y;
  std::memcpy(&y, &u, sizeof y);
  return y;
}

struct Problem {
  int64_t h, d, k, n;
  float scale;
};

// Scratch for one row, in floats.
inline int64_t scratch_floats(const Problem& pr) {
  return pr.d * kBlock + 2 * pr.h * kBlock + pr.h * pr.d + pr.d + 2 * pr.h;
}

// q: [h, d] of this row; kv: [n, d] of this batch; idx: [k]; out: [h, d].
// Indices must already be checked to lie in [-1, n). kRoundOut = false leaves out the final
// bf16 rounding (tests compare kernels on the float32 quotient, where every last bit shows).
template <typename I, bool kRoundOut = true>
__attribute__((always_inline)) inline void row(const Problem& pr, const float* q,
                                               const float* kv, const I* idx,
                                               const float* sink, float* scratch, float* out) {
  const int64_t h = pr.h, d = pr.d, k = pr.k;
  float* panel = scratch;                 // [d][64]: the block's rows, transposed
  float* logit = panel + d * kBlock;      // [h][64]
  float* pb = logit + h * kBlock;         // [h][64]: bf16(p)
  float* acc = pb + h * kBlock;           // [h][d]
  float* blk = acc + h * d;               // [d]
  float* m = blk + d;                     // [h]
  float* total = m + h;                   // [h]
  for (int64_t i = 0; i < h; ++i) {
    m[i] = kRunningMaxInit;
    total[i] = 0.0f;
  }
  for (int64_t i = 0; i < h * d; ++i) acc[i] = 0.0f;
  const bool blocked = h >= 4;
  const int64_t chunk = torch_linear::mkl_chunk(d);
  const int64_t head = h == 1 && d > 0 ? (d - 1) % 4 + 1 : 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t j0 = 0; j0 < k; j0 += kBlock) {
    const int64_t len = k - j0 < kBlock ? k - j0 : kBlock;
    const float* rows[kBlock];
    bool any = false;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t ix = j < len ? static_cast<int64_t>(idx[j0 + j]) : -1;
      rows[j] = ix >= 0 ? kv + ix * d : nullptr;
      any = any || ix >= 0;
    }
    if (!any) continue;
    for (int64_t j = 0; j < kBlock; ++j) {
      if (rows[j]) {
        for (int64_t e = 0; e < d; ++e) panel[e * kBlock + j] = rows[j][e];
      } else {
        for (int64_t e = 0; e < d; ++e) panel[e * kBlock + j] = 0.0f;
      }
    }
    // logits
    for (int64_t i = 0; i < h; ++i) {
      const float* qi = q + i * d;
      float* li = logit + i * kBlock;
      if (blocked) {
        float sum[kBlock], part[kBlock];
        for (int64_t j = 0; j < kBlock; ++j) sum[j] = 0.0f;
        for (int64_t e0 = 0; e0 < d; e0 += chunk) {
          const int64_t e1 = e0 + chunk < d ? e0 + chunk : d;
          for (int64_t j = 0; j < kBlock; ++j) part[j] = 0.0f;
          for (int64_t e = e0; e < e1; ++e) {
            const float qv = qi[e];
            const float* pe = panel + e * kBlock;
#pragma GCC ivdep
            for (int64_t j = 0; j < kBlock; ++j) part[j] = __builtin_fmaf(qv, pe[j], part[j]);
          }
          for (int64_t j = 0; j < kBlock; ++j) sum[j] = sum[j] + part[j];
        }
        for (int64_t j = 0; j < kBlock; ++j) li[j] = sum[j];
      } else {
        float lane[4][kBlock];
        for (int l = 0; l < 4; ++l)
          for (int64_t j = 0; j < kBlock; ++j) lane[l][j] = 0.0f;
        for (int64_t e = 0; e < d; ++e) {
          const int l = e < head ? 0 : static_cast<int>((e - head) % 4);
          const float qv = qi[e];
          const float* pe = panel + e * kBlock;
#pragma GCC ivdep
          for (int64_t j = 0; j < kBlock; ++j) {
            const float p = qv * pe[j];
            lane[l][j] = lane[l][j] + p;
          }
        }
        for (int64_t j = 0; j < kBlock; ++j)
          li[j] = (lane[0][j] + lane[2][j]) + (lane[1][j] + lane[3][j]);
      }
      for (int64_t j = 0; j < kBlock; ++j) li[j] = rows[j] ? li[j] * pr.scale : neg_inf;
    }
    // online softmax and P @ V
    for (int64_t i = 0; i < h; ++i) {
      float* li = logit + i * kBlock;
      float bmax = neg_inf;
      for (int64_t j = 0; j < kBlock; ++j) bmax = li[j] > bmax ? li[j] : bmax;
      const float m_new = bmax > m[i] ? bmax : m[i];
      float* pi = pb + i * kBlock;
      for (int64_t j = 0; j < kBlock; ++j) li[j] = std::exp(li[j] - m_new);  // p, in place
      const float alpha = std::exp(m[i] - m_new);
      total[i] = total[i] * alpha + torch_sum::sum(li, kBlock);
      for (int64_t j = 0; j < kBlock; ++j) pi[j] = round_bf16(li[j]);
      for (int64_t e = 0; e < d; ++e) blk[e] = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) {
        if (!rows[j]) continue;  // p = 0 exactly: adds nothing
        const float pv = pi[j];
        const float* r = rows[j];
        if (blocked) {
#pragma GCC ivdep
          for (int64_t e = 0; e < d; ++e) blk[e] = __builtin_fmaf(pv, r[e], blk[e]);
        } else {
#pragma GCC ivdep
          for (int64_t e = 0; e < d; ++e) {
            const float t = pv * r[e];
            blk[e] = blk[e] + t;
          }
        }
      }
      float* ai = acc + i * d;
#pragma GCC ivdep
      for (int64_t e = 0; e < d; ++e) {
        const float scaled = ai[e] * alpha;
        ai[e] = scaled + blk[e];
      }
      m[i] = m_new;
    }
  }
  for (int64_t i = 0; i < h; ++i) {
    const float denom = total[i] + std::exp(sink[i] - m[i]);
    for (int64_t e = 0; e < d; ++e) {
      const float o = acc[i * d + e] / denom;
      out[i * d + e] = kRoundOut ? round_bf16(o) : o;
    }
  }
}

}  // namespace csa::sparse_attention
