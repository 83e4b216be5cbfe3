#pragma once

#include <memory>
#include <vector>

namespace Ort::Custom {
struct OrtLiteCustomOp;
}

namespace csa {
// Appends the IndexerScore and IndexerTopK kernels (float or packed uint8 keys, CPU) to `ops`.
void AppendIndexerScoreOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops);
}  // namespace csa
