// TorchTopK (domain csa2onnx): torch.topk(X, K, dim=-1, largest, sorted) exactly as
// PyTorch's CPU kernel computes it, including which tied elements win and their order
// (torch_topk.h); ONNX TopK breaks ties by lowest index instead, which changes the model.
// Inputs X (float, bfloat16, float16; rank >= 1) and K (int64, scalar or [1]); attributes
// largest and sorted (0 or 1, default 1); outputs Values (X's type, X.shape[:-1] + [K]) and
// Indices (int64, same shape). As in torch, the output is sorted whenever K*64 <= n.
#include "ort_api.h"

#include <atomic>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "kernel_support.h"
#include "torch_topk.h"
#include "torch_topk_op.h"

namespace csa {
namespace {

constexpr const char* kOp = "TorchTopK";

// An optional 0/1 attribute (default `fallback`).
bool flag_attribute(const OrtKernelInfo* info, const char* name, bool fallback) {
  const int64_t value =
      optional_attribute<int64_t>(info, kOp, name, "an int, 0 or 1").value_or(fallback ? 1 : 0);
  if (value != 0 && value != 1)
    fail(kOp, "attribute " + std::string(name) + " must be 0 or 1, got " + std::to_string(value));
  return value == 1;
}

// Rows per ParallelFor task: about 64K elements each, so that a task outweighs the
// hand-off and allocates its own scratch only once.
constexpr int64_t kElementsPerTask = int64_t{1} << 16;

// OrtT: the onnxruntime element type; Fmt: the matching torch_topk.h format.
template <typename OrtT, typename Fmt>
struct TorchTopKKernel {
  using Storage = typename Fmt::Storage;
  static_assert(sizeof(OrtT) == sizeof(Storage), "element types must share their bits");

  bool largest;
  bool sorted;

  TorchTopKKernel(const OrtApi*, const OrtKernelInfo* info)
      : largest((require_node_io(info, kOp, 2, 2), flag_attribute(info, "largest", true))),
        sorted(flag_attribute(info, "sorted", true)) {}

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<OrtT>& x,
                      const Ort::Custom::Tensor<int64_t>& k_tensor,
                      Ort::Custom::Tensor<OrtT>& values, Ort::Custom::Tensor<int64_t>& indices) {
    return status_of([&] { Run(ctx, x, k_tensor, values, indices); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<OrtT>& x,
           const Ort::Custom::Tensor<int64_t>& k_tensor, Ort::Custom::Tensor<OrtT>& values,
           Ort::Custom::Tensor<int64_t>& indices) {
    const std::vector<int64_t> shape = x.Shape();
    if (shape.empty()) fail(kOp, "X must have rank >= 1, got a scalar");
    const std::vector<int64_t>& k_shape = k_tensor.Shape();
    if (!(k_shape.empty() || (k_shape.size() == 1 && k_shape[0] == 1)))
      fail(kOp, "K must be a scalar or have shape [1], got shape " + shape_string(k_shape));
    const int64_t k = *k_tensor.Data();
    const int64_t n = shape.back();
    if (k < 0) fail(kOp, "K must be >= 0, got " + std::to_string(k));
    if (k > n) {
      fail(kOp, "K = " + std::to_string(k) + " exceeds the last dimension of X, " +
                    std::to_string(n) + " (X shape " + shape_string(shape) + ")");
    }

    std::vector<int64_t> out_shape = shape;
    out_shape.back() = k;
    if (!has_output(ctx, 0, out_shape) || !has_output(ctx, 1, out_shape))
      fail(kOp, "outputs Values and Indices are both required");
    Storage* out_values = reinterpret_cast<Storage*>(values.Allocate(out_shape));
    int64_t* out_indices = indices.Allocate(out_shape);
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
    if (k == 0 || rows == 0) return;

    struct Job {
      const Storage* x;
      Storage* values;
      int64_t* indices;
      int64_t rows, n, k, rows_per_task;
      bool largest, sorted;
      std::atomic<bool> out_of_memory{false};
    } job{reinterpret_cast<const Storage*>(x.Data()), out_values, out_indices, rows, n, k,
          kElementsPerTask / n > 1 ? kElementsPerTask / n : 1, largest, sorted};
    auto run_task = [](void* data, size_t task) {
      Job& j = *static_cast<Job*>(data);
      const int64_t begin = static_cast<int64_t>(task) * j.rows_per_task;
      const int64_t end = begin + j.rows_per_task < j.rows ? begin + j.rows_per_task : j.rows;
      try {  // no exception may escape into onnxruntime's thread pool
        // the partial_sort branch (k * 64 <= n) keeps k pairs, the other all n; left
        // uninitialised (a std::vector would zero n pairs first: 16 MiB for a 1M row)
        const int64_t queue = j.k * 64 <= j.n ? j.k : j.n;
        const std::unique_ptr<TopKPair[]> scratch(new TopKPair[static_cast<size_t>(queue)]);
        torch_topk_rows<Fmt>(j.x, begin, end, j.n, j.k, j.largest, j.sorted, scratch.get(),
                             j.values, j.indices);
      } catch (const std::bad_alloc&) {
        j.out_of_memory = true;
      }
    };
    const int64_t tasks = (rows + job.rows_per_task - 1) / job.rows_per_task;
    run_tasks(ctx, rows * n, kElementsPerTask, static_cast<size_t>(tasks), run_task, &job);
    if (job.out_of_memory)
      ORT_CXX_API_THROW("TorchTopK: out of memory for a scratch row of " + std::to_string(n),
                        ORT_FAIL);
  }
};

}  // namespace

void AppendTorchTopKOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  // Same name, one kernel per X type: onnxruntime picks by the input's type.
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchTopKKernel<float, TopKF32>>(
      kOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchTopKKernel<Ort::BFloat16_t, TopKBF16>>(
      kOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchTopKKernel<Ort::Float16_t, TopKF16>>(
      kOp, "CPUExecutionProvider"));
}

}  // namespace csa
