// 16 float32 lanes (AVX-512) or 8 (AVX2 with FMA and F16C) loaded from float32, bf16 or FP8
// memory and stored to float32 or bf16 memory, and their exp, for the kernels' elementwise loops.
// A bf16 is the top half of a float32: widening is exact, and narrowing rounds to nearest even,
// as PyTorch's conversion does. The 8-lane helpers exist wherever AVX2 does (AVX-512 CPUs too),
// so that a kernel without an AVX-512 path for some feature can take the AVX2 one.
#pragma once
#include <ATen/ATen.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
// FP8 e4m3fn (sign, 4 exponent bits biased by 7, 3 mantissa bits; no inf, 0x7f is NaN) is moved
// into float16's fields (sign to bit 15, the rest to bits 13..7), which reads it with a bias of 15
// instead of 7, subnormals included; float16 -> float32, times 2^8, is then exact. 0x7f/0xff
// become float16 NaNs.
inline __m512 load16(const at::Float8_e4m3fn* p) {
  const __m256i bytes =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // (byte << 8) >> 1, arithmetic: the sign lands in bits 15 and 14; bit 14 is cleared.
  __m256i halves = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 1),
                                    _mm256_set1_epi16(static_cast<short>(0xbfff)));
  const __m256i magnitude = _mm256_and_si256(bytes, _mm256_set1_epi16(0x7f));
  const __m256i is_nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f));
  halves = _mm256_or_si256(halves, _mm256_and_si256(is_nan, _mm256_set1_epi16(0x7e00)));
  return _mm512_mul_ps(_mm512_cvtph_ps(halves), _mm512_set1_ps(256.f));
}
// FP8 e5m2 is the top byte of a float16: widened to 16 bits, then float16 -> float32.
inline __m512 load16(const at::Float8_e5m2* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}
#endif

#ifdef __AVX512BW__
// acc's 16 int32 lanes plus the products of a's and b's int16 pairs, each lane adding its pair's
// two products: one instruction with AVX512-VNNI (vpdpwssd), else AVX512-BW's vpmaddwd and an
// add.
inline __m512i add_pair_products(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#endif

#ifdef __AVX512BF16__
// v rounded to bf16 in the low half of each 32-bit lane, as bf16_lanes (below) does 8: PyTorch's
// rounding, for every value (AVX512-BF16's conversion instruction flushes subnormals to zero).
inline __m512i bf16_lanes16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lowest_kept, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7fc0));
}
// v as 16 bf16 rounded as PyTorch rounds them: AVX512-BF16's conversion (to nearest, ties to
// even, as PyTorch) wherever no lane is a NaN or a subnormal, which the instruction quiets its
// own way or flushes to zero; bf16_lanes16 where one is.
inline __m256i bf16_halves16(__m512 v) {
  constexpr int NAN_OR_SUBNORMAL = 0x01 | 0x20 | 0x80;  // quiet NaN, subnormal, signaling NaN
  if (_mm512_fpclass_ps_mask(v, NAN_OR_SUBNORMAL) == 0)
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_cvtepi32_epi16(bf16_lanes16(v));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_halves16(v));
}
// v rounded to T's precision, as a float32 again.
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(at::BFloat16*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_halves16(v)), 16));
}
#endif

#ifdef __AVX512F__
// exp(x) of 16 floats: x = n ln2 + r (|r| <= ln2 / 2), exp(x) = 2^n e^r with e^r by its
// Taylor series to r^7 (about an ulp, as the Sleef expf behind PyTorch's vectorized silu).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);  // p * 2^n: inf above, 0 below float's range
}
#endif

#ifdef __AVX512F__
// 2^x of 16 floats for attention's probabilities, which are then rounded to bf16: x = n + f
// (|f| <= 1/2), 2^f = e^(f ln2) by its Taylor series to degree 4 (a relative error near 4e-5,
// a fiftieth of bf16's rounding), its terms (f ln2)^k / k! written as c_k f^k (c_k = ln2^k /
// k!: no product by ln2 first), times 2^n (0 below float's range).
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.00961812911f);  // ln2^4 / 24
  for (const float c : {0.0555041087f, 0.240226507f, 0.693147181f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
// FP8 e4m3fn as in load16: its fields moved into float16's (bias 15 instead of 7), float16 ->
// float32 (F16C), times 2^8; exact, subnormals included. 0x7f/0xff become float16 NaNs.
inline __m256 load8(const at::Float8_e4m3fn* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  // (byte << 8) >> 1, arithmetic: the sign lands in bits 15 and 14; bit 14 is cleared.
  __m128i halves = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(bytes, 8), 1),
                                 _mm_set1_epi16(static_cast<short>(0xbfff)));
  const __m128i magnitude = _mm_and_si128(bytes, _mm_set1_epi16(0x7f));
  const __m128i is_nan = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f));
  halves = _mm_or_si128(halves, _mm_and_si128(is_nan, _mm_set1_epi16(0x7e00)));
  return _mm256_mul_ps(_mm256_cvtph_ps(halves), _mm256_set1_ps(256.f));
}
// FP8 e5m2 is the top byte of a float16: widened to 16 bits, then float16 -> float32.
inline __m256 load8(const at::Float8_e5m2* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
}

// v rounded to bf16, each in the low half of its 32-bit lane: round to nearest even by adding
// 0x7fff plus the lowest kept bit, then dropping the low 16 bits; a NaN becomes 0x7fc0, as in
// PyTorch's scalar conversion (c10::BFloat16). An infinity stays one, a float beyond bf16's
// largest finite value rounds to infinity, as it should.
inline __m256i bf16_lanes(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lowest_kept = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lowest_kept, _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i lanes = bf16_lanes(v);  // packs work per 128-bit half: the halves, packed
  const __m128i halves =
      _mm_packus_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), halves);
}
// v rounded to T's precision, as a float32 again.
inline __m256 round_to(float*, __m256 v) { return v; }
inline __m256 round_to(at::BFloat16*, __m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_lanes(v), 16));
}

// The sum of v's 8 lanes: the two 128-bit halves added, then pairs within.
inline float add_lanes8(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

// exp(x) of 8 floats, as exp16: x = n ln2 + r, e^r by its Taylor series to r^7, times 2^n.
// AVX2 has no scalef, so 2^n is built in the exponent field in two halves, 2^(n/2) 2^(n - n/2),
// each a normal float for every n the clamp allows (-150..128): the product then rounds once,
// to infinity above float's range and through the subnormals to 0 below, as scalef does.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(89.f)), _mm256_set1_ps(-104.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i first = _mm256_srai_epi32(whole, 1), second = _mm256_sub_epi32(whole, first);
  const auto power = [](__m256i e) {  // 2^e for a normal float's exponent e
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, power(first)), power(second));
}
#endif
