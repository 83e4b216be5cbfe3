// Element access for the tensor types the kernels accept: everything is computed in float.
#pragma once

#include "fp4_quant.h"

namespace csa {

inline float to_float(float x) { return x; }
inline float to_float(Ort::BFloat16_t x) { return bf16_bits_to_float(x.val); }
inline float to_float(Ort::Float16_t x) { return x.ToFloat(); }

template <typename T>
T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline Ort::BFloat16_t from_float<Ort::BFloat16_t>(float x) {
  return Ort::BFloat16_t::FromBits(float_to_bf16_bits(x));
}
template <>
inline Ort::Float16_t from_float<Ort::Float16_t>(float x) { return Ort::Float16_t(x); }

}  // namespace csa
