// ctypes entry point for the Python tests: runs csa::torch_topk_rows, the same function
// the onnxruntime TorchTopK kernel runs on each chunk of rows.
#include <cstdint>
#include <vector>

#include "torch_topk.h"

// x: [rows, n] contiguous; values: [rows, k] of the same format; indices: [rows, k].
// fmt: 0 float32, 1 bfloat16 bits, 2 float16 bits. Returns 0, or -1 for a bad fmt.
extern "C" int topk_rows(int fmt, const void* x, int64_t rows, int64_t n, int64_t k,
                         int largest, int sorted, void* values, int64_t* indices) {
  std::vector<csa::TopKPair> scratch(static_cast<size_t>(n));
  switch (fmt) {
    case 0:
      csa::torch_topk_rows<csa::TopKF32>(static_cast<const float*>(x), 0, rows, n, k, largest != 0,
                                         sorted != 0, scratch.data(), static_cast<float*>(values),
                                         indices);
      return 0;
    case 1:
      csa::torch_topk_rows<csa::TopKBF16>(static_cast<const uint16_t*>(x), 0, rows, n, k,
                                          largest != 0, sorted != 0, scratch.data(),
                                          static_cast<uint16_t*>(values), indices);
      return 0;
    case 2:
      csa::torch_topk_rows<csa::TopKF16>(static_cast<const uint16_t*>(x), 0, rows, n, k,
                                         largest != 0, sorted != 0, scratch.data(),
                                         static_cast<uint16_t*>(values), indices);
      return 0;
    default:
      return -1;
  }
}
