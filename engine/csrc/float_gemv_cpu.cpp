// Float matrix-vector products for decode steps of 1 to 4 rows (engine/model.py ``Linear``), built on first use by
// torch.utils.cpp_extension and cached.
//
// lmforge_float_gemv::mm(x [M, K], w [N, K], bias [N]? float32, residual [M, N]?, silu_mul) -> [M, N] (or
//     [M, N / 2] with silu_mul), x, w, residual and the result all fp32 or all bf16, 1 <= M <= 4
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), accumulated in float32 and rounded once to the dtype.
//   Decoding a few sequences is bound by reading the weights: each weight row is read once for all M rows of x,
//   from the plain [N, K] layout. On a 2-core AMD EPYC, where a plain read of memory reaches ~27 GB/s, oneDNN's
//   packed GEMM streams a decode step's weights at ~16-22 GB/s (padded to 4 rows) and this kernel at one row at
//   ~28 GB/s (engine/model.py FLOAT_GEMV_ROWS). With AVX-512 16 and with AVX2 + FMA 8 floats a vector (AVX2-only AMD
//   EPYC: one fp32 request alone decoded at 30.9 against 61.9 ms a token on oneDNN).
//   A row's sums are added in the same order whatever M is, so rows 1 to 4 of a call agree bit for bit.
//   Epilogues, with the roundings of the oneDNN post-ops they replace: residual -> round(residual + y) (the add
//   on the float32 sum), silu_mul -> w holds [gate; up] ([2 I, K]) and the result is
//   round(round(silu(gate)) * up) (SwiGLU: gate rounded once, then the product rounded).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "common.h"

namespace {

using lmforge_bf16::bf16_to_float;
using lmforge_bf16::float_to_bf16;

// Output columns per task: enough weight bytes per task that a parallel region pays off.
constexpr int64_t kColsPerTask = 128;
constexpr int kMaxRows = 4;

template <typename W>
inline float weight_at(const W* row, int64_t c) {
  if constexpr (std::is_same_v<W, float>) {
    return row[c];
  } else {
    return bf16_to_float(row[c]);
  }
}

#ifdef __AVX512F__
template <typename W>
inline __m512 load16(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
template <typename W>
inline __m256 load8(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
#endif

// acc[m * n_stride + r] = dot(x[m], w[r]) for r in [r_begin, r_end): one weight row at a time, read in 64-element
// steps into four 16-wide accumulators per input row (the sum order depends on K only, not on M). No software
// prefetch: on the AMD EPYC the hardware prefetchers alone stream a row fastest (21.4 GB/s on one core against
// 13-15 with prefetches 1-8 KB ahead).
template <typename W, int M>
void dot_rows(const float* x, int64_t k, const W* w, int64_t r_begin, int64_t r_end, float* acc, int64_t n_stride) {
  int64_t r = r_begin;
#ifdef __AVX512F__
  constexpr int U = 4;
  constexpr int64_t step = 16 * U;
  const int64_t k_vec = k / step * step;
  for (; r < r_end; ++r) {
    const W* row = w + r * k;
    __m512 a[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k_vec; c += step) {
      for (int u = 0; u < U; ++u) {
        const __m512 wv = load16(row + c + 16 * u);
        for (int m = 0; m < M; ++m) a[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + c + 16 * u), wv, a[m][u]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float t = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3])));
      for (int64_t c = k_vec; c < k; ++c) t += x[m * k + c] * weight_at(row, c);
      acc[m * n_stride + r] = t;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2 (16 vector registers): 8-wide, two accumulators per input row whatever M is (the same sum order)
  constexpr int U = 2;
  constexpr int64_t step = 8 * U;
  const int64_t k_vec = k / step * step;
  for (; r < r_end; ++r) {
    const W* row = w + r * k;
    __m256 a[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k_vec; c += step) {
      for (int u = 0; u < U; ++u) {
        const __m256 wv = load8(row + c + 8 * u);
        for (int m = 0; m < M; ++m) a[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + c + 8 * u), wv, a[m][u]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float t = lmforge_vec::hsum8(_mm256_add_ps(a[m][0], a[m][1]));
      for (int64_t c = k_vec; c < k; ++c) t += x[m * k + c] * weight_at(row, c);
      acc[m * n_stride + r] = t;
    }
  }
#endif
  for (; r < r_end; ++r) {  // the portable loop
    const W* row = w + r * k;
    for (int m = 0; m < M; ++m) {
      float t = 0.f;
      for (int64_t c = 0; c < k; ++c) t += x[m * k + c] * weight_at(row, c);
      acc[m * n_stride + r] = t;
    }
  }
}

#ifdef __AVX512BF16__
// The bf16 weights with AVX512-BF16: acc[m * n_stride + r] = dot(x[m], w[r]) with x in bf16 too, 32 pairs of
// products a VDPBF16PS into two accumulators per input row (the products are exact in float32; each pair is added
// to the accumulator in order, rounded to nearest even), so a row needs no conversion of its weights.
template <int M>
void dot_rows_bf16(const uint16_t* x, int64_t k, const uint16_t* w, int64_t r_begin, int64_t r_end, float* acc,
                   int64_t n_stride) {
  constexpr int U = 2;
  constexpr int64_t step = 32 * U;
  const int64_t k_vec = k / step * step;
  for (int64_t r = r_begin; r < r_end; ++r) {
    const uint16_t* row = w + r * k;
    __m512 a[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k_vec; c += step) {
      for (int u = 0; u < U; ++u) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + c + 32 * u);
        for (int m = 0; m < M; ++m)
          a[m][u] = _mm512_dpbf16_ps(a[m][u], (__m512bh)_mm512_loadu_si512(x + m * k + c + 32 * u), wv);
      }
    }
    for (int m = 0; m < M; ++m) {
      float t = _mm512_reduce_add_ps(_mm512_add_ps(a[m][0], a[m][1]));
      for (int64_t c = k_vec; c < k; ++c) t += bf16_to_float(x[m * k + c]) * bf16_to_float(row[c]);
      acc[m * n_stride + r] = t;
    }
  }
}

void dot_rows_bf16_m(int m, const uint16_t* x, int64_t k, const uint16_t* w, int64_t b, int64_t e, float* acc,
                     int64_t n) {
  switch (m) {
    case 1: return dot_rows_bf16<1>(x, k, w, b, e, acc, n);
    case 2: return dot_rows_bf16<2>(x, k, w, b, e, acc, n);
    case 3: return dot_rows_bf16<3>(x, k, w, b, e, acc, n);
    default: return dot_rows_bf16<4>(x, k, w, b, e, acc, n);
  }
}
#endif

template <typename W>
void dot_rows_m(int m, const float* x, int64_t k, const W* w, int64_t b, int64_t e, float* acc, int64_t n) {
  switch (m) {
    case 1: return dot_rows<W, 1>(x, k, w, b, e, acc, n);
    case 2: return dot_rows<W, 2>(x, k, w, b, e, acc, n);
    case 3: return dot_rows<W, 3>(x, k, w, b, e, acc, n);
    default: return dot_rows<W, 4>(x, k, w, b, e, acc, n);
  }
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

template <typename W>
void run(const at::Tensor& x, const at::Tensor& w, const float* bias, const W* residual, bool silu_mul, W* out) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), n_out = silu_mul ? n / 2 : n;
  const W* wp = reinterpret_cast<const W*>(w.data_ptr());
  constexpr bool bf16 = !std::is_same_v<W, float>;
#ifdef __AVX512BF16__
  const W* xw = reinterpret_cast<const W*>(x.data_ptr());  // bf16 x read as it is by VDPBF16PS
  const float* xp = nullptr;
  auto dot = [&](const W* rows, int64_t b, int64_t e, float* out_acc, int64_t stride) {
    if constexpr (bf16) {
      dot_rows_bf16_m(static_cast<int>(m), xw, k, rows, b, e, out_acc, stride);
    } else {
      dot_rows_m<W>(static_cast<int>(m), reinterpret_cast<const float*>(xw), k, rows, b, e, out_acc, stride);
    }
  };
#else
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]: a few KB, read from cache by every weight row
  const float* xp = xf.data_ptr<float>();
  auto dot = [&](const W* rows, int64_t b, int64_t e, float* out_acc, int64_t stride) {
    dot_rows_m<W>(static_cast<int>(m), xp, k, rows, b, e, out_acc, stride);
  };
#endif
  (void)xp;
  auto load = [](W v) -> float {
    if constexpr (bf16) return bf16_to_float(v); else return v;
  };
  auto store = [](float v) -> W {
    if constexpr (bf16) return float_to_bf16(v); else return v;
  };
  at::parallel_for(0, n_out, kColsPerTask, [&](int64_t task_begin, int64_t task_end) {
    // float32 sums of one block of columns: [M, width] (and the up half's beside them for silu_mul)
    float sums[kMaxRows * 2 * kColsPerTask];
    for (int64_t begin = task_begin; begin < task_end; begin += kColsPerTask) {
      const int64_t end = std::min(begin + kColsPerTask, task_end), width = end - begin;
      float* gate_or_y = sums;
      float* up = sums + m * width;
      dot(wp, begin, end, gate_or_y - begin, width);
      if (silu_mul) dot(wp + n_out * k, begin, end, up - begin, width);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t c = begin; c < end; ++c) {
          const int64_t j = i * width + (c - begin);
          float v;
          if (silu_mul) {
            const float g = load(store(silu(gate_or_y[j] + (bias ? bias[c] : 0.f))));
            v = g * (up[j] + (bias ? bias[n_out + c] : 0.f));
          } else {
            v = gate_or_y[j] + (bias ? bias[c] : 0.f);
            if (residual) v += load(residual[i * n + c]);
          }
          out[i * n_out + c] = store(v);
        }
      }
    }
  });
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
              const c10::optional<at::Tensor>& residual, bool silu_mul) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "float_gemv.mm: x must be a CPU bf16 / fp32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "float_gemv.mm: x must have 1 to ", kMaxRows, " rows, got ", m);
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 2 && w.size(1) == k && w.is_contiguous(),
              "float_gemv.mm: w must be contiguous [N, K] in x's dtype with K = x's columns");
  TORCH_CHECK(!(silu_mul && residual.has_value()), "float_gemv.mm: give residual or silu_mul, not both");
  TORCH_CHECK(!silu_mul || n % 2 == 0, "float_gemv.mm: silu_mul needs an even number of weight rows [gate; up]");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "float_gemv.mm: bias must have N elements");
  }
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == x.scalar_type() && res.dim() == 2 && res.size(0) == m && res.size(1) == n,
                "float_gemv.mm: residual must be [M, N] in x's dtype");
  }
  const at::Tensor xc = x.contiguous();
  const int64_t n_out = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, n_out}, x.options());
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run<float>(xc, w, bp, residual.has_value() ? res.data_ptr<float>() : nullptr, silu_mul, out.data_ptr<float>());
  } else {
    run<uint16_t>(xc, w, bp, residual.has_value() ? reinterpret_cast<const uint16_t*>(res.data_ptr()) : nullptr,
                  silu_mul, reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(lmforge_float_gemv, m) {
  m.def("mm(Tensor x, Tensor w, Tensor? bias=None, Tensor? residual=None, bool silu_mul=False) -> Tensor", &mm);
}
