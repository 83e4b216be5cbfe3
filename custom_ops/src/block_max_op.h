#pragma once

#include <memory>
#include <vector>

namespace Ort::Custom {
struct OrtLiteCustomOp;
}

namespace csa {
// Appends the BlockMax kernel (float, CPU) to `ops`.
void AppendBlockMaxOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops);
}  // namespace csa
