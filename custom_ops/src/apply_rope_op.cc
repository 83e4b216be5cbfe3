// ApplyRope (domain csa2onnx): the reference's apply_rotary_emb on the LAST rope_head_dim
// features, bit for bit the standard ops it replaces (graphs/rope.py before the op, now the
// op's portable body): Slice, Mul, Sub, Add, Concat, Cast to bf16 and back.
//
// Inputs X (float [b, s, d] or [b, s, h, d]), Cos and Sin (float [s, rd/2], or [b, s, rd/2]
// for per-batch positions; [1, s, rd/2] broadcasts over b as the standard ops' would);
// attributes rope_head_dim (rd: even, 1..d) and inverse (0 or 1); output Y (X's shape).
// Features [0, d - rd) are copied unchanged; the last rd are adjacent pairs (re, im):
//   out_re = re*c - im*s',  out_im = re*s' + im*c,  s' = inverse ? -sin : sin
// each product, the difference and the sum rounded on their own (this file is compiled
// with -ffp-contract=off: no fused multiply-add), then onnxruntime's Cast to bf16 and back
// (nearest even; a NaN becomes 0x7FC0 with its sign).
//
// NaNs: where one operand of a product or of the sum is NaN, that NaN (with its sign) is
// the result, as in the standard ops. Where BOTH are NaN, onnxruntime's Mul and Add return
// either one, by the element's place in their vector loops (seen with onnxruntime 1.32);
// this op returns the first operand's (re*s' of the sum, X's value of a product), on every
// path and thread count.
//
// In place: the op tells onnxruntime that Y may reuse X's buffer (GetMayInplace); when it
// does, the unchanged features are not copied. CSA_APPLY_ROPE_ISA (or CSA2ONNX_ISA, read
// when a session creates the kernel) forces "avx512", "avx2" or "scalar": the same loop
// compiled for each, the same bits.
#include "ort_api.h"

#include <cstring>
#include <string>
#include <vector>

#include "apply_rope_op.h"
#include "kernel_support.h"
#include "ort_cast.h"

namespace csa {
namespace {

constexpr const char* kOp = "ApplyRope";

// One call's rows: X and Y as [rows, d] (rows = b*s*h), the rope rows of Cos and Sin as
// [table_rows, rd/2]; row r's token is r / heads, its table row that token (per-batch
// tables) or its position in the sequence (token % seq).
struct Job {
  const float* x;
  float* y;
  const float* cos;
  const float* sin;
  int64_t d, half, heads, seq;
  bool per_batch;
  bool copy_nope;  // false when Y is X's buffer
};

// a*b, or a where a is NaN (the first operand's NaN when both are: see the header).
inline float mul_first(float a, float b) {
  const float p = a * b;
  return a != a ? a : p;
}
inline float add_first(float a, float b) {
  const float p = a + b;
  return a != a ? a : p;
}

// Pairs of `x` (not Y's buffer: see rotate_rows) into y.
template <bool kInverse>
inline void rotate_pairs(const float* __restrict x, float* __restrict y,
                         const float* __restrict cos, const float* __restrict sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float re = x[2 * i], im = x[2 * i + 1];
    const float c = cos[i];
    const float s = kInverse ? -sin[i] : sin[i];
    const float out_re = mul_first(re, c) - mul_first(im, s);
    const float out_im = add_first(mul_first(re, s), mul_first(im, c));
    y[2 * i] = ort_cast::cast_bf16(out_re);
    y[2 * i + 1] = ort_cast::cast_bf16(out_im);
  }
}

// Pairs per block: each block of X's pairs is read into a local buffer first, so that the
// rotation vectorises (no aliasing to rule out) even when Y is X's buffer.
constexpr int64_t kPairsPerBlock = 64;

template <bool kInverse>
inline void rotate_rows(const Job& j, int64_t first, int64_t count) {
  const int64_t nope = j.d - 2 * j.half;
  float block[2 * kPairsPerBlock];
  for (int64_t r = first; r < first + count; ++r) {
    const int64_t token = r / j.heads;
    const int64_t row = (j.per_batch ? token : token % j.seq) * j.half;
    const float* x = j.x + r * j.d;
    float* y = j.y + r * j.d;
    if (j.copy_nope && nope > 0) std::memcpy(y, x, static_cast<size_t>(nope) * sizeof(float));
    for (int64_t p = 0; p < j.half; p += kPairsPerBlock) {
      const int64_t n = j.half - p < kPairsPerBlock ? j.half - p : kPairsPerBlock;
      std::memcpy(block, x + nope + 2 * p, static_cast<size_t>(2 * n) * sizeof(float));
      rotate_pairs<kInverse>(block, y + nope + 2 * p, j.cos + row + p, j.sin + row + p, n);
    }
  }
}

inline void rows_any(const Job& j, bool inverse, int64_t first, int64_t count) {
  if (inverse) {
    rotate_rows<true>(j, first, count);
  } else {
    rotate_rows<false>(j, first, count);
  }
}

// The same loop per instruction set (flatten: the helpers inline under the target).
using RowsFn = void (*)(const Job&, bool, int64_t, int64_t);
void rows_scalar(const Job& j, bool inverse, int64_t first, int64_t count) {
  rows_any(j, inverse, first, count);
}
#ifdef CSA_X86
CSA_TARGET_AVX512 __attribute__((flatten)) void rows_avx512(const Job& j, bool inverse,
                                                            int64_t first, int64_t count) {
  rows_any(j, inverse, first, count);
}
CSA_TARGET_AVX2 __attribute__((flatten)) void rows_avx2(const Job& j, bool inverse,
                                                        int64_t first, int64_t count) {
  rows_any(j, inverse, first, count);
}
#endif

RowsFn rows_fn(Isa isa) {
#ifdef CSA_X86
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) return rows_avx512;
  if (isa == Isa::kAvx2) return rows_avx2;
#endif
  (void)isa;
  return rows_scalar;
}

struct ApplyRopeKernel {
  int64_t rope_head_dim = 0;
  bool inverse = false;
  RowsFn loop = nullptr;

  ApplyRopeKernel(const OrtApi*, const OrtKernelInfo* info) {
    require_node_io(info, kOp, 3, 1);
    rope_head_dim = required_attribute<int64_t>(info, kOp, "rope_head_dim", "an int");
    if (rope_head_dim < 1 || rope_head_dim % 2 != 0) {
      fail(kOp, "rope_head_dim must be even and >= 2 (adjacent pairs), got " +
                    std::to_string(rope_head_dim));
    }
    const int64_t inv = optional_attribute<int64_t>(info, kOp, "inverse", "an int").value_or(0);
    if (inv != 0 && inv != 1) fail(kOp, "inverse must be 0 or 1, got " + std::to_string(inv));
    inverse = inv == 1;
    loop = rows_fn(select_isa("CSA_APPLY_ROPE_ISA"));
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<float>& cos,
                      const Ort::Custom::Tensor<float>& sin, Ort::Custom::Tensor<float>& y) {
    return status_of([&] { Run(ctx, x, cos, sin, y); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
           const Ort::Custom::Tensor<float>& cos, const Ort::Custom::Tensor<float>& sin,
           Ort::Custom::Tensor<float>& y) const {
    const std::vector<int64_t> xs = x.Shape();
    if (xs.size() != 3 && xs.size() != 4)
      fail(kOp, "X must be [b, s, d] or [b, s, h, d], got " + shape_string(xs));
    const int64_t b = xs[0], s = xs[1], d = xs.back();
    const int64_t heads = xs.size() == 4 ? xs[2] : 1;
    if (rope_head_dim > d) {
      fail(kOp, "rope_head_dim " + std::to_string(rope_head_dim) + " exceeds X's last dimension " +
                    std::to_string(d) + " (X " + shape_string(xs) + ")");
    }
    const int64_t half = rope_head_dim / 2;
    const std::vector<int64_t> cs = cos.Shape();
    if (sin.Shape() != cs) {
      fail(kOp, "Cos " + shape_string(cs) + " and Sin " + shape_string(sin.Shape()) +
                    " must have the same shape");
    }
    const bool rows_form = cs.size() == 2 && cs[0] == s && cs[1] == half;
    const bool batch_form =
        cs.size() == 3 && (cs[0] == b || cs[0] == 1) && cs[1] == s && cs[2] == half;
    if (!rows_form && !batch_form) {
      fail(kOp, "Cos and Sin must be [s, rope_head_dim/2] = [" + std::to_string(s) + ", " +
                    std::to_string(half) + "] or [b, s, rope_head_dim/2] = [" +
                    std::to_string(b) + ", " + std::to_string(s) + ", " + std::to_string(half) +
                    "], got " + shape_string(cs) + " (X " + shape_string(xs) + ")");
    }
    float* out = y.Allocate(xs);
    const int64_t rows = b * s * heads;
    if (rows == 0 || d == 0) return;
    const float* in = x.Data();
    const Job job{in,   out, cos.Data(), sin.Data(), d, half, heads, s,
                  batch_form && cs[0] == b, out != in};
    const RowsFn fn = loop;
    const bool inv = inverse;
    // The unchanged features are one copy, the pairs a few operations each: the rows are
    // cheap per value, split as the elementwise kernels are.
    run_row_chunks(ctx, rows, d, [&job, fn, inv](int64_t first, int64_t count) {
      fn(job, inv, first, count);
    });
  }
};

// Y may reuse X's buffer (input 0 -> output 0).
size_t ORT_API_CALL may_inplace(int** input_index, int** output_index) {
  *input_index = new int[1]{0};
  *output_index = new int[1]{0};
  return 1;
}
void ORT_API_CALL release_may_inplace(int* input_index, int* output_index) {
  delete[] input_index;
  delete[] output_index;
}

}  // namespace

void AppendApplyRopeOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  auto op = std::unique_ptr<Ort::Custom::OrtLiteCustomOp>(
      Ort::Custom::CreateLiteCustomOp<ApplyRopeKernel>(kOp, "CPUExecutionProvider"));
  op->GetMayInplace = may_inplace;
  op->ReleaseMayInplace = release_may_inplace;
  ops.push_back(std::move(op));
}

}  // namespace csa
