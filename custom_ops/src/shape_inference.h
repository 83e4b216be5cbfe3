// The custom ops' output shapes for onnxruntime, which asks when a session loads a model
// (OrtCustomOp::InferOutputShapeFn, API version >= 17): register.cc installs them on every
// op by name, so the kernels' files hold no shape rules. onnxruntime infers the output
// element types itself, from the kernels' declared types.
//
// The same rules exist in Python for ONNX tooling (custom_ops/schemas.py);
// tests/test_shape_inference.py checks that the two agree.
#pragma once

#include "ort_api.h"

namespace csa {

using ShapeInferFn = OrtStatusPtr(ORT_API_CALL*)(const OrtCustomOp*, OrtShapeInferContext*);

// The shape inference of custom op `op_name`, or null for an op without one (TorchTopK:
// its output's last dimension is the value of K, which onnxruntime does not pass here).
ShapeInferFn shape_inference_for(const char* op_name);

}  // namespace csa
