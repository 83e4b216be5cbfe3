// Test-only C entry points around the CUDA launchers of custom_ops/src (fp8_linear_cuda.cu,
// fp4_cuda.cu), so tests can run those kernels on a GPU without a CUDA build of
// onnxruntime: host arrays in, device copies, one launch (or `reps` timed launches), host
// arrays out. Every CUDA call is checked; a failure returns nonzero with the message in
// `err`. Built by tests/test_cuda_kernels.py with nvcc, each .cu with its library flags.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include "fp4_cuda.h"
#include "fp8_linear_cuda.h"

namespace {

struct Failed {
  std::string what;
};

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Failed{std::string(what) + ": " + cudaGetErrorString(e)};
}

void check_launch(const std::string& error, const char* what) {
  if (!error.empty()) throw Failed{std::string(what) + ": " + error};
  check(cudaGetLastError(), what);
}

// A device buffer freed on every path.
struct Buffer {
  void* p = nullptr;
  explicit Buffer(size_t bytes) { check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc"); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <typename T> T* as() const { return static_cast<T*>(p); }
};

void to_device(const Buffer& b, const void* host, size_t bytes) {
  check(cudaMemcpy(b.p, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

void to_host(void* host, const Buffer& b, size_t bytes) {
  check(cudaMemcpy(host, b.p, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

// Output buffers start as NaN bit patterns, so an element the kernel never wrote shows.
void poison(const Buffer& b, size_t bytes) { check(cudaMemset(b.p, 0xFF, bytes), "cudaMemset"); }

template <typename F>
int guarded(char* err, int64_t err_size, F&& body) {
  try {
    body();
    return 0;
  } catch (const Failed& f) {
    if (err != nullptr && err_size > 0) std::snprintf(err, err_size, "%s", f.what.c_str());
    return 1;
  }
}

}  // namespace

extern "C" {

int csa_cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// y[M, N] = Fp8Linear(x[M, K], w[N, K] e4m3 codes, wscale[ceil(N/32), K/32]); with reps > 1
// the launch is repeated and *ms_per_call gets the mean time of one (CUDA events).
int csa_fp8_linear(const float* x, const uint8_t* w, const float* wscale, float* y, int64_t M,
                   int64_t N, int64_t K, int round_output, int reps, float* ms_per_call,
                   char* err, int64_t err_size) {
  return guarded(err, err_size, [&] {
    if (K % 32 != 0 || M < 0 || N < 0 || reps < 1) throw Failed{"bad arguments"};
    const size_t xb = sizeof(float) * M * K, wb = static_cast<size_t>(N) * K,
                 sb = sizeof(float) * ((N + 31) / 32) * (K / 32), yb = sizeof(float) * M * N;
    Buffer dx(xb), dw(wb), ds(sb), dy(yb);
    to_device(dx, x, xb);
    to_device(dw, w, wb);
    to_device(ds, wscale, sb);
    poison(dy, yb);
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    check(cudaEventRecord(start), "cudaEventRecord");
    for (int r = 0; r < reps; ++r)
      check_launch(csa::launch_fp8_linear(dx.as<float>(), dw.as<uint8_t>(), ds.as<float>(),
                                          dy.as<float>(), M, N, K, round_output != 0,
                                          /*pairs16=*/false, nullptr),
                   "launch_fp8_linear");
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "fp8_linear kernel");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (ms_per_call != nullptr) *ms_per_call = ms / reps;
    to_host(y, dy, yb);
  });
}

// Fp4QuantDequant over nblocks blocks of `block` elements; bf16 != 0: in/out are bf16 bits.
// scales may be null (the op's optional second output).
int csa_fp4_round_trip(int bf16, const void* in, void* out, float* scales, int64_t nblocks,
                       int64_t block, int scale_format, char* err, int64_t err_size) {
  return guarded(err, err_size, [&] {
    if (nblocks < 0 || block < 1 || (scale_format != 0 && scale_format != 1))
      throw Failed{"bad arguments"};
    const size_t eb = bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t vb = eb * nblocks * block, sb = sizeof(float) * nblocks;
    const auto format = static_cast<csa::ScaleFormat>(scale_format);
    Buffer din(vb), dout(vb), ds(sb);
    to_device(din, in, vb);
    poison(dout, vb);
    poison(ds, sb);
    float* dscales = scales != nullptr ? ds.as<float>() : nullptr;
    if (bf16)
      check_launch(csa::launch_fp4_round_trip(din.as<Ort::BFloat16_t>(),
                                              dout.as<Ort::BFloat16_t>(), dscales, nblocks,
                                              block, format, nullptr),
                   "launch_fp4_round_trip");
    else
      check_launch(csa::launch_fp4_round_trip(din.as<float>(), dout.as<float>(), dscales,
                                              nblocks, block, format, nullptr),
                   "launch_fp4_round_trip");
    check(cudaDeviceSynchronize(), "fp4 kernel");
    to_host(out, dout, vb);
    if (scales != nullptr) to_host(scales, ds, sb);
  });
}

}  // extern "C"
