// CUDA Fp4QuantDequant: one thread per block of `block_size` elements, the same scalar
// code as the CPU kernel (fp4_quant.h), so both are exact to the reference.
#include <cuda_runtime.h>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include "fp4_cuda.h"

namespace csa {
namespace {

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const Ort::BFloat16_t* p) { return bf16_bits_to_float(p->val); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(Ort::BFloat16_t* p, float v) { p->val = float_to_bf16_bits(v); }

template <typename T>
__global__ void fp4_round_trip_kernel(const T* in, T* out, float* scales, int64_t nblocks,
                                      int64_t block, ScaleFormat format) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const T* src = in + b * block;
  T* dst = out + b * block;
  float amax = 0.0f;
  for (int64_t i = 0; i < block; ++i) {
    const float a = fabsf(load(src + i));
    if (a != a) { amax = a; break; }
    amax = a > amax ? a : amax;
  }
  const float s = fp4_block_scale(amax, format);
  for (int64_t i = 0; i < block; ++i) store(dst + i, fp4_round_trip(load(src + i), s));
  if (scales != nullptr) scales[b] = s;
}

}  // namespace

template <typename T>
std::string launch_fp4_round_trip(const T* in, T* out, float* scales, int64_t nblocks,
                                  int64_t block_size, ScaleFormat format, void* stream) {
  constexpr int kThreads = 256;
  if (nblocks == 0) return {};  // a launch of an empty grid is an error
  const int64_t grid = (nblocks + kThreads - 1) / kThreads;
  if (grid > 0x7fffffff) return "too many blocks for one launch";
  fp4_round_trip_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0,
                             static_cast<cudaStream_t>(stream)>>>(in, out, scales, nblocks,
                                                                  block_size, format);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

template std::string launch_fp4_round_trip<float>(const float*, float*, float*, int64_t, int64_t,
                                                  ScaleFormat, void*);
template std::string launch_fp4_round_trip<Ort::BFloat16_t>(const Ort::BFloat16_t*,
                                                            Ort::BFloat16_t*, float*, int64_t,
                                                            int64_t, ScaleFormat, void*);

}  // namespace csa
