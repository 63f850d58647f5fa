// Helpers shared by every CPU kernel source: float32 bit casts, bf16 <-> float32 conversion (round to nearest
// even, as torch does) and, with AVX-512F, e^x for x <= 0 and SiLU in float32 vectors. NativeKernels hashes the
// headers of csrc/ into each build's key, so a change here rebuilds every kernel.
#pragma once

#include <cstdint>
#include <cstring>

namespace lmforge_bf16 {

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

inline float bf16_to_float(uint16_t r) { return bits_to_float(static_cast<uint32_t>(r) << 16); }

inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7fc0u;
  const uint32_t u = float_to_bits(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}

}  // namespace lmforge_bf16

#if defined(__AVX512F__)
#include <immintrin.h>

namespace lmforge_vec {

// e^x for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7),
// 2^n by VSCALEFPS; below -87 the result is ~1e-38.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) = g / (1 + e^-g) = g * (g >= 0 ? 1 : t) / (1 + t) with t = e^-|g| <= 1 (no overflow); the reciprocal
// of 1 + t in [1, 2] by VRCP14PS and one Newton step (~1e-7 relative error).
inline __m512 silu(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 d = _mm512_add_ps(one, t);
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
  const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, t);
  return _mm512_mul_ps(num, inv);
}

}  // namespace lmforge_vec

#endif

#if defined(__AVX2__)
#include <immintrin.h>

namespace lmforge_vec {

// The sum of the 8 floats of v: halves, then pairs, then the last two (one fixed order).
inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// The sum of the 8 int32 of v.
inline int32_t hsum8_epi32(__m256i v) {
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i f = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(f, _mm_shuffle_epi32(f, 0xB1)));
}

#if defined(__FMA__)
// e^x for x <= 0 on 8 floats: the AVX-512 version's reduction and polynomial, 2^n built in the exponent bits
// (n >= -126 after the clamp at -87).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu(g) = g / (1 + e^-g) on 8 floats, as the AVX-512 version: t = e^-|g|, the reciprocal of 1 + t by VRCPPS and
// two Newton steps.
inline __m256 silu8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  const __m256 abs_g = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
  const __m256 t = exp_nonpositive8(_mm256_sub_ps(_mm256_setzero_ps(), abs_g));
  const __m256 d = _mm256_add_ps(one, t);
  __m256 inv = _mm256_rcp_ps(d);
  inv = _mm256_mul_ps(inv, _mm256_fnmadd_ps(d, inv, two));
  inv = _mm256_mul_ps(inv, _mm256_fnmadd_ps(d, inv, two));
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, t), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_mul_ps(num, inv);
}
#endif

}  // namespace lmforge_vec

#endif
