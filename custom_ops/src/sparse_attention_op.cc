// SparseAttention (domain csa2onnx): the reference's sparse_attn, bit for bit as
// sparse_attention.h's `row` defines it, computed by the tiled kernel of
// sparse_attention_tiled.h: per query row and group of heads (all heads of a query share its
// index list and its K=V rows), each block of 64 indices is gathered once (row pointers, or
// padded copies) and the logits and P @ V of all the group's heads run as register tiles,
// every output summed in the definition's order. In parallel over (query rows x head
// groups); O(64*d + h*d) scratch per thread (the gathered rows [b, s, k, d] are never
// materialised).
// Inputs Q (float [b, s, h, d]), KV (float [b, n, d], each row both key and value), Sink
// (float [h]), Idx (int64 or int32 [b, s, k], -1 = nothing, else in [0, n)), and optionally
// Compressed (uint8 [b, n_cache, row_bytes]: a packed cache, packed_quant.h, in the format
// named by the attribute compressed_format, e.g. "fp4_e4m3_16"): then an index i < n reads
// KV's row i and an index i in [n, n + n_cache) reads Compressed's row i - n, unpacked as
// the tiled kernel gathers it, so the output equals the call on Concat(KV,
// UnpackQuantized(Compressed)) bit for bit without that O(context) copy. Attributes
// softmax_scale (float, > 0) and compressed_format (string; needed with Compressed, a
// format without Compressed means no packed rows); output O (float [b, s, h, d], bf16
// values).
// CSA_SPARSE_ATTENTION_ISA (or CSA2ONNX_ISA; read when a session creates the kernel) forces
// a path for tests: "avx512bf16" (the tiles with vdpbf16ps where exact: the default on a CPU
// with AVX512-BF16 but AMX, where unforced both numerics take the avx512 tiles), "avx512",
// "avx2", "scalar" (the tiles without SIMD) or "reference" (the definition's `row`, one row
// per task, on the widest instruction set this CPU has); all give the same bits (the
// reference path unpacks Compressed into the concatenated float rows first).
// Attribute numerics: "exact" (absent: exact) or "fast": on a CPU with AVX512-BF16 the
// vdpbf16ps kernel of sparse_attention_fast.h (q and the rows rounded to bf16, the products
// summed in another order: outputs within a bf16 ulp or so of exact's, most identical; same
// bits for any thread count); on every other path (a CPU without AVX512-BF16, or avx512,
// avx2, scalar, reference forced) the exact kernel. CSA_SPARSE_ATTENTION_ISA=avx512bf16
// forces the fast kernel where numerics="fast", the exact vdpbf16ps tiles where "exact".
// Compiled with -ffp-contract=off: the orders keep some multiplies and adds apart.
#include "ort_api.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kernel_support.h"
#include "packed_quant.h"
#include "sparse_attention.h"
#include "sparse_attention_fast.h"
#include "sparse_attention_tiled.h"
#include "sparse_attention_op.h"
#include "simd.h"

namespace csa {
namespace {

namespace sa = sparse_attention;

constexpr const char* kOp = "SparseAttention";

template <typename I>
struct Job {
  sa::Problem pr;  // pr.n: KV's rows per batch entry
  int64_t s;
  const float* q;
  const float* kv;
  const float* sink;
  const I* idx;
  float* out;
  int64_t group;   // heads per task (the last task of a row may have fewer)
  int64_t splits;  // tasks per query row: ceil(h / group)
  const uint8_t* packed = nullptr;  // Compressed [b, n_cache, row_bytes], or null
  int64_t n_cache = 0, row_bytes = 0;
  packed::Format format = packed::Format::kFp4E4m3;
  float* unpacked = nullptr;  // [b * s, k, d]: the packed entries unpacked once, or null
  // numerics="fast": KV as bf16 [b, n, bf16_stride], or the index lists' rows as bf16
  // [b * s, k, bf16_stride], or null (sparse_attention_fast.h reads them in place)
  const uint16_t* kv_bf16 = nullptr;
  const uint16_t* gathered = nullptr;
  int64_t bf16_stride = 0;
  bool out_of_memory = false;
};

// ---- the tiled kernel (sparse_attention_tiled.h): task t = (row t / splits, head group) ----

// Query row `row`'s rows: its batch entry's KV, and the packed cache (already unpacked for
// this row when the op did that once for all its tasks).
template <typename I>
sa::tiled::Source source_of(const Job<I>& j, int64_t row) {
  const int64_t b = row / j.s;
  sa::tiled::Source src{j.kv + b * j.pr.n * j.pr.d, j.pr.n};
  if (j.kv_bf16 != nullptr) {
    src.bf16 = j.kv_bf16 + b * j.pr.n * j.bf16_stride;
    src.bf16_stride = j.bf16_stride;
  }
  if (j.gathered != nullptr) {
    src.gathered = j.gathered + row * j.pr.k * j.bf16_stride;
    src.bf16_stride = j.bf16_stride;
  }
  if (j.packed != nullptr) {
    src.packed = j.packed + b * j.n_cache * j.row_bytes;
    src.row_bytes = j.row_bytes;
    src.format = j.format;
    if (j.unpacked != nullptr) src.unpacked = j.unpacked + row * j.pr.k * j.pr.d;
  }
  return src;
}

template <typename I>
using TilesFn = void (*)(const sa::Problem&, const sa::tiled::Shape&, int64_t, const float*,
                         const sa::tiled::Source&, const I*, const float*, float*, float*);

// The tiles per instruction set. `flatten` inlines the whole kernel, vector members included,
// into the function that carries the target (see sparse_attention_tiled.h).
template <typename I>
__attribute__((flatten)) void tiles_scalar(const sa::Problem& pr, const sa::tiled::Shape& s,
                                           int64_t h0, const float* q,
                                           const sa::tiled::Source& kv, const I* idx,
                                           const float* sink, float* scratch, float* out) {
  sa::tiled::task<sa::tiled::CfgScalar, I>(pr, s, h0, q, kv, idx, sink, scratch, out);
}
#ifdef CSA_X86
template <typename I>
CSA_TARGET_AVX512 __attribute__((flatten)) void tiles_avx512(
    const sa::Problem& pr, const sa::tiled::Shape& s, int64_t h0, const float* q,
    const sa::tiled::Source& kv, const I* idx, const float* sink, float* scratch, float* out) {
  sa::tiled::task<sa::tiled::CfgAvx512, I>(pr, s, h0, q, kv, idx, sink, scratch, out);
}
template <typename I>
CSA_TARGET_AVX512BF16 __attribute__((flatten)) void tiles_avx512bf16(
    const sa::Problem& pr, const sa::tiled::Shape& s, int64_t h0, const float* q,
    const sa::tiled::Source& kv, const I* idx, const float* sink, float* scratch, float* out) {
  sa::tiled::task<sa::tiled::CfgAvx512Bf16, I>(pr, s, h0, q, kv, idx, sink, scratch, out);
}
template <typename I>
CSA_TARGET_AVX2 __attribute__((flatten)) void tiles_avx2(
    const sa::Problem& pr, const sa::tiled::Shape& s, int64_t h0, const float* q,
    const sa::tiled::Source& kv, const I* idx, const float* sink, float* scratch, float* out) {
  sa::tiled::task<sa::tiled::CfgAvx2, I>(pr, s, h0, q, kv, idx, sink, scratch, out);
}
#endif

// The once-per-call unpacking of the packed entries: part t = (query row, block of 64).
template <typename I>
using UnpackFn = void (*)(const Job<I>&, size_t);

template <typename Cfg, typename I>
__attribute__((always_inline)) inline void unpack_part(const Job<I>& j, size_t t) {
  const int64_t blocks = (j.pr.k + sa::kBlock - 1) / sa::kBlock;
  const int64_t row = static_cast<int64_t>(t) / blocks;
  const int64_t j0 = static_cast<int64_t>(t) % blocks * sa::kBlock;
  const int64_t j1 = j0 + sa::kBlock < j.pr.k ? j0 + sa::kBlock : j.pr.k;
  sa::tiled::unpack_entries<Cfg>(source_of(j, row), j.pr.d, j.idx + row * j.pr.k, j0, j1,
                                 j.unpacked + row * j.pr.k * j.pr.d);
}
template <typename I>
__attribute__((flatten)) void unpack_scalar(const Job<I>& j, size_t t) {
  unpack_part<sa::tiled::CfgScalar>(j, t);
}
#ifdef CSA_X86
template <typename I>
CSA_TARGET_AVX512 __attribute__((flatten)) void unpack_avx512(const Job<I>& j, size_t t) {
  unpack_part<sa::tiled::CfgAvx512>(j, t);
}
template <typename I>
CSA_TARGET_AVX2 __attribute__((flatten)) void unpack_avx2(const Job<I>& j, size_t t) {
  unpack_part<sa::tiled::CfgAvx2>(j, t);
}
#endif

// Task t's query row and heads [h0, h0 + g).
struct Part {
  int64_t row, h0, g;
};
template <typename I>
Part part_of(const Job<I>& j, size_t t) {
  const int64_t row = static_cast<int64_t>(t) / j.splits;
  const int64_t h0 = static_cast<int64_t>(t) % j.splits * j.group;
  return {row, h0, j.pr.h - h0 < j.group ? j.pr.h - h0 : j.group};
}

// Runs `tiles` (a kernel of shape type S) on task t with scratch for that shape.
template <typename I, typename S, typename Tiles>
void run_shape(Job<I>& j, const Part& part, const S& shape, int64_t scratch_floats,
               std::vector<float>& scratch, Tiles tiles) {
  const sa::Problem& pr = j.pr;
  if (scratch.size() < static_cast<size_t>(scratch_floats))
    scratch.resize(static_cast<size_t>(scratch_floats));
  const sa::tiled::Source src = source_of(j, part.row);
  tiles(pr, shape, part.h0, j.q + part.row * pr.h * pr.d, src, j.idx + part.row * pr.k, j.sink,
        scratch.data(), j.out + part.row * pr.h * pr.d);
}

template <typename Cfg, typename I>
void run_task(Job<I>& j, size_t t, std::vector<float>& scratch, TilesFn<I> tiles) {
  const Part part = part_of(j, t);
  const sa::tiled::Shape shape =
      sa::tiled::shape_of<Cfg>(part.g, j.pr.d, j.packed != nullptr && j.unpacked == nullptr);
  run_shape(j, part, shape, sa::tiled::scratch_floats(shape), scratch, tiles);
}

template <typename I>
void task_scalar(Job<I>& j, size_t t, std::vector<float>& s) {
  run_task<sa::tiled::CfgScalar>(j, t, s, tiles_scalar<I>);
}
#ifdef CSA_X86
template <typename I>
void task_avx512(Job<I>& j, size_t t, std::vector<float>& s) {
  run_task<sa::tiled::CfgAvx512>(j, t, s, tiles_avx512<I>);
}
template <typename I>
void task_avx512bf16(Job<I>& j, size_t t, std::vector<float>& s) {
  run_task<sa::tiled::CfgAvx512Bf16>(j, t, s, tiles_avx512bf16<I>);
}
template <typename I>
void task_avx2(Job<I>& j, size_t t, std::vector<float>& s) {
  run_task<sa::tiled::CfgAvx2>(j, t, s, tiles_avx2<I>);
}

// numerics="fast" (sparse_attention_fast.h): vdpbf16ps tiles, on CPUs with AVX512-BF16.
template <typename I>
CSA_TARGET_AVX512BF16 __attribute__((flatten)) void tiles_fast(
    const sa::Problem& pr, const sa::fast::Shape& s, int64_t h0, const float* q,
    const sa::tiled::Source& kv, const I* idx, const float* sink, float* scratch, float* out) {
  sa::fast::task<I>(pr, s, h0, q, kv, idx, sink, scratch, out);
}
template <typename I>
void task_fast(Job<I>& j, size_t t, std::vector<float>& scratch) {
  const Part part = part_of(j, t);
  const sa::fast::Shape shape =
      sa::fast::shape_of(part.g, j.pr.d, j.packed != nullptr && j.unpacked == nullptr);
  run_shape(j, part, shape, sa::fast::scratch_floats(shape), scratch, tiles_fast<I>);
}
#endif

// ---- the reference path: the definition (sparse_attention.h `row`), one task per row ----

template <typename I>
__attribute__((always_inline)) inline void run_row(Job<I>& j, size_t r,
                                                   std::vector<float>& scratch) {
  const sa::Problem& pr = j.pr;
  const size_t need = static_cast<size_t>(sa::scratch_floats(pr));
  if (scratch.size() < need) scratch.resize(need);
  const int64_t row = static_cast<int64_t>(r);
  const int64_t b = row / j.s;
  sa::row<I>(pr, j.q + row * pr.h * pr.d, j.kv + b * pr.n * pr.d, j.idx + row * pr.k, j.sink,
             scratch.data(), j.out + row * pr.h * pr.d);
}

template <typename I>
void row_scalar(Job<I>& j, size_t r, std::vector<float>& s) { run_row(j, r, s); }
#ifdef CSA_X86
template <typename I>
CSA_TARGET_AVX512 void row_avx512(Job<I>& j, size_t r, std::vector<float>& s) {
  run_row(j, r, s);
}
template <typename I>
CSA_TARGET_AVX2 void row_avx2(Job<I>& j, size_t r, std::vector<float>& s) { run_row(j, r, s); }
#endif

// Heads per task: all of them when there are enough query rows to keep the threads busy
// (the block's gather and Q's transpose are then done once per row, and each gathered row
// feeds the widest tile); else the heads are split (a multiple of 16, the AVX-512 tile) so
// that decode's few rows still make a task per CPU (onnxruntime's pool has at most one
// thread per core unless told otherwise). Fewer, wider tasks are faster: decode at 2 CPUs,
// 4 tasks of 64 heads against 16 of 16 took 3.1 against 3.6 ms (3 layers, batch 4). The
// split changes no bits: every output belongs to one head.
int64_t heads_per_task(int64_t rows, int64_t h) {
  static const int64_t kMinTasks =
      std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  if (rows >= kMinTasks || h <= 16) return h;
  const int64_t splits = (kMinTasks + rows - 1) / rows;
  const int64_t group = ((h + splits - 1) / splits + 15) / 16 * 16;
  return group < h ? group : h;
}

// The most floats the once-per-call unpacking may hold (16 MiB: decode of 6 queries at
// k = 640, d = 512); larger index lists unpack on each task's gather instead.
constexpr int64_t kMaxUnpackedFloats = int64_t{1} << 22;
// The most bf16 values the fast kernel's once-per-call conversion of KV may hold (64 MiB).
constexpr int64_t kMaxConvertedValues = int64_t{1} << 25;

// The reference path with a packed cache: the definition runs on the concatenated float
// rows [b, n + n_cache, d] (KV's, then Compressed's unpacked), made here.
template <typename I>
std::vector<float> concatenated_rows(const Job<I>& j, int64_t b) {
  const int64_t d = j.pr.d, n = j.pr.n, total = n + j.n_cache;
  std::vector<float> rows(static_cast<size_t>(b * total * d));
  for (int64_t e = 0; e < b; ++e) {
    float* dst = rows.data() + e * total * d;
    std::memcpy(dst, j.kv + e * n * d, static_cast<size_t>(n * d) * sizeof(float));
    for (int64_t r = 0; r < j.n_cache; ++r)
      packed::unpack_row_scalar(j.format, j.packed + (e * j.n_cache + r) * j.row_bytes, d,
                                dst + (n + r) * d);
  }
  return rows;
}

#ifdef CSA_X86
// The fast kernel's rows as bf16, converted once per call where a row would otherwise be
// converted by several tasks: with heads split over tasks (decode), each query's index list
// (window rows, and packed rows once unpacked for all tasks); else, when the call reads KV's
// rows more often than once on average (prefill), all of KV. Otherwise each task converts
// its rows on the gather.
template <typename I>
void convert_for_fast(OrtKernelContext* ctx, Job<I>& job, int64_t b, int64_t rows) {
  const int64_t n = job.pr.n, k = job.pr.k, d = job.pr.d;
  const int64_t dp = sa::fast::shape_of(job.pr.h, d, false).dp;
  job.bf16_stride = dp;
  if (job.splits > 1 && k > 0 && rows * k * dp <= kMaxConvertedValues &&
      (job.packed == nullptr || job.unpacked != nullptr)) {
    thread_local std::vector<uint16_t> gathered;  // pages stay mapped from call to call
    if (gathered.size() < static_cast<size_t>(rows * k * dp))
      gathered.resize(static_cast<size_t>(rows * k * dp));
    job.gathered = gathered.data();
    struct Pass {
      Job<I>* job;
      uint16_t* out;
    } pass{&job, gathered.data()};
    auto part = [](void* data, size_t t) {  // (query row, block of 64)
      const Pass& p = *static_cast<const Pass*>(data);
      const Job<I>& j = *p.job;
      const int64_t blocks = (j.pr.k + sa::kBlock - 1) / sa::kBlock;
      const int64_t row = static_cast<int64_t>(t) / blocks;
      const int64_t j0 = static_cast<int64_t>(t) % blocks * sa::kBlock;
      const int64_t j1 = j0 + sa::kBlock < j.pr.k ? j0 + sa::kBlock : j.pr.k;
      sa::fast::gather_entries(source_of(j, row), j.pr.d, j.bf16_stride, j.idx + row * j.pr.k,
                               j0, j1, p.out + row * j.pr.k * j.bf16_stride);
    };
    run_tasks(ctx, rows * k * d, serial_below::kElements,
              static_cast<size_t>(rows * ((k + sa::kBlock - 1) / sa::kBlock)), part, &pass);
  } else if (n > 0 && b * n <= rows * k && b * n * dp <= kMaxConvertedValues) {
    thread_local std::vector<uint16_t> converted;
    if (converted.size() < static_cast<size_t>(b * n * dp))
      converted.resize(static_cast<size_t>(b * n * dp));
    const float* x = job.kv;
    uint16_t* y = converted.data();
    run_row_chunks(ctx, b * n, d, [x, y, d, dp](int64_t r0, int64_t count) {
      sa::fast::convert_rows(x + r0 * d, count, d, dp, y + r0 * dp);
    });
    job.kv_bf16 = converted.data();
  }
}
#endif

template <typename I>
struct SparseAttentionKernel {
  float scale = 0.0f;
  bool has_format = false;
  packed::Format format = packed::Format::kFp4E4m3;
  // numerics="fast" takes the avx512bf16 path (sparse_attention_fast.h) where the CPU has
  // it (or it is forced); on every lower path fast runs the exact kernel, bit for bit.
  bool fast = false;
  Isa isa = Isa::kScalar;

  static constexpr const char* kIsaVariable = "CSA_SPARSE_ATTENTION_ISA";

  SparseAttentionKernel(const OrtApi*, const OrtKernelInfo* info) {
    require_node_io(info, kOp, 4, 1);  // Compressed is optional
    fast = numerics_is_fast(info, kOp);
    isa = select_isa(kIsaVariable, /*has_reference=*/true, /*has_bf16=*/true);
    // On a CPU with AMX (vdpbf16ps slower than FMA there) the avx512 fmaf tiles are faster
    // than both vdpbf16ps kernels, the fast one included (measured on a 2-core Xeon with
    // AMX, 3 layers, 2 threads: prefill 1024 0.61x exact's time, 0.69x fast's; decode
    // batch 4 0.65x): unforced, exact and fast run them there.
    if (isa == Isa::kAvx512Bf16 && cpu_has_amx_bf16() && !isa_forced(kIsaVariable))
      isa = Isa::kAvx512;
#ifdef CSA_X86
    // the exact softmax's exp path is decided here, once, not in the first call's time
    if (!fast && (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16)) sa::tiled::libm_expf_vector();
#endif
    scale = required_attribute<float>(info, kOp, "softmax_scale", "a float");
    if (!(scale > 0.0f)) fail(kOp, "softmax_scale must be > 0, got " + std::to_string(scale));
    // absent: no packed cache
    const std::optional<std::string> name =
        optional_attribute<std::string>(info, kOp, "compressed_format", "a string");
    has_format = name.has_value();
    if (has_format && !packed::parse_format(*name, &format))
      fail(kOp, "unknown compressed_format \"" + *name + "\" (expected " +
                    packed::kFormatChoices + ")");
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q,
                      const Ort::Custom::Tensor<float>& kv,
                      const Ort::Custom::Tensor<float>& sink, const Ort::Custom::Tensor<I>& idx,
                      std::optional<const Ort::Custom::Tensor<uint8_t>*> compressed,
                      Ort::Custom::Tensor<float>& o) {
    return status_of([&] { Run(ctx, q, kv, sink, idx, compressed, o); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q,
           const Ort::Custom::Tensor<float>& kv, const Ort::Custom::Tensor<float>& sink,
           const Ort::Custom::Tensor<I>& idx,
           std::optional<const Ort::Custom::Tensor<uint8_t>*> compressed,
           Ort::Custom::Tensor<float>& o) {
    const std::vector<int64_t> qs = q.Shape(), ks = kv.Shape(), ss = sink.Shape(),
                               is = idx.Shape();
    if (qs.size() != 4) fail(kOp, "Q must be [b, s, h, d], got " + shape_string(qs));
    const int64_t b = qs[0], s = qs[1], h = qs[2], d = qs[3];
    if (ks.size() != 3 || ks[0] != b || ks[2] != d)
      fail(kOp, "KV must be [b, n, d] = [" + std::to_string(b) + ", n, " + std::to_string(d) +
           "] (Q is " + shape_string(qs) + "), got " + shape_string(ks));
    if (ss.size() != 1 || ss[0] != h)
      fail(kOp, "Sink must be [h] = [" + std::to_string(h) + "], got " + shape_string(ss));
    if (is.size() != 3 || is[0] != b || is[1] != s)
      fail(kOp, "Idx must be [b, s, k] = [" + std::to_string(b) + ", " + std::to_string(s) +
           ", k], got " + shape_string(is));
    const int64_t n = ks[1], k = is[2];
    // The packed cache: [b, n_cache, row_bytes(format, d)].
    const uint8_t* packed_rows = nullptr;
    int64_t n_cache = 0, row_bytes = 0;
    if (compressed.has_value() && *compressed != nullptr) {
      const std::vector<int64_t> cs = (*compressed)->Shape();
      if (!has_format)
        fail(kOp, "input Compressed needs the attribute compressed_format (" +
             std::string(packed::kFormatChoices) + ")");
      if (!packed::dim_fits(format, d))
        fail(kOp, std::string("compressed_format ") + packed::format_name(format) +
                      " packs blocks of " + std::to_string(packed::block_of(format)) +
                      " values, which do not divide d = " + std::to_string(d));
      row_bytes = packed::row_bytes(format, d);
      if (cs.size() != 3 || cs[0] != b || cs[2] != row_bytes)
        fail(kOp, "Compressed must be [b, n_cache, row_bytes] = [" + std::to_string(b) +
                      ", n_cache, " + std::to_string(row_bytes) + "] (" +
                      packed::format_name(format) + " rows of d = " + std::to_string(d) +
                      "), got " + shape_string(cs));
      n_cache = cs[1];
      packed_rows = (*compressed)->Data();
    }
    const int64_t rows_total = n + n_cache;
    const I* ix = idx.Data();
    const int64_t count = b * s * k;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t v = static_cast<int64_t>(ix[i]);
      if (v < -1 || v >= rows_total) {
        const int64_t row = i / (k > 0 ? k : 1);
        fail(kOp, "Idx[" + std::to_string(row / (s > 0 ? s : 1)) + ", " +
             std::to_string(row % (s > 0 ? s : 1)) + ", " + std::to_string(i % k) + "] = " +
             std::to_string(v) + " is out of range: indices must be -1 or in [0, " +
             std::to_string(rows_total) + ")" +
             (packed_rows != nullptr ? " (KV's " + std::to_string(n) + " rows, then " +
                                           std::to_string(n_cache) + " rows of Compressed)"
                                     : std::string()));
      }
    }
    float* out = o.Allocate(qs);
    const int64_t rows = b * s;
    if (rows == 0 || h == 0 || d == 0) return;

    const bool reference = isa == Isa::kReference;
    const int64_t group = reference ? h : heads_per_task(rows, h);
    const int64_t splits = (h + group - 1) / group;
    Job<I> job{{h, d, k, n, scale}, s, q.Data(), kv.Data(), sink.Data(), ix, out, group, splits};
    if (packed_rows != nullptr && n_cache > 0) {
      job.packed = packed_rows;
      job.n_cache = n_cache;
      job.row_bytes = row_bytes;
      job.format = format;
    }
    std::vector<float> concatenated;  // the reference path's rows with a packed cache
    if (reference && job.packed != nullptr) {
      concatenated = concatenated_rows(job, b);
      job.kv = concatenated.data();
      job.pr.n = rows_total;
      job.packed = nullptr;
    }
    using Fn = void (*)(Job<I>&, size_t, std::vector<float>&);
    Fn fn = task_scalar<I>;
#ifdef CSA_X86
    if (isa == Isa::kAvx512Bf16) fn = fast ? task_fast<I> : task_avx512bf16<I>;
    if (isa == Isa::kAvx512) fn = task_avx512<I>;
    if (isa == Isa::kAvx2) fn = task_avx2<I>;
#endif
    if (reference) {  // the definition on the widest path this CPU has (all give its bits)
      fn = row_scalar<I>;
#ifdef CSA_X86
      if (cpu_has(Isa::kAvx512)) fn = row_avx512<I>;
      else if (cpu_has(Isa::kAvx2)) fn = row_avx2<I>;
#endif
    }
    // Heads split over tasks: each task would unpack the row's packed entries again, so they
    // are unpacked once here (in parallel over query rows and blocks) and read in place.
    if (!reference && job.packed != nullptr && splits > 1 && k > 0 &&
        rows * k * d <= kMaxUnpackedFloats) {
      // Kept per calling thread (the buffer's pages stay mapped from call to call). Only the
      // packed entries are written. Past kMaxUnpackedFloats each task unpacks on its gather.
      thread_local std::vector<float> unpacked;
      if (unpacked.size() < static_cast<size_t>(rows * k * d))
        unpacked.resize(static_cast<size_t>(rows * k * d));
      job.unpacked = unpacked.data();
      UnpackFn<I> unpack = unpack_scalar<I>;
#ifdef CSA_X86
      if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) unpack = unpack_avx512<I>;
      if (isa == Isa::kAvx2) unpack = unpack_avx2<I>;
#endif
      struct Pass {
        const Job<I>* job;
        UnpackFn<I> fn;
      } pass{&job, unpack};
      const int64_t parts = rows * ((k + sa::kBlock - 1) / sa::kBlock);
      auto part = [](void* data, size_t t) {
        const Pass& p = *static_cast<const Pass*>(data);
        p.fn(*p.job, t);
      };
      run_tasks(ctx, rows * k * d, serial_below::kElements, static_cast<size_t>(parts), part,
                &pass);
    }
#ifdef CSA_X86
    if (isa == Isa::kAvx512Bf16 && fast) convert_for_fast(ctx, job, b, rows);
#endif
    run_tasks_with_scratch(ctx, rows * h * (k > 0 ? k : 1) * d, serial_below::kAttentionTerms,
                           static_cast<size_t>(rows * splits), fn, job);
    if (job.out_of_memory) ORT_CXX_API_THROW(std::string(kOp) + ": out of memory", ORT_FAIL);
  }
};

}  // namespace

// The exact vdpbf16ps tiles' block counts (sparse_attention_tiled.h PairCounts): out[0..2] =
// blocks on pairs, blocks with P @ V on fmaf, blocks all on fmaf (the tests check that a case
// built for a path took it).
extern "C" __attribute__((visibility("default"))) void csa2onnx_sparse_attention_pair_counts(
    uint64_t* out, uint64_t n) {
  const uint64_t counts[3] = {sa::tiled::pair_counts.pairs.load(std::memory_order_relaxed),
                              sa::tiled::pair_counts.pv_fmaf.load(std::memory_order_relaxed),
                              sa::tiled::pair_counts.fmaf.load(std::memory_order_relaxed)};
  for (uint64_t i = 0; i < n && i < 3; ++i) out[i] = counts[i];
}

void AppendSparseAttentionOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<SparseAttentionKernel<int64_t>>(
      kOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<SparseAttentionKernel<int32_t>>(
      kOp, "CPUExecutionProvider"));
}

}  // namespace csa
