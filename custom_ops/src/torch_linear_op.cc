// TorchLinear (domain csa2onnx): Y = X @ W^T with every output summed in the order torch
// 2.13 CPU's F.linear uses (torch_linear.h), so that Y matches the reference bit for bit
// where MLAS's MatMul would differ in the last bit of ~0.01% of the outputs.
// Inputs X (float, [..., K], rank >= 1) and W (float or bfloat16, [N, K]); output Y (float,
// [..., N]); no rounding to bf16 inside (the graph rounds where the reference does).
//
// W is packed into panels of 64 columns ([K][64], zero-padded, bf16 kept as bf16) once when
// it is a constant initializer, else on every call. A tile of a few rows x 64 (AVX-512) or
// 32 (AVX2) columns walks k in the order's sequence with the accumulators in registers,
// vectorised over the columns: the order per output is the same whatever the tile or the
// instruction set, so every path gives the same bits (fmaf is exact everywhere; the
// default build calls libm's). This file is compiled with -ffp-contract=off: the compiler
// must never fuse a multiply and an add that the order keeps apart.
//
// CSA_TORCH_LINEAR_ISA (or CSA2ONNX_ISA; read when a session creates the kernel) forces a
// path for tests: "avx512", "avx2", "scalar" (the tiles without SIMD) or "reference"
// (reference_dot per output, single-threaded).
#include "ort_api.h"

#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "kernel_support.h"
#include "torch_linear.h"
#include "torch_linear_op.h"
#include "simd.h"

#define CSA_INLINE __attribute__((always_inline)) inline

namespace csa {
namespace {

using torch_linear::Order;
using torch_linear::Plan;

[[noreturn]] void fail(const std::string& message) {
  ORT_CXX_API_THROW("TorchLinear: " + message, ORT_INVALID_ARGUMENT);
}

constexpr int64_t kPanel = 64;     // columns per packed panel
constexpr int64_t kMaxRows = 48;   // rows per task (a multiple of every tile height)
constexpr int64_t kParallelWork = int64_t{1} << 17;  // M*N*K below which one thread runs it

// W packed as ceil(N/64) panels of [K][64] (storage S: uint16_t bf16 bits, or float).
template <typename S>
struct PackedW {
  int64_t n = -1, k = -1;
  std::vector<S> data;

  void pack(const S* w, int64_t N, int64_t K) {
    n = N;
    k = K;
    const int64_t panels = (N + kPanel - 1) / kPanel;
    data.assign(static_cast<size_t>(panels * K * kPanel), S{});
    for (int64_t col = 0; col < N; ++col) {
      S* dst = data.data() + (col / kPanel) * K * kPanel + col % kPanel;
      const S* src = w + col * K;
      for (int64_t kk = 0; kk < K; ++kk) dst[kk * kPanel] = src[kk];
    }
  }
};

// ---- tiles: plain loops, inlined into each instruction-set wrapper and vectorised there ----

template <int MR, int NT>
CSA_INLINE void seq_step(float (&acc)[MR][NT], const float* x, int64_t ldx, const float* wk,
                         int64_t k) {
  for (int m = 0; m < MR; ++m) {
    const float xv = x[m * ldx + k];
#pragma GCC ivdep
    for (int j = 0; j < NT; ++j) acc[m][j] = __builtin_fmaf(xv, wk[j], acc[m][j]);
  }
}

// bf16 weights: widened once per k (a shift), then shared by the tile's rows.
template <int MR, int NT>
CSA_INLINE void seq_step(float (&acc)[MR][NT], const float* x, int64_t ldx, const uint16_t* wk,
                         int64_t k) {
  float wf[NT];
#pragma GCC ivdep
  for (int j = 0; j < NT; ++j) wf[j] = torch_linear::bf16_to_float(wk[j]);
  seq_step<MR, NT>(acc, x, ldx, wf, k);
}

// One chunk [k0, k1) of kOneDnnPairs / kMklBlocked for rows [0, MR) x columns [0, NT):
// fmaf chains from 0 in the order's sequence, then out += chunk sum.
template <typename S, bool kPairs, int MR, int NT>
CSA_INLINE void seq_tile(const float* x, int64_t ldx, const S* panel, int64_t k0, int64_t k1,
                         float* out) {
  float acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = 0.0f;
  int64_t k = k0;
  if (kPairs) {
    for (; k + 1 < k1; k += 2) {
      seq_step<MR, NT>(acc, x, ldx, panel + (k + 1) * kPanel, k + 1);
      seq_step<MR, NT>(acc, x, ldx, panel + k * kPanel, k);
    }
  }
  for (; k < k1; ++k) seq_step<MR, NT>(acc, x, ldx, panel + k * kPanel, k);
  for (int m = 0; m < MR; ++m)
#pragma GCC ivdep
    for (int j = 0; j < NT; ++j) out[m * kPanel + j] = out[m * kPanel + j] + acc[m][j];
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

// ---- tasks: a block of up to kMaxRows rows x one panel ----

struct Job {
  Plan plan;
  const float* x;
  const void* panels;  // PackedW data
  float* y;
  int64_t M, N, K;
  int64_t row_blocks, n_panels;
};

template <typename S, bool kPairs, int MR, int NT>
CSA_INLINE void seq_rows(const Job& j, const S* panel, int64_t m0, int64_t rows, float* buf) {
  for (int64_t k0 = 0; k0 < j.K; k0 += j.plan.chunk) {
    const int64_t k1 = k0 + j.plan.chunk < j.K ? k0 + j.plan.chunk : j.K;
    for (int64_t c = 0; c < kPanel; c += NT) {
      int64_t r = 0;
      for (; r + MR <= rows; r += MR)
        seq_tile<S, kPairs, MR, NT>(j.x + (m0 + r) * j.K, j.K, panel + c, k0, k1,
                                    buf + r * kPanel + c);
      for (; r < rows; ++r)  // leftover rows, one at a time
        seq_tile<S, kPairs, 1, NT>(j.x + (m0 + r) * j.K, j.K, panel + c, k0, k1,
                                   buf + r * kPanel + c);
    }
  }
}

template <int MR, int NT, int LANES_NT>
CSA_INLINE void run_task(const Job& j, size_t task, bool w_bf16) {
  const int64_t p = static_cast<int64_t>(task) / j.row_blocks;
  const int64_t m0 = (static_cast<int64_t>(task) % j.row_blocks) * kMaxRows;
  const int64_t rows = j.M - m0 < kMaxRows ? j.M - m0 : kMaxRows;
  alignas(64) float buf[kMaxRows * kPanel];
  for (int64_t i = 0; i < rows * kPanel; ++i) buf[i] = 0.0f;
  const int64_t offset = p * j.K * kPanel;
  // plan_linear gives bf16 weights kOneDnnPairs (kTorchDot runs elsewhere) and float
  // weights kMklBlocked or kMklLanes.
  if (w_bf16) {
    seq_rows<uint16_t, true, MR, NT>(j, static_cast<const uint16_t*>(j.panels) + offset, m0,
                                     rows, buf);
  } else if (j.plan.order == Order::kMklBlocked) {
    seq_rows<float, false, MR, NT>(j, static_cast<const float*>(j.panels) + offset, m0, rows,
                                   buf);
  } else {
    const float* panel = static_cast<const float*>(j.panels) + offset;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < kPanel; c += LANES_NT)
        lanes_tile<LANES_NT>(j.x + (m0 + r) * j.K, panel + c, j.K, j.plan.head,
                             buf + r * kPanel + c);
  }
  const int64_t n0 = p * kPanel;
  const int64_t cols = j.N - n0 < kPanel ? j.N - n0 : kPanel;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) j.y[(m0 + r) * j.N + n0 + c] = buf[r * kPanel + c];
}

// Instruction-set wrappers (tiles sized so the accumulators stay in registers: AVX-512
// 6 rows x 4 zmm, AVX2 2 rows x 4 ymm; the 4-lane path 4 x 4 zmm or 4 x 4 ymm).
void task_scalar(const Job& j, size_t task, bool w_bf16) { run_task<1, 64, 64>(j, task, w_bf16); }
#ifdef CSA_X86
CSA_TARGET_AVX512 void task_avx512(const Job& j, size_t task, bool w_bf16) {
  run_task<6, 64, 64>(j, task, w_bf16);
}
CSA_TARGET_AVX2 void task_avx2(const Job& j, size_t task, bool w_bf16) {
  run_task<2, 32, 32>(j, task, w_bf16);
}
#endif

Isa select_isa() { return csa::select_isa("CSA_TORCH_LINEAR_ISA", /*has_reference=*/true); }

// OrtT: the onnxruntime type of W (float or BFloat16_t); S: its storage.
template <typename OrtT, typename S>
struct TorchLinearKernel {
  static constexpr bool kBf16 = sizeof(S) == 2;
  Isa isa;
  PackedW<S> constant_w;  // packed once when W is a constant initializer

  TorchLinearKernel(const OrtApi*, const OrtKernelInfo* info) : isa(select_isa()) {
    require_node_io(info, "TorchLinear", 2, 1);
    int is_constant = 0;
    Ort::ConstValue w{nullptr};
    try {
      w = Ort::ConstKernelInfo(info).GetTensorConstantInput(1, &is_constant);
    } catch (const Ort::Exception&) {
      is_constant = 0;  // not available: pack on every call
    }
    if (!is_constant || w == nullptr) return;
    const std::vector<int64_t> shape = w.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2 || shape[0] < 0 || shape[1] < 0) return;  // Compute reports it
    constant_w.pack(reinterpret_cast<const S*>(w.GetTensorRawData()), shape[0], shape[1]);
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<OrtT>& w, Ort::Custom::Tensor<float>& y) {
    return status_of([&] { Run(ctx, x, w, y); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
           const Ort::Custom::Tensor<OrtT>& w, Ort::Custom::Tensor<float>& y) const {
    const std::vector<int64_t> x_shape = x.Shape();
    const std::vector<int64_t> w_shape = w.Shape();
    if (x_shape.empty()) fail("X must have rank >= 1, got a scalar");
    if (w_shape.size() != 2)
      fail("W must be [N, K] (rank 2), got shape " + shape_string(w_shape));
    const int64_t N = w_shape[0], K = w_shape[1];
    if (x_shape.back() != K) {
      fail("the last dimension of X (" + std::to_string(x_shape.back()) +
           ") must equal K, the second dimension of W (" + std::to_string(K) + "); X shape " +
           shape_string(x_shape) + ", W shape " + shape_string(w_shape));
    }
    int64_t M = 1;
    for (size_t d = 0; d + 1 < x_shape.size(); ++d) M *= x_shape[d];
    std::vector<int64_t> y_shape = x_shape;
    y_shape.back() = N;
    float* out = y.Allocate(y_shape);
    if (M == 0 || N == 0) return;
    if (K == 0) {
      for (int64_t i = 0; i < M * N; ++i) out[i] = 0.0f;
      return;
    }

    const Plan plan = torch_linear::plan_linear(kBf16, M, N, K);
    const float* xd = x.Data();
    const S* wd = reinterpret_cast<const S*>(w.Data());
    if (isa == Isa::kReference || plan.order == Order::kTorchDot) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n)
          out[m * N + n] = torch_linear::reference_dot(plan, xd + m * K, wd + n * K, K);
      return;
    }

    PackedW<S> per_call;
    const PackedW<S>* packed = &constant_w;
    if (constant_w.n != N || constant_w.k != K) {
      per_call.pack(wd, N, K);
      packed = &per_call;
    }
    Job job{plan, xd, packed->data.data(), out, M, N, K, (M + kMaxRows - 1) / kMaxRows,
            (N + kPanel - 1) / kPanel};
    struct Call {
      const Job* job;
      void (*task)(const Job&, size_t, bool);
    } call{&job, task_scalar};
#ifdef CSA_X86
    if (isa == Isa::kAvx512) call.task = task_avx512;
    if (isa == Isa::kAvx2) call.task = task_avx2;
#endif
    // Tasks only compute into memory that exists; nothing in them can throw.
    auto run = [](void* data, size_t t) {
      const Call& c = *static_cast<const Call*>(data);
      c.task(*c.job, t, kBf16);
    };
    const int64_t tasks = job.row_blocks * job.n_panels;
    if (tasks == 1 || M * N * K < kParallelWork) {
      for (int64_t t = 0; t < tasks; ++t) run(&call, static_cast<size_t>(t));
    } else {
      Ort::KernelContext(ctx).ParallelFor(run, static_cast<size_t>(tasks), 0, &call);
    }
  }
};

}  // namespace

void AppendTorchLinearOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  // Same name, one kernel per W type: onnxruntime picks by the input's type.
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchLinearKernel<float, float>>(
      "TorchLinear", "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TorchLinearKernel<Ort::BFloat16_t, uint16_t>>(
      "TorchLinear", "CPUExecutionProvider"));
}

}  // namespace csa
