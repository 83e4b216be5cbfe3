// Fp8Linear (domain csa2onnx): Y = fp8_gemm(act_quant(X), W, WScale) with the block rule
// of fp8_linear.h. Inputs X (float, [..., K], rank >= 1), W (float8e4m3fn, [N, K], kept at
// one byte per weight), WScale (float, [ceil(N/32), K/32], the checkpoint's ue8m0 scales);
// attribute block_size (default 32, the only size supported); output Y (float, [..., N]),
// not rounded to bf16 (the graph rounds).
//
// W is repacked into panels of 32 columns ([K][32] bytes, zero-padded), once when it is a
// constant initializer, else on every call; a panel's columns share one WScale row. X is
// quantised a chunk of rows at a time (xq kept as double). Per panel and K block, rows x 32
// columns accumulate the block's 32 products in double, exact in any order (e4m3 products
// are multiples of 2^-18 below 2^18, 32 of them need < 45 bits), so fused multiply-adds
// are exact too; the sum is rounded once to float, then scaled and added in float, blocks
// in order. Weights become doubles exactly: for groups of 6 rows the 32x32 tile is
// converted once (e4m3 -> f16 bits -> float -> double) and shared; fewer rows (decode)
// convert in registers (AVX512-VBMI byte permutes, or integer shifts, building the double's
// bits directly). Every instruction-set path and thread count gives the same bits. This
// file is compiled with -ffp-contract=off: the float scaling must stay multiply, multiply,
// add.
//
// CSA_FP8_LINEAR_ISA (read when a session creates the kernel) forces a path for tests:
// "avx512", "avx2" or "scalar" ("avx512-novbmi": AVX-512 without the VBMI conversion).
#include "ort_api.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "fp8_linear.h"
#include "fp8_linear_op.h"
#include "kernel_support.h"
#include "simd.h"
#ifdef CSA_X86
#include <immintrin.h>
#endif
#ifdef CSA_WITH_CUDA
#include "fp8_linear_cuda.h"
#endif

#define CSA_INLINE __attribute__((always_inline)) inline

namespace csa {
namespace {

[[noreturn]] void fail(const std::string& message) {
  ORT_CXX_API_THROW("Fp8Linear: " + message, ORT_INVALID_ARGUMENT);
}

constexpr int64_t kBlock = Fp8::kBlock;   // K block of the scales, and panel width
constexpr int64_t kChunkRows = 128;       // rows quantised and multiplied per pass over W
constexpr int64_t kParallelWork = int64_t{1} << 17;  // M*N*K below which one thread runs it
// Exact power-of-two scalings: quantised rows are stored as xq * 2^1000 and tiles as
// w * 2^-1000 (the f16 trick gives w / 256, times 2^-992), so a tile sum is the dot itself;
// the AVX-512 code path builds doubles holding w * 2^-1016 straight from the codes, so its
// sum is dot * 2^-16. Every weight, product and sum stays a normal double.
constexpr double kXScale = 0x1p1000;
constexpr double kTileFromF16 = 0x1p-992;
constexpr double kCodeDot = 0x1p16;

// Checks shapes and returns (M, N, K); everything is checked before any memory is touched.
struct Dims {
  int64_t M = 0, N = 0, K = 0, KB = 0, NB = 0;
};

Dims check_shapes(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                  const std::vector<int64_t>& ws) {
  if (x.empty()) fail("X must have rank >= 1, got a scalar");
  if (w.size() != 2) fail("W must be [N, K] (rank 2), got shape " + shape_string(w));
  Dims d;
  d.N = w[0];
  d.K = w[1];
  if (d.K % kBlock != 0) {
    fail("K (" + std::to_string(d.K) + ", the second dimension of W " + shape_string(w) +
         ") must be a multiple of the block size 32");
  }
  if (x.back() != d.K) {
    fail("the last dimension of X (" + std::to_string(x.back()) +
         ") must equal K, the second dimension of W (" + std::to_string(d.K) + "); X shape " +
         shape_string(x) + ", W shape " + shape_string(w));
  }
  d.KB = d.K / kBlock;
  d.NB = (d.N + kBlock - 1) / kBlock;
  if (ws.size() != 2 || ws[0] != d.NB || ws[1] != d.KB) {
    fail("WScale must be [ceil(N/32), K/32] = " + shape_string({d.NB, d.KB}) + " for W " +
         shape_string(w) + ", got shape " + shape_string(ws));
  }
  d.M = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) d.M *= x[i];
  return d;
}

// W as ceil(N/32) panels of [K][32] codes (code 0 is +0 in the padding), plus the columns
// holding a NaN code (their outputs are NaN whatever the tiles compute).
struct PackedW {
  int64_t n = -1, k = -1;
  std::vector<uint8_t> data;
  std::vector<int64_t> nan_columns;

  void pack(const uint8_t* w, int64_t N, int64_t K) {
    n = N;
    k = K;
    const int64_t panels = (N + kBlock - 1) / kBlock;
    data.assign(static_cast<size_t>(panels * K * kBlock), uint8_t{0});
    nan_columns.clear();
    for (int64_t col = 0; col < N; ++col) {
      uint8_t* dst = data.data() + (col / kBlock) * K * kBlock + col % kBlock;
      const uint8_t* src = w + col * K;
      bool nan = false;
      for (int64_t kk = 0; kk < K; ++kk) {
        dst[kk * kBlock] = src[kk];
        nan |= Fp8::is_nan_code(src[kk]);
      }
      if (nan) nan_columns.push_back(col);
    }
  }
};

// ---- weight tiles: 32 k x 32 columns of codes -> doubles (w / 256), exact on every path ----

struct Lut {
  double v[256];
  Lut() {
    for (int c = 0; c < 256; ++c)
      v[c] = static_cast<double>(Fp8::e4m3_value(uint8_t(c))) * 0x1p-1000;
  }
};
const Lut kLut;

void convert_tile_scalar(const uint8_t* src, double* dst) {
  for (int64_t i = 0; i < kBlock * kBlock; ++i) dst[i] = kLut.v[src[i]];
}

#ifdef CSA_X86
// GCC 12 flags the intrinsics' own _mm*_undefined_* placeholders as (maybe-)uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// e4m3fn code c -> f16 bits (sext(c) << 7) & 0xBF80: sign to bit 15, exponent and mantissa
// into the f16 fields (bias 15 instead of 7), so the f16 value is w / 256, subnormals
// included; NaN codes give 1.875 and are overwritten at the end.
CSA_TARGET_AVX512 void convert_tile_avx512(const uint8_t* src, double* dst) {
  const __m512i mask = _mm512_set1_epi16(static_cast<short>(0xBF80));
  for (int64_t k = 0; k < kBlock; ++k) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k * kBlock));
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), 7), mask);
    const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    const __m512 f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    double* out = dst + k * kBlock;
    const __m512d fold = _mm512_set1_pd(kTileFromF16);
    _mm512_storeu_pd(out, _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(f0)), fold));
    _mm512_storeu_pd(out + 8, _mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f0, 1)), fold));
    _mm512_storeu_pd(out + 16, _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(f1)), fold));
    _mm512_storeu_pd(out + 24, _mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f1, 1)), fold));
  }
}

CSA_TARGET_AVX2 void convert_tile_avx2(const uint8_t* src, double* dst) {
  const __m256i mask = _mm256_set1_epi16(static_cast<short>(0xBF80));
  for (int64_t k = 0; k < kBlock; ++k) {
    for (int64_t half = 0; half < 2; ++half) {
      const __m128i codes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * kBlock + half * 16));
      const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7), mask);
      const __m256 f0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
      const __m256 f1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
      double* out = dst + k * kBlock + half * 16;
      const __m256d fold = _mm256_set1_pd(kTileFromF16);
      _mm256_storeu_pd(out, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(f0)), fold));
      _mm256_storeu_pd(out + 4, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(f0, 1)), fold));
      _mm256_storeu_pd(out + 8, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(f1)), fold));
      _mm256_storeu_pd(out + 12, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(f1, 1)), fold));
    }
  }
}
#endif

// ---- row tiles: plain loops, inlined into each instruction-set wrapper and vectorised ----

struct Job {
  const double* xq;      // [rows][K], this chunk's quantised rows
  const float* xs;       // [rows][KB]
  const uint8_t* panels; // PackedW data
  const float* wscale;   // [NB][KB]
  float* y;              // this chunk's first output row
  int64_t rows, N, K, KB;
};

// MR rows x NT columns (from column c of the tile) for one K block: the exact double sum,
// then out = out + float(sum) * (xs * ws). kFma: a fused multiply-add (exact here, like
// the separate multiply and add, which the scalar path uses to avoid libm's fma).
template <int MR, int NT, bool kFma>
CSA_INLINE void rows_tile(const double* x, int64_t ldx, const double* tile, int64_t c,
                          const float* xs, int64_t ldxs, float ws, float* out) {
  double acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = 0.0;
  for (int64_t k = 0; k < kBlock; ++k) {
    const double* wk = tile + k * kBlock + c;
    for (int m = 0; m < MR; ++m) {
      const double xv = x[m * ldx + k];
#pragma GCC ivdep
      for (int j = 0; j < NT; ++j) {
        if (kFma) {
          acc[m][j] = __builtin_fma(xv, wk[j], acc[m][j]);
        } else {
          const double p = xv * wk[j];
          acc[m][j] = acc[m][j] + p;
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const float scale = xs[m * ldxs] * ws;
    float* o = out + m * kBlock + c;
#pragma GCC ivdep
    for (int j = 0; j < NT; ++j) {
      const float dot = static_cast<float>(acc[m][j]);  // the exact sum, rounded once
      const float term = dot * scale;
      o[j] = o[j] + term;
    }
  }
}

template <void (*Convert)(const uint8_t*, double*), int MR, int NT, bool kFma>
CSA_INLINE void run_task(const Job& j, size_t task) {
  const int64_t p = static_cast<int64_t>(task);
  alignas(64) float buf[kChunkRows * kBlock];
  alignas(64) double tile[kBlock * kBlock];
  for (int64_t i = 0; i < j.rows * kBlock; ++i) buf[i] = 0.0f;
  const uint8_t* panel = j.panels + p * j.K * kBlock;
  for (int64_t kb = 0; kb < j.KB; ++kb) {
    Convert(panel + kb * kBlock * kBlock, tile);
    const float ws = j.wscale[p * j.KB + kb];
    const double* x = j.xq + kb * kBlock;
    const float* xs = j.xs + kb;
    for (int64_t c = 0; c < kBlock; c += NT) {
      int64_t r = 0;
      for (; r + MR <= j.rows; r += MR)
        rows_tile<MR, NT, kFma>(x + r * j.K, j.K, tile, c, xs + r * j.KB, j.KB, ws,
                                buf + r * kBlock);
      for (; r < j.rows; ++r)  // leftover rows, one at a time
        rows_tile<1, NT, kFma>(x + r * j.K, j.K, tile, c, xs + r * j.KB, j.KB, ws,
                               buf + r * kBlock);
    }
  }
  const int64_t n0 = p * kBlock;
  const int64_t cols = j.N - n0 < kBlock ? j.N - n0 : kBlock;
  for (int64_t r = 0; r < j.rows; ++r)
    for (int64_t c = 0; c < cols; ++c) j.y[r * j.N + n0 + c] = buf[r * kBlock + c];
}

// Instruction-set wrappers (accumulators in registers: AVX-512 6 rows x 4 zmm, AVX2
// 2 rows x 4 ymm per half tile).
void task_scalar(const Job& j, size_t t) { run_task<convert_tile_scalar, 1, 32, false>(j, t); }
#ifdef CSA_X86
// AVX-512 with intrinsics: the accumulators must stay in registers (6 rows x 4 zmm of
// doubles), which GCC's vectorised loops do not manage here.
CSA_TARGET_AVX512 CSA_INLINE void codes_to_doubles_avx512(const uint8_t* src, __m512d (&w)[4]) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), 7),
                                     _mm512_set1_epi16(static_cast<short>(0xBF80)));
  const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  const __m512 f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  const __m512d fold = _mm512_set1_pd(kTileFromF16);  // w * 2^-1000, as in the tiles
  w[0] = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(f0)), fold);
  w[1] = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f0, 1)), fold);
  w[2] = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(f1)), fold);
  w[3] = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f1, 1)), fold);
}

// e4m3fn codes -> doubles holding w * 2^-1016 with integer operations only: the code's
// exponent and mantissa bits go to the bottom of the double's exponent field and the top
// of its mantissa, the sign to bit 63 (subnormal codes become subnormal doubles, which
// the caller avoids when denormals are treated as zero).
CSA_TARGET_AVX512 CSA_INLINE void codes_to_scaled_doubles_avx512(const uint8_t* src,
                                                                 __m512d (&w)[4]) {
  const __m512i mask = _mm512_set1_epi64(static_cast<long long>(0x80FE000000000000ull));
  for (int q = 0; q < 4; ++q) {
    const __m512i v = _mm512_cvtepi8_epi64(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(src + 8 * q)));
    w[q] = _mm512_castsi512_pd(_mm512_and_si512(_mm512_slli_epi64(v, 49), mask));
  }
}

// out[m][0..32) = out + float(acc[m] (* kCodeDot)) * (xs[m] * ws), rows m < MR.
template <int MR, bool kScaled>
CSA_TARGET_AVX512 CSA_INLINE void finish_avx512(const __m512d (&acc)[MR][4], const float* xs,
                                                int64_t ldxs, float ws, float* out) {
  const __m512d code_dot = _mm512_set1_pd(kCodeDot);
  for (int m = 0; m < MR; ++m) {
    const float scale_f = xs[m * ldxs] * ws;
    const __m512 scale = _mm512_set1_ps(scale_f);
    for (int h = 0; h < 2; ++h) {
      __m512d a_lo = acc[m][2 * h], a_hi = acc[m][2 * h + 1];
      if (kScaled) {
        a_lo = _mm512_mul_pd(a_lo, code_dot);
        a_hi = _mm512_mul_pd(a_hi, code_dot);
      }
      const __m256 lo = _mm512_cvtpd_ps(a_lo);
      const __m256 hi = _mm512_cvtpd_ps(a_hi);
      const __m512 dot = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
      float* o = out + m * kBlock + 16 * h;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_mul_ps(dot, scale)));
    }
  }
}

// MR rows from a converted tile (prefill: the conversion is shared by every row).
template <int MR>
CSA_TARGET_AVX512 CSA_INLINE void tile_rows_avx512(const double* x, int64_t ldx,
                                                   const double* tile, const float* xs,
                                                   int64_t ldxs, float ws, float* out) {
  __m512d acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q) acc[m][q] = _mm512_setzero_pd();
  for (int64_t k = 0; k < kBlock; ++k) {
    __m512d w[4];
    for (int q = 0; q < 4; ++q) w[q] = _mm512_load_pd(tile + k * kBlock + 8 * q);
    for (int m = 0; m < MR; ++m) {
      const __m512d xv = _mm512_set1_pd(x[m * ldx + k]);
      for (int q = 0; q < 4; ++q) acc[m][q] = _mm512_fmadd_pd(xv, w[q], acc[m][q]);
    }
  }
  finish_avx512<MR, false>(acc, xs, ldxs, ws, out);
}

// MR rows straight from the codes (decode, and rows left over from the tiles).
template <int MR, bool kIntegerCodes>
CSA_TARGET_AVX512 CSA_INLINE void code_rows_avx512(const double* x, int64_t ldx,
                                                   const uint8_t* codes, const float* xs,
                                                   int64_t ldxs, float ws, float* out) {
  // Few rows: even and odd k in separate accumulators, so that more fused multiply-add
  // chains run at once (the sums are exact, so splitting them changes nothing).
  constexpr int kSplit = MR <= 2 ? 2 : 1;
  __m512d part[kSplit][MR][4];
  for (int h = 0; h < kSplit; ++h)
    for (int m = 0; m < MR; ++m)
      for (int q = 0; q < 4; ++q) part[h][m][q] = _mm512_setzero_pd();
  for (int64_t k0 = 0; k0 < kBlock; k0 += kSplit) {
    for (int h = 0; h < kSplit; ++h) {
      const int64_t k = k0 + h;
      __m512d w[4];
      if (kIntegerCodes) {
        codes_to_scaled_doubles_avx512(codes + k * kBlock, w);
      } else {
        codes_to_doubles_avx512(codes + k * kBlock, w);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512d xv = _mm512_set1_pd(x[m * ldx + k]);
        for (int q = 0; q < 4; ++q) part[h][m][q] = _mm512_fmadd_pd(xv, w[q], part[h][m][q]);
      }
    }
  }
  __m512d acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q)
      acc[m][q] = kSplit == 2 ? _mm512_add_pd(part[0][m][q], part[kSplit - 1][m][q])
                              : part[0][m][q];
  finish_avx512<MR, kIntegerCodes>(acc, xs, ldxs, ws, out);
}

// AVX512-VBMI (Zen 4, Ice Lake and later): the same doubles as the integer path, built
// with byte permutes, 64 codes (two k) at a time: byte 7 of each double is the code's sign
// (code & 0x80), byte 6 its exponent and mantissa shifted up one (code + code), the rest 0.
#define CSA_TARGET_AVX512_VBMI \
  __attribute__((target("arch=x86-64-v4,avx512vbmi,prefer-vector-width=512")))

bool cpu_has_vbmi() {
#ifdef CSA_X86
  return cpu_has_x86_64_v4() && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

struct VbmiIndex {  // for group q of 8 codes: their bytes 6 (from code + code) and 7 (sign)
  alignas(64) uint8_t idx[8][64];
  VbmiIndex() {
    for (int q = 0; q < 8; ++q)
      for (int j = 0; j < 64; ++j)
        idx[q][j] = j % 8 == 6 ? uint8_t(8 * q + j / 8) : j % 8 == 7 ? uint8_t(64 + 8 * q + j / 8) : 0;
  }
};
const VbmiIndex kVbmiIndex;

template <int MR>
CSA_TARGET_AVX512_VBMI __attribute__((noinline)) void code_rows_vbmi(
    const double* x, int64_t ldx, const uint8_t* codes, const float* xs, int64_t ldxs, float ws,
    float* out) {
  constexpr int kSplit = MR <= 2 ? 2 : 1;  // as in code_rows_avx512
  constexpr __mmask64 kTopBytes = 0xC0C0C0C0C0C0C0C0ull;
  __m512d part[kSplit][MR][4];
  for (int h = 0; h < kSplit; ++h)
    for (int m = 0; m < MR; ++m)
      for (int q = 0; q < 4; ++q) part[h][m][q] = _mm512_setzero_pd();
  for (int64_t k0 = 0; k0 < kBlock; k0 += 2) {
    const __m512i c = _mm512_loadu_si512(codes + k0 * kBlock);
    const __m512i body = _mm512_add_epi8(c, c);
    const __m512i sign = _mm512_and_si512(c, _mm512_set1_epi8(static_cast<char>(0x80)));
    for (int h = 0; h < 2; ++h) {
      __m512d w[4];
      for (int q = 0; q < 4; ++q) {
        const __m512i idx = _mm512_load_si512(kVbmiIndex.idx[4 * h + q]);
        w[q] = _mm512_castsi512_pd(_mm512_maskz_permutex2var_epi8(kTopBytes, body, idx, sign));
      }
      for (int m = 0; m < MR; ++m) {
        const __m512d xv = _mm512_set1_pd(x[m * ldx + k0 + h]);
        for (int q = 0; q < 4; ++q)
          part[h % kSplit][m][q] = _mm512_fmadd_pd(xv, w[q], part[h % kSplit][m][q]);
      }
    }
  }
  __m512d acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q)
      acc[m][q] = kSplit == 2 ? _mm512_add_pd(part[0][m][q], part[kSplit - 1][m][q])
                              : part[0][m][q];
  finish_avx512<MR, true>(acc, xs, ldxs, ws, out);
}

enum class Conv { kF16, kInt, kVbmi };  // how the code path turns e4m3 codes into doubles

template <int MR, Conv kConv>
CSA_TARGET_AVX512 CSA_INLINE void code_rows(const double* x, int64_t ldx, const uint8_t* codes,
                                            const float* xs, int64_t ldxs, float ws,
                                            float* out) {
  if (kConv == Conv::kVbmi) {
    code_rows_vbmi<MR>(x, ldx, codes, xs, ldxs, ws, out);
  } else {
    code_rows_avx512<MR, kConv == Conv::kInt>(x, ldx, codes, xs, ldxs, ws, out);
  }
}

template <Conv kConv>
CSA_TARGET_AVX512 CSA_INLINE void task_avx512(const Job& j, size_t task) {
  constexpr int kTileRows = 6, kCodeRows = 4;
  const int64_t p = static_cast<int64_t>(task);
  alignas(64) float buf[kChunkRows * kBlock];
  alignas(64) double tile[kBlock * kBlock];
  for (int64_t i = 0; i < j.rows * kBlock; ++i) buf[i] = 0.0f;
  const uint8_t* panel = j.panels + p * j.K * kBlock;
  const int64_t tiled = j.rows >= kTileRows ? j.rows - j.rows % kTileRows : 0;
  for (int64_t kb = 0; kb < j.KB; ++kb) {
    const uint8_t* codes = panel + kb * kBlock * kBlock;
    const float ws = j.wscale[p * j.KB + kb];
    const double* x = j.xq + kb * kBlock;
    const float* xs = j.xs + kb;
    int64_t r = 0;
    if (tiled > 0) {
      convert_tile_avx512(codes, tile);
      for (; r < tiled; r += kTileRows)
        tile_rows_avx512<kTileRows>(x + r * j.K, j.K, tile, xs + r * j.KB, j.KB, ws,
                                    buf + r * kBlock);
    }
    constexpr Conv C = kConv;
    for (; r + kCodeRows <= j.rows; r += kCodeRows)
      code_rows<kCodeRows, C>(x + r * j.K, j.K, codes, xs + r * j.KB, j.KB, ws, buf + r * kBlock);
    float* o = buf + r * kBlock;
    switch (j.rows - r) {
      case 3: code_rows<3, C>(x + r * j.K, j.K, codes, xs + r * j.KB, j.KB, ws, o); break;
      case 2: code_rows<2, C>(x + r * j.K, j.K, codes, xs + r * j.KB, j.KB, ws, o); break;
      case 1: code_rows<1, C>(x + r * j.K, j.K, codes, xs + r * j.KB, j.KB, ws, o); break;
      default: break;
    }
  }
  const int64_t n0 = p * kBlock;
  const int64_t cols = j.N - n0 < kBlock ? j.N - n0 : kBlock;
  for (int64_t r = 0; r < j.rows; ++r)
    for (int64_t c = 0; c < cols; ++c) j.y[r * j.N + n0 + c] = buf[r * kBlock + c];
}
CSA_TARGET_AVX512 void task_avx512_vbmi(const Job& j, size_t t) { task_avx512<Conv::kVbmi>(j, t); }
CSA_TARGET_AVX512 void task_avx512_int(const Job& j, size_t t) { task_avx512<Conv::kInt>(j, t); }
CSA_TARGET_AVX512 void task_avx512_f16(const Job& j, size_t t) { task_avx512<Conv::kF16>(j, t); }
CSA_TARGET_AVX2 void task_avx2(const Job& j, size_t t) {
  run_task<convert_tile_avx2, 2, 16, true>(j, t);
}
#pragma GCC diagnostic pop
#endif

// act_quant of one row (xq stored as double times kXScale), compiled once per instruction
// set: the same exact operations, the wider sets inline the rounding and vectorise.
struct Quant {
  const float* x;
  double* xq;
  float* xs;
  int64_t K, KB;
};

CSA_INLINE void quantize_row_body(void* data, size_t row) {
  const Quant& q = *static_cast<const Quant*>(data);
  const int64_t r = static_cast<int64_t>(row);
  for (int64_t kb = 0; kb < q.KB; ++kb) {
    float v[kBlock];
    q.xs[r * q.KB + kb] = Fp8::quantize_block(q.x + r * q.K + kb * kBlock, v);
    for (int64_t i = 0; i < kBlock; ++i)
      q.xq[r * q.K + kb * kBlock + i] = static_cast<double>(v[i]) * kXScale;
  }
}

void quantize_row_scalar(void* data, size_t row) { quantize_row_body(data, row); }
#ifdef CSA_X86
CSA_TARGET_AVX512 void quantize_row_avx512(void* data, size_t row) {
  quantize_row_body(data, row);
}
CSA_TARGET_AVX2 void quantize_row_avx2(void* data, size_t row) { quantize_row_body(data, row); }
#endif

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512NoVbmi };

bool cpu_has(Isa isa) {
  if (isa == Isa::kAvx2) return cpu_has_x86_64_v3();
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512NoVbmi) return cpu_has_x86_64_v4();
  return true;
}

Isa select_isa() {
  const char* forced = std::getenv("CSA_FP8_LINEAR_ISA");
  if (forced != nullptr && *forced != '\0') {
    const std::string name = forced;
    Isa isa;
    if (name == "scalar") isa = Isa::kScalar;
    else if (name == "avx2") isa = Isa::kAvx2;
    else if (name == "avx512") isa = Isa::kAvx512;
    else if (name == "avx512-novbmi") isa = Isa::kAvx512NoVbmi;  // tests: the non-VBMI code
    else fail("CSA_FP8_LINEAR_ISA=\"" + name + "\" (expected avx512, avx2 or scalar)");
    if (!cpu_has(isa)) fail("CSA_FP8_LINEAR_ISA=" + name + " but this CPU does not support it");
    return isa;
  }
  if (cpu_has(Isa::kAvx512)) return Isa::kAvx512;
  if (cpu_has(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

// Attributes and node I/O, checked when the session creates the kernel.
void check_node(const OrtKernelInfo* info) {
  require_node_io(info, "Fp8Linear", 3, 1);
  int64_t block_size = kBlock;
  try {
    block_size = Ort::ConstKernelInfo(info).GetAttribute<int64_t>("block_size");
  } catch (const Ort::Exception&) {
    block_size = kBlock;  // absent: the default
  }
  if (block_size != kBlock)
    fail("block_size must be 32 (the only size supported), got " + std::to_string(block_size));
}

struct Fp8LinearKernel {
  Isa isa;
  PackedW constant_w;  // packed once when W is a constant initializer

  Fp8LinearKernel(const OrtApi*, const OrtKernelInfo* info) : isa(select_isa()) {
    check_node(info);
    const Ort::ConstValue w = constant_input(info, 1);
    if (w == nullptr) return;  // not a constant: packed on every call
    const std::vector<int64_t> shape = w.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2 || shape[0] < 0 || shape[1] < 0 || shape[1] % kBlock != 0)
      return;  // Compute reports it
    constant_w.pack(static_cast<const uint8_t*>(w.GetTensorRawData()), shape[0], shape[1]);
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<Ort::Float8E4M3FN_t>& w,
                      const Ort::Custom::Tensor<float>& wscale, Ort::Custom::Tensor<float>& y) {
    return status_of([&] { Run(ctx, x, w, wscale, y); });
  }

  void Run(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
           const Ort::Custom::Tensor<Ort::Float8E4M3FN_t>& w,
           const Ort::Custom::Tensor<float>& wscale, Ort::Custom::Tensor<float>& y) const {
    const std::vector<int64_t> x_shape = x.Shape();
    const Dims d = check_shapes(x_shape, w.Shape(), wscale.Shape());
    std::vector<int64_t> y_shape = x_shape;
    y_shape.back() = d.N;
    float* out = y.Allocate(y_shape);
    if (d.M == 0 || d.N == 0) return;
    if (d.K == 0) {
      for (int64_t i = 0; i < d.M * d.N; ++i) out[i] = 0.0f;
      return;
    }

    PackedW per_call;
    const PackedW* packed = &constant_w;
    if (constant_w.n != d.N || constant_w.k != d.K) {
      per_call.pack(reinterpret_cast<const uint8_t*>(w.Data()), d.N, d.K);
      packed = &per_call;
    }
    // task_daz: the task for a thread whose MXCSR treats denormals as zero. Subnormal
    // doubles as inputs need denormals honoured (DAZ clear, the default); under DAZ the
    // weights go through the f16 conversion, whose results are all normal. Each thread
    // checks its own MXCSR: onnxruntime's pool threads and the caller may differ.
    struct Call {
      Job job;
      void (*task)(const Job&, size_t);
      void (*task_daz)(const Job&, size_t);
    } call{{nullptr, nullptr, packed->data.data(), wscale.Data(), out, 0, d.N, d.K, d.KB},
           task_scalar, task_scalar};
#ifdef CSA_X86
    if (isa == Isa::kAvx512 || isa == Isa::kAvx512NoVbmi) {
      call.task = isa == Isa::kAvx512 && cpu_has_vbmi() ? task_avx512_vbmi : task_avx512_int;
      call.task_daz = task_avx512_f16;
    }
    if (isa == Isa::kAvx2) call.task = call.task_daz = task_avx2;
#endif
    const int64_t chunk = d.M < kChunkRows ? d.M : kChunkRows;
    std::vector<double> xq(static_cast<size_t>(chunk * d.K));
    std::vector<float> xs(static_cast<size_t>(chunk * d.KB));
    const float* xd = x.Data();
    Ort::KernelContext context(ctx);
    const bool parallel = d.M * d.N * d.K >= kParallelWork;
    for (int64_t m0 = 0; m0 < d.M; m0 += chunk) {
      const int64_t rows = d.M - m0 < chunk ? d.M - m0 : chunk;
      Quant quant{xd + m0 * d.K, xq.data(), xs.data(), d.K, d.KB};
      void (*quantize_row)(void*, size_t) = quantize_row_scalar;
#ifdef CSA_X86
      if (isa == Isa::kAvx512 || isa == Isa::kAvx512NoVbmi) quantize_row = quantize_row_avx512;
      if (isa == Isa::kAvx2) quantize_row = quantize_row_avx2;
#endif
      if (rows * d.K >= (int64_t{1} << 16)) {
        context.ParallelFor(quantize_row, static_cast<size_t>(rows), 0, &quant);
      } else {
        for (int64_t r = 0; r < rows; ++r) quantize_row(&quant, static_cast<size_t>(r));
      }
      call.job.xq = xq.data();
      call.job.xs = xs.data();
      call.job.y = out + m0 * d.N;
      call.job.rows = rows;
      // Tasks (one panel each) only compute into memory that exists; nothing throws.
      auto run = [](void* data, size_t t) {
        const Call& c = *static_cast<const Call*>(data);
#ifdef CSA_X86
        if (_mm_getcsr() & 0x40u) return c.task_daz(c.job, t);
#endif
        c.task(c.job, t);
      };
      const int64_t tasks = d.NB;
      if (tasks == 1 || !parallel) {
        for (int64_t t = 0; t < tasks; ++t) run(&call, static_cast<size_t>(t));
      } else {
        context.ParallelFor(run, static_cast<size_t>(tasks), 0, &call);
      }
    }
    const float nan = Fp8::from_bits(0x7FC00000u);
    for (const int64_t col : packed->nan_columns)
      for (int64_t m = 0; m < d.M; ++m) out[m * d.N + col] = nan;
  }
};

#ifdef CSA_WITH_CUDA
struct Fp8LinearCudaKernel {
  Fp8LinearCudaKernel(const OrtApi*, const OrtKernelInfo* info) { check_node(info); }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& x,
                      const Ort::Custom::Tensor<Ort::Float8E4M3FN_t>& w,
                      const Ort::Custom::Tensor<float>& wscale, Ort::Custom::Tensor<float>& y) {
    return status_of([&] {
      const std::vector<int64_t> x_shape = x.Shape();
      const Dims d = check_shapes(x_shape, w.Shape(), wscale.Shape());
      std::vector<int64_t> y_shape = x_shape;
      y_shape.back() = d.N;
      float* out = y.Allocate(y_shape);
      if (d.M == 0 || d.N == 0) return;
      void* stream = Ort::KernelContext(ctx).GetGPUComputeStream();
      const std::string error =
          launch_fp8_linear(x.Data(), reinterpret_cast<const uint8_t*>(w.Data()), wscale.Data(),
                            out, d.M, d.N, d.K, stream);
      if (!error.empty()) ORT_CXX_API_THROW("Fp8Linear (CUDA): " + error, ORT_RUNTIME_EXCEPTION);
    });
  }
};
#endif

}  // namespace

void AppendFp8LinearOps(std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops) {
  ops.emplace_back(
      Ort::Custom::CreateLiteCustomOp<Fp8LinearKernel>("Fp8Linear", "CPUExecutionProvider"));
#ifdef CSA_WITH_CUDA
  ops.emplace_back(Ort::Custom::CreateLiteCustomOp<Fp8LinearCudaKernel>("Fp8Linear",
                                                                        "CUDAExecutionProvider"));
#endif
}

}  // namespace csa
