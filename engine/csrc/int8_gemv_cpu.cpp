// Weight-only INT8 matrix-vector products for decode (engine/quant/int8.py, ``weight-only`` scheme), built on
// first use by torch.utils.cpp_extension and cached.
//
// lmforge_int8_gemv::weight_only_mm(x [M, K] bf16 / fp32, w [N, K] int8, w_scale [N] float32, bias [N]? float32)
//     -> [M, N] in x's dtype, M <= 8
//   y[m, n] = (sum_k x[m, k] * w[n, k]) * w_scale[n] (+ bias[n]), accumulated in float32 and rounded once. Each
//   weight row is read once for all M rows of x, 64 int8 values per step widened to float32 in registers: decoding
//   a few sequences is bound by reading the weights, and these are half the bytes of bf16. With AVX-512 16 and
//   with AVX2 + FMA 8 weights a vector; without either, a scalar loop.
//   Optional epilogues, with the roundings of the torch ops they replace (x's dtype after each op):
//   residual [M, N] -> round(residual + round(y)) (a residual add); silu_mul -> w holds [gate; up] ([2 I, K]) and
//   the result is [M, I], round(round(silu(round(gate))) * round(up)) (SwiGLU).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "common.h"

namespace {

using lmforge_bf16::float_to_bf16;

// Rows of w per task: enough work per task that a parallel region pays off (K = 576: 256 rows).
constexpr int64_t kRowsPerTask = 256;
// Software prefetch distance in weight rows: the hardware prefetchers alone leave a weight streamed from DRAM
// about a quarter slower than with this distance.
constexpr int64_t kPrefetchRows = 8;

template <int M>
void gemv_rows(const float* x, int64_t k, const int8_t* w, int64_t n_begin, int64_t n_end, float* y, int64_t n) {
  int64_t r = n_begin;
#ifdef __AVX512F__
  // 16 int8 weights widened to float32 per vector; U independent accumulators per input row hide the
  // multiply-add latency (U * M <= 8 vectors in flight), and a 2-row step shares each x load.
  constexpr int U = M == 1 ? 4 : (M <= 3 ? 2 : 1);
  const int64_t step = 16 * U;
  const int64_t k_vec = k / step * step;
  for (; r + 2 <= n_end; r += 2) {
    const int8_t* row0 = w + r * k;
    const int8_t* row1 = row0 + k;
    __m512 acc0[M][U], acc1[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc0[m][u] = acc1[m][u] = _mm512_setzero_ps();
    const int8_t* ahead = row0 + kPrefetchRows * k;  // rows this step's loads will reach soon
    for (int64_t c = 0; c < k_vec; c += step) {
      for (int64_t line = 0; line < step; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + c + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + k + c + line), _MM_HINT_T0);
      }
      for (int u = 0; u < U; ++u) {
        const __m512 w0 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row0 + c + 16 * u))));
        const __m512 w1 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row1 + c + 16 * u))));
        for (int m = 0; m < M; ++m) {
          const __m512 xv = _mm512_loadu_ps(x + m * k + c + 16 * u);
          acc0[m][u] = _mm512_fmadd_ps(xv, w0, acc0[m][u]);
          acc1[m][u] = _mm512_fmadd_ps(xv, w1, acc1[m][u]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      __m512 s0 = acc0[m][0], s1 = acc1[m][0];
      for (int u = 1; u < U; ++u) {
        s0 = _mm512_add_ps(s0, acc0[m][u]);
        s1 = _mm512_add_ps(s1, acc1[m][u]);
      }
      float t0 = _mm512_reduce_add_ps(s0), t1 = _mm512_reduce_add_ps(s1);
      for (int64_t c = k_vec; c < k; ++c) {
        t0 += x[m * k + c] * static_cast<float>(row0[c]);
        t1 += x[m * k + c] * static_cast<float>(row1[c]);
      }
      y[m * n + r] = t0;
      y[m * n + r + 1] = t1;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2 (16 vector registers): one weight row at a time, 8 int8 weights widened to float32 per vector, U
  // independent accumulators per input row (U * M <= 8), the next rows prefetched as above.
  constexpr int U = M == 1 ? 4 : (M <= 3 ? 2 : 1);
  const int64_t step = 8 * U;
  const int64_t k_vec = k / step * step;
  for (; r < n_end; ++r) {
    const int8_t* row = w + r * k;
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    const int8_t* ahead = row + kPrefetchRows * k;
    for (int64_t c = 0; c < k_vec; c += step) {
      if (c % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(ahead + c), _MM_HINT_T0);
      for (int u = 0; u < U; ++u) {
        const __m256 wv = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c + 8 * u))));
        for (int m = 0; m < M; ++m) acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + c + 8 * u), wv, acc[m][u]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256 s = acc[m][0];
      for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[m][u]);
      float t = lmforge_vec::hsum8(s);
      for (int64_t c = k_vec; c < k; ++c) t += x[m * k + c] * static_cast<float>(row[c]);
      y[m * n + r] = t;
    }
  }
#endif
  for (; r < n_end; ++r) {  // the portable loop, and an odd last row
    const int8_t* row = w + r * k;
    float acc[M] = {};
    for (int64_t c = 0; c < k; ++c) {
      const float wv = static_cast<float>(row[c]);
      for (int m = 0; m < M; ++m) acc[m] += x[m * k + c] * wv;
    }
    for (int m = 0; m < M; ++m) y[m * n + r] = acc[m];
  }
}

using GemvFn = void (*)(const float*, int64_t, const int8_t*, int64_t, int64_t, float*, int64_t);
constexpr GemvFn kGemv[] = {gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>,
                            gemv_rows<5>, gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};

using lmforge_bf16::bf16_to_float;

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// y [M, N] in x's dtype (the plain product) -> round(residual + y), or round(round(silu(gate)) * up) of y = [gate, up].
at::Tensor epilogue(const at::Tensor& y, const at::Tensor* residual, bool silu_mul) {
  const bool bf16 = y.scalar_type() == at::kBFloat16;
  const int64_t m = y.size(0), n = y.size(1), n_out = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, n_out}, y.options());
  auto load = [&](const at::Tensor& t, int64_t i) {
    return bf16 ? bf16_to_float(reinterpret_cast<const uint16_t*>(t.data_ptr())[i]) : t.data_ptr<float>()[i];
  };
  auto round = [&](float v) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; };
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < n_out; ++c) {
      const float v = silu_mul ? round(silu(load(y, i * n + c))) * load(y, i * n + c + n_out)
                               : load(*residual, i * n + c) + load(y, i * n + c);
      if (bf16) {
        reinterpret_cast<uint16_t*>(out.data_ptr())[i * n_out + c] = float_to_bf16(v);
      } else {
        out.data_ptr<float>()[i * n_out + c] = v;
      }
    }
  }
  return out;
}

at::Tensor weight_only_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                          const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                          bool silu_mul) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "weight_only_mm: x must be a CPU bf16 / fp32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(m >= 1 && m <= 8, "weight_only_mm: x must have 1 to 8 rows, got ", m);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.size(1) == k && w.is_contiguous(),
              "weight_only_mm: w must be contiguous int8 [N, K] with K = x's columns");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == n && w_scale.is_contiguous(),
              "weight_only_mm: w_scale must be contiguous float32 [N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "weight_only_mm: bias must be contiguous float32 [N]");
  TORCH_CHECK(!(silu_mul && residual.has_value()), "weight_only_mm: give residual or silu_mul, not both");
  TORCH_CHECK(!silu_mul || n % 2 == 0, "weight_only_mm: silu_mul needs an even number of weight rows [gate; up]");
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == x.scalar_type() && res.dim() == 2 && res.size(0) == m && res.size(1) == n,
                "weight_only_mm: residual must be [M, N] in x's dtype");
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]: a few KB, read from cache by every row of w
  at::Tensor acc = at::empty({m, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  float* ap = acc.data_ptr<float>();
  const GemvFn fn = kGemv[m - 1];
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) { fn(xp, k, wp, begin, end, ap, n); });
  const float* sp = w_scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m, n}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < n; ++c) op[i * n + c] = float_to_bf16(ap[i * n + c] * sp[c] + (bp ? bp[c] : 0.f));
  } else {
    float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < n; ++c) op[i * n + c] = ap[i * n + c] * sp[c] + (bp ? bp[c] : 0.f);
  }
  if (silu_mul || residual.has_value()) return epilogue(out, residual.has_value() ? &res : nullptr, silu_mul);
  return out;
}

}  // namespace

TORCH_LIBRARY(lmforge_int8_gemv, m) {
  m.def(
      "weight_only_mm(Tensor x, Tensor w, Tensor w_scale, Tensor? bias, Tensor? residual=None, bool silu_mul=False) "
      "-> Tensor",
      &weight_only_mm);
}
