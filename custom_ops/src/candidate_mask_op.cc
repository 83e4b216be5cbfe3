// CandidateMask (domain csa2onnx): select_candidate_blocks' mask from the blocks it picked,
// written once: Mask[..., t] is true iff block t // block_size is one of the row's Blocks
// whose Keep is true (reference.md: the picks' keep marks scattered into zeros [..., nb],
// each position inheriting its block's mark), without the [..., nb] marks, their block_size
// copies and the transpose and slice the standard ops need (a 256-token prefill chunk at 1M
// keys: four 256 MiB tensors).
// Inputs Blocks (int64 [..., k]: each row's picked blocks, distinct, as top-k's indices are),
// Keep (bool, Blocks' shape), Width (int64, one element: T >= 0); attribute block_size (int
// >= 1); output Mask (bool [..., T]). A block outside [0, ceil(T / block_size)) or repeated
// in its row is an error: the scatter it replaces has no meaning for either.
#include "ort_api.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "candidate_mask_op.h"
#include "kernel_support.h"

namespace csa {
namespace {

constexpr const char* kOp = "CandidateMask";

struct CandidateMaskKernel {
  int64_t block;

  CandidateMaskKernel(const OrtApi*, const OrtKernelInfo* info)
      : block(required_attribute<int64_t>(info, kOp, "block_size", "an int")) {
    require_node_io(info, kOp, 3, 1);
    if (block < 1) fail(kOp, "block_size must be >= 1, got " + std::to_string(block));
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<int64_t>& blocks,
                      const Ort::Custom::Tensor<bool>& keep,
                      const Ort::Custom::Tensor<int64_t>& width,
                      Ort::Custom::Tensor<bool>& mask) {
    return status_of([&] { Run(ctx, blocks, keep, width, mask); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<int64_t>& blocks,
           const Ort::Custom::Tensor<bool>& keep, const Ort::Custom::Tensor<int64_t>& width,
           Ort::Custom::Tensor<bool>& mask) const {
    std::vector<int64_t> shape = blocks.Shape();
    if (shape.empty())
      fail(kOp, "Blocks must have rank >= 1 (blocks on the last axis), got a scalar");
    if (keep.Shape() != shape)
      fail(kOp, "Keep must have Blocks' shape " + shape_string(shape) + ", got " +
                    shape_string(keep.Shape()));
    if (width.NumberOfElement() != 1)
      fail(kOp, "Width must hold one element, got shape " + shape_string(width.Shape()));
    const int64_t t = width.Data()[0];
    if (t < 0) fail(kOp, "Width must be >= 0, got " + std::to_string(t));
    const int64_t n_blocks = t / block + (t % block != 0 ? 1 : 0), k = shape.back();
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    const int64_t* picked = blocks.Data();
    static_assert(sizeof(bool) == 1, "bool tensors are read and written as bytes");
    const auto* kept = reinterpret_cast<const uint8_t*>(keep.Data());

    // Every index checked before anything is written: in range, and once per row (a row's
    // marks are set, then cleared again by the same indices).
    std::vector<uint8_t> seen(static_cast<size_t>(n_blocks), 0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t* row = picked + r * k;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t b = row[j];
        if (b < 0 || b >= n_blocks)
          fail(kOp, "Blocks[" + std::to_string(r) + ", " + std::to_string(j) + "] = " +
                        std::to_string(b) + " is not a block of Width " + std::to_string(t) +
                        " (blocks of " + std::to_string(block) + ": [0, " +
                        std::to_string(n_blocks) + "))");
        if (seen[b] != 0)
          fail(kOp, "block " + std::to_string(b) + " appears twice in row " + std::to_string(r) +
                        " of Blocks (a row's picks are distinct)");
        seen[b] = 1;
      }
      for (int64_t j = 0; j < k; ++j) seen[row[j]] = 0;
    }

    shape.back() = t;
    auto* out = reinterpret_cast<uint8_t*>(mask.Allocate(shape));
    if (rows == 0 || t == 0) return;
    run_row_chunks(ctx, rows, t, [&](int64_t first, int64_t n) {
      for (int64_t r = first; r < first + n; ++r) {
        uint8_t* row = out + r * t;
        std::memset(row, 0, static_cast<size_t>(t));
        for (int64_t j = 0; j < k; ++j) {
          if (kept[r * k + j] == 0) continue;
          const int64_t lo = picked[r * k + j] * block;
          std::memset(row + lo, 1, static_cast<size_t>(std::min(block, t - lo)));
        }
      }
    });
  }
};

}  // namespace

void AppendCandidateMaskOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<CandidateMaskKernel>(kOp, "CPUExecutionProvider"));
}

}  // namespace csa
