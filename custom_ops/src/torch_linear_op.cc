// TorchLinear (domain csa2onnx): Y = X @ W^T with every output summed in the order torch
// 2.13 CPU's F.linear uses (torch_linear.h), so that Y matches the reference bit for bit
// where MLAS's MatMul would differ in the last bit of ~0.01% of the outputs.
// Inputs X (float, [..., K], rank >= 1) and W (float or bfloat16); output Y (float,
// [..., N]). Attribute round_output (int, default 0): 1 rounds Y through bfloat16 as the
// graph's Cast pair would (ort_cast.h), where the reference rounds the linear's output.
// Attribute groups G (int, default 1): G independent linears of one shape in one node, X
// [..., G*K], W G groups of [N, K] (plain: [G*N, K], wo_a as the checkpoint stores it;
// panels64: the G groups' panels one after another, [G*ceil(N/64), ...]), Y [..., G*N];
// group g is X[..., gK:(g+1)K] @ W_g^T into Y[..., gN:(g+1)N], every group exactly the
// TorchLinear of its own [N, K] (the same plan, orders and bits). X's groups are read where
// they lie and each group's outputs stored into its columns of Y: no Split, no Concat.
//
// The kernels read W in panels of 64 columns: float W as [K][64], bf16 W as [ceil(K/2)][64]
// k-pairs (w[k] | w[k+1] << 16, the layout vdpbf16ps reads; the fmaf tiles widen a pair
// with a mask and a shift), the columns past N and the partner of an odd K's last k zero.
// W comes in one of two layouts (attribute weight_layout):
// - "plain" (the default): W is [N, K] ([G*N, K]). The kernel packs it into panels once when
//   it is a constant initializer (its own copy: 2 bytes a bf16 weight, 4 a float32 one, plus
//   the padding; each group's columns in panels of their own), else on every call.
// - "panels64": W is already the panels, bf16 [ceil(N/64), ceil(K/2), 64, 2] (element
//   [p, i, c, h] is w[64p + c, 2i + h]) or float [ceil(N/64), K, 64] (element [p, k, c] is
//   w[64p + c, k]); with G groups the first dimension is G*ceil(N/64), group g's panels
//   from g*ceil(N/64) on; attributes out_features (N) and in_features (K), a group's, are
//   required. The
//   kernel reads W where it lies (a constant initializer is checked once, at kernel
//   creation: shape, zero padding, and the exponent range the vdpbf16ps path needs), so
//   the process holds no copy of it: the exporter stores every TorchLinear weight this way.
// Both layouts give the same bits on every path.
// Attribute numerics: "exact" (the default) or "fast": with bf16 W on a CPU with AMX-BF16,
// calls of 16 rows or more whose X is bf16-exact run on AMX tiles (amx_bf16_tiles.h,
// TDPBF16PS: its own order, denormals as zero; bits independent of the thread count);
// everything else runs the exact kernel.
//
// Two kinds of tiles, every one giving the same bits:
// - fmaf tiles (avx512: 6 rows x 64 columns, avx2: 2 x 32, scalar: 1 x 64): walk k in the
//   order's sequence with float32 accumulators in registers, vectorised over the columns;
//   the order per output is the same whatever the tile or the instruction set (fmaf is
//   exact everywhere; the scalar build calls libm's).
// - vdpbf16ps tiles (avx512bf16, bf16 W only; 6 rows x 64 columns, 96 rows a task): X is
//   converted to bf16 k-pairs once per call, and one vdpbf16ps per 16 outputs does a
//   kOneDnnPairs pair step. Exact only under a precondition checked per call (X bf16-exact,
//   no denormal, inf or NaN, exponents that keep every product and partial sum normal and
//   finite; see dp_is_exact); a call that fails it runs on the avx512 fmaf tiles.
// This file is compiled with -ffp-contract=off: the compiler must never fuse a multiply and
// an add that the order keeps apart.
//
// CSA_TORCH_LINEAR_ISA (or CSA2ONNX_ISA; read when a session creates the kernel) forces a
// path for tests: "avx512bf16" (the default where the CPU has AVX512_BF16; float W runs on
// the avx512 tiles; unforced on a CPU with AMX, 24 rows or more take the fmaf tiles:
// kFmafMinRowsOnAmx), "avx512", "avx2", "scalar" (the tiles without SIMD) or "reference"
// (reference_dot per output, single-threaded; panels64 W is read a column at a time).
#include "ort_api.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)  // as CSA_X86 in simd.h
#include <immintrin.h>
#endif

#include "amx_bf16_tiles.h"
#include "dp_bf16_tiles.h"
#include "kernel_support.h"
#include "ort_cast.h"
#include "torch_linear.h"
#include "torch_linear_op.h"
#include "simd.h"

#define CSA_INLINE __attribute__((always_inline)) inline

namespace csa {
namespace {

using torch_linear::Order;
using torch_linear::Plan;

constexpr const char* kOp = "TorchLinear";
constexpr const char* kIsaVariable = "CSA_TORCH_LINEAR_ISA";

constexpr int64_t kPanel = 64;     // columns per packed panel
constexpr int64_t kMaxRows = 48;   // rows per task of the fmaf tiles (a multiple of 6 and 2)
constexpr int64_t kTwoPanelRows = 4;  // up to this many rows a vdpbf16ps task streams two panels
constexpr int64_t kDpRows = 96;    // rows per task of the vdpbf16ps tiles (a multiple of 6)
constexpr int64_t kAmxMinRows = 16;  // numerics "fast": fewer rows stay on vdpbf16ps
// Exact on a CPU with AMX (Sapphire Rapids class), the path not forced: from this many rows
// the avx512 fmaf tiles beat vdpbf16ps, slower there than FMA (measured on a 2-core Xeon
// with AMX, 2 threads, the released shapes, one process alternating: 0.67-0.79x the
// time at 24 to 1024 rows; at 16 rows 0.97-0.99x, at 2-4 rows 1.25-1.65x). Same bits.
constexpr int64_t kFmafMinRowsOnAmx = 24;
constexpr int64_t kDpBatchPairs = int64_t{1} << 22;  // X pairs converted per batch (16 MiB)

// Calls that ran on vdpbf16ps: the tests read it (csa2onnx_torch_linear_dp_calls) to know
// that a case they mean for that path did not quietly fall back to the fmaf tiles.
std::atomic<uint64_t> dp_calls{0};
// Calls that ran on AMX tiles (numerics "fast"): csa2onnx_torch_linear_amx_calls.
std::atomic<uint64_t> amx_calls{0};

// float32 W packed as ceil(N/64) panels of [K][64] (zero-padded columns).
// With G groups (W [G*N, K]) each group's N columns get ceil(N/64) panels of their own,
// group g's from panel g*ceil(N/64) on: the panels64 layout of a grouped W.
struct PackedF32 {
  int64_t n = -1, k = -1;
  std::vector<float> data;

  void pack(const float* w, int64_t N, int64_t K, int64_t G) {
    n = N;
    k = K;
    const int64_t panels = (N + kPanel - 1) / kPanel;
    data.assign(static_cast<size_t>(G * panels * K * kPanel), 0.0f);
    for (int64_t col = 0; col < G * N; ++col) {  // column col % N of group col / N
      const int64_t panel = col / N * panels + col % N / kPanel;
      float* dst = data.data() + panel * K * kPanel + col % N % kPanel;
      const float* src = w + col * K;
      for (int64_t kk = 0; kk < K; ++kk) dst[kk * kPanel] = src[kk];
    }
  }
};

// The exponents of a set of float32 or bf16 values, for the vdpbf16ps path's precondition
// (dp_is_exact): the smallest and largest biased exponent of the nonzero values (no nonzero
// value: min 255, max 0; inf and NaN have 255) and whether one is a denormal.
struct ExponentRange {
  uint32_t min = 255, max = 0;
  bool denormal = false;
};

// bf16 W packed as ceil(N/64) panels of [ceil(K/2)][64] pairs: one uint32 per column and
// k-pair, w[k] in the low half and w[k+1] in the high half (zero when K is odd). That is the
// layout vdpbf16ps multiplies, and the fmaf tiles read it too (a mask and a shift widen a
// pair), so the kernel keeps one copy of the weights: 2 bytes a weight plus the padding.
struct PackedBf16 {
  int64_t n = -1, k = -1;
  std::vector<uint32_t> data;
  ExponentRange range;

  void pack(const uint16_t* w, int64_t N, int64_t K, int64_t G) {
    n = N;
    k = K;
    const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
    data.assign(static_cast<size_t>(G * panels * pairs * kPanel), 0u);
    range = ExponentRange{};
    for (int64_t col = 0; col < G * N; ++col) {  // column col % N of group col / N
      const int64_t panel = col / N * panels + col % N / kPanel;
      uint32_t* dst = data.data() + panel * pairs * kPanel + col % N % kPanel;
      const uint16_t* src = w + col * K;
      for (int64_t kk = 0; kk < K; ++kk) {
        const uint32_t e = (src[kk] >> 7) & 0xFFu;
        if (src[kk] & 0x7FFFu) {
          range.min = e < range.min ? e : range.min;
          range.max = e > range.max ? e : range.max;
          range.denormal |= e == 0;
        }
        dst[(kk / 2) * kPanel] |= static_cast<uint32_t>(src[kk]) << (16 * (kk % 2));
      }
    }
  }
};

// The exponent range of bf16 values (for a panels64 W, read where it lies; zeros, the
// padding included, do not count).
inline ExponentRange bf16_exponents(const uint16_t* w, size_t count) {
  uint32_t lo = 255, hi = 0, denormal = 0;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t e = (w[i] >> 7) & 0xFFu;
    const bool nonzero = (w[i] & 0x7FFFu) != 0;
    lo = nonzero && e < lo ? e : lo;
    hi = nonzero && e > hi ? e : hi;
    denormal |= nonzero && e == 0;
  }
  return ExponentRange{lo, hi, denormal != 0};
}

enum class Layout { kPlain, kPanels64 };

// The panels of one group's N columns, rounded up without overflowing (N >= 0).
inline int64_t panels_of(int64_t N) { return N / kPanel + (N % kPanel != 0); }

// The shape of a panels64 W of G groups of N outputs and K inputs (bf16: k-pairs of two
// halves); N, K >= 0 and G >= 1 from the attributes (G*N fits in int64, checked there).
std::vector<int64_t> panels_shape(bool bf16, int64_t N, int64_t K, int64_t G) {
  const int64_t panels = G * panels_of(N);
  if (bf16) return {panels, K / 2 + K % 2, kPanel, 2};
  return {panels, K, kPanel};
}

// The elements of one group's panels in a panels64 W (or the kernel's packed copy).
inline int64_t group_elements(bool bf16, int64_t N, int64_t K) {
  return bf16 ? panels_of(N) * ((K + 1) / 2) * kPanel * 2 : panels_of(N) * K * kPanel;
}

// Where w[n, k] lies in a panels64 W (pairs = ceil(K/2) for bf16).
inline int64_t panel_index_f32(int64_t n, int64_t k, int64_t K) {
  return (n / kPanel * K + k) * kPanel + n % kPanel;
}
inline int64_t panel_index_bf16(int64_t n, int64_t k, int64_t pairs) {
  return ((n / kPanel * pairs + k / 2) * kPanel + n % kPanel) * 2 + k % 2;
}

bool is_zero(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u == 0;
}
bool is_zero(uint16_t v) { return v == 0; }

// A panels64 W's padding holds +0 bits: in each group, columns N.. of its last panel and,
// for bf16 with an odd K, the unused half of every column's last pair. (No output reads the
// padding, and the exponent range would only grow from it; the layout fixes it so that one
// W has one encoding.) `w` is one group's panels, `group` names it in the error ("" when
// the W has one group).
template <typename S>
void check_padding(const S* w, int64_t N, int64_t K, const std::string& group) {
  constexpr bool kBf16 = sizeof(S) == 2;
  const int64_t rows = kBf16 ? (K + 1) / 2 : K, halves = kBf16 ? 2 : 1;
  const int64_t last = (N - 1) / kPanel;  // the last panel (N > 0)
  auto bad = [&](int64_t column, int64_t k) {
    fail(kOp, "a panels64 W must hold zeros in its padding; " + group + "column " +
              std::to_string(column) + " (N is " + std::to_string(N) + "), k " +
              std::to_string(k) + " (K is " + std::to_string(K) + ") is not zero");
  };
  for (int64_t col = N; col < (last + 1) * kPanel; ++col)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < halves; ++h) {
        const int64_t i = ((last * rows + r) * kPanel + col % kPanel) * halves + h;
        if (!is_zero(w[i])) bad(col, r * halves + h);
      }
  if (kBf16 && K % 2)
    for (int64_t col = 0; col < N; ++col)
      if (!is_zero(w[panel_index_bf16(col, K, rows)])) bad(col, K);
}

template <typename S> struct PackedFor;
template <> struct PackedFor<float> { using Type = PackedF32; };
template <> struct PackedFor<uint16_t> { using Type = PackedBf16; };

// ---- fmaf tiles: plain loops, inlined into each instruction-set wrapper and vectorised there

CSA_INLINE float float_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <int MR, int NT>
CSA_INLINE void seq_step(float (&acc)[MR][NT], const float* x, int64_t ldx, const float* wk,
                         int64_t k) {
  for (int m = 0; m < MR; ++m) {
    const float xv = x[m * ldx + k];
#pragma GCC ivdep
    for (int j = 0; j < NT; ++j) acc[m][j] = __builtin_fmaf(xv, wk[j], acc[m][j]);
  }
}

template <int MR, int NT>
CSA_INLINE void add_tile(const float (&acc)[MR][NT], float* out) {
  for (int m = 0; m < MR; ++m)
#pragma GCC ivdep
    for (int j = 0; j < NT; ++j) out[m * kPanel + j] = out[m * kPanel + j] + acc[m][j];
}

// One chunk [k0, k1) of kMklBlocked (float W, [K][64] panel) for rows [0, MR) x columns
// [0, NT): a fmaf chain from 0 in k order, then out += the chunk's sum.
template <int MR, int NT>
CSA_INLINE void chain_tile(const float* x, int64_t ldx, const float* panel, int64_t k0,
                           int64_t k1, float* out) {
  float acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = 0.0f;
  for (int64_t k = k0; k < k1; ++k) seq_step<MR, NT>(acc, x, ldx, panel + k * kPanel, k);
  add_tile<MR, NT>(acc, out);
}

// One chunk [k0, k1) of kOneDnnPairs (bf16 W, pair panel; k0 even) for rows [0, MR) x
// columns [0, NT): per pair the product of k+1 first, then that of k (each widened once from
// the packed pair and shared by the rows), a last single k when k1 is odd; then out += sum.
// PF > 0: each pair row's lines are prefetched PF pair rows ahead (see task_avx2).
template <int MR, int NT, int PF>
CSA_INLINE void pair_tile(const float* x, int64_t ldx, const uint32_t* panel, int64_t k0,
                          int64_t k1, float* out) {
  float acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = 0.0f;
  float w0[NT], w1[NT];
  int64_t k = k0;
  for (; k + 1 < k1; k += 2) {
    const uint32_t* wp = panel + (k / 2) * kPanel;
    if constexpr (PF > 0)
      for (int j = 0; j < NT; j += 16) __builtin_prefetch(wp + PF * kPanel + j);  // 64-byte lines
#pragma GCC ivdep
    for (int j = 0; j < NT; ++j) {
      w1[j] = float_of_bits(wp[j] & 0xFFFF0000u);
      w0[j] = float_of_bits(wp[j] << 16);
    }
    seq_step<MR, NT>(acc, x, ldx, w1, k + 1);
    seq_step<MR, NT>(acc, x, ldx, w0, k);
  }
  if (k < k1) {
    const uint32_t* wp = panel + (k / 2) * kPanel;
#pragma GCC ivdep
    for (int j = 0; j < NT; ++j) w0[j] = float_of_bits(wp[j] << 16);
    seq_step<MR, NT>(acc, x, ldx, w0, k);
  }
  add_tile<MR, NT>(acc, out);
}

// kMklLanes for one row x columns [0, NT): separate multiply and add.
template <int NT>
CSA_INLINE void lane_add(float (&lane)[NT], float xv, const float* wk) {
#pragma GCC ivdep
  for (int j = 0; j < NT; ++j) {
    const float p = xv * wk[j];
    lane[j] = lane[j] + p;
  }
}

template <int NT>
CSA_INLINE void lanes_tile(const float* x, const float* panel, int64_t K, int64_t head,
                           float* out) {
  float l0[NT], l1[NT], l2[NT], l3[NT];
  for (int j = 0; j < NT; ++j) l0[j] = l1[j] = l2[j] = l3[j] = 0.0f;
  if (head > K) head = K;
  int64_t k = 0;
  for (; k < head; ++k) lane_add<NT>(l0, x[k], panel + k * kPanel);
  for (; k + 4 <= K; k += 4) {
    lane_add<NT>(l0, x[k], panel + k * kPanel);
    lane_add<NT>(l1, x[k + 1], panel + (k + 1) * kPanel);
    lane_add<NT>(l2, x[k + 2], panel + (k + 2) * kPanel);
    lane_add<NT>(l3, x[k + 3], panel + (k + 3) * kPanel);
  }
  if (k < K) lane_add<NT>(l0, x[k], panel + k * kPanel);
  if (k + 1 < K) lane_add<NT>(l1, x[k + 1], panel + (k + 1) * kPanel);
  if (k + 2 < K) lane_add<NT>(l2, x[k + 2], panel + (k + 2) * kPanel);
#pragma GCC ivdep
  for (int j = 0; j < NT; ++j) out[j] = (l0[j] + l2[j]) + (l1[j] + l3[j]);
}

// ---- tasks: a block of rows x one panel of one group ----
//
// Group g's rows of X lie at X[m, gK:(g+1)K] (row stride G*K) and its outputs go to
// Y[m, gN:(g+1)N] (row stride G*N): read and stored where they lie. The tasks cover every
// group's panels x row blocks, so all threads share all groups (decode too, where M = 1).

struct Job {
  Plan plan;           // a group's: plan_linear(M, N, K)
  const float* x;      // X [M][G*K]
  const uint32_t* xb;  // the vdpbf16ps path: groups group0.. of X as bf16 pairs, [.][M][pairs]
  const void* panels;  // PackedF32 / PackedBf16 data (a panels64 W): G groups of n_panels
  float* y;            // Y [M][G*N]
  int64_t M, N, K, G, pairs;
  int64_t rows_per_task, row_blocks, n_panels;  // n_panels: one group's, ceil(N/64)
  bool round_output;  // Y through bfloat16 (the graph's Cast pair, fused)
  int64_t group0;     // the tasks' first group (they cover groups group0, group0 + 1, ...)
  int64_t panels_per_task = 1;  // 2: a task's tiles stream two panels at once (decode)
};

// A group's tasks per row block: its panels, panels_per_task at a time.
CSA_INLINE int64_t task_panels(const Job& j) {
  return (j.n_panels + j.panels_per_task - 1) / j.panels_per_task;
}

// A task's group, first panel (its index among all groups' panels), panel count (1, or 2
// with panels_per_task 2) and rows; its tile writes them to a buffer that goes to Y at the
// end.
struct TaskRows {
  int64_t group, panel, m0, rows, panels = 1;
};

CSA_INLINE TaskRows task_rows(const Job& j, size_t task) {
  const int64_t t = static_cast<int64_t>(task);
  const int64_t m0 = (t % j.row_blocks) * j.rows_per_task;
  const int64_t q = t / j.row_blocks, per_group = task_panels(j);
  const int64_t group = j.group0 + q / per_group;
  const int64_t first = q % per_group * j.panels_per_task;  // within the group
  const int64_t left = j.n_panels - first;
  return {group, group * j.n_panels + first, m0,
          j.M - m0 < j.rows_per_task ? j.M - m0 : j.rows_per_task,
          left < j.panels_per_task ? left : j.panels_per_task};
}

// The task's first row of its group's X; rows are G*K apart.
CSA_INLINE const float* task_x(const Job& j, const TaskRows& tr) {
  return j.x + tr.m0 * j.G * j.K + tr.group * j.K;
}

CSA_INLINE void store_rows(const Job& j, const TaskRows& tr, const float* buf) {
  const int64_t n0 = tr.panel % j.n_panels * kPanel;  // the panel's first column in its group
  const int64_t cols = j.N - n0 < kPanel ? j.N - n0 : kPanel;
  for (int64_t r = 0; r < tr.rows; ++r) {
    float* y = j.y + (tr.m0 + r) * j.G * j.N + tr.group * j.N + n0;
    const float* b = buf + r * kPanel;
    if (j.round_output) {
      for (int64_t c = 0; c < cols; ++c) y[c] = ort_cast::cast_bf16(b[c]);
    } else {
      std::memcpy(y, b, static_cast<size_t>(cols) * sizeof(float));
    }
  }
}

#ifdef CSA_X86
// pair_tile on AVX2 with its registers spelled out: each 8-column vector of a pair row is
// widened and at once multiplied into the rows' accumulators (GCC's vectorised pair_tile
// widens the whole pair row first). The same fmafs in the same order: the same bits. Not
// inlined: its caller's lambda is compiled for the default target (one call per chunk of
// up to 512 pair rows).
template <int MR, int NV, int PF>
CSA_TARGET_AVX2 __attribute__((noinline)) void pair_tile_avx2(const float* x, int64_t ldx,
                                                              const uint32_t* panel, int64_t k0,
                                                              int64_t k1, float* out) {
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = k0;
  for (; k + 1 < k1; k += 2) {
    const uint32_t* wp = panel + (k / 2) * kPanel;
    if constexpr (PF > 0)
      for (int v = 0; v < NV; v += 2)  // 64-byte lines
        _mm_prefetch(reinterpret_cast<const char*>(wp + PF * kPanel + 8 * v), _MM_HINT_T0);
    __m256 x1[MR], x0[MR];
    for (int m = 0; m < MR; ++m) {
      x1[m] = _mm256_broadcast_ss(x + m * ldx + k + 1);
      x0[m] = _mm256_broadcast_ss(x + m * ldx + k);
    }
    for (int v = 0; v < NV; ++v) {
      const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 8 * v));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      for (int m = 0; m < MR; ++m) {
        acc[m][v] = _mm256_fmadd_ps(x1[m], w1, acc[m][v]);
        acc[m][v] = _mm256_fmadd_ps(x0[m], w0, acc[m][v]);
      }
    }
  }
  if (k < k1) {
    const uint32_t* wp = panel + (k / 2) * kPanel;
    for (int v = 0; v < NV; ++v) {
      const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 8 * v));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      for (int m = 0; m < MR; ++m)
        acc[m][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * ldx + k), w0, acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      float* o = out + m * kPanel + 8 * v;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[m][v]));
    }
}
#endif

// kAvx2: bf16 pair tiles by pair_tile_avx2 (the caller's target must include AVX2).
template <bool kPairs, int MR, int NT, int PF, bool kAvx2 = false>
CSA_INLINE void seq_rows(const Job& j, const void* panel_data, const float* x0, int64_t rows,
                         float* buf) {
  const int64_t ldx = j.G * j.K;
  for (int64_t k0 = 0; k0 < j.K; k0 += j.plan.chunk) {
    const int64_t k1 = k0 + j.plan.chunk < j.K ? k0 + j.plan.chunk : j.K;
    for (int64_t c = 0; c < kPanel; c += NT) {
      auto tile = [&](auto mr, int64_t r) {
        constexpr int R = decltype(mr)::value;
        const float* x = x0 + r * ldx;
#ifdef CSA_X86
        if constexpr (kPairs && kAvx2) {
          pair_tile_avx2<R, NT / 8, PF>(x, ldx, static_cast<const uint32_t*>(panel_data) + c, k0,
                                        k1, buf + r * kPanel + c);
          return;
        }
#endif
        if constexpr (kPairs)
          pair_tile<R, NT, PF>(x, ldx, static_cast<const uint32_t*>(panel_data) + c, k0, k1,
                           buf + r * kPanel + c);
        else
          chain_tile<R, NT>(x, ldx, static_cast<const float*>(panel_data) + c, k0, k1,
                            buf + r * kPanel + c);
      };
      int64_t r = 0;
      for (; r + MR <= rows; r += MR) tile(std::integral_constant<int, MR>{}, r);
      for (; r < rows; ++r) tile(std::integral_constant<int, 1>{}, r);  // leftover rows
    }
  }
}

template <int MR, int NT, int LANES_NT, int PF = 0, bool kAvx2 = false>
CSA_INLINE void run_task(const Job& j, size_t task, bool w_bf16) {
  const TaskRows tr = task_rows(j, task);
  alignas(64) float buf[kMaxRows * kPanel];
  for (int64_t i = 0; i < tr.rows * kPanel; ++i) buf[i] = 0.0f;
  // plan_linear gives bf16 weights kOneDnnPairs (kTorchDot runs elsewhere) and float
  // weights kMklBlocked or kMklLanes.
  const float* x = task_x(j, tr);
  if (w_bf16) {
    const int64_t offset = tr.panel * j.pairs * kPanel;
    const uint32_t* panel = static_cast<const uint32_t*>(j.panels) + offset;
    seq_rows<true, MR, NT, PF, kAvx2>(j, panel, x, tr.rows, buf);
  } else if (j.plan.order == Order::kMklBlocked) {
    const int64_t offset = tr.panel * j.K * kPanel;
    seq_rows<false, MR, NT, 0>(j, static_cast<const float*>(j.panels) + offset, x, tr.rows, buf);
  } else {
    const float* panel = static_cast<const float*>(j.panels) + tr.panel * j.K * kPanel;
    for (int64_t r = 0; r < tr.rows; ++r)
      for (int64_t c = 0; c < kPanel; c += LANES_NT)
        lanes_tile<LANES_NT>(x + r * j.G * j.K, panel + c, j.K, j.plan.head,
                             buf + r * kPanel + c);
  }
  store_rows(j, tr, buf);
}

// Instruction-set wrappers (tiles sized so the accumulators stay in registers: AVX-512
// 6 rows x 4 zmm, AVX2 2 rows x 4 ymm; the 4-lane path 4 x 4 zmm or 4 x 4 ymm).
void task_scalar(const Job& j, size_t task, bool w_bf16) { run_task<1, 64, 64>(j, task, w_bf16); }
#ifdef CSA_X86
CSA_TARGET_AVX512 void task_avx512(const Job& j, size_t task, bool w_bf16) {
  run_task<6, 64, 64>(j, task, w_bf16);
}
// One row (decode at batch 1): all 64 columns of the panel in one pass (8 ymm accumulators),
// W read once as one sequential stream; two passes of 32 columns each (the tile for more
// rows) read every 256-byte pair row in two halves. Measured on an AMD EPYC with AVX2 only
// (family 23), 3 layers' decode step, 2 threads: 95.7 -> 59.0 ms at batch 1; at batch 4
// the 64-column pass was slower (1 row a tile: 100 -> 119 ms; 2 rows: 111, spilling).
// A bf16 panel's pair rows are prefetched ahead: there the hardware prefetcher alone left
// one row at 0.62 of the read probe (tools/bench_decode_stream.py, 800 MiB: 57 -> 39-46 ms
// 8 pairs ahead; 4 rows 97 -> 85-89 ms, FMA-bound). One row reads a panel's 256-byte pair
// rows fastest 4 ahead (1 KiB): measured later, 800 MiB in turns, 0 / 2 / 4 / 6 / 8 / 16
// / 32 ahead: 49.5 / 33.0 / 32.4-34.9 / 37.3 / 39.3-41.2 / 38.6 / 38.9 ms; two to four rows
// (FMA-bound) keep 8, the same or a little faster there (3 rows: 52.9 at 8, 56.1 at 4).
// Three and four rows (decode at batch 3-4) take all rows in one tile, so each half pair row
// is converted and read once, not once per two rows (four rows need more ymm registers than
// AVX2 has: 16 accumulators besides the pair and X). Measured there (800 MiB, 2 threads,
// three runs in turns): 3 rows 67-74 -> 58-60 ms, 4 rows 82-90 -> 75.5-76.5; three rows a
// tile with the fourth alone: 79-81; 4 rows x 16 columns (four passes over each pair row):
// about 7x slower; more rows (prefill) in tiles of three: no gain, kept at two.
// Two rows (decode at batch 2) take the 64 columns in one pass too, by pair_tile_avx2 (16
// accumulators, some on the stack): 800 MiB in turns 48.1-53.4 -> 39.9-46.1 ms, where the
// 32-column tiles ran the panel's two halves at 0.57-0.80 of the read probe though they
// compute as fast from L1. pair_tile_avx2 for three or four rows (32 or 64 columns a
// pass), or for prefill's many rows (1.26x the time at 256-1024 rows), was slower than
// GCC's tiles.
constexpr int kAvx2PrefetchPairs = 8, kAvx2PrefetchPairsOneRow = 4;
CSA_TARGET_AVX2 void task_avx2(const Job& j, size_t task, bool w_bf16) {
  if (j.M == 1) {
    run_task<1, 64, 32, kAvx2PrefetchPairsOneRow>(j, task, w_bf16);
  } else if (j.M == 3) {
    run_task<3, 32, 32, kAvx2PrefetchPairs>(j, task, w_bf16);
  } else if (j.M == 4) {
    run_task<4, 32, 32, kAvx2PrefetchPairs>(j, task, w_bf16);
  } else if (j.M == 2) {
    run_task<2, 64, 32, kAvx2PrefetchPairs, true>(j, task, w_bf16);
  } else {
    run_task<2, 32, 32, kAvx2PrefetchPairs>(j, task, w_bf16);
  }
}
#endif

// ---- the vdpbf16ps path (bf16 W, kOneDnnPairs) ----
//
// vdpbf16ps adds to each float32 lane i the product of bf16 elements 2i+1, then that of
// elements 2i, rounding after each addition (round to nearest even, whatever MXCSR says):
// with k = 2i that is kOneDnnPairs' pair step, two fmafs, because a product of two bf16
// values is exact in float32. Checked bit for bit on an AMD EPYC (Zen 4) for random and
// adversarial operands (signed zeros, cancellations, ties), and by the tests against the
// reference path. It differs from fmaf in three ways, all ruled out by dp_is_exact before the
// path runs: it reads denormal inputs as zero and flushes denormal results to zero; a
// product that overflows (or underflows) is rounded before it is added, where fmaf keeps it
// exact; and it takes X as bf16, where the op's X is float32.
//
// dp_is_exact(X, W, K): every X value is bf16-exact (checked while converting), and
//   - no input is a denormal, inf or NaN;
//   - no nonzero product or partial sum can fall below 2^-126: a bf16 value with exponent e
//     is a multiple of 2^(e-7), so every product is a multiple of 2^(ex_min + ew_min - 14),
//     and so is every sum of them rounded to float32 (rounding a multiple of 2^q gives a
//     multiple of the result's ulp, which is >= 2^q when the value is not exact); hence
//     ex_min + ew_min - 14 >= -126 keeps every nonzero intermediate normal;
//   - nothing can overflow: |product| < 2^(ex_max + ew_max + 2), each partial sum is at
//     most sum |products| * (1 + 2^-24)^(K + K/512) < 2 * K * that bound (K < 2^22), so
//     ex_max + ew_max + 3 + ceil(log2 K) <= 127 keeps every value below 2^127.
// Then every operation of both paths is exact or one correctly rounded float32 result of
// the same operands, and the bits agree. Real activations and weights pass by far (the
// exponent sums they need are beyond 2^-100 and 2^100); when a call fails the test it runs
// on the fmaf tiles (avx512), same bits, only slower.

CSA_INLINE uint32_t ceil_log2(int64_t v) {
  uint32_t b = 0;
  while ((int64_t{1} << b) < v) ++b;
  return b;
}

inline bool dp_is_exact(const ExponentRange& x, const ExponentRange& w, int64_t K) {
  if (x.denormal || w.denormal || x.max == 255 || w.max == 255) return false;
  if (K >= (int64_t{1} << 22)) return false;
  if (x.min + w.min < 254 - 112) return false;  // (ex_min-127) + (ew_min-127) >= -112
  return x.max + w.max + 3 + ceil_log2(K) <= 254 + 127;
}

#ifdef CSA_X86
// GCC 12's AVX-512 headers fill unused operands with a self-initialised _mm512_undefined_*,
// which -Wuninitialized reports once inlined here (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Accumulates what convert_x checks of 16 float32 values (a lambda would not inherit the
// function's target, so the intrinsics could not inline). Lanes a masked load left out are
// 0 and change nothing.
CSA_TARGET_AVX512BF16 CSA_INLINE void scan_x(__m512i u, __m512i& any_bits, __m512i& emin,
                                             __m512i& emax) {
  const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i e = _mm512_srli_epi32(magnitude, 23);
  any_bits = _mm512_or_si512(any_bits, u);
  emin = _mm512_mask_min_epu32(emin, _mm512_test_epi32_mask(magnitude, magnitude), emin, e);
  emax = _mm512_max_epu32(emax, e);
}

// X ([M][K] float32, rows ldx apart) to bf16 pairs ([M][pairs], x[k] low, x[k+1] high,
// zero-padded) with the exponent range of its nonzero values; false when a value is not
// bf16-exact (its low 16 bits are not zero). 32 values a step: the pairs are the odd 16-bit
// words of two zmm.
CSA_TARGET_AVX512BF16 bool convert_x(const float* x, int64_t ldx, int64_t M, int64_t K,
                                     uint32_t* xb, ExponentRange& range) {
  const int64_t pairs = (K + 1) / 2;
  alignas(64) uint16_t odd[32];
  for (int i = 0; i < 32; ++i) odd[i] = static_cast<uint16_t>(2 * i + 1);
  const __m512i odd_words = _mm512_load_si512(odd);
  __m512i any_bits = _mm512_setzero_si512(), emin = _mm512_set1_epi32(255),
          emax = _mm512_setzero_si512();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    uint32_t* dst = xb + m * pairs;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512i a = _mm512_loadu_si512(row + k), b = _mm512_loadu_si512(row + k + 16);
      scan_x(a, any_bits, emin, emax);
      scan_x(b, any_bits, emin, emax);
      _mm512_storeu_si512(dst + k / 2, _mm512_permutex2var_epi16(a, odd_words, b));
    }
    if (k < K) {
      const int64_t rest = K - k;  // 1..31; an odd rest leaves a zero partner in the last pair
      const __mmask16 in_a = rest >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << rest) - 1);
      const __mmask16 in_b =
          rest > 16 ? static_cast<__mmask16>((1u << (rest - 16)) - 1) : __mmask16{0};
      const __m512i a = _mm512_maskz_loadu_epi32(in_a, row + k);
      const __m512i b = _mm512_maskz_loadu_epi32(in_b, row + k + 16);
      scan_x(a, any_bits, emin, emax);
      scan_x(b, any_bits, emin, emax);
      _mm512_mask_storeu_epi32(dst + k / 2, static_cast<__mmask16>((1u << ((rest + 1) / 2)) - 1),
                               _mm512_permutex2var_epi16(a, odd_words, b));
    }
  }
  range.min = _mm512_reduce_min_epu32(emin);
  range.max = _mm512_reduce_max_epu32(emax);
  range.denormal = range.min == 0;  // a nonzero value with exponent field 0
  const __m512i low = _mm512_and_si512(any_bits, _mm512_set1_epi32(0xFFFF));
  return _mm512_test_epi32_mask(low, low) == 0;
}
#pragma GCC diagnostic pop

// convert_x over blocks of rows of each group in parallel: converting is M*K work against
// the product's M*N*K, yet a few percent of a prefill call if one thread did it while the
// others wait. `count` groups of X [M][G*K] from `x` (a group's first column) become
// [count][M][pairs]: a group's rows of pairs lie together, as one linear's would (the
// vdpbf16ps tiles read them `pairs` apart, not G*pairs: no power-of-two stride over the
// groups for the caches to alias).
ExponentRange convert_rows(OrtKernelContext* ctx, const float* x, int64_t M, int64_t K,
                           int64_t G, int64_t count, uint32_t* xb, bool& bf16_exact) {
  constexpr int64_t kBlockRows = 32;
  struct Part {
    ExponentRange range;
    bool exact = true;
  };
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  struct Convert {
    const float* x;
    uint32_t* xb;
    int64_t M, K, G, blocks;
    std::vector<Part> parts;
  } c{x, xb, M, K, G, blocks, std::vector<Part>(static_cast<size_t>(count * blocks))};
  auto run = [](void* data, size_t i) {
    Convert& c = *static_cast<Convert*>(data);
    const int64_t g = static_cast<int64_t>(i) / c.blocks;
    const int64_t m0 = static_cast<int64_t>(i) % c.blocks * kBlockRows;
    const int64_t rows = c.M - m0 < kBlockRows ? c.M - m0 : kBlockRows;
    Part& part = c.parts[i];
    part.exact = convert_x(c.x + m0 * c.G * c.K + g * c.K, c.G * c.K, rows, c.K,
                           c.xb + (g * c.M + m0) * ((c.K + 1) / 2), part.range);
  };
  run_tasks(ctx, M * count * K, serial_below::kConvertedValues, c.parts.size(), run, &c);
  ExponentRange range;
  for (const Part& part : c.parts) {
    bf16_exact = bf16_exact && part.exact;
    range.min = part.range.min < range.min ? part.range.min : range.min;
    range.max = part.range.max > range.max ? part.range.max : range.max;
    range.denormal = range.denormal || part.range.denormal;
  }
  return range;
}

// The chunks' tiles are dp_bf16_tiles.h's: out += each chunk's sum (one vaddps, the same
// rounding as the reference's out + acc). An odd last k has a zero partner in X and W: its
// +0 product is added first, and acc + 0 == acc because acc, starting at +0, is never -0.
CSA_TARGET_AVX512BF16 void task_avx512bf16(const Job& j, size_t task, bool) {
  const TaskRows tr = task_rows(j, task);
  alignas(64) float buf[kDpRows * kPanel];
  for (int64_t i = 0; i < tr.rows * kPanel; ++i) buf[i] = 0.0f;
  const uint32_t* panel = static_cast<const uint32_t*>(j.panels) + tr.panel * j.pairs * kPanel;
  const int64_t ldxb = j.pairs;
  const uint32_t* xb = j.xb + ((tr.group - j.group0) * j.M + tr.m0) * ldxb;
  if (tr.panels == 2) {  // decode: the panel and the next one in one pass
    alignas(64) float buf2[kTwoPanelRows * kPanel] = {};
    const uint32_t* next = panel + j.pairs * kPanel;
    for (int64_t k0 = 0; k0 < j.K; k0 += j.plan.chunk) {
      const int64_t k1 = k0 + j.plan.chunk < j.K ? k0 + j.plan.chunk : j.K;
      dp_bf16::dp_rows_two(xb, ldxb, tr.rows, panel, next, k0 / 2, (k1 + 1) / 2, buf, buf2);
    }
    store_rows(j, tr, buf);
    store_rows(j, {tr.group, tr.panel + 1, tr.m0, tr.rows}, buf2);
    return;
  }
  for (int64_t k0 = 0; k0 < j.K; k0 += j.plan.chunk) {  // chunks are even but the last
    const int64_t k1 = k0 + j.plan.chunk < j.K ? k0 + j.plan.chunk : j.K;
    const int64_t p0 = k0 / 2, p1 = (k1 + 1) / 2;
    dp_bf16::dp_rows(xb, ldxb, tr.rows, panel, p0, p1, buf);
  }
  store_rows(j, tr, buf);
}

// numerics "fast" on a CPU with AMX: the whole K in one chunk of TDPBF16PS tiles
// (amx_bf16_tiles.h), W read where it lies.
CSA_TARGET_AVX512BF16 void task_amx(const Job& j, size_t task, bool) {
  const TaskRows tr = task_rows(j, task);
  alignas(64) float buf[kDpRows * kPanel];
  for (int64_t i = 0; i < tr.rows * kPanel; ++i) buf[i] = 0.0f;
  const uint32_t* panel = static_cast<const uint32_t*>(j.panels) + tr.panel * j.pairs * kPanel;
  const uint32_t* xb = j.xb + ((tr.group - j.group0) * j.M + tr.m0) * j.pairs;
  amx_bf16::amx_rows(xb, j.pairs, tr.rows, panel, 0, j.pairs, buf);
  store_rows(j, tr, buf);
}
#endif

using Task = void (*)(const Job&, size_t, bool);

// The tasks of `groups` groups from job.group0 on (row blocks x panels of each), in
// parallel. Tasks only compute into memory that exists; nothing in them can throw.
void run_groups(OrtKernelContext* ctx, const Job& job, Task task, int64_t groups, bool w_bf16) {
  struct Call {
    const Job* job;
    Task task;
    bool w_bf16;
  } call{&job, task, w_bf16};
  auto run = [](void* data, size_t t) {
    const Call& c = *static_cast<const Call*>(data);
    c.task(*c.job, t, c.w_bf16);
  };
  const int64_t tasks = job.row_blocks * groups * task_panels(job);
  run_tasks(ctx, job.M * groups * job.N * job.K, serial_below::kMultiplyAdds,
            static_cast<size_t>(tasks), run, &call);
}

// avx512bf16 (the default where the CPU has it) runs float W on the avx512 tiles: MKL's
// orders have no pair step for vdpbf16ps.
Isa select_isa() {
  return csa::select_isa(kIsaVariable, /*has_reference=*/true, /*has_bf16=*/true);
}

// The node's attributes, checked when the session creates the kernel.
struct LinearAttributes {
  Layout layout = Layout::kPlain;
  int64_t n = 0, k = 0;  // panels64: out_features (N) and in_features (K), a group's
  int64_t groups = 1;    // G
  bool round_output = false;
  bool fast = false;     // numerics "fast"

  explicit LinearAttributes(const OrtKernelInfo* info) {
    fast = numerics_is_fast(info, kOp);
    const std::string name =
        optional_attribute<std::string>(info, kOp, "weight_layout", "a string").value_or("plain");
    const std::optional<int64_t> out_features =
        optional_attribute<int64_t>(info, kOp, "out_features", "an int");
    const std::optional<int64_t> in_features =
        optional_attribute<int64_t>(info, kOp, "in_features", "an int");
    const int64_t round = optional_attribute<int64_t>(info, kOp, "round_output", "an int").value_or(0);
    if (round != 0 && round != 1)
      fail(kOp, "round_output must be 0 or 1, got " + std::to_string(round));
    round_output = round == 1;
    groups = optional_attribute<int64_t>(info, kOp, "groups", "an int").value_or(1);
    if (groups < 1) fail(kOp, "groups must be >= 1, got " + std::to_string(groups));
    const bool has_n = out_features.has_value(), has_k = in_features.has_value();
    n = out_features.value_or(0);
    k = in_features.value_or(0);
    if (name == "panels64") {
      layout = Layout::kPanels64;
      if (!has_n || !has_k)
        fail(kOp, "weight_layout \"panels64\" needs the attributes out_features (N) and "
                  "in_features (K): the panels' shape pads both");
      if (n < 0 || k < 0)
        fail(kOp, "out_features and in_features must be >= 0, got " + std::to_string(n) + " and " +
                  std::to_string(k));
      if (n > INT64_MAX / groups || k > INT64_MAX / groups)
        fail(kOp, "groups (" + std::to_string(groups) + ") times out_features (" +
                  std::to_string(n) + ") or in_features (" + std::to_string(k) +
                  ") does not fit in int64");
    } else if (name == "plain") {
      if (has_n || has_k)
        fail(kOp, "out_features and in_features belong to weight_layout \"panels64\"; a plain W "
                  "is [N, K] and gives them");
    } else {
      fail(kOp, "unknown weight_layout \"" + name + "\" (expected \"plain\" or \"panels64\")");
    }
  }
};

// OrtT: the onnxruntime type of W (float or BFloat16_t); S: its storage.
template <typename OrtT, typename S>
struct TorchLinearKernel {
  static constexpr bool kBf16 = sizeof(S) == 2;
  using Packed = typename PackedFor<S>::Type;
  Isa isa;
  LinearAttributes attrs;
  Packed constant_w;                   // plain: a constant W, packed once
  const S* constant_panels = nullptr;  // panels64: a constant W, checked once, read in place
  ExponentRange constant_range;        // ... and the exponents of its values (bf16)
  bool amx = false;  // numerics "fast", bf16 W, the avx512bf16 path, AMX granted by the OS
  bool fmaf_prefill = false;  // the CPU has AMX, the path is not forced: exact prefill takes
                              // the fmaf tiles (kFmafMinRowsOnAmx)
  bool two_panels = false;    // the CPU has AMX: decode's vdpbf16ps tasks stream two panels
                              // (kTwoPanelRows; measured there only, so far)

  TorchLinearKernel(const OrtApi*, const OrtKernelInfo* info)
      : isa(select_isa()), attrs((require_node_io(info, kOp, 2, 1), info)) {
    const bool amx_cpu = kBf16 && isa == Isa::kAvx512Bf16 && cpu_has_amx_bf16();
    fmaf_prefill = amx_cpu && !isa_forced(kIsaVariable);
    two_panels = amx_cpu;
    amx = amx_cpu && attrs.fast && amx_bf16::enable();
    const Ort::ConstValue w = constant_input(info, 1);
    if (w == nullptr) return;  // not a constant: packed (plain) or checked (panels64) per call
    const std::vector<int64_t> shape = w.GetTensorTypeAndShapeInfo().GetShape();
    const S* data = static_cast<const S*>(w.GetTensorRawData());
    if (attrs.layout == Layout::kPanels64) {  // a bad constant fails the session's creation
      check_panels(shape, data);
      constant_panels = data;
      if constexpr (kBf16) constant_range = bf16_exponents(data, element_count(shape));
      return;
    }
    if (shape.size() != 2 || shape[0] < 0 || shape[1] < 0 || shape[0] % attrs.groups)
      return;  // Compute reports it
    constant_w.pack(data, shape[0] / attrs.groups, shape[1], attrs.groups);
  }

  static size_t element_count(const std::vector<int64_t>& shape) {
    size_t count = 1;
    for (int64_t d : shape) count *= static_cast<size_t>(d);
    return count;
  }

  // A panels64 W: its shape for groups x out_features x in_features, its alignment (the
  // kernels read bf16 pairs as uint32) and each group's zero padding.
  void check_panels(const std::vector<int64_t>& shape, const S* data) const {
    const int64_t G = attrs.groups;
    const std::vector<int64_t> want = panels_shape(kBf16, attrs.n, attrs.k, G);
    if (shape != want) {
      const std::string groups = G == 1 ? "" : std::to_string(G) + "*";
      fail(kOp, std::string("a panels64 W (") + (kBf16 ? "bfloat16" : "float") +
                ") for out_features " + std::to_string(attrs.n) + " and in_features " +
                std::to_string(attrs.k) + (G == 1 ? "" : " in " + std::to_string(G) + " groups") +
                " must have shape " + shape_string(want) + " ([" + groups + "ceil(N/64), " +
                (kBf16 ? "ceil(K/2), 64, 2])" : "K, 64])") + ", got " + shape_string(shape));
    }
    if (reinterpret_cast<uintptr_t>(data) % alignof(uint32_t) != 0)
      fail(kOp, "a panels64 W must be 4-byte aligned (onnxruntime's tensors are)");
    if (attrs.n == 0) return;
    for (int64_t g = 0; g < G; ++g)
      check_padding(data + g * group_elements(kBf16, attrs.n, attrs.k), attrs.n, attrs.k,
                    G == 1 ? std::string() : "group " + std::to_string(g) + ", ");
  }

  // Column n of a panels64 W's group (`w`: its panels) as K contiguous values (the
  // reference path's dot products).
  static void unpack_column(const S* w, int64_t n, int64_t K, S* column) {
    const int64_t pairs = (K + 1) / 2;
    for (int64_t k = 0; k < K; ++k)
      column[k] = w[kBf16 ? panel_index_bf16(n, k, pairs) : panel_index_f32(n, k, K)];
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<OrtT>& w, Ort::Custom::Tensor<float>& y) {
    return status_of([&] { Run(ctx, x, w, y); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
           const Ort::Custom::Tensor<OrtT>& w, Ort::Custom::Tensor<float>& y) const {
    const std::vector<int64_t> x_shape = x.Shape();
    const std::vector<int64_t> w_shape = w.Shape();
    if (x_shape.empty()) fail(kOp, "X must have rank >= 1, got a scalar");
    const bool in_panels = attrs.layout == Layout::kPanels64;
    const int64_t G = attrs.groups;
    const S* wd = reinterpret_cast<const S*>(w.Data());
    int64_t N, K;  // a group's
    if (in_panels) {
      N = attrs.n;
      K = attrs.k;
      if (constant_panels == nullptr || wd != constant_panels) check_panels(w_shape, wd);
    } else {
      if (w_shape.size() != 2)
        fail(kOp, "W must be [N, K] (rank 2), got shape " + shape_string(w_shape));
      if (w_shape[0] % G) {
        fail(kOp, "groups (" + std::to_string(G) + ") must divide W's first dimension (G*N), "
                  "got W shape " + shape_string(w_shape));
      }
      N = w_shape[0] / G;
      K = w_shape[1];
    }
    // X's last dimension is G*K (compared without forming G*K, which could overflow).
    if (x_shape.back() % G != 0 || x_shape.back() / G != K) {
      const std::string want = G == 1 ? "" : " times groups (" + std::to_string(G) + ")";
      fail(kOp, "the last dimension of X (" + std::to_string(x_shape.back()) + ") must equal " +
                (in_panels ? "in_features (" + std::to_string(K) + ")"
                           : "K, the second dimension of W (" + std::to_string(K) + ")") +
                want + "; X shape " + shape_string(x_shape) +
                (in_panels ? "" : ", W shape " + shape_string(w_shape)));
    }
    int64_t M = 1;
    for (size_t d = 0; d + 1 < x_shape.size(); ++d) M *= x_shape[d];
    std::vector<int64_t> y_shape = x_shape;
    y_shape.back() = G * N;
    float* out = y.Allocate(y_shape);
    if (M == 0 || N == 0) return;
    if (K == 0) {
      for (int64_t i = 0; i < M * G * N; ++i) out[i] = 0.0f;
      return;
    }

    // Every group is the linear of its own [N, K]: one plan for all.
    const Plan plan = torch_linear::plan_linear(kBf16, M, N, K);
    const float* xd = x.Data();
    if (isa == Isa::kReference || plan.order == Order::kTorchDot) {
      std::vector<S> column(in_panels ? static_cast<size_t>(K) : 0);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t n = 0; n < N; ++n) {
          const S* wn = wd + (g * N + n) * K;
          if (in_panels) {
            unpack_column(wd + g * group_elements(kBf16, N, K), n, K, column.data());
            wn = column.data();
          }
          for (int64_t m = 0; m < M; ++m) {
            const float v = torch_linear::reference_dot(plan, xd + (m * G + g) * K, wn, K);
            out[(m * G + g) * N + n] = attrs.round_output ? ort_cast::cast_bf16(v) : v;
          }
        }
      return;
    }

    Packed per_call;
    const Packed* packed = nullptr;  // plain: the kernel's packed copy
    if (!in_panels) {
      packed = &constant_w;
      if (constant_w.n != N || constant_w.k != K) {
        per_call.pack(wd, N, K, G);
        packed = &per_call;
      }
    }
    const void* panels = in_panels ? static_cast<const void*>(wd) : packed->data.data();
    Job job{plan, xd, nullptr, panels, out, M, N, K, G, (K + 1) / 2,
            kMaxRows, (M + kMaxRows - 1) / kMaxRows, panels_of(N), attrs.round_output, 0};
    Task task = task_scalar;
#ifdef CSA_X86
    if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) task = task_avx512;
    if (isa == Isa::kAvx2) task = task_avx2;
    if constexpr (kBf16) {
      if (isa == Isa::kAvx512Bf16 && !(fmaf_prefill && !amx && M >= kFmafMinRowsOnAmx)) {
        const ExponentRange w_range =
            !in_panels ? packed->range
            : wd == constant_panels ? constant_range
                                    : bf16_exponents(wd, element_count(w_shape));
        // X goes to bf16 pairs a batch of groups at a time (each group's rows pairs of their
        // own, whatever K's parity), a batch's pairs at most kDpBatchPairs but one group: the
        // buffer stays the size one linear's was (all of wo_a's groups at once, 64 MiB at
        // 1024 tokens, came fresh from the OS on every call). A decode step converts every
        // group in one batch. Both paths give the same bits, so each batch takes its own.
        const int64_t per_group = M * job.pairs;
        const int64_t batch = per_group >= kDpBatchPairs ? 1
                              : G < kDpBatchPairs / per_group ? G : kDpBatchPairs / per_group;
        std::unique_ptr<uint32_t[]> xb(new uint32_t[static_cast<size_t>(batch * per_group)]);
        for (int64_t g0 = 0; g0 < G; g0 += batch) {
          const int64_t count = G - g0 < batch ? G - g0 : batch;
          bool bf16_exact = true;
          const ExponentRange x_range =
              convert_rows(ctx, xd + g0 * K, M, K, G, count, xb.get(), bf16_exact);
          Job part = job;
          part.group0 = g0;
          Task part_task = task;
          const bool on_amx = bf16_exact && amx && M >= kAmxMinRows;  // no exponent precondition
          if (on_amx || (bf16_exact && dp_is_exact(x_range, w_range, K))) {  // X's bf16 pairs
            part.xb = xb.get();
            part.rows_per_task = kDpRows;
            part.row_blocks = (M + kDpRows - 1) / kDpRows;
            if (on_amx) {
              part_task = task_amx;
              amx_calls.fetch_add(1, std::memory_order_relaxed);
            } else {
              // two panels a task where that still leaves each thread a task (4 panels or more)
              part.panels_per_task =
                  two_panels && M <= kTwoPanelRows && job.n_panels >= 4 ? 2 : 1;
              part_task = task_avx512bf16;
              dp_calls.fetch_add(1, std::memory_order_relaxed);
            }
          }
          run_groups(ctx, part, part_task, count, kBf16);
        }
        return;
      }
    }
#endif
    run_groups(ctx, job, task, G, kBf16);
  }
};

}  // namespace

void AppendTorchLinearOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  // Same name, one kernel per W type: onnxruntime picks by the input's type.
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchLinearKernel<float, float>>(
      kOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchLinearKernel<Ort::BFloat16_t, uint16_t>>(
      kOp, "CPUExecutionProvider"));
}

}  // namespace csa

extern "C" __attribute__((visibility("default"))) uint64_t csa2onnx_torch_linear_dp_calls() {
  return csa::dp_calls.load(std::memory_order_relaxed);
}

extern "C" __attribute__((visibility("default"))) uint64_t csa2onnx_torch_linear_amx_calls() {
  return csa::amx_calls.load(std::memory_order_relaxed);
}
