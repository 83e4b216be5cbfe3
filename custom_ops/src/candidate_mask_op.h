#pragma once

#include <memory>
#include <vector>

namespace Ort::Custom {
struct OrtLiteCustomOp;
}

namespace csa {
// Appends the CandidateMask kernel (CPU) to `ops`.
void AppendCandidateMaskOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops);
}  // namespace csa
