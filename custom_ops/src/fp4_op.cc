// Fp4QuantDequant (domain csa2onnx): the fp4 round trip of fp4_quant.h over blocks of
// `block_size` along the last axis. Inputs X (float, bfloat16, float16); attributes
// block_size (> 0, divides the last dimension) and scale_format ("e8m0" | "e4m3");
// outputs Y (X's shape and type) and, optionally, Scale (float, [..., last / block_size]).
#include "ort_api.h"

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "element_types.h"
#include "fp4_op.h"
#include "fp4_quant.h"
#include "kernel_support.h"
#ifdef CSA_WITH_CUDA
#include "fp4_cuda.h"
#endif

namespace csa {
namespace {

constexpr const char* kOp = "Fp4QuantDequant";

// Attributes are checked once, when the session creates the kernel.
struct Fp4Attributes {
  int64_t block_size = 0;
  ScaleFormat format = ScaleFormat::kE8M0;

  explicit Fp4Attributes(const OrtKernelInfo* info) {
    require_node_io(info, kOp, 1, 1);  // Scale is optional
    block_size = required_attribute<int64_t>(info, kOp, "block_size", "an int");
    if (block_size <= 0) fail(kOp, "block_size must be > 0, got " + std::to_string(block_size));
    const std::string name = required_attribute<std::string>(
        info, kOp, "scale_format", "a string, \"e8m0\" or \"e4m3\"");
    if (name == "e8m0") {
      format = ScaleFormat::kE8M0;
    } else if (name == "e4m3") {
      format = ScaleFormat::kE4M3;
    } else {
      fail(kOp, "unknown scale_format \"" + name + "\" (expected \"e8m0\" or \"e4m3\")");
    }
  }

  // Number of blocks in X, after checking the shape fits the block size.
  int64_t blocks(const std::vector<int64_t>& shape) const {
    if (shape.empty()) fail(kOp, "X must have at least one dimension");
    const int64_t last = shape.back();
    if (last % block_size != 0) {
      fail(kOp, "block_size " + std::to_string(block_size) +
                    " does not divide the last dimension " +
                std::to_string(last));
    }
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    return count / block_size;
  }

  std::vector<int64_t> scale_shape(std::vector<int64_t> shape) const {
    shape.back() /= block_size;
    return shape;
  }
};

// Y, and Scale's storage when the graph asks for it (else null).
template <typename T>
T* allocate_outputs(OrtKernelContext* ctx, const Fp4Attributes& attrs,
                    const std::vector<int64_t>& shape, Ort::Custom::Tensor<T>& y,
                    std::optional<Ort::Custom::Tensor<float>*> scale, float** scales) {
  if (!has_output(ctx, 0, shape)) fail(kOp, "output Y is required");
  const std::vector<int64_t> scale_shape = attrs.scale_shape(shape);
  *scales = scale.has_value() && has_output(ctx, 1, scale_shape) ? (*scale)->Allocate(scale_shape)
                                                                  : nullptr;
  return y.Allocate(shape);
}

template <typename T>
struct Fp4CpuKernel {
  Fp4Attributes attrs;
  Fp4CpuKernel(const OrtApi*, const OrtKernelInfo* info) : attrs(info) {}

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<T>& x,
                      Ort::Custom::Tensor<T>& y, std::optional<Ort::Custom::Tensor<float>*> scale) {
    return status_of([&] { Run(ctx, x, y, scale); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<T>& x, Ort::Custom::Tensor<T>& y,
           std::optional<Ort::Custom::Tensor<float>*> scale) {
    const std::vector<int64_t> shape = x.Shape();
    const int64_t nblocks = attrs.blocks(shape);
    const T* in = x.Data();
    float* scales = nullptr;
    T* out = allocate_outputs(ctx, attrs, shape, y, scale, &scales);
    if (nblocks == 0) return;

    struct Job {
      const T* in;
      T* out;
      float* scales;
      int64_t block;
      ScaleFormat format;
    } job{in, out, scales, attrs.block_size, attrs.format};
    auto run_block = [](void* data, size_t b) {
      const Job& j = *static_cast<const Job*>(data);
      const T* src = j.in + static_cast<int64_t>(b) * j.block;
      T* dst = j.out + static_cast<int64_t>(b) * j.block;
      float amax = 0.0f;
      for (int64_t i = 0; i < j.block; ++i) {
        const float a = fabsf(to_float(src[i]));
        if (a != a) { amax = a; break; }  // torch's amax propagates NaN
        amax = a > amax ? a : amax;
      }
      const float s = fp4_block_scale(amax, j.format);
      for (int64_t i = 0; i < j.block; ++i) dst[i] = from_float<T>(fp4_round_trip(to_float(src[i]), s));
      if (j.scales != nullptr) j.scales[b] = s;
    };
    run_tasks(ctx, nblocks * attrs.block_size, serial_below::kElements,
              static_cast<size_t>(nblocks), run_block, &job);
  }
};

#ifdef CSA_WITH_CUDA
template <typename T>
struct Fp4CudaKernel {
  Fp4Attributes attrs;
  Fp4CudaKernel(const OrtApi*, const OrtKernelInfo* info) : attrs(info) {}

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<T>& x,
                      Ort::Custom::Tensor<T>& y, std::optional<Ort::Custom::Tensor<float>*> scale) {
    return status_of([&] { Run(ctx, x, y, scale); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<T>& x, Ort::Custom::Tensor<T>& y,
           std::optional<Ort::Custom::Tensor<float>*> scale) {
    const std::vector<int64_t> shape = x.Shape();
    const int64_t nblocks = attrs.blocks(shape);
    float* scales = nullptr;
    T* out = allocate_outputs(ctx, attrs, shape, y, scale, &scales);
    if (nblocks == 0) return;
    void* stream = Ort::KernelContext(ctx).GetGPUComputeStream();
    const std::string error = launch_fp4_round_trip(x.Data(), out, scales, nblocks,
                                                    attrs.block_size, attrs.format, stream);
    if (!error.empty()) ORT_CXX_API_THROW("Fp4QuantDequant (CUDA): " + error, ORT_RUNTIME_EXCEPTION);
  }
};
#endif

}  // namespace

void AppendFp4Ops(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<Fp4CpuKernel<float>>(kOp, "CPUExecutionProvider"));
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<Fp4CpuKernel<Ort::BFloat16_t>>(kOp, "CPUExecutionProvider"));
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<Fp4CpuKernel<Ort::Float16_t>>(kOp, "CPUExecutionProvider"));
#ifdef CSA_WITH_CUDA
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<Fp4CudaKernel<float>>(kOp, "CUDAExecutionProvider"));
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<Fp4CudaKernel<Ort::BFloat16_t>>(kOp, "CUDAExecutionProvider"));
#endif
}

}  // namespace csa
