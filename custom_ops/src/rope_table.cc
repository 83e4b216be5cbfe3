// cos/sin of float32 angles through the C library's cosf/sinf, which is what torch.polar
// evaluates on the CPU: the reference's freqs_cis tables come out bit for bit. (A float64
// cos rounded once differs from glibc's cosf in about 1% of the entries.)
#include <cmath>
#include <cstdint>

extern "C" __attribute__((visibility("default"))) void csa2onnx_cos_sin(const float* angles,
                                                                        int64_t n, float* cos_out,
                                                                        float* sin_out) {
  for (int64_t i = 0; i < n; ++i) {
    cos_out[i] = cosf(angles[i]);
    sin_out[i] = sinf(angles[i]);
  }
}
