// int8 weight-only products for decode steps on CPU: see nanoserve/engine/quantization/int8.py.
//
//   out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]        (float32 sums)
//
// Each weight row is read once, front to back, widened to float32 in AVX-512 registers and
// multiplied by every token's activations (kept in float32 in L1); rows are split across
// torch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

// How far ahead of the product the weights are fetched: with the hardware prefetcher alone a
// core streams a weight matrix at about half the rate it does with this.
constexpr int64_t AHEAD = 4096;  // bytes (= int8 weights)

// sums[m] = dot(x[m], w) for M activation rows and one weight row of length K. The row is
// read front to back (rows one after another: one sequential stream for the prefetcher); each
// 16 weights are widened to float32 once and used for all M rows, and U accumulators per row
// (interleaved along k) hide the FMA latency.
template <int M>
static void row_dot(const float* x, const int8_t* w, int64_t K, float* sums) {
  constexpr int U = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  int64_t k = 0;
#ifdef __AVX512F__
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  for (; k + 16 * U <= K; k += 16 * U) {
    // Ask for the cache line AHEAD bytes on (a prefetch never faults past the end).
    if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k + AHEAD), _MM_HINT_T0);
    for (int u = 0; u < U; ++u) {
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16 * u));
      const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      for (int m = 0; m < M; ++m)
        acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16 * u), wf, acc[m][u]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 total = acc[m][0];
    for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[m][u]);
    sums[m] = _mm512_reduce_add_ps(total);
  }
#else
  for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
  for (; k < K; ++k)  // the tail (all of it without AVX-512)
    for (int m = 0; m < M; ++m) sums[m] += x[m * K + k] * static_cast<float>(w[k]);
}

// out [M, N] float32 = (x [M, K] @ w [N, K].T) * scales [N], rows of w split across threads.
template <int M>
static void gemv(const float* x, const int8_t* w, const float* scales, int64_t N, int64_t K,
                 float* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float sums[M];
    for (int64_t n = begin; n < end; ++n) {
      row_dot<M>(x, w + n * K, K, sums);
      for (int m = 0; m < M; ++m) out[m * N + n] = sums[m] * scales[n];
    }
  });
}

// x [M, K] (M <= 8), weight [N, K] int8, scales [N] -> [M, N] in x's dtype.
at::Tensor int8_gemv(at::Tensor x, at::Tensor weight, at::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1));
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "int8_gemv takes 1 to 8 rows");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(scales.numel() == N, "one scale per output row");
  auto xf = x.to(at::kFloat).contiguous();
  auto sf = scales.to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (M) {
    case 1: gemv<1>(xp, wp, sp, N, K, op); break;
    case 2: gemv<2>(xp, wp, sp, N, K, op); break;
    case 3: gemv<3>(xp, wp, sp, N, K, op); break;
    case 4: gemv<4>(xp, wp, sp, N, K, op); break;
    case 5: gemv<5>(xp, wp, sp, N, K, op); break;
    case 6: gemv<6>(xp, wp, sp, N, K, op); break;
    case 7: gemv<7>(xp, wp, sp, N, K, op); break;
    default: gemv<8>(xp, wp, sp, N, K, op); break;
  }
  return out.to(x.scalar_type());
}
