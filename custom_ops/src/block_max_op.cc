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

using block_max::order_key;

#ifdef CSA_X86
// Pairs of whole blocks of 8 from x on AVX-512, one pair a vector: the order keys' max by
// three swaps within each half (128-bit lanes, 64-bit halves, neighbours), a NaN by a compare.
CSA_TARGET_AVX512 void block_maxes_8(const uint32_t* x, int64_t pairs, uint32_t* y) {
  for (int64_t p = 0; p < pairs; ++p) {
    constexpr __mmask16 kAll = 0xFFFF;
    const __m512i b = _mm512_loadu_si512(x + 16 * p);
    // order_key. The masked forms with every lane set: the plain ones pass GCC 12 an
    // "undefined" source that it then warns about
    const __m512i key = _mm512_xor_si512(
        b, _mm512_maskz_srli_epi32(kAll, _mm512_maskz_srai_epi32(kAll, b, 31), 1));
    __m512i m = _mm512_maskz_max_epi32(
        kAll, key, _mm512_maskz_shuffle_i32x4(kAll, key, key, _MM_SHUFFLE(2, 3, 0, 1)));
    m = _mm512_maskz_max_epi32(kAll, m, _mm512_maskz_shuffle_epi32(kAll, m, _MM_PERM_BADC));
    m = _mm512_maskz_max_epi32(kAll, m, _mm512_maskz_shuffle_epi32(kAll, m, _MM_PERM_CDAB));
    const __m512 v = _mm512_castsi512_ps(b);
    const unsigned nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const int32_t first = _mm512_cvtsi512_si32(m);
    const int32_t second = _mm_cvtsi128_si32(_mm512_maskz_extracti32x4_epi32(0xF, m, 2));
    y[2 * p] = (nan & 0xFFu) != 0 ? 0x7FC00000u : static_cast<uint32_t>(order_key(
                                                      static_cast<uint32_t>(first)));
    y[2 * p + 1] = (nan >> 8) != 0 ? 0x7FC00000u : static_cast<uint32_t>(order_key(
                                                       static_cast<uint32_t>(second)));
  }
}
#endif

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
            block_maxes_8(row_in + j * 8, whole / 2, row_out + j);
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
