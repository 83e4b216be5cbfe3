#pragma once

#include <memory>
#include <vector>

namespace Ort::Custom {
struct OrtLiteCustomOp;
}

namespace csa {
// Appends the Fp8Linear kernels (CPU; CUDA when built with it) to `ops`.
void AppendFp8LinearOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops);
}  // namespace csa
