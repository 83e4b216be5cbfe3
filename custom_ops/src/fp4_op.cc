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

[[noreturn]] void fail(const std::string& message) {
  ORT_CXX_API_THROW("Fp4QuantDequant: " + message, ORT_INVALID_ARGUMENT);
}

// Whether the graph gives output `index` an OrtValue: an omitted output ("" or absent) has
// none, and Tensor::Allocate would dereference null. Allocates it (Allocate then reuses it).
bool has_output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& shape) {
  const OrtValue* value = Ort::KernelContext(ctx).GetOutput(index, shape);
  return value != nullptr;
}

// Attributes are checked once, when the session creates the kernel.
struct Fp4Attributes {
  int64_t block_size = 0;
  ScaleFormat format = ScaleFormat::kE8M0;

  explicit Fp4Attributes(const OrtKernelInfo* info) {
    require_node_io(info, "Fp4QuantDequant", 1, 1);  // Scale is optional
    Ort::ConstKernelInfo ki(info);
    try {
      block_size = ki.GetAttribute<int64_t>("block_size");
    } catch (const Ort::Exception&) {
      fail("attribute block_size (int) is required");
    }
    if (block_size <= 0) fail("block_size must be > 0, got " + std::to_string(block_size));
    std::string name;
    try {
      name = ki.GetAttribute<std::string>("scale_format");
    } catch (const Ort::Exception&) {
      fail("attribute scale_format (\"e8m0\" or \"e4m3\") is required");
    }
    if (name == "e8m0") {
      format = ScaleFormat::kE8M0;
    } else if (name == "e4m3") {
      format = ScaleFormat::kE4M3;
    } else {
      fail("unknown scale_format \"" + name + "\" (expected \"e8m0\" or \"e4m3\")");
    }
  }

  // Number of blocks in X, after checking the shape fits the block size.
  int64_t blocks(const std::vector<int64_t>& shape) const {
    if (shape.empty()) fail("X must have at least one dimension");
    const int64_t last = shape.back();
    if (last % block_size != 0) {
      fail("block_size " + std::to_string(block_size) + " does not divide the last dimension " +
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
  if (!has_output(ctx, 0, shape)) fail("output Y is required");
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
    // Below ~64K elements the thread hand-off costs more than it saves.
    if (nblocks * attrs.block_size < (1 << 16)) {
      for (int64_t b = 0; b < nblocks; ++b) run_block(&job, static_cast<size_t>(b));
    } else {
      Ort::KernelContext(ctx).ParallelFor(run_block, static_cast<size_t>(nblocks), 0, &job);
    }
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
  constexpr const char* kName = "Fp4QuantDequant";
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<Fp4CpuKernel<float>>(kName, "CPUExecutionProvider"));
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<Fp4CpuKernel<Ort::BFloat16_t>>(kName, "CPUExecutionProvider"));
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<Fp4CpuKernel<Ort::Float16_t>>(kName, "CPUExecutionProvider"));
#ifdef CSA_WITH_CUDA
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<Fp4CudaKernel<float>>(kName, "CUDAExecutionProvider"));
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<Fp4CudaKernel<Ort::BFloat16_t>>(kName, "CUDAExecutionProvider"));
#endif
}

}  // namespace csa
