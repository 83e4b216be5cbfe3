// The custom ops' output shapes for onnxruntime (shape_inference.h), through the C API's
// shape-inference context.
//
// What that context can say limits what is set here: it passes an input without a known
// shape as rank 0 (so a rank-0 input counts as unknown, never as a scalar), it cannot take
// an unknown dimension in an output (an output is set only when every dimension is a size or
// a symbolic name), it passes no input values (TorchTopK's K; IndexerScore's and
// IndexerTopK's Width, so those ops have no rule: each output has a dimension neither a size
// nor a name), and it cannot tell how many outputs a node has (Fp4QuantDequant's optional Scale is
// left alone). Whatever is not set, onnxruntime leaves unknown, as it did before. A status returned here is only logged by
// onnxruntime: the kernels check every shape when they run.
#include "shape_inference.h"

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "packed_quant.h"

namespace csa {
namespace {

// A dimension as onnxruntime passes it: a size (>= 0), a symbolic name, or neither.
struct Dim {
  int64_t value = -1;
  std::string symbol;
  bool known() const { return value >= 0 || !symbol.empty(); }
};

struct Input {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<Dim> dims;  // empty: the rank is unknown (or the input a scalar)
};

class Context {
 public:
  Context(const OrtApi& api, OrtShapeInferContext* ctx) : api_(api), ctx_(ctx) {}

  // Input `index`, or false when the node leaves it out or onnxruntime cannot describe it.
  bool input(size_t index, Input& in) const {
    size_t count = 0;
    if (failed(api_.ShapeInferContext_GetInputCount(ctx_, &count)) || index >= count)
      return false;
    OrtTensorTypeAndShapeInfo* info = nullptr;  // the context's: not released here
    if (failed(api_.ShapeInferContext_GetInputTypeShape(ctx_, index, &info)) || info == nullptr)
      return false;
    size_t rank = 0;
    if (failed(api_.GetTensorElementType(info, &in.type)) ||
        failed(api_.GetDimensionsCount(info, &rank)))
      return false;
    std::vector<int64_t> values(rank);
    std::vector<const char*> symbols(rank, nullptr);
    if (rank > 0 && (failed(api_.GetDimensions(info, values.data(), rank)) ||
                     failed(api_.GetSymbolicDimensions(info, symbols.data(), rank))))
      return false;
    in.dims.assign(rank, Dim{});
    for (size_t i = 0; i < rank; ++i) {
      in.dims[i].value = values[i] >= 0 ? values[i] : -1;
      if (symbols[i] != nullptr) in.dims[i].symbol = symbols[i];
    }
    return true;
  }

  // Input `index` with rank >= 1 (a rank-0 one may be of unknown rank).
  bool ranked_input(size_t index, Input& in) const { return input(index, in) && !in.dims.empty(); }

  bool int_attribute(const char* name, int64_t& out) const {
    const OrtOpAttr* attr = nullptr;
    if (failed(api_.ShapeInferContext_GetAttribute(ctx_, name, &attr)) || attr == nullptr)
      return false;
    size_t size = 0;
    return !failed(api_.ReadOpAttr(attr, ORT_OP_ATTR_INT, &out, sizeof(out), &size));
  }

  bool string_attribute(const char* name, std::string& out) const {
    const OrtOpAttr* attr = nullptr;
    if (failed(api_.ShapeInferContext_GetAttribute(ctx_, name, &attr)) || attr == nullptr)
      return false;
    size_t size = 0;  // the first call (no room) reports the size, with its terminating 0
    failed(api_.ReadOpAttr(attr, ORT_OP_ATTR_STRING, nullptr, 0, &size));
    if (size == 0) return false;
    std::vector<char> text(size);
    if (failed(api_.ReadOpAttr(attr, ORT_OP_ATTR_STRING, text.data(), size, &size)))
      return false;
    out.assign(text.data(), strnlen(text.data(), text.size()));
    return true;
  }

  // The number of values of a floats attribute (0 when absent or empty).
  size_t floats_count(const char* name) const {
    const OrtOpAttr* attr = nullptr;
    if (failed(api_.ShapeInferContext_GetAttribute(ctx_, name, &attr)) || attr == nullptr)
      return 0;
    size_t size = 0;  // with no room, the call reports the bytes it needs
    failed(api_.ReadOpAttr(attr, ORT_OP_ATTR_FLOATS, nullptr, 0, &size));
    return size / sizeof(float);
  }

  // Output `index` gets `dims`, when every one is known.
  OrtStatusPtr set_output(size_t index, const std::vector<Dim>& dims,
                          ONNXTensorElementDataType type) const {
    std::vector<int64_t> values;
    std::vector<const char*> symbols;
    for (const Dim& d : dims) {
      if (!d.known()) return nullptr;  // onnxruntime would read -1 as a size
      values.push_back(d.symbol.empty() ? d.value : -1);
      symbols.push_back(d.symbol.c_str());
    }
    OrtTensorTypeAndShapeInfo* info = nullptr;
    if (OrtStatusPtr status = api_.CreateTensorTypeAndShapeInfo(&info)) return status;
    OrtStatusPtr status = api_.SetTensorElementType(info, type);
    if (status == nullptr) status = api_.SetDimensions(info, values.data(), values.size());
    if (status == nullptr)
      status = api_.SetSymbolicDimensions(info, symbols.data(), symbols.size());
    if (status == nullptr) status = api_.ShapeInferContext_SetOutputTypeShape(ctx_, index, info);
    api_.ReleaseTensorTypeAndShapeInfo(info);  // onnxruntime copied the shape
    return status;
  }

 private:
  // Whether a call failed (its status released: a missing attribute or input is no error).
  bool failed(OrtStatusPtr status) const {
    if (status == nullptr) return false;
    api_.ReleaseStatus(status);
    return true;
  }

  const OrtApi& api_;
  OrtShapeInferContext* ctx_;
};

constexpr ONNXTensorElementDataType kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;

std::vector<Dim> with_last(std::vector<Dim> dims, Dim last) {
  dims.back() = std::move(last);
  return dims;
}

Dim size(int64_t value) { return Dim{value, ""}; }

// ---------------------------------------------------------------- the rules
// Output 0 has input 0's shape (TorchRMSNorm, SparseAttention, WriteRows, Fp4QuantDequant's
// Y), and its type.
OrtStatusPtr like_first_input(const Context& c) {
  Input x;
  if (!c.ranked_input(0, x)) return nullptr;
  return c.set_output(0, x.dims, x.type);
}

// TorchLinear: X [..., G*K] -> [..., G*N], N = out_features (panels64; G = groups, default
// 1), or W's first dimension (plain: that is G*N).
OrtStatusPtr torch_linear(const Context& c) {
  Input x, w;
  if (!c.ranked_input(0, x)) return nullptr;
  std::string layout = "plain";
  c.string_attribute("weight_layout", layout);
  if (layout == "panels64") {
    int64_t n = -1, groups = 1;
    if (!c.int_attribute("out_features", n) || n < 0) return nullptr;
    c.int_attribute("groups", groups);
    if (groups < 1 || n > INT64_MAX / groups) return nullptr;  // the kernel reports it
    return c.set_output(0, with_last(x.dims, size(groups * n)), kFloat);
  }
  if (!c.input(1, w) || w.dims.size() != 2) return nullptr;
  return c.set_output(0, with_last(x.dims, w.dims[0]), kFloat);
}

// Fp8Linear: X [..., K] -> [..., N], N = W's first dimension (plain), or 16 times it
// (pairs16: W [N/16, K/32, 512]; known only as a size).
OrtStatusPtr fp8_linear(const Context& c) {
  Input x, w;
  if (!c.ranked_input(0, x) || !c.input(1, w)) return nullptr;
  std::string layout = "plain";
  c.string_attribute("weight_layout", layout);
  if (layout == "pairs16") {
    if (w.dims.size() != 3) return nullptr;  // the kernel reports it
    const Dim groups = w.dims[0];
    const bool sized = groups.value >= 0 && groups.value <= INT64_MAX / 16;
    return c.set_output(0, with_last(x.dims, sized ? size(16 * groups.value) : Dim{}), kFloat);
  }
  if (w.dims.size() != 2) return nullptr;
  return c.set_output(0, with_last(x.dims, w.dims[0]), kFloat);
}

// RopeCosSin: Positions [...] -> Cos, Sin [..., len(inverse_frequencies)].
OrtStatusPtr rope_cos_sin(const Context& c) {
  Input positions;
  const size_t count = c.floats_count("inverse_frequencies");
  if (!c.ranked_input(0, positions) || count == 0) return nullptr;
  std::vector<Dim> dims = positions.dims;
  dims.push_back(size(static_cast<int64_t>(count)));
  if (OrtStatusPtr status = c.set_output(0, dims, kFloat)) return status;
  return c.set_output(1, dims, kFloat);
}

// PackQuantized: X [..., d] -> [..., row_bytes(format, d)] (d a size).
OrtStatusPtr pack_quantized(const Context& c) {
  Input x;
  std::string name;
  packed::Format format;
  if (!c.ranked_input(0, x) || !c.string_attribute("format", name) ||
      !packed::parse_format(name, &format))
    return nullptr;
  const Dim& d = x.dims.back();
  if (!d.symbol.empty() || !packed::dim_fits(format, d.value)) return nullptr;
  return c.set_output(0, with_last(x.dims, size(packed::row_bytes(format, d.value))),
                      ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8);
}

// UnpackQuantized: P [..., row_bytes] -> [..., dim].
OrtStatusPtr unpack_quantized(const Context& c) {
  Input p;
  int64_t dim = -1;
  if (!c.ranked_input(0, p) || !c.int_attribute("dim", dim) || dim < 0) return nullptr;
  return c.set_output(0, with_last(p.dims, size(dim)), kFloat);
}

// BlockMax: X [..., T] -> [..., ceil(T / block_size)] (T a size).
OrtStatusPtr block_max(const Context& c) {
  Input x;
  int64_t block = 0;
  if (!c.ranked_input(0, x) || !c.int_attribute("block_size", block) || block < 1)
    return nullptr;
  const Dim& t = x.dims.back();
  if (!t.symbol.empty() || t.value < 0) return nullptr;
  return c.set_output(0, with_last(x.dims, size(t.value / block + (t.value % block != 0))),
                      kFloat);
}

template <OrtStatusPtr (*Rule)(const Context&)>
OrtStatusPtr ORT_API_CALL infer(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  const OrtApi& api = Ort::GetApi();
  try {
    return Rule(Context(api, ctx));
  } catch (const std::exception& e) {  // bad_alloc: leave the shapes unknown
    return api.CreateStatus(ORT_FAIL, e.what());
  }
}

struct Entry {
  const char* op;
  ShapeInferFn fn;
};

constexpr Entry kRules[] = {
    {"Fp4QuantDequant", infer<like_first_input>},
    {"TorchLinear", infer<torch_linear>},
    {"Fp8Linear", infer<fp8_linear>},
    {"TorchRMSNorm", infer<like_first_input>},
    {"SparseAttention", infer<like_first_input>},
    {"RopeCosSin", infer<rope_cos_sin>},
    {"ApplyRope", infer<like_first_input>},
    {"WriteRows", infer<like_first_input>},
    {"PackQuantized", infer<pack_quantized>},
    {"UnpackQuantized", infer<unpack_quantized>},
    {"BlockMax", infer<block_max>},
};

}  // namespace

ShapeInferFn shape_inference_for(const char* op_name) {
  for (const Entry& e : kRules)
    if (std::strcmp(e.op, op_name) == 0) return e.fn;
  return nullptr;
}

}  // namespace csa
