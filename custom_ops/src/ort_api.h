// The ONNX Runtime C/C++ API as this library uses it. Nothing links libonnxruntime: the API
// table arrives through RegisterCustomOps (register.cc), so every file must agree on
// ORT_API_MANUAL_INIT.
#pragma once

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"
