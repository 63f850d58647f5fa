// AMX-INT8 kernels of the ``w8a8`` INT8 scheme (engine/quant/int8.py), built on first use by
// torch.utils.cpp_extension (with -mamx-tile -mamx-int8, only on CPUs that report amx_int8) and cached; used where
// Linux also grants the tile state.
//
// lmforge_int8_amx::usable() -> bool
//   CPUID reports AMX-TILE and AMX-INT8 and arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) succeeded (asked
//   once per process; Linux keeps the 8 KB tile state off until a process asks for it).
// lmforge_int8_amx::pack_weight(w [N, K] int8) -> int8 [NB = ceil(N / 16), KB = ceil(K / 64), 16, 64]
//   the tile layout of the B operand of TDPBSSD: block (nb, kb) is one 1 KB tile whose row r holds, for each of
//   its 16 output channels j, the 4 consecutive weights w[16 nb + j, 64 kb + 4 r .. 4 r + 3] (VNNI order), zero
//   past N and K.
// lmforge_int8_amx::quantize_per_token(x [M, K] bf16 / fp32) -> (int8 [M, K], float32 scale [M, 1])
//   the activation quantizer the GEMMs run, exposed for tests: the same integers and scales as the reference
//   ``quantize_per_token``: scale = max(max|x_row|, 1e-8) / 127, q = clamp(round_half_even(x / scale), -127, 127).
// lmforge_int8_amx::linear(x [M, K], packed, w_scale [N], bias [N]?, N, residual [M, N]?) -> [M, N] in x's dtype
//   y = acc * w_scale * x_scale (+ bias) (+ residual), acc the exact int32 sum of q x w8 (TDPBSSD), rounded once
//   to x's dtype. The product order (acc * w_scale first) is the oneDNN path's, so without a residual the output
//   is bit-identical to ``lmforge_int8::w8a8_linear``.
// lmforge_int8_amx::linear_silu_mul(x [M, K], packed gate ++ packed up, w_scale [2 I], bias [2 I]?, I) -> [M, I]
//   silu(gate) * up of a ``[gate; up]`` layer, both halves computed by the same tiles and combined in float32
//   before the one rounding (the halves are packed separately, each padded to 16 channels).
//
// Blocking: 2 x 2 tiles of 16 x 16 int32 accumulators (32 tokens x 32 channels), 2 activation and 2 weight tiles
// per 64-wide K step, the most the 8 tile registers hold. Each task of at::parallel_for owns pairs of 16-channel
// weight blocks and runs them over blocks of kRowBlock tokens (so the quantized activations stay in L2), then
// every 32-token chunk of a block.
//
// The quantizer divides by one multiply and an FMA correction (q0 = x * (1 / s), q = q0 + (x - q0 * s) / s with
// the residual exact by FMA), a quarter of the cost of a vector division; for bf16 inputs its rounded integers
// were checked equal to those of the true quotient for every pair of finite bf16 |x| <= amax (5.3e8 pairs), and
// float32 inputs and rows with a non-finite maximum take the division.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (v + magic) - magic == round-half-even(v) for |v| < 2^22
constexpr int64_t kTileBytes = 16 * 64;
constexpr int64_t kRowBlock = 256;  // tokens per pass over a task's weights (256 x 1536 int8 = 384 KB of L2)
constexpr int64_t kMacsPerTask = int64_t{1} << 21;

bool usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: accumulators, 4-5: activations (16 tokens x 64 K), 6-7: weights; all 16 rows of 64 bytes. The
// configuration lives in static storage: gcc's _tile_loadconfig declares only 8 of its 64 bytes as read, so the
// stores of a configuration on the stack may be dropped as dead.
TileConfig make_tile_config() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  return cfg;
}

const TileConfig kTileConfig = make_tile_config();

inline void configure_tiles() { _tile_loadconfig(&kTileConfig); }

// c [32][32] int32 = a (16 or 32 rows of lda bytes) x the 1 or 2 weight blocks b0, b1 over kb K steps.
template <bool TwoM, bool TwoN>
inline void tile_block(const int8_t* a, int64_t lda, const int8_t* b0, const int8_t* b1, int64_t kb,
                                   int32_t* c) {
  _tile_zero(0);
  if (TwoN) _tile_zero(1);
  if (TwoM) _tile_zero(2);
  if (TwoM && TwoN) _tile_zero(3);
  for (int64_t q = 0; q < kb; ++q) {
    _tile_loadd(4, a + q * 64, lda);
    _tile_loadd(6, b0 + q * kTileBytes, 64);
    if (TwoM) _tile_loadd(5, a + 16 * lda + q * 64, lda);
    if (TwoN) _tile_loadd(7, b1 + q * kTileBytes, 64);
    _tile_dpbssd(0, 4, 6);
    if (TwoN) _tile_dpbssd(1, 4, 7);
    if (TwoM) _tile_dpbssd(2, 5, 6);
    if (TwoM && TwoN) _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  if (TwoN) _tile_stored(1, c + 16, 128);
  if (TwoM) _tile_stored(2, c + 16 * 32, 128);
  if (TwoM && TwoN) _tile_stored(3, c + 16 * 32 + 16, 128);
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// 16 lanes of an output row: ((float(acc) * w_scale) * x_scale) + bias, as the oneDNN path rounds them.
inline __m512 dequantize(const int32_t* acc, const float* ws, const float* bias, __m512 xs, __mmask16 m) {
  __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc)), _mm512_maskz_loadu_ps(m, ws)), xs);
  return bias != nullptr ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias)) : v;
}

// As dequantize, plus the outlier segment's ((float(acc2) * w_scale) * x_scale2) before the bias (acc2 nullptr: none).
inline __m512 dequantize2(const int32_t* acc, const int32_t* acc2, const float* ws, const float* bias, __m512 xs,
                          __m512 xs2, __mmask16 m) {
  if (acc2 == nullptr) return dequantize(acc, ws, bias, xs, m);
  const __m512 w = _mm512_maskz_loadu_ps(m, ws);
  __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc)), w), xs);
  v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc2)), w), xs2));
  return bias != nullptr ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias)) : v;
}

struct BF16Out {
  using raw_t = uint16_t;
  static inline __m512 load(const raw_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
  // round to nearest even, NaN -> 0x7fc0 (as torch's float -> bf16 conversion)
  static inline void store(raw_t* p, __m512 v, __mmask16 m) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(u));
  }
};

struct F32Out {
  using raw_t = float;
  static inline __m512 load(const raw_t* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static inline void store(raw_t* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
};

// Quantizes rows [0, m) of x [m, k] into q (row stride ldq) and scale [m]; see the header for the division.
template <typename In>
void quantize_rows(const typename In::raw_t* x, int64_t m, int64_t k, int8_t* q, int64_t ldq,
                               float* scale) {
  const __m512 magic = _mm512_set1_ps(kRoundMagic), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t i = 0; i < m; ++i) {
    const typename In::raw_t* row = x + i * k;
    // max |x| over the row's bit patterns (monotonic in |x| for non-NaN values), as the reference kernel
    __m512i amax = _mm512_setzero_si512();
    for (int64_t c = 0; c < k; c += 16) {
      const __m512 v = In::load(row + c, tail_mask(k - c));
      amax = _mm512_max_epu32(amax, _mm512_castps_si512(_mm512_and_ps(v, abs_mask)));
    }
    const uint32_t bits = _mm512_reduce_max_epu32(amax);
    float amax_f;
    std::memcpy(&amax_f, &bits, sizeof(amax_f));
    const float s = std::max(amax_f, 1e-8f) / 127.0f;
    scale[i] = s;
    const bool divide = !std::is_same<In, BF16Out>::value || !(bits < 0x7f800000u);
    const __m512 sv = _mm512_set1_ps(s), rv = _mm512_set1_ps(1.0f / s);
    int8_t* out = q + i * ldq;
    for (int64_t c = 0; c < k; c += 16) {
      const __mmask16 mask = tail_mask(k - c);
      const __m512 v = In::load(row + c, mask);
      __m512 d;
      if (divide) {
        d = _mm512_div_ps(v, sv);
      } else {
        const __m512 q0 = _mm512_mul_ps(v, rv);
        d = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, sv, v), rv, q0);
      }
      d = _mm512_sub_ps(_mm512_add_ps(d, magic), magic);
      d = _mm512_min_ps(_mm512_max_ps(d, lo), hi);
      _mm_mask_storeu_epi8(out + c, mask, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(d)));
    }
  }
}

void check_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              op, ": x must be a CPU bf16 / fp32 [M, K] tensor");
  TORCH_CHECK(usable(), op, ": this CPU or kernel does not allow AMX tiles (check usable() first)");
}

// The quantized activations of one call: int8 [ceil(M / 16) * 16, KB * 64], rows 16 apart in tiles. Columns past
// K and rows past M are never zeroed: the packed weights are zero past K, and rows past M are never stored.
struct Activations {
  const int8_t* data;
  int64_t rows_padded, ld;
  std::vector<float> scale;  // [M]
};

Activations quantize_activations(const at::Tensor& x, int64_t kb, std::vector<int8_t>& buffer) {
  const int64_t m = x.size(0), k = x.size(1);
  Activations a{nullptr, (m + 15) / 16 * 16, kb * 64, std::vector<float>(m)};
  buffer.resize(a.rows_padded * a.ld);
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows<BF16Out>(static_cast<const uint16_t*>(x.const_data_ptr()), m, k, buffer.data(), a.ld, a.scale.data());
  else
    quantize_rows<F32Out>(x.const_data_ptr<float>(), m, k, buffer.data(), a.ld, a.scale.data());
  a.data = buffer.data();
  return a;
}

// One more K segment of a call: the activations of the input channels that get their own per-token scale
// (outlier channels) and the weights of those channels, packed alone.
struct Segment {
  const Activations* a;
  const int8_t* packed;
  int64_t kb;
};

// c [32][32] int32 for 32-token chunk mc of pair (first, second) over one segment.
inline void segment_block(const Activations& a, const int8_t* packed, int64_t kb, int64_t first, int64_t second,
                          int64_t mc, bool two_m, int32_t* acc) {
  const int8_t* b0 = packed + first * kb * kTileBytes;
  const int8_t* b1 = second >= 0 ? packed + second * kb * kTileBytes : b0;
  const int8_t* x = a.data + mc * a.ld;
  if (two_m && second >= 0) tile_block<true, true>(x, a.ld, b0, b1, kb, acc);
  else if (two_m) tile_block<true, false>(x, a.ld, b0, b1, kb, acc);
  else if (second >= 0) tile_block<false, true>(x, a.ld, b0, b1, kb, acc);
  else tile_block<false, false>(x, a.ld, b0, b1, kb, acc);
}

// The GEMM over weight-block pairs: pair p multiplies blocks first(p) and second(p) (second < 0: one block) for
// every 32-token chunk and hands the [32][32] int32 accumulators to epilogue(p, token0, rows, acc, acc2); acc2
// holds the outlier segment's (nullptr without one).
template <typename Pairs, typename Epilogue>
void run_pairs(const Activations& a, int64_t m, const int8_t* packed, int64_t kb, const Segment* outliers,
               int64_t pairs, Pairs pair_blocks, Epilogue epilogue) {
  const int64_t ld = a.ld + (outliers != nullptr ? outliers->a->ld : 0);
  const int64_t grain = std::max<int64_t>(1, kMacsPerTask / std::max<int64_t>(1, a.rows_padded * 32 * ld));
  at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) int32_t acc[32 * 32];
    alignas(64) int32_t acc2[32 * 32];
    for (int64_t m0 = 0; m0 < a.rows_padded; m0 += kRowBlock) {
      const int64_t m1 = std::min(a.rows_padded, m0 + kRowBlock);
      for (int64_t p = begin; p < end; ++p) {
        const auto [first, second] = pair_blocks(p);
        for (int64_t mc = m0; mc < m1; mc += 32) {
          const bool two_m = mc + 16 < m1;
          segment_block(a, packed, kb, first, second, mc, two_m, acc);
          if (outliers != nullptr)
            segment_block(*outliers->a, outliers->packed, outliers->kb, first, second, mc, two_m, acc2);
          epilogue(p, mc, std::min<int64_t>(32, m - mc), acc, outliers != nullptr ? acc2 : nullptr);
        }
      }
    }
    _tile_release();
  });
}

void check_packed(const at::Tensor& packed, const at::Tensor& x, const char* op) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 64 &&
                  packed.is_contiguous(),
              op, ": packed must come from pack_weight (int8 [NB, KB, 16, 64])");
  TORCH_CHECK(packed.size(1) == (x.size(1) + 63) / 64, op, ": packed holds ", packed.size(1) * 64,
              " padded input features, x has ", x.size(1));
}

const float* float_vector(const c10::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n && t->is_contiguous(), what,
              " must be contiguous float32 with ", n, " elements");
  return t->const_data_ptr<float>();
}

template <typename Out>
void linear_epilogue(const Activations& a, int64_t m, const int8_t* packed, int64_t kb, const Segment* outliers,
                     int64_t n, const float* ws, const float* bias, const typename Out::raw_t* residual,
                     typename Out::raw_t* y) {
  const int64_t nb = (n + 15) / 16;
  run_pairs(a, m, packed, kb, outliers, (nb + 1) / 2,
            [nb](int64_t p) { return std::pair<int64_t, int64_t>{2 * p, 2 * p + 1 < nb ? 2 * p + 1 : -1}; },
            [&](int64_t p, int64_t mc, int64_t rows, const int32_t* acc, const int32_t* acc2) {
              const int64_t n0 = 32 * p;
              for (int64_t r = 0; r < rows; ++r) {
                const __m512 xs = _mm512_set1_ps(a.scale[mc + r]);
                const __m512 xs2 = _mm512_set1_ps(acc2 != nullptr ? outliers->a->scale[mc + r] : 0.0f);
                for (int64_t j = 0; j < 32 && n0 + j < n; j += 16) {
                  const __mmask16 mask = tail_mask(n - n0 - j);
                  const int64_t at = (mc + r) * n + n0 + j;
                  __m512 v = dequantize2(acc + r * 32 + j, acc2 != nullptr ? acc2 + r * 32 + j : nullptr, ws + n0 + j,
                                         bias ? bias + n0 + j : nullptr, xs, xs2, mask);
                  if (residual != nullptr) v = _mm512_add_ps(v, Out::load(residual + at, mask));
                  Out::store(y + at, v, mask);
                }
              }
            });
}

template <typename Out>
void silu_mul_epilogue(const Activations& a, int64_t m, const int8_t* packed, int64_t kb, const Segment* outliers,
                       int64_t half, const float* ws, const float* bias, typename Out::raw_t* y) {
  const int64_t nbh = (half + 15) / 16;  // blocks per half: gate blocks [0, nbh), up blocks [nbh, 2 nbh)
  run_pairs(a, m, packed, kb, outliers, nbh, [nbh](int64_t p) { return std::pair<int64_t, int64_t>{p, nbh + p}; },
            [&](int64_t p, int64_t mc, int64_t rows, const int32_t* acc, const int32_t* acc2) {
              const int64_t n0 = 16 * p;
              const __mmask16 mask = tail_mask(half - n0);
              for (int64_t r = 0; r < rows; ++r) {
                const __m512 xs = _mm512_set1_ps(a.scale[mc + r]);
                const __m512 xs2 = _mm512_set1_ps(acc2 != nullptr ? outliers->a->scale[mc + r] : 0.0f);
                const int32_t* g2 = acc2 != nullptr ? acc2 + r * 32 : nullptr;
                const __m512 g = dequantize2(acc + r * 32, g2, ws + n0, bias ? bias + n0 : nullptr, xs, xs2, mask);
                const __m512 u = dequantize2(acc + r * 32 + 16, g2 != nullptr ? g2 + 16 : nullptr, ws + half + n0,
                                             bias ? bias + half + n0 : nullptr, xs, xs2, mask);
                Out::store(y + (mc + r) * half + n0, _mm512_mul_ps(lmforge_vec::silu(g), u), mask);
              }
            });
}

thread_local std::vector<int8_t> tls_activations;
thread_local std::vector<int8_t> tls_outlier_activations;

// The outlier segment of a call (x2 [M, K2] with its own per-token scales, packed2 its weights packed alone), or
// nothing when x2 is not given.
struct OutlierInput {
  at::Tensor x;
  Activations a;
  Segment segment;
  bool present = false;
};

void outlier_input(const c10::optional<at::Tensor>& x2, const c10::optional<at::Tensor>& packed2, const at::Tensor& x,
                   int64_t nb, const char* op, OutlierInput& out) {
  const bool has_x = x2.has_value() && x2->defined(), has_packed = packed2.has_value() && packed2->defined();
  TORCH_CHECK(has_x == has_packed, op, ": x_outlier and packed_outlier go together");
  if (!has_x) return;
  TORCH_CHECK(x2->scalar_type() == x.scalar_type() && x2->dim() == 2 && x2->size(0) == x.size(0), op,
              ": x_outlier must be [M, K2] in x's dtype with M = ", x.size(0));
  check_packed(*packed2, *x2, op);
  TORCH_CHECK(packed2->size(0) == nb, op, ": packed_outlier has ", packed2->size(0), " blocks of 16 channels, packed has ",
              nb);
  out.x = x2->contiguous();
  out.a = quantize_activations(out.x, packed2->size(1), tls_outlier_activations);
  out.segment = Segment{&out.a, packed2->const_data_ptr<int8_t>(), packed2->size(1)};
  out.present = true;
}

at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2, "pack_weight: w must be int8 [N, K]");
  const at::Tensor wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), nb = (n + 15) / 16, kb = (k + 63) / 64;
  at::Tensor out = at::zeros({nb, kb, 16, 64}, wc.options());
  const int8_t* src = wc.const_data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t j = 0; j < 16 && 16 * b + j < n; ++j) {
        const int8_t* row = src + (16 * b + j) * k;
        for (int64_t c = 0; c < k; ++c)
          dst[((b * kb + c / 64) * 16 + (c % 64) / 4) * 64 + 4 * j + c % 4] = row[c];
      }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x) {
  check_input(x, "quantize_per_token");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  const Activations a = quantize_activations(xc, (k + 63) / 64, tls_activations);
  at::Tensor q = at::empty({m, k}, xc.options().dtype(at::kChar));
  for (int64_t i = 0; i < m; ++i) std::memcpy(q.data_ptr<int8_t>() + i * k, a.data + i * a.ld, k);
  at::Tensor scale = at::from_blob(const_cast<float*>(a.scale.data()), {m, 1}, at::kFloat).clone();
  return {q, scale};
}

// The A side of a linear: x quantized per token and its outlier segment (``seg`` null without one). Filled in
// place: ``seg`` points into ``outliers``.
struct LinearInput {
  OutlierInput outliers;
  const Segment* seg = nullptr;
  Activations a{};
};

void linear_input(const at::Tensor& xc, const at::Tensor& packed, const c10::optional<at::Tensor>& x_outlier,
                  const c10::optional<at::Tensor>& packed_outlier, const char* op, LinearInput& in) {
  outlier_input(x_outlier, packed_outlier, xc, packed.size(0), op, in.outliers);
  in.seg = in.outliers.present ? &in.outliers.segment : nullptr;
  in.a = quantize_activations(xc, packed.size(1), tls_activations);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                  const c10::optional<at::Tensor>& bias, int64_t n, const c10::optional<at::Tensor>& residual,
                  const c10::optional<at::Tensor>& x_outlier, const c10::optional<at::Tensor>& packed_outlier) {
  check_input(x, "linear");
  check_packed(packed, x, "linear");
  TORCH_CHECK(n > 0 && (n + 15) / 16 == packed.size(0), "linear: N = ", n, " does not match packed's ",
              packed.size(0), " blocks of 16 channels");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), kb = packed.size(1);
  const float* ws = float_vector(w_scale, n, "linear: w_scale");
  const float* bp = float_vector(bias, n, "linear: bias");
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->dim() == 2 && residual->size(0) == m &&
                    residual->size(1) == n,
                "linear: residual must be [M, N] = [", m, ", ", n, "] in x's dtype");
    res = residual->contiguous();
  }
  at::Tensor y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
  LinearInput in;
  linear_input(xc, packed, x_outlier, packed_outlier, "linear", in);
  const int8_t* pp = packed.const_data_ptr<int8_t>();
  if (xc.scalar_type() == at::kBFloat16)
    linear_epilogue<BF16Out>(in.a, m, pp, kb, in.seg, n, ws, bp,
                             res.defined() ? static_cast<const uint16_t*>(res.const_data_ptr()) : nullptr,
                             static_cast<uint16_t*>(y.data_ptr()));
  else
    linear_epilogue<F32Out>(in.a, m, pp, kb, in.seg, n, ws, bp,
                            res.defined() ? res.const_data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                           const c10::optional<at::Tensor>& bias, int64_t half,
                           const c10::optional<at::Tensor>& x_outlier, const c10::optional<at::Tensor>& packed_outlier) {
  check_input(x, "linear_silu_mul");
  check_packed(packed, x, "linear_silu_mul");
  TORCH_CHECK(half > 0 && packed.size(0) == 2 * ((half + 15) / 16), "linear_silu_mul: packed must hold the gate and ",
              "up halves of ", half, " channels, each packed alone");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), kb = packed.size(1);
  const float* ws = float_vector(w_scale, 2 * half, "linear_silu_mul: w_scale");
  const float* bp = float_vector(bias, 2 * half, "linear_silu_mul: bias");
  at::Tensor y = at::empty({m, half}, xc.options());
  if (m == 0) return y;
  LinearInput in;
  linear_input(xc, packed, x_outlier, packed_outlier, "linear_silu_mul", in);
  const int8_t* pp = packed.const_data_ptr<int8_t>();
  if (xc.scalar_type() == at::kBFloat16)
    silu_mul_epilogue<BF16Out>(in.a, m, pp, kb, in.seg, half, ws, bp, static_cast<uint16_t*>(y.data_ptr()));
  else
    silu_mul_epilogue<F32Out>(in.a, m, pp, kb, in.seg, half, ws, bp, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY(lmforge_int8_amx, m) {
  m.def("usable() -> bool", &usable);
  m.def("pack_weight(Tensor w) -> Tensor", &pack_weight);
  m.def("quantize_per_token(Tensor x) -> (Tensor, Tensor)", &quantize_per_token);
  m.def("linear(Tensor x, Tensor packed, Tensor w_scale, Tensor? bias, int n, Tensor? residual, "
        "Tensor? x_outlier=None, Tensor? packed_outlier=None) -> Tensor",
        &linear);
  m.def("linear_silu_mul(Tensor x, Tensor packed, Tensor w_scale, Tensor? bias, int half, "
        "Tensor? x_outlier=None, Tensor? packed_outlier=None) -> Tensor",
        &linear_silu_mul);
}
