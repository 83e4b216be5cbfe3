// Host-side launcher of the CUDA Fp8Linear kernel (fp8_linear_cuda.cu); no CUDA headers here.
#pragma once

#include <cstdint>
#include <string>

namespace csa {
// x [M, K] float, w [N, K] e4m3fn codes, wscale [ceil(N/32), K/32] float, y [M, N] float:
// device pointers; shapes already checked (K % 32 == 0); `pairs16`: w in that layout
// (fp8_linear.h, N % 16 == 0) instead of [N, K]. `round_output`: y through bfloat16
// as onnxruntime's Cast pair (ort_cast.h). Runs on `stream` (a cudaStream_t); returns an
// error message or "".
std::string launch_fp8_linear(const float* x, const uint8_t* w, const float* wscale, float* y,
                              int64_t M, int64_t N, int64_t K, bool round_output, bool pairs16,
                              void* stream);
}  // namespace csa
