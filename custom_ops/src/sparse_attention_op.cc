// SparseAttention (domain csa2onnx): the reference's sparse_attn (sparse_attention.h) per
// query row, in parallel over the b*s rows, with O(64*d + h*d) scratch per row (the
// gathered rows [b, s, k, d] are never materialised).
// Inputs Q (float [b, s, h, d]), KV (float [b, n, d], each row both key and value), Sink
// (float [h]), Idx (int64 or int32 [b, s, k], -1 = nothing, else in [0, n)); attribute
// softmax_scale (float, > 0); output O (float [b, s, h, d], bf16 values).
// Compiled with -ffp-contract=off: the orders keep some multiplies and adds apart.
#include "ort_api.h"

#include <exception>
#include <string>
#include <vector>

#include "kernel_support.h"
#include "sparse_attention.h"
#include "sparse_attention_op.h"
#include "simd.h"


namespace csa {
namespace {

namespace sa = sparse_attention;

[[noreturn]] void fail(const std::string& message) {
  ORT_CXX_API_THROW("SparseAttention: " + message, ORT_INVALID_ARGUMENT);
}

template <typename I>
struct Job {
  sa::Problem pr;
  int64_t s;
  const float* q;
  const float* kv;
  const float* sink;
  const I* idx;
  float* out;
  bool out_of_memory = false;
};

template <typename I>
__attribute__((always_inline)) inline void run_row(Job<I>& j, size_t r, float* scratch) {
  const sa::Problem& pr = j.pr;
  const int64_t row = static_cast<int64_t>(r);
  const int64_t b = row / j.s;
  sa::row<I>(pr, j.q + row * pr.h * pr.d, j.kv + b * pr.n * pr.d, j.idx + row * pr.k, j.sink,
             scratch, j.out + row * pr.h * pr.d);
}

template <typename I>
void row_scalar(Job<I>& j, size_t r, float* s) { run_row(j, r, s); }
#ifdef CSA_X86
template <typename I>
CSA_TARGET_AVX512 void row_avx512(Job<I>& j, size_t r, float* s) { run_row(j, r, s); }
template <typename I>
CSA_TARGET_AVX2 void row_avx2(Job<I>& j, size_t r, float* s) { run_row(j, r, s); }
#endif

Isa select_isa() { return csa::select_isa("CSA_SPARSE_ATTENTION_ISA"); }

template <typename I>
struct SparseAttentionKernel {
  float scale = 0.0f;
  Isa isa;

  SparseAttentionKernel(const OrtApi*, const OrtKernelInfo* info) : isa(select_isa()) {
    require_node_io(info, "SparseAttention", 4, 1);
    try {
      scale = Ort::ConstKernelInfo(info).GetAttribute<float>("softmax_scale");
    } catch (const Ort::Exception&) {
      fail("attribute softmax_scale (float) is required");
    }
    if (!(scale > 0.0f)) fail("softmax_scale must be > 0, got " + std::to_string(scale));
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q,
                      const Ort::Custom::Tensor<float>& kv,
                      const Ort::Custom::Tensor<float>& sink, const Ort::Custom::Tensor<I>& idx,
                      Ort::Custom::Tensor<float>& o) {
    return status_of([&] { Run(ctx, q, kv, sink, idx, o); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q,
           const Ort::Custom::Tensor<float>& kv, const Ort::Custom::Tensor<float>& sink,
           const Ort::Custom::Tensor<I>& idx, Ort::Custom::Tensor<float>& o) {
    const std::vector<int64_t> qs = q.Shape(), ks = kv.Shape(), ss = sink.Shape(),
                               is = idx.Shape();
    if (qs.size() != 4) fail("Q must be [b, s, h, d], got " + shape_string(qs));
    const int64_t b = qs[0], s = qs[1], h = qs[2], d = qs[3];
    if (ks.size() != 3 || ks[0] != b || ks[2] != d)
      fail("KV must be [b, n, d] = [" + std::to_string(b) + ", n, " + std::to_string(d) +
           "] (Q is " + shape_string(qs) + "), got " + shape_string(ks));
    if (ss.size() != 1 || ss[0] != h)
      fail("Sink must be [h] = [" + std::to_string(h) + "], got " + shape_string(ss));
    if (is.size() != 3 || is[0] != b || is[1] != s)
      fail("Idx must be [b, s, k] = [" + std::to_string(b) + ", " + std::to_string(s) +
           ", k], got " + shape_string(is));
    const int64_t n = ks[1], k = is[2];
    const I* ix = idx.Data();
    const int64_t count = b * s * k;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t v = static_cast<int64_t>(ix[i]);
      if (v < -1 || v >= n) {
        const int64_t row = i / (k > 0 ? k : 1);
        fail("Idx[" + std::to_string(row / (s > 0 ? s : 1)) + ", " +
             std::to_string(row % (s > 0 ? s : 1)) + ", " + std::to_string(i % k) + "] = " +
             std::to_string(v) + " is out of range: indices must be -1 or in [0, " +
             std::to_string(n) + ")");
      }
    }
    float* out = o.Allocate(qs);
    const int64_t rows = b * s;
    if (rows == 0 || h == 0 || d == 0) return;

    Job<I> job{{h, d, k, n, scale}, s, q.Data(), kv.Data(), sink.Data(), ix, out};
    void (*fn)(Job<I>&, size_t, float*) = row_scalar<I>;
#ifdef CSA_X86
    if (isa == Isa::kAvx512) fn = row_avx512<I>;
    if (isa == Isa::kAvx2) fn = row_avx2<I>;
#endif
    struct Call {
      Job<I>* job;
      void (*fn)(Job<I>&, size_t, float*);
    } call{&job, fn};
    auto task = [](void* data, size_t r) {
      Call& c = *static_cast<Call*>(data);
      try {  // no exception may escape into onnxruntime's thread pool
        thread_local std::vector<float> scratch;
        const size_t need = static_cast<size_t>(sa::scratch_floats(c.job->pr));
        if (scratch.size() < need) scratch.resize(need);
        c.fn(*c.job, r, scratch.data());
      } catch (const std::bad_alloc&) {
        c.job->out_of_memory = true;
      }
    };
    if (rows * h * (k > 0 ? k : 1) * d < (1 << 16)) {
      for (int64_t r = 0; r < rows; ++r) task(&call, static_cast<size_t>(r));
    } else {
      Ort::KernelContext(ctx).ParallelFor(task, static_cast<size_t>(rows), 0, &call);
    }
    if (job.out_of_memory) ORT_CXX_API_THROW("SparseAttention: out of memory", ORT_FAIL);
  }
};

}  // namespace

void AppendSparseAttentionOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<SparseAttentionKernel<int64_t>>(
      "SparseAttention", "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<SparseAttentionKernel<int32_t>>(
      "SparseAttention", "CPUExecutionProvider"));
}

}  // namespace csa
