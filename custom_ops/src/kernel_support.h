// What every kernel of the library needs: node I/O checked at kernel creation, errors
// returned as a Status, shapes printed in messages.
#pragma once

#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "simd.h"

namespace csa {

// The node's inputs and outputs, checked when the session creates a kernel: onnxruntime
// accepts "" (or too few names) for a custom op's required input or output, and the lite
// API would then dereference the missing value before our code runs.
inline void require_node_io(const OrtKernelInfo* info, const char* op, size_t inputs,
                            size_t outputs) {
  const Ort::ConstKernelInfo ki(info);
  auto check = [op](size_t needed, size_t count, auto name_of, const char* kind) {
    for (size_t i = 0; i < needed; ++i) {
      if (i >= count || name_of(i).empty()) {
        ORT_CXX_API_THROW(std::string(op) + ": " + kind + " " + std::to_string(i) +
                              " is required but the node leaves it out",
                          ORT_INVALID_ARGUMENT);
      }
    }
  };
  check(inputs, ki.GetInputCount(), [&ki](size_t i) { return ki.GetInputName(i); }, "input");
  check(outputs, ki.GetOutputCount(), [&ki](size_t i) { return ki.GetOutputName(i); },
        "output");
}

// Runs a kernel body, returning its error as a Status: onnxruntime would turn an exception
// escaping a custom kernel into RUNTIME_EXCEPTION and lose the INVALID_ARGUMENT code.
template <typename Body>
Ort::Status status_of(Body&& body) {
  try {
    body();
  } catch (const Ort::Exception& e) {
    return Ort::Status(e);
  } catch (const std::exception& e) {  // e.g. bad_alloc for the outputs
    return Ort::Status(e);
  }
  return Ort::Status(nullptr);
}

// A constant initializer feeding input `index` (for packing it once at kernel creation),
// or a null value when the input is not a constant or onnxruntime cannot tell.
inline Ort::ConstValue constant_input(const OrtKernelInfo* info, size_t index) {
  int is_constant = 0;
  Ort::ConstValue value{nullptr};
  try {
    value = Ort::ConstKernelInfo(info).GetTensorConstantInput(index, &is_constant);
  } catch (const Ort::Exception&) {
    return Ort::ConstValue{nullptr};
  }
  return is_constant ? value : Ort::ConstValue{nullptr};
}

inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// kAvx512Bf16: the AVX-512 path plus vdpbf16ps where the op has one (TorchLinear).
enum class Isa { kReference, kScalar, kAvx2, kAvx512, kAvx512Bf16 };

inline bool cpu_has(Isa isa) {
  if (isa == Isa::kAvx2) return cpu_has_x86_64_v3();
  if (isa == Isa::kAvx512) return cpu_has_x86_64_v4();
  if (isa == Isa::kAvx512Bf16) return cpu_has_avx512bf16();
  return true;  // the reference and scalar paths run anywhere
}

// The instruction-set path a kernel takes, chosen when a session creates it: the op's own
// variable (e.g. CSA_TORCH_LINEAR_ISA), else CSA2ONNX_ISA (every kernel), else the widest
// this CPU has. Forcing a path is for tests: every path computes the same bits, which is
// how csa2onnx gives the same outputs on every CPU. `reference` only where the op has one;
// `avx512bf16` names the op's own variable only where the op has such a path, while
// CSA2ONNX_ISA=avx512bf16 puts the ops without one on their avx512 path (one setting for a
// whole model).
inline Isa select_isa(const char* op_variable, bool has_reference = false,
                      bool has_bf16 = false) {
  for (const char* variable : {op_variable, "CSA2ONNX_ISA"}) {
    const char* forced = std::getenv(variable);
    if (forced == nullptr || *forced == '\0') continue;
    const std::string name = forced;
    const bool global = variable != op_variable;
    std::string choices = "avx512, avx2";
    choices += has_reference ? ", scalar, reference" : ", scalar";
    choices += has_bf16 ? " or avx512bf16" : "";
    if (!has_bf16) {
      const size_t last_comma = choices.rfind(", ");
      choices.replace(last_comma, 2, " or ");
    }
    Isa isa;
    if (name == "reference" && has_reference) isa = Isa::kReference;
    else if (name == "scalar") isa = Isa::kScalar;
    else if (name == "avx2") isa = Isa::kAvx2;
    else if (name == "avx512") isa = Isa::kAvx512;
    else if (name == "avx512bf16" && (has_bf16 || global))
      isa = has_bf16 ? Isa::kAvx512Bf16 : Isa::kAvx512;
    else ORT_CXX_API_THROW(std::string(variable) + "=\"" + name + "\" (expected " + choices + ")",
                           ORT_INVALID_ARGUMENT);
    if (!cpu_has(isa) || (name == "avx512bf16" && !cpu_has(Isa::kAvx512Bf16)))
      ORT_CXX_API_THROW(std::string(variable) + "=" + name + " but this CPU does not support it",
                        ORT_INVALID_ARGUMENT);
    return isa;
  }
  if (has_bf16 && cpu_has(Isa::kAvx512Bf16)) return Isa::kAvx512Bf16;
  if (cpu_has(Isa::kAvx512)) return Isa::kAvx512;
  if (cpu_has(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

}  // namespace csa
