// WriteRows (domain csa2onnx): CacheOut = Cache with rows RowStart .. RowStart+n-1 of the
// first b batch entries replaced by Rows. Inputs Cache (T [B, R, d]), Rows (T [b, n, d],
// b <= B), RowStart (int64, one element, 0 <= RowStart <= R - n) and After (optional, int64,
// any shape; ignored: an ordering edge, so that nodes reading the old Cache run first); output
// CacheOut (T [B, R, d]). T is float (the float caches) or uint8 (packed rows, d =
// row_bytes: PackQuantized's output); the rows are copied as bytes either way.
//
// When the runtime binds CacheOut to the same buffer as Cache (IOBinding, one OrtValue as
// past input and present output) only the n new rows are written: O(b*n*d), whatever R is.
// Otherwise Cache is copied first, so any caller gets a correct result.
#include "ort_api.h"

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kernel_support.h"
#include "write_rows_op.h"

namespace csa {
namespace {

constexpr const char* kOp = "WriteRows";

template <typename T>
struct WriteRowsKernel {
  WriteRowsKernel(const OrtApi*, const OrtKernelInfo* info) {
    require_node_io(info, kOp, 3, 1);  // After is optional
  }

  Ort::Status Compute(const Ort::Custom::Tensor<T>& cache, const Ort::Custom::Tensor<T>& rows,
                      const Ort::Custom::Tensor<int64_t>& row_start,
                      std::optional<const Ort::Custom::Tensor<int64_t>*> /*after*/,
                      Ort::Custom::Tensor<T>& out) {
    return status_of([&] { Run(cache, rows, row_start, out); });
  }

  static void Run(const Ort::Custom::Tensor<T>& cache, const Ort::Custom::Tensor<T>& rows,
                  const Ort::Custom::Tensor<int64_t>& row_start, Ort::Custom::Tensor<T>& out) {
    const std::vector<int64_t> cs = cache.Shape();
    const std::vector<int64_t> rs = rows.Shape();
    if (cs.size() != 3)
      fail(kOp, "Cache must have rank 3 [batch, rows, d], got " + shape_string(cs));
    if (rs.size() != 3) fail(kOp, "Rows must have rank 3 [batch, n, d], got " + shape_string(rs));
    if (rs[2] != cs[2]) {
      fail(kOp, "Rows " + shape_string(rs) + " and Cache " + shape_string(cs) +
                " differ in the last dimension");
    }
    if (rs[0] > cs[0]) {
      fail(kOp, "Rows " + shape_string(rs) + " has a larger batch than Cache " + shape_string(cs));
    }
    if (row_start.NumberOfElement() != 1) {
      fail(kOp, "RowStart must hold one element, got shape " + shape_string(row_start.Shape()));
    }
    const int64_t start = row_start.Data()[0];
    const int64_t n = rs[1];
    if (start < 0) fail(kOp, "RowStart must be >= 0, got " + std::to_string(start));
    if (start > cs[1] - n) {  // start + n > rows, without overflow
      fail(kOp, "rows " + std::to_string(start) + " .. " + std::to_string(start + n - 1) +
                " are past the cache's " + std::to_string(cs[1]) + " rows (Cache " +
                shape_string(cs) + ", Rows " + shape_string(rs) + ")");
    }
    const T* src = cache.Data();
    T* dst = out.Allocate(cs);
    const int64_t row_bytes = cs[2] * static_cast<int64_t>(sizeof(T));
    // Bound to the same buffer: the old rows are already in place.
    if (dst != src && cache.NumberOfElement() > 0) {
      std::memcpy(dst, src, static_cast<size_t>(cache.NumberOfElement()) * sizeof(T));
    }
    if (n == 0 || cs[2] == 0) return;
    const T* new_rows = rows.Data();
    for (int64_t b = 0; b < rs[0]; ++b) {
      std::memcpy(dst + (b * cs[1] + start) * cs[2], new_rows + b * n * cs[2],
                  static_cast<size_t>(n * row_bytes));
    }
  }
};

}  // namespace

void AppendWriteRowsOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<WriteRowsKernel<float>>(
      kOp, "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<WriteRowsKernel<uint8_t>>(
      kOp, "CPUExecutionProvider"));
}

}  // namespace csa
