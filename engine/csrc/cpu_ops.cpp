// CPU kernels of the engine's step (engine/cpu_ops.py builds them on first use with torch.utils.cpp_extension).
//
// lmforge_engine::rms_norm(x [N, H] bf16 / fp32, weight [H]? , eps) -> [N, H] in x's dtype
//   y = round(x * rsqrt(mean(x^2) + eps)) in float32 then rounded to x's dtype; with weight (x's dtype) then
//   round(weight * y), the two roundings of Hugging Face's LlamaRMSNorm. One read of each row.
// lmforge_engine::argmax(logits [S, V] bf16 / fp32) -> int64 [S]
//   index of the first maximum of each row (a NaN counts as the maximum, as torch.argmax does).
// lmforge_engine::refine_logits(logits [S, V] bf16, hidden [S, H] bf16, weight [V, H] bf16, to_float, top_k)
//     -> Tensor
//   logits rounded to bf16 by the lm head's GEMM tie or swap near the top (bf16 keeps 8 bits: 0.125 apart at 20),
//   so each entry within two bf16 steps of its row's maximum is recomputed as a float32 dot product of the same
//   bf16 operands (the GEMM's own accumulation, before its rounding). to_float: a float32 [S, V] copy holding
//   those exact values, and also those of every entry that may be among the top_k largest exact values (whose
//   logprobs a request may read): all entries within two steps below a bf16 value that top_k entries reach.
//   Otherwise, in place: the exact winner of each row is raised to the next bf16 value above the row's maximum,
//   so any argmax of the row picks it (greedy decoding reads nothing else).
// lmforge_engine::screen_logits(logits [S, V] bf16, hidden [S, H] fp32, weight [V, H] fp32, weight_norms [V] fp32,
//     rel, out, absolute) -> logits
//   the greedy pick of a float32 lm head from a bf16 one: logits are the lm head's output computed on bf16 copies
//   of hidden and weight; each entry lies within rel * |x| |w_v| + out * |a_v| + absolute of the float32 dot product
//   (the coefficients from engine/cpu_ops.py screen_bound_coefficients), so
//   every entry whose upper bound reaches the largest lower bound of its row is recomputed in float32, and the
//   first of the largest exact values is raised in place to the next bf16 value above the row's maximum: any
//   argmax of the row picks the token a float32 head's argmax picks. -inf entries (masked tokens) stay out.
// lmforge_engine::apply_token_bitmask_(logits [S, V] bf16 / fp16 / fp32, bitmask [S, W] int32, W * 32 >= V)
//   structured output's token mask: logits[i, t] = -inf where bit t % 32 of word bitmask[i, t / 32] is 0
//   (llguidance's and xgrammar's layout: a set bit allows its token), in place; other entries untouched. A word
//   of 32 allowed tokens (most of a row inside a JSON string) costs one compare, so the pass reads the bitmask and
//   writes only disallowed entries, on the calling thread: no byte-per-token mask, and no parallel region (its
//   microseconds of work would wait for cores that other processes hold).
// lmforge_engine::paged_decode_attention(q [D, Hq, hd], kv_cache [2, num_blocks, block_size, Hkv, hd],
//     block_tables [D, max_blocks] int64, seq_lens [D] int64, first_block, scale, sliding_window,
//     prior_out [Hkv, D * g, hd]?, prior_lse [Hkv, D * g]?, group_shared) -> [D, Hq * hd]
//   one query token per sequence (its position seq_len - 1) against that sequence's keys at positions
//   first_block * block_size .. seq_len - 1, read in place through its block table (no gathered copy). The
//   g = Hq / Hkv query heads of a KV head share each key and value row (grouped-query attention). Softmax in
//   float32 with the running maximum; with prior_out / prior_lse (the output and log-sum-exp of the same queries
//   over keys before first_block, e.g. a prefix shared by the batch, in the layout of one attention call whose
//   query rows are each KV head's g query heads, sequence-major: row i * g + j of KV head h is query head
//   h * g + j of sequence i) the two parts are merged exactly, as the online-softmax state (m = lse, l = 1,
//   acc = out) the kernel starts from (cascade attention, Ye et al. 2024). kv_cache may instead be int8 [2,
//   num_blocks, block_size, Hkv, hd + 2]: each row's hd int8 values followed by its float16 scale (the int8 KV
//   cache, engine/attention.py quantize_kv); a key's score is scale * (q . k_int8) and a value row enters the
//   accumulator weighted by p * scale (the same products as dequantizing first, in another order). With
//   group_shared, sequences whose tables start with the same blocks (past first_block) are attended in chunks of
//   up to 16 query heads: the chunk's common blocks once for all its heads, then each sequence's own keys.
// lmforge_engine::rope_and_cache(qkv [N, (Hq + 2 Hkv) * hd] bf16 or fp32, cos [N, hd] fp32, signed_sin [N, hd]
//     fp32, kv_cache [2, num_blocks, block_size, Hkv, hd] (qkv's dtype), slot_mapping [N] int64) -> q [N, Hq, hd]
//   rotary embedding of the q and k heads, x * cos + swap_halves(x) * signed_sin in float32 (the products and the
//   sum rounded to float32 apart, no fused multiply-add: the torch ops on float32 copies) and rounded once to qkv's
//   dtype, and the rotated k and the v heads stored at each token's slot (a negative slot: padding, not stored).
//   One pass instead of a dozen small ops per layer. An int8 kv_cache
//   ([2, num_blocks, block_size, Hkv, hd + 2]) stores each rotated k row and each v row quantized from those
//   values: scale = float16(absmax / 127), q = clamp(round_half_even(x / scale), -127, 127), the scale's two
//   bytes after the row (engine/attention.py quantize_kv computes the same bytes).
// lmforge_engine::lora_apply(y [N, out] (a!), x [>= N, in], rows [M] int64, task_bounds [T + 1] int64,
//     task_slots [T] int64, A [S, in, K], B [S, K, out], out_splits [n + 1] int64) -> y
//   the LoRA deltas of one fused layer added in place: for task t (rows[task_bounds[t] .. task_bounds[t + 1]), all
//   of slot task_slots[t]) and each of its rows i, y[i] += (x[i] A[s]) B[s], where module j (of n) owns rank rows
//   [j K / n, (j + 1) K / n) of B[s] and output columns [out_splits[j], out_splits[j + 1]) (B is block-diagonal:
//   only those blocks are read). x, y, A, B share one dtype (bf16 or fp32); x A and the delta are float32 and y is
//   rounded once. A task reads its slot's weights once for all its rows (grouped GEMM over the slots, as Punica's
//   SGMV, Chen et al. 2023), so one call serves every adapter of the step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "common.h"

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using lmforge_bf16::bf16_to_float;
using lmforge_bf16::float_to_bf16;

template <typename T>
struct Elem;

template <>
struct Elem<at::BFloat16> {
  using raw_t = uint16_t;
  static inline int32_t is_nan(raw_t r) { return (r & 0x7fffu) > 0x7f80u; }  // on the bits: no float compare
  static inline float load(raw_t r) { return bf16_to_float(r); }
  static inline raw_t store(float f) { return float_to_bf16(f); }
};

template <>
struct Elem<float> {
  using raw_t = float;
  static inline int32_t is_nan(raw_t r) {
    uint32_t u;
    std::memcpy(&u, &r, sizeof(u));
    return (u & 0x7fffffffu) > 0x7f800000u;
  }
  static inline float load(raw_t r) { return r; }
  static inline raw_t store(float f) { return f; }
};

// The values of an int8 KV cache row (read only; the row's scale follows its hd values: row_scale).
template <>
struct Elem<int8_t> {
  using raw_t = int8_t;
  static inline float load(raw_t r) { return static_cast<float>(r); }
};

// Bytes after the hd int8 values of an int8 cache row: its float16 scale.
constexpr int64_t kScaleBytes = 2;
constexpr float kInt8Max = 127.0f;

// The factor a cache row's values are multiplied by: 1 for a float cache, the row's float16 scale for int8.
template <typename C>
inline float row_scale(const typename Elem<C>::raw_t* /*row*/, int64_t /*hd*/) {
  return 1.0f;
}

template <>
inline float row_scale<int8_t>(const int8_t* row, int64_t hd) {
  uint16_t bits;
  std::memcpy(&bits, row + hd, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the same value as the portable conversion
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// x [hd] (bf16 values) -> dst [hd + kScaleBytes]: symmetric int8 with one float16 scale (absmax / 127), rounded
// half to even and clamped to +-127; an all-zero row gets scale 0 and zeros. engine/attention.py quantize_kv.
inline void quantize_row(const float* x, int64_t hd, int8_t* dst) {
  float absmax = 0.f;
  for (int64_t d = 0; d < hd; ++d) absmax = std::max(absmax, std::fabs(x[d]));
  const c10::Half scale_h(absmax / kInt8Max);
  const float s = static_cast<float>(scale_h);
  for (int64_t d = 0; d < hd; ++d) {
    const float v = s > 0.f ? std::nearbyint(x[d] / s) : 0.f;
    dst[d] = static_cast<int8_t>(std::min(kInt8Max, std::max(-kInt8Max, v)));
  }
  const uint16_t bits = scale_h.x;
  std::memcpy(dst + hd, &bits, sizeof(bits));
}

// Work per task of at::parallel_for: small step tensors run on the calling thread (a parallel region costs
// more than these passes when the cores are shared), big ones split.
inline int64_t grain(int64_t work_per_item, int64_t target = 1 << 16) {
  return std::max<int64_t>(1, target / std::max<int64_t>(1, work_per_item));
}

// exp(x) for x <= 0 in float32, written so loops over it vectorize: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// degree-6 Taylor polynomial (relative error < 2e-7), 2^n from the exponent bits; x below -87 gives ~1e-38.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f + r * 0.00138888892f)))));
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 16-float vectors (GCC / Clang vector extensions: one zmm register with AVX-512, two ymm with AVX2) and loads of
// 16 cache or activation values widened to float32.
typedef float vf16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));

template <typename T>
inline vf16 load16(const typename Elem<T>::raw_t* src);

template <>
inline vf16 load16<at::BFloat16>(const uint16_t* src) {
  vh16 h;
  std::memcpy(&h, src, sizeof(h));
  vu16 u = __builtin_convertvector(h, vu16) << 16;
  vf16 f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <>
inline vf16 load16<float>(const float* src) {
  vf16 f;
  std::memcpy(&f, src, sizeof(f));
  return f;
}

typedef int8_t vb16 __attribute__((vector_size(16)));

// Sign extension and one vector conversion (GCC turns a generic int8 -> float vector conversion into one
// scalar conversion per lane).
template <>
inline vf16 load16<int8_t>(const int8_t* src) {
  vf16 f;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  std::memcpy(&f, &v, sizeof(f));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
  std::memcpy(&f, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&f) + sizeof(lo), &hi, sizeof(hi));
#else
  vb16 b;
  std::memcpy(&b, src, sizeof(b));
  f = __builtin_convertvector(b, vf16);
#endif
  return f;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 cache values widened to float32 in one ymm register (the value pass of DecodeItemVec on AVX2).
template <typename T>
inline __m256 load8(const typename Elem<T>::raw_t* src);

template <>
inline __m256 load8<at::BFloat16>(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <>
inline __m256 load8<float>(const float* src) {
  return _mm256_loadu_ps(src);
}

template <>
inline __m256 load8<int8_t>(const int8_t* src) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
}
#endif

// The sum of x[0 .. n): lane e of a vector sums x[e], x[e + 16], ..., then the lanes and the tail in order. An
// explicit vector, so the order never depends on x's address (a loop the compiler may peel for alignment would
// make a row's result depend on the buffer it sits in, and batch-invariant decoding on the rows beside it).
inline float lane_sum(const float* x, int64_t n) {
  vf16 lanes = {};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) lanes += load16<float>(x + k);
  float sum = 0.f;
  for (int e = 0; e < 16; ++e) sum += lanes[e];
  for (; k < n; ++k) sum += x[k];
  return sum;
}

// ------------------------------------------------------------------------------------------------ rms_norm

// sum_k row[k]^2 in float32, the row as float32 into buf [cols]. Lane l of a 16-float vector sums the squares of
// elements l, l + 16, ...: a vector the compiler cannot re-split by the alignment of row or buf (a peeled loop would
// add them in another order, and a row's norm would then depend on which rows share the call and on the buffer's
// address; batch-invariant decoding relies on it not to). Not inlined: one instance for every caller, since GCC
// contracted these products and adds into FMAs differently where it inlined the loop into the calling thread's
// path and into the OpenMP workers' (AVX2: a row's norm differed by an ulp alone and among other rows).
template <typename T>
__attribute__((noinline)) float row_sum_squares(const typename Elem<T>::raw_t* row, int64_t cols, float* buf) {
  using E = Elem<T>;
  vf16 squares = {};
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    const vf16 v = load16<T>(row + c);
    std::memcpy(buf + c, &v, sizeof(v));
    squares += v * v;
  }
  float lanes[16];
  std::memcpy(lanes, &squares, sizeof(lanes));
  float sum = 0.f;
  for (; c < cols; ++c) {
    const float v = E::load(row[c]);
    buf[c] = v;
    sum += v * v;
  }
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return sum;
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* weight, double eps, at::Tensor& out) {
  using E = Elem<T>;
  using raw_t = typename E::raw_t;
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t x_stride = x.stride(0), o_stride = out.stride(0);
  const raw_t* xp = reinterpret_cast<const raw_t*>(x.data_ptr());
  raw_t* op = reinterpret_cast<raw_t*>(out.data_ptr());
  const raw_t* wp = weight ? reinterpret_cast<const raw_t*>(weight->data_ptr()) : nullptr;
  at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(cols);
    for (int64_t r = begin; r < end; ++r) {
      const raw_t* row = xp + r * x_stride;
      const float sum = row_sum_squares<T>(row, cols, buf.data());
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(cols) + static_cast<float>(eps));
      raw_t* orow = op + r * o_stride;
      if (wp) {
        for (int64_t k = 0; k < cols; ++k) orow[k] = E::store(E::load(wp[k]) * E::load(E::store(buf[k] * inv)));
      } else {
        for (int64_t k = 0; k < cols; ++k) orow[k] = E::store(buf[k] * inv);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be a CPU [N, H] tensor with unit last stride");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rms_norm: x must be bf16 or fp32");
  at::Tensor w;
  if (weight.has_value()) {
    w = weight->to(x.scalar_type()).contiguous();
    TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1), "rms_norm: weight must be [H]");
  }
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows<at::BFloat16>(x, weight.has_value() ? &w : nullptr, eps, out);
  } else {
    rms_norm_rows<float>(x, weight.has_value() ? &w : nullptr, eps, out);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ argmax

template <typename T>
void argmax_rows(const at::Tensor& x, at::Tensor& out) {
  using E = Elem<T>;
  using raw_t = typename E::raw_t;
  const int64_t rows = x.size(0), cols = x.size(1), stride = x.stride(0);
  const raw_t* xp = reinterpret_cast<const raw_t*>(x.data_ptr());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(cols, 1 << 17), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const raw_t* row = xp + r * stride;
      // Per-lane maxima and the first index holding each over 32-wide chunks (vectorizes), then the lane with
      // the largest maximum, the lowest index among equal ones. NaNs (ignored by the comparisons) are counted
      // on their bit patterns, since the build lets the compiler reassociate float arithmetic.
      constexpr int W = 32;
      float lane_max[W];
      int32_t lane_nan[W];
      int32_t lane_idx[W];
      for (int l = 0; l < W; ++l) {
        lane_max[l] = -std::numeric_limits<float>::infinity();
        lane_nan[l] = 0;
        lane_idx[l] = l;
      }
      int64_t c = 0;
      for (; c + W <= cols; c += W) {
        for (int l = 0; l < W; ++l) {
          const float v = E::load(row[c + l]);
          lane_nan[l] += E::is_nan(row[c + l]);
          const bool greater = v > lane_max[l];
          lane_max[l] = greater ? v : lane_max[l];
          lane_idx[l] = greater ? static_cast<int32_t>(c + l) : lane_idx[l];
        }
      }
      float best = -std::numeric_limits<float>::infinity();
      int64_t index = 0;
      int64_t nans = 0;
      bool found = false;
      for (int l = 0; l < W; ++l) {
        nans += lane_nan[l];
        if (l >= cols) continue;
        if (!found || lane_max[l] > best || (lane_max[l] == best && lane_idx[l] < index)) {
          best = lane_max[l];
          index = lane_idx[l];
          found = true;
        }
      }
      for (int64_t k = c; k < cols; ++k) {
        const float v = E::load(row[k]);
        nans += E::is_nan(row[k]);
        if (!found || v > best) {
          best = v;
          index = k;
          found = true;
        }
      }
      if (nans > 0) {
        for (int64_t k = 0; k < cols; ++k) {
          if (E::is_nan(row[k])) {
            index = k;
            break;
          }
        }
      }
      op[r] = index;
    }
  });
}

at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1,
              "argmax: logits must be a CPU [S, V] tensor with unit last stride");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kBFloat16) {
    argmax_rows<at::BFloat16>(logits, out);
  } else if (logits.scalar_type() == at::kFloat) {
    argmax_rows<float>(logits, out);
  } else {
    TORCH_CHECK(false, "argmax: logits must be bf16 or fp32");
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ refine_logits

inline float dot_bf16(const uint16_t* a, const uint16_t* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += bf16_to_float(a[i]) * bf16_to_float(b[i]);
  return acc;
}

// The ulp of bf16 values of magnitude |x| (at least that of the smallest normal float).
inline float bf16_step(float x) {
  return std::ldexp(1.0f, std::ilogb(std::max(std::fabs(x), std::numeric_limits<float>::min())) - 7);
}

// A threshold t <= m such that at least k entries of row (n values) are >= t: m - 2^j steps of m, the first j that
// reaches k (each try one vectorized count); -inf when the row holds fewer than k finite entries above m - 2^24 steps.
inline float top_k_floor(const uint16_t* row, int64_t n, float m, int64_t k) {
  const float step = bf16_step(m);
  for (int j = 1; j <= 24; ++j) {
    const float t = m - std::ldexp(step, j);
    int64_t count = 0;
    for (int64_t c = 0; c < n; ++c) count += bf16_to_float(row[c]) >= t;
    if (count >= k) return t;
  }
  return -std::numeric_limits<float>::infinity();
}

// The largest value of row[0 .. n) (NaNs ignored; -inf for none): per-lane maxima over 32-wide chunks, which
// vectorize where one running maximum does not.
inline float row_max(const uint16_t* row, int64_t n) {
  constexpr int W = 32;
  float lanes[W];
  for (int l = 0; l < W; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t c = 0;
  for (; c + W <= n; c += W)
    for (int l = 0; l < W; ++l) {
      const float v = bf16_to_float(row[c + l]);
      lanes[l] = v > lanes[l] ? v : lanes[l];
    }
  float m = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < W; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (; c < n; ++c) {
    const float v = bf16_to_float(row[c]);
    m = v > m ? v : m;
  }
  return m;
}

// *entry = the next bf16 value above m (m a finite bf16 value, not the largest): any argmax of its row picks it.
inline void lift_above(uint16_t* entry, float m) {
  const uint16_t bits = float_to_bf16(m);
  *entry = m == 0.f ? uint16_t{0x0001} : static_cast<uint16_t>(m > 0.f ? bits + 1 : bits - 1);
}

// Entries refine_logits tests at once before looking at any one of them.
constexpr int64_t kRefineChunk = 64;

// Whether any of row[0 .. kRefineChunk) is >= t (a branch-free loop that vectorizes; NaN entries compare false).
inline bool any_at_least(const uint16_t* row, float t) {
  int32_t hits = 0;
  for (int64_t c = 0; c < kRefineChunk; ++c) hits |= static_cast<int32_t>(bf16_to_float(row[c]) >= t);
  return hits != 0;
}

at::Tensor refine_logits(at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight, bool to_float,
                         int64_t top_k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.scalar_type() == at::kBFloat16,
              "refine_logits: logits must be a CPU bf16 [S, V] tensor with unit last stride");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == logits.size(0) && hidden.is_contiguous() &&
                  hidden.scalar_type() == at::kBFloat16,
              "refine_logits: hidden must be a contiguous bf16 [S, H] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == logits.size(1) && weight.size(1) == hidden.size(1) &&
                  weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "refine_logits: weight must be a contiguous bf16 [V, H] tensor");
  const int64_t rows = logits.size(0), cols = logits.size(1), h = hidden.size(1), stride = logits.stride(0);
  uint16_t* lp = reinterpret_cast<uint16_t*>(logits.data_ptr());
  const uint16_t* hp = reinterpret_cast<const uint16_t*>(hidden.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  at::Tensor out = to_float ? at::empty({rows, cols}, logits.options().dtype(at::kFloat)) : logits;
  float* op = to_float ? out.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, grain(cols, 1 << 17), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* row = lp + r * stride;
      if (op) {
        float* orow = op + r * cols;
        for (int64_t c = 0; c < cols; ++c) orow[c] = bf16_to_float(row[c]);
      }
      const float m = row_max(row, cols);
      if (!std::isfinite(m)) continue;  // NaN / inf rows: nothing to refine
      // true values round to within half a bf16 step each, so the true maximum lies within two steps of m
      float threshold = m - 2.0f * bf16_step(m);
      if (op && top_k > 1) {
        // k entries reach t, so the k-th largest true value is at least t - step / 2 and every entry of the true
        // top k has a bf16 value of at least t - step
        const float t = top_k_floor(row, cols, m, std::min<int64_t>(top_k, cols));
        threshold = std::min(threshold, t - 2.0f * bf16_step(std::max(std::fabs(m), std::fabs(t))));
      }
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_index = -1, first_max = -1;
      for (int64_t c = 0; c < cols; ++c) {
        if ((c & (kRefineChunk - 1)) == 0 && c + kRefineChunk <= cols && !any_at_least(row + c, threshold)) {
          c += kRefineChunk - 1;  // no candidate in this chunk (the common case: one vectorized test)
          continue;
        }
        const float v = bf16_to_float(row[c]);
        if (v < threshold) continue;
        if (first_max < 0 && v == m) first_max = c;
        const float exact = dot_bf16(hp + r * h, wp + c * h, h);
        if (op) op[r * cols + c] = exact;
        if (exact > best) {
          best = exact;
          best_index = c;
        }
      }
      if (!op && best_index >= 0 && best_index != first_max) lift_above(row + best_index, m);
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------------------ screen_logits

// sum_i a[i] * b[i] in float32 over 16 lanes (one fixed order whatever the row or the step).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int e = 0; e < 16; ++e) lanes[e] += a[i + e] * b[i + e];
  float s = 0.f;
  for (int e = 0; e < 16; ++e) s += lanes[e];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

at::Tensor screen_logits(at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight,
                         const at::Tensor& weight_norms, double rel, double out, double absolute) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.scalar_type() == at::kBFloat16,
              "screen_logits: logits must be a CPU bf16 [S, V] tensor with unit last stride");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == logits.size(0) && hidden.is_contiguous() &&
                  hidden.scalar_type() == at::kFloat,
              "screen_logits: hidden must be a contiguous float32 [S, H] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == logits.size(1) && weight.size(1) == hidden.size(1) &&
                  weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "screen_logits: weight must be a contiguous float32 [V, H] tensor");
  TORCH_CHECK(weight_norms.dim() == 1 && weight_norms.size(0) == logits.size(1) && weight_norms.is_contiguous() &&
                  weight_norms.scalar_type() == at::kFloat,
              "screen_logits: weight_norms must be a contiguous float32 [V] tensor");
  const int64_t rows = logits.size(0), cols = logits.size(1), h = hidden.size(1), stride = logits.stride(0);
  uint16_t* lp = reinterpret_cast<uint16_t*>(logits.data_ptr());
  const float* hp = hidden.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np_ = weight_norms.data_ptr<float>();
  // |exact - screened| <= rel * |x| |w_v| + out * |screened| + absolute (engine/cpu_ops.py screen_logits)
  at::parallel_for(0, rows, grain(cols, 1 << 17), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* row = lp + r * stride;
      const float* x = hp + r * h;
      double sq = 0.0;
      for (int64_t i = 0; i < h; ++i) sq += static_cast<double>(x[i]) * x[i];
      const float c = static_cast<float>(rel * std::sqrt(sq)), o = static_cast<float>(out),
                  tiny = static_cast<float>(absolute);
      // the largest lower bound of an entry (the exact maximum is at least this) and the row's maximum
      constexpr int W = 32;
      const float inf = std::numeric_limits<float>::infinity();
      float lanes[W], tops[W];
      for (int l = 0; l < W; ++l) lanes[l] = tops[l] = -inf;
      int64_t k = 0;
      for (; k + W <= cols; k += W)
        for (int l = 0; l < W; ++l) {
          const float a = bf16_to_float(row[k + l]);
          const float lo = a - (c * np_[k + l] + o * std::fabs(a) + tiny);
          lanes[l] = lo > lanes[l] ? lo : lanes[l];
          tops[l] = a > tops[l] ? a : tops[l];
        }
      float floor = -inf, m = -inf;
      for (int l = 0; l < W; ++l) {
        floor = lanes[l] > floor ? lanes[l] : floor;
        m = tops[l] > m ? tops[l] : m;
      }
      for (; k < cols; ++k) {
        const float a = bf16_to_float(row[k]);
        const float lo = a - (c * np_[k] + o * std::fabs(a) + tiny);
        floor = lo > floor ? lo : floor;
        m = a > m ? a : m;
      }
      if (!std::isfinite(floor) || !std::isfinite(m)) continue;  // no finite entry, or an infinite one
      // candidates: entries whose upper bound reaches it; the first of the largest exact values wins
      float best = -inf;
      int64_t best_index = -1;
      for (int64_t q = 0; q < cols; ++q) {
        if ((q & (kRefineChunk - 1)) == 0 && q + kRefineChunk <= cols) {
          int32_t hits = 0;  // one vectorized test of the whole chunk (the common case: no candidate in it)
          for (int64_t e = 0; e < kRefineChunk; ++e) {
            const float a = bf16_to_float(row[q + e]);
            hits |= static_cast<int32_t>(a + (c * np_[q + e] + o * std::fabs(a) + tiny) >= floor);
          }
          if (hits == 0) {
            q += kRefineChunk - 1;
            continue;
          }
        }
        const float a = bf16_to_float(row[q]);
        if (!std::isfinite(a) || !(a + (c * np_[q] + o * std::fabs(a) + tiny) >= floor)) continue;
        const float exact = dot_f32(x, wp + q * h, h);
        if (exact > best) {
          best = exact;
          best_index = q;
        }
      }
      if (best_index < 0) continue;
      // the winner alone at the top, unless an argmax already picks it: the next bf16 value above the maximum
      bool picked = bf16_to_float(row[best_index]) == m;
      for (int64_t q = 0; q < best_index && picked; ++q) picked = bf16_to_float(row[q]) != m;
      if (!picked) lift_above(row + best_index, m);
    }
  });
  return logits;
}

// ------------------------------------------------------------------------------------------------ attention

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;

// The keys lo .. seq_len - 1 of one sequence's KV head, walked block by block through its block table:
// each(base, f) calls f(row, t) with the row of key lo + t in the K or V half starting at base.
constexpr int64_t kPrefetchBlocks = 2;  // blocks of rows asked for ahead of the one being read

struct KeyWalk {
  const int64_t* table;
  int64_t max_blocks, lo, seq_len, block_size, c_block, c_tok, head_off, row_elems;

  // Asks for the next block's rows of this head while the current block is read: the rows of one head are a
  // strided third (or less) of each token's row, which the hardware prefetchers follow late.
  template <typename raw_t>
  inline void prefetch_block(const raw_t* first) const {
    const int64_t bytes = static_cast<int64_t>(sizeof(raw_t)) * row_elems;
    const char* r = reinterpret_cast<const char*>(first);
    for (int64_t k = 0; k < block_size; ++k, r += c_tok * static_cast<int64_t>(sizeof(raw_t)))
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(r + b, 0, 3);
  }

  template <typename raw_t, typename F>
  inline void each(const raw_t* base, F&& f) const {
    int64_t t = 0;
    const int64_t last = (seq_len - 1) / block_size;
    for (int64_t b = lo / block_size; b <= std::min(last, lo / block_size + kPrefetchBlocks - 1); ++b)
      prefetch_block(base + table[std::min(b, max_blocks - 1)] * c_block + head_off);
    for (int64_t p = lo; p < seq_len;) {
      const int64_t logical = p / block_size;
      const int64_t block = table[std::min(logical, max_blocks - 1)];
      const int64_t stop = std::min(seq_len, (logical + 1) * block_size);
      const raw_t* row = base + block * c_block + (p % block_size) * c_tok + head_off;
      if (logical + kPrefetchBlocks <= last)
        prefetch_block(base + table[std::min(logical + kPrefetchBlocks, max_blocks - 1)] * c_block + head_off);
      for (; p < stop; ++p, ++t, row += c_tok) f(row, t);
    }
  }
};

// One (sequence, KV head) item: its g query heads against keys lo .. seq_len - 1, read from a cache of element
// type T (bf16, float, or int8 rows with their scale). HD > 0 fixes the head dim at compile time (the loops over
// it unroll); HD == 0 reads it from hd.
template <typename T, int HD>
struct DecodeItem {
  using E = Elem<T>;
  using raw_t = typename E::raw_t;

  static inline float dot(const float* a, const float* b, int64_t hd) {
    const int64_t n = HD > 0 ? HD : hd;
    if ((HD > 0 ? HD : hd) % 16 == 0) {  // lanes as lane_sum's, whatever the addresses of a and b
      vf16 lanes = {};
      for (int64_t d = 0; d < n; d += 16) lanes += load16<float>(a + d) * load16<float>(b + d);
      float s = 0.f;
      for (int e = 0; e < 16; ++e) s += lanes[e];
      return s;
    }
    float s = 0.f;
    for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
  }

  static inline void load_row(const raw_t* src, float* dst, int64_t hd) {
    const int64_t n = HD > 0 ? HD : hd;
    const float s = row_scale<T>(src, n);
    for (int64_t d = 0; d < n; ++d) dst[d] = E::load(src[d]) * s;
  }

  // scores: [g, n] scratch; qf [g][kMaxHeadDim] scaled queries; acc, m, l: the online-softmax state (in/out).
  static void run(const raw_t* kp, const raw_t* vp, const KeyWalk& keys, int64_t g, int64_t hd_rt,
                  float (*qf)[kMaxHeadDim], float (*acc)[kMaxHeadDim], float* m, float* l, std::vector<float>& scores) {
    const int64_t hd = HD > 0 ? HD : hd_rt;
    const int64_t n = std::max<int64_t>(0, keys.seq_len - keys.lo);
    if (n == 0) return;
    scores.resize(static_cast<size_t>(n * g));
    float row[kMaxHeadDim];
    // Pass 1: scores q . k (head j's scores contiguous: scores[j * n + t]).
    keys.each(kp, [&](const raw_t* krow, int64_t t) {
      load_row(krow, row, hd);
      for (int64_t j = 0; j < g; ++j) scores[j * n + t] = dot(qf[j], row, hd);
    });
    // Softmax weights against the running maximum (a prior part's lse included).
    for (int64_t j = 0; j < g; ++j) {
      float* sj = scores.data() + j * n;
      float lanes[16];
      for (int e = 0; e < 16; ++e) lanes[e] = m[j];
      int64_t k = 0;
      for (; k + 16 <= n; k += 16)
        for (int e = 0; e < 16; ++e) lanes[e] = sj[k + e] > lanes[e] ? sj[k + e] : lanes[e];
      float mx = m[j];
      for (int e = 0; e < 16; ++e) mx = lanes[e] > mx ? lanes[e] : mx;
      for (; k < n; ++k) mx = sj[k] > mx ? sj[k] : mx;
      const float corr = l[j] > 0.f ? std::exp(m[j] - mx) : 0.f;
      for (int64_t k2 = 0; k2 < n; ++k2) sj[k2] = exp_nonpositive(sj[k2] - mx);
      m[j] = mx;
      l[j] = l[j] * corr + lane_sum(sj, n);
      for (int64_t d = 0; d < hd; ++d) acc[j][d] *= corr;
    }
    // Pass 2: acc += w * v.
    keys.each(vp, [&](const raw_t* vrow, int64_t t) {
      load_row(vrow, row, hd);
      for (int64_t j = 0; j < g; ++j) {
        const float w = scores[j * n + t];
        float* a = acc[j];
        for (int64_t d = 0; d < hd; ++d) a[d] += w * row[d];
      }
    });
  }
};

// The same item on 16-float vectors (GCC / Clang vector extensions: one zmm register with AVX-512, two ymm with
// AVX2) for head dims that are multiples of 16; each query head's accumulator stays in registers over the keys.
// r[i] = the sum of the lanes of p[i], for 16 vectors at once: four rounds that each add two shuffles of pairs
// of vectors, halving the lanes every vector's partial sums take (16 -> 8 -> 4 -> 2 -> 1).
inline vf16 reduce16(const vf16* p) {
  vf16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The largest of x[0 .. n) (NaNs ignored; -inf for none), per lane over 16-wide chunks so that it vectorizes.
inline float lane_max(const float* x, int64_t n) {
  float lanes[16];
  for (int e = 0; e < 16; ++e) lanes[e] = -std::numeric_limits<float>::infinity();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    for (int e = 0; e < 16; ++e) lanes[e] = x[k + e] > lanes[e] ? x[k + e] : lanes[e];
  float mx = -std::numeric_limits<float>::infinity();
  for (int e = 0; e < 16; ++e) mx = lanes[e] > mx ? lanes[e] : mx;
  for (; k < n; ++k) mx = x[k] > mx ? x[k] : mx;
  return mx;
}

template <typename T, int HD, int G>
struct DecodeItemVec {
  using E = Elem<T>;
  using raw_t = typename E::raw_t;
  static constexpr int C = HD / 16;  // vectors per head row
  static constexpr int GM = G > 0 ? G : kMaxGroup;

  // G > 0 fixes the query heads per KV head at compile time: every head's accumulator then stays in registers
  // and each V row is loaded once for all of them; G == 0 reads g and walks the V rows once per head.
  static void run(const raw_t* kp, const raw_t* vp, const KeyWalk& keys, int64_t g_rt, int64_t /*hd*/,
                  float (*qf)[kMaxHeadDim], float (*acc)[kMaxHeadDim], float* m, float* l, std::vector<float>& scores) {
    const int64_t g = G > 0 ? G : g_rt;
    const int64_t n = std::max<int64_t>(0, keys.seq_len - keys.lo);
    if (n == 0) return;
    scores.resize(static_cast<size_t>(n * g));
#if defined(__AVX2__) && !defined(__AVX512F__)
    scores_avx2(kp, keys, g, n, qf, scores.data());
#else
    vf16 qv[GM][C];
    for (int64_t j = 0; j < g; ++j)
      for (int c = 0; c < C; ++c) std::memcpy(&qv[j][c], &qf[j][c * 16], sizeof(vf16));
    // Pass 1: scores q . k (head j's scores contiguous: scores[j * n + t]).
    // Each key's products stay a 16-lane vector until 16 keys are in; reduce16 then sums the 16 vectors at once
    // (a quarter of the shuffles of one horizontal sum per key).
    vf16 part[GM][16];
    int filled = 0;
    int64_t first = 0;
    auto store = [&](int count) {
      for (int64_t j = 0; j < g; ++j) {
        const vf16 r = reduce16(part[j]);
        std::memcpy(scores.data() + j * n + first, &r, sizeof(float) * count);
      }
    };
    keys.each(kp, [&](const raw_t* krow, int64_t /*t*/) {
      vf16 k[C];
      for (int c = 0; c < C; ++c) k[c] = load16<T>(krow + c * 16);
      const float ks = row_scale<T>(krow, HD);
      for (int64_t j = 0; j < g; ++j) {
        vf16 s = qv[j][0] * k[0];
        for (int c = 1; c < C; ++c) s += qv[j][c] * k[c];
        part[j][filled] = s * ks;
      }
      if (++filled == 16) {
        store(16);
        first += 16;
        filled = 0;
      }
    });
    if (filled > 0) {
      for (int64_t j = 0; j < g; ++j)
        for (int e = filled; e < 16; ++e) part[j][e] = vf16{};
      store(filled);
    }
#endif
    float corr[GM];
    for (int64_t j = 0; j < g; ++j) {
      float* sj = scores.data() + j * n;
      const float mx = std::max(m[j], lane_max(sj, n));
      corr[j] = l[j] > 0.f ? std::exp(m[j] - mx) : 0.f;
      for (int64_t k = 0; k < n; ++k) sj[k] = exp_nonpositive(sj[k] - mx);
      m[j] = mx;
      l[j] = l[j] * corr[j] + lane_sum(sj, n);
    }
    // Pass 2: acc_j = corr_j * acc_j + sum_t w_jt v_t, the accumulators in registers: all G heads at once, or
    // (G == 0) the g heads in blocks of up to kValueHeads, each V row widened once per block.
    if constexpr (G > 0) {
      accumulate_values<G>(vp, keys, scores.data(), n, corr, acc);
    } else {
      for (int64_t j = 0; j < g; j += kValueHeads) {
        switch (std::min<int64_t>(kValueHeads, g - j)) {
          case 1: accumulate_values<1>(vp, keys, scores.data() + j * n, n, corr + j, acc + j); break;
          case 2: accumulate_values<2>(vp, keys, scores.data() + j * n, n, corr + j, acc + j); break;
          case 3: accumulate_values<3>(vp, keys, scores.data() + j * n, n, corr + j, acc + j); break;
          default: accumulate_values<kValueHeads>(vp, keys, scores.data() + j * n, n, corr + j, acc + j); break;
        }
      }
    }
  }

#if defined(__AVX2__) && !defined(__AVX512F__)
  // AVX2 pass 1: scores[j * n + t] = q_j . k_t (times the row's scale for int8), 8 keys at a time. The 16-float
  // vectors of run's generic loop (a query head's 4 and each key's 16 partial sums) do not fit 16 ymm registers and
  // GCC kept them on the stack; here each head's query is read in pieces of 4 ymm against 8 named accumulators
  // (one per key), and reduce8 sums each key's 8 lanes in the same tree whatever the keys beside it.
  static inline __m256 reduce8(const __m256* a) {
    const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
  }

  static void scores_avx2(const raw_t* kp, const KeyWalk& keys, int64_t g, int64_t n, float (*qf)[kMaxHeadDim],
                          float* scores) {
    constexpr int R = 2 * C, RH = R >= 8 ? 4 : R;  // ymm per head row; ymm of the query held at once
    const raw_t* rows[8];
    alignas(32) float ks[8];
    int64_t first = 0;
    int filled = 0;
    auto flush = [&](int count) {
      for (int e = count; e < 8; ++e) rows[e] = rows[0];  // padding lanes: read a real row, never stored
      for (int64_t j = 0; j < g; ++j) {
        __m256 acc[8];
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
        for (int r0 = 0; r0 < R; r0 += RH) {
          __m256 qv[RH];
          for (int r = 0; r < RH; ++r) qv[r] = _mm256_loadu_ps(&qf[j][(r0 + r) * 8]);
          for (int t = 0; t < 8; ++t)
            for (int r = 0; r < RH; ++r) acc[t] = _mm256_fmadd_ps(qv[r], load8<T>(rows[t] + (r0 + r) * 8), acc[t]);
        }
        __m256 s = reduce8(acc);
        if constexpr (std::is_same<T, int8_t>::value) s = _mm256_mul_ps(s, _mm256_load_ps(ks));
        if (count == 8) {
          _mm256_storeu_ps(scores + j * n + first, s);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, s);
          std::memcpy(scores + j * n + first, tmp, sizeof(float) * count);
        }
      }
    };
    keys.each(kp, [&](const raw_t* krow, int64_t /*t*/) {
      rows[filled] = krow;
      if constexpr (std::is_same<T, int8_t>::value) ks[filled] = row_scale<T>(krow, HD);  // float rows: 1
      if (++filled == 8) {
        flush(8);
        first += 8;
        filled = 0;
      }
    });
    if (filled > 0) flush(filled);
  }
#endif

  static constexpr int kValueHeads = 4;

#if defined(__AVX2__) && !defined(__AVX512F__)
  // AVX2: the loop below on 8-float registers. GCC splits the 16-float vector type into ymm halves but builds its
  // scalar-times-vector broadcasts through the stack and moves those halves through general registers (64 sequences x
  // 84 keys, fp32: 2.4-2.7 ms a call, against 0.63 ms with this loop). The head dim runs in pieces of R ymm, the keys walked once
  // a piece, so that NB x R accumulators stay in registers; the same fused multiply-adds in the same order.
  static constexpr int run8(int most) {
    while ((2 * C) % most != 0) --most;
    return most;
  }

  template <int NB>
  static inline void accumulate_values(const raw_t* vp, const KeyWalk& keys, const float* w, int64_t n,
                                       const float* corr, float (*acc)[kMaxHeadDim]) {
    constexpr int R = run8(std::max(1, std::min(2 * C, 12 / NB)));
    for (int r0 = 0; r0 < 2 * C; r0 += R) {
      __m256 a[NB][R];
      for (int j = 0; j < NB; ++j) {
        const __m256 cj = _mm256_set1_ps(corr[j]);
        for (int r = 0; r < R; ++r) a[j][r] = _mm256_mul_ps(_mm256_loadu_ps(&acc[j][(r0 + r) * 8]), cj);
      }
      keys.each(vp, [&](const raw_t* vrow, int64_t t) {
        __m256 v[R];
        for (int r = 0; r < R; ++r) v[r] = load8<T>(vrow + (r0 + r) * 8);
        const float vs = row_scale<T>(vrow, HD);
        for (int j = 0; j < NB; ++j) {
          const __m256 wt = _mm256_set1_ps(w[j * n + t] * vs);
          for (int r = 0; r < R; ++r) a[j][r] = _mm256_fmadd_ps(wt, v[r], a[j][r]);
        }
      });
      for (int j = 0; j < NB; ++j)
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(&acc[j][(r0 + r) * 8], a[j][r]);
    }
  }
#else
  // acc_j = corr_j * acc_j + sum_t w[j * n + t] v_t for NB heads, their accumulators in registers.
  template <int NB>
  static inline void accumulate_values(const raw_t* vp, const KeyWalk& keys, const float* w, int64_t n,
                                       const float* corr, float (*acc)[kMaxHeadDim]) {
    vf16 a[NB][C];
    for (int j = 0; j < NB; ++j)
      for (int c = 0; c < C; ++c) {
        std::memcpy(&a[j][c], &acc[j][c * 16], sizeof(vf16));
        a[j][c] *= corr[j];
      }
    keys.each(vp, [&](const raw_t* vrow, int64_t t) {
      vf16 v[C];
      for (int c = 0; c < C; ++c) v[c] = load16<T>(vrow + c * 16);
      const float vs = row_scale<T>(vrow, HD);
      for (int j = 0; j < NB; ++j) {
        const float wt = w[j * n + t] * vs;
        for (int c = 0; c < C; ++c) a[j][c] += wt * v[c];
      }
    });
    for (int j = 0; j < NB; ++j)
      for (int c = 0; c < C; ++c) std::memcpy(&acc[j][c * 16], &a[j][c], sizeof(vf16));
  }
#endif
};

template <typename T, int HD, int G>
using DecodeItemFor =
    typename std::conditional<HD % 16 == 0 && HD != 0, DecodeItemVec<T, HD, G>, DecodeItem<T, HD>>::type;

template <typename T, typename CacheT, int HD, int G>
void decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, int64_t first_block, double scale, int64_t sliding_window,
                      const at::Tensor* prior_out, const at::Tensor* prior_lse, bool group_shared, at::Tensor& out) {
  using E = Elem<T>;
  using raw_t = typename E::raw_t;
  using cache_t = typename Elem<CacheT>::raw_t;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), hd = q.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv = kv_cache.size(3);
  const int64_t g = num_heads / num_kv;
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t c_half = kv_cache.stride(0), c_block = kv_cache.stride(1), c_tok = kv_cache.stride(2),
                c_head = kv_cache.stride(3);
  const int64_t bt_s0 = block_tables.stride(0), max_blocks = block_tables.size(1);
  const raw_t* qp = reinterpret_cast<const raw_t*>(q.data_ptr());
  const cache_t* kp = reinterpret_cast<const cache_t*>(kv_cache.data_ptr());
  const cache_t* vp = kp + c_half;
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* slp = seq_lens.data_ptr<int64_t>();
  const raw_t* pop = prior_out ? reinterpret_cast<const raw_t*>(prior_out->data_ptr()) : nullptr;
  const int64_t po_s0 = prior_out ? prior_out->stride(0) : 0, po_s1 = prior_out ? prior_out->stride(1) : 0;
  const float* plp = prior_lse ? prior_lse->data_ptr<float>() : nullptr;
  const int64_t pl_s0 = prior_lse ? prior_lse->stride(0) : 0, pl_s1 = prior_lse ? prior_lse->stride(1) : 0;
  raw_t* op = reinterpret_cast<raw_t*>(out.data_ptr());
  const int64_t first_pos = first_block * block_size;

  // Sequences whose block tables start with the same blocks (the requests of one LoRA adapter over one system
  // prompt, the rows of one prefill chunk) are attended in chunks of up to kMaxGroup / g: the chunk's common keys
  // are read once for the query heads of all its sequences, then each sequence's own keys continue its online
  // softmax (cascade attention within the call; Ye et al. 2024).
  std::vector<int64_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  const int64_t chunk_max = sliding_window > 0 || !group_shared ? 1 : std::max<int64_t>(1, kMaxGroup / g);
  const auto first_of = [&](int64_t i) { return btp[i * bt_s0 + std::min(first_block, max_blocks - 1)]; };
  if (chunk_max > 1)
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return first_of(a) < first_of(b); });
  std::vector<int64_t> chunk_start{0}, chunk_shared_end;  // chunk c: order[chunk_start[c] .. chunk_start[c + 1])
  for (int64_t k = 0; k < num_seqs;) {
    const int64_t head = order[k];
    int64_t end = k + 1, min_len = slp[head];
    if (chunk_max > 1) {
      int64_t same_first = k + 1;  // the run of sequences with head's first block, split evenly into chunks
      while (same_first < num_seqs && first_of(order[same_first]) == first_of(head)) ++same_first;
      const int64_t run = same_first - k, pieces = (run + chunk_max - 1) / chunk_max;
      end = k + (run + pieces - 1) / pieces;
    }
    for (int64_t m = k + 1; m < end; ++m) min_len = std::min(min_len, slp[order[m]]);
    int64_t shared = 0;  // blocks from first_block equal in every table of the chunk, each query's own key after
    const int64_t limit = std::min((min_len - 1) / block_size - first_block, max_blocks - first_block);
    while (end - k > 1 && shared < limit) {
      const int64_t b = btp[head * bt_s0 + first_block + shared];
      bool same = true;
      for (int64_t m = k + 1; m < end && same; ++m) same = btp[order[m] * bt_s0 + first_block + shared] == b;
      if (!same) break;
      ++shared;
    }
    chunk_shared_end.push_back(first_pos + shared * block_size);
    chunk_start.push_back(end);
    k = end;
  }
  const int64_t num_chunks = static_cast<int64_t>(chunk_shared_end.size());
  if (num_chunks == num_seqs)  // nothing shared: the batch's own order (each sequence's keys follow the last's)
    for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;

  int64_t total_keys = 0;
  for (int64_t i = 0; i < num_seqs; ++i) total_keys += std::max<int64_t>(0, slp[i] - first_pos);
  const int64_t items = num_chunks * num_kv;
  const int64_t work_per_item = std::max<int64_t>(1, total_keys / std::max<int64_t>(1, num_chunks)) * g * hd * 2;

  at::parallel_for(0, items, grain(work_per_item, 1 << 15), [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    float qf[kMaxGroup][kMaxHeadDim];
    float acc[kMaxGroup][kMaxHeadDim];
    float m[kMaxGroup], l[kMaxGroup];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / num_kv, h = item % num_kv;
      const int64_t members = chunk_start[c + 1] - chunk_start[c];
      const int64_t* seqs = order.data() + chunk_start[c];
      for (int64_t s = 0; s < members; ++s)
        for (int64_t j = 0; j < g; ++j) {
          const int64_t i = seqs[s], r = s * g + j;
          const raw_t* src = qp + i * q_s0 + (h * g + j) * q_s1;
          for (int64_t d = 0; d < hd; ++d) qf[r][d] = E::load(src[d]) * static_cast<float>(scale);
          if (pop) {
            const raw_t* prior = pop + h * po_s0 + (i * g + j) * po_s1;
            for (int64_t d = 0; d < hd; ++d) acc[r][d] = E::load(prior[d]);
            m[r] = plp[h * pl_s0 + (i * g + j) * pl_s1];
            l[r] = 1.f;
          } else {
            for (int64_t d = 0; d < hd; ++d) acc[r][d] = 0.f;
            m[r] = -std::numeric_limits<float>::infinity();
            l[r] = 0.f;
          }
        }
      const int64_t shared_end = chunk_shared_end[c];
      if (shared_end > first_pos) {  // the common keys, once for every query head of the chunk
        const KeyWalk common{btp + seqs[0] * bt_s0, max_blocks, first_pos, shared_end, block_size,
                             c_block,             c_tok,      h * c_head, kv_cache.size(4)};
        DecodeItemFor<CacheT, HD, 0>::run(kp, vp, common, members * g, hd, qf, acc, m, l, scores);
      }
      for (int64_t s = 0; s < members; ++s) {
        const int64_t i = seqs[s], seq_len = slp[i];
        int64_t lo = std::max(first_pos, shared_end);
        if (sliding_window > 0) lo = std::max(lo, seq_len - sliding_window);  // the query sits at seq_len - 1
        const KeyWalk keys{btp + i * bt_s0, max_blocks, lo, seq_len, block_size, c_block, c_tok, h * c_head, kv_cache.size(4)};
        DecodeItemFor<CacheT, HD, G>::run(kp, vp, keys, g, hd, qf + s * g, acc + s * g, m + s * g, l + s * g, scores);
        for (int64_t j = 0; j < g; ++j) {
          const int64_t r = s * g + j;
          const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
          raw_t* dst = op + i * num_heads * hd + (h * g + j) * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = E::store(acc[r][d] * inv);
        }
      }
    }
  });
}

// Compile-time head dims 64 and 128 with 1 to 8 query heads per KV head (the usual grouped-query shapes), else
// the runtime loops.
template <typename T, typename CacheT, int HD>
void decode_attention_group(int64_t g, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t first_block, double scale, int64_t sliding_window,
                            const at::Tensor* prior_out, const at::Tensor* prior_lse, bool group_shared, at::Tensor& out) {
#define LMFORGE_GROUP(G_)                                                                                     \
  case G_:                                                                                                    \
    return decode_attention<T, CacheT, HD, G_>(q, kv_cache, block_tables, seq_lens, first_block, scale,       \
                                               sliding_window, prior_out, prior_lse, group_shared, out);
  switch (HD == 0 ? 0 : g) {
    LMFORGE_GROUP(1)
    LMFORGE_GROUP(2)
    LMFORGE_GROUP(3)
    LMFORGE_GROUP(4)
    LMFORGE_GROUP(5)
    LMFORGE_GROUP(6)
    LMFORGE_GROUP(7)
    LMFORGE_GROUP(8)
    default:
      return decode_attention<T, CacheT, HD, 0>(q, kv_cache, block_tables, seq_lens, first_block, scale,
                                                sliding_window, prior_out, prior_lse, group_shared, out);
  }
#undef LMFORGE_GROUP
}

template <typename T, typename CacheT>
void decode_attention_dispatch(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, int64_t first_block, double scale, int64_t sliding_window,
                               const at::Tensor* prior_out, const at::Tensor* prior_lse, bool group_shared, at::Tensor& out) {
  const int64_t g = q.size(1) / kv_cache.size(3);
  switch (q.size(2)) {
    case 64:
      return decode_attention_group<T, CacheT, 64>(g, q, kv_cache, block_tables, seq_lens, first_block, scale,
                                                   sliding_window, prior_out, prior_lse, group_shared, out);
    case 128:
      return decode_attention_group<T, CacheT, 128>(g, q, kv_cache, block_tables, seq_lens, first_block, scale,
                                                    sliding_window, prior_out, prior_lse, group_shared, out);
    default:
      return decode_attention_group<T, CacheT, 0>(g, q, kv_cache, block_tables, seq_lens, first_block, scale,
                                                  sliding_window, prior_out, prior_lse, group_shared, out);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, int64_t first_block, double scale,
                                  int64_t sliding_window, const c10::optional<at::Tensor>& prior_out,
                                  const c10::optional<at::Tensor>& prior_lse, bool group_shared) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "paged_decode_attention: q must be CPU [D, Hq, hd]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.stride(4) == 1,
              "paged_decode_attention: kv_cache must be [2, num_blocks, block_size, Hkv, hd]");
  const bool quantized = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type() || quantized,
              "paged_decode_attention: kv_cache must be in q's dtype or int8");
  TORCH_CHECK(q.size(2) + (quantized ? kScaleBytes : 0) == kv_cache.size(4) && q.size(2) <= kMaxHeadDim,
              "paged_decode_attention: head_dim mismatch (an int8 cache row is hd + 2 bytes) or > 256");
  TORCH_CHECK(!quantized || (kv_cache.stride(3) % 2 == 0 && kv_cache.stride(2) % 2 == 0 &&
                             kv_cache.stride(1) % 2 == 0 && kv_cache.stride(0) % 2 == 0),
              "paged_decode_attention: an int8 kv_cache needs even strides (its float16 scales are read in place)");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0 && q.size(1) / kv_cache.size(3) <= kMaxGroup,
              "paged_decode_attention: num_heads must be a multiple (<= 16) of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.stride(1) == 1 && block_tables.size(1) > 0,
              "paged_decode_attention: block_tables must be int64 [D, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention: seq_lens must be contiguous int64 [D]");
  TORCH_CHECK(prior_out.has_value() == prior_lse.has_value(), "paged_decode_attention: give prior_out with prior_lse");
  at::Tensor po, pl;
  if (prior_out.has_value()) {
    po = *prior_out;
    pl = *prior_lse;
    const int64_t num_kv = kv_cache.size(3), rows = q.size(0) * (q.size(1) / num_kv);
    TORCH_CHECK(po.scalar_type() == q.scalar_type() && po.dim() == 3 && po.size(0) == num_kv && po.size(1) == rows &&
                    po.size(2) == q.size(2) && po.stride(2) == 1,
                "paged_decode_attention: prior_out must be [Hkv, D * g, hd] in q's dtype");
    TORCH_CHECK(pl.scalar_type() == at::kFloat && pl.dim() == 2 && pl.size(0) == num_kv && pl.size(1) == rows,
                "paged_decode_attention: prior_lse must be float32 [Hkv, D * g]");
  }
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  const at::Tensor* pop = prior_out.has_value() ? &po : nullptr;
  const at::Tensor* plp = prior_out.has_value() ? &pl : nullptr;
  if (q.scalar_type() == at::kBFloat16 && quantized) {
    decode_attention_dispatch<at::BFloat16, int8_t>(q, kv_cache, block_tables, seq_lens, first_block, scale,
                                                    sliding_window, pop, plp, group_shared, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_dispatch<at::BFloat16, at::BFloat16>(q, kv_cache, block_tables, seq_lens, first_block, scale,
                                                          sliding_window, pop, plp, group_shared, out);
  } else if (q.scalar_type() == at::kFloat && quantized) {
    decode_attention_dispatch<float, int8_t>(q, kv_cache, block_tables, seq_lens, first_block, scale, sliding_window,
                                             pop, plp, group_shared, out);
  } else if (q.scalar_type() == at::kFloat) {
    decode_attention_dispatch<float, float>(q, kv_cache, block_tables, seq_lens, first_block, scale, sliding_window,
                                            pop, plp, group_shared, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: q must be bf16 or fp32");
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ rope + cache

// No fused multiply-add in the rotation: the products and the sum round apart, as the torch ops do.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rope_and_cache_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                         const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv, at::Tensor& q) {
  using E = Elem<T>;
  using raw_t = typename E::raw_t;
  const bool quantized = kv_cache.scalar_type() == at::kChar;
  const int64_t n = qkv.size(0), row = kv_cache.size(4), hd = quantized ? row - kScaleBytes : row;
  const raw_t* xp = reinterpret_cast<const raw_t*>(qkv.data_ptr());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  // the cache in bytes (int8 rows, or rows of sizeof(raw_t) bytes per value)
  const int64_t esize = quantized ? 1 : static_cast<int64_t>(sizeof(raw_t));
  char* kp = reinterpret_cast<char*>(kv_cache.data_ptr());
  char* vp = kp + kv_cache.stride(0) * esize;
  raw_t* qp = reinterpret_cast<raw_t*>(q.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t x_stride = qkv.stride(0), c_stride = cos.stride(0), s_stride = sin.stride(0);
  const int64_t block_size = kv_cache.size(2), c_block = kv_cache.stride(1) * esize,
                c_tok = kv_cache.stride(2) * esize, row_bytes = row * esize;
  const int64_t half = hd / 2, num_rot = num_heads + num_kv;
  at::parallel_for(0, n, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    float c[kMaxHeadDim], sn[kMaxHeadDim], vals[kMaxHeadDim];
    raw_t rotated[kMaxHeadDim];
    for (int64_t t = begin; t < end; ++t) {
      const raw_t* x = xp + t * x_stride;
      for (int64_t d = 0; d < hd; ++d) {
        c[d] = cp[t * c_stride + d];
        sn[d] = sp[t * s_stride + d];
      }
      const int64_t slot = slots[t];
      char* k_dst = slot >= 0 ? kp + (slot / block_size) * c_block + (slot % block_size) * c_tok : nullptr;
      char* v_dst = slot >= 0 ? vp + (slot / block_size) * c_block + (slot % block_size) * c_tok : nullptr;
      for (int64_t h = 0; h < num_rot; ++h) {
        const raw_t* src = x + h * hd;
        const bool is_k = h >= num_heads;
        if (is_k && !k_dst) continue;
        char* k_row = is_k ? k_dst + (h - num_heads) * row_bytes : nullptr;
        raw_t* dst = !is_k ? qp + (t * num_heads + h) * hd : (quantized ? rotated : reinterpret_cast<raw_t*>(k_row));
        // each product and the sum rounded to float32 apart (fp-contract off): torch's three ops
        for (int64_t d = 0; d < half; ++d) {  // the two halves apart, so both loops vectorize
          const float a = E::load(src[d]) * c[d];
          const float b = E::load(src[d + half]) * sn[d];
          dst[d] = E::store(a + b);
        }
        for (int64_t d = half; d < hd; ++d) {
          const float a = E::load(src[d]) * c[d];
          const float b = E::load(src[d - half]) * sn[d];
          dst[d] = E::store(a + b);
        }
        if (is_k && quantized) {
          for (int64_t d = 0; d < hd; ++d) vals[d] = E::load(rotated[d]);
          quantize_row(vals, hd, reinterpret_cast<int8_t*>(k_row));
        }
      }
      if (!v_dst) continue;
      const raw_t* v_src = x + num_rot * hd;
      if (!quantized) {
        std::memcpy(v_dst, v_src, static_cast<size_t>(num_kv * hd) * sizeof(raw_t));
        continue;
      }
      for (int64_t h = 0; h < num_kv; ++h) {
        for (int64_t d = 0; d < hd; ++d) vals[d] = E::load(v_src[h * hd + d]);
        quantize_row(vals, hd, reinterpret_cast<int8_t*>(v_dst + h * row_bytes));
      }
    }
  });
}

at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv) {
  const bool bf16 = qkv.scalar_type() == at::kBFloat16;
  TORCH_CHECK(qkv.device().is_cpu() && (bf16 || qkv.scalar_type() == at::kFloat) && qkv.dim() == 2 &&
                  qkv.stride(1) == 1,
              "rope_and_cache: qkv must be a CPU bf16 or float32 [N, (Hq + 2 Hkv) * hd] tensor with unit last stride");
  const bool quantized = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK((kv_cache.scalar_type() == qkv.scalar_type() || quantized) && kv_cache.dim() == 5 &&
                  kv_cache.size(0) == 2 && kv_cache.size(3) == num_kv && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4),
              "rope_and_cache: kv_cache must be [2, num_blocks, block_size, Hkv, hd] in qkv's dtype or int8 "
              "[..., hd + 2] with contiguous tokens");
  const int64_t n = qkv.size(0), row = kv_cache.size(4), hd = quantized ? row - kScaleBytes : row;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv) * hd, "rope_and_cache: qkv width is not (Hq + 2 Hkv) * hd");
  TORCH_CHECK(hd % 2 == 0 && hd <= kMaxHeadDim, "rope_and_cache: head_dim must be even and <= 256");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  sin.dim() == 2 && cos.size(0) == n && sin.size(0) == n && cos.size(1) == hd && sin.size(1) == hd &&
                  cos.stride(1) == 1 && sin.stride(1) == 1,
              "rope_and_cache: cos and signed_sin must be float32 [N, hd]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == n &&
                  slot_mapping.is_contiguous(),
              "rope_and_cache: slot_mapping must be contiguous int64 [N]");
  at::Tensor q = at::empty({n, num_heads, hd}, qkv.options());
  if (bf16)
    rope_and_cache_rows<at::BFloat16>(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv, q);
  else
    rope_and_cache_rows<float>(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv, q);
  return q;
}

#pragma GCC pop_options

// ------------------------------------------------------------------------------------------------ token bitmask

template <typename raw_t>
void bitmask_rows(at::Tensor& logits, const at::Tensor& bitmask, raw_t neg_inf) {
  const int64_t rows = logits.size(0), cols = logits.size(1), stride = logits.stride(0);
  const int64_t words = bitmask.size(1), word_stride = bitmask.stride(0);
  raw_t* lp = reinterpret_cast<raw_t*>(logits.data_ptr());
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t used_words = std::min(words, (cols + 31) / 32);
  for (int64_t r = 0; r < rows; ++r) {
    raw_t* row = lp + r * stride;
    const uint32_t* mask = mp + r * word_stride;
    for (int64_t w = 0; w < used_words; ++w) {
      const uint32_t allowed = mask[w];
      if (allowed == 0xffffffffu) continue;
      const int64_t base = w * 32;
      const int64_t n = std::min<int64_t>(32, cols - base);
      if (allowed == 0u) {
        std::fill(row + base, row + base + n, neg_inf);
        continue;
      }
      for (uint32_t off = ~allowed; off != 0u; off &= off - 1u) {
        const int64_t k = __builtin_ctz(off);
        if (k < n) row[base + k] = neg_inf;
      }
    }
  }
}

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask_: logits must be a CPU [S, V] tensor with unit last stride");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.stride(1) == 1,
              "apply_token_bitmask_: bitmask must be a CPU [S, W] int32 tensor with unit last stride");
  TORCH_CHECK(bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask_: bitmask must be [S, ceil(V / 32)] for logits [S, V]");
  switch (logits.scalar_type()) {
    case at::kBFloat16:
      bitmask_rows<uint16_t>(logits, bitmask, 0xff80u);
      break;
    case at::kHalf:
      bitmask_rows<uint16_t>(logits, bitmask, 0xfc00u);
      break;
    case at::kFloat:
      bitmask_rows<uint32_t>(logits, bitmask, 0xff800000u);
      break;
    default:
      TORCH_CHECK(false, "apply_token_bitmask_: logits must be bf16, fp16 or fp32");
  }
}

// ------------------------------------------------------------------------------------------------ LoRA

constexpr int64_t kLoraTaskRows = 16;

// Rows of w asked for ahead of the one read: an adapter's weights are cold in a decode step (the base's weights
// and the KV cache pass through the caches between two layers), and the hardware prefetchers follow these short
// runs late (a layer's 8 rank-16 q/k/v slots with cold weights: 1.1x faster).
constexpr int64_t kLoraPrefetchRows = 48;

constexpr int kLoraRowBlock = 8;  // rows per register block: 8 x 3 accumulators + 3 weight vectors fit 32 zmm

// out[r][c] = sum_i xr[r][i] w[i][c] for kLoraRowBlock rows r and NV * 16 columns c: the accumulators stay in
// registers, and each row of w is loaded (and widened to float32) once for all the rows.
template <typename T, int NV>
inline void lora_block(const float* xr, int64_t xs, const typename Elem<T>::raw_t* w, int64_t ld, int64_t depth,
                       float* out, int64_t os) {
  vf16 acc[kLoraRowBlock][NV];
  for (int r = 0; r < kLoraRowBlock; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf16{} + 0.f;
  for (int64_t i = 0; i < depth; ++i) {
    vf16 a[NV];
    if (i + kLoraPrefetchRows < depth) {
      const char* ahead = reinterpret_cast<const char*>(w + (i + kLoraPrefetchRows) * ld);
      for (size_t b = 0; b < NV * 16 * sizeof(*w); b += 64) __builtin_prefetch(ahead + b, 0, 3);
    }
    for (int v = 0; v < NV; ++v) a[v] = load16<T>(w + i * ld + v * 16);
    for (int r = 0; r < kLoraRowBlock; ++r) {
      const float xi = xr[r * xs + i];
      for (int v = 0; v < NV; ++v) acc[r][v] += xi * a[v];
    }
  }
  for (int r = 0; r < kLoraRowBlock; ++r)
    for (int v = 0; v < NV; ++v) std::memcpy(out + r * os + v * 16, &acc[r][v], sizeof(vf16));
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// lora_block for 4 rows x 16 columns in ymm registers: 8 named accumulators, two weight vectors and a broadcast.
// lora_block's 16-float vectors take 2 ymm each on AVX2, and GCC 13 kept its 8 x 3 block of them on the stack,
// storing and reloading around every FMA (64 rows over 8 rank-16 q/k/v slots: 1.37 ms a call, 0.11 ms here).
template <typename T>
inline void lora_block4_avx2(const float* xr, int64_t xs, const typename Elem<T>::raw_t* w, int64_t ld,
                             int64_t depth, float* out, int64_t os) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  for (int64_t i = 0; i < depth; ++i) {
    if (i + kLoraPrefetchRows < depth) {
      const char* ahead = reinterpret_cast<const char*>(w + (i + kLoraPrefetchRows) * ld);
      for (size_t b = 0; b < 16 * sizeof(*w); b += 64) __builtin_prefetch(ahead + b, 0, 3);
    }
    const __m256 w0 = load8<T>(w + i * ld), w1 = load8<T>(w + i * ld + 8);
    __m256 x = _mm256_broadcast_ss(xr + i);
    a00 = _mm256_fmadd_ps(x, w0, a00);
    a01 = _mm256_fmadd_ps(x, w1, a01);
    x = _mm256_broadcast_ss(xr + xs + i);
    a10 = _mm256_fmadd_ps(x, w0, a10);
    a11 = _mm256_fmadd_ps(x, w1, a11);
    x = _mm256_broadcast_ss(xr + 2 * xs + i);
    a20 = _mm256_fmadd_ps(x, w0, a20);
    a21 = _mm256_fmadd_ps(x, w1, a21);
    x = _mm256_broadcast_ss(xr + 3 * xs + i);
    a30 = _mm256_fmadd_ps(x, w0, a30);
    a31 = _mm256_fmadd_ps(x, w1, a31);
  }
  _mm256_storeu_ps(out, a00);
  _mm256_storeu_ps(out + 8, a01);
  _mm256_storeu_ps(out + os, a10);
  _mm256_storeu_ps(out + os + 8, a11);
  _mm256_storeu_ps(out + 2 * os, a20);
  _mm256_storeu_ps(out + 2 * os + 8, a21);
  _mm256_storeu_ps(out + 3 * os, a30);
  _mm256_storeu_ps(out + 3 * os + 8, a31);
}
#endif

// out [8, cols] = xr [8, depth] (float32, row stride xs) times w [depth, cols] (T, row stride ld), float32.
template <typename T>
void lora_gemm(const float* xr, int64_t xs, const typename Elem<T>::raw_t* w, int64_t ld, int64_t depth,
               int64_t cols, float* out, int64_t os) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 48 <= cols; c += 48) lora_block<T, 3>(xr, xs, w + c, ld, depth, out + c, os);
  if (cols - c >= 32) {
    lora_block<T, 2>(xr, xs, w + c, ld, depth, out + c, os);
    c += 32;
  } else if (cols - c >= 16) {
    lora_block<T, 1>(xr, xs, w + c, ld, depth, out + c, os);
    c += 16;
  }
#elif defined(__AVX2__)
  static_assert(kLoraRowBlock == 8, "two blocks of 4 rows");
  for (; c + 16 <= cols; c += 16) {
    lora_block4_avx2<T>(xr, xs, w + c, ld, depth, out + c, os);
    lora_block4_avx2<T>(xr + 4 * xs, xs, w + c, ld, depth, out + 4 * os + c, os);
  }
#else
  for (; c + 16 <= cols; c += 16) lora_block<T, 1>(xr, xs, w + c, ld, depth, out + c, os);
#endif
  for (; c < cols; ++c)
    for (int r = 0; r < kLoraRowBlock; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < depth; ++i) sum += xr[r * xs + i] * Elem<T>::load(w[i * ld + c]);
      out[r * os + c] = sum;
    }
}

template <typename T>
void lora_apply_tasks(at::Tensor& y, const at::Tensor& x, const int64_t* rows, const int64_t* bounds,
                      const int64_t* slots, int64_t tasks, const at::Tensor& A, const at::Tensor& B,
                      const std::vector<int64_t>& splits) {
  using E = Elem<T>;
  using raw_t = typename E::raw_t;
  const int64_t in = x.size(1), K = A.size(2), n_mod = static_cast<int64_t>(splits.size()) - 1, R = K / n_mod;
  const raw_t* xp = reinterpret_cast<const raw_t*>(x.data_ptr());
  raw_t* yp = reinterpret_cast<raw_t*>(y.data_ptr());
  const raw_t* ap = reinterpret_cast<const raw_t*>(A.data_ptr());
  const raw_t* bp = reinterpret_cast<const raw_t*>(B.data_ptr());
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0), out = B.size(2);
  int64_t widest = 0;
  for (int64_t j = 0; j < n_mod; ++j) widest = std::max(widest, splits[j + 1] - splits[j]);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // the task's rows of x and of x A (float32; rows past the task's are zero), and a row block of deltas
    std::vector<float> xs(kLoraTaskRows * in), t(kLoraTaskRows * K), delta(kLoraRowBlock * widest);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = bounds[task], nr = bounds[task + 1] - first;
      const raw_t* a = ap + slots[task] * in * K;
      const raw_t* b = bp + slots[task] * K * out;
      std::fill(xs.begin(), xs.end(), 0.f);
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t i = 0; i < in; ++i) xs[r * in + i] = E::load(xp[rows[first + r] * x_stride + i]);
      for (int64_t r0 = 0; r0 < nr; r0 += kLoraRowBlock) lora_gemm<T>(&xs[r0 * in], in, a, K, in, K, &t[r0 * K], K);
      for (int64_t j = 0; j < n_mod; ++j) {  // module j: its rank rows times its block of B
        const int64_t c0 = splits[j], width = splits[j + 1] - c0;
        for (int64_t r0 = 0; r0 < nr; r0 += kLoraRowBlock) {
          lora_gemm<T>(&t[r0 * K + j * R], K, b + j * R * out + c0, out, R, width, delta.data(), widest);
          for (int64_t r = r0; r < std::min(nr, r0 + kLoraRowBlock); ++r) {
            raw_t* yr = yp + rows[first + r] * y_stride + c0;
            const float* dr = delta.data() + (r - r0) * widest;
            for (int64_t c = 0; c < width; ++c) yr[c] = E::store(E::load(yr[c]) + dr[c]);
          }
        }
      }
    }
  });
}

at::Tensor& lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& task_bounds,
                       const at::Tensor& task_slots, const at::Tensor& A, const at::Tensor& B,
                       const at::Tensor& out_splits) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && y.scalar_type() == dtype &&
                  A.scalar_type() == dtype && B.scalar_type() == dtype,
              "lora_apply: x, y, A and B must share one dtype, bf16 or float32");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1 &&
                  A.dim() == 3 && B.dim() == 3 && A.is_contiguous() && B.is_contiguous() && A.size(0) == B.size(0) &&
                  A.size(1) == x.size(1) && A.size(2) == B.size(1) && B.size(2) == y.size(1),
              "lora_apply: want x [N, in], y [N, out] (unit last strides), A [S, in, K], B [S, K, out] contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && task_bounds.scalar_type() == at::kLong &&
                  task_slots.scalar_type() == at::kLong && out_splits.scalar_type() == at::kLong &&
                  rows.is_contiguous() && task_bounds.is_contiguous() && task_slots.is_contiguous() &&
                  out_splits.is_contiguous() && task_bounds.numel() == task_slots.numel() + 1,
              "lora_apply: rows, task_bounds [T + 1], task_slots [T] and out_splits must be contiguous int64");
  const int64_t tasks = task_slots.numel(), n_mod = out_splits.numel() - 1;
  TORCH_CHECK(n_mod >= 1 && A.size(2) % n_mod == 0, "lora_apply: K must be a multiple of the module count");
  const int64_t* bounds = task_bounds.data_ptr<int64_t>();
  const int64_t* slots = task_slots.data_ptr<int64_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t nr = bounds[t + 1] - bounds[t];
    TORCH_CHECK(nr >= 1 && nr <= kLoraTaskRows && bounds[t + 1] <= rows.numel() && slots[t] >= 0 &&
                    slots[t] < A.size(0),
                "lora_apply: each task holds 1..16 rows of one slot in range");
    for (int64_t r = bounds[t]; r < bounds[t + 1]; ++r)
      TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < y.size(0) && row_ids[r] < x.size(0), "lora_apply: row out of range");
  }
  std::vector<int64_t> splits(out_splits.data_ptr<int64_t>(), out_splits.data_ptr<int64_t>() + n_mod + 1);
  TORCH_CHECK(splits.front() >= 0 && splits.back() <= y.size(1) && std::is_sorted(splits.begin(), splits.end()),
              "lora_apply: out_splits must rise within [0, out]");
  if (dtype == at::kBFloat16)
    lora_apply_tasks<at::BFloat16>(y, x, row_ids, bounds, slots, tasks, A, B, splits);
  else
    lora_apply_tasks<float>(y, x, row_ids, bounds, slots, tasks, A, B, splits);
  return y;
}

}  // namespace

TORCH_LIBRARY(lmforge_engine, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor", &rms_norm);
  m.def("argmax(Tensor logits) -> Tensor", &argmax);
  m.def(
      "screen_logits(Tensor(a!) logits, Tensor hidden, Tensor weight, Tensor weight_norms, float rel, float out, "
      "float absolute) -> Tensor",
      &screen_logits);
  m.def("refine_logits(Tensor(a!) logits, Tensor hidden, Tensor weight, bool to_float, int top_k) -> Tensor",
        &refine_logits);
  m.def(
      "rope_and_cache(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "int num_heads, int num_kv) -> Tensor",
      &rope_and_cache);
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, int first_block, "
      "float scale, int sliding_window, Tensor? prior_out, Tensor? prior_lse, bool group_shared) -> Tensor",
      &paged_decode_attention);
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask) -> ()", &apply_token_bitmask_);
  m.def(
      "lora_apply(Tensor(a!) y, Tensor x, Tensor rows, Tensor task_bounds, Tensor task_slots, Tensor A, Tensor B, "
      "Tensor out_splits) -> Tensor(a!)",
      &lora_apply);
}
