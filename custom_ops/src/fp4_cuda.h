// Host-side launcher of the CUDA Fp4QuantDequant kernel (fp4_cuda.cu); no CUDA headers here.
#pragma once

#include <cstdint>
#include <string>

#include "fp4_quant.h"

namespace csa {
// `in`/`out` are device pointers of T = float or bfloat16 (Ort::BFloat16_t); `scales`
// may be null. Runs on `stream` (a cudaStream_t); returns an error message or "".
template <typename T>
std::string launch_fp4_round_trip(const T* in, T* out, float* scales, int64_t nblocks,
                                  int64_t block_size, ScaleFormat format, void* stream);
}  // namespace csa
