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
// The two kernels are one shell (PackedKernel) over what differs (PackSide, UnpackSide);
// errors, attributes, threading and the instruction set are kernel_support.h's.
#include "ort_api.h"

#include <string>
#include <vector>

#include "kernel_support.h"
#include "packed_ops.h"
#include "packed_quant.h"

namespace csa {
namespace {

using packed::Format;

Format read_format(const OrtKernelInfo* info, const char* op) {
  static const std::string kind = std::string("a string: ") + packed::kFormatChoices;
  const std::string name = required_attribute<std::string>(info, op, "format", kind.c_str());
  Format f;
  if (!packed::parse_format(name, &f))
    fail(op, "unknown format \"" + name + "\" (expected " + packed::kFormatChoices + ")");
  return f;
}

// ---- the row loops per instruction set (flatten: the helpers inline under the target)

template <typename P>
inline void pack_rows(Format f, const float* x, uint8_t* p, int64_t rows, int64_t d) {
  const int64_t rb = packed::row_bytes(f, d);
  for (int64_t r = 0; r < rows; ++r) packed::pack_row<P>(f, x + r * d, d, p + r * rb);
}
template <void (*Row)(Format, const uint8_t*, int64_t, float*)>
inline void unpack_rows(Format f, const uint8_t* p, float* y, int64_t rows, int64_t d) {
  const int64_t rb = packed::row_bytes(f, d);
  for (int64_t r = 0; r < rows; ++r) Row(f, p + r * rb, d, y + r * d);
}

void pack_rows_scalar(Format f, const float* x, uint8_t* p, int64_t rows, int64_t d) {
  pack_rows<packed::PackScalar>(f, x, p, rows, d);
}
void unpack_rows_scalar(Format f, const uint8_t* p, float* y, int64_t rows, int64_t d) {
  unpack_rows<packed::unpack_row_scalar>(f, p, y, rows, d);
}
#ifdef CSA_X86
CSA_TARGET_AVX512 __attribute__((flatten)) void pack_rows_avx512(
    Format f, const float* x, uint8_t* p, int64_t rows, int64_t d) {
  pack_rows<packed::PackAvx512>(f, x, p, rows, d);
}
CSA_TARGET_AVX2 __attribute__((flatten)) void pack_rows_avx2(
    Format f, const float* x, uint8_t* p, int64_t rows, int64_t d) {
  pack_rows<packed::PackAvx2>(f, x, p, rows, d);
}
CSA_TARGET_AVX512 __attribute__((flatten)) void unpack_rows_avx512(
    Format f, const uint8_t* p, float* y, int64_t rows, int64_t d) {
  unpack_rows<packed::unpack_row_avx512>(f, p, y, rows, d);
}
CSA_TARGET_AVX2 __attribute__((flatten)) void unpack_rows_avx2(
    Format f, const uint8_t* p, float* y, int64_t rows, int64_t d) {
  unpack_rows<packed::unpack_row_avx2>(f, p, y, rows, d);
}
#endif

using PackFn = void (*)(Format, const float*, uint8_t*, int64_t, int64_t);
using UnpackFn = void (*)(Format, const uint8_t*, float*, int64_t, int64_t);

// The row loops of a session's instruction-set path.
struct RowLoops {
  PackFn pack;
  UnpackFn unpack;
};
RowLoops row_loops(Isa isa) {
#ifdef CSA_X86
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16)
    return {pack_rows_avx512, unpack_rows_avx512};
  if (isa == Isa::kAvx2) return {pack_rows_avx2, unpack_rows_avx2};
#endif
  (void)isa;
  return {pack_rows_scalar, unpack_rows_scalar};
}

// What differs between the two ops; PackedKernel is the shell both share. A Side gives the
// element types, the op's names, its row loops per instruction set, and the row widths of a
// call (in: the input's last dimension, out: the output's, d: the values per row), checking
// the input's shape.
struct Widths {
  int64_t in, out, d;
};

struct PackSide {
  using In = float;
  using Out = uint8_t;
  using Fn = PackFn;
  static constexpr const char* kOp = "PackQuantized";
  static constexpr const char* kIsaVariable = "CSA_PACK_QUANTIZED_ISA";
  Format format;

  explicit PackSide(const OrtKernelInfo* info) : format(read_format(info, kOp)) {}

  static Fn fn(Isa isa) { return row_loops(isa).pack; }

  Widths widths(const std::vector<int64_t>& shape) const {
    if (shape.empty()) fail(kOp, "X must have at least one dimension [..., d]");
    const int64_t d = shape.back();
    if (!packed::dim_fits(format, d)) {
      fail(kOp, std::string("format ") + packed::format_name(format) + " packs blocks of " +
                    std::to_string(packed::block_of(format)) +
                    " values, which do not divide X's last dimension " + std::to_string(d) +
                    " (X " + shape_string(shape) + ")");
    }
    return {d, packed::row_bytes(format, d), d};
  }
};

struct UnpackSide {
  using In = uint8_t;
  using Out = float;
  using Fn = UnpackFn;
  static constexpr const char* kOp = "UnpackQuantized";
  static constexpr const char* kIsaVariable = "CSA_UNPACK_QUANTIZED_ISA";
  Format format;
  int64_t dim;

  explicit UnpackSide(const OrtKernelInfo* info)
      : format(read_format(info, kOp)),
        dim(required_attribute<int64_t>(info, kOp, "dim", "an int, the values per row")) {
    if (!packed::dim_fits(format, dim)) {
      fail(kOp, "dim " + std::to_string(dim) + " must be >= 0 and a multiple of " +
                    std::to_string(packed::block_of(format)) + " (format " +
                    packed::format_name(format) + ")");
    }
  }

  static Fn fn(Isa isa) { return row_loops(isa).unpack; }

  Widths widths(const std::vector<int64_t>& shape) const {
    const int64_t rb = packed::row_bytes(format, dim);
    if (shape.empty() || shape.back() != rb) {
      fail(kOp, "P must be [..., " + std::to_string(rb) + "] (format " +
                    packed::format_name(format) + ", dim " + std::to_string(dim) + "), got " +
                    shape_string(shape));
    }
    return {rb, dim, dim};
  }
};

template <typename Side>
struct PackedKernel {
  using In = typename Side::In;
  using Out = typename Side::Out;
  Side side;
  typename Side::Fn fn;

  PackedKernel(const OrtApi*, const OrtKernelInfo* info)
      : side(info), fn(Side::fn(select_isa(Side::kIsaVariable))) {
    require_node_io(info, Side::kOp, 1, 1);
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<In>& x,
                      Ort::Custom::Tensor<Out>& y) {
    return status_of([&] { Run(ctx, x, y); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<In>& x,
           Ort::Custom::Tensor<Out>& y) {
    std::vector<int64_t> shape = x.Shape();
    const Widths w = side.widths(shape);
    const int64_t rows = w.in > 0 ? x.NumberOfElement() / w.in : 0;
    shape.back() = w.out;
    const In* in = x.Data();
    Out* out = y.Allocate(shape);
    if (rows == 0 || w.d == 0) return;
    run_row_chunks(ctx, rows, w.d, [&](int64_t r0, int64_t n) {
      fn(side.format, in + r0 * w.in, out + r0 * w.out, n, w.d);
    });
  }
};

}  // namespace

void AppendPackedOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<PackedKernel<PackSide>>(PackSide::kOp,
                                                                       "CPUExecutionProvider"));
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<PackedKernel<UnpackSide>>(UnpackSide::kOp,
                                                                         "CPUExecutionProvider"));
}

}  // namespace csa
