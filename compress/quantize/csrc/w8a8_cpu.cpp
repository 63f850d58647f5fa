// Fused CPU kernels of the ``w8a8`` INT8 scheme (compress/quantize/int8.py), built on first use by
// torch.utils.cpp_extension and cached.
//
// lmforge_int8::quantize_per_token(x [M, K] bf16 / fp32) -> (int8 [M, K], float32 scale [M, 1]):
//   one pass per row for max|x| and one to quantize, bit-identical to the ATen reference
//   ``quantize_per_token``: scale = max(max|x_row|, 1e-8) / 127, q = clamp(round_half_even(x / scale), -127, 127).
// lmforge_int8::w8a8_linear(x [M, K], oneDNN-packed int8 weight, w_scale [N], w_zero_point [N], bias [N]?) -> [M, N]
//   in x's dtype: quantize_per_token, onednn::qlinear_pointwise (int8 x int8 -> float32 acc * w_scale), then
//   acc * x_scale (+ bias) rounded once to x's dtype, as the ATen path does (built with -ffp-contract=off so no
//   fused multiply-add changes the rounding). The activations go to oneDNN as uint8 q + 128 with zero point 128
//   (the same integer sums): VNNI's dot product is u8 x s8, and oneDNN 3.12 on an AVX-512 VNNI CPU without AMX
//   ran signed int8 activations on its reference kernel (`ref_int8`), ~4000x slower than its u8 kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (v + magic) - magic == round-half-even(v) for |v| < 2^22

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Element loads as float and |x| bit patterns (monotonic in |x| for non-NaN values).
struct BF16Row {
  using raw_t = uint16_t;
  static inline uint32_t abs_bits(raw_t r) { return static_cast<uint32_t>(r & 0x7fffu); }
  static inline float abs_value(uint32_t bits) { return bits_to_float(bits << 16); }
  static inline float load(raw_t r) { return bits_to_float(static_cast<uint32_t>(r) << 16); }
  static inline raw_t store(float f) {
    const uint32_t u = float_to_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    return static_cast<raw_t>(f != f ? 0x7fc0u : rounded);
  }
};

struct F32Row {
  using raw_t = uint32_t;
  static inline uint32_t abs_bits(raw_t r) { return r & 0x7fffffffu; }
  static inline float abs_value(uint32_t bits) { return bits_to_float(bits); }
  static inline float load(raw_t r) { return bits_to_float(r); }
  static inline raw_t store(float f) { return float_to_bits(f); }
};

// Rows per task of at::parallel_for: 2^18 elements, so a decode step's rows (64 x 576 .. 64 x 3072) run on the
// calling thread. These passes take microseconds; an extra parallel region per pass costs more than it saves
// when the cores are shared (a thread waits for its sibling to be scheduled), as the int8 GEMM already uses
// every thread.
inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(cols, 1)); }

// Out = int8_t: q; Out = uint8_t: q + 128 (oneDNN's u8 activations with zero point 128, `w8a8_linear`).
template <typename Row, typename Out = int8_t>
void quantize_rows(const typename Row::raw_t* x, int64_t rows, int64_t cols, Out* q, float* scale) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const typename Row::raw_t* row = x + m * cols;
      uint32_t amax_bits = 0;
      for (int64_t k = 0; k < cols; ++k) amax_bits = std::max(amax_bits, Row::abs_bits(row[k]));
      const float s = std::max(Row::abs_value(amax_bits), 1e-8f) / 127.0f;
      scale[m] = s;
      Out* out = q + m * cols;
      constexpr int32_t offset = std::is_same_v<Out, uint8_t> ? 128 : 0;
      for (int64_t k = 0; k < cols; ++k) {
        float v = Row::load(row[k]) / s;
        v = (v + kRoundMagic) - kRoundMagic;
        v = std::min(std::max(v, -127.0f), 127.0f);
        out[k] = static_cast<Out>(static_cast<int32_t>(v) + offset);
      }
    }
  });
}

template <typename Row>
void dequantize_rows(const float* acc, const float* scale, const float* bias, int64_t rows, int64_t cols,
                     typename Row::raw_t* y) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float s = scale[m];
      const float* a = acc + m * cols;
      typename Row::raw_t* out = y + m * cols;
      if (bias != nullptr) {
        for (int64_t n = 0; n < cols; ++n) {
          const float prod = a[n] * s;
          out[n] = Row::store(prod + bias[n]);
        }
      } else {
        for (int64_t n = 0; n < cols; ++n) out[n] = Row::store(a[n] * s);
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

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale,
                       const at::Tensor& w_zero_point, const std::optional<at::Tensor>& bias) {
  auto [q, scale] = quantize_per_token_as<uint8_t>(x, at::kByte);  // q + 128
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("onednn::qlinear_pointwise", "")
                       .typed<at::Tensor(at::Tensor, double, int64_t, at::Tensor, at::Tensor, at::Tensor,
                                         std::optional<at::Tensor>, double, int64_t, std::optional<at::ScalarType>,
                                         std::string_view, c10::List<std::optional<at::Scalar>>, std::string_view)>();
  at::Tensor acc = op.call(q, 1.0, 128, w_packed, w_scale, w_zero_point, std::nullopt, 1.0, 0, at::kFloat, "none",
                           c10::List<std::optional<at::Scalar>>(), "")
                       .contiguous();
  const int64_t rows = acc.size(0), cols = acc.size(1);
  auto y = at::empty({rows, cols}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    dequantize_rows<BF16Row>(acc.const_data_ptr<float>(), scale.const_data_ptr<float>(), bp, rows, cols,
                             static_cast<uint16_t*>(y.data_ptr()));
  } else {
    dequantize_rows<F32Row>(acc.const_data_ptr<float>(), scale.const_data_ptr<float>(), bp, rows, cols,
                            static_cast<uint32_t*>(y.data_ptr()));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(lmforge_int8, m) {
  m.def("quantize_per_token(Tensor x) -> (Tensor, Tensor)", &quantize_per_token);
  m.def("w8a8_linear(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_zero_point, Tensor? bias) -> Tensor",
        &w8a8_linear);
}
