// Fp8Linear's fast numerics (attribute numerics = "fast"; fp8_linear_fast.cc): the same
// inputs, outputs and terms as the exact kernel, summed in whatever order is fastest.
#pragma once

#include <cstdint>
#include <vector>

#include "ort_api.h"

namespace csa::fp8_fast {

// Whether this CPU has what the fast kernel needs (AVX512-BF16, AVX512-VBMI and GFNI).
bool cpu_supported();

// Whether this process can run the prefill's tiles on AMX-BF16 (amx_bf16_tiles.h enable()),
// which it does from kAmxMinRows rows (fewer: vdpbf16ps).
bool amx_supported();
constexpr int64_t kAmxMinRows = 16;

struct Problem {
  const float* x;    // [M][K]
  const uint8_t* w;  // [N][K] e4m3fn codes
  const float* ws;   // [ceil(N/32)][K/32]
  float* y;          // [M][N]
  int64_t M, N, K;   // M, N >= 1; K >= 32, a multiple of 32
  bool round_output;  // Y through bfloat16 (the graph's Cast pair, ort_cast.h)
  bool amx;           // prefill of 16 rows or more on AMX tiles (amx_bf16::enable() was true)
};

// Y by the fast kernel, or false when some term is not exact in bf16 for this call (a scale
// outside the range checked, a NaN or inf in X): then Y holds nothing of use and the caller
// runs the exact kernel. The NaN codes of W count as 0 here: the caller sets their columns
// to NaN (nan_columns).
bool run(OrtKernelContext* ctx, const Problem& p);

// The columns of W (rows of codes) with a NaN code (0x7F or 0xFF).
std::vector<int64_t> nan_columns(const uint8_t* w, int64_t N, int64_t K);

}  // namespace csa::fp8_fast
