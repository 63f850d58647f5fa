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

// ---- fp32 GEMM on column panels, for decode steps of 4 to 64 rows ----
//
// lmforge_float_gemv::pack_panels(w [N, K] fp32, gated) -> [P, K, 16] fp32, P = ceil(N / 16): panel p holds columns
//     16 p .. 16 p + 15 of y = x w^T, w[16 p + c][k] at [p][k][c], zero past N. gated: w is [gate; up] ([2 I, K],
//     I a multiple of 16) and the panels alternate gate 0, up 0, gate 1, up 1, ... so one task holds both halves of
//     its output columns.
// lmforge_float_gemv::gemm_panels(x [M, K], w_panels, n, gated, bias [N]?, residual [M, N]?, silu_mul) -> [M, N]
//     fp32 (silu_mul, which needs gated panels: [M, N / 2]): the same results and epilogues as mm, with the columns in
//     w's order, but each output summed over k in order by one accumulator (so a row's result does not depend on M
//     or on its place in the batch). n: w's rows; gated: w_panels was packed with gated.
//   Register tiles of up to 6 rows x 16 columns (12 ymm accumulators; each k: two panel loads, one broadcast of x a
//   row, two FMAs a row), the panel read from memory once for all rows and then from cache. A decode step's layer
//   linears and LM head of SmolLM2-135M on a 2-core AVX2-only AMD EPYC (2 threads), oneDNN's packed fp32 GEMM
//   against this: 70 / 80 / 192 against 38 / 56 / 164 ms at 4 / 16 / 64 rows, level at 160 and 512 (~115 GFLOP/s).
constexpr int64_t kPanelCols = 16;
constexpr int kPanelTileRows = 6;

at::Tensor pack_panels(const at::Tensor& w, bool gated) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "float_gemv.pack_panels: w must be a CPU fp32 [N, K] tensor");
  const at::Tensor wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), panels = (n + kPanelCols - 1) / kPanelCols;
  TORCH_CHECK(!gated || n % (2 * kPanelCols) == 0,
              "float_gemv.pack_panels: a gated weight needs [gate; up] halves of a multiple of 16 rows, got ", n);
  at::Tensor out = at::zeros({panels, k, kPanelCols}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t half_panels = panels / 2;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      // the weight rows this panel holds: plain order, or gate / up alternating
      const int64_t row0 = gated ? (p % 2) * half_panels * kPanelCols + (p / 2) * kPanelCols : p * kPanelCols;
      float* panel = dst + p * k * kPanelCols;
      for (int64_t c = 0; c < kPanelCols && row0 + c < n; ++c) {
        const float* row = src + (row0 + c) * k;
        for (int64_t i = 0; i < k; ++i) panel[i * kPanelCols + c] = row[i];
      }
    }
  });
  return out;
}

// t[r * 16 + c] = sum over i in order of x[r * k + i] * panel[i * 16 + c], for r < R.
template <int R>
inline void panel_tile(const float* x, int64_t k, const float* panel, float* t) {
#if defined(__AVX2__) && defined(__FMA__)
  // Named accumulators: GCC keeps an array of __m256 indexed in the loop on the stack (a store per FMA).
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  // one row of the tile: its two accumulators += the broadcast x[row][i] times the panel's 16 columns
  auto row = [](const float* xi, __m256 w0, __m256 w1, __m256& c0, __m256& c1) {
    const __m256 xb = _mm256_broadcast_ss(xi);
    c0 = _mm256_fmadd_ps(w0, xb, c0);
    c1 = _mm256_fmadd_ps(w1, xb, c1);
  };
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanelCols);
    const __m256 w1 = _mm256_loadu_ps(panel + i * kPanelCols + 8);
    row(x + i, w0, w1, a00, a01);
    if constexpr (R > 1) row(x + k + i, w0, w1, a10, a11);
    if constexpr (R > 2) row(x + 2 * k + i, w0, w1, a20, a21);
    if constexpr (R > 3) row(x + 3 * k + i, w0, w1, a30, a31);
    if constexpr (R > 4) row(x + 4 * k + i, w0, w1, a40, a41);
    if constexpr (R > 5) row(x + 5 * k + i, w0, w1, a50, a51);
  }
  const __m256 acc[2 * kPanelTileRows] = {a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(t + r * kPanelCols, acc[2 * r]);
    _mm256_storeu_ps(t + r * kPanelCols + 8, acc[2 * r + 1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kPanelCols; ++c) {
      float v = 0.f;
      for (int64_t i = 0; i < k; ++i) v = std::fma(x[r * k + i], panel[i * kPanelCols + c], v);
      t[r * kPanelCols + c] = v;
    }
#endif
}

void panel_tile_rows(int rows, const float* x, int64_t k, const float* panel, float* t) {
  switch (rows) {
    case 1: return panel_tile<1>(x, k, panel, t);
    case 2: return panel_tile<2>(x, k, panel, t);
    case 3: return panel_tile<3>(x, k, panel, t);
    case 4: return panel_tile<4>(x, k, panel, t);
    case 5: return panel_tile<5>(x, k, panel, t);
    default: return panel_tile<kPanelTileRows>(x, k, panel, t);
  }
}

// out[c] = silu(gate[c] + gb[c]) * (up[c] + ub[c]) for c < 16 (gb / ub: nullptr for no bias)
inline void silu_mul16(const float* gate, const float* up, const float* gb, const float* ub, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int h = 0; h < 16; h += 8) {
    __m256 g = _mm256_loadu_ps(gate + h), u = _mm256_loadu_ps(up + h);
    if (gb != nullptr) g = _mm256_add_ps(g, _mm256_loadu_ps(gb + h));
    if (ub != nullptr) u = _mm256_add_ps(u, _mm256_loadu_ps(ub + h));
    _mm256_storeu_ps(out + h, _mm256_mul_ps(lmforge_vec::silu8(g), u));
  }
#else
  for (int c = 0; c < 16; ++c) {
    const float g = gate[c] + (gb ? gb[c] : 0.f);
    out[c] = silu(g) * (up[c] + (ub ? ub[c] : 0.f));
  }
#endif
}

at::Tensor gemm_panels(const at::Tensor& x, const at::Tensor& w_panels, int64_t n, bool gated,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                       bool silu_mul) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "float_gemv.gemm_panels: x must be a CPU fp32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), panels = (n + kPanelCols - 1) / kPanelCols;
  TORCH_CHECK(w_panels.scalar_type() == at::kFloat && w_panels.dim() == 3 && w_panels.size(0) == panels &&
                  w_panels.size(1) == k && w_panels.size(2) == kPanelCols && w_panels.is_contiguous(),
              "float_gemv.gemm_panels: w_panels must be pack_panels of an fp32 [n, K] weight with K = x's columns");
  TORCH_CHECK(!(silu_mul && residual.has_value()), "float_gemv.gemm_panels: give residual or silu_mul, not both");
  TORCH_CHECK(!silu_mul || gated, "float_gemv.gemm_panels: silu_mul needs panels packed with gated");
  TORCH_CHECK(!gated || n % (2 * kPanelCols) == 0,
              "float_gemv.gemm_panels: gated panels need [gate; up] halves of a multiple of 16 rows");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "float_gemv.gemm_panels: bias must have n elements");
  }
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.dim() == 2 && res.size(0) == m && res.size(1) == n,
                "float_gemv.gemm_panels: residual must be fp32 [M, n]");
  }
  const at::Tensor xc = x.contiguous();
  const int64_t n_out = silu_mul ? n / 2 : n;
  at::Tensor out = at::empty({m, n_out}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w_panels.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const float* rp = residual.has_value() ? res.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // a task: one output panel of 16 columns (silu_mul: its gate and up panels)
  const int64_t tasks = silu_mul ? panels / 2 : panels;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float t[kPanelTileRows * kPanelCols];
    alignas(32) float u[kPanelTileRows * kPanelCols];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t col0 = task * kPanelCols, cols = std::min(kPanelCols, n_out - col0);
      for (int64_t r0 = 0; r0 < m; r0 += kPanelTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kPanelTileRows, m - r0));
        if (silu_mul) {
          panel_tile_rows(rows, xp + r0 * k, k, wp + (2 * task) * k * kPanelCols, t);
          panel_tile_rows(rows, xp + r0 * k, k, wp + (2 * task + 1) * k * kPanelCols, u);
          for (int r = 0; r < rows; ++r)
            silu_mul16(t + r * kPanelCols, u + r * kPanelCols, bp ? bp + col0 : nullptr,
                       bp ? bp + n_out + col0 : nullptr, op + (r0 + r) * n_out + col0);
        } else {
          // gated panels alternate gate and up: panel 2 j + h holds columns h * n / 2 + 16 j ..
          const int64_t c0 = gated ? (task % 2) * (n / 2) + (task / 2) * kPanelCols : col0;
          panel_tile_rows(rows, xp + r0 * k, k, wp + task * k * kPanelCols, t);
          for (int r = 0; r < rows; ++r) {
            float* dst = op + (r0 + r) * n_out + c0;
            for (int64_t c = 0; c < cols; ++c) {
              float v = t[r * kPanelCols + c] + (bp ? bp[c0 + c] : 0.f);
              if (rp) v += rp[(r0 + r) * n + c0 + c];
              dst[c] = v;
            }
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(lmforge_float_gemv, m) {
  m.def("mm(Tensor x, Tensor w, Tensor? bias=None, Tensor? residual=None, bool silu_mul=False) -> Tensor", &mm);
  m.def("pack_panels(Tensor w, bool gated=False) -> Tensor", &pack_panels);
  m.def(
      "gemm_panels(Tensor x, Tensor w_panels, int n, bool gated=False, Tensor? bias=None, Tensor? residual=None, "
      "bool silu_mul=False) -> Tensor",
      &gemm_panels);
}
