// Fp8Linear's fast numerics (numerics = "fast"): the exact kernel's terms, summed in f32 in
// the order that suits vdpbf16ps. Why every term is exact:
//   act_quant's value X' = xq * xs (xq e4m3, 4 significant bits; xs a power of two) and the
//   weight W' = wq * ws (ws a power of two) are bf16 values, and a product of two bf16
//   values is exact in f32; so is X' * W' = (xq * wq) * (xs * ws), the definition's term,
//   as long as every value stays a normal float. The call checks that: every WScale value a
//   power of two in [2^-60, 2^20], every xs at most 2^40 (act_quant makes it at least
//   2^-22), X finite. Then |X'| in [2^-31, 2^49), |W'| in [2^-69, 2^29) and every product in
//   [2^-100, 2^78], so vdpbf16ps (which flushes denormals) sees no denormal, and every
//   partial sum is a multiple of 2^-100: 0 or normal. A call outside that range returns
//   false and runs the exact kernel.
// Only the order of the f32 additions differs from the definition (per K block an exact
// dot rounded once, then block by block): the outputs are within the reassociation bound
// of the exact ones. Each output is summed by one task in a fixed order, so the bits do not
// depend on the thread count; they do depend on the path: M <= 4 rows (decode) sum each
// output along k in 16 lanes (vdpbf16ps pairs), then a tree; more rows sum as TorchLinear's
// vdpbf16ps tiles (dp_bf16_tiles.h) in chunks of 512 k.
// W's codes become bf16 words of wq * 2^8 (the factor 2^-8 goes into the other operand):
// per byte, two GFNI affine bit moves give the high and low byte (s 1000 e3e2e1 and
// e0 mmm 0000: exponent 128 + e) where no code of the 64 has exponent field 0; otherwise two
// 128-entry byte tables (vpermi2b) give them, zero and subnormal codes included (raw
// subnormal bits would be flushed by vdpbf16ps), and the sign is ORed in.
//   decode: rows of W in order (one sequential stream, prefetched 16 KiB ahead), per 32 rows
//     (one WScale row) ws * 2^-8 folded into X (x'' = X' * ws * 2^-8 per K block, an
//     exponent add, bf16-exact by the range above: [2^-99, 2^61]), codes -> words,
//     vpunpck{l,h}bw (X is stored in that order), two vdpbf16ps per 64 weights and row of X:
//     7 instructions per 64 weights at M = 1 (load, 2 GFNI, a test, 2 unpacks, 2 vdpbf16ps;
//     the exact kernel ~13), four chains per output, the chains added, a tree per 16 outputs.
//   prefill: per task (64 columns x up to 480 rows) W is converted 512 k at a time into a
//     64 KiB bf16 panel chunk (the weights stay fp8 in memory; the tables), W' = wq * ws
//     by an exponent add, transposed 16 x 16 into TorchLinear's panel layout; 16 rows or
//     more on a CPU with AMX-BF16 multiply each chunk on AMX tiles (amx_bf16_tiles.h:
//     TDPBF16PS's own order within a 16-pair step; within the same bound), else vdpbf16ps.
// NaN codes are 0 in the sums; the op sets their columns to NaN (as the exact kernel).
// Built for x86-64-v4 + AVX512-BF16 + AVX512-VBMI + GFNI; elsewhere cpu_supported() is false.
#include "fp8_linear_fast.h"

#include <atomic>
#include <cstring>
#include <new>

#include "amx_bf16_tiles.h"
#include "dp_bf16_tiles.h"
#include "fp8_linear.h"
#include "fp8_linear_kernels.h"
#include "kernel_support.h"
#include "ort_cast.h"
#include "simd.h"

namespace csa::fp8_fast {

bool cpu_supported() {
#ifdef CSA_X86
  return cpu_has_avx512bf16() && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("gfni");
#else
  return false;
#endif
}

std::vector<int64_t> nan_columns(const uint8_t* w, int64_t N, int64_t K) {
  std::vector<int64_t> cols;
  for (int64_t n = 0; n < N; ++n) {
    uint8_t any = 0;
    for (int64_t k = 0; k < K; ++k) any |= static_cast<uint8_t>((w[n * K + k] & 0x7Fu) == 0x7Fu);
    if (any) cols.push_back(n);
  }
  return cols;
}

#ifdef CSA_X86
#define CSA_TARGET_FAST \
  __attribute__((target("arch=x86-64-v4,avx512bf16,avx512vbmi,gfni,prefer-vector-width=512")))

namespace {

constexpr int64_t kBlock = Fp8::kBlock;
constexpr uint32_t kBias = 127;
constexpr uint32_t kMaxXsExponent = 40;                    // xs <= 2^40
constexpr uint32_t kMinWsExponent = 60, kMaxWsExponent = 20;  // ws in [2^-60, 2^20]
constexpr int64_t kDecodeRows = 4;      // M at most this: the decode kernel
constexpr int64_t kGroupRows = 32;      // rows of W per WScale row (a decode task)
constexpr int64_t kPanel = dp_bf16::kPanel;
constexpr int64_t kChunkK = 512;        // prefill: k per converted panel chunk (64 KiB)
constexpr int64_t kMaxTaskRows = 480;   // prefill: rows per task at most
constexpr int64_t kPrefetchBytes = 16384;  // decode: how far ahead W is fetched (L2)

// Every WScale value a power of two in [2^-60, 2^20].
bool scales_in_range(const float* ws, int64_t count) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t b = Fp8::bits_of(ws[i]), e = b >> 23;  // sign 0: e is the exponent
    bad |= (b & 0x807FFFFFu) | static_cast<uint32_t>(e < kBias - kMinWsExponent) |
           static_cast<uint32_t>(e > kBias + kMaxWsExponent);
  }
  return bad == 0;
}

// W's words hold bf16(wq * 2^8) (the bit moves of CodeBytes::decode give that exponent);
// the 2^-8 goes into the other factor's exponent step.
constexpr int kWordExponent = 8;
constexpr float kWordScale = 256.0f;

// bf16 bits of e4m3fn magnitudes * 2^8 (NaN: 0) as low and high bytes, and the word orders.
struct Tables {
  alignas(64) uint8_t lo[128], hi[128];
  alignas(64) uint8_t interleave[2][64];    // vpermt2b: bytes (lo[i], hi[i]) of codes 32h..
  alignas(64) uint16_t unpack_order[2][32]; // vpermt2w: k of vpunpck{l,h}bw's words
  Tables() {
    for (int c = 0; c < 128; ++c) {
      const float v = c == 0x7F ? 0.0f : Fp8::e4m3_value(static_cast<uint8_t>(c)) * kWordScale;
      const uint32_t b = Fp8::bits_of(v) >> 16;  // exact: 4 significant bits
      lo[c] = static_cast<uint8_t>(b & 0xFFu);
      hi[c] = static_cast<uint8_t>(b >> 8);
    }
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 32; ++i) {
        interleave[h][2 * i] = static_cast<uint8_t>(32 * h + i);
        interleave[h][2 * i + 1] = static_cast<uint8_t>(64 + 32 * h + i);
        // unpacklo takes bytes 0-7 of each 128-bit lane, unpackhi bytes 8-15
        unpack_order[h][i] = static_cast<uint16_t>(16 * (i / 8) + 8 * h + i % 8);
      }
    }
  }
};
const Tables kTables;

// The exponent add on bf16 words that multiplies them by scale * 2^-8 (scale a power of
// two in range): (d - 8) * 2^7 as int16.
inline int16_t exponent_step(float scale) {
  const int32_t d = static_cast<int32_t>(Fp8::bits_of(scale) >> 23) - static_cast<int32_t>(kBias);
  return static_cast<int16_t>((d - kWordExponent) * 128);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// act_quant of rows [r0, r1) of X into X' = xq * xs as bf16 words ([M][K], natural order);
// false at a value that is not finite or an xs above 2^40.
CSA_TARGET_FAST bool quantize_rows(const float* x, int64_t K, int64_t r0, int64_t r1,
                                   uint16_t* xq) {
  const __m512i exp_bits = _mm512_set1_epi32(0x7F800000);
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k = 0; k < K; k += kBlock) {
      const float* s = x + r * K + k;
      const __m512 x0 = _mm512_loadu_ps(s), x1 = _mm512_loadu_ps(s + 16);
      const __mmask16 inf0 = _mm512_cmpeq_epi32_mask(
          _mm512_and_si512(_mm512_castps_si512(x0), exp_bits), exp_bits);
      const __mmask16 inf1 = _mm512_cmpeq_epi32_mask(
          _mm512_and_si512(_mm512_castps_si512(x1), exp_bits), exp_bits);
      if ((inf0 | inf1) != 0) return false;
      float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_and_ps(x0, abs_mask), _mm512_and_ps(x1, abs_mask)));
      if (amax < Fp8::kAmaxFloor) amax = Fp8::kAmaxFloor;
      const float xs = Fp8::pow2_ceil(amax * Fp8::kMaxInv);
      if ((Fp8::bits_of(xs) >> 23) > kBias + kMaxXsExponent) return false;
      // 2^-22 <= xs <= 2^40 here: multiplying by its reciprocal is the division
      const __m512 vxs = _mm512_set1_ps(xs), vinv = _mm512_set1_ps(Fp8::pow2_reciprocal(xs));
      const __m512 q0 = _mm512_mul_ps(fp8_kernels::e4m3_rne_avx512(_mm512_mul_ps(x0, vinv)), vxs);
      const __m512 q1 = _mm512_mul_ps(fp8_kernels::e4m3_rne_avx512(_mm512_mul_ps(x1, vinv)), vxs);
      _mm512_storeu_si512(xq + r * K + k, (__m512i)_mm512_cvtne2ps_pbh(q1, q0));  // exact
    }
  }
  return true;
}

// 64 codes -> bf16 words of their values (NaN codes 0), low and high bytes apart.
struct CodeBytes {
  __m512i lo0, lo1, hi0, hi1, sign;
  CSA_TARGET_FAST static CodeBytes load() {
    const Tables& t = kTables;
    return {_mm512_load_si512(t.lo), _mm512_load_si512(t.lo + 64), _mm512_load_si512(t.hi),
            _mm512_load_si512(t.hi + 64), _mm512_set1_epi8(static_cast<char>(0x80))};
  }
  CSA_TARGET_FAST void operator()(__m512i codes, __m512i& lo, __m512i& hi) const {
    lo = _mm512_permutex2var_epi8(lo0, codes, lo1);
    hi = _mm512_permutex2var_epi8(hi0, codes, hi1);
    hi = _mm512_ternarylogic_epi32(hi, codes, sign, 0xF8);  // hi | (codes & 0x80)
  }
  // The same words, by bit moves (GFNI) where no code has exponent field 0: a normal code
  // s eeee mmm becomes hi = s 1 000 e3 e2 e1, lo = e0 mmm 0000, i.e. bf16 exponent 128 + e,
  // value * 2^8 (NaN codes give a finite value; their columns become NaN). Zero and
  // subnormal codes take the tables.
  CSA_TARGET_FAST __attribute__((always_inline)) inline void decode(__m512i codes, __m512i& lo,
                                                                      __m512i& hi) const {
    if (_mm512_testn_epi8_mask(codes, _mm512_set1_epi8(0x78)) != 0) {
      (*this)(codes, lo, hi);
      return;
    }
    lo = _mm512_gf2p8affine_epi64_epi8(codes, _mm512_set1_epi64(0x01020408), 0);
    hi = _mm512_gf2p8affine_epi64_epi8(codes, _mm512_set1_epi64(0x1020400000000080), 0x40);
  }
};

// A horizontal sum of each of 16 vectors: lane i of the result is v[i]'s sum (a fixed tree).
CSA_TARGET_FAST inline __m512 sums16(const __m512 (&v)[16]) {
  __m512 b[8];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 c[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

struct Call {
  const uint16_t* xq;  // [M][K] X' as bf16
  const uint8_t* w;
  const float* ws;
  float* y;
  int64_t M, N, K, KB;
  int64_t panels, task_rows;  // prefill
  std::atomic<bool>* out_of_memory;  // a task's buffers could not be allocated
  bool round_output;  // Y through bfloat16 (ort_cast.h)
  bool amx;           // the prefill tiles are AMX's (amx_bf16_tiles.h)
};

// fn(call, t) on the pool for t in [0, tasks); an allocation failure in a task is recorded
// (nothing may throw into the pool) and thrown here.
void run_call(OrtKernelContext* ctx, const Call& c, size_t tasks, void (*fn)(const Call&, int64_t)) {
  struct Job {
    const Call* c;
    void (*fn)(const Call&, int64_t);
  } job{&c, fn};
  auto task = [](void* data, size_t t) {
    const Job& j = *static_cast<const Job*>(data);
    try {
      j.fn(*j.c, static_cast<int64_t>(t));
    } catch (...) {
      j.c->out_of_memory->store(true);
    }
  };
  run_tasks(ctx, c.M * c.N * c.K, serial_below::kMultiplyAdds, tasks, task, &job);
  if (c.out_of_memory->load()) throw std::bad_alloc();
}

// ------------------------------------------------------------------ decode (M <= 4)
// X' * ws * 2^-8 for one WScale row g, MR rows, in vpunpck order ([MR][ldf], zero past K).
template <int MR>
CSA_TARGET_FAST void fold_x(const Call& c, int64_t g, uint16_t* xf, int64_t ldf) {
  const Tables& t = kTables;
  const __m512i order0 = _mm512_load_si512(t.unpack_order[0]);
  const __m512i order1 = _mm512_load_si512(t.unpack_order[1]);
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  const float* ws = c.ws + g * c.KB;
  for (int m = 0; m < MR; ++m) {
    for (int64_t kb = 0; kb * kBlock < ldf; kb += 2) {
      const uint16_t* src = c.xq + m * c.K + kb * kBlock;
      __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
      if (kb < c.KB) {
        a = _mm512_loadu_si512(src);
        a = _mm512_mask_add_epi16(a, _mm512_test_epi16_mask(a, magnitude), a,
                                  _mm512_set1_epi16(exponent_step(ws[kb])));
      }
      if (kb + 1 < c.KB) {
        b = _mm512_loadu_si512(src + kBlock);
        b = _mm512_mask_add_epi16(b, _mm512_test_epi16_mask(b, magnitude), b,
                                  _mm512_set1_epi16(exponent_step(ws[kb + 1])));
      }
      uint16_t* dst = xf + m * ldf + kb * kBlock;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, order0, b));
      _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, order1, b));
    }
  }
}

// 64 codes against MR rows of X's words (x, row stride ldf): a += low words, b += high.
template <int MR>
CSA_TARGET_FAST __attribute__((always_inline)) inline void dot64(
    const CodeBytes& conv, __m512i codes, const uint16_t* x, int64_t ldf, __m512 (&a)[MR],
    __m512 (&b)[MR]) {
  __m512i lo, hi;
  conv.decode(codes, lo, hi);
  const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
  const __m512bh w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
  for (int m = 0; m < MR; ++m) {
    a[m] = _mm512_dpbf16_ps(a[m], w0, (__m512bh)_mm512_loadu_si512(x + m * ldf));
    b[m] = _mm512_dpbf16_ps(b[m], w1, (__m512bh)_mm512_loadu_si512(x + m * ldf + 32));
  }
}

// Rows [n0, n0 + rows) of W (rows <= R) against MR rows of X, a row at a time (W is read
// as one sequential stream): per output four chains of 16 lanes along k, added, then the
// rows' lanes summed by one tree.
template <int R, int MR>
CSA_TARGET_FAST void decode_rows(const Call& c, int64_t n0, int64_t rows, const uint16_t* xf,
                                 int64_t ldf) {
  static_assert(R * MR <= 16, "one sums16 tree");
  const CodeBytes conv = CodeBytes::load();
  __m512 v[16];
  for (int i = R * MR; i < 16; ++i) v[i] = _mm512_setzero_ps();
  const int64_t full = c.K / 128 * 128;
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = c.w + (n0 + (r < rows ? r : rows - 1)) * c.K;
    __m512 a0[MR], a1[MR], a2[MR], a3[MR];
    for (int m = 0; m < MR; ++m)
      a0[m] = a1[m] = a2[m] = a3[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 128) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k + kPrefetchBytes), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(row + k + 64 + kPrefetchBytes), _MM_HINT_T1);
      dot64<MR>(conv, _mm512_loadu_si512(row + k), xf + k, ldf, a0, a1);
      dot64<MR>(conv, _mm512_loadu_si512(row + k + 64), xf + k + 64, ldf, a2, a3);
    }
    if (full < c.K) {  // 32, 64 or 96 codes left; X's words are zero past K
      const int64_t rest = c.K - full;
      const __mmask64 half = 0xFFFFFFFFu;
      dot64<MR>(conv, _mm512_maskz_loadu_epi8(rest >= 64 ? ~__mmask64{0} : half, row + full),
                xf + full, ldf, a0, a1);
      if (rest > 64)
        dot64<MR>(conv, _mm512_maskz_loadu_epi8(half, row + full + 64), xf + full + 64, ldf, a2, a3);
    }
    for (int m = 0; m < MR; ++m)
      v[r * MR + m] = _mm512_add_ps(_mm512_add_ps(a0[m], a1[m]), _mm512_add_ps(a2[m], a3[m]));
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, sums16(v));
  for (int64_t r = 0; r < rows; ++r)
    for (int m = 0; m < MR; ++m) {
      const float v = s[r * MR + m];
      c.y[m * c.N + n0 + r] = c.round_output ? ort_cast::cast_bf16(v) : v;
    }
}

template <int MR>
CSA_TARGET_FAST void decode_group(const Call& c, int64_t g, uint16_t* xf, int64_t ldf) {
  constexpr int R = 16 / MR;
  fold_x<MR>(c, g, xf, ldf);
  const int64_t end = (g + 1) * kGroupRows < c.N ? (g + 1) * kGroupRows : c.N;
  for (int64_t n = g * kGroupRows; n < end; n += R)
    decode_rows<R, MR>(c, n, end - n < R ? end - n : R, xf, ldf);
}

void decode_task(const Call& c, int64_t g) {
  const int64_t ldf = (c.K + 127) / 128 * 128;
  thread_local std::vector<uint16_t> buffer;
  if (buffer.size() < static_cast<size_t>(kDecodeRows * ldf))
    buffer.resize(static_cast<size_t>(kDecodeRows * ldf));
  switch (c.M) {
    case 1: decode_group<1>(c, g, buffer.data(), ldf); break;
    case 2: decode_group<2>(c, g, buffer.data(), ldf); break;
    case 3: decode_group<3>(c, g, buffer.data(), ldf); break;
    default: decode_group<4>(c, g, buffer.data(), ldf); break;
  }
}

// ------------------------------------------------------------------ prefill (M > 4)
// Columns [64 panel, +64) of W over k in [k0, k1) as bf16 pairs W' = wq * ws: buf[p][64].
CSA_TARGET_FAST void convert_chunk(const Call& c, int64_t panel, int64_t k0, int64_t k1,
                                   uint32_t* buf) {
  const CodeBytes conv = CodeBytes::load();
  const Tables& t = kTables;
  const __m512i ilv0 = _mm512_load_si512(t.interleave[0]);
  const __m512i ilv1 = _mm512_load_si512(t.interleave[1]);
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  for (int64_t q = 0; q < kPanel / 16; ++q) {
    const int64_t n0 = panel * kPanel + 16 * q;
    for (int64_t k = k0; k < k1; k += kBlock) {
      const int64_t kb = k / kBlock;
      __m512i v[16];
      for (int i = 0; i < 8; ++i) {
        const int64_t n = n0 + 2 * i;  // n and n + 1: one WScale row
        const __m256i a = n < c.N ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.w + n * c.K + k))
                                  : _mm256_setzero_si256();
        const __m256i b = n + 1 < c.N
                              ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.w + (n + 1) * c.K + k))
                              : _mm256_setzero_si256();
        __m512i lo, hi;
        conv(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), lo, hi);
        const __m512i step =
            _mm512_set1_epi16(n < c.N ? exponent_step(c.ws[(n / kGroupRows) * c.KB + kb]) : 0);
        for (int h = 0; h < 2; ++h) {
          const __m512i wv = _mm512_permutex2var_epi8(lo, h == 0 ? ilv0 : ilv1, hi);
          v[2 * i + h] = _mm512_mask_add_epi16(wv, _mm512_test_epi16_mask(wv, magnitude), wv, step);
        }
      }
      fp8_kernels::transpose16(v);  // v[p]: pair p of the 16 columns
      uint32_t* dst = buf + ((k - k0) / 2) * kPanel + 16 * q;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * kPanel, v[p]);
    }
  }
}

CSA_TARGET_FAST void prefill_task(const Call& c, int64_t t) {
  const int64_t panel = t % c.panels, r0 = (t / c.panels) * c.task_rows;
  const int64_t rows = c.M - r0 < c.task_rows ? c.M - r0 : c.task_rows;
  thread_local std::vector<uint32_t> chunk;
  thread_local std::vector<float> out;
  if (chunk.size() < static_cast<size_t>(kChunkK / 2 * kPanel))
    chunk.resize(static_cast<size_t>(kChunkK / 2 * kPanel));
  if (out.size() < static_cast<size_t>(kMaxTaskRows * kPanel))
    out.resize(static_cast<size_t>(kMaxTaskRows * kPanel));
  std::memset(out.data(), 0, static_cast<size_t>(rows * kPanel) * sizeof(float));
  const int64_t pairs = c.K / 2;
  const uint32_t* xb = reinterpret_cast<const uint32_t*>(c.xq) + r0 * pairs;
  for (int64_t k0 = 0; k0 < c.K; k0 += kChunkK) {
    const int64_t k1 = k0 + kChunkK < c.K ? k0 + kChunkK : c.K;
    convert_chunk(c, panel, k0, k1, chunk.data());
    if (c.amx)
      amx_bf16::amx_rows(xb + k0 / 2, pairs, rows, chunk.data(), 0, (k1 - k0) / 2, out.data());
    else
      dp_bf16::dp_rows(xb + k0 / 2, pairs, rows, chunk.data(), 0, (k1 - k0) / 2, out.data());
  }
  const int64_t n0 = panel * kPanel, cols = c.N - n0 < kPanel ? c.N - n0 : kPanel;
  for (int64_t r = 0; r < rows; ++r) {
    float* y = c.y + (r0 + r) * c.N + n0;
    const float* o = out.data() + r * kPanel;
    if (c.round_output) {
      for (int64_t i = 0; i < cols; ++i) y[i] = ort_cast::cast_bf16(o[i]);
    } else {
      std::memcpy(y, o, static_cast<size_t>(cols) * sizeof(float));
    }
  }
}

#pragma GCC diagnostic pop

}  // namespace

bool amx_supported() { return cpu_supported() && amx_bf16::enable(); }

bool run(OrtKernelContext* ctx, const Problem& p) {
  const int64_t KB = p.K / kBlock, NB = (p.N + kGroupRows - 1) / kGroupRows;
  if (!scales_in_range(p.ws, NB * KB)) return false;
  // X' for the call, kept from call to call (the calling thread's)
  thread_local std::vector<uint16_t> xq_buffer;
  if (xq_buffer.size() < static_cast<size_t>(p.M * p.K))
    xq_buffer.resize(static_cast<size_t>(p.M * p.K));
  uint16_t* xq = xq_buffer.data();
  {
    constexpr int64_t kQuantRows = 16;
    struct Quant {
      const Problem* p;
      uint16_t* xq;
      std::atomic<bool> ok{true};
    } q{&p, xq};
    auto quantize = [](void* data, size_t i) {
      Quant& q = *static_cast<Quant*>(data);
      const int64_t r0 = static_cast<int64_t>(i) * kQuantRows;
      const int64_t r1 = r0 + kQuantRows < q.p->M ? r0 + kQuantRows : q.p->M;
      if (!quantize_rows(q.p->x, q.p->K, r0, r1, q.xq)) q.ok.store(false);
    };
    run_tasks(ctx, p.M * p.K, serial_below::kElements,
              static_cast<size_t>((p.M + kQuantRows - 1) / kQuantRows), quantize, &q);
    if (!q.ok.load()) return false;
  }
  std::atomic<bool> out_of_memory{false};
  Call c{xq, p.w, p.ws, p.y, p.M, p.N, p.K, KB, (p.N + kPanel - 1) / kPanel, 0, &out_of_memory,
         p.round_output, p.amx && p.M >= kAmxMinRows};
  if (p.M <= kDecodeRows) {
    run_call(ctx, c, static_cast<size_t>(NB), decode_task);
    return true;
  }
  // rows per task: the fewest blocks of at most kMaxTaskRows, a multiple of the tile's rows
  // (vdpbf16ps: 6; AMX: a 32-row strip)
  const int64_t blocks = (p.M + kMaxTaskRows - 1) / kMaxTaskRows;
  const int64_t per = (p.M + blocks - 1) / blocks;
  const int64_t tile = c.amx ? 2 * amx_bf16::kTile : dp_bf16::kTileRows;  // rows of a tile
  c.task_rows = (per + tile - 1) / tile * tile;
  const int64_t row_blocks = (p.M + c.task_rows - 1) / c.task_rows;
  run_call(ctx, c, static_cast<size_t>(c.panels * row_blocks), prefill_task);
  return true;
}

#else   // not x86: cpu_supported() is false and the op never calls run
bool amx_supported() { return false; }
bool run(OrtKernelContext*, const Problem&) { return false; }
#endif  // CSA_X86

}  // namespace csa::fp8_fast
