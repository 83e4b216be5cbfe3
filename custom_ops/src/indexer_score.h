// IndexerScore's definition and its tiled kernel. The op replaces the Indexer's standard-op
// score (graphs/indexer.py, before this op):
//   dots     = bf16(MatMul(q [b,s,H,D], k^T [b,1,D,T]))
//   weighted = bf16(Relu(dots) * w [b,s,H,1])
//   score    = bf16(ReduceSum(weighted, axis 2))              [b, s, T]
// bit for bit as onnxruntime 1.32 (x86-64 with FMA) runs those nodes, so every order
// below is onnxruntime's (MLAS's SGEMM and the CPU ReduceSum), found in its sources and
// checked against it with adversarial inputs (tests/test_indexer_score.py):
//   - The MatMul is one SGEMM per (b, s) entry with M = H rows, or, when b == 1 (B's batch
//     dimensions all 1), one with M = s*H rows (onnxruntime folds A's batch into M).
//     D <= 128 is one K panel, so MLAS's kernel sums each dot as ONE fma chain from +0 over
//     d in order (kMaxDim; larger D would split the chain, which is not reproduced here).
//     Two shapes take MLAS's M=1 kernels instead, which multiply and add separately:
//     M == 1: groups of 4 products summed ((p0+p1)+p2)+p3, each group added to the running
//     sum (2 then 1 for the rest); T == 1 (N = 1): 8 lane sums over d (mod 8), reduced by a
//     tree that depends on where the row falls in the GEMM's blocks of 4, 2 and 1 rows.
//   - Cast to bf16: round to nearest even; a NaN becomes the quiet NaN 0x7FC0 with its sign.
//     Relu keeps -0 and NaN (x < 0 ? +0 : x).
//   - ReduceSum over H: b*s >= 2 is MLAS's M=1 kernel on a ones vector (groups of 4 as
//     above, from +0); b*s == 1 sums in order from +0 (H == 1 too adds +0: -0 becomes +0).
// What onnxruntime itself does differently with its thread count (this op never does):
// ReduceSum takes the in-order sum when b*s is below the intra-op thread count (so this op
// is its result for <= 2 threads, or b*s >= threads), and with T == 1 and s*H*D >= 65536
// (b == 1) MLAS splits the GEMM's rows over threads, which moves the block boundaries of
// the T == 1 tree (both seen with 3 threads).
//
// The tiled kernel (M >= 2 and T >= 2, the shapes every prefill and decode step of a real
// context has) keeps heads in vector lanes, so no key is ever transposed (decode has one
// query row per batch entry: nothing to share a transposed tile with). Per call each query
// row is transposed once to qt[D][hp] (H padded by zero heads to hp, a multiple of the
// vector width); per task (batch entry, kTileS query rows, kTileT key rows) the key rows
// are read in place (float keys) or unpacked once into row-major scratch, in blocks of
// kKeys rows; a register tile of kHeadVecs head vectors x kKeys key rows runs the fma chains
// (fma(q, k, acc) is fma(k, q, acc) bit for bit), the epilogue rounds, applies relu and the
// weight lane by lane, and each key's H terms are then added in the ReduceSum order above
// (sum_heads). Padding heads and padding key rows (zeros past the tile) are computed and
// never read. No [s, H, T] intermediate exists. The other shapes (and
// CSA_INDEXER_SCORE_ISA=reference) run the scalar definition below.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "amx_tiles.h"
#include "ort_cast.h"
#include "packed_quant.h"
#include "simd.h"
#include "sparse_attention_tiled.h"

#ifdef CSA_X86
#include <immintrin.h>
#endif

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace csa::indexer_score {

constexpr int64_t kMaxDim = 128;  // MLAS's SGEMM K panel: one fma chain per dot
constexpr int64_t kTileT = 64;    // key rows per task (T = 256, 1K tokens at ratio 4: 4 tasks)
// query rows per task: a task makes its key blocks once for them (16 -> 64: 1024 x 8192 keys
// on 2 threads 89 -> 81 ms on AMX tiles, 277 -> 249 on AVX2's integer dots, the same on
// vpdpbusd and vdpbf16ps, AMX-class Xeon)
constexpr int64_t kTileS = 64;

// How onnxruntime sums the heads (see above).
enum class SumOrder { kGroups4, kInOrder };

struct Problem {
  int64_t b, s, h, d, t;
  // The MatMul's GEMM rows: s*H when b == 1 (folded), else H.
  int64_t gemm_rows() const { return b == 1 ? s * h : h; }
  int64_t gemm_row(int64_t i, int64_t hh) const { return b == 1 ? i * h + hh : hh; }
  SumOrder sum_order() const { return b * s >= 2 ? SumOrder::kGroups4 : SumOrder::kInOrder; }
  // The tiled kernel's shapes: every dot one fma chain.
  bool tiled() const { return gemm_rows() >= 2 && t >= 2; }
};

// ---------------------------------------------------------------- scalar definition
using ort_cast::cast_bf16;  // onnxruntime's Cast float -> bfloat16 -> float

inline float relu(float x) { return x < 0.0f ? 0.0f : x; }

// MLAS's general kernel: one fma chain from +0.
inline float dot_chain(const float* q, const float* k, int64_t d) {
  float acc = 0.0f;
  for (int64_t i = 0; i < d; ++i) acc = __builtin_fmaf(q[i], k[i], acc);
  return acc;
}

// MLAS's M = 1 kernel (B not transposed) for one output: products in groups of 4, 2, 1.
// Also the ReduceSum of b*s >= 2 rows (q = ones: the products are the terms).
inline float sum_groups4(const float* terms, int64_t n) {
  float c = 0.0f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) c = (((terms[i] + terms[i + 1]) + terms[i + 2]) + terms[i + 3]) + c;
  if (n - i >= 2) {
    c = (terms[i] + terms[i + 1]) + c;
    i += 2;
  }
  if (n - i == 1) c = terms[i] + c;
  return c;
}

inline float dot_m1(const float* q, const float* k, int64_t d) {
  float p[kMaxDim];
  for (int64_t i = 0; i < d; ++i) p[i] = q[i] * k[i];
  return sum_groups4(p, d);
}

// MLAS's M = 1 kernel with B transposed (the MatMul's N = T = 1, A and B swapped): 8 lane
// sums over d, the last partial vector adding +0 in its idle lanes, then the tree of the
// row's block (4, 2 or 1 rows), then + 0.
inline float dot_lanes(const float* q, const float* k, int64_t d, int block) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i0 = 0; i0 < d; i0 += 8) {
    for (int64_t l = 0; l < 8; ++l) a[l] = a[l] + (i0 + l < d ? q[i0 + l] * k[i0 + l] : 0.0f);
  }
  float r;
  if (block == 4) {
    r = (((a[0] + a[1]) + a[2]) + a[3]) + (((a[4] + a[5]) + a[6]) + a[7]);
  } else if (block == 2) {
    r = ((a[0] + a[2]) + (a[4] + a[6])) + ((a[1] + a[3]) + (a[5] + a[7]));
  } else {
    r = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
  return r + 0.0f;
}

// The size of the block of GEMM rows (4, 2 or 1) that row r of m falls in.
inline int row_block(int64_t r, int64_t m) {
  const int64_t fours = m / 4 * 4;
  if (r < fours) return 4;
  if ((m & 2) != 0 && r < fours + 2) return 2;
  return 1;
}

inline float dot(const Problem& pr, int64_t i, int64_t hh, const float* q, const float* k) {
  const int64_t m = pr.gemm_rows();
  if (m == 1) return dot_m1(q, k, pr.d);
  if (pr.t == 1) return dot_lanes(q, k, pr.d, row_block(pr.gemm_row(i, hh), m));
  return dot_chain(q, k, pr.d);
}

inline float sum_heads(SumOrder order, const float* x, int64_t h) {
  if (order == SumOrder::kGroups4) return sum_groups4(x, h);
  float c = 0.0f;
  for (int64_t i = 0; i < h; ++i) c = c + x[i];
  return c;
}

constexpr float kMasked = -__builtin_inff();  // the score of a key not scored (Lengths, Candidates)

// Whether any of the n bytes from p is nonzero (a row's candidates in a block of keys),
// eight at a time (a block of keys is 8 or 4 bytes of a row's candidates).
inline bool any_byte(const uint8_t* p, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    if (word != 0) return true;
  }
  for (; i < n; ++i)
    if (p[i] != 0) return true;
  return false;
}

// A query row's Candidates: one byte per block of `block` keys from key 0 (select_candidate_
// blocks' blocks; block 1: a byte a key), or null for all keys. `shift`: log2(block) where
// block is a power of two (a shift per key then, not a division), else -1.
struct CandidateRow {
  const uint8_t* bytes;
  int64_t block;
  int shift;
  int64_t of(int64_t key) const { return shift >= 0 ? key >> shift : key / block; }
};

inline int shift_of(int64_t block) {
  for (int shift = 0; shift < 63; ++shift)
    if ((int64_t{1} << shift) == block) return shift;
  return -1;
}

// The keys a query row scores, from key `first` on (c = 0 is key first): those before
// `reach` (its reachable length, past that key) that its candidates keep. The others score
// kMasked and are never computed or read.
struct RowKeys {
  CandidateRow cand;
  int64_t first;
  int64_t reach;
  bool keeps(int64_t c) const {
    return c < reach && (cand.bytes == nullptr || cand.bytes[cand.of(first + c)] != 0);
  }
  // Whether it keeps any of the keys [c, c + n).
  bool any(int64_t c, int64_t n) const {
    const int64_t m = reach - c < n ? reach - c : n;
    if (m <= 0 || cand.bytes == nullptr) return m > 0;
    const int64_t b0 = cand.of(first + c);
    return any_byte(cand.bytes + b0, cand.of(first + c + m - 1) - b0 + 1);
  }
};

// Query row q's reachable length (Lengths[q], or every key without them) past key t0,
// clamped to [0, t - t0].
inline int64_t reach_from(const int64_t* lengths, int64_t q, int64_t t0, int64_t t) {
  const int64_t n = lengths != nullptr ? lengths[q] : t;
  return n <= t0 ? 0 : (n >= t ? t - t0 : n - t0);
}

// score[t] for query row i (q_row [H][D], w_row [H]) against key rows k [T][D]: the
// definition, for any shape (the reference path and the shapes the tiles do not take).
// keys: the keys the row scores (the others score kMasked, unread).
inline void score_row(const Problem& pr, int64_t i, const float* q_row, const float* w_row,
                      const float* k, RowKeys keys, float* out, float* terms /* [H] */) {
  const SumOrder order = pr.sum_order();
  for (int64_t t = 0; t < pr.t; ++t) {
    if (!keys.keeps(t)) {
      out[t] = kMasked;
      continue;
    }
    for (int64_t hh = 0; hh < pr.h; ++hh) {
      const float dq = cast_bf16(dot(pr, i, hh, q_row + hh * pr.d, k + t * pr.d));
      terms[hh] = cast_bf16(relu(dq) * w_row[hh]);
    }
    out[t] = cast_bf16(sum_heads(order, terms, pr.h));
  }
}

// ---------------------------------------------------------------- the tiles
namespace tv = sparse_attention::tiled;

// Per vector type: relu and the Cast's bf16 rounding, lane by lane as above.
template <typename V>
struct Ops;

#ifdef CSA_X86
template <>
struct Ops<tv::VAvx512> {
  using T = __m512;
  CSA_TARGET_AVX512 static inline T relu(T x) {
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(x, neg, _mm512_setzero_ps());
  }
  CSA_TARGET_AVX512 static inline T cast_bf16(T x) { return ort_cast::cast_bf16(x); }
  CSA_TARGET_AVX512 static inline T cast_bf16_not_nan(T x) {
    return ort_cast::cast_bf16_not_nan(x);
  }
};

template <>
struct Ops<tv::VAvx2> {
  using T = __m256;
  CSA_TARGET_AVX2 static inline T relu(T x) {
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_andnot_ps(neg, x);
  }
  CSA_TARGET_AVX2 static inline T cast_bf16(T x) { return ort_cast::cast_bf16(x); }
  CSA_TARGET_AVX2 static inline T cast_bf16_not_nan(T x) { return ort_cast::cast_bf16_not_nan(x); }
};
#endif

template <>
struct Ops<tv::VScalar> {
  static inline float relu(float x) { return indexer_score::relu(x); }
  static inline float cast_bf16(float x) { return indexer_score::cast_bf16(x); }
};

// Accumulators per instruction set: kHeadVecs head vectors x kKeys key rows; the packed
// rows' unpacking is SparseAttention's tile configuration's.
template <typename V>
struct Cfg;
#ifdef CSA_X86
template <>
struct Cfg<tv::VAvx512> : tv::CfgAvx512 {
  static constexpr int kHeadVecs = 2, kKeys = 8;  // 16 zmm of dots
};
template <>
struct Cfg<tv::VAvx2> : tv::CfgAvx2 {
  static constexpr int kHeadVecs = 2, kKeys = 4;  // 8 ymm of dots
};
#endif
template <>
struct Cfg<tv::VScalar> : tv::CfgScalar {
  static constexpr int kHeadVecs = 4, kKeys = 4;
};

// A task's inputs: a block of query rows of one batch entry against a tile of key rows.
struct Tile {
  const Problem* pr;
  const float* qt;             // [rows][D][hp]: the block's query rows, transposed
  const float* w;              // [rows][hp]: their weights, zeros past H
  int64_t hp;                  // H rounded up to the vector width
  const float* const* blocks;  // per block of kKeys key rows: [kKeys][D]
  int64_t cols;                // key rows in the tile
  float* out;                  // score[block's first query][tile's first key]
  int64_t out_stride;          // between the block's query rows in `out`
  CandidateRow cand;           // the Candidates of the block's first query, or bytes null
  int64_t cand_stride;         // Candidates' bytes a query row
  const int64_t* lengths;      // Lengths[block's first query] (reachable keys), or null
  int64_t t0;                  // the tile's first key

  // The keys of the tile that query row r of the block scores.
  RowKeys row_keys(int64_t r) const {
    CandidateRow row = cand;
    if (row.bytes != nullptr) row.bytes += r * cand_stride;
    return {row, t0, reach_from(lengths, r, t0, pr->t)};
  }
};

// The dots of head vectors [v0, v0 + kHv) x kKeys keys, as the weighted terms into terms
// [kKeys][hp]: bf16(relu(bf16(dot)) * w) lane by lane. kExactDots: the integer tiles' dots,
// exact and finite, so their rounding skips the NaN case.
template <typename V, int kHv, int kKeys, bool kExactDots = false>
__attribute__((always_inline)) inline void store_terms(const Tile& tile, int64_t r, int64_t v0,
                                                       const typename V::T (&acc)[kHv][kKeys],
                                                       float* terms) {
  using T = typename V::T;
  const float* w = tile.w + r * tile.hp + v0 * V::W;
  for (int v = 0; v < kHv; ++v) {
    const T wv = V::load(w + v * V::W);
    for (int j = 0; j < kKeys; ++j) {
      T dot;
      if constexpr (kExactDots)
        dot = Ops<V>::cast_bf16_not_nan(acc[v][j]);
      else
        dot = Ops<V>::cast_bf16(acc[v][j]);
      const T x = Ops<V>::cast_bf16(V::mul(Ops<V>::relu(dot), wv));
      V::store(terms + j * tile.hp + (v0 + v) * V::W, x);
    }
  }
}

// Head vectors [v0, v0 + kHv) of query row r against kKeys key rows keys [kKeys][D]:
// the weighted terms into terms [kKeys][hp].
template <typename V, int kHv, int kKeys>
__attribute__((always_inline)) inline void tile_heads(const Tile& tile, int64_t r, int64_t v0,
                                                      const float* keys, float* terms) {
  using T = typename V::T;
  const int64_t d = tile.pr->d, hp = tile.hp;
  T acc[kHv][kKeys];
  for (int v = 0; v < kHv; ++v)
    for (int j = 0; j < kKeys; ++j) acc[v][j] = V::zero();
  const float* qt = tile.qt + r * d * hp + v0 * V::W;
  for (int64_t i = 0; i < d; ++i, qt += hp) {
    T qv[kHv];
    for (int v = 0; v < kHv; ++v) qv[v] = V::load(qt + v * V::W);
    for (int j = 0; j < kKeys; ++j) {
      const T kb = V::bcast(keys[j * d + i]);
      for (int v = 0; v < kHv; ++v) acc[v][j] = V::fma(qv[v], kb, acc[v][j]);
    }
  }
  store_terms<V, kHv, kKeys>(tile, r, v0, acc, terms);
}

// Query row r against the tile's key blocks, one block at a time (the row's qt stays in
// L1): the row's scores of the tile. terms: scratch [kKeys][hp]. block(c, terms) writes
// the weighted terms of the block of key rows from c (by default tile_heads' fma chains).
template <typename V>
__attribute__((always_inline)) inline void fma_block(const Tile& tile, int64_t r, int64_t c,
                                                     float* terms) {
  constexpr int kHv = Cfg<V>::kHeadVecs, kKeys = Cfg<V>::kKeys;
  const int64_t vecs = tile.hp / V::W;
  const float* keys = tile.blocks[c / kKeys];
  int64_t v0 = 0;
  for (; v0 + kHv <= vecs; v0 += kHv) tile_heads<V, kHv, kKeys>(tile, r, v0, keys, terms);
  for (; v0 < vecs; ++v0) tile_heads<V, 1, kKeys>(tile, r, v0, keys, terms);
}

#ifdef CSA_X86
// out[j] = cast_bf16(sum_heads(order, terms + j * hp, h)) for the n <= 8 keys of a block,
// the 8 keys in the lanes of one ymm: every lane adds the same terms in the same order as
// sum_heads, so the bits are its own (measured against the scalar sums, a key at a time and
// 32 dependent adds each: decode 0.88-0.93x, prefill 0.96x the op's time). terms [8][hp], hp
// a multiple of 8; heads read 8 at a time (an 8 x 8 transpose), those past h never added.
CSA_TARGET_AVX512 inline void sum_heads_8keys(SumOrder order, const float* terms, int64_t hp,
                                              int64_t h, int64_t n, float* out) {
  __m256 c = _mm256_setzero_ps();
  __m256 pending[3];  // kGroups4: the current group's first terms
  int64_t in_group = 0;
  for (int64_t i0 = 0; i0 < h; i0 += 8) {
    __m256 r[8], t[8], u[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(terms + j * hp + i0);
    for (int j = 0; j < 8; j += 2) {
      t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
      t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
      u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
      u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
      u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
      u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
    }
    __m256 head[8];  // head[k], lane j: terms[j][i0 + k]
    for (int k = 0; k < 4; ++k) {
      head[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
      head[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
    }
    const int64_t heads = h - i0 < 8 ? h - i0 : 8;
    if (heads == 8 && in_group == 0) {  // 8 heads, whole groups of 4: no state to carry
      if (order == SumOrder::kInOrder) {
        for (int k = 0; k < 8; ++k) c = _mm256_add_ps(c, head[k]);
      } else {
        for (int k = 0; k < 8; k += 4)
          c = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(head[k], head[k + 1]),
                                                        head[k + 2]), head[k + 3]), c);
      }
      continue;
    }
    for (int64_t k = 0; k < heads; ++k) {
      if (order == SumOrder::kInOrder) {
        c = _mm256_add_ps(c, head[k]);
        continue;
      }
      // sum_groups4: c = (((t0 + t1) + t2) + t3) + c per group of 4
      if (in_group < 3) {
        pending[in_group++] = head[k];
        continue;
      }
      const __m256 g = _mm256_add_ps(_mm256_add_ps(pending[0], pending[1]), pending[2]);
      c = _mm256_add_ps(_mm256_add_ps(g, head[k]), c);
      in_group = 0;
    }
  }
  // sum_groups4's tail: (t0 + t1) + c, then t + c
  if (in_group >= 2) {
    c = _mm256_add_ps(_mm256_add_ps(pending[0], pending[1]), c);
    if (in_group == 3) c = _mm256_add_ps(pending[2], c);
  } else if (in_group == 1) {
    c = _mm256_add_ps(pending[0], c);
  }
  _mm256_mask_storeu_ps(out, static_cast<__mmask8>((1u << n) - 1u), ort_cast::cast_bf16(c));
}
#endif

#ifdef CSA_X86
// sum_heads_8keys for the n <= 4 keys of an AVX2 block, in the lanes of one xmm (a 4 x 4
// transpose per 4 heads). Its order is written out again: a template shared with the 8-key
// form (GCC vector `+`) made the integer tiles' prefill 2-3% slower.
CSA_TARGET_AVX2 inline void sum_heads_4keys(SumOrder order, const float* terms, int64_t hp,
                                            int64_t h, int64_t n, float* out) {
  __m128 c = _mm_setzero_ps();
  __m128 pending[3];  // kGroups4: the current group's first terms
  int64_t in_group = 0;
  for (int64_t i0 = 0; i0 < h; i0 += 4) {
    __m128 head[4];  // head[k], lane j: terms[j][i0 + k]
    for (int j = 0; j < 4; ++j) head[j] = _mm_loadu_ps(terms + j * hp + i0);
    _MM_TRANSPOSE4_PS(head[0], head[1], head[2], head[3]);
    const int64_t heads = h - i0 < 4 ? h - i0 : 4;
    for (int64_t k = 0; k < heads; ++k) {
      if (order == SumOrder::kInOrder) {
        c = _mm_add_ps(c, head[k]);
        continue;
      }
      if (in_group < 3) {
        pending[in_group++] = head[k];
        continue;
      }
      const __m128 g = _mm_add_ps(_mm_add_ps(pending[0], pending[1]), pending[2]);
      c = _mm_add_ps(_mm_add_ps(g, head[k]), c);
      in_group = 0;
    }
  }
  if (in_group >= 2) {
    c = _mm_add_ps(_mm_add_ps(pending[0], pending[1]), c);
    if (in_group == 3) c = _mm_add_ps(pending[2], c);
  } else if (in_group == 1) {
    c = _mm_add_ps(pending[0], c);
  }
  alignas(16) float sums[4];
  _mm_store_ps(sums, c);
  for (int64_t j = 0; j < n; ++j) out[j] = cast_bf16(sums[j]);
}
#endif

template <typename V, typename Block>
__attribute__((always_inline)) inline void tile_row(const Tile& tile, int64_t r, float* terms,
                                                    Block&& block) {
  constexpr int kKeys = Cfg<V>::kKeys;
  const Problem& pr = *tile.pr;
  const SumOrder order = pr.sum_order();
  float* out = tile.out + r * tile.out_stride;
  const RowKeys keys = tile.row_keys(r);
  const bool every = tile.cand.bytes == nullptr && tile.lengths == nullptr;
  for (int64_t c = 0; c < tile.cols; c += kKeys) {
    const int64_t n = tile.cols - c < kKeys ? tile.cols - c : kKeys;
    if (!every && !keys.any(c, n)) {  // none of the block's keys: not computed
      std::fill(out + c, out + c + n, kMasked);
      continue;
    }
    block(c, terms);
#ifdef CSA_X86
    if constexpr (std::is_same_v<V, tv::VAvx512>) {
      static_assert(kKeys == 8, "one ymm of keys");
      sum_heads_8keys(order, terms, tile.hp, pr.h, n, out + c);
    } else if constexpr (std::is_same_v<V, tv::VAvx2>) {
      static_assert(kKeys == 4, "one xmm of keys");
      sum_heads_4keys(order, terms, tile.hp, pr.h, n, out + c);
    } else
#endif
    {
      for (int64_t j = 0; j < n; ++j)
        out[c + j] = cast_bf16(sum_heads(order, terms + j * tile.hp, pr.h));
    }
    if (!every)
      for (int64_t j = 0; j < n; ++j)
        if (!keys.keeps(c + j)) out[c + j] = kMasked;
  }
}

template <typename V>
__attribute__((always_inline)) inline void tile_row(const Tile& tile, int64_t r, float* terms) {
  // always_inline: a lambda is compiled for the default target, and GCC left every vector
  // member below it a call (AVX2 tiles 5x slower; tests/test_kernel_inlining.py)
  tile_row<V>(tile, r, terms, [&](int64_t c, float* t) __attribute__((always_inline)) {
    fma_block<V>(tile, r, c, t);
  });
}

#ifdef CSA_X86
// ---------------------------------------------------------------- vdpbf16ps tiles
// On CPUs with AVX512-BF16 the dots' fma chains run two steps an instruction, as
// SparseAttention's (sparse_attention_tiled.h, namespace pairs): pairs stored swapped make
// vdpbf16ps add the product of term 2e, then of 2e + 1, one rounding each, the chain in
// order, exact where every value is a finite bf16 value and the exponents of the query row
// and of the key block rule out denormals and overflow (pairs::chains_exact; the model's fp4
// values always do). Any other query row or key block runs tile_heads' fma chains.
namespace pairs = sparse_attention::tiled::pairs;

// A packed fp4_e8m0_32 key row (packed_quant.h) straight to its swapped pairs, without the
// floats: value(code) * 2^(byte - 127) is bf16 value(code) with (byte - 127) added to the
// exponent field (codes of nonzero magnitude) while the result stays normal and finite, i.e.
// for scale bytes 2..252 (a nonzero e2m1 magnitude, 0.5..6, lands on biased exponents
// byte - 1 .. byte + 2). The unpacked floats are exactly those values, so the pairs are
// swap_row's of them. Returns false, writing nothing, for a row with any other scale byte.
// lo / hi are lowered / raised to byte - 1 / byte + 2 of each block: a range containing the
// exact one (pairs::Scan's), so chains_exact on it implies chains_exact on the exact one.
struct E2m1Bf16 {
  alignas(64) uint32_t bits[16];  // bf16 bits of kE2m1Values, low half of each dword
  constexpr E2m1Bf16() : bits() {
    constexpr uint32_t magnitude[8] = {0x0000, 0x3F00, 0x3F80, 0x3FC0,
                                       0x4000, 0x4040, 0x4080, 0x40C0};
    for (int c = 0; c < 16; ++c) bits[c] = magnitude[c & 7] | (c >= 8 ? 0x8000u : 0u);
  }
};
inline constexpr E2m1Bf16 kE2m1Bf16{};
constexpr __mmask16 kNonzeroCodes = 0xFEFE;  // codes 0 and 8 are +0 and -0

CSA_TARGET_AVX512BF16 inline bool swap_packed_fp4_e8m0(const uint8_t* p, int64_t d, pairs::u32* out,
                                                      uint32_t& lo, uint32_t& hi) {
  constexpr int64_t kBlock = packed::kFp4E8m0Block;
  static_assert(kBlock == 32, "one block is 16 code bytes, 16 pairs");
  const uint8_t* scales = p + packed::code_bytes(packed::Format::kFp4E8m0, d);
  uint32_t blo = 255, bhi = 0;
  for (int64_t b = 0; b < d / kBlock; ++b) {
    blo = scales[b] < blo ? scales[b] : blo;
    bhi = scales[b] > bhi ? scales[b] : bhi;
  }
  if (blo < 2 || bhi > 252) return false;
  const __m512i table = _mm512_load_si512(kE2m1Bf16.bits);
  for (int64_t b = 0; b < d / kBlock; ++b) {
    const int exponent = static_cast<int>(scales[b]) - 127;  // bf16's exponent field: bit 7
    const __m512i low =
        _mm512_mask_add_epi32(table, kNonzeroCodes, table, _mm512_set1_epi32(exponent * 128));
    const __m512i high = _mm512_maskz_slli_epi32(packed::kAll16, low, 16);
    // byte i holds element 2i (bits 0-3: the pair's high word; vpermd reads index bits 0-3)
    // and element 2i + 1 (bits 4-7: its low word)
    const __m512i bytes = _mm512_maskz_cvtepu8_epi32(
        packed::kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * kBlock / 2)));
    const __m512i odd = _mm512_maskz_srli_epi32(packed::kAll16, bytes, 4);
    const __m512i swapped =
        _mm512_or_si512(_mm512_maskz_permutexvar_epi32(packed::kAll16, bytes, high),
                        _mm512_maskz_permutexvar_epi32(packed::kAll16, odd, low));
    _mm512_storeu_si512(out + b * kBlock / 2, swapped);
  }
  lo = blo - 1 < lo ? blo - 1 : lo;
  hi = bhi + 2 > hi ? bhi + 2 : hi;
  return true;
}

// A query row's pairs, q2 [D/2][hp] swapped, and the range of its values.
struct PairRow {
  const pairs::u32* q2;
  pairs::Range range;
};

// tile_heads on pairs: keys2 [kKeys][D/2] swapped.
template <int kHv, int kKeys>
CSA_TARGET_AVX512BF16 inline void tile_heads_pairs(const Tile& tile, const PairRow& row,
                                                   int64_t r, int64_t v0,
                                                   const pairs::u32* keys2, float* terms) {
  using V = tv::VAvx512;
  const int64_t half = tile.pr->d / 2, hp = tile.hp;
  __m512 acc[kHv][kKeys];
  for (int v = 0; v < kHv; ++v)
    for (int j = 0; j < kKeys; ++j) acc[v][j] = _mm512_setzero_ps();
  const pairs::u32* qp = row.q2 + v0 * V::W;
  for (int64_t p = 0; p < half; ++p, qp += hp) {
    __m512bh qv[kHv];
    for (int v = 0; v < kHv; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qp + v * V::W);
    for (int j = 0; j < kKeys; ++j) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(keys2[j * half + p]));
      for (int v = 0; v < kHv; ++v) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], qv[v], kb);
    }
  }
  store_terms<V, kHv, kKeys>(tile, r, v0, acc, terms);
}

// tile_row with each key block on pairs where the row and the block allow it: keys2
// [blocks][kKeys][D/2], keys_range per block. Counts the blocks of each kind.
CSA_TARGET_AVX512BF16 inline void tile_row_pairs(const Tile& tile, const PairRow& row,
                                                 int64_t r, const pairs::u32* keys2,
                                                 const pairs::Range* keys_range, float* terms,
                                                 uint64_t* on_pairs, uint64_t* on_fma) {
  using V = tv::VAvx512;
  constexpr int kHv = Cfg<V>::kHeadVecs, kKeys = Cfg<V>::kKeys;
  const int64_t vecs = tile.hp / V::W, half = tile.pr->d / 2;
  tile_row<V>(tile, r, terms, [&](int64_t c, float* t) {
    const int64_t blk = c / kKeys;
    if (!pairs::chains_exact(row.range, keys_range[blk], tile.pr->d)) {
      fma_block<V>(tile, r, c, t);
      ++*on_fma;
      return;
    }
    const pairs::u32* k2 = keys2 + blk * kKeys * half;
    int64_t v0 = 0;
    for (; v0 + kHv <= vecs; v0 += kHv) tile_heads_pairs<kHv, kKeys>(tile, row, r, v0, k2, t);
    for (; v0 < vecs; ++v0) tile_heads_pairs<1, kKeys>(tile, row, r, v0, k2, t);
    ++*on_pairs;
  });
}
#endif

#ifdef CSA_X86
// ---------------------------------------------------------------- integer tiles
// On AVX2 the dots of fp4-valued rows run on vpmaddubsw, 32 products an instruction (fma
// takes 8), and on AVX512-VNNI on vpdpbusd, 64 (vdpbf16ps takes 32). Where no partial sum of
// a dot's fma chain rounds, every order gives the chain's bits, the exact dot, and integer
// sums give it too. A query head's block of 32 values that
// are all n * 2^u (n an integer, |n| <= 15, one u per block; the model's fp4 e8m0 values have
// |n| <= 12) and a key's block of fp4_e8m0_32 codes (n = 2 * e2m1, u = scale byte - 128) make
// every product an integer times 2^(uq + uk): a block's 32 add up to at most 32 * 15 * 15 =
// 7200 of its units, four blocks to 4 * 7200 units of the smallest when their exponents lie
// within 9 of each other (28800 * 2^9 < 2^24), so every partial sum of the chain, in any
// order, is a float32 (the units >= 2^-149 and nothing near overflow: int8::exact). The tiles
// sum each block in int16 (keys offset by 15, unsigned for vpmaddubsw, the accumulator
// starting at -15 times the query block's sum) and add the blocks as floats, exactly; with
// VNNI in int32 lanes, four products a lane an instruction (no int16 stage). Any other query
// row or key block runs fma_block's chains on the keys' floats.
namespace int8 {
constexpr int64_t kBlock = 32;   // values per scale (fp4_e8m0_32)
constexpr int kOffset = 15;      // added to the key values: the unsigned operand
constexpr int kMaxN = 15;        // |n| of a query value: 2 * 30 * 15 per pair fits int16
constexpr int kMaxSpan = 9;      // exponents of one dot's blocks within 9: 28800 * 2^9 < 2^24
constexpr int64_t kHeads = 16;   // heads per int16 vector

// The exponents u of the nonzero blocks: per query head (or key row) their spread, over the
// row's heads (the block's keys) its largest, and the smallest and largest u.
struct Range {
  bool fine = true;  // every value n * 2^u as above
  bool any = false;  // a nonzero block
  int lo = 0, hi = 0, span = 0;
  void add(int row_lo, int row_hi) {
    lo = any ? std::min(lo, row_lo) : row_lo;
    hi = any ? std::max(hi, row_hi) : row_hi;
    span = std::max(span, row_hi - row_lo);
    any = true;
  }
};

// Whether every dot of a query row and a key block is exact in float32 (see above).
inline bool exact(const Range& q, const Range& k) {
  if (!q.fine || !k.fine) return false;
  if (!q.any || !k.any) return true;  // every product +-0: every dot +0
  return q.span + k.span <= kMaxSpan && q.lo + k.lo >= -149 && q.hi + k.hi <= 100;
}

// A query row as the tiles read it: q [D/G][hp][G] (the values n in groups of G, 2 for
// vpmaddubsw and 4 for vpdpbusd; zeros past H; kRowMajor: q [hp][D], AMX's A tiles), base [D/32][hp] (-kOffset * the block's sum
// of n), scale [D/32][hp] (2^u, 0 for a zero block), and its range.
struct Row {
  const int8_t* q;
  const int16_t* base;
  const float* scale;
  Range range;
};

constexpr int kRowMajor = 0;  // make_row's kGroup for q [hp][D]

// Query row [H][D] (D a multiple of 32) into row's arrays (q zeroed by the caller), groups of
// kGroup values (or kRowMajor). A block's unit is 2^u with u from its largest magnitude (|v| < 16 * 2^u),
// -126 <= u <= 100; a value is taken only if v * 2^-u is an integer n and n * 2^u gives v back
// (a value too small for the unit rounds to a wrong n, 0 even, in that product).
template <int kGroup>
inline Range make_row(const float* x, int64_t h, int64_t d, int64_t hp, int8_t* q,
                      int16_t* base, float* scale) {
  Range range;
  for (int64_t hh = 0; hh < h; ++hh) {
    int lo = 0, hi = 0;
    bool any = false;
    for (int64_t b = 0; b < d / kBlock; ++b) {
      const float* v = x + hh * d + b * kBlock;
      float amax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) {
        if (!std::isfinite(v[i])) return Range{false};
        amax = std::max(amax, std::fabs(v[i]));
      }
      base[b * hp + hh] = 0;
      scale[b * hp + hh] = 0.0f;
      if (amax == 0.0f) continue;  // +-0 values: n = 0
      const int u = static_cast<int>(float_bits(amax) >> 23) - 130;  // 2^(u + 3) <= amax
      if (u < -126 || u > 100) return Range{false};
      const float unit = bits_float(static_cast<uint32_t>(u + 127) << 23);
      const float inverse = bits_float(static_cast<uint32_t>(127 - u) << 23);
      int sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const float n = v[i] * inverse;
        if (!(std::fabs(n) <= kMaxN)) return Range{false};
        const int k = static_cast<int>(n);
        if (static_cast<float>(k) != n || static_cast<float>(k) * unit != v[i])
          return Range{false};
        const int64_t at = kGroup == kRowMajor
                               ? hh * d + b * kBlock + i
                               : ((b * kBlock + i) / kGroup * hp + hh) * kGroup + i % kGroup;
        q[at] = static_cast<int8_t>(k);
        sum += k;
      }
      base[b * hp + hh] = static_cast<int16_t>(-kOffset * sum);
      scale[b * hp + hh] = unit;
      lo = any ? std::min(lo, u) : u;
      hi = any ? std::max(hi, u) : u;
      any = true;
    }
    if (any) range.add(lo, hi);
  }
  return range;
}

// Key value + kOffset per fp4 code (n = 2 * e2m1, sign bit 8).
alignas(16) constexpr int8_t kOffsetCodes[16] = {15, 16, 17, 18, 19, 21, 23, 27,
                                                 15, 14, 13, 12, 11, 9, 7, 3};
// Key value n per fp4 code, without the offset (AMX's TDPBSSD multiplies signed by signed).
alignas(16) constexpr int8_t kSignedCodes[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                                 0, -1, -2, -3, -4, -6, -8, -12};

// n <= kKeys packed fp4_e8m0_32 rows from p (row_bytes apart) as the tiles read them, the
// values' offset bytes a dword per group for vpbroadcastd: kGroup 2, [kKeys][D/2] dwords (a
// pair's two bytes, twice: vpmaddubsw); kGroup 4, [kKeys][D/4] (four values: vpdpbusd);
// scale [kKeys][D/32] (2^(byte - 128), 0 for a block of +-0 codes); rows past n zero.
// kSigned: the values n themselves (kSignedCodes), not offset. Returns their range; not fine
// where a block of nonzero codes has a scale byte outside 2..228 (values denormal, near
// overflow or inf) or any block the byte 255 (NaN values).
template <int kKeys, int kGroup, bool kSigned = false>
CSA_TARGET_AVX2 inline Range make_keys(const uint8_t* p, int64_t row_bytes, int64_t n, int64_t d,
                                       uint32_t* groups, float* scale) {
  static_assert(kGroup == 2 || kGroup == 4, "pairs or quads");
  const int64_t nb = d / kBlock, per_row = d / kGroup;
  const __m128i table = _mm_load_si128(
      reinterpret_cast<const __m128i*>(kSigned ? kSignedCodes : kOffsetCodes));
  const __m128i nibble = _mm_set1_epi8(0x0F), magnitude = _mm_set1_epi8(0x77);
  Range range;
  for (int64_t k = 0; k < n; ++k) {
    const uint8_t* row = p + k * row_bytes;
    _mm_prefetch(reinterpret_cast<const char*>(row + 16 * row_bytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + 16 * row_bytes + 64), _MM_HINT_T0);
    const uint8_t* bytes = row + d / 2;  // fp4 codes: d/2 bytes, then a scale byte per block
    int lo = 0, hi = 0;
    bool any = false;
    for (int64_t b = 0; b < nb; ++b) {
      const int byte = bytes[b];
      if (byte == 255) return Range{false};  // NaN values, zero codes too
      // byte i: value 2i in bits 0-3, 2i + 1 in bits 4-7
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock / 2));
      const __m128i even = _mm_shuffle_epi8(table, _mm_and_si128(c, nibble));
      const __m128i odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(c, 4), nibble));
      const __m128i w0 = _mm_unpacklo_epi8(even, odd), w1 = _mm_unpackhi_epi8(even, odd);
      __m128i* out = reinterpret_cast<__m128i*>(groups + k * per_row + b * kBlock / kGroup);
      if constexpr (kGroup == 4) {
        _mm_storeu_si128(out, w0);
        _mm_storeu_si128(out + 1, w1);
      } else {
        _mm_storeu_si128(out, _mm_unpacklo_epi16(w0, w0));
        _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(w0, w0));
        _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(w1, w1));
        _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(w1, w1));
      }
      scale[k * nb + b] = 0.0f;
      if (_mm_testz_si128(c, magnitude)) continue;  // +-0 codes: +-0 values, n = 0
      if (byte < 2 || byte > 228) return Range{false};
      scale[k * nb + b] = bits_float(static_cast<uint32_t>(byte - 1) << 23);  // 2^(byte - 128)
      const int u = byte - 128;
      lo = any ? std::min(lo, u) : u;
      hi = any ? std::max(hi, u) : u;
      any = true;
    }
    if (any) range.add(lo, hi);
  }
  std::fill(groups + n * per_row, groups + kKeys * per_row, 0u);
  std::fill(scale + n * nb, scale + kKeys * nb, 0.0f);
  return range;
}

// The dots of head vectors [v0, v0 + kHv) (kHeads heads each) of query row r x kKeys keys
// (pairs [kKeys][D/2], scale [kKeys][D/32]), as tile_heads' weighted terms into terms.
template <int kHv, int kKeys>
CSA_TARGET_AVX2 inline void tile_heads(const Tile& tile, const Row& row, int64_t r, int64_t v0,
                                       const uint32_t* pairs, const float* scale, float* terms) {
  using V = tv::VAvx2;
  const int64_t d = tile.pr->d, half = d / 2, nb = d / kBlock, hp = tile.hp;
  __m256 acc[2 * kHv][kKeys];  // 8 heads each: vectors 2 v and 2 v + 1 are v's halves
  for (int v = 0; v < 2 * kHv; ++v)
    for (int j = 0; j < kKeys; ++j) acc[v][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i sum[kHv][kKeys];
    for (int v = 0; v < kHv; ++v) {
      const __m256i base = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(row.base + b * hp + (v0 + v) * kHeads));
      for (int j = 0; j < kKeys; ++j) sum[v][j] = base;
    }
    const int8_t* qp = row.q + (b * kBlock / 2 * hp + v0 * kHeads) * 2;
    const uint32_t* kp = pairs + b * kBlock / 2;
    // unrolled: GCC copies each loop-carried sum once an iteration, now once per 4 (1.06x)
#pragma GCC unroll 4
    for (int64_t i = 0; i < kBlock / 2; ++i, qp += 2 * hp) {
      __m256i qv[kHv];
      for (int v = 0; v < kHv; ++v)
        qv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + v * 2 * kHeads));
      for (int j = 0; j < kKeys; ++j) {
        const __m256i kb = _mm256_set1_epi32(static_cast<int>(kp[j * half + i]));
        for (int v = 0; v < kHv; ++v)
          sum[v][j] = _mm256_add_epi16(_mm256_maddubs_epi16(kb, qv[v]), sum[v][j]);
      }
    }
    // the block's exact dots, n * 2^uq * 2^uk, added as floats (exact)
    const float* qs = row.scale + b * hp + v0 * kHeads;
    for (int v = 0; v < kHv; ++v) {
      const __m256 qs0 = _mm256_loadu_ps(qs + v * kHeads);
      const __m256 qs1 = _mm256_loadu_ps(qs + v * kHeads + 8);
      for (int j = 0; j < kKeys; ++j) {
        const __m256 ks = _mm256_set1_ps(scale[j * nb + b]);
        const __m128i lo = _mm256_castsi256_si128(sum[v][j]);
        const __m128i hi = _mm256_extracti128_si256(sum[v][j], 1);
        const __m256 n0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(lo));
        const __m256 n1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(hi));
        acc[2 * v][j] = _mm256_add_ps(acc[2 * v][j], _mm256_mul_ps(_mm256_mul_ps(n0, qs0), ks));
        acc[2 * v + 1][j] =
            _mm256_add_ps(acc[2 * v + 1][j], _mm256_mul_ps(_mm256_mul_ps(n1, qs1), ks));
      }
    }
  }
  store_terms<V, 2 * kHv, kKeys, true>(tile, r, 2 * v0, acc, terms);
}

// tile_heads on AVX512-VNNI's vpdpbusd: heads 16 to an int32 vector (v0 counts such vectors),
// four products a lane an instruction into the block's exact int32 sum, the sum then added
// as a float as above (n * (2^uq * 2^uk) by one fma: the product and the sum are exact);
// quads [kKeys][D/4], row.q [D/4][hp][4].
template <int kHv, int kKeys>
CSA_TARGET_AVX512_VNNI inline void tile_heads_vnni(const Tile& tile, const Row& row, int64_t r,
                                                   int64_t v0, const uint32_t* quads,
                                                   const float* scale, float* terms) {
  using V = tv::VAvx512;
  const int64_t d = tile.pr->d, quarter = d / 4, nb = d / kBlock, hp = tile.hp;
  __m512 acc[kHv][kKeys];
  for (int v = 0; v < kHv; ++v)
    for (int j = 0; j < kKeys; ++j) acc[v][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i sum[kHv][kKeys];
    for (int v = 0; v < kHv; ++v) {
      // the masked forms with every lane set: the plain ones pass GCC 12 an "undefined"
      // source that it then warns about (-Wmaybe-uninitialized)
      const int16_t* bp = row.base + b * hp + (v0 + v) * V::W;
      const __m512i base = _mm512_maskz_cvtepi16_epi32(
          packed::kAll16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp)));
      for (int j = 0; j < kKeys; ++j) sum[v][j] = base;
    }
    const int8_t* qp = row.q + (b * kBlock / 4 * hp + v0 * V::W) * 4;
    const uint32_t* kp = quads + b * kBlock / 4;
#pragma GCC unroll 8
    for (int64_t i = 0; i < kBlock / 4; ++i, qp += 4 * hp) {
      __m512i qv[kHv];
      for (int v = 0; v < kHv; ++v) qv[v] = _mm512_loadu_si512(qp + v * 4 * V::W);
      for (int j = 0; j < kKeys; ++j) {
        const __m512i kb = _mm512_set1_epi32(static_cast<int>(kp[j * quarter + i]));
        for (int v = 0; v < kHv; ++v) sum[v][j] = _mm512_dpbusd_epi32(sum[v][j], kb, qv[v]);
      }
    }
    for (int v = 0; v < kHv; ++v) {
      const __m512 qs = _mm512_loadu_ps(row.scale + b * hp + (v0 + v) * V::W);
      for (int j = 0; j < kKeys; ++j) {
        const __m512 unit = _mm512_mul_ps(qs, _mm512_set1_ps(scale[j * nb + b]));
        const __m512 n = _mm512_maskz_cvtepi32_ps(packed::kAll16, sum[v][j]);
        acc[v][j] = _mm512_fmadd_ps(n, unit, acc[v][j]);
      }
    }
  }
  store_terms<V, kHv, kKeys, true>(tile, r, v0, acc, terms);
}

// The same exact dots on AMX-INT8 (Sapphire Rapids and later), keys in the lanes: per block
// of 32 values and 16 heads one TDPBSSD, A = the heads' values (q [hp][D], kRowMajor), B = 16
// keys' values (make_keys' kSigned quads transposed: [D/4][16 keys][4]), C [16 heads][16 keys]
// int32 from zero: the blocks' exact integer sums, the same as vpdpbusd's in any order. Each
// head's row of C then becomes its weighted term for 16 keys at once, the blocks added as
// floats as tile_heads_vnni does, and the heads are added in the ReduceSum order down the
// rows: no transpose, no [keys][heads] terms. Where the blocks allow, merged values take one
// C tile per head group (merge_row, merge_keys), on wide tiles where they can (wide()).
// Measured on a 2-core AMX-class Xeon: a TDPBSSD (8192 products at K = 32) 5.3 ns, about 10
// vpdpbusd (64 products each); a tile store 4.8 ns, an A tile load 2.5 ns; none of them
// overlapped another or the vector code after it.
namespace amx {
constexpr int64_t kKeys = 16;  // keys per group: B's columns, one zmm of scores
constexpr int64_t kHeads = 16;  // heads per A tile

// Configures this thread's tiles for group_dots and group_dots_merged; the caller releases
// them (_tile_release). Tiles 0-3: C of blocks 0-3 [16 heads][16 keys]; 4, 5: A [16 heads][32
// values] of even / odd blocks; 6, 7: B [8][16 keys x 4 values] of even / odd blocks.
CSA_TARGET_AMX_INT8 inline void configure() {
  amx_tiles::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 6 ? kHeads : kBlock / 4;
    cfg.colsb[t] = t == 4 || t == 5 ? kBlock : 64;
  }
  amx_tiles::load(cfg);
}

// quads [kKeys][D/4] to kt [D/4][kKeys] (B's rows): 16 x 16 dword transposes (the last
// one's columns masked where D/4 is not a multiple of 16).
CSA_TARGET_AVX512 inline void transpose_quads(const uint32_t* quads, int64_t quarter,
                                              uint32_t* kt) {
  static_assert(kKeys == 16, "16 keys: one zmm a quad row");
  for (int64_t i0 = 0; i0 < quarter; i0 += 16) {
    const int64_t cols = std::min<int64_t>(16, quarter - i0);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    __m512i r[16], t[16];
    for (int k = 0; k < 16; ++k) r[k] = _mm512_maskz_loadu_epi32(mask, quads + k * quarter + i0);
    // the masked forms with every lane set: the plain ones pass GCC 12 an "undefined" source
    // that it then warns about (-Wmaybe-uninitialized)
    constexpr __mmask16 kAll = packed::kAll16;
    constexpr __mmask8 kAll8 = 0xFF;
    for (int k = 0; k < 16; k += 2) {  // 128-bit lane L: rows k, k + 1 at columns 4L + 0..3
      t[k] = _mm512_maskz_unpacklo_epi32(kAll, r[k], r[k + 1]);
      t[k + 1] = _mm512_maskz_unpackhi_epi32(kAll, r[k], r[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) {  // r[k + j], lane L: rows k..k + 3 at column 4L + j
      r[k] = _mm512_maskz_unpacklo_epi64(kAll8, t[k], t[k + 2]);
      r[k + 1] = _mm512_maskz_unpackhi_epi64(kAll8, t[k], t[k + 2]);
      r[k + 2] = _mm512_maskz_unpacklo_epi64(kAll8, t[k + 1], t[k + 3]);
      r[k + 3] = _mm512_maskz_unpackhi_epi64(kAll8, t[k + 1], t[k + 3]);
    }
    for (int j = 0; j < 4; ++j) {  // column 4L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
      const __m512i lo0 = _mm512_maskz_shuffle_i32x4(kAll, r[j], r[4 + j], 0x44);
      const __m512i hi0 = _mm512_maskz_shuffle_i32x4(kAll, r[j], r[4 + j], 0xEE);
      const __m512i lo1 = _mm512_maskz_shuffle_i32x4(kAll, r[8 + j], r[12 + j], 0x44);
      const __m512i hi1 = _mm512_maskz_shuffle_i32x4(kAll, r[8 + j], r[12 + j], 0xEE);
      t[j] = _mm512_maskz_shuffle_i32x4(kAll, lo0, lo1, 0x88);
      t[4 + j] = _mm512_maskz_shuffle_i32x4(kAll, lo0, lo1, 0xDD);
      t[8 + j] = _mm512_maskz_shuffle_i32x4(kAll, hi0, hi1, 0x88);
      t[12 + j] = _mm512_maskz_shuffle_i32x4(kAll, hi0, hi1, 0xDD);
    }
    for (int m = 0; m < cols; ++m) _mm512_storeu_si512(kt + (i0 + m) * kKeys, t[m]);
  }
}

// A group of kKeys keys for the tiles: make_keys' quads [kKeys][D/4] to kt [D/4][kKeys] (B's
// rows) and its scale [kKeys][D/32] to st [D/32][kKeys] (a block's 16 key scales a vector).
CSA_TARGET_AVX512 inline void transpose_keys(const uint32_t* quads, const float* scale,
                                             int64_t d, uint32_t* kt, float* st) {
  const int64_t nb = d / kBlock;
  transpose_quads(quads, d / 4, kt);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t k = 0; k < kKeys; ++k) st[b * kKeys + k] = scale[k * nb + b];
}

// Merged blocks: where the units of a query head's blocks lie within 2^kMaxShift of the
// head's smallest (2^e), and those of a key's blocks within 2^kMaxShift of the key's smallest,
// each value n of a block with unit 2^(e + a) is taken as the integer n * 2^a (|n| <= 15:
// at most 120, an int8), so one int32 sum over all D values is the dot over 2^(e_q + e_k):
// |sum| <= 128 * 120 * 96 < 2^24, so sum * (2^e_q * 2^e_k) is exact (int8::exact bounds the
// exponents) and equals the blocks' exact sum. One C tile per head group, accumulated over the
// blocks, and one product per term, instead of a tile and an fma per block.
constexpr int kMaxShift = 3;

// The exponent of a unit 2^e (a normal power of two, as make_row's and make_keys' are).
inline int unit_exponent(float unit) { return static_cast<int>(float_bits(unit) >> 23) - 127; }

// The smallest unit of nb blocks' units (0 for a zero block, skipped) and whether every other
// one is within 2^kMaxShift of it; unit 0 where every block is zero.
inline bool merged_unit(const float* units, int64_t stride, int64_t nb, float& unit) {
  int lo = 0, hi = 0;
  bool any = false;
  for (int64_t b = 0; b < nb; ++b) {
    if (units[b * stride] == 0.0f) continue;
    const int e = unit_exponent(units[b * stride]);
    lo = any ? std::min(lo, e) : e;
    hi = any ? std::max(hi, e) : e;
    any = true;
  }
  unit = any ? bits_float(static_cast<uint32_t>(lo + 127) << 23) : 0.0f;
  return hi - lo <= kMaxShift;
}

// A query row's merged values: qm [hp][D] from make_row's q [hp][D] (kRowMajor) and scale
// [D/32][hp], and each head's unit [hp]; false (qm unfinished) where a head's blocks spread
// past kMaxShift.
inline bool merge_row(const int8_t* q, const float* scale, int64_t h, int64_t d, int64_t hp,
                      int8_t* qm, float* unit) {
  const int64_t nb = d / kBlock;
  for (int64_t hh = 0; hh < h; ++hh) {
    if (!merged_unit(scale + hh, hp, nb, unit[hh])) return false;
    for (int64_t b = 0; b < nb; ++b) {
      const float u = scale[b * hp + hh];
      const int shift = u == 0.0f ? 0 : unit_exponent(u) - unit_exponent(unit[hh]);
      for (int64_t i = 0; i < kBlock; ++i) {
        const int64_t at = hh * d + b * kBlock + i;
        qm[at] = static_cast<int8_t>(q[at] * (1 << shift));
      }
    }
  }
  return true;
}

// A group's merged values: from make_keys' signed quads [kKeys][D/4] and scale [kKeys][D/32]
// (every key's range fine), kt [D/4][kKeys] as transpose_keys' with each block's values
// shifted, and each key's unit [kKeys]; false (kt unfinished) where a key's blocks spread
// past kMaxShift.
CSA_TARGET_AVX512 inline bool merge_keys(const uint32_t* quads, const float* scale, int64_t d,
                                         uint32_t* kt, float* unit) {
  const int64_t quarter = d / 4, nb = d / kBlock;
  alignas(64) uint32_t shifted[kKeys * kMaxDim / 4];  // the quads, each block shifted
  for (int64_t k = 0; k < kKeys; ++k) {
    if (!merged_unit(scale + k * nb, 1, nb, unit[k])) return false;
    for (int64_t b = 0; b < nb; ++b) {
      const float u = scale[k * nb + b];
      const int shift = u == 0.0f ? 0 : unit_exponent(u) - unit_exponent(unit[k]);
      const int64_t at = k * quarter + b * kBlock / 4;
      // 32 signed bytes as int16, shifted, back to bytes (|n * 2^shift| <= 96)
      const __m512i words = _mm512_maskz_cvtepi8_epi16(
          0xFFFFFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quads + at)));
      const __m512i moved = _mm512_maskz_sll_epi16(0xFFFFFFFF, words, _mm_cvtsi32_si128(shift));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(shifted + at),
                          _mm512_maskz_cvtepi16_epi8(0xFFFFFFFF, moved));
    }
  }
  transpose_quads(shifted, quarter, kt);
  return true;
}

// One block's dots of one head group: tile C = tile A . tile B (B loaded by the caller),
// stored to c [16][16]. A macro: GCC 12's tile intrinsics paste the tile numbers into the
// instruction text (literals only).
#define CSA_AMX_BLOCK_DOTS(A, B, C, q, q_bytes, c) \
  do {                                             \
    _tile_loadd(A, q, q_bytes);                    \
    _tile_zero(C);                                 \
    _tile_dpbssd(C, A, B);                         \
    _tile_stored(C, c, 64);                        \
  } while (0)

// The tile dots of one query row (q [hp][D] row-major values) against a group of kKeys keys
// (kt: transpose_keys'), into dots [hp/16][D/32][16 heads][16 keys]; the tiles configured.
// A block's B serves every head group; blocks and head groups alternate tiles so that
// consecutive dots do not wait on each other's tiles.
CSA_TARGET_AMX_INT8 inline void group_dots(const Problem& pr, const int8_t* q,
                                           const uint32_t* kt, int32_t* dots) {
  const int64_t d = pr.d, nb = d / kBlock, groups = (pr.h + kHeads - 1) / kHeads;
  const long q_bytes = static_cast<long>(d);
  for (int64_t b = 0; b < nb; ++b) {
    const uint32_t* kb = kt + b * (kBlock / 4) * kKeys;
    if (b % 2 == 0)
      _tile_loadd(6, kb, 64);
    else
      _tile_loadd(7, kb, 64);
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* qb = q + g * kHeads * d + b * kBlock;
      int32_t* db = dots + (g * nb + b) * kHeads * kKeys;
      switch (b % 2 * 2 + g % 2) {  // tile numbers are literals
        case 0: CSA_AMX_BLOCK_DOTS(4, 6, 0, qb, q_bytes, db); break;
        case 1: CSA_AMX_BLOCK_DOTS(5, 6, 1, qb, q_bytes, db); break;
        case 2: CSA_AMX_BLOCK_DOTS(4, 7, 2, qb, q_bytes, db); break;
        default: CSA_AMX_BLOCK_DOTS(5, 7, 3, qb, q_bytes, db); break;
      }
    }
  }
}

// group_dots for merged values (qm [hp][D], kt: merge_keys'): per head group one C tile,
// accumulated over the blocks, into dots [hp/16][16 heads][16 keys] (two C tiles as two chains
// a head group measured the same).
#define CSA_AMX_MERGED_DOT(A, B, C, q, q_bytes, keys) \
  do {                                                \
    _tile_loadd(A, q, q_bytes);                       \
    _tile_loadd(B, keys, 64);                         \
    _tile_dpbssd(C, A, B);                            \
  } while (0)

CSA_TARGET_AMX_INT8 inline void group_dots_merged(const Problem& pr, const int8_t* qm,
                                                  const uint32_t* kt, int32_t* dots) {
  const int64_t d = pr.d, nb = d / kBlock;
  const long q_bytes = static_cast<long>(d);
  for (int64_t h0 = 0; h0 < pr.h; h0 += 2 * kHeads) {  // two head groups: C tiles 0 and 1
    const bool two = h0 + kHeads < pr.h;
    _tile_zero(0);
    if (two) _tile_zero(1);
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* qb = qm + h0 * d + b * kBlock;
      const uint32_t* kb = kt + b * (kBlock / 4) * kKeys;
      if (b % 2 == 0) {
        CSA_AMX_MERGED_DOT(4, 6, 0, qb, q_bytes, kb);
        if (two) CSA_AMX_MERGED_DOT(5, 6, 1, qb + kHeads * d, q_bytes, kb);
      } else {
        CSA_AMX_MERGED_DOT(4, 7, 0, qb, q_bytes, kb);
        if (two) CSA_AMX_MERGED_DOT(5, 7, 1, qb + kHeads * d, q_bytes, kb);
      }
    }
    int32_t* dh = dots + h0 / kHeads * kHeads * kKeys;
    _tile_stored(0, dh, 64);
    if (two) _tile_stored(1, dh + kHeads * kKeys, 64);
  }
}

// Merged values on wide tiles (wide(): H <= 32, D 64 or 128): K = 64 values a TDPBSSD, the
// query row's A tiles loaded once for all its groups (load_wide_row), so a group is a B tile
// per 64 values, a TDPBSSD per head group and 64 values, and a store per head group (the
// tiles are the task's time on this CPU, not their products: measured, group_dots_merged's
// A loads and 32-value TDPBSSD cost more than its products need).
// Tiles 0, 1: C of head groups 0, 1; 2, 3: B of values 0-63, 64-127; 4, 5: A of head group
// 0, values 0-63 / 64-127; 6, 7: the same of head group 1.
inline bool wide(const Problem& pr) { return pr.h <= 2 * kHeads && pr.d % 64 == 0; }

CSA_TARGET_AMX_INT8 inline void configure_wide() {
  amx_tiles::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kHeads;  // C and A: 16 heads; B: 64 values / 4
    cfg.colsb[t] = 64;
  }
  amx_tiles::load(cfg);
}

// The row's A tiles (qm [hp][D] merged values), configured by configure_wide.
CSA_TARGET_AMX_INT8 inline void load_wide_row(const Problem& pr, const int8_t* qm) {
  const long q_bytes = static_cast<long>(pr.d);
  const bool two = pr.h > kHeads, wide_d = pr.d > 64;
  _tile_loadd(4, qm, q_bytes);
  if (wide_d) _tile_loadd(5, qm + 64, q_bytes);
  if (two) _tile_loadd(6, qm + kHeads * pr.d, q_bytes);
  if (two && wide_d) _tile_loadd(7, qm + kHeads * pr.d + 64, q_bytes);
}

// group_dots_merged on wide tiles (the row's A tiles loaded), into dots [hp/16][16][16].
CSA_TARGET_AMX_INT8 inline void group_dots_wide(const Problem& pr, const uint32_t* kt,
                                                int32_t* dots) {
  const bool two = pr.h > kHeads, wide_d = pr.d > 64;
  _tile_zero(0);
  if (two) _tile_zero(1);
  _tile_loadd(2, kt, 64);
  _tile_dpbssd(0, 4, 2);
  if (two) _tile_dpbssd(1, 6, 2);
  if (wide_d) {
    _tile_loadd(3, kt + 16 * kKeys, 64);  // values 64-127: quad rows 16-31
    _tile_dpbssd(0, 5, 3);
    if (two) _tile_dpbssd(1, 7, 3);
  }
  _tile_stored(0, dots, 64);
  if (two) _tile_stored(1, dots + kHeads * kKeys, 64);
}
#undef CSA_AMX_MERGED_DOT

// One head's weighted term for the group's 16 keys: bf16(relu(bf16(dot)) * w), the dot's
// blocks (dh [kNb][16][16] at the head's row) added as floats as tile_heads_vnni does; qs the
// head's units (hp apart). kWFinite: w finite, so the product is never NaN (the dot never is).
template <int kNb, bool kWFinite>
CSA_TARGET_AVX512 __attribute__((always_inline)) inline __m512 head_term(
    const int32_t* dh, const __m512 (&ks)[kNb > 0 ? kNb : 1], const float* qs, int64_t hp,
    float w) {
  __m512 acc = _mm512_setzero_ps();
  if constexpr (kNb == 0) {  // merged values: one sum, one product
    acc = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(packed::kAll16, _mm512_loadu_si512(dh)),
                        _mm512_mul_ps(ks[0], _mm512_set1_ps(qs[0])));
  }
  for (int b = 0; b < kNb; ++b) {
    const __m512 unit = _mm512_mul_ps(ks[b], _mm512_set1_ps(qs[b * hp]));
    const __m512 m = _mm512_maskz_cvtepi32_ps(
        packed::kAll16, _mm512_loadu_si512(dh + b * kHeads * kKeys));
    acc = _mm512_fmadd_ps(m, unit, acc);
  }
  // relu as max(x, +0): an exact dot is never -0 (its terms are +0 or nonzero, and x + -x
  // is +0), so this is relu's x < 0 ? +0 : x
  const __m512 dot = _mm512_maskz_max_ps(packed::kAll16, ort_cast::cast_bf16_not_nan(acc),
                                         _mm512_setzero_ps());
  const __m512 x = _mm512_mul_ps(dot, _mm512_set1_ps(w));
  return kWFinite ? ort_cast::cast_bf16_not_nan(x) : ort_cast::cast_bf16(x);
}

// out[k] for the keys k in `lanes` = the row's scores of the group from group_dots' dots
// (every dot of those keys exact: int8::exact), qs [D/32][hp] the row's units, w [hp] its
// weights, st: transpose_keys'. The
// heads are added as sum_heads does: in order, or (kGroups4) in groups of 4 (groups never
// straddle the 16-head tiles) and the last group's tail.
template <int kNb, bool kWFinite>
CSA_TARGET_AVX512 inline void group_scores(const Problem& pr, int64_t hp, const int32_t* dots,
                                           const float* qs, const float* w, const float* st,
                                           __mmask16 lanes, float* out) {
  constexpr int kSlots = kNb > 0 ? kNb : 1;  // a head group's tiles in dots
  const bool in_order = pr.sum_order() == SumOrder::kInOrder;
  __m512 ks[kNb > 0 ? kNb : 1];
  for (int b = 0; b < (kNb > 0 ? kNb : 1); ++b) ks[b] = _mm512_loadu_ps(st + b * kKeys);
  __m512 c = _mm512_setzero_ps();
  for (int64_t h0 = 0; h0 < pr.h; h0 += kHeads) {
    const int32_t* dg = dots + h0 / kHeads * kSlots * kHeads * kKeys;
    const int64_t heads = std::min(kHeads, pr.h - h0);
    // not a lambda: GCC compiles one for the default target (tile_row's note)
#define CSA_TERM(i) head_term<kNb, kWFinite>(dg + (i) * kKeys, ks, qs + h0 + (i), hp, w[h0 + (i)])
    int64_t i = 0;
    if (in_order) {
      for (; i < heads; ++i) c = _mm512_add_ps(c, CSA_TERM(i));
      continue;
    }
    for (; i + 4 <= heads; i += 4) {
      const __m512 t0 = CSA_TERM(i), t1 = CSA_TERM(i + 1), t2 = CSA_TERM(i + 2), t3 = CSA_TERM(i + 3);
      c = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(t0, t1), t2), t3), c);
    }
    if (heads - i >= 2) {  // sum_groups4's tail: (t0 + t1) + c, then t + c
      const __m512 t0 = CSA_TERM(i), t1 = CSA_TERM(i + 1);
      c = _mm512_add_ps(_mm512_add_ps(t0, t1), c);
      i += 2;
    }
    if (heads - i == 1) c = _mm512_add_ps(CSA_TERM(i), c);
#undef CSA_TERM
  }
  _mm512_mask_storeu_ps(out, lanes, ort_cast::cast_bf16(c));
}

// group_scores for nb blocks (1 to 4) and the row's weights; nb 0: merged values
// (group_dots_merged's dots, st the keys' units, qs the heads' units).
CSA_TARGET_AVX512 inline void group_scores(const Problem& pr, int64_t nb, int64_t hp,
                                           const int32_t* dots, const float* qs, const float* w,
                                           bool w_finite, const float* st, __mmask16 lanes,
                                           float* out) {
  switch (nb * 2 + (w_finite ? 1 : 0)) {
    case 0: return group_scores<0, false>(pr, hp, dots, qs, w, st, lanes, out);
    case 1: return group_scores<0, true>(pr, hp, dots, qs, w, st, lanes, out);
    case 2: return group_scores<1, false>(pr, hp, dots, qs, w, st, lanes, out);
    case 3: return group_scores<1, true>(pr, hp, dots, qs, w, st, lanes, out);
    case 4: return group_scores<2, false>(pr, hp, dots, qs, w, st, lanes, out);
    case 5: return group_scores<2, true>(pr, hp, dots, qs, w, st, lanes, out);
    case 6: return group_scores<3, false>(pr, hp, dots, qs, w, st, lanes, out);
    case 7: return group_scores<3, true>(pr, hp, dots, qs, w, st, lanes, out);
    case 8: return group_scores<4, false>(pr, hp, dots, qs, w, st, lanes, out);
    default: return group_scores<4, true>(pr, hp, dots, qs, w, st, lanes, out);
  }
}
#undef CSA_AMX_BLOCK_DOTS
}  // namespace amx
}  // namespace int8

// tile_row with each key block on integer dots where the row and the block allow it: groups
// [blocks][kKeys][D/G] (make_keys' pairs on AVX2, quads on AVX-512), scale
// [blocks][kKeys][D/32], range per block. Counts the blocks of each kind.
template <typename V>
__attribute__((always_inline)) inline void tile_row_int8(
    const Tile& tile, const int8::Row& row, int64_t r, const uint32_t* groups,
    const float* scale, const int8::Range* range, float* terms, uint64_t* on_int8,
    uint64_t* on_fma) {
  constexpr bool kVnni = std::is_same_v<V, tv::VAvx512>;
  constexpr int kKeys = Cfg<V>::kKeys, kGroup = kVnni ? 4 : 2;
  // AVX2: 2 x 16 heads x 2 keys, 4 int16 sums and 8 float sums; AVX-512: 2 x 16 heads x 4
  // keys, 8 int32 sums and 8 float sums
  constexpr int kHv = 2, kPart = kVnni ? 4 : 2;
  const int64_t vecs = tile.hp / (kVnni ? V::W : int8::kHeads);
  const int64_t per_key = tile.pr->d / kGroup, nb = tile.pr->d / int8::kBlock;
  tile_row<V>(tile, r, terms, [&](int64_t c, float* t) __attribute__((always_inline)) {
    const int64_t blk = c / kKeys;
    if (!int8::exact(row.range, range[blk])) {
      fma_block<V>(tile, r, c, t);
      ++*on_fma;
      return;
    }
    for (int j = 0; j < kKeys; j += kPart) {
      const uint32_t* kg = groups + (c + j) * per_key;
      const float* ks = scale + (c + j) * nb;
      float* tj = t + j * tile.hp;
      int64_t v0 = 0;
      if constexpr (kVnni) {
        for (; v0 + kHv <= vecs; v0 += kHv)
          int8::tile_heads_vnni<kHv, kPart>(tile, row, r, v0, kg, ks, tj);
        for (; v0 < vecs; ++v0) int8::tile_heads_vnni<1, kPart>(tile, row, r, v0, kg, ks, tj);
      } else {
        for (; v0 + kHv <= vecs; v0 += kHv)
          int8::tile_heads<kHv, kPart>(tile, row, r, v0, kg, ks, tj);
        for (; v0 < vecs; ++v0) int8::tile_heads<1, kPart>(tile, row, r, v0, kg, ks, tj);
      }
    }
    ++*on_int8;
  });
}
#endif

// Key blocks by path on the integer tiles (AVX2), over the process (tests read them).
inline tv::PairCounts int8_counts;

// Key blocks by path, over the process (tests read them): on vdpbf16ps, on fma (a query
// row or the block not fit for it). Counted only on the avx512bf16 path.
inline tv::PairCounts pair_counts;

}  // namespace csa::indexer_score

#pragma GCC diagnostic pop
