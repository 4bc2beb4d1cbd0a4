// 16 float32 lanes loaded from and stored to float32 or bf16 memory (AVX-512), for the
// kernels' elementwise loops. A bf16 is the top half of a float32: widening is exact, and
// narrowing rounds to nearest even, as PyTorch's conversion does.
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
