// IndexerScore (domain csa2onnx): the Indexer's score of every compressed position for every
// query, bf16(sum_h bf16(relu(bf16(q[b,s,h] . k[b,t])) * w[b,s,h])), bit for bit as
// onnxruntime runs the standard ops it replaces (indexer_score.h states the orders), with no
// [s, H, T] intermediate.
// Inputs Q (float [b, s, H, D], D <= 128), W (float [b, s, H]), Keys (float [b, R, D], or
// uint8 [b, R, row_bytes]: the packed index-key cache read in place, in the format named by
// the attribute keys_format, e.g. "fp4_e8m0_32"), Width (int64, one element: T, 0 <= T <= R,
// the key rows scored), optional Lengths (int64 [s]: query q's keys from Lengths[q] on score
// -inf and are not computed: a prefill's unreachable compressed positions), optional
// Candidates (bool [b, s, ceil(T / candidate_block_size)], given only with Lengths: key t is
// scored only where value t / candidate_block_size is true, else -inf and not computed: a
// later index source's level two, whose candidate blocks are a few thousand of up to a million
// keys; the attribute defaults to 1, a value a key); output Score (float [b, s, T], bf16
// values).
// In parallel over (batch entry, block of 64 queries, tile of 64 key rows), heads in vector
// lanes: each query row is transposed once per call, each task unpacks its key tile once
// (row-major) for its queries (on the avx512bf16 path, packed fp4_e8m0_32 keys go straight
// from their codes to the pairs vdpbf16ps reads: indexer_score.h swap_packed_fp4_e8m0).
// CSA_INDEXER_SCORE_ISA (or CSA2ONNX_ISA; read when a session creates the kernel) forces a
// path: "avx512bf16" (the tiles with vdpbf16ps where exact: indexer_score.h), "avx512" (with
// packed fp4_e8m0_32 keys on a CPU with AVX512-VNNI, integer dots on vpdpbusd where exact:
// indexer_score.h int8; the default there), "amx" (this op's own name: the same dots on
// AMX-INT8 tiles, indexer_score.h int8::amx), "avx2" (the same on vpmaddubsw), "scalar" (the
// tiles without SIMD) or "reference" (the scalar definition, one query row per task); all
// give the same bits. Unforced: the avx512 path's integer dots where the CPU has
// AVX512-VNNI and the keys are packed fp4_e8m0_32 (2.3x vdpbf16ps's speed on an AMX-class
// Xeon), on AMX-INT8 tiles where the CPU has them for calls of kAmxMinQueries rows or more
// without Candidates (1.7x vpdpbusd's speed there), else avx512bf16, avx512, avx2 as the CPU
// allows.
// Compiled with -ffp-contract=off: the orders keep multiplies and adds apart.
#include "ort_api.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "block_max.h"
#include "indexer_score.h"
#include "indexer_score_op.h"
#include "kernel_support.h"
#include "packed_quant.h"
#include "simd.h"
#include "torch_topk.h"

namespace csa {
namespace {

namespace is = indexer_score;
constexpr const char* kOp = "IndexerScore";

struct Job;
struct TaskTile;
// The body of a tiled call's task: its tile of query rows against key rows, the scores to
// TaskTile::out.
using TileFn = void (*)(const Job&, const TaskTile&, std::vector<float>&);

struct Job {
  is::Problem pr{};
  TileFn tile_fn = nullptr;  // the tiled path, or null: row_task (the definition)
  int64_t r = 0;  // Keys' rows per batch entry
  const float* q = nullptr;
  const float* w = nullptr;
  const float* keys = nullptr;      // float keys, or null
  const uint8_t* packed = nullptr;  // packed keys, or null
  packed::Format format = packed::Format::kFp4E8m0;
  int64_t row_bytes = 0;
  // Candidates [b * s][ceil(T / cand.block)] (0 / 1 bytes; cand.bytes the first row's), or
  // cand.bytes null: all keys
  is::CandidateRow cand{nullptr, 1, 0};
  int64_t cand_stride = 0;
  const int64_t* lengths = nullptr;  // Lengths [s], or null: every key reachable
  float* out = nullptr;
  int64_t s_blocks = 0, t_blocks = 0;
  // The tiles' query rows and weights, transposed once per call (see indexer_score::Tile).
  const float* qt = nullptr;
  const float* wt = nullptr;
  int64_t hp = 0;
#ifdef CSA_X86
  // The avx512bf16 path: the query rows as swapped pairs [rows][D/2][hp], and the range of
  // each row's values (pairs::chains_exact).
  const is::pairs::u32* q2 = nullptr;
  const is::pairs::Range* q_range = nullptr;
  // The integer tiles (packed fp4_e8m0_32 keys): the query rows as they read them
  // (indexer_score.h int8::Row), [rows][D/G][hp][G], [rows][D/32][hp] twice, [rows].
  const int8_t* q8 = nullptr;
  const int16_t* q8_base = nullptr;
  const float* q8_scale = nullptr;
  const is::int8::Range* q8_range = nullptr;
  // The AMX tiles' merged values (indexer_score.h amx::merge_row): [rows][hp][D], the heads'
  // units [rows][hp], and whether a row has them (its heads' blocks within 2^kMaxShift).
  const int8_t* q8m = nullptr;
  const float* q8m_unit = nullptr;
  const uint8_t* q8m_ok = nullptr;
#endif
  std::atomic<bool> out_of_memory{false};
};

// A tiled task's batch entry, first key and query rows, how many of each, and where its
// scores go: Score itself (row stride T), or a task's own buffer (IndexerTopK).
struct TaskTile {
  int64_t bi, t0, s0, cols, rows;
  float* out;          // score[first query row][first key]
  int64_t out_stride;  // between query rows
};
// Tiled task t = (batch entry, query block, key tile) of the whole Score.
inline TaskTile task_tile(const Job& j, size_t task) {
  const int64_t t = static_cast<int64_t>(task);
  const int64_t t0 = t % j.t_blocks * is::kTileT, s0 = t / j.t_blocks % j.s_blocks * is::kTileS;
  const int64_t bi = t / j.t_blocks / j.s_blocks;
  return {bi, t0, s0, std::min(is::kTileT, j.pr.t - t0), std::min(is::kTileS, j.pr.s - s0),
          j.out + (bi * j.pr.s + s0) * j.pr.t + t0, j.pr.t};
}

// A task's tile (its block of query rows against its key tile), with the keys each row
// scores (indexer_score.h Tile::row_keys).
inline is::Tile task_view(const Job& j, const TaskTile& tt, const float* const* blocks) {
  const int64_t first_row = tt.bi * j.pr.s + tt.s0;
  return {&j.pr, j.qt + first_row * j.pr.d * j.hp, j.wt + first_row * j.hp, j.hp, blocks,
          tt.cols, tt.out, tt.out_stride,
          {j.cand.bytes != nullptr ? j.cand.bytes + first_row * j.cand_stride : nullptr,
           j.cand.block, j.cand.shift},
          j.cand_stride, j.lengths != nullptr ? j.lengths + tt.s0 : nullptr, tt.t0};
}

// Whether any of a task's query rows scores a key among [c, c + n): only then is the block
// of keys unpacked (tile_row skips it per row).
inline bool block_needed(const is::Tile& tile, int64_t rows, int64_t c, int64_t n) {
  if (tile.cand.bytes == nullptr && tile.lengths == nullptr) return true;
  for (int64_t r = 0; r < rows; ++r)
    if (tile.row_keys(r).any(c, n)) return true;
  return false;
}

// The n (<= kKeys) key rows from `first_key` as one block [kKeys][D]: float keys where they
// lie when the block is whole, else copied or unpacked into `block` and padded with zero rows.
template <typename V>
__attribute__((always_inline)) inline const float* key_block(const Job& j, int64_t first_key,
                                                             int64_t n, float* block) {
  constexpr int64_t kKeys = is::Cfg<V>::kKeys;
  const int64_t d = j.pr.d;
  const float* keys = j.keys != nullptr ? j.keys + first_key * d : nullptr;
  if (keys != nullptr && n == kKeys) return keys;
  for (int64_t k = 0; k < n; ++k) {
    if (keys != nullptr)
      std::memcpy(block + k * d, keys + k * d, static_cast<size_t>(d) * 4);
    else
      is::Cfg<V>::unpack(j.format, j.packed + (first_key + k) * j.row_bytes, d, block + k * d);
  }
  std::fill(block + n * d, block + kKeys * d, 0.0f);
  return block;
}

// Tiled task t = (batch entry, query block, key tile): the tile's blocks of kKeys key rows
// are read in place (float keys) or unpacked once (packed keys, and a last partial block,
// padded with zero rows) into row-major scratch; then each query row of the block runs over
// them.
template <typename V>
__attribute__((always_inline)) inline void tiled_task(const Job& j, const TaskTile& tt,
                                                      std::vector<float>& scratch) {
  constexpr int64_t kKeys = is::Cfg<V>::kKeys;
  static_assert(is::kTileT % kKeys == 0, "a tile is whole key blocks");
  const is::Problem& pr = j.pr;
  const int64_t bi = tt.bi, t0 = tt.t0, cols = tt.cols, rows = tt.rows;
  const size_t need = static_cast<size_t>(is::kTileT * pr.d + kKeys * j.hp);
  if (scratch.size() < need) scratch.resize(need);
  float* unpacked = scratch.data();
  float* terms = unpacked + is::kTileT * pr.d;
  const float* blocks[is::kTileT / kKeys];
  const is::Tile tile = task_view(j, tt, blocks);
  for (int64_t c = 0; c < cols; c += kKeys) {
    const int64_t n = std::min(kKeys, cols - c);
    blocks[c / kKeys] = block_needed(tile, rows, c, n)
                            ? key_block<V>(j, bi * j.r + t0 + c, n, unpacked + c * pr.d)
                            : nullptr;
  }
  for (int64_t r = 0; r < rows; ++r) is::tile_row<V>(tile, r, terms);
}

__attribute__((flatten)) void tiled_scalar(const Job& j, const TaskTile& t, std::vector<float>& s) {
  tiled_task<is::tv::VScalar>(j, t, s);
}
#ifdef CSA_X86
CSA_TARGET_AVX512 __attribute__((flatten)) void tiled_avx512(const Job& j, const TaskTile& t,
                                                             std::vector<float>& s) {
  tiled_task<is::tv::VAvx512>(j, t, s);
}
CSA_TARGET_AVX2 __attribute__((flatten)) void tiled_avx2(const Job& j, const TaskTile& t,
                                                         std::vector<float>& s) {
  tiled_task<is::tv::VAvx2>(j, t, s);
}
#endif

#ifdef CSA_X86
// tiled_task on the avx512bf16 path: the tile's key blocks also as swapped pairs (with their
// fitness), each query row against each block on vdpbf16ps where both allow it.
CSA_TARGET_AVX512BF16 __attribute__((flatten)) void tiled_avx512bf16(
    const Job& j, const TaskTile& tt, std::vector<float>& scratch) {
  using V = is::tv::VAvx512;
  constexpr int64_t kKeys = is::Cfg<V>::kKeys, kBlocks = is::kTileT / kKeys;
  const is::Problem& pr = j.pr;
  const int64_t half = pr.d / 2;
  const int64_t bi = tt.bi, t0 = tt.t0, s0 = tt.s0, cols = tt.cols, rows = tt.rows;
  const size_t need = static_cast<size_t>(is::kTileT * pr.d + kKeys * j.hp + is::kTileT * half);
  if (scratch.size() < need) scratch.resize(need);
  float* unpacked = scratch.data();
  float* terms = unpacked + is::kTileT * pr.d;
  is::pairs::u32* keys2 = reinterpret_cast<is::pairs::u32*>(terms + kKeys * j.hp);
  const float* blocks[kBlocks];
  is::pairs::Range range[kBlocks];
  const int64_t first_row = bi * pr.s + s0;
  const is::Tile tile = task_view(j, tt, blocks);
  // Packed fp4_e8m0_32 keys become pairs straight from their codes; floats are made only for
  // a block that a query row of the task cannot take on pairs (its fma chains read them) or
  // whose scales the direct path does not take.
  const bool direct = j.packed != nullptr && j.format == packed::Format::kFp4E8m0;
  for (int64_t c = 0; c < cols; c += kKeys) {
    const int64_t blk = c / kKeys, n = std::min(kKeys, cols - c);
    blocks[blk] = nullptr;
    if (!block_needed(tile, rows, c, n)) continue;  // no row reads it
    is::pairs::u32* k2 = keys2 + c * half;
    bool paired = direct;
    if (direct) {
      uint32_t lo = 255, hi = 0;
      for (int64_t k = 0; k < n && paired; ++k)
        paired = is::swap_packed_fp4_e8m0(j.packed + (bi * j.r + t0 + c + k) * j.row_bytes, pr.d,
                                          k2 + k * half, lo, hi);
      if (paired) {
        std::memset(k2 + n * half, 0, static_cast<size_t>((kKeys - n) * half) * sizeof(*k2));
        range[blk] = {true, lo, hi};
      }
    }
    bool floats = !paired;
    for (int64_t r = 0; r < rows && !floats; ++r)
      floats = !is::pairs::chains_exact(j.q_range[first_row + r], range[blk], pr.d);
    if (!floats) continue;
    const float* keys = key_block<V>(j, bi * j.r + t0 + c, n, unpacked + c * pr.d);
    blocks[blk] = keys;
    if (paired) continue;
    is::pairs::Scan scan;
    for (int64_t k = 0; k < kKeys; ++k)
      is::pairs::swap_row(keys + k * pr.d, pr.d, k2 + k * half, scan);
    range[blk] = scan.range();
  }
  uint64_t on_pairs = 0, on_fma = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = first_row + r;
    const is::PairRow pair_row{j.q2 + row * half * j.hp, j.q_range[row]};
    is::tile_row_pairs(tile, pair_row, r, keys2, range, terms, &on_pairs, &on_fma);
  }
  is::pair_counts.pairs.fetch_add(on_pairs, std::memory_order_relaxed);
  is::pair_counts.fmaf.fetch_add(on_fma, std::memory_order_relaxed);
}

// tiled_task with packed fp4_e8m0_32 keys on integer dots (AVX2's vpmaddubsw, AVX512-VNNI's
// vpdpbusd): the tile's key blocks also as the integer tiles' groups of values (with their
// range), each query row against each block on integer dots where both allow it; a block's
// floats are unpacked only for a row that cannot.
template <typename V>
__attribute__((always_inline)) inline void tiled_int8(const Job& j, const TaskTile& tt,
                                                      std::vector<float>& scratch) {
  constexpr int64_t kKeys = is::Cfg<V>::kKeys, kBlocks = is::kTileT / kKeys;
  constexpr int kGroup = std::is_same_v<V, is::tv::VAvx512> ? 4 : 2;
  const is::Problem& pr = j.pr;
  const int64_t per_key = pr.d / kGroup, nb = pr.d / is::int8::kBlock;
  const int64_t bi = tt.bi, t0 = tt.t0, s0 = tt.s0, cols = tt.cols, rows = tt.rows;
  const size_t need =
      static_cast<size_t>(is::kTileT * pr.d + kKeys * j.hp + is::kTileT * (per_key + nb));
  if (scratch.size() < need) scratch.resize(need);
  float* unpacked = scratch.data();
  float* terms = unpacked + is::kTileT * pr.d;
  uint32_t* groups = reinterpret_cast<uint32_t*>(terms + kKeys * j.hp);
  float* key_scale = reinterpret_cast<float*>(groups + is::kTileT * per_key);
  const float* blocks[kBlocks];
  is::int8::Range range[kBlocks];
  const int64_t first_row = bi * pr.s + s0;
  const is::Tile tile = task_view(j, tt, blocks);
  bool any_fine = false;  // else no key block is made (queries that are not fp4 values)
  for (int64_t r = 0; r < rows; ++r) any_fine = any_fine || j.q8_range[first_row + r].fine;
  for (int64_t c = 0; c < cols; c += kKeys) {
    const int64_t blk = c / kKeys, n = std::min(kKeys, cols - c);
    blocks[blk] = nullptr;
    if (!block_needed(tile, rows, c, n)) continue;  // no row reads it
    const int64_t first_key = bi * j.r + t0 + c;
    range[blk] = any_fine ? is::int8::make_keys<kKeys, kGroup>(
                                j.packed + first_key * j.row_bytes, j.row_bytes, n, pr.d,
                                groups + c * per_key, key_scale + c * nb)
                          : is::int8::Range{false};
    bool floats = false;
    for (int64_t r = 0; r < rows && !floats; ++r)
      floats = !is::int8::exact(j.q8_range[first_row + r], range[blk]);
    if (floats) blocks[blk] = key_block<V>(j, first_key, n, unpacked + c * pr.d);
  }
  uint64_t on_int8 = 0, on_fma = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = first_row + r;
    const is::int8::Row int8_row{j.q8 + row * pr.d * j.hp, j.q8_base + row * nb * j.hp,
                                 j.q8_scale + row * nb * j.hp, j.q8_range[row]};
    is::tile_row_int8<V>(tile, int8_row, r, groups, key_scale, range, terms, &on_int8,
                         &on_fma);
  }
  is::int8_counts.pairs.fetch_add(on_int8, std::memory_order_relaxed);
  is::int8_counts.fmaf.fetch_add(on_fma, std::memory_order_relaxed);
}

CSA_TARGET_AVX2 __attribute__((flatten)) void tiled_avx2_int8(const Job& j, const TaskTile& t,
                                                              std::vector<float>& s) {
  tiled_int8<is::tv::VAvx2>(j, t, s);
}
CSA_TARGET_AVX512_VNNI __attribute__((flatten)) void tiled_avx512_int8(const Job& j,
                                                                       const TaskTile& t,
                                                                       std::vector<float>& s) {
  tiled_int8<is::tv::VAvx512>(j, t, s);
}

// Key blocks (of 8 rows, per query row) on AMX-INT8 tiles over the process, and those of them
// as merged values (tests read them).
struct AmxCounts {
  std::atomic<uint64_t> blocks{0}, merged{0};
};
AmxCounts amx_counts;

// tiled_int8 on AMX-INT8 tiles (indexer_score.h int8::amx): the tile's keys in groups of 16
// (two blocks of 8, each made by make_keys with its own range; signed quads, transposed for
// B, and as merged values where they can be), each query row (job.q8 row-major, job.q8m
// merged) against each group on the tiles where the dots of either block are exact; a block
// whose dots are not runs fma_block's chains as tile_row does, its lanes left out of the
// group's store. Wide tiles (amx::wide) where every row and group of the task is merged. The
// scores of a group are computed after the next group's tile dots are issued (1-3% faster
// than right after its own, measured). The tiles are configured at the task's first group
// on them and released after it.
CSA_TARGET_AMX_INT8 __attribute__((flatten)) void tiled_amx(const Job& j, const TaskTile& tt,
                                                            std::vector<float>& scratch) {
  using V = is::tv::VAvx512;
  namespace amx = is::int8::amx;
  constexpr int64_t kKeys = is::Cfg<V>::kKeys, kGroup = amx::kKeys, kBlocks = is::kTileT / kKeys;
  static_assert(kGroup == 2 * kKeys && is::kTileT % kGroup == 0, "groups of two blocks of 8");
  const is::Problem& pr = j.pr;
  const int64_t quarter = pr.d / 4, nb = pr.d / is::int8::kBlock;
  const int64_t bi = tt.bi, t0 = tt.t0, s0 = tt.s0, cols = tt.cols, rows = tt.rows;
  // scratch: unpacked [kTileT][D], terms [kKeys][hp], kt [kTileT / 16][D/4][16], st
  // [kTileT / 16][D/32][16], a group's quads [16][D/4] and scales [16][D/32], two groups'
  // dots [hp/16][D/32][16][16] (group_dots'), and the merged kt and units (merge_keys')
  const int64_t group_dots = j.hp / amx::kHeads * nb * amx::kHeads * kGroup;
  const size_t need =
      static_cast<size_t>(is::kTileT * pr.d + kKeys * j.hp + is::kTileT * (quarter + nb) +
                          kGroup * (quarter + nb) + 2 * group_dots + is::kTileT * (quarter + 1));
  if (scratch.size() < need) scratch.resize(need);
  float* unpacked = scratch.data();
  float* terms = unpacked + is::kTileT * pr.d;
  uint32_t* kt = reinterpret_cast<uint32_t*>(terms + kKeys * j.hp);
  float* st = reinterpret_cast<float*>(kt + is::kTileT * quarter);
  uint32_t* quads = reinterpret_cast<uint32_t*>(st + is::kTileT * nb);
  float* key_scale = reinterpret_cast<float*>(quads + kGroup * quarter);
  int32_t* dots = reinterpret_cast<int32_t*>(key_scale + kGroup * nb);
  uint32_t* ktm = reinterpret_cast<uint32_t*>(dots + 2 * group_dots);
  float* key_unit = reinterpret_cast<float*>(ktm + is::kTileT * quarter);
  const float* blocks[kBlocks];
  is::int8::Range range[kBlocks];
  bool merged[is::kTileT / kGroup];  // the group's keys as merged values (ktm, key_unit)
  static_assert(is::kTileT / kGroup <= 32, "a row's groups as bits of a word");
  const int64_t first_row = bi * pr.s + s0;
  const is::Tile tile = task_view(j, tt, blocks);
  bool any_fine = false;  // else no group is made (queries that are not fp4 values)
  bool all_merged = true;  // every row as merged values: no group needs the blocks' kt
  for (int64_t r = 0; r < rows; ++r) {
    any_fine = any_fine || j.q8_range[first_row + r].fine;
    all_merged = all_merged && j.q8m_ok[first_row + r] != 0;
  }
  for (int64_t c = 0; c < cols; c += kGroup) {
    const int64_t g = c / kGroup;
    const bool needed = any_fine && block_needed(tile, rows, c, std::min(kGroup, cols - c));
    for (int64_t half = 0; half < 2; ++half) {  // make_keys zero-fills a half past the tile
      const int64_t blk = 2 * g + half, c8 = c + half * kKeys;
      const int64_t n8 = std::max<int64_t>(0, std::min(kKeys, cols - c8));
      const uint8_t* first = n8 > 0 ? j.packed + (bi * j.r + t0 + c8) * j.row_bytes : j.packed;
      range[blk] = needed ? is::int8::make_keys<kKeys, 4, /*kSigned=*/true>(
                                first, j.row_bytes, n8, pr.d, quads + half * kKeys * quarter,
                                key_scale + half * kKeys * nb)
                          : is::int8::Range{false};
    }
    // a block not fine leaves its rows unfinished: their lanes are never stored
    merged[g] = range[2 * g].fine && range[2 * g + 1].fine &&
                amx::merge_keys(quads, key_scale, pr.d, ktm + g * quarter * kGroup,
                                key_unit + g * kGroup);
    if ((range[2 * g].fine || range[2 * g + 1].fine) && !(merged[g] && all_merged))
      amx::transpose_keys(quads, key_scale, pr.d, kt + g * quarter * kGroup,
                          st + g * nb * kGroup);
    for (int64_t c8 = c; c8 < std::min(c + kGroup, cols); c8 += kKeys) {
      const int64_t blk = c8 / kKeys, n8 = std::min(kKeys, cols - c8);
      blocks[blk] = nullptr;
      if (!block_needed(tile, rows, c8, n8)) continue;  // no row reads it
      bool floats = false;
      for (int64_t r = 0; r < rows && !floats; ++r)
        floats = !is::int8::exact(j.q8_range[first_row + r], range[blk]);
      if (floats) blocks[blk] = key_block<V>(j, bi * j.r + t0 + c8, n8, unpacked + c8 * pr.d);
    }
  }
  // Wide tiles (amx::wide) where every row and every group the task makes is merged
  bool wide = all_merged && amx::wide(pr);
  for (int64_t g = 0; g < (cols + kGroup - 1) / kGroup && wide; ++g)
    wide = merged[g] || !(range[2 * g].fine || range[2 * g + 1].fine);  // made: merged
  bool configured = false;  // the tiles, configured for the task's first group on them
  int64_t loaded_row = -1;  // the row whose A tiles are loaded (wide tiles)
  uint32_t scored[is::kTileS] = {};  // per row, the groups with keys computed (bits)
  const is::SumOrder order = pr.sum_order();
  const bool every = tile.cand.bytes == nullptr && tile.lengths == nullptr;
  uint64_t on_int8 = 0, on_fma = 0, on_merged = 0;  // on_int8: every block on the tiles
  // The group whose dots were issued last, scored after the next group's are issued.
  struct Scored {
    const float* qs;
    const float* w;
    bool w_finite;
    const float* st;
    int64_t nb;  // blocks: 0 for merged values
    __mmask16 lanes;  // the keys whose scores it stores
    float* out;
  } issued{};
  int64_t buffer = 0;  // the dots buffer the next group's dots go to
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = first_row + r;
    const is::int8::Range& row_range = j.q8_range[row];
    const int8_t* q = j.q8 + row * pr.d * j.hp;
    const float* qs = j.q8_scale + row * nb * j.hp;
    const float* w = tile.w + r * j.hp;
    bool w_finite = true;
    for (int64_t hh = 0; hh < pr.h; ++hh) w_finite = w_finite && std::isfinite(w[hh]);
    float* out = tile.out + r * tile.out_stride;
    const is::RowKeys keys = tile.row_keys(r);
    for (int64_t c = 0; c < cols; c += kGroup) {
      uint32_t lanes = 0;
      uint64_t exact_blocks = 0;
      const uint64_t fma_before = on_fma;
      for (int64_t c8 = c; c8 < std::min(c + kGroup, cols); c8 += kKeys) {
        const int64_t n8 = std::min(kKeys, cols - c8);
        if (!every && !keys.any(c8, n8)) {  // none of the block's keys: not computed
          std::fill(out + c8, out + c8 + n8, is::kMasked);
        } else if (is::int8::exact(row_range, range[c8 / kKeys])) {
          lanes |= ((1u << n8) - 1u) << (c8 - c);
          ++exact_blocks;
        } else {
          is::fma_block<V>(tile, r, c8, terms);
          is::sum_heads_8keys(order, terms, j.hp, pr.h, n8, out + c8);
          ++on_fma;
        }
      }
      const int64_t g = c / kGroup;
      if (lanes != 0 || on_fma != fma_before) scored[r] |= 1u << g;
      if (lanes == 0) continue;
      if (!configured) {
        if (wide)
          amx::configure_wide();
        else
          amx::configure();
      }
      configured = true;
      const bool as_merged = merged[g] && j.q8m_ok[row] != 0;
      on_int8 += exact_blocks;
      on_merged += as_merged ? exact_blocks : 0;
      if (wide && loaded_row != row) {
        amx::load_wide_row(pr, j.q8m + row * pr.d * j.hp);
        loaded_row = row;
      }
      if (wide)
        amx::group_dots_wide(pr, ktm + g * quarter * kGroup, dots + buffer * group_dots);
      else if (as_merged)
        amx::group_dots_merged(pr, j.q8m + row * pr.d * j.hp, ktm + g * quarter * kGroup,
                               dots + buffer * group_dots);
      else
        amx::group_dots(pr, q, kt + g * quarter * kGroup, dots + buffer * group_dots);
      buffer ^= 1;
      if (issued.out != nullptr)
        amx::group_scores(pr, issued.nb, j.hp, dots + buffer * group_dots, issued.qs, issued.w,
                          issued.w_finite, issued.st, issued.lanes, issued.out);
      issued = as_merged ? Scored{j.q8m_unit + row * j.hp, w, w_finite, key_unit + g * kGroup, 0,
                                  static_cast<__mmask16>(lanes), out + c}
                         : Scored{qs, w, w_finite, st + g * nb * kGroup, nb,
                                  static_cast<__mmask16>(lanes), out + c};
    }
  }
  if (issued.out != nullptr)
    amx::group_scores(pr, issued.nb, j.hp, dots + (buffer ^ 1) * group_dots, issued.qs,
                      issued.w, issued.w_finite, issued.st, issued.lanes, issued.out);
  if (configured) _tile_release();
  if (!every)  // the keys a row does not score among those its tile groups computed
    for (int64_t r = 0; r < rows; ++r) {
      const is::RowKeys keys = tile.row_keys(r);
      float* out = tile.out + r * tile.out_stride;
      for (int64_t c = 0; c < cols; c += kGroup)
        if ((scored[r] >> (c / kGroup)) & 1u)
          for (int64_t k = c; k < std::min(c + kGroup, cols); ++k)
            if (!keys.keeps(k)) out[k] = is::kMasked;
    }
  is::int8_counts.pairs.fetch_add(on_int8, std::memory_order_relaxed);
  is::int8_counts.fmaf.fetch_add(on_fma, std::memory_order_relaxed);
  amx_counts.blocks.fetch_add(on_int8, std::memory_order_relaxed);
  amx_counts.merged.fetch_add(on_merged, std::memory_order_relaxed);
}

// The query rows as the integer tiles read them (indexer_score.h int8::Row, groups of
// `group` values: 2 on AVX2, 4 on AVX512-VNNI, kRowMajor on AMX-INT8 with the merged values
// too), made in parallel over rows (a 4096-row
// prefill chunk's took a seventh of the op's time serially).
struct Int8Queries {
  std::vector<int8_t> q;
  std::vector<int16_t> base;
  std::vector<float> scale;
  std::vector<is::int8::Range> range;
  // kRowMajor (the AMX tiles): the merged values too (Job::q8m)
  std::vector<int8_t> qm;
  std::vector<float> unit;
  std::vector<uint8_t> merged;
  Int8Queries(OrtKernelContext* ctx, const float* x, int64_t rows, int64_t h, int64_t d,
              int64_t hp, int group)
      : q(static_cast<size_t>(rows * d * hp), 0),
        base(static_cast<size_t>(rows * d / is::int8::kBlock * hp), 0),
        scale(base.size(), 0.0f),
        range(static_cast<size_t>(rows)) {
    const int64_t nb = d / is::int8::kBlock;
    const bool amx = group == is::int8::kRowMajor;
    if (amx) {
      qm.assign(q.size(), 0);
      unit.assign(static_cast<size_t>(rows * hp), 0.0f);
      merged.assign(static_cast<size_t>(rows), 0);
    }
    run_row_chunks(ctx, rows, h * d, [&](int64_t first, int64_t n) {
      for (int64_t i = first; i < first + n; ++i) {
        int8_t* qi = q.data() + i * d * hp;
        int16_t* bi = base.data() + i * nb * hp;
        float* si = scale.data() + i * nb * hp;
        const float* xi = x + i * h * d;
        range[i] = group == 4   ? is::int8::make_row<4>(xi, h, d, hp, qi, bi, si)
                   : group == 2 ? is::int8::make_row<2>(xi, h, d, hp, qi, bi, si)
                                : is::int8::make_row<is::int8::kRowMajor>(xi, h, d, hp, qi, bi, si);
        if (amx && range[i].fine)
          merged[i] = is::int8::amx::merge_row(qi, si, h, d, hp, qm.data() + i * d * hp,
                                               unit.data() + i * hp);
      }
    });
  }
};

// The query rows as the avx512bf16 tiles read them: q2 [rows][D/2][hp] (qt's pairs, swapped),
// and the range of each row's values.
CSA_TARGET_AVX512BF16 void pair_queries(const float* q, int64_t rows, int64_t h, int64_t d,
                                        int64_t hp, std::vector<uint32_t>& q2,
                                        std::vector<is::pairs::Range>& range) {
  const int64_t half = d / 2;
  q2.assign(static_cast<size_t>(rows * half * hp), 0u);
  range.resize(static_cast<size_t>(rows));
  std::vector<uint32_t> swapped(static_cast<size_t>(half));
  for (int64_t i = 0; i < rows; ++i) {
    is::pairs::Scan scan;
    for (int64_t hh = 0; hh < h; ++hh) {
      is::pairs::swap_row(q + (i * h + hh) * d, d, swapped.data(), scan);
      for (int64_t p = 0; p < half; ++p) q2[(i * half + p) * hp + hh] = swapped[p];
    }
    range[i] = scan.range();
  }
}
#endif

// Q [rows][H][D] and W [rows][H] as the tiles read them: qt [rows][D][hp] and
// wt [rows][hp], zeros in the padding heads.
void transpose_queries(const float* q, const float* w, int64_t rows, int64_t h, int64_t d,
                       int64_t hp, std::vector<float>& qt, std::vector<float>& wt) {
  qt.assign(static_cast<size_t>(rows * d * hp), 0.0f);
  wt.assign(static_cast<size_t>(rows * hp), 0.0f);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t hh = 0; hh < h; ++hh) {
      wt[i * hp + hh] = w[i * h + hh];
      for (int64_t k = 0; k < d; ++k) qt[(i * d + k) * hp + hh] = q[(i * h + hh) * d + k];
    }
  }
}

// The definition for query row `task` (the reference path and the shapes the tiles do not
// take: one GEMM row, or T == 1); packed keys are unpacked row by row first.
void row_task(const Job& j, size_t task, std::vector<float>& scratch) {
  const is::Problem& pr = j.pr;
  const int64_t i = static_cast<int64_t>(task);  // b * s + query
  const int64_t bi = i / pr.s;
  const float* keys = j.keys != nullptr ? j.keys + bi * j.r * pr.d : nullptr;
  const size_t need = static_cast<size_t>(pr.h + (keys == nullptr ? pr.t * pr.d : 0));
  if (scratch.size() < need) scratch.resize(need);
  float* terms = scratch.data();
  const is::RowKeys scored{
      {j.cand.bytes != nullptr ? j.cand.bytes + i * j.cand_stride : nullptr, j.cand.block,
       j.cand.shift},
      0, is::reach_from(j.lengths, i % pr.s, 0, pr.t)};
  if (keys == nullptr) {
    float* unpacked = terms + pr.h;
    for (int64_t t = 0; t < pr.t; ++t)
      if (scored.keeps(t))
        packed::unpack_row_scalar(j.format, j.packed + (bi * j.r + t) * j.row_bytes, pr.d,
                                  unpacked + t * pr.d);
    keys = unpacked;
  }
  is::score_row(pr, i % pr.s, j.q + i * pr.h * pr.d, j.w + i * pr.h, keys, scored,
                j.out + i * pr.t, terms);
}

constexpr const char* kIsaVariable = "CSA_INDEXER_SCORE_ISA";
// Unforced, the AMX tiles take calls of this many query rows a batch entry or more, without
// Candidates: one row (decode) reads each key once, and making a key group for the tiles
// costs more than the tiles save; with Candidates (a later index source's few thousand blocks
// of 8 among up to a million keys, other blocks for each row) a row mostly keeps one block of
// a group, and the tiles compute all 16 keys. One IndexerScore, H 32, D 128, AMX-class Xeon:
// vpdpbusd against AMX, 65536 keys, 1 thread: 1 row 12.4 / 14.4 ms (at 262144 keys), 2 rows
// 5.26 / 4.36, 4 rows 9.67 / 7.71, 16 rows 36.1 / 20.9 ms; 64 rows x 1M keys with 2048
// candidate blocks of 8 each, 2 threads: 142 / 208 ms.
constexpr int64_t kAmxMinQueries = 2;

// CSA_INDEXER_SCORE_ISA=amx (this op's own name): the avx512 path, its integer dots on
// AMX-INT8 tiles.
bool amx_named() {
  const char* forced = std::getenv(kIsaVariable);
  return forced != nullptr && std::strcmp(forced, "amx") == 0;
}

// Whether this process can run AMX-INT8 tiles: the CPU has them and Linux grants their state.
bool amx_usable() { return cpu_has_amx_int8() && amx_tiles_granted(); }

Isa select_path() {
  if (!amx_named())
    return select_isa(kIsaVariable, /*has_reference=*/true, /*has_bf16=*/true);
  if (!amx_usable())
    fail(kOp, std::string(kIsaVariable) + "=amx but this CPU does not support it (AMX-INT8 "
              "with AVX512-VNNI), or Linux did not grant the AMX tile state");
  return Isa::kAvx512;
}

// One call's scoring: the job, and the query rows' layouts it points into.
struct Scoring {
  Job job;
  std::vector<float> qt, wt;
#ifdef CSA_X86
  std::vector<uint32_t> q2;
  std::vector<is::pairs::Range> q_range;
  std::optional<Int8Queries> q8;
#endif
};

// IndexerScore's and IndexerTopK's inputs, attributes and path: both score alike, bit for bit.
template <typename K>
struct ScoringKernel {
  static constexpr bool kPacked = std::is_same_v<K, uint8_t>;
  const char* op;
  Isa isa;
  bool forced;  // a path named by CSA_INDEXER_SCORE_ISA or CSA2ONNX_ISA, taken as named
  // The integer dots on AMX-INT8 tiles: named ("amx"), or unforced where the CPU has them
  // (then for calls of kAmxMinQueries query rows a batch entry or more)
  bool amx_named_;
  bool amx;
  packed::Format format = packed::Format::kFp4E8m0;
  int64_t cand_block = 1;  // candidate_block_size: keys a Candidates value stands for

  ScoringKernel(const OrtKernelInfo* info, const char* op_name, size_t outputs)
      : op(op_name),
        isa(select_path()),
        forced(isa_forced(kIsaVariable)),
        amx_named_(amx_named()),
        amx(amx_named_ || (!forced && amx_usable())) {
    require_node_io(info, op, 4, outputs);  // Lengths and Candidates are optional
    // onnxruntime's lite API cannot take an optional input left out before a given one (it
    // reads the missing value): Candidates come with Lengths
    const Ort::ConstKernelInfo ki(info);
    if (ki.GetInputCount() > 5 && ki.GetInputName(4).empty() && !ki.GetInputName(5).empty())
      fail(op, "Candidates (input 5) need Lengths (input 4): give each query row's reachable "
               "keys (Width for all of them)");
    const auto name = optional_attribute<std::string>(info, op, "keys_format", "a string");
    if (kPacked && !name.has_value())
      fail(op, std::string("uint8 Keys (packed rows) need the attribute keys_format (") +
                   packed::kFormatChoices + ")");
    if (!kPacked && name.has_value())
      fail(op, "keys_format \"" + *name + "\" names a packed format but Keys are float rows");
    if (name.has_value() && !packed::parse_format(*name, &format))
      fail(op, "unknown keys_format \"" + *name + "\" (expected " + packed::kFormatChoices + ")");
    cand_block = optional_attribute<int64_t>(info, op, "candidate_block_size", "an int")
                     .value_or(1);
    if (cand_block < 1)
      fail(op, "candidate_block_size must be >= 1 (keys a Candidates value stands for), got " +
                   std::to_string(cand_block));
  }

  // Checks the inputs and fills sc.job (all but its output) and, for a call with scores to
  // compute, the path and the query layouts.
  void Prepare(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q,
               const Ort::Custom::Tensor<float>& w, const Ort::Custom::Tensor<K>& keys,
               const Ort::Custom::Tensor<int64_t>& width,
               std::optional<const Ort::Custom::Tensor<int64_t>*> lengths,
               std::optional<const Ort::Custom::Tensor<bool>*> candidates, Scoring& sc) const {
    const std::vector<int64_t> qs = q.Shape(), ws = w.Shape(), ks = keys.Shape();
    if (qs.size() != 4) fail(op, "Q must be [b, s, H, D], got " + shape_string(qs));
    const int64_t b = qs[0], s = qs[1], h = qs[2], d = qs[3];
    if (h < 1) fail(op, "Q " + shape_string(qs) + " has no heads");
    if (d < 1 || d > is::kMaxDim)
      fail(op, "Q's head dim D must be in [1, " + std::to_string(is::kMaxDim) +
                   "] (onnxruntime's MatMul sums larger D in several chains, which this op "
                   "does not reproduce), got Q " + shape_string(qs));
    if (ws.size() != 3 || ws[0] != b || ws[1] != s || ws[2] != h)
      fail(op, "W must be [b, s, H] = [" + std::to_string(b) + ", " + std::to_string(s) + ", " +
                   std::to_string(h) + "] (Q is " + shape_string(qs) + "), got " +
                   shape_string(ws));
    int64_t row_bytes = d;
    if (kPacked) {
      if (!packed::dim_fits(format, d))
        fail(op, std::string("keys_format ") + packed::format_name(format) + " packs blocks of " +
                     std::to_string(packed::block_of(format)) +
                     " values, which do not divide D = " + std::to_string(d));
      row_bytes = packed::row_bytes(format, d);
    }
    if (ks.size() != 3 || ks[0] != b || ks[2] != row_bytes)
      fail(op, std::string("Keys must be [b, R, ") + (kPacked ? "row_bytes" : "D") + "] = [" +
                   std::to_string(b) + ", R, " + std::to_string(row_bytes) + "]" +
                   (kPacked ? std::string(" (") + packed::format_name(format) +
                                  " rows of D = " + std::to_string(d) + ")"
                            : std::string()) +
                   " (Q is " + shape_string(qs) + "), got " + shape_string(ks));
    if (width.NumberOfElement() != 1)
      fail(op, "Width must hold one element, got shape " + shape_string(width.Shape()));
    const int64_t t = width.Data()[0];
    if (t < 0 || t > ks[1])
      fail(op, "Width " + std::to_string(t) + " must be in [0, R = " + std::to_string(ks[1]) +
                   "] (Keys " + shape_string(ks) + ")");
    const uint8_t* cand = nullptr;
    // Candidates' values a query row: one per key, or per block of candidate_block_size keys
    const int64_t cand_cols = t / cand_block + (t % cand_block != 0);
    if (candidates.has_value() && *candidates != nullptr) {
      const std::vector<int64_t> cs = (*candidates)->Shape();
      if (cs.size() != 3 || cs[0] != b || cs[1] != s || cs[2] != cand_cols)
        fail(op, std::string("Candidates must be [b, s, ") +
                     (cand_block == 1 ? "Width"
                                      : "ceil(Width / candidate_block_size " +
                                            std::to_string(cand_block) + ")") +
                     "] = [" + std::to_string(b) + ", " + std::to_string(s) + ", " +
                     std::to_string(cand_cols) + "], got " + shape_string(cs));
      static_assert(sizeof(bool) == 1, "bool tensors are read as bytes");
      cand = reinterpret_cast<const uint8_t*>((*candidates)->Data());
    }
    const int64_t* reachable = nullptr;
    if (lengths.has_value() && *lengths != nullptr) {
      const std::vector<int64_t> ls = (*lengths)->Shape();
      if (ls.size() != 1 || ls[0] != s)
        fail(op, "Lengths must be [s] = [" + std::to_string(s) + "], got " + shape_string(ls));
      reachable = (*lengths)->Data();
    }

    Job& job = sc.job;
    job.pr = is::Problem{b, s, h, d, t};
    job.r = ks[1];
    job.q = q.Data();
    job.w = w.Data();
    if constexpr (kPacked) {
      job.packed = keys.Data();
      job.format = format;
      job.row_bytes = row_bytes;
    } else {
      job.keys = keys.Data();
    }
    job.cand = {cand, cand_block, is::shift_of(cand_block)};
    job.cand_stride = cand_cols;
    job.lengths = reachable;
    job.s_blocks = (s + is::kTileS - 1) / is::kTileS;
    job.t_blocks = (t + is::kTileT - 1) / is::kTileT;
    if (b == 0 || s == 0 || t == 0 || isa == Isa::kReference || !job.pr.tiled()) return;

    job.tile_fn = tiled_scalar;
    int64_t lanes = 1;  // heads are padded to a multiple of the vector width
#ifdef CSA_X86
    if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) {
      job.tile_fn = tiled_avx512;
      lanes = is::tv::VAvx512::W;
    }
    // integer dots with packed fp4_e8m0_32 keys (whole blocks of 32): on AVX2, heads 16 to
    // an int16 vector; on AVX512-VNNI (the avx512 path, and the default where the CPU has
    // it: faster than vdpbf16ps), 16 to an int32 vector; on AMX-INT8 (unforced where the
    // CPU has it, or named), tiles of 16 heads x 16 keys
    const bool fp4_keys = kPacked && format == packed::Format::kFp4E8m0;
    const bool vnni = cpu_has_avx512vnni() &&
                      (isa == Isa::kAvx512 || (isa == Isa::kAvx512Bf16 && !forced));
    const bool integer_dots = fp4_keys && (isa == Isa::kAvx2 || vnni);
    const bool on_amx = amx && (amx_named_ || (s >= kAmxMinQueries && cand == nullptr));
    if (isa == Isa::kAvx512Bf16 && d % 32 == 0 && !integer_dots) {  // pairs of 32 values
      job.tile_fn = tiled_avx512bf16;
      pair_queries(job.q, b * s, h, d, (h + lanes - 1) / lanes * lanes, sc.q2, sc.q_range);
      job.q2 = sc.q2.data();
      job.q_range = sc.q_range.data();
    }
    if (isa == Isa::kAvx2) {
      job.tile_fn = tiled_avx2;
      lanes = is::tv::VAvx2::W;
    }
    int group = 2;
    if (integer_dots && isa == Isa::kAvx2) {
      job.tile_fn = tiled_avx2_int8;
      lanes = is::int8::kHeads;
    } else if (integer_dots) {
      job.tile_fn = on_amx ? tiled_amx : tiled_avx512_int8;
      lanes = is::tv::VAvx512::W;
      group = on_amx ? is::int8::kRowMajor : 4;
    }
#endif
    job.hp = (h + lanes - 1) / lanes * lanes;
#ifdef CSA_X86
    if (integer_dots) {
      sc.q8.emplace(ctx, job.q, b * s, h, d, job.hp, group);
      job.q8 = sc.q8->q.data();
      job.q8_base = sc.q8->base.data();
      job.q8_scale = sc.q8->scale.data();
      job.q8_range = sc.q8->range.data();
      job.q8m = sc.q8->qm.data();
      job.q8m_unit = sc.q8->unit.data();
      job.q8m_ok = sc.q8->merged.data();
    }
#endif
    transpose_queries(job.q, job.w, b * s, h, d, job.hp, sc.qt, sc.wt);
    job.qt = sc.qt.data();
    job.wt = sc.wt.data();
  }
};

// Tiled task t of the whole Score (task_tile).
void tile_task(const Job& j, size_t task, std::vector<float>& scratch) {
  j.tile_fn(j, task_tile(j, task), scratch);
}

// A call's multiply-adds, b * s * H * T * D, saturated (it only decides serial or pool).
int64_t multiply_adds(const is::Problem& pr) {
  int64_t n = 1;
  for (const int64_t f : {pr.b, pr.s, pr.h, pr.t, pr.d})
    if (__builtin_mul_overflow(n, f, &n)) return INT64_MAX;
  return n;
}

// Every score into `out` [b, s, T]: the tiles in parallel, or the definition row by row.
void score_all(OrtKernelContext* ctx, const char* op, Scoring& sc, float* out) {
  Job& job = sc.job;
  const is::Problem& pr = job.pr;
  job.out = out;
  const int64_t tasks =
      job.tile_fn != nullptr ? pr.b * job.s_blocks * job.t_blocks : pr.b * pr.s;
  run_tasks_with_scratch(ctx, multiply_adds(pr), serial_below::kMultiplyAdds,
                         static_cast<size_t>(tasks), job.tile_fn != nullptr ? tile_task : row_task,
                         job);
  if (job.out_of_memory) ORT_CXX_API_THROW(std::string(op) + ": out of memory", ORT_FAIL);
}

template <typename K>
struct IndexerScoreKernel : ScoringKernel<K> {
  IndexerScoreKernel(const OrtApi*, const OrtKernelInfo* info)
      : ScoringKernel<K>(info, kOp, 1) {}

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q,
                      const Ort::Custom::Tensor<float>& w, const Ort::Custom::Tensor<K>& keys,
                      const Ort::Custom::Tensor<int64_t>& width,
                      std::optional<const Ort::Custom::Tensor<int64_t>*> lengths,
                      std::optional<const Ort::Custom::Tensor<bool>*> candidates,
                      Ort::Custom::Tensor<float>& score) {
    return status_of([&] {
      Scoring sc;
      this->Prepare(ctx, q, w, keys, width, lengths, candidates, sc);
      const is::Problem& pr = sc.job.pr;
      float* out = score.Allocate({pr.b, pr.s, pr.t});
      if (pr.b > 0 && pr.s > 0 && pr.t > 0) score_all(ctx, kOp, sc, out);
    });
  }
};

// IndexerTopK: a score row's top k is torch's partial_sort branch (k * 64 <= T) fed the row's
// scores in key order (torch_topk.h HeapSelect), a window of keys at a time: the window's
// scores (kWindowScores for all rows, so that they stay in the caches) on IndexerScore's
// tiles, every task in parallel, then into each row's heap, the rows in parallel; the
// [b, s, T] scores are never whole. (Each task streaming its rows' tiles into their heaps was
// as fast on 2 threads, but gave a 256-row chunk 4 tasks whatever the thread count.) A call
// whose scores fit kMaterializedScores, or that torch ranks otherwise (k * 64 > T:
// nth_element over the whole row), or on the definition's path, scores every row first
// (score_all) and ranks each row as TorchTopK does.
constexpr const char* kTopKOp = "IndexerTopK";
constexpr int64_t kMaterializedScores = int64_t{1} << 24;  // floats: 64 MiB
constexpr int64_t kWindowScores = int64_t{1} << 20;  // floats: 4 MiB, to stay in the caches
// For tests (read when a session creates the kernel): "always" streams every call that can
// (a tiled path, k * 64 <= T) in windows of one key tile, "never" none; unset, by
// kMaterializedScores.
constexpr const char* kStreamVariable = "CSA_INDEXER_TOPK_STREAM";
enum class Streaming { kAuto, kAlways, kNever };
Streaming streaming_setting() {
  const char* v = std::getenv(kStreamVariable);
  if (v == nullptr || *v == '\0') return Streaming::kAuto;
  if (std::strcmp(v, "always") == 0) return Streaming::kAlways;
  if (std::strcmp(v, "never") == 0) return Streaming::kNever;
  fail(kTopKOp, std::string(kStreamVariable) + " must be \"always\" or \"never\", got \"" + v +
                    "\"");
}

struct TopKJob {
  const Job* job = nullptr;
  int64_t k = 0;                    // per row: min(attribute k, T)
  int64_t block = 0, nb = 0;        // block_size and blocks a row (0: no BlockScores)
  bool force_newest = false;        // force_newest_block
  // heaps fed through scan_above on AVX-512 or AVX2; AVX-512 also takes blocks of 8 in pairs
  Isa vector_scan = Isa::kScalar;
  const float* scores = nullptr;    // materialised [b, s, T], or null (streamed)
  int64_t* indices = nullptr;       // [b, s, k]
  uint32_t* block_scores = nullptr;  // [b, s, nb], or null
  // Streamed: the current window of keys [w0, w0 + cols), its scores [b * s][width], and
  // each row's heap and block maxes, fed window by window.
  float* window = nullptr;
  int64_t width = 0, w0 = 0, cols = 0, w_blocks = 0;
  HeapSelect<TopKF32, TopKLargestFirst>* select = nullptr;
  block_max::RowStream* blocks = nullptr;
  std::atomic<bool> out_of_memory{false};
};

using LargestFirst = HeapSelect<TopKF32, TopKLargestFirst>;

#ifdef CSA_X86
// The first of v[0..n) whose torch order key (TopKF32::key, IeeeOrder) is above `top`, or n:
// 16 keys a compare.
CSA_TARGET_AVX512 int64_t scan_above(const float* v, int64_t n, uint32_t top) {
  const __m512i limit = _mm512_set1_epi32(static_cast<int32_t>(top));
  const __m512i sign = _mm512_set1_epi32(INT32_MIN), abs_mask = _mm512_set1_epi32(INT32_MAX);
  const __m512i inf = _mm512_set1_epi32(0x7F800000), nan_key = _mm512_set1_epi32(-1);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_loadu_si512(v + i);
    const __m512i magnitude = _mm512_and_si512(bits, abs_mask);
    // positives: sign | bits; negatives: INT32_MAX - magnitude; zeros: sign; NaN: all ones
    __m512i key = _mm512_mask_sub_epi32(_mm512_or_si512(bits, sign),
                                        _mm512_movepi32_mask(bits), abs_mask, magnitude);
    key = _mm512_mask_mov_epi32(key, _mm512_cmpeq_epi32_mask(magnitude, _mm512_setzero_si512()),
                                sign);
    key = _mm512_mask_mov_epi32(key, _mm512_cmpgt_epu32_mask(magnitude, inf), nan_key);
    const __mmask16 above = _mm512_cmpgt_epu32_mask(key, limit);
    if (above != 0) return i + __builtin_ctz(above);
  }
  for (; i < n; ++i)
    if (TopKF32::key(v[i]) > top) return i;
  return n;
}

// scan_above on AVX2, 8 keys a compare (unsigned, as signed with the sign bits flipped).
CSA_TARGET_AVX2 int64_t scan_above_avx2(const float* v, int64_t n, uint32_t top) {
  const __m256i sign = _mm256_set1_epi32(INT32_MIN), abs_mask = _mm256_set1_epi32(INT32_MAX);
  const __m256i inf = _mm256_set1_epi32(0x7F800000), nan_key = _mm256_set1_epi32(-1);
  const __m256i limit = _mm256_xor_si256(_mm256_set1_epi32(static_cast<int32_t>(top)), sign);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    const __m256i magnitude = _mm256_and_si256(bits, abs_mask);
    // positives: sign | bits; negatives: INT32_MAX - magnitude; zeros: sign; NaN: all ones
    __m256i key = _mm256_blendv_epi8(_mm256_or_si256(bits, sign),
                                     _mm256_sub_epi32(abs_mask, magnitude),
                                     _mm256_srai_epi32(bits, 31));
    key = _mm256_blendv_epi8(key, sign, _mm256_cmpeq_epi32(magnitude, _mm256_setzero_si256()));
    key = _mm256_blendv_epi8(key, nan_key, _mm256_cmpgt_epi32(magnitude, inf));
    const int above = _mm256_movemask_ps(
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_xor_si256(key, sign), limit)));
    if (above != 0) return i + __builtin_ctz(static_cast<unsigned>(above));
  }
  for (; i < n; ++i)
    if (TopKF32::key(v[i]) > top) return i;
  return n;
}
#endif

// select.push(v, n), skipping on a vector scan the values a full heap drops untouched.
void feed(const TopKJob& tj, LargestFirst& select, const float* v, int64_t n) {
#ifdef CSA_X86
  if (tj.vector_scan != Isa::kScalar) {
    int64_t i = 0;
    if (!select.full()) {
      i = std::min(n, select.k - select.seen);
      select.push(v, i);
    }
    while (i < n) {
      const uint32_t top = select.heap[0].key;
      const int64_t next = i + (tj.vector_scan == Isa::kAvx512
                                    ? scan_above(v + i, n - i, top)
                                    : scan_above_avx2(v + i, n - i, top));
      select.skip(next - i);
      if (next == n) return;
      select.push(v + next, 1);
      i = next + 1;
    }
    return;
  }
#endif
  select.push(v, n);
}

// force_newest_block: +inf for the block of query row i's last reachable key (select_candidate
// blocks forces it in): Lengths[q] - 1, or Width - 1 without Lengths; none where that is < 0
// or past the blocks, as the graph's Where of the block ids against it does.
void force_newest(const TopKJob& tj, int64_t i, uint32_t* row_blocks) {
  const Job& j = *tj.job;
  const int64_t reach = j.lengths != nullptr ? j.lengths[i % j.pr.s] : j.pr.t;
  if (reach > 0 && (reach - 1) / tj.block < tj.nb)
    row_blocks[(reach - 1) / tj.block] = 0x7F800000u;
}

// Materialised: row `task` of the scores, ranked as TorchTopK (largest, unsorted) ranks it,
// its block maxes as BlockMax takes them.
void topk_row(const TopKJob& tj, size_t task, std::vector<float>& scratch) {
  const int64_t t = tj.job->pr.t, i = static_cast<int64_t>(task);
  const float* row = tj.scores + i * t;
  // torch's heap takes k pairs, nth_element all t (kept per thread, as TorchTopK's scratch)
  const bool heap = tj.k * 64 <= t;
  thread_local std::vector<TopKPair> pairs;
  if (pairs.size() < static_cast<size_t>(heap ? tj.k : t))
    pairs.resize(static_cast<size_t>(heap ? tj.k : t));
  if (heap) {  // torch's heap (torch_topk_select), fed through `feed`
    LargestFirst select{pairs.data(), tj.k};
    feed(tj, select, row, t);
    select.finish();
    for (int64_t j = 0; j < tj.k; ++j) tj.indices[i * tj.k + j] = pairs[j].index;
  } else {
    if (scratch.size() < static_cast<size_t>(tj.k)) scratch.resize(static_cast<size_t>(tj.k));
    torch_topk_row<TopKF32>(row, t, tj.k, /*largest=*/true, /*sorted=*/false, pairs.data(),
                            scratch.data(), tj.indices + i * tj.k);
  }
  if (tj.block_scores != nullptr) {
    const auto* bits = reinterpret_cast<const uint32_t*>(row);
    uint32_t* out = tj.block_scores + i * tj.nb;
    int64_t done = 0;
#ifdef CSA_X86
    if (tj.vector_scan == Isa::kAvx512 && tj.block == 8) {  // BlockMax's vector blocks of 8
      block_max::pairs_of_8(bits, t / 16, out);
      done = t / 16 * 2;
    }
#endif
    block_max::blocks_of_row(bits, t, tj.block, done, tj.nb - done, out);
    if (tj.force_newest) force_newest(tj, i, out);
  }
}

// Streamed, phase 1 of a window: tiled task (batch entry, block of kTileS queries, key tile
// of the window), its scores into the window's buffer.
void window_scores(const TopKJob& tj, size_t task, std::vector<float>& scratch) {
  const Job& j = *tj.job;
  const is::Problem& pr = j.pr;
  const int64_t t = static_cast<int64_t>(task), tile = t % tj.w_blocks;
  const int64_t s0 = t / tj.w_blocks % j.s_blocks * is::kTileS, bi = t / tj.w_blocks / j.s_blocks;
  const int64_t t0 = tj.w0 + tile * is::kTileT;
  j.tile_fn(j,
            TaskTile{bi, t0, s0, std::min(is::kTileT, tj.w0 + tj.cols - t0),
                     std::min(is::kTileS, pr.s - s0),
                     tj.window + (bi * pr.s + s0) * tj.width + tile * is::kTileT, tj.width},
            scratch);
}

// Streamed, phase 2 of a window: query row `task`'s scores of the window, in key order, into
// its heap and block maxes.
void window_feed(const TopKJob& tj, size_t task, std::vector<float>&) {
  const float* row = tj.window + static_cast<int64_t>(task) * tj.width;
  feed(tj, tj.select[task], row, tj.cols);
  if (tj.blocks != nullptr) tj.blocks[task].push(reinterpret_cast<const uint32_t*>(row), tj.cols);
}

// Streamed, at the end: query row `task`'s output.
void window_finish(const TopKJob& tj, size_t task, std::vector<float>&) {
  LargestFirst& select = tj.select[task];
  select.finish();
  int64_t* out = tj.indices + static_cast<int64_t>(task) * tj.k;
  for (int64_t i = 0; i < tj.k; ++i) out[i] = select.heap[i].index;
  if (tj.blocks != nullptr) {
    tj.blocks[task].finish();
    if (tj.force_newest) force_newest(tj, static_cast<int64_t>(task), tj.blocks[task].y);
  }
}

template <typename K>
struct IndexerTopKKernel : ScoringKernel<K> {
  int64_t k;
  int64_t block;  // BlockScores' block size, 0: no BlockScores
  bool force_newest_block;
  Streaming streaming;

  IndexerTopKKernel(const OrtApi*, const OrtKernelInfo* info)
      : ScoringKernel<K>(info, kTopKOp, 1),
        k(required_attribute<int64_t>(info, kTopKOp, "k", "an int")),
        block(optional_attribute<int64_t>(info, kTopKOp, "block_size", "an int").value_or(0)),
        force_newest_block(
            optional_attribute<int64_t>(info, kTopKOp, "force_newest_block", "an int")
                .value_or(0) != 0),
        streaming(streaming_setting()) {
    if (k < 1) fail(kTopKOp, "k must be >= 1, got " + std::to_string(k));
    if (block < 0)
      fail(kTopKOp, "block_size must be >= 1 (or 0: no BlockScores), got " +
                        std::to_string(block));
    if (force_newest_block && block == 0)
      fail(kTopKOp, "force_newest_block needs block_size >= 1 (it sets a block score)");
    const Ort::ConstKernelInfo ki(info);
    const bool wanted = ki.GetOutputCount() > 1 && !ki.GetOutputName(1).empty();
    if (wanted != (block > 0))
      fail(kTopKOp, block > 0 ? "block_size " + std::to_string(block) +
                                    " asks for the output BlockScores, which the node leaves out"
                              : std::string("the output BlockScores needs block_size >= 1"));
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q,
                      const Ort::Custom::Tensor<float>& w, const Ort::Custom::Tensor<K>& keys,
                      const Ort::Custom::Tensor<int64_t>& width,
                      std::optional<const Ort::Custom::Tensor<int64_t>*> lengths,
                      std::optional<const Ort::Custom::Tensor<bool>*> candidates,
                      Ort::Custom::Tensor<int64_t>& indices,
                      std::optional<Ort::Custom::Tensor<float>*> block_scores) {
    return status_of([&] { Run(ctx, q, w, keys, width, lengths, candidates, indices,
                               block_scores); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q,
           const Ort::Custom::Tensor<float>& w, const Ort::Custom::Tensor<K>& keys,
           const Ort::Custom::Tensor<int64_t>& width,
           std::optional<const Ort::Custom::Tensor<int64_t>*> lengths,
           std::optional<const Ort::Custom::Tensor<bool>*> candidates,
           Ort::Custom::Tensor<int64_t>& indices,
           std::optional<Ort::Custom::Tensor<float>*> block_scores) const {
    Scoring sc;
    this->Prepare(ctx, q, w, keys, width, lengths, candidates, sc);
    const is::Problem& pr = sc.job.pr;
    TopKJob tj;
    tj.job = &sc.job;
    tj.k = std::min(k, pr.t);
    tj.block = block;
    tj.nb = block > 0 ? (pr.t + block - 1) / block : 0;
    tj.force_newest = force_newest_block;
    tj.vector_scan = this->isa == Isa::kAvx512 || this->isa == Isa::kAvx512Bf16 ? Isa::kAvx512
                     : this->isa == Isa::kAvx2                                  ? Isa::kAvx2
                                                                                : Isa::kScalar;
    tj.indices = indices.Allocate({pr.b, pr.s, tj.k});
    if (block > 0) {
      const std::vector<int64_t> shape{pr.b, pr.s, tj.nb};
      if (!block_scores.has_value() || !has_output(ctx, 1, shape))
        fail(kTopKOp, "block_size " + std::to_string(block) + " needs the output BlockScores");
      static_assert(sizeof(float) == sizeof(uint32_t), "block maxes written as their bits");
      tj.block_scores = reinterpret_cast<uint32_t*>((*block_scores)->Allocate(shape));
    }
    if (pr.b == 0 || pr.s == 0 || pr.t == 0) return;
    const int64_t rows = pr.b * pr.s;
    int64_t scores = 0;  // what every score at once would take (the materialised path)
    if (__builtin_mul_overflow(rows, pr.t, &scores))
      fail(kTopKOp, "b * s * Width overflows int64 (Q " + shape_string(q.Shape()) + ", Width " +
                        std::to_string(pr.t) + ")");
    const bool can_stream = sc.job.tile_fn != nullptr && tj.k * 64 <= pr.t;
    const bool stream = can_stream && streaming != Streaming::kNever &&
                        (streaming == Streaming::kAlways || scores > kMaterializedScores);
    if (!stream) {
      std::vector<float> all(static_cast<size_t>(scores));
      score_all(ctx, kTopKOp, sc, all.data());
      tj.scores = all.data();
      run_tasks_with_scratch(ctx, scores, serial_below::kElements,
                             static_cast<size_t>(rows), topk_row, tj);
    } else {
      // A window of keys at a time, its width whole key tiles within the budget: its scores
      // made on IndexerScore's tiles, all tasks in parallel, then fed to the rows' heaps in
      // key order, the rows in parallel (any thread count finds work in both).
      // (CSA_INDEXER_TOPK_STREAM=always: windows of one tile, as many as can be)
      tj.width = std::max(is::kTileT, kWindowScores / rows / is::kTileT * is::kTileT);
      tj.width = std::min(tj.width, (pr.t + is::kTileT - 1) / is::kTileT * is::kTileT);
      if (streaming == Streaming::kAlways) tj.width = is::kTileT;
      std::vector<float> window(static_cast<size_t>(rows * tj.width));
      std::vector<TopKPair> heaps(static_cast<size_t>(rows * tj.k));
      std::vector<LargestFirst> select;
      std::vector<block_max::RowStream> blocks;
      for (int64_t r = 0; r < rows; ++r) {
        select.push_back({heaps.data() + r * tj.k, tj.k});
        if (tj.block_scores != nullptr) blocks.push_back({tj.block_scores + r * tj.nb, block});
      }
      tj.window = window.data();
      tj.select = select.data();
      tj.blocks = blocks.empty() ? nullptr : blocks.data();
      for (tj.w0 = 0; tj.w0 < pr.t && !tj.out_of_memory; tj.w0 += tj.width) {
        tj.cols = std::min(tj.width, pr.t - tj.w0);
        tj.w_blocks = (tj.cols + is::kTileT - 1) / is::kTileT;
        is::Problem window_pr = pr;
        window_pr.t = tj.cols;
        run_tasks_with_scratch(ctx, multiply_adds(window_pr), serial_below::kMultiplyAdds,
                               static_cast<size_t>(pr.b * sc.job.s_blocks * tj.w_blocks),
                               window_scores, tj);
        run_tasks_with_scratch(ctx, rows * tj.cols, serial_below::kElements,
                               static_cast<size_t>(rows), window_feed, tj);
      }
      run_tasks_with_scratch(ctx, rows * tj.k * 16, serial_below::kElements,
                             static_cast<size_t>(rows), window_finish, tj);
    }
    if (tj.out_of_memory) ORT_CXX_API_THROW(std::string(kTopKOp) + ": out of memory", ORT_FAIL);
  }
};

}  // namespace

// The key blocks of the paths with exact shortcuts (indexer_score.h pair_counts,
// int8_counts): out[0] on vdpbf16ps, out[1] on fma (the avx512bf16 path); out[2] on integer
// dots, out[3] on fma (the integer paths with packed keys); of out[2], out[4] on AMX-INT8
// tiles and out[5] of those as merged values (amx_counts). The tests check that a case built
// for a path took it.
extern "C" __attribute__((visibility("default"))) void csa2onnx_indexer_score_pair_counts(
    uint64_t* out, uint64_t n) {
  const uint64_t counts[6] = {is::pair_counts.pairs.load(std::memory_order_relaxed),
                              is::pair_counts.fmaf.load(std::memory_order_relaxed),
                              is::int8_counts.pairs.load(std::memory_order_relaxed),
                              is::int8_counts.fmaf.load(std::memory_order_relaxed),
                              amx_counts.blocks.load(std::memory_order_relaxed),
                              amx_counts.merged.load(std::memory_order_relaxed)};
  for (uint64_t i = 0; i < n && i < 6; ++i) out[i] = counts[i];
}

void AppendIndexerScoreOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<IndexerScoreKernel<float>>(
      kOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<IndexerScoreKernel<uint8_t>>(
      kOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<IndexerTopKKernel<float>>(
      kTopKOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<IndexerTopKKernel<uint8_t>>(
      kTopKOp, "CPUExecutionProvider"));
}

}  // namespace csa
