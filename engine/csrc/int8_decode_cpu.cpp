// A CPU kernel of the engine (engine/cpu_ops.py builds it on first use with torch.utils.cpp_extension).
//
// lmforge_decode::decode_layers(h [N, H] bf16 / fp32, weights, weight_sums, scales, biases, hadamard_blocks, norms,
//     kv_cache [L, 2, num_blocks, block_size, Hkv, hd] in h's dtype (or int8 [..., hd + 2]: the int8 KV cache, read
//     and written by the two ops below), cos [N, hd] fp32, signed_sin [N, hd] fp32, slot_mapping [N],
//     block_tables [N, max_blocks], seq_lens [N], num_heads, num_kv, eps, float_aten) -> [N, H]
//   every decoder layer of a Llama-style model for N <= 8 tokens, each attending as a row of the decode kernel
//   (token i at position seq_lens[i] - 1 through block_tables[i]; its K and V are stored first, so later tokens of
//   the same sequence see earlier ones). Linear 4 l + j of layer l (j = qkv, o, [gate; up], down) runs by what it
//   holds: a w8a8 layer (int8 weight, int32 row sums, float32 scales) lmforge_int8::w8a8_gemv, after
//   lmforge_int8::block_hadamard of its input where hadamard_blocks gives a block (> 0); a weight-only INT8 layer
//   (int8 weight and scales, no row sums) lmforge_int8_gemv::weight_only_mm; a float layer (its plain weight only)
//   lmforge_float_gemv::mm, or with float_aten at::linear followed by the add or SwiGLU as torch ops (the unpacked
//   float path of a draft model, whose roundings differ from oneDNN's packed one with post-ops); each with the
//   residual-add (o, down) or SwiGLU ([gate; up]) epilogue. norms[2 l], [2 l + 1]: the input and post-attention
//   RMSNorm weights or None. The same ops with the same arguments in the same order as engine/model.py's op-by-op
//   forward of such a step, so the same bits (float_aten layers aside); what it saves is the Python and op dispatch
//   between ~10 ops a layer (docs/engine.md). The ops are called through the dispatcher: lmforge_engine (rms_norm,
//   rope_and_cache, paged_decode_attention) and those the linears name must be loaded. A source of its own, so that
//   adding it does not change how the compiler builds (and rounds in) those kernels. The switches of
//   engine.cpu_ops and engine.quant.int8 are checked by its Python callers, not here.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using OptTensor = c10::optional<at::Tensor>;
// (x, weight, scale or row sums, bias, residual, silu_mul): the signature of the few-row GEMV ops
using GemvFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                          bool);

at::Tensor rms_norm(const at::Tensor& x, const OptTensor& weight, double eps) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const OptTensor&, double)>("lmforge_engine::rms_norm");
  return op.call(x, weight, eps);
}

at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, int64_t, int64_t)>("lmforge_engine::rope_and_cache");
  return op.call(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
                         int64_t, const OptTensor&, const OptTensor&, bool)>("lmforge_engine::paged_decode_attention");
  // group_shared as the op-by-op forward's calls: a sequence's tokens read their common blocks together
  return op.call(q, kv_cache, block_tables, seq_lens, 0, scale, 0, c10::nullopt, c10::nullopt, true);
}

// at::linear, then the add or SwiGLU as the torch ops of engine/model.py's unpacked float path.
at::Tensor aten_linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias, const OptTensor& residual,
                       bool silu_mul) {
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 2 && w.size(1) == x.size(1),
              "decode_layers: a float weight must be [out, in] in h's dtype");
  const at::Tensor y = at::linear(x, w, bias);
  if (silu_mul) {
    TORCH_CHECK(y.size(1) % 2 == 0, "decode_layers: a [gate; up] weight needs an even number of rows");
    const int64_t half = y.size(1) / 2;
    return at::silu(y.narrow(1, 0, half)) * y.narrow(1, half, half);
  }
  if (!residual.has_value()) return y;
  TORCH_CHECK(residual->sizes() == y.sizes(), "decode_layers: residual and linear output shapes differ");
  return *residual + y;
}

// One linear of decode_layers (see the header).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& w_sum, const OptTensor& scale,
                  const OptTensor& bias, int64_t hadamard, const OptTensor& residual, bool silu_mul, bool float_aten) {
  if (w_sum.has_value()) {
    TORCH_CHECK(scale.has_value(), "decode_layers: a w8a8 layer needs its scales");
    static const auto w8a8 =
        find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const OptTensor&, const OptTensor&, bool)>("lmforge_int8::w8a8_gemv");
    static const auto rotate = find_op<at::Tensor(const at::Tensor&, int64_t)>("lmforge_int8::block_hadamard");
    return w8a8.call(hadamard > 0 ? rotate.call(x, hadamard) : x, w, *w_sum, *scale, bias, residual, silu_mul);
  }
  TORCH_CHECK(hadamard == 0, "decode_layers: an input rotation belongs to a w8a8 layer");
  if (scale.has_value()) {
    static const auto op = find_op<GemvFn>("lmforge_int8_gemv::weight_only_mm");
    return op.call(x, w, *scale, bias, residual, silu_mul);
  }
  if (float_aten) return aten_linear(x, w, bias, residual, silu_mul);
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, bool)>(
          "lmforge_float_gemv::mm");
  return op.call(x, w, bias, residual, silu_mul);
}

at::Tensor decode_layers(const at::Tensor& h_in, at::TensorList weights, const c10::List<OptTensor>& weight_sums,
                         const c10::List<OptTensor>& scales, const c10::List<OptTensor>& biases,
                         at::IntArrayRef hadamard_blocks, const c10::List<OptTensor>& norms, const at::Tensor& kv_cache,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv,
                         double eps, bool float_aten) {
  const int64_t num_layers = static_cast<int64_t>(weights.size()) / 4;
  const auto count = static_cast<size_t>(4 * num_layers);
  TORCH_CHECK((h_in.scalar_type() == at::kBFloat16 || h_in.scalar_type() == at::kFloat) && h_in.dim() == 2 &&
                  h_in.size(0) >= 1 && h_in.size(0) <= 8,
              "decode_layers: h must be bf16 or float32 [N, H] with 1 <= N <= 8");
  TORCH_CHECK(num_layers >= 1 && weights.size() == count && weight_sums.size() == count && scales.size() == count &&
                  biases.size() == count && hadamard_blocks.size() == count &&
                  static_cast<int64_t>(norms.size()) == 2 * num_layers,
              "decode_layers: give 4 weights, row sums, scales, biases and Hadamard blocks and 2 norms per layer");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == num_layers && kv_cache.size(1) == 2,
              "decode_layers: kv_cache must be [L, 2, num_blocks, block_size, Hkv, hd] (int8: hd + 2)");
  TORCH_CHECK(cos.dim() == 2, "decode_layers: cos must be [N, hd]");
  // head_dim ** -0.5 as Python computes it (engine.cpu_ops.paged_decode_attention; an int8 cache row is longer)
  const double scale = std::pow(static_cast<double>(cos.size(1)), -0.5);
  at::Tensor h = h_in.contiguous();
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor cache = kv_cache.select(0, l);  // [2, num_blocks, block_size, Hkv, hd]
    auto layer_linear = [&](int64_t j, const at::Tensor& x, const OptTensor& residual, bool silu_mul) {
      const int64_t i = 4 * l + j;
      return linear(x, weights[i], weight_sums.get(i), scales.get(i), biases.get(i), hadamard_blocks[i], residual,
                    silu_mul, float_aten);
    };
    at::Tensor x = rms_norm(h, norms.get(2 * l), eps);
    const at::Tensor q =
        rope_and_cache(layer_linear(0, x, c10::nullopt, false), cos, sin, cache, slot_mapping, num_heads, num_kv);
    h = layer_linear(1, paged_decode_attention(q, cache, block_tables, seq_lens, scale), h, false);  // [N, H]
    x = rms_norm(h, norms.get(2 * l + 1), eps);
    h = layer_linear(3, layer_linear(2, x, c10::nullopt, true), h, false);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY(lmforge_decode, m) {
  m.def(
      "decode_layers(Tensor h, Tensor[] weights, Tensor?[] weight_sums, Tensor?[] scales, Tensor?[] biases, "
      "int[] hadamard_blocks, Tensor?[] norms, Tensor(a!) kv_cache, Tensor cos, Tensor signed_sin, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv, float eps, bool float_aten=False) -> Tensor",
      &decode_layers);
}
