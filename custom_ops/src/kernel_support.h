// What every kernel of the library shares, so that each op file holds only its own rules:
//   - errors: fail(op, message), INVALID_ARGUMENT with the op's name in front;
//   - node I/O and attributes, checked when the session creates the kernel
//     (require_node_io, required_attribute, optional_attribute, numerics_is_fast, has_output);
//   - the Compute trampoline: a kernel's Compute(inputs..., outputs...) is
//       `return status_of([&] { Run(ctx, inputs..., outputs...); });`
//     (the lite API reads Compute's parameter types for the op's signature, so the
//     trampoline cannot be one generic function; status_of is the shared part);
//   - threading: run_tasks, run_row_chunks and the serial_below cut-offs (work below which a
//     kernel stays on the calling thread);
//   - the instruction-set path (select_isa).
// Output shapes for onnxruntime are shape_inference.cc's, not the kernels'.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "ort_api.h"
#include "simd.h"

namespace csa {

// ---------------------------------------------------------------- errors
// Every error a kernel reports: "Op: what is wrong" (the caller's input or node is).
[[noreturn]] inline void fail(const char* op, const std::string& message) {
  ORT_CXX_API_THROW(std::string(op) + ": " + message, ORT_INVALID_ARGUMENT);
}

inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// ---------------------------------------------------------------- node I/O, attributes
// The node's inputs and outputs, checked when the session creates a kernel: onnxruntime
// accepts "" (or too few names) for a custom op's required input or output, and the lite
// API would then dereference the missing value before our code runs.
inline void require_node_io(const OrtKernelInfo* info, const char* op, size_t inputs,
                            size_t outputs) {
  const Ort::ConstKernelInfo ki(info);
  auto check = [op](size_t needed, size_t count, auto name_of, const char* kind) {
    for (size_t i = 0; i < needed; ++i) {
      if (i >= count || name_of(i).empty())
        fail(op, std::string(kind) + " " + std::to_string(i) +
                     " is required but the node leaves it out");
    }
  };
  check(inputs, ki.GetInputCount(), [&ki](size_t i) { return ki.GetInputName(i); }, "input");
  check(outputs, ki.GetOutputCount(), [&ki](size_t i) { return ki.GetOutputName(i); },
        "output");
}

// Attributes. onnxruntime reports "absent" and "of another type" with one error code; the
// message tells them apart. `kind` names the expected value with its article ("an int",
// "a float", "floats", "a string"), as the messages print it.
namespace detail {
template <typename T>
struct IsVector : std::false_type {};
template <typename U>
struct IsVector<std::vector<U>> : std::true_type {};

template <typename T>
T read_attribute(const OrtKernelInfo* info, const char* name) {
  const Ort::ConstKernelInfo ki(info);
  if constexpr (IsVector<T>::value) {
    return ki.GetAttributes<typename T::value_type>(name);
  } else {
    return ki.GetAttribute<T>(name);
  }
}

inline bool is_absent(const Ort::Exception& e) {
  return std::string(e.what()).find("No attribute") != std::string::npos;
}
}  // namespace detail

template <typename T>
T required_attribute(const OrtKernelInfo* info, const char* op, const char* name,
                     const char* kind) {
  try {
    return detail::read_attribute<T>(info, name);
  } catch (const Ort::Exception& e) {
    if (detail::is_absent(e))
      fail(op, std::string("attribute ") + name + " (" + kind + ") is required");
    fail(op, std::string("attribute ") + name + " must be " + kind + " (" + e.what() + ")");
  }
}

// Empty when the node does not have the attribute; another type is an error.
template <typename T>
std::optional<T> optional_attribute(const OrtKernelInfo* info, const char* op,
                                    const char* name, const char* kind) {
  try {
    return detail::read_attribute<T>(info, name);
  } catch (const Ort::Exception& e) {
    if (detail::is_absent(e)) return std::nullopt;
    fail(op, std::string("attribute ") + name + " must be " + kind + " (" + e.what() + ")");
  }
}

// The attribute numerics of an op that has a fast kernel: "exact" (or absent) or "fast";
// returns whether it is "fast".
inline bool numerics_is_fast(const OrtKernelInfo* info, const char* op) {
  const std::string numerics =
      optional_attribute<std::string>(info, op, "numerics", "a string").value_or("exact");
  if (numerics != "exact" && numerics != "fast")
    fail(op, "attribute numerics must be \"exact\" or \"fast\", got \"" + numerics + "\"");
  return numerics == "fast";
}

// Whether the graph gives output `index` an OrtValue: an omitted output ("" or absent) has
// none, and Tensor::Allocate would dereference null. Allocates it (Allocate then reuses it).
inline bool has_output(OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& shape) {
  return Ort::KernelContext(ctx).GetOutput(index, shape) != nullptr;
}

// ---------------------------------------------------------------- Compute
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

// ---------------------------------------------------------------- threading
// Work below which a kernel runs on the calling thread: handing tasks to onnxruntime's pool
// costs more than it saves (each in the unit its kernel counts). Threads never change a bit
// of any result: every task computes its own outputs in the fixed order.
namespace serial_below {
constexpr int64_t kElements = int64_t{1} << 16;        // cheap per-value work (fp4 round trip)
constexpr int64_t kRmsNormElements = int64_t{1} << 15;  // a square, a sum and a product each
constexpr int64_t kAngles = int64_t{1} << 14;           // a cosf and a sinf each (RopeCosSin)
constexpr int64_t kMultiplyAdds = int64_t{1} << 17;     // the linears: M*N*K
constexpr int64_t kConvertedValues = int64_t{1} << 18;  // TorchLinear's X rows to bf16 pairs
constexpr int64_t kAttentionTerms = int64_t{1} << 16;   // SparseAttention: rows*h*k*d
}  // namespace serial_below

// Values per task for kernels that split rows into chunks (Pack/UnpackQuantized): enough
// that a task outweighs its hand-off, few enough that decode-sized calls still spread.
constexpr int64_t kValuesPerRowChunk = int64_t{1} << 15;

// fn(data, t) for t in [0, tasks): on the calling thread when `work` is below `serial`,
// else on onnxruntime's intra-op pool. fn must not throw (no exception may escape into the
// pool): tasks record failures in `data`.
inline void run_tasks(OrtKernelContext* ctx, int64_t work, int64_t serial, size_t tasks,
                      void (*fn)(void*, size_t), void* data) {
  if (work < serial || tasks <= 1) {
    for (size_t t = 0; t < tasks; ++t) fn(data, t);
  } else {
    Ort::KernelContext(ctx).ParallelFor(fn, tasks, 0, data);
  }
}

// body(first_row, row_count) over `rows` rows of `width` values, in chunks of about
// kValuesPerRowChunk values: on the calling thread below serial_below::kElements values,
// else on the pool. body must not throw (see run_tasks).
template <typename Body>
void run_row_chunks(OrtKernelContext* ctx, int64_t rows, int64_t width, Body body) {
  const int64_t per = width > 0 ? (kValuesPerRowChunk + width - 1) / width : rows;
  const int64_t chunks = per > 0 ? (rows + per - 1) / per : 0;
  if (rows * width < serial_below::kElements || chunks <= 1) {
    body(int64_t{0}, rows);  // one call: no chunking overhead when serial
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
  run_tasks(ctx, rows * width, serial_below::kElements, static_cast<size_t>(chunks), run, &job);
}

// fn(job, t, scratch) for t in [0, tasks) through run_tasks, each task with its thread's
// scratch vector (kept from call to call); a task that runs out of memory sets
// job.out_of_memory instead of throwing into the pool.
template <typename Job, typename Fn>
void run_tasks_with_scratch(OrtKernelContext* ctx, int64_t work, int64_t serial, size_t tasks,
                            Fn fn, Job& job) {
  struct Call {
    Job* job;
    Fn fn;
  } call{&job, fn};
  auto task = [](void* data, size_t t) {
    Call& c = *static_cast<Call*>(data);
    try {
      thread_local std::vector<float> scratch;
      c.fn(*c.job, t, scratch);
    } catch (const std::bad_alloc&) {
      c.job->out_of_memory = true;
    }
  };
  run_tasks(ctx, work, serial, tasks, task, &call);
}

// ---------------------------------------------------------------- instruction sets
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
// The variable that forces a path: the op's own if set, else CSA2ONNX_ISA if set, else
// null (a forced path is taken as named, not swapped for another the kernel finds faster).
inline const char* forcing_variable(const char* op_variable) {
  for (const char* variable : {op_variable, "CSA2ONNX_ISA"}) {
    const char* forced = std::getenv(variable);
    if (forced != nullptr && *forced != '\0') return variable;
  }
  return nullptr;
}

inline bool isa_forced(const char* op_variable) { return forcing_variable(op_variable) != nullptr; }

inline Isa select_isa(const char* op_variable, bool has_reference = false,
                      bool has_bf16 = false) {
  if (const char* variable = forcing_variable(op_variable)) {
    const std::string name = std::getenv(variable);
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
