#pragma once

#include <memory>
#include <vector>

namespace Ort::Custom {
struct OrtLiteCustomOp;
}

namespace csa {
// Appends the TorchTopK kernels (CPU; float, bfloat16, float16) to `ops`.
void AppendTorchTopKOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops);
}  // namespace csa
