// 16 float32 lanes loaded from float32, bf16 or FP8 memory and stored to float32 or bf16 memory
// (AVX-512), and their exp, for the kernels' elementwise loops. A bf16 is the top half of a
// float32: widening is exact, and narrowing rounds to nearest even, as PyTorch's conversion does.
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

#ifdef __AVX512BF16__
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
// v rounded to T's precision, as a float32 again.
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(at::BFloat16*, __m512 v) {
  const __m256i halves = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
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
