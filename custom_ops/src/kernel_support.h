// What every kernel of the library needs: node I/O checked at kernel creation, errors
// returned as a Status, shapes printed in messages.
#pragma once

#include <exception>
#include <string>
#include <vector>

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

inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace csa
