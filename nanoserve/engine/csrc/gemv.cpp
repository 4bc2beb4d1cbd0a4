// Weight-streaming products for decode steps on CPU: a few tokens times a weight matrix.
//
//   int8_gemv:  out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]     (int8 w, float32 sums)
//   bf16_gemv:  out[m, n] =             sum_k x[m, k] * w[n, k]     (bf16 w, float32 sums)
//
// A decode step reads every weight once and does little arithmetic with it, so its speed is
// the rate at which weights stream from memory. Each weight row is read once, front to back
// (rows one after another: one sequential stream for the hardware prefetcher, helped by an
// explicit prefetch ahead), and multiplied by every token's activations, which stay in L1.
// Rows are split across torch's intra-op threads. Callers: quantization/int8.py (int8),
// cpu_linear.py (bf16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <ATen/Dispatch.h>

#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

// How far ahead of the product the weights are fetched: with the hardware prefetcher alone a
// core streams a weight matrix at about half the rate it does with this.
constexpr int64_t AHEAD = 4096;  // bytes

// Accumulators per token row, interleaved along k, to hide the FMA latency: fewer rows, more.
template <int M>
constexpr int UNROLL = M <= 2 ? 4 : M <= 4 ? 2 : 1;

#ifdef __AVX512F__
// sums[m] = the sum of every lane of acc[m][0..U): one row's U interleaved accumulators.
template <int M, int U>
static void add_lanes(const __m512 (&acc)[M][U], float* sums) {
  for (int m = 0; m < M; ++m) {
    __m512 total = acc[m][0];
    for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[m][u]);
    sums[m] = _mm512_reduce_add_ps(total);
  }
}
#endif

// sums[m] = dot(x[m], w) for M float32 activation rows and one int8 weight row of length K;
// each 16 weights are widened to float32 once and used for all M rows.
template <int M>
static void int8_row_dot(const float* x, const int8_t* w, int64_t K, float* sums) {
  constexpr int U = UNROLL<M>;
  int64_t k = 0;
#ifdef __AVX512F__
  __m512 acc[M][U] = {};  // zeros
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
  add_lanes<M, U>(acc, sums);
#else
  for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
  for (; k < K; ++k)  // the tail (all of it without AVX-512)
    for (int m = 0; m < M; ++m) sums[m] += x[m * K + k] * static_cast<float>(w[k]);
}

// sums[m] = dot(x[m], w) for M bf16 activation rows and one bf16 weight row of length K.
// AVX512-BF16's dot instruction multiplies 32 pairs (exact in float32) into 16 float32 sums.
template <int M>
static void bf16_row_dot(const at::BFloat16* x, const at::BFloat16* w, int64_t K, float* sums) {
  int64_t k = 0;
#ifdef __AVX512BF16__
  constexpr int U = UNROLL<M>;
  const char* bytes = reinterpret_cast<const char*>(w);
  __m512 acc[M][U] = {};  // zeros
  for (; k + 32 * U <= K; k += 32 * U) {
    for (int u = 0; u < U; ++u) {  // each u reads one 64-byte line (32 weights)
      _mm_prefetch(bytes + 2 * (k + 32 * u) + AHEAD, _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u);
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], xv, wv);
      }
    }
  }
  add_lanes<M, U>(acc, sums);
#else
  for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
  for (; k < K; ++k)  // the tail (all of it without AVX512-BF16)
    for (int m = 0; m < M; ++m)
      sums[m] += static_cast<float>(x[m * K + k]) * static_cast<float>(w[k]);
}

// out [M, N]: out[m, n] = sums[m] of row_dot(n, sums), rounded once to Out; rows n split
// across threads.
template <int M, typename Out, typename RowDot>
static void gemv(int64_t N, Out* out, const RowDot& row_dot) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float sums[M];
    for (int64_t n = begin; n < end; ++n) {
      row_dot(n, sums);
      for (int m = 0; m < M; ++m) out[m * N + n] = static_cast<Out>(sums[m]);
    }
  });
}

// A tensor's values as float32 (activations and scales are small next to the weights).
template <typename T>
static void append_floats(const at::Tensor& t, std::vector<float>& values) {
  const T* p = t.data_ptr<T>();
  for (int64_t i = 0; i < t.numel(); ++i) values.push_back(static_cast<float>(p[i]));
}

static std::vector<float> as_floats(const at::Tensor& tensor) {
  const at::Tensor t = tensor.contiguous();
  std::vector<float> values;
  values.reserve(t.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "as_floats",
                                  [&] { append_floats<scalar_t>(t, values); });
  return values;
}

// Calls body(std::integral_constant<int, M>) for M in 1..8, so each row count gets its own
// fully unrolled code.
template <typename Body>
static void with_rows(int64_t M, const Body& body) {
  TORCH_CHECK(M >= 1 && M <= 8, "the decode GEMVs take 1 to 8 rows, got ", M);
  switch (M) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, 2>{}); break;
    case 3: body(std::integral_constant<int, 3>{}); break;
    case 4: body(std::integral_constant<int, 4>{}); break;
    case 5: body(std::integral_constant<int, 5>{}); break;
    case 6: body(std::integral_constant<int, 6>{}); break;
    case 7: body(std::integral_constant<int, 7>{}); break;
    default: body(std::integral_constant<int, 8>{}); break;
  }
}

// x [M, K] (M <= 8), weight [N, K] int8, scales [N] -> [M, N] in x's dtype.
at::Tensor int8_gemv(at::Tensor x, at::Tensor weight, at::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1));
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(scales.numel() == N, "one scale per output row");
  const std::vector<float> xf = as_floats(x), sf = as_floats(scales);
  auto out = at::empty({M, N}, x.options());
  const int8_t* wp = weight.data_ptr<int8_t>();
  with_rows(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    const auto row_dot = [&](int64_t n, float* sums) {
      int8_row_dot<R>(xf.data(), wp + n * K, K, sums);
      for (int m = 0; m < R; ++m) sums[m] *= sf[n];
    };
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "int8_gemv",
                                    [&] { gemv<R>(N, out.data_ptr<scalar_t>(), row_dot); });
  });
  return out;
}

// True when bf16_gemv runs on AVX512-BF16 instructions (otherwise a plain loop: slow).
bool bf16_gemv_is_vectorized() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 (M <= 8), weight [N, K] bf16 -> [M, N] bf16 (float32 sums, rounded once).
at::Tensor bf16_gemv(at::Tensor x, at::Tensor weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16);
  TORCH_CHECK(weight.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  with_rows(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    gemv<R>(N, out.data_ptr<at::BFloat16>(),
            [&](int64_t n, float* sums) { bf16_row_dot<R>(xp, wp + n * K, K, sums); });
  });
  return out;
}
