// TorchRMSNorm (domain csa2onnx): Y = W * (X * rsqrt(mean(X^2) + epsilon)) along the last
// axis, float32, with the mean summed in torch's order (torch_rms_norm.h). Inputs X (float,
// [..., n], rank >= 1) and W (float or bfloat16, [n]); attributes epsilon (float, > 0) and
// round_output (int, default 0: 1 rounds Y through bfloat16 as the graph's Cast pair to
// bf16 and back would, where the reference rounds); output Y (float, X's shape).
#include "ort_api.h"

#include <exception>
#include <string>
#include <vector>

#include "element_types.h"
#include "kernel_support.h"
#include "ort_cast.h"
#include "torch_rms_norm.h"
#include "torch_rms_norm_op.h"

namespace csa {
namespace {

constexpr const char* kOp = "TorchRMSNorm";

template <typename WT>
struct TorchRMSNormKernel {
  float epsilon = 0.0f;
  bool round_output = false;

  TorchRMSNormKernel(const OrtApi*, const OrtKernelInfo* info) {
    require_node_io(info, kOp, 2, 1);
    epsilon = required_attribute<float>(info, kOp, "epsilon", "a float");
    if (!(epsilon > 0.0f)) fail(kOp, "epsilon must be > 0, got " + std::to_string(epsilon));
    const int64_t round =
        optional_attribute<int64_t>(info, kOp, "round_output", "an int").value_or(0);
    if (round != 0 && round != 1)
      fail(kOp, "round_output must be 0 or 1, got " + std::to_string(round));
    round_output = round == 1;
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<WT>& w, Ort::Custom::Tensor<float>& y) {
    return status_of([&] { Run(ctx, x, w, y); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
           const Ort::Custom::Tensor<WT>& w, Ort::Custom::Tensor<float>& y) {
    const std::vector<int64_t> shape = x.Shape();
    if (shape.empty()) fail(kOp, "X must have rank >= 1, got a scalar");
    const int64_t n = shape.back();
    const std::vector<int64_t> w_shape = w.Shape();
    if (w_shape.size() != 1 || w_shape[0] != n) {
      fail(kOp, "W must have shape [" + std::to_string(n) + "] (X's last dimension), got rank " +
                std::to_string(w_shape.size()) + (w_shape.size() == 1 ? " size " +
                std::to_string(w_shape[0]) : ""));
    }
    float* out = y.Allocate(shape);
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
    if (rows == 0 || n == 0) return;

    struct Job {
      const float* x;
      const WT* w;
      float* y;
      int64_t n;
      float eps;
      bool round_output;
      bool out_of_memory = false;
    } job{x.Data(), w.Data(), out, n, epsilon, round_output};
    auto run_row = [](void* data, size_t row) {
      Job& j = *static_cast<Job*>(data);
      try {  // no exception may escape into onnxruntime's thread pool
        std::vector<float> squares(static_cast<size_t>(j.n));
        const int64_t offset = static_cast<int64_t>(row) * j.n;
        float* y = j.y + offset;
        rms_norm_row(j.x + offset, j.n, [&j](int64_t i) { return to_float(j.w[i]); }, j.eps,
                     squares.data(), y);
        if (j.round_output)
          for (int64_t i = 0; i < j.n; ++i) y[i] = ort_cast::cast_bf16(y[i]);
      } catch (const std::bad_alloc&) {
        j.out_of_memory = true;
      }
    };
    run_tasks(ctx, rows * n, serial_below::kRmsNormElements, static_cast<size_t>(rows),
              run_row, &job);
    if (job.out_of_memory) ORT_CXX_API_THROW("TorchRMSNorm: out of memory", ORT_FAIL);
  }
};

}  // namespace

void AppendTorchRMSNormOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchRMSNormKernel<float>>(
      kOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchRMSNormKernel<Ort::BFloat16_t>>(
      kOp, "CPUExecutionProvider"));
}

}  // namespace csa
