// CUDA Fp8Linear: the scalar rule of fp8_linear.h. A thread block takes one row of X and
// 256 columns: its first 32 threads quantise up to 32 K blocks of the row into shared
// memory, then every thread walks those blocks in order for its column: the 32 products
// summed in double (exact in any order), rounded once to float, scaled and added in float
// with explicitly rounded operations (and --fmad=false for the file): the CPU kernel's bits
// (tests/test_cuda_kernels.py, run on an H200). Simple, not fast: see the README.
#include <cuda_runtime.h>

#include "fp8_linear.h"
#include "fp8_linear_cuda.h"

namespace csa {
namespace {

constexpr int kThreads = 256;
constexpr int kChunkBlocks = 32;  // K blocks quantised per pass (4 KiB of shared memory)

// onnxruntime's Cast float -> bfloat16 -> float (ort_cast.h's scalar form, bit for bit).
__device__ float cast_bf16(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    u = (u & 0x80000000u) | 0x7fc00000u;
  } else {
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  }
  return __uint_as_float(u);
}

__global__ void fp8_linear_kernel(const float* x, const uint8_t* w, const float* wscale,
                                  float* y, int64_t M, int64_t N, int64_t K, bool round_output,
                                  bool pairs16) {
  __shared__ float xq[kChunkBlocks * Fp8::kBlock];
  __shared__ float xs[kChunkBlocks];
  const int64_t KB = K / Fp8::kBlock;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    const float* row = x + m * K;
    float acc = 0.0f;
    for (int64_t kb0 = 0; kb0 < KB; kb0 += kChunkBlocks) {
      const int64_t blocks = KB - kb0 < kChunkBlocks ? KB - kb0 : kChunkBlocks;
      __syncthreads();  // the previous chunk is no longer read
      if (threadIdx.x < blocks) {
        const int64_t kb = kb0 + threadIdx.x;
        xs[threadIdx.x] = Fp8::quantize_block(row + kb * Fp8::kBlock,
                                              xq + threadIdx.x * Fp8::kBlock);
      }
      __syncthreads();
      if (n < N) {
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t k0 = (kb0 + b) * Fp8::kBlock;
          double dot = 0.0;
          for (int i = 0; i < Fp8::kBlock; ++i) {
            const uint8_t code = w[pairs16 ? Fp8::pairs16_offset(K, n, k0 + i) : n * K + k0 + i];
            dot = __dadd_rn(dot, __dmul_rn(static_cast<double>(xq[b * Fp8::kBlock + i]),
                                           static_cast<double>(Fp8::e4m3_value(code))));
          }
          acc = Fp8::accumulate(acc, __double2float_rn(dot), xs[b],
                                wscale[(n / Fp8::kBlock) * KB + kb0 + b]);
        }
      }
    }
    if (n < N) y[m * N + n] = round_output ? cast_bf16(acc) : acc;
  }
}

}  // namespace

std::string launch_fp8_linear(const float* x, const uint8_t* w, const float* wscale, float* y,
                              int64_t M, int64_t N, int64_t K, bool round_output, bool pairs16,
                              void* stream) {
  if (M == 0 || N == 0) return {};  // a launch of an empty grid is an error
  const int64_t col_blocks = (N + kThreads - 1) / kThreads;
  if (col_blocks > 0x7fffffff) return "too many columns for one launch";
  const unsigned rows = static_cast<unsigned>(M < 65535 ? M : 65535);
  fp8_linear_kernel<<<dim3(static_cast<unsigned>(col_blocks), rows), kThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(x, w, wscale, y, M, N, K, round_output,
                                                                 pairs16);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace csa
