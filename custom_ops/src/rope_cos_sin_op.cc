// RoPE's cos and sin at given positions, as the reference's freqs_cis rows hold them
// (reference.md "freqs_cis"): angle = f32(pos) * f_i, one float32 multiply, then the C
// library's cosf / sinf of it, which is what torch.outer + torch.polar evaluate on the CPU.
// Computed per call, so a model holds no [max_seq_len, rd/2] tables: its memory does not
// grow with the maximum context.
//
// RopeCosSin (domain csa2onnx): input Positions (int64, any shape, each in
// [0, max_positions)); attributes inverse_frequencies (floats, the f_i, finite, at least
// one) and max_positions (int, > 0: the reference's table has max_seq_len rows, and a
// position past it is an error there too); outputs Cos and Sin (float,
// Positions' shape + [len(inverse_frequencies)]).
//
// cosf / sinf come from the process's C library, as torch's do: on the same machine they
// are torch's bits. (glibc picks an FMA or an SSE2 build of them by the CPU; the two differ
// on a few inputs, README "The custom ops".) The float(pos) conversion rounds to nearest
// as torch's int64 -> float32 promotion does (exact below 2^24).
//
// csa2onnx_cos_sin: the same cosf / sinf over given float32 angles, through ctypes, for the
// tables a --portable artifact keeps (custom_ops/library.py libm_cos_sin).
#include "ort_api.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernel_support.h"
#include "rope_cos_sin_op.h"

extern "C" __attribute__((visibility("default"))) void csa2onnx_cos_sin(const float* angles,
                                                                        int64_t n, float* cos_out,
                                                                        float* sin_out) {
  for (int64_t i = 0; i < n; ++i) {
    cos_out[i] = cosf(angles[i]);
    sin_out[i] = sinf(angles[i]);
  }
}

namespace csa {
namespace {

constexpr const char* kOp = "RopeCosSin";

struct RopeCosSinKernel {
  std::vector<float> freqs;
  int64_t max_positions = 0;

  RopeCosSinKernel(const OrtApi*, const OrtKernelInfo* info) {
    require_node_io(info, kOp, 1, 2);
    freqs = required_attribute<std::vector<float>>(info, kOp, "inverse_frequencies", "floats");
    if (freqs.empty()) fail(kOp, "inverse_frequencies must hold at least one value");
    for (size_t i = 0; i < freqs.size(); ++i) {
      if (!std::isfinite(freqs[i])) {
        fail(kOp, "inverse_frequencies[" + std::to_string(i) + "] is not finite (" +
                  std::to_string(freqs[i]) + ")");
      }
    }
    max_positions = required_attribute<int64_t>(info, kOp, "max_positions", "an int");
    if (max_positions <= 0)
      fail(kOp, "max_positions must be > 0, got " + std::to_string(max_positions));
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<int64_t>& positions,
                      Ort::Custom::Tensor<float>& cos, Ort::Custom::Tensor<float>& sin) {
    return status_of([&] { Run(ctx, positions, cos, sin); });
  }

  struct Job {
    const int64_t* positions;
    const float* freqs;
    int64_t n;
    float* cos;
    float* sin;
  };

  static void Row(void* data, size_t row) {
    const Job& j = *static_cast<const Job*>(data);
    // One rounding from int64, one float32 multiply: torch.outer's promoted product.
    const float pos = static_cast<float>(j.positions[row]);
    float* c = j.cos + static_cast<int64_t>(row) * j.n;
    float* s = j.sin + static_cast<int64_t>(row) * j.n;
    for (int64_t i = 0; i < j.n; ++i) {
      const float angle = pos * j.freqs[i];
      c[i] = cosf(angle);
      s[i] = sinf(angle);
    }
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<int64_t>& positions,
           Ort::Custom::Tensor<float>& cos, Ort::Custom::Tensor<float>& sin) const {
    std::vector<int64_t> shape = positions.Shape();
    const int64_t rows = positions.NumberOfElement();
    const int64_t* pos = rows > 0 ? positions.Data() : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      if (pos[r] < 0 || pos[r] >= max_positions) {
        fail(kOp, "position " + std::to_string(pos[r]) + " (element " + std::to_string(r) + " of " +
                  shape_string(shape) + ") is outside 0.." + std::to_string(max_positions - 1) +
                  " (max_positions)");
      }
    }
    const int64_t n = static_cast<int64_t>(freqs.size());
    shape.push_back(n);
    Job job{pos, freqs.data(), n, cos.Allocate(shape), sin.Allocate(shape)};
    if (rows == 0) return;
    run_tasks(ctx, rows * n, serial_below::kAngles, static_cast<size_t>(rows), Row, &job);
  }
};

}  // namespace

void AppendRopeCosSinOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<RopeCosSinKernel>(kOp, "CPUExecutionProvider"));
}

}  // namespace csa
