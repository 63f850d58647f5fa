// Fused CPU kernels of the ``w8a8`` INT8 scheme (engine/quant/int8.py), built on first use by
// torch.utils.cpp_extension and cached.
//
// lmforge_int8::quantize_per_token(x [M, K] bf16 / fp32) -> (int8 [M, K], float32 scale [M, 1]):
//   one pass per row for max|x| and one to quantize, bit-identical to the ATen reference
//   ``quantize_per_token``: scale = max(max|x_row|, 1e-8) / 127, q = clamp(round_half_even(x / scale), -127, 127).
// lmforge_int8::w8a8_linear(x [M, K], oneDNN-packed int8 weight, w_scale [N], w_zero_point [N], bias [N]?) -> [M, N]
//   in x's dtype: quantize_per_token, onednn::qlinear_pointwise (int8 x int8 -> float32 acc * w_scale), then
//   acc * x_scale (+ bias) rounded once to x's dtype, as the ATen path does (built with -ffp-contract=off so no
//   fused multiply-add changes the rounding). The activations go to oneDNN as uint8 q + 128 with zero point 128
//   (the same integer sums): VNNI's dot product is u8 x s8, and on a VNNI CPU without AMX oneDNN runs signed
//   int8 activations on its slow reference kernel (`ref_int8`; docs/quantization.md).
// lmforge_int8::w8a8_linear_epilogue(x, w_packed, w_scale, w_zero_point, bias?, residual [M, N]?, silu_mul) -> y
//   the same GEMM with the layer's element-wise work done on the float32 accumulators before the one rounding:
//   residual: y [M, N] = acc * x_scale (+ bias) + residual; silu_mul (a [gate; up] layer, N even):
//   y [M, N / 2] = silu(gate) * up. Replaces the separate add / silu / mul ops (and their roundings).
// lmforge_int8::w8a8_gemv(x [M, K], w [N, K] int8, w_sum [N] int32, w_scale [N], bias [N]?, residual?, silu_mul)
//   -> y, M <= 4: `w8a8_linear` / `w8a8_linear_epilogue` (residual or silu_mul) for a decode step of a few rows
//   on the plain int8 weight: the same quantize_per_token (q + 128 as u8), the int32 sums by VNNI's u8 x s8 dot
//   product (VPDPBUSD, 64 weights an instruction) less 128 * w_sum (the zero point), float(acc) * w_scale, then
//   the same epilogue. A step of one sequence is bound by reading the weights, and oneDNN's int8 GEMM of one row
//   is slower than that; widening int8 weights to float (the weight-only GEMV) is bound by those instructions.
//   With AVX2 and no AVX512-VNNI the activations stay signed int8 q and the same int32 sums come from VPMADDUBSW
//   on |w| (u8) x sign(w) * q (s8), whose pairs (<= 2 * 127 * 127) cannot saturate int16, then VPMADDWD by ones
//   (32 weights a step): oneDNN's own AVX2 int8 GEMM multiplies u8 q + 128 by w and does saturate. Without either,
//   a scalar loop.
// lmforge_int8::pack_weight_i16(w [N, K] int8) -> int16 panels; lmforge_int8::w8a8_gemm_i16(x [M, K], w_packed,
//   w_scale [N], bias?, residual?, silu_mul) -> y: `w8a8_linear_epilogue`'s arithmetic for CPUs whose oneDNN int8 GEMM
//   saturates (AVX2 without VNNI), the exact int32 sums by VPMADDWD on int16 copies of q and w (see below).
// lmforge_int8::block_hadamard(x [M, K] bf16 / fp32, int block) -> [M, K] in x's dtype: each run of `block`
//   consecutive elements of a row times the unnormalized Sylvester Hadamard matrix H_block (entries +-1,
//   H H^T = block I), by the fast Walsh-Hadamard butterflies in float32 (stages of stride 1, 2, 4, ...), rounded
//   once. The online half of the w8a8 input rotation (W8A8Linear.input_hadamard); with AVX-512 the strides below
//   16 (AVX2: below 8) run as lane permutes inside a vector, with the scalar loop's results bit for bit (the same
//   adds, same order).
// With AVX-512 (F, BW) the passes over rows run 16 elements at a time, with the scalar loops' results (the same
// division, round-half-even and clamp; the SiLU by the polynomial exp of common.h, within ~2e-7 of expf).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define LMFORGE_W8A8_AVX512 1
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))

// w8a8_gemv reads signed activations q (the AVX2 sums above), not q + 128
#define LMFORGE_W8A8_GEMV_SIGNED 1
#endif

namespace {

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (v + magic) - magic == round-half-even(v) for |v| < 2^22

using lmforge_bf16::bf16_to_float;
using lmforge_bf16::bits_to_float;
using lmforge_bf16::float_to_bf16;
using lmforge_bf16::float_to_bits;

// Element loads as float and |x| bit patterns (monotonic in |x| for non-NaN values).
struct BF16Row {
  using raw_t = uint16_t;
  static inline uint32_t abs_bits(raw_t r) { return static_cast<uint32_t>(r & 0x7fffu); }
  static inline float abs_value(uint32_t bits) { return bits_to_float(bits << 16); }
  static inline float load(raw_t r) { return bf16_to_float(r); }
  static inline raw_t store(float f) { return float_to_bf16(f); }
};

struct F32Row {
  using raw_t = uint32_t;
  static inline uint32_t abs_bits(raw_t r) { return r & 0x7fffffffu; }
  static inline float abs_value(uint32_t bits) { return bits_to_float(bits); }
  static inline float load(raw_t r) { return bits_to_float(r); }
  static inline raw_t store(float f) { return float_to_bits(f); }
};

// Rows per task of at::parallel_for: 2^14 elements, so a decode step of 64 rows splits over the threads the int8
// GEMM uses (about 10% faster on SmolLM2's MLP at 64 rows than every pass on the calling thread), and one row
// (a lone sequence) stays on the calling thread. With one torch thread parallel_for runs inline.
inline int64_t grain_rows(int64_t cols) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1));
}

// Scalar row kernels; the vector kernels below give the same bits (same division, round-half-even, clamp).
template <typename Row>
inline uint32_t amax_bits_scalar(const typename Row::raw_t* row, int64_t begin, int64_t cols, uint32_t amax_bits) {
  for (int64_t k = begin; k < cols; ++k) amax_bits = std::max(amax_bits, Row::abs_bits(row[k]));
  return amax_bits;
}

template <typename Row, typename Out>
inline void quantize_scalar(const typename Row::raw_t* row, int64_t begin, int64_t cols, float s, Out* out) {
  constexpr int32_t offset = std::is_same_v<Out, uint8_t> ? 128 : 0;
  for (int64_t k = begin; k < cols; ++k) {
    float v = Row::load(row[k]) / s;
    v = (v + kRoundMagic) - kRoundMagic;
    v = std::min(std::max(v, -127.0f), 127.0f);
    out[k] = static_cast<Out>(static_cast<int32_t>(v) + offset);
  }
}

#ifdef LMFORGE_W8A8_AVX512
// 16 elements of a row as float32 (a BF16 value is the high half of a float32).
template <typename Row>
inline __m512 load16(const typename Row::raw_t* p) {
  if constexpr (std::is_same_v<Row, BF16Row>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

template <typename Row>
inline uint32_t amax_bits_avx512(const typename Row::raw_t* row, int64_t cols, int64_t* done) {
  // |x| bits of BF16 compare as 16-bit lanes of the raw data (32 per vector), of FP32 as 32-bit lanes.
  const int64_t step = 64 / static_cast<int64_t>(sizeof(typename Row::raw_t));
  const int64_t vec_end = cols - cols % step;
  uint32_t amax = 0;
  if constexpr (std::is_same_v<Row, BF16Row>) {
    __m512i m = _mm512_setzero_si512();
    const __m512i mask = _mm512_set1_epi16(0x7fff);
    for (int64_t k = 0; k < vec_end; k += step)
      m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(row + k), mask));
    const __m512i m32 = _mm512_max_epu32(_mm512_and_si512(m, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(m, 16));
    amax = static_cast<uint32_t>(_mm512_reduce_max_epu32(m32));
  } else {
    __m512i m = _mm512_setzero_si512();
    const __m512i mask = _mm512_set1_epi32(0x7fffffff);
    for (int64_t k = 0; k < vec_end; k += step)
      m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512(row + k), mask));
    amax = static_cast<uint32_t>(_mm512_reduce_max_epu32(m));
  }
  *done = vec_end;
  return amax;
}

template <typename Row, typename Out>
inline int64_t quantize_avx512(const typename Row::raw_t* row, int64_t cols, float s, Out* out) {
  constexpr int32_t offset = std::is_same_v<Out, uint8_t> ? 128 : 0;
  const int64_t vec_end = cols - cols % 16;
  const __m512 vs = _mm512_set1_ps(s), magic = _mm512_set1_ps(kRoundMagic);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512i voffset = _mm512_set1_epi32(offset);
  for (int64_t k = 0; k < vec_end; k += 16) {
    __m512 v = _mm512_div_ps(load16<Row>(row + k), vs);
    v = _mm512_sub_ps(_mm512_add_ps(v, magic), magic);
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));  // a NaN stays NaN (max/min return the second operand), as in the scalar loop
    const __m512i i = _mm512_add_epi32(_mm512_cvttps_epi32(v), voffset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(i));
  }
  return vec_end;
}

// Stores 16 floats rounded as Row::store (bf16: round-half-even, NaN -> 0x7fc0).
template <typename Row>
inline void store16(typename Row::raw_t* p, __m512 v) {
  if constexpr (std::is_same_v<Row, BF16Row>) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  } else {
    _mm512_storeu_ps(reinterpret_cast<float*>(p), v);
  }
}

#endif

// Out = int8_t: q; Out = uint8_t: q + 128 (oneDNN's u8 activations with zero point 128, `w8a8_linear`).
template <typename Row, typename Out = int8_t>
void quantize_rows(const typename Row::raw_t* x, int64_t rows, int64_t cols, Out* q, float* scale) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const typename Row::raw_t* row = x + m * cols;
      int64_t done = 0;
      uint32_t amax_bits = 0;
#ifdef LMFORGE_W8A8_AVX512
      amax_bits = amax_bits_avx512<Row>(row, cols, &done);
#endif
      amax_bits = amax_bits_scalar<Row>(row, done, cols, amax_bits);
      const float s = std::max(Row::abs_value(amax_bits), 1e-8f) / 127.0f;
      scale[m] = s;
      Out* out = q + m * cols;
      done = 0;
#ifdef LMFORGE_W8A8_AVX512
      done = quantize_avx512<Row, Out>(row, cols, s, out);
#endif
      quantize_scalar<Row, Out>(row, done, cols, s, out);
    }
  });
}

// The output pass of `w8a8_linear` (no residual, no silu_mul) and the epilogues of `w8a8_linear_epilogue`, on the
// float32 accumulators acc [rows, acc_cols] (= sum q w8 * s_w):
//   plain: y[m, n] = store(acc[m, n] * s[m] (+ bias[n])), bit-identical to the ATen path (mul, then add);
//   residual: y[m, n] = store(acc[m, n] * s[m] + bias[n] + residual[m, n]), cols = acc_cols;
//   silu_mul: g = acc[m, n] * s[m] + bias[n], u = acc[m, cols + n] * s[m] + bias[cols + n],
//             y[m, n] = store(silu(g) * u), cols = acc_cols / 2;
// each computed in float32 and rounded once to the output dtype.
template <typename Row>
void epilogue_rows(const float* acc, const float* scale, const float* bias, const typename Row::raw_t* residual,
                   bool silu_mul, int64_t rows, int64_t cols, typename Row::raw_t* y) {
  const int64_t acc_cols = silu_mul ? 2 * cols : cols;
  at::parallel_for(0, rows, grain_rows(acc_cols), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float s = scale[m];
      const float* a = acc + m * acc_cols;
      typename Row::raw_t* out = y + m * cols;
      int64_t n = 0;
#ifdef LMFORGE_W8A8_AVX512
      const __m512 vs = _mm512_set1_ps(s);
      for (; n + 16 <= cols; n += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(a + n), vs);
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
        if (silu_mul) {
          __m512 u = _mm512_mul_ps(_mm512_loadu_ps(a + cols + n), vs);
          if (bias != nullptr) u = _mm512_add_ps(u, _mm512_loadu_ps(bias + cols + n));
          v = _mm512_mul_ps(lmforge_vec::silu(v), u);
        } else if (residual != nullptr) {
          v = _mm512_add_ps(v, load16<Row>(residual + m * cols + n));
        }
        store16<Row>(out + n, v);
      }
#endif
      for (; n < cols; ++n) {
        float v = a[n] * s;
        if (bias != nullptr) v += bias[n];
        if (silu_mul) {
          float u = a[cols + n] * s;
          if (bias != nullptr) u += bias[cols + n];
          v = v / (1.0f + std::exp(-v)) * u;
        } else if (residual != nullptr) {
          v += Row::load(residual[m * cols + n]);
        }
        out[n] = Row::store(v);
      }
    }
  });
}

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32, got ",
              x.scalar_type());
}

template <typename Out>
std::tuple<at::Tensor, at::Tensor> quantize_per_token_as(const at::Tensor& x, at::ScalarType out_type) {
  check_input(x);
  auto xc = x.contiguous();
  const int64_t rows = xc.size(0), cols = xc.size(1);
  auto q = at::empty({rows, cols}, xc.options().dtype(out_type));
  auto scale = at::empty({rows, 1}, xc.options().dtype(at::kFloat));
  Out* qp = static_cast<Out*>(q.data_ptr());
  if (xc.scalar_type() == at::kBFloat16) {
    quantize_rows<BF16Row, Out>(static_cast<const uint16_t*>(xc.const_data_ptr()), rows, cols, qp,
                                scale.data_ptr<float>());
  } else {
    quantize_rows<F32Row, Out>(static_cast<const uint32_t*>(xc.const_data_ptr()), rows, cols, qp,
                               scale.data_ptr<float>());
  }
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x) {
  return quantize_per_token_as<int8_t>(x, at::kChar);
}

// The int8 GEMM of `w8a8_linear`: (acc [M, N] float32 = sum_k q x w8 * w_scale, x_scale [M, 1]).
std::tuple<at::Tensor, at::Tensor> onednn_accumulate(const at::Tensor& x, const at::Tensor& w_packed,
                                                     const at::Tensor& w_scale, const at::Tensor& w_zero_point) {
  auto [q, scale] = quantize_per_token_as<uint8_t>(x, at::kByte);  // q + 128
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("onednn::qlinear_pointwise", "")
                       .typed<at::Tensor(at::Tensor, double, int64_t, at::Tensor, at::Tensor, at::Tensor,
                                         std::optional<at::Tensor>, double, int64_t, std::optional<at::ScalarType>,
                                         std::string_view, c10::List<std::optional<at::Scalar>>, std::string_view)>();
  at::Tensor acc = op.call(q, 1.0, 128, w_packed, w_scale, w_zero_point, std::nullopt, 1.0, 0, at::kFloat, "none",
                           c10::List<std::optional<at::Scalar>>(), "")
                       .contiguous();
  return {acc, scale};
}

// acc [M, N] float32 * x_scale (+ bias) (+ residual, or silu(gate) * up) in x's dtype (`epilogue_rows`); `op` names
// the caller in errors.
at::Tensor finish(const char* op, const at::Tensor& x, const at::Tensor& acc, const at::Tensor& scale,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual, bool silu_mul) {
  const int64_t rows = acc.size(0), acc_cols = acc.size(1);
  TORCH_CHECK(!silu_mul || acc_cols % 2 == 0, op, ": silu_mul needs an even out_features, got ", acc_cols);
  const int64_t cols = silu_mul ? acc_cols / 2 : acc_cols;
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->dim() == 2 && residual->size(0) == rows &&
                    residual->size(1) == cols,
                op, ": residual must be [", rows, ", ", cols, "] in x's dtype");
    res = residual->contiguous();
  }
  auto y = at::empty({rows, cols}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  const float* ap = acc.const_data_ptr<float>();
  const float* sp = scale.const_data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    const auto* rp = res.defined() ? static_cast<const uint16_t*>(res.const_data_ptr()) : nullptr;
    epilogue_rows<BF16Row>(ap, sp, bp, rp, silu_mul, rows, cols, static_cast<uint16_t*>(y.data_ptr()));
  } else {
    const auto* rp = res.defined() ? static_cast<const uint32_t*>(res.const_data_ptr()) : nullptr;
    epilogue_rows<F32Row>(ap, sp, bp, rp, silu_mul, rows, cols, static_cast<uint32_t*>(y.data_ptr()));
  }
  return y;
}

// The oneDNN int8 GEMM, then `finish`.
at::Tensor linear_with_epilogue(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale,
                                const at::Tensor& w_zero_point, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& residual, bool silu_mul) {
  auto [acc, scale] = onednn_accumulate(x, w_packed, w_scale, w_zero_point);
  return finish("w8a8_linear_epilogue", x, acc, scale, bias, residual, silu_mul);
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale,
                       const at::Tensor& w_zero_point, const std::optional<at::Tensor>& bias) {
  return linear_with_epilogue(x, w_packed, w_scale, w_zero_point, bias, std::nullopt, false);
}

at::Tensor w8a8_linear_epilogue(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale,
                                const at::Tensor& w_zero_point, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& residual, bool silu_mul) {
  const bool has_residual = residual.has_value() && residual->defined();
  TORCH_CHECK(has_residual != silu_mul, "w8a8_linear_epilogue: give a residual or silu_mul=True, not both or neither");
  return linear_with_epilogue(x, w_packed, w_scale, w_zero_point, bias, residual, silu_mul);
}

// ---------------------------------------------------------------------------------------------- few-row GEMV

#ifdef LMFORGE_W8A8_GEMV_SIGNED
// acc[m * n + r] = float(sum_k q[m, k] * w[r, k]) * w_scale[r] for rows r in [r_begin, r_end), q signed int8.
template <int M>
void w8a8_gemv_rows_signed(const int8_t* q, int64_t k, const int8_t* w, const float* w_scale, int64_t r_begin,
                           int64_t r_end, float* acc, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int8_t* row = w + r * k;
    __m256i a[M];
    for (int m = 0; m < M; ++m) a[m] = _mm256_setzero_si256();
    int64_t c = 0;
    for (; c + 32 <= k; c += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
      const __m256i w_abs = _mm256_abs_epi8(wv);  // |w| <= 127: no -128 in a stored weight
      for (int m = 0; m < M; ++m) {
        const __m256i qs =
            _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * k + c)), wv);
        a[m] = _mm256_add_epi32(a[m], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, qs), ones));
      }
    }
    for (int m = 0; m < M; ++m) {
      int32_t sum = lmforge_vec::hsum8_epi32(a[m]);
      for (int64_t j = c; j < k; ++j) sum += static_cast<int32_t>(q[m * k + j]) * static_cast<int32_t>(row[j]);
      acc[m * n + r] = static_cast<float>(sum) * w_scale[r];
    }
  }
}
#endif

// acc[m * n + r] = float(sum_k u[m, k] * w[r, k] - 128 * w_sum[r]) * w_scale[r] for rows r in [r_begin, r_end).
template <int M>
void w8a8_gemv_rows(const uint8_t* u, int64_t k, const int8_t* w, const int32_t* w_sum, const float* w_scale,
                    int64_t r_begin, int64_t r_end, float* acc, int64_t n) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int8_t* row = w + r * k;
    int32_t sums[M];
    int64_t c = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_si512();
    for (; c + 128 <= k; c += 128) {
      const __m512i w0 = _mm512_loadu_si512(row + c), w1 = _mm512_loadu_si512(row + c + 64);
      for (int m = 0; m < M; ++m) {
        a0[m] = _mm512_dpbusd_epi32(a0[m], _mm512_loadu_si512(u + m * k + c), w0);
        a1[m] = _mm512_dpbusd_epi32(a1[m], _mm512_loadu_si512(u + m * k + c + 64), w1);
      }
    }
    if (c + 64 <= k) {
      const __m512i w0 = _mm512_loadu_si512(row + c);
      for (int m = 0; m < M; ++m) a0[m] = _mm512_dpbusd_epi32(a0[m], _mm512_loadu_si512(u + m * k + c), w0);
      c += 64;
    }
    for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_epi32(_mm512_add_epi32(a0[m], a1[m]));
#else
    for (int m = 0; m < M; ++m) sums[m] = 0;
#endif
    for (; c < k; ++c)
      for (int m = 0; m < M; ++m) sums[m] += static_cast<int32_t>(u[m * k + c]) * static_cast<int32_t>(row[c]);
    for (int m = 0; m < M; ++m) acc[m * n + r] = static_cast<float>(sums[m] - 128 * w_sum[r]) * w_scale[r];
  }
}

at::Tensor w8a8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_sum, const at::Tensor& w_scale,
                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual, bool silu_mul) {
  check_input(x);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(m >= 1 && m <= 4, "w8a8_gemv: x must have 1 to 4 rows, got ", m);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.size(1) == k && w.is_contiguous(),
              "w8a8_gemv: w must be contiguous int8 [N, K] with K = x's columns");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.numel() == n && w_sum.is_contiguous(),
              "w8a8_gemv: w_sum must be contiguous int32 [N] (each weight row's sum)");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == n && w_scale.is_contiguous(),
              "w8a8_gemv: w_scale must be contiguous float32 [N]");
  TORCH_CHECK(!(residual.has_value() && residual->defined() && silu_mul),
              "w8a8_gemv: give residual or silu_mul, not both");
  at::Tensor acc = at::empty({m, n}, x.options().dtype(at::kFloat));
  const int8_t* wp = w.const_data_ptr<int8_t>();
  const float* scp = w_scale.const_data_ptr<float>();
  float* ap = acc.data_ptr<float>();
#ifdef LMFORGE_W8A8_GEMV_SIGNED
  auto [q, scale] = quantize_per_token_as<int8_t>(x, at::kChar);
  const int8_t* qp = q.const_data_ptr<int8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    switch (m) {
      case 1: return w8a8_gemv_rows_signed<1>(qp, k, wp, scp, begin, end, ap, n);
      case 2: return w8a8_gemv_rows_signed<2>(qp, k, wp, scp, begin, end, ap, n);
      case 3: return w8a8_gemv_rows_signed<3>(qp, k, wp, scp, begin, end, ap, n);
      default: return w8a8_gemv_rows_signed<4>(qp, k, wp, scp, begin, end, ap, n);
    }
  });
#else
  auto [q, scale] = quantize_per_token_as<uint8_t>(x, at::kByte);  // q + 128
  const uint8_t* up = q.const_data_ptr<uint8_t>();
  const int32_t* sp = w_sum.const_data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    switch (m) {
      case 1: return w8a8_gemv_rows<1>(up, k, wp, sp, scp, begin, end, ap, n);
      case 2: return w8a8_gemv_rows<2>(up, k, wp, sp, scp, begin, end, ap, n);
      case 3: return w8a8_gemv_rows<3>(up, k, wp, sp, scp, begin, end, ap, n);
      default: return w8a8_gemv_rows<4>(up, k, wp, sp, scp, begin, end, ap, n);
    }
  });
#endif
  return finish("w8a8_gemv", x, acc, scale, bias, residual, silu_mul);
}

// ---------------------------------------------------------------------------------------------- int16 GEMM

// Columns of one packed weight panel (`pack_weight_i16`) and rows of one register tile of `w8a8_gemm_i16`.
constexpr int64_t kPanelCols = 16;
constexpr int kTileRows = 4;

// w [N, K] int8 -> int16 [ceil(N / 16), ceil(K / 2), 16, 2]: panel b, pair p, column c holds (w[16 b + c, 2 p],
// w[16 b + c, 2 p + 1]), zeros past N and K. A pair of one column is what VPMADDWD multiplies by a pair of
// activations, and 8 columns' pairs fill a 256-bit register.
at::Tensor pack_weight_i16(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2, "pack_weight_i16: w must be int8 [N, K]");
  const auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), panels = (n + kPanelCols - 1) / kPanelCols, pairs = (k + 1) / 2;
  auto packed = at::zeros({panels, pairs, kPanelCols, 2}, wc.options().dtype(at::kShort));
  const int8_t* src = wc.const_data_ptr<int8_t>();
  int16_t* dst = packed.data_ptr<int16_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kPanelCols && b * kPanelCols + c < n; ++c) {
        const int8_t* row = src + (b * kPanelCols + c) * k;
        int16_t* out = dst + b * pairs * kPanelCols * 2 + c * 2;
        for (int64_t j = 0; j < k; ++j) out[(j / 2) * kPanelCols * 2 + (j % 2)] = row[j];
      }
  });
  return packed;
}

// acc[m, col0 + c] = float(sum_k a[m, k] w[col0 + c, k]) * w_scale[col0 + c] for the R rows of `a` (int16 pairs
// as int32 [R, pairs]) and the `cols` (<= 16) valid columns of one panel. The int32 sums are exact (each pair's
// products <= 2 * 127 * 127, K / 2 pairs). AVX2: VPMADDWD multiplies 16 int16 pairs an instruction, twice the
// products of one fp32 FMA, into an R x 16 tile of int32 held in 2 R registers; elsewhere, a scalar loop.
template <int R>
void gemm_i16_tile(const int32_t* a, int64_t pairs, const int16_t* panel, const float* w_scale, int64_t col0,
                   int64_t cols, float* acc, int64_t n) {
#if defined(__AVX2__)
  __m256i t0[R], t1[R];
  for (int r = 0; r < R; ++r) t0[r] = t1[r] = _mm256_setzero_si256();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + p * 32));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + p * 32 + 16));
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(a[r * pairs + p]);
      t0[r] = _mm256_add_epi32(t0[r], _mm256_madd_epi16(w0, x));
      t1[r] = _mm256_add_epi32(t1[r], _mm256_madd_epi16(w1, x));
    }
  }
  alignas(32) int32_t sums[R][kPanelCols];
  for (int r = 0; r < R; ++r) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r]), t0[r]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r] + 8), t1[r]);
  }
#else
  int32_t sums[R][kPanelCols] = {};
  for (int64_t p = 0; p < pairs; ++p)
    for (int r = 0; r < R; ++r) {
      const int32_t pair = a[r * pairs + p];
      const int32_t lo = static_cast<int16_t>(pair & 0xffff), hi = static_cast<int16_t>(pair >> 16);
      for (int64_t c = 0; c < kPanelCols; ++c)
        sums[r][c] += lo * panel[p * 32 + 2 * c] + hi * panel[p * 32 + 2 * c + 1];
    }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c)
      acc[r * n + col0 + c] = static_cast<float>(sums[r][c]) * w_scale[col0 + c];
}

// lmforge_int8::w8a8_gemm_i16(x [M, K], w_packed (pack_weight_i16 of w [N, K]), w_scale [N], bias?, residual?,
// silu_mul) -> y: `w8a8_linear` / `w8a8_linear_epilogue` for CPUs whose oneDNN int8 GEMM saturates (AVX2 without
// VNNI): the same quantize_per_token, the same int32 sums of q x w (exact, by VPMADDWD on int16 copies of both),
// float(acc) * w_scale, then the same epilogue (`finish`). The weight is read as int16 (2x its int8 bytes,
// half of a float32 copy's).
at::Tensor w8a8_gemm_i16(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                         bool silu_mul) {
  check_input(x);
  const int64_t m = x.size(0), k = x.size(1), n = w_scale.numel(), pairs = (k + 1) / 2;
  TORCH_CHECK(w_packed.scalar_type() == at::kShort && w_packed.dim() == 4 && w_packed.is_contiguous() &&
                  w_packed.size(0) == (n + kPanelCols - 1) / kPanelCols && w_packed.size(1) == pairs &&
                  w_packed.size(2) == kPanelCols && w_packed.size(3) == 2,
              "w8a8_gemm_i16: w_packed must be pack_weight_i16 of an int8 [N, K] weight with K = x's columns and "
              "N = w_scale's length");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(),
              "w8a8_gemm_i16: w_scale must be contiguous float32 [N]");
  TORCH_CHECK(!(residual.has_value() && residual->defined() && silu_mul),
              "w8a8_gemm_i16: give residual or silu_mul, not both");
  auto [q, scale] = quantize_per_token_as<int8_t>(x, at::kChar);
  // the activations as int16 pairs (a zero after an odd K), one 32-bit broadcast per pair
  auto a = at::zeros({m, 2 * pairs}, x.options().dtype(at::kShort));
  a.narrow(1, 0, k).copy_(q);
  const int32_t* ap = reinterpret_cast<const int32_t*>(a.const_data_ptr<int16_t>());
  const int16_t* wp = w_packed.const_data_ptr<int16_t>();
  const float* sp = w_scale.const_data_ptr<float>();
  at::Tensor acc = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* accp = acc.data_ptr<float>();
  const int64_t panels = w_packed.size(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int16_t* panel = wp + b * pairs * kPanelCols * 2;
      const int64_t col0 = b * kPanelCols, cols = std::min(kPanelCols, n - col0);
      int64_t r = 0;
      for (; r + kTileRows <= m; r += kTileRows)
        gemm_i16_tile<kTileRows>(ap + r * pairs, pairs, panel, sp, col0, cols, accp + r * n, n);
      switch (m - r) {
        case 1: gemm_i16_tile<1>(ap + r * pairs, pairs, panel, sp, col0, cols, accp + r * n, n); break;
        case 2: gemm_i16_tile<2>(ap + r * pairs, pairs, panel, sp, col0, cols, accp + r * n, n); break;
        case 3: gemm_i16_tile<3>(ap + r * pairs, pairs, panel, sp, col0, cols, accp + r * n, n); break;
        default: break;
      }
    }
  });
  return finish("w8a8_gemm_i16", x, acc, scale, bias, residual, silu_mul);
}

// ---------------------------------------------------------------------------------------------- block Hadamard

// In place: v [n] (n a power of two) times H_n, by butterflies of stride 1, 2, ..., n / 2 (from first_stride: the
// smaller strides already done).
inline void fwht_scalar(float* v, int64_t n, int64_t first_stride = 1) {
  for (int64_t h = first_stride; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
}

#if defined(__AVX2__) && !defined(LMFORGE_W8A8_AVX512)
// fwht_scalar with its strides 1, 2, 4 as lane permutes inside 8-float vectors (n a power of two >= 8; lane i gets
// a_i * sign + a_{i^h}: the butterfly's a + b and a - b, the product by +-1 exact, so the scalar loop's results
// bit for bit), then its loop for the strides of 8 and up.
inline void fwht_avx2(float* v, int64_t n) {
  const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
  const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
  const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  for (int64_t k = 0; k < n; k += 8) {
    __m256 a = _mm256_loadu_ps(v + k);
    a = _mm256_fmadd_ps(a, s1, _mm256_permute_ps(a, 0xB1));          // swap neighbours
    a = _mm256_fmadd_ps(a, s2, _mm256_permute_ps(a, 0x4E));          // swap pairs
    a = _mm256_fmadd_ps(a, s4, _mm256_permute2f128_ps(a, a, 0x01));  // swap 128-bit halves
    _mm256_storeu_ps(v + k, a);
  }
  fwht_scalar(v, n, 8);  // runs of 8 and more contiguous lanes: the compiler vectorizes them
}
#endif

#ifdef LMFORGE_W8A8_AVX512
// 16 floats times H_16: strides 1, 2, 4, 8 inside the vector (lanes i and i ^ h: a_i * sign + a_{i^h}, sign +1
// where bit h of i is clear, -1 where set: the butterfly's a + b and a - b; the product by +-1 is exact).
inline __m512 fwht16(__m512 a) {
  const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
  const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
  const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  a = _mm512_fmadd_ps(a, s1, _mm512_permute_ps(a, 0xB1));        // swap neighbours
  a = _mm512_fmadd_ps(a, s2, _mm512_permute_ps(a, 0x4E));        // swap pairs
  a = _mm512_fmadd_ps(a, s4, _mm512_shuffle_f32x4(a, a, 0xB1));  // swap 128-bit lanes
  return _mm512_fmadd_ps(a, s8, _mm512_shuffle_f32x4(a, a, 0x4E));  // swap 256-bit halves
}

// in [n] (n a multiple of 16) times H_n into out, in float32 with one rounding at the store: each run of 64
// (or 16, 32) in registers, the strides of 64 and up between those runs in the float32 buffer v [n].
template <typename Row>
inline void fwht_avx512(const typename Row::raw_t* in, int64_t n, float* v, typename Row::raw_t* out) {
  const int64_t run = std::min<int64_t>(n, 64), nv = run / 16;
  for (int64_t r0 = 0; r0 < n; r0 += run) {
    __m512 a[4];
    for (int64_t i = 0; i < nv; ++i) a[i] = fwht16(load16<Row>(in + r0 + 16 * i));
    for (int64_t h = 1; h < nv; h *= 2)  // strides 16 and 32
      for (int64_t i = 0; i < nv; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const __m512 x = a[j], y = a[j + h];
          a[j] = _mm512_add_ps(x, y);
          a[j + h] = _mm512_sub_ps(x, y);
        }
    if (n == run) {
      for (int64_t i = 0; i < nv; ++i) store16<Row>(out + 16 * i, a[i]);
      return;
    }
    for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(v + r0 + 16 * i, a[i]);
  }
  for (int64_t h = 64; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; j += 16) {
        const __m512 x = _mm512_loadu_ps(v + j), y = _mm512_loadu_ps(v + j + h);
        _mm512_storeu_ps(v + j, _mm512_add_ps(x, y));
        _mm512_storeu_ps(v + j + h, _mm512_sub_ps(x, y));
      }
  for (int64_t k = 0; k < n; k += 16) store16<Row>(out + k, _mm512_loadu_ps(v + k));
}
#endif

template <typename Row>
void hadamard_rows(const typename Row::raw_t* x, int64_t rows, int64_t cols, int64_t block, typename Row::raw_t* y) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(block));
    float* v = buf.data();
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b0 = 0; b0 < cols; b0 += block) {
        const typename Row::raw_t* in = x + m * cols + b0;
        typename Row::raw_t* out = y + m * cols + b0;
#ifdef LMFORGE_W8A8_AVX512
        if (block % 16 == 0) {
          fwht_avx512<Row>(in, block, v, out);
          continue;
        }
#endif
        for (int64_t k = 0; k < block; ++k) v[k] = Row::load(in[k]);
#if defined(__AVX2__) && !defined(LMFORGE_W8A8_AVX512)
        if (block % 8 == 0)
          fwht_avx2(v, block);
        else
#endif
          fwht_scalar(v, block);
        for (int64_t k = 0; k < block; ++k) out[k] = Row::store(v[k]);
      }
    }
  });
}

at::Tensor block_hadamard(const at::Tensor& x, int64_t block) {
  check_input(x);
  TORCH_CHECK(block >= 2 && (block & (block - 1)) == 0, "block_hadamard: block must be a power of two >= 2, got ",
              block);
  TORCH_CHECK(x.size(1) % block == 0, "block_hadamard: the row length ", x.size(1), " is not a multiple of block ",
              block);
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  const int64_t rows = xc.size(0), cols = xc.size(1);
  if (xc.scalar_type() == at::kBFloat16) {
    hadamard_rows<BF16Row>(static_cast<const uint16_t*>(xc.const_data_ptr()), rows, cols, block,
                           static_cast<uint16_t*>(y.data_ptr()));
  } else {
    hadamard_rows<F32Row>(static_cast<const uint32_t*>(xc.const_data_ptr()), rows, cols, block,
                          static_cast<uint32_t*>(y.data_ptr()));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(lmforge_int8, m) {
  m.def("quantize_per_token(Tensor x) -> (Tensor, Tensor)", &quantize_per_token);
  m.def("w8a8_linear(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_zero_point, Tensor? bias) -> Tensor",
        &w8a8_linear);
  m.def(
      "w8a8_linear_epilogue(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_zero_point, Tensor? bias, "
      "Tensor? residual, bool silu_mul) -> Tensor",
      &w8a8_linear_epilogue);
  m.def(
      "w8a8_gemv(Tensor x, Tensor w, Tensor w_sum, Tensor w_scale, Tensor? bias, Tensor? residual=None, "
      "bool silu_mul=False) -> Tensor",
      &w8a8_gemv);
  m.def("pack_weight_i16(Tensor w) -> Tensor", &pack_weight_i16);
  m.def(
      "w8a8_gemm_i16(Tensor x, Tensor w_packed, Tensor w_scale, Tensor? bias, Tensor? residual=None, "
      "bool silu_mul=False) -> Tensor",
      &w8a8_gemm_i16);
  m.def("block_hadamard(Tensor x, int block) -> Tensor", &block_hadamard);
}
