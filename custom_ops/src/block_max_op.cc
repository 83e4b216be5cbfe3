// BlockMax (domain csa2onnx): the max of each block of block_size values on the last axis,
// the last block of a row shorter when block_size does not divide it: select_candidate_blocks'
// block scores (reference.md: the row padded with -inf to whole blocks, then amax), without
// the padded copy of the [b, s, T] scores (1 GiB for a 256-token prefill chunk at 1M keys).
// Input X (float [..., T], rank >= 1), attribute block_size (int >= 1); output Y (float
// [..., ceil(T / block_size)]). Y is NaN (0x7FC00000) for a block holding a NaN (torch's amax
// propagates it, and its topk then picks that block as the largest, unkept), else the largest
// value with +0 above -0 (IEEE 754-2019 maximum): defined whatever the order of the
// comparisons, so any vector or thread split gives the same bits. An empty block cannot occur
// (T = 0 gives Y [..., 0]).
// CSA_BLOCK_MAX_ISA (or CSA2ONNX_ISA) forces a path: "avx512" (blocks of 8, the released
// candidate_block_size, two to a vector; the default on such a CPU) or "scalar" (any block
// size, the other paths' rest); the same bits.
#include "ort_api.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "block_max.h"
#include "block_max_op.h"
#include "kernel_support.h"
#include "simd.h"

#ifdef CSA_X86
#include <immintrin.h>
#endif

namespace csa {
namespace {

constexpr const char* kOp = "BlockMax";


struct BlockMaxKernel {
  int64_t block;
  bool vector8;  // blocks of 8 on AVX-512

  BlockMaxKernel(const OrtApi*, const OrtKernelInfo* info)
      : block(required_attribute<int64_t>(info, kOp, "block_size", "an int")) {
    const Isa isa = select_isa("CSA_BLOCK_MAX_ISA");
    vector8 = block == 8 && (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16);
    require_node_io(info, kOp, 1, 1);
    if (block < 1) fail(kOp, "block_size must be >= 1, got " + std::to_string(block));
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      Ort::Custom::Tensor<float>& y) {
    return status_of([&] { Run(ctx, x, y); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
           Ort::Custom::Tensor<float>& y) const {
    std::vector<int64_t> shape = x.Shape();
    if (shape.empty()) fail(kOp, "X must have rank >= 1 (blocks on the last axis), got a scalar");
    const int64_t width = shape.back();
    const int64_t blocks = width / block + (width % block != 0 ? 1 : 0);
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    shape.back() = blocks;
    static_assert(sizeof(float) == sizeof(uint32_t), "floats read as their bits");
    const auto* in = reinterpret_cast<const uint32_t*>(x.Data());
    auto* out = reinterpret_cast<uint32_t*>(y.Allocate(shape));
    if (rows == 0 || blocks == 0) return;
    // in parallel over (row, block) pairs: a decode step is one row of up to a million keys
    // (a block's work: at most `width` values, however large block_size is)
    run_row_chunks(ctx, rows * blocks, std::min(block, width), [&](int64_t first, int64_t n) {
      while (n > 0) {
        const int64_t row = first / blocks, j = first % blocks;
        const int64_t count = n < blocks - j ? n : blocks - j;
        const uint32_t* row_in = in + row * width;
        uint32_t* row_out = out + row * blocks;
        int64_t done = 0;
#ifdef CSA_X86
        if (vector8) {  // whole pairs of whole blocks
          const int64_t whole = std::min(j + count, width / 8) - j;
          if (whole >= 2) {
            block_max::pairs_of_8(row_in + j * 8, whole / 2, row_out + j);
            done = whole / 2 * 2;
          }
        }
#endif
        block_max::blocks_of_row(row_in, width, block, j + done, count - done, row_out);
        first += count;
        n -= count;
      }
    });
  }
};

}  // namespace

void AppendBlockMaxOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<BlockMaxKernel>(kOp, "CPUExecutionProvider"));
}

}  // namespace csa
