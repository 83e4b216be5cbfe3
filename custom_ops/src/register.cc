// Entry point onnxruntime calls when the library is registered
// (SessionOptions.register_custom_ops_library): one domain, csa2onnx, version 1. Every op
// gets its output shape inference here (shape_inference.cc), by name.
#include "ort_api.h"

#include <memory>
#include <vector>

#include "apply_rope_op.h"
#include "block_max_op.h"
#include "candidate_mask_op.h"
#include "fp4_op.h"
#include "fp8_linear_op.h"
#include "indexer_score_op.h"
#include "packed_ops.h"
#include "rope_cos_sin_op.h"
#include "shape_inference.h"
#include "sparse_attention_op.h"
#include "torch_linear_op.h"
#include "torch_rms_norm_op.h"
#include "torch_topk_op.h"
#include "write_rows_op.h"

namespace {

// The ops and the domain must outlive every session that uses them (onnxruntime keeps
// only pointers), so they are built once per process and never destroyed.
struct Library {
  Ort::CustomOpDomain domain{"csa2onnx"};
  std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>> ops;

  Library() {
    csa::AppendFp4Ops(ops);
    csa::AppendTorchTopKOps(ops);
    csa::AppendTorchLinearOps(ops);
    csa::AppendFp8LinearOps(ops);
    csa::AppendTorchRMSNormOps(ops);
    csa::AppendSparseAttentionOps(ops);
    csa::AppendWriteRowsOps(ops);
    csa::AppendPackedOps(ops);
    csa::AppendRopeCosSinOps(ops);
    csa::AppendIndexerScoreOps(ops);
    csa::AppendApplyRopeOps(ops);
    csa::AppendBlockMaxOps(ops);
    csa::AppendCandidateMaskOps(ops);
    for (auto& op : ops) {
      op->InferOutputShapeFn = csa::shape_inference_for(op->GetName(op.get()));
      domain.Add(op.get());
    }
  }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  try {
    static Library* const library = new Library();  // thread-safe static init
    Ort::UnownedSessionOptions(options).Add(library->domain);
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
