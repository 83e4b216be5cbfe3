// PackQuantized and UnpackQuantized (domain csa2onnx): rows of the layer state stored packed
// (packed_quant.h gives the formats and their byte layout).
//   PackQuantized: X (float [..., d]) -> P (uint8 [..., row_bytes(format, d)]); attribute
//     format ("fp4_e4m3_16" | "fp4_e8m0_32" | "fp8_e8m0_32"); d a multiple of the format's
//     block. Quantises as the graph does today (Fp4QuantDequant for fp4, act_quant for fp8).
//   UnpackQuantized: P (uint8 [..., row_bytes(format, dim)]) -> Y (float [..., dim]);
//     attributes format and dim (>= 0, a multiple of the block). Y = value(code) * scale,
//     bit for bit the round trip's values.
// CSA_PACK_QUANTIZED_ISA / CSA_UNPACK_QUANTIZED_ISA (or CSA2ONNX_ISA; read when a session
// creates the kernel) force "avx512", "avx2" or "scalar"; all give the same bits.
#include "ort_api.h"

#include <string>
#include <vector>

#include "kernel_support.h"
#include "packed_ops.h"
#include "packed_quant.h"

namespace csa {
namespace {

using packed::Format;

[[noreturn]] void fail(const char* op, const std::string& message) {
  ORT_CXX_API_THROW(std::string(op) + ": " + message, ORT_INVALID_ARGUMENT);
}

Format read_format(const OrtKernelInfo* info, const char* op) {
  std::string name;
  try {
    name = Ort::ConstKernelInfo(info).GetAttribute<std::string>("format");
  } catch (const Ort::Exception&) {
    fail(op, std::string("attribute format (") + packed::kFormatChoices + ") is required");
  }
  Format f;
  if (!packed::parse_format(name, &f))
    fail(op, "unknown format \"" + name + "\" (expected " + packed::kFormatChoices + ")");
  return f;
}

// ---- the row loops per instruction set (flatten: the helpers inline under the target)

using PackFn = void (*)(Format, const float*, uint8_t*, int64_t, int64_t);
using UnpackFn = void (*)(Format, const uint8_t*, float*, int64_t, int64_t);

void pack_rows_scalar(Format f, const float* x, uint8_t* p, int64_t rows, int64_t d) {
  const int64_t rb = packed::row_bytes(f, d);
  for (int64_t r = 0; r < rows; ++r)
    packed::pack_row<packed::PackScalar>(f, x + r * d, d, p + r * rb);
}
void unpack_rows_scalar(Format f, const uint8_t* p, float* y, int64_t rows, int64_t d) {
  const int64_t rb = packed::row_bytes(f, d);
  for (int64_t r = 0; r < rows; ++r) packed::unpack_row_scalar(f, p + r * rb, d, y + r * d);
}
#ifdef CSA_X86
CSA_TARGET_AVX512 __attribute__((flatten)) void pack_rows_avx512(Format f, const float* x,
                                                                 uint8_t* p, int64_t rows,
                                                                 int64_t d) {
  const int64_t rb = packed::row_bytes(f, d);
  for (int64_t r = 0; r < rows; ++r)
    packed::pack_row<packed::PackAvx512>(f, x + r * d, d, p + r * rb);
}
CSA_TARGET_AVX2 __attribute__((flatten)) void pack_rows_avx2(Format f, const float* x,
                                                             uint8_t* p, int64_t rows,
                                                             int64_t d) {
  const int64_t rb = packed::row_bytes(f, d);
  for (int64_t r = 0; r < rows; ++r)
    packed::pack_row<packed::PackAvx2>(f, x + r * d, d, p + r * rb);
}
CSA_TARGET_AVX512 __attribute__((flatten)) void unpack_rows_avx512(Format f, const uint8_t* p,
                                                                   float* y, int64_t rows,
                                                                   int64_t d) {
  const int64_t rb = packed::row_bytes(f, d);
  for (int64_t r = 0; r < rows; ++r) packed::unpack_row_avx512(f, p + r * rb, d, y + r * d);
}
CSA_TARGET_AVX2 __attribute__((flatten)) void unpack_rows_avx2(Format f, const uint8_t* p,
                                                               float* y, int64_t rows,
                                                               int64_t d) {
  const int64_t rb = packed::row_bytes(f, d);
  for (int64_t r = 0; r < rows; ++r) packed::unpack_row_avx2(f, p + r * rb, d, y + r * d);
}
#endif

PackFn pack_fn(Isa isa) {
#ifdef CSA_X86
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) return pack_rows_avx512;
  if (isa == Isa::kAvx2) return pack_rows_avx2;
#endif
  (void)isa;
  return pack_rows_scalar;
}

UnpackFn unpack_fn(Isa isa) {
#ifdef CSA_X86
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) return unpack_rows_avx512;
  if (isa == Isa::kAvx2) return unpack_rows_avx2;
#endif
  (void)isa;
  return unpack_rows_scalar;
}

// Runs body(first_row, row_count) over `rows` rows, in parallel chunks when there is enough
// work (below ~64K values a thread hand-off costs more than it saves).
template <typename Body>
void for_row_chunks(OrtKernelContext* ctx, int64_t rows, int64_t d, Body body) {
  constexpr int64_t kChunkValues = 1 << 15;
  const int64_t per = d > 0 ? (kChunkValues + d - 1) / d : rows;
  const int64_t chunks = per > 0 ? (rows + per - 1) / per : 0;
  if (rows * d < (1 << 16) || chunks <= 1) {
    body(int64_t{0}, rows);
    return;
  }
  struct Job {
    Body* body;
    int64_t rows, per;
  } job{&body, rows, per};
  auto run = [](void* data, size_t c) {
    const Job& j = *static_cast<const Job*>(data);
    const int64_t r0 = static_cast<int64_t>(c) * j.per;
    (*j.body)(r0, j.rows - r0 < j.per ? j.rows - r0 : j.per);
  };
  Ort::KernelContext(ctx).ParallelFor(run, static_cast<size_t>(chunks), 0, &job);
}

struct PackQuantizedKernel {
  Format format;
  PackFn fn;

  PackQuantizedKernel(const OrtApi*, const OrtKernelInfo* info)
      : format(read_format(info, "PackQuantized")),
        fn(pack_fn(select_isa("CSA_PACK_QUANTIZED_ISA"))) {
    require_node_io(info, "PackQuantized", 1, 1);
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      Ort::Custom::Tensor<uint8_t>& p) {
    return status_of([&] { Run(ctx, x, p); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
           Ort::Custom::Tensor<uint8_t>& p) {
    std::vector<int64_t> shape = x.Shape();
    if (shape.empty()) fail("PackQuantized", "X must have at least one dimension [..., d]");
    const int64_t d = shape.back();
    if (!packed::dim_fits(format, d)) {
      fail("PackQuantized", std::string("format ") + packed::format_name(format) +
                                " packs blocks of " + std::to_string(packed::block_of(format)) +
                                " values, which do not divide X's last dimension " +
                                std::to_string(d) + " (X " + shape_string(shape) + ")");
    }
    const int64_t rows = d > 0 ? x.NumberOfElement() / d : 0;
    shape.back() = packed::row_bytes(format, d);
    const float* in = x.Data();
    uint8_t* out = p.Allocate(shape);
    if (rows == 0 || d == 0) return;
    const int64_t rb = shape.back();
    for_row_chunks(ctx, rows, d, [&](int64_t r0, int64_t n) {
      fn(format, in + r0 * d, out + r0 * rb, n, d);
    });
  }
};

struct UnpackQuantizedKernel {
  Format format;
  int64_t dim = 0;
  UnpackFn fn;

  UnpackQuantizedKernel(const OrtApi*, const OrtKernelInfo* info)
      : format(read_format(info, "UnpackQuantized")),
        fn(unpack_fn(select_isa("CSA_UNPACK_QUANTIZED_ISA"))) {
    require_node_io(info, "UnpackQuantized", 1, 1);
    try {
      dim = Ort::ConstKernelInfo(info).GetAttribute<int64_t>("dim");
    } catch (const Ort::Exception&) {
      fail("UnpackQuantized", "attribute dim (int, the values per row) is required");
    }
    if (!packed::dim_fits(format, dim)) {
      fail("UnpackQuantized", "dim " + std::to_string(dim) + " must be >= 0 and a multiple of " +
                                  std::to_string(packed::block_of(format)) + " (format " +
                                  packed::format_name(format) + ")");
    }
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<uint8_t>& p,
                      Ort::Custom::Tensor<float>& y) {
    return status_of([&] { Run(ctx, p, y); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<uint8_t>& p,
           Ort::Custom::Tensor<float>& y) {
    std::vector<int64_t> shape = p.Shape();
    const int64_t rb = packed::row_bytes(format, dim);
    if (shape.empty() || shape.back() != rb) {
      fail("UnpackQuantized", "P must be [..., " + std::to_string(rb) + "] (format " +
                                  packed::format_name(format) + ", dim " + std::to_string(dim) +
                                  "), got " + shape_string(shape));
    }
    const int64_t rows = rb > 0 ? p.NumberOfElement() / rb : 0;
    shape.back() = dim;
    const uint8_t* in = p.Data();
    float* out = y.Allocate(shape);
    if (rows == 0 || dim == 0) return;
    for_row_chunks(ctx, rows, dim, [&](int64_t r0, int64_t n) {
      fn(format, in + r0 * rb, out + r0 * dim, n, dim);
    });
  }
};

}  // namespace

void AppendPackedOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<PackQuantizedKernel>("PackQuantized",
                                                                       "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<UnpackQuantizedKernel>("UnpackQuantized",
                                                                         "CPUExecutionProvider"));
}

}  // namespace csa
