// Weight-streaming products for decode steps on CPU: a few tokens times a weight matrix.
//
//   int8_gemv:  out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]  (int8 w, int16 x, int32 sums)
//   bf16_gemv:  out[m, n] =             sum_k x[m, k] * w[n, k]  (bf16 w, float32 sums)
//
// A decode step reads every weight once and does little arithmetic with it, so its speed is
// the rate at which weights stream from memory. Each weight row is read once, front to back
// (rows one after another: one sequential stream for the hardware prefetcher, helped where it
// pays by an explicit prefetch ahead), and multiplied by every token's activations, which stay
// in L1. Rows are split across torch's intra-op threads. Callers: quantization/int8.py (int8),
// cpu_linear.py (bf16). Where the CPU has AMX, bf16_gemv hands whole tiles to amx_gemv.cpp,
// whose one tile product serves up to 16 tokens (AVX-512's dot products cost one per token).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <ATen/Dispatch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "simd.h"

// How far ahead of the product the weights are fetched, in bytes (0: the hardware prefetcher
// alone). The best distance depends on the CPU: on an Intel Xeon an explicit prefetch 4 KiB
// ahead doubled the rate at which a core streamed a weight matrix; on an AMD EPYC it slowed
// the int8 GEMV by a fifth. cpu_kernels times the candidates when it loads the kernels.
static std::atomic<int64_t> prefetch_bytes{4096};

void set_gemv_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "a prefetch distance is a number of bytes ahead, got ", bytes);
  prefetch_bytes.store(bytes);
}

int64_t gemv_prefetch() { return prefetch_bytes.load(); }

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

// int8 products sum in int32, exactly: activations come as int16 (int16_rows, below), and one
// instruction (add_pair_products, simd.h) multiplies 32 int16 pairs and adds them in pairs into
// 16 int32 lanes; each 32 weights are widened int8 -> int16 once for all M rows. AVX2's
// vpmaddwd does it for 16 pairs.

// A lane gains at most 2 * 32767 * 127 per instruction: 256 instructions (8192 k) stay inside
// int32, so longer rows sum in chunks of this many, each chunk's lanes then added as float32.
constexpr int64_t INT32_SAFE_K = 8192;
// AVX2's lanes are half as many: 256 of its instructions cover 4096 k.
constexpr int64_t INT32_SAFE_K_AVX2 = INT32_SAFE_K / 2;

// int8 weights come in row pairs, [N/2, K/32, 2, 32]: 32 weights of row 2p, then the same 32
// of row 2p + 1 (quantization/int8.py's pair_rows). One sequential stream then feeds two rows
// at once: streamed from memory, that ran 10-30% faster than one row after another.
constexpr int64_t PAIR_CHUNK = 32;

#if !defined(__AVX512BW__) && defined(__AVX2__)
// int8_pair_dot's AVX2 path: sums[r][m] += dot(x[m], row r of the pair).
template <int M>
[[gnu::always_inline]] inline static void int8_pair_dot_avx2(const int16_t* x, const int8_t* pair,
                                                            int64_t K, int64_t ahead,
                                                            float (&sums)[2][M]) {
  // Adds the products of the 32-weight chunk at k (both rows) into acc: per row, two vpmaddwd of
  // 16 pairs each (the chunk's halves, widened int8 -> int16 as they are loaded), whose sums
  // go to one accumulator, so a lane gains two instructions' worth per chunk.
  const auto add_chunk = [&](__m256i (&acc)[2][M], int64_t k) {
    const int8_t* both = pair + 2 * k;  // 32 weights of each row: one 64-byte line
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(both + ahead), _MM_HINT_T0);
    for (int r = 0; r < 2; ++r) {
      const __m128i* bytes = reinterpret_cast<const __m128i*>(both + r * PAIR_CHUNK);
      const __m256i low = _mm256_cvtepi8_epi16(_mm_loadu_si128(bytes));
      const __m256i high = _mm256_cvtepi8_epi16(_mm_loadu_si128(bytes + 1));
      for (int m = 0; m < M; ++m) {
        const __m256i* xs = reinterpret_cast<const __m256i*>(x + m * K + k);
        const __m256i from_low = _mm256_madd_epi16(_mm256_loadu_si256(xs), low);
        const __m256i from_high = _mm256_madd_epi16(_mm256_loadu_si256(xs + 1), high);
        acc[r][m] = _mm256_add_epi32(acc[r][m], _mm256_add_epi32(from_low, from_high));
      }
    }
  };
  for (int64_t chunk = 0; chunk < K; chunk += INT32_SAFE_K_AVX2) {
    const int64_t chunk_end = std::min(K, chunk + INT32_SAFE_K_AVX2);
    __m256i acc[2][M] = {};  // zeros
    for (int64_t k = chunk; k < chunk_end; k += PAIR_CHUNK) add_chunk(acc, k);
    for (int r = 0; r < 2; ++r)
      for (int m = 0; m < M; ++m) sums[r][m] += add_lanes8(_mm256_cvtepi32_ps(acc[r][m]));
  }
}
#endif

// sums[r][m] = dot(x[m], row r of the pair) for M int16 activation rows; K % 32 == 0.
// (Inlined into the pair loop: a tenth faster from cache; bf16_row_dot was slower inlined.)
template <int M>
[[gnu::always_inline]] inline static void int8_pair_dot(const int16_t* x, const int8_t* pair,
                                                       int64_t K, int64_t ahead,
                                                       float (&sums)[2][M]) {
  for (int r = 0; r < 2; ++r)
    for (int m = 0; m < M; ++m) sums[r][m] = 0.f;
#ifdef __AVX512BW__
  constexpr int U = M <= 2 ? 2 : 1;  // interleaved sums per row and token (FMA latency)
  // Adds the products of the 32-weight chunk at k (both rows) into acc[.][.][u].
  const auto add_chunk = [&](__m512i (&acc)[2][M][U], int64_t k, int u) {
    const int8_t* both = pair + 2 * k;  // 32 weights of each row: one 64-byte line
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(both + ahead), _MM_HINT_T0);
    for (int r = 0; r < 2; ++r) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(both) + r);
      const __m512i wv = _mm512_cvtepi8_epi16(bytes);
      for (int m = 0; m < M; ++m)
        acc[r][m][u] = add_pair_products(acc[r][m][u], _mm512_loadu_si512(x + m * K + k), wv);
    }
  };
  for (int64_t chunk = 0; chunk < K; chunk += INT32_SAFE_K) {
    const int64_t chunk_end = std::min(K, chunk + INT32_SAFE_K);
    __m512i acc[2][M][U] = {};  // zeros
    int64_t k = chunk;
    for (; k + PAIR_CHUNK * U <= chunk_end; k += PAIR_CHUNK * U)
      for (int u = 0; u < U; ++u) add_chunk(acc, k + PAIR_CHUNK * u, u);
    for (; k < chunk_end; k += PAIR_CHUNK) add_chunk(acc, k, 0);
    for (int r = 0; r < 2; ++r)
      for (int m = 0; m < M; ++m) {
        __m512 total = _mm512_setzero_ps();
        for (int u = 0; u < U; ++u) total = _mm512_add_ps(total, _mm512_cvtepi32_ps(acc[r][m][u]));
        sums[r][m] += _mm512_reduce_add_ps(total);
      }
  }
#elif defined(__AVX2__)
  int8_pair_dot_avx2<M>(x, pair, K, ahead, sums);
#else
  for (int64_t k = 0; k < K; ++k)  // without SIMD: the same products, one at a time
    for (int r = 0; r < 2; ++r)
      for (int m = 0; m < M; ++m) {
        const int8_t w = pair[(k / PAIR_CHUNK) * 2 * PAIR_CHUNK + r * PAIR_CHUNK + k % PAIR_CHUNK];
        sums[r][m] += static_cast<float>(x[m * K + k] * int32_t{w});
      }
#endif
}

// The activations as bf16_row_dot reads them: bf16 as they come where AVX512-BF16 multiplies
// bf16 pairs (and in the plain loop); float32 on AVX2, widened once per call by
// gemv_activations (M rows of K: they stay in L1 while every weight row streams past).
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
using Activation = float;
#else
using Activation = at::BFloat16;
#endif

// Where activation k of a row is stored for bf16_row_dot on AVX2: each whole 16 k as its 8 even
// values, then its 8 odd ones, the order in which a load of 16 bf16 weights comes apart into
// two float32 vectors (bf16_row_dot); the last K % 16 in order.
static int64_t activation_position(int64_t k, int64_t K) {
  const int64_t start = k - k % 16, j = k % 16;
  if (start + 16 > K) return k;
  return start + (j % 2) * 8 + j / 2;
}

// x [rows, K] bf16 as Activation values, contiguous (positions as above where they are float32).
static at::Tensor gemv_activations(const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  if constexpr (std::is_same_v<Activation, at::BFloat16>) {
    return xc;
  } else {
    const int64_t rows = xc.size(0), K = xc.size(1);
    at::Tensor widened = at::empty({rows, K}, xc.options().dtype(at::kFloat));
    const at::BFloat16* from = xc.data_ptr<at::BFloat16>();
    float* to = widened.data_ptr<float>();
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k)
        to[m * K + activation_position(k, K)] = static_cast<float>(from[m * K + k]);
    return widened;
  }
}

// sums[m] = dot(x[m], w) for M activation rows (gemv_activations) and one bf16 weight row of
// length K. AVX512-BF16's dot instruction multiplies 32 pairs (exact in float32) into 16 float32
// sums; AVX2 widens 16 weights to two float32 vectors and FMAs each with 8 activations.
template <int M>
static void bf16_row_dot(const Activation* x, const at::BFloat16* w, int64_t K, int64_t ahead,
                         float* sums) {
  int64_t k = 0;
#ifdef __AVX512BF16__
  constexpr int U = UNROLL<M>;
  const char* bytes = reinterpret_cast<const char*>(w);
  __m512 acc[M][U] = {};  // zeros
  for (; k + 32 * U <= K; k += 32 * U) {
    for (int u = 0; u < U; ++u) {  // each u reads one 64-byte line (32 weights)
      if (ahead) _mm_prefetch(bytes + 2 * (k + 32 * u) + ahead, _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u);
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], xv, wv);
      }
    }
  }
  add_lanes<M, U>(acc, sums);
#elif defined(__AVX2__) && defined(__FMA__)
  constexpr int U = UNROLL<M>;
  const char* bytes = reinterpret_cast<const char*>(w);
  __m256 acc[M][U] = {};  // zeros
  // Adds the products of the 16 weights at k into acc[.][u]. A 32-bit lane of the load holds an
  // even weight in its low half and the next (odd) one in its high half: shifted left 16 bits,
  // or with the low half cleared, each is that weight as a float32 (a bf16 is a float32's top).
  const auto add_step = [&](int64_t k, int u) {
    if (ahead) _mm_prefetch(bytes + 2 * k + ahead, _MM_HINT_T0);
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536)));
    for (int m = 0; m < M; ++m) {
      const float* xs = x + m * K + k;  // 8 even activations, then 8 odd ones
      acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(xs), even, acc[m][u]);
      acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 8), odd, acc[m][u]);
    }
  };
  for (; k + 16 * U <= K; k += 16 * U)
    for (int u = 0; u < U; ++u) add_step(k + 16 * u, u);
  for (; k + 16 <= K; k += 16) add_step(k, 0);
  for (int m = 0; m < M; ++m) {
    __m256 total = acc[m][0];
    for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[m][u]);
    sums[m] = add_lanes8(total);
  }
#else
  for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
  for (; k < K; ++k)  // the tail (all of it without SIMD)
    for (int m = 0; m < M; ++m)
      sums[m] += static_cast<float>(x[m * K + k]) * static_cast<float>(w[k]);
}

// out [M, N]: rows G i .. G i + G - 1 of out from group_dot(i, sums[G][M]), each rounded once
// to Out; groups of G rows (one bf16 row, an int8 pair) split across threads, the last one
// short where G does not divide N.
template <int M, int G, typename Out, typename GroupDot>
static void gemv(int64_t N, Out* out, const GroupDot& group_dot) {
  at::parallel_for(0, (N + G - 1) / G, 16 / G, [&](int64_t begin, int64_t end) {
    float sums[G][M];
    for (int64_t i = begin; i < end; ++i) {
      group_dot(i, sums);
      for (int r = 0; r < G && G * i + r < N; ++r)
        for (int m = 0; m < M; ++m) out[m * N + G * i + r] = static_cast<Out>(sums[r][m]);
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

// Activation rows as int16 values times a power of two per row: row m = values[m, :] *
// scales[m]. The power of two is the smallest that fits the row's largest magnitude in int16,
// so every activation within 2^7 of the row's largest is exact (bf16 has 8 significant bits)
// and smaller ones are off by at most half of it (2^-15 of the largest).
struct Int16Rows {
  at::Tensor values;          // [M, K] int16, in torch's 64-byte-aligned memory
  std::vector<float> scales;  // [M]
};

// The largest |row[k]|, or NaN where the row holds a NaN or an infinity (x * 0 is NaN for those
// alone, and NaN survives a sum where a max would drop it).
static float largest_magnitude(const float* row, int64_t K) {
  float largest = 0.f, poison = 0.f;
  int64_t k = 0;
#ifdef __AVX512F__
  __m512 top = _mm512_setzero_ps(), zeros = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_loadu_ps(row + k);
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
    zeros = _mm512_add_ps(zeros, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  largest = _mm512_reduce_max_ps(top);
  poison = _mm512_reduce_add_ps(zeros);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps(), zeros = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(row + k);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));  // |v|: the sign bit cleared
    zeros = _mm256_add_ps(zeros, _mm256_mul_ps(v, _mm256_setzero_ps()));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  largest = *std::max_element(lanes, lanes + 8);
  poison = add_lanes8(zeros);
#endif
  for (; k < K; ++k) {
    largest = std::max(largest, std::fabs(row[k]));
    poison += row[k] * 0.f;
  }
  return std::isnan(poison) ? std::numeric_limits<float>::quiet_NaN() : largest;
}

// out[k] = row[k] * inverse, rounded to the nearest integer (ties to even), saturated to int16.
static void round_to_int16(const float* row, int64_t K, float inverse, int16_t* out) {
  int64_t k = 0;
#ifdef __AVX512F__
  const __m512 by = _mm512_set1_ps(inverse);
  for (; k + 16 <= K; k += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), by));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtsepi32_epi16(q));
  }
#elif defined(__AVX2__)
  const __m256 by = _mm256_set1_ps(inverse);
  for (; k + 16 <= K; k += 16) {
    const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), by));
    const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k + 8), by));
    // vpackssdw saturates to int16 but packs each 128-bit half on its own (low 0-3, high 0-3,
    // low 4-7, high 4-7, in 64-bit quarters): the quarters are then put back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), packed);
  }
#endif
  for (; k < K; ++k)
    out[k] = static_cast<int16_t>(std::clamp(std::nearbyint(row[k] * inverse), -32768.f, 32767.f));
}

static Int16Rows int16_rows(const at::Tensor& x) {
  const std::vector<float> xf = as_floats(x);
  const int64_t M = x.size(0), K = x.size(1);
  Int16Rows rows{at::empty({M, K}, at::kShort), std::vector<float>(M)};
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xf.data() + m * K;
    const float largest = largest_magnitude(row, K);
    int16_t* values = rows.values.data_ptr<int16_t>() + m * K;
    if (std::isnan(largest)) {  // NaN or inf in x: NaN products (PyTorch: inf or NaN)
      rows.scales[m] = largest;
      std::fill(values, values + K, int16_t{0});
      continue;
    }
    int exponent = 0;
    std::frexp(largest, &exponent);  // largest < 2^exponent
    rows.scales[m] = largest > 0.f ? std::ldexp(1.f, exponent - 15) : 1.f;
    round_to_int16(row, K, 1.f / rows.scales[m], values);
  }
  return rows;
}

// x [M, K] (M <= 8), weight int8 in row pairs [(N + 1) / 2, 2K] (pair_rows; K % 32 == 0) or in
// blocks [N/64, K/2, 64, 2] (int8_gemv_blocks), scales [N] -> [M, N] in x's dtype.
at::Tensor int8_gemv(at::Tensor x, at::Tensor weight, at::Tensor scales) {
  const bool in_blocks = weight.dim() == 4;
  TORCH_CHECK(x.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = scales.numel();
  if (in_blocks) {
    TORCH_CHECK(weight.size(0) * 64 == N && weight.size(1) * 2 == K && weight.size(2) == 64 &&
                    weight.size(3) == 2, "int8_gemv's blocks are [N/64, K/2, 64, 2]");
  } else {
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == 2 * K,
                "int8_gemv takes the weight in row pairs, [(N + 1) / 2, 2K] (pair_rows)");
    TORCH_CHECK(K % PAIR_CHUNK == 0, "int8_gemv takes K a multiple of 32, got ", K);
    TORCH_CHECK(weight.size(0) == (N + 1) / 2, "one scale per output row");
  }
  const Int16Rows xq = int16_rows(x);
  const int64_t ahead = prefetch_bytes.load();
  std::vector<float> converted;  // float32 scales are read in place (no copy of a 150k vocab)
  const bool float_scales = scales.scalar_type() == at::kFloat && scales.is_contiguous();
  if (!float_scales) converted = as_floats(scales);
  const float* sf = float_scales ? scales.data_ptr<float>() : converted.data();
  auto out = at::empty({M, N}, x.options());
  if (in_blocks) {
    block_int8_gemv(xq.values, xq.scales.data(), weight, sf, ahead, out);
    return out;
  }
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int16_t* xp = xq.values.data_ptr<int16_t>();
  with_rows(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    const auto pair_dot = [&](int64_t p, float (&sums)[2][R]) {
      int8_pair_dot<R>(xp, wp + p * 2 * K, K, ahead, sums);
      for (int r = 0; r < 2; ++r)
        for (int m = 0; m < R; ++m)
          sums[r][m] *= xq.scales[m] * sf[std::min(2 * p + r, N - 1)];
    };
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "int8_gemv",
                                    [&] { gemv<R, 2>(N, out.data_ptr<scalar_t>(), pair_dot); });
  });
  return out;
}

// True when bf16_gemv has a SIMD path: AVX512-BF16, or AVX2 with FMA (otherwise a plain loop:
// slow).
bool bf16_gemv_is_vectorized() {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

// The most tokens one vector GEMV pass takes (with_rows), and one bf16_gemv call (AMX's tiles
// multiply up to 80 tokens in one pass; elsewhere vector passes of 8).
constexpr int64_t VECTOR_GEMV_ROWS = 8;
constexpr int64_t MOST_GEMV_ROWS = 80;

// Up to how many tokens bf16_gemv streams a weight once: AMX's tiles take 80 where the CPU has
// them (and the weight is whole tiles), the vector GEMV 16 in two passes.
int64_t bf16_gemv_max_rows() {
  return std::max<int64_t>(2 * VECTOR_GEMV_ROWS, amx_gemv_max_rows());
}

// bf16_gemv's vector path for M <= 8 (AVX512-BF16 or AVX2, or the bf16 blocks).
static at::Tensor vector_bf16_gemv(const at::Tensor& x, const at::Tensor& weight) {
  if (weight.dim() == 4) return block_bf16_gemv(x, weight, prefetch_bytes.load());  // block_gemv
  TORCH_CHECK(weight.dim() == 2, "bf16_gemv takes a plain weight or bf16_gemv_weight's layout");
  TORCH_CHECK(x.size(1) == weight.size(1));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16);
  TORCH_CHECK(weight.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor activations = gemv_activations(x);
  const int64_t ahead = prefetch_bytes.load();
  auto out = at::empty({M, N}, x.options());
  const Activation* xp = activations.data_ptr<Activation>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  with_rows(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    gemv<R, 1>(N, out.data_ptr<at::BFloat16>(), [&](int64_t n, float (&sums)[1][R]) {
      bf16_row_dot<R>(xp, wp + n * K, K, ahead, sums[0]);
    });
  });
  return out;
}

// x [M, K] bf16 (M <= 80), weight [N, K] bf16, or as bf16_gemv_weight lays it out (AMX's tiles:
// amx_gemv.cpp; blocks of 64 rows: block_gemv.cpp) -> [M, N] bf16 (float32 sums, rounded
// once). Up to 80 tokens stream the weight once on AMX's tiles; elsewhere the vector GEMV takes
// 8 tokens a pass (past bf16_gemv_max_rows, one stream of the weight per pass: correct, not
// fast).
at::Tensor bf16_gemv(at::Tensor x, at::Tensor weight) {
  TORCH_CHECK(x.dim() == 2, "x [M, K]");
  const int64_t M = x.size(0);
  TORCH_CHECK(M >= 1 && M <= MOST_GEMV_ROWS, "the bf16 decode GEMV takes 1 to 80 rows, got ", M);
  if (amx_gemv_applies(x, weight)) return amx_bf16_gemv(x, weight, prefetch_bytes.load());
  if (M <= VECTOR_GEMV_ROWS) return vector_bf16_gemv(x, weight);
  std::vector<at::Tensor> passes;
  for (int64_t first = 0; first < M; first += VECTOR_GEMV_ROWS) {
    const int64_t rows = std::min(VECTOR_GEMV_ROWS, M - first);
    passes.push_back(vector_bf16_gemv(x.narrow(0, first, rows), weight));
  }
  return at::cat(passes);
}

// ---------------------------------------------------------------------------------------------
// Grouped products for mixture-of-experts decode steps: rows of x grouped by expert, each group
// multiplied by its own expert's weight, which is read once for the group. Only the experts
// named in expert_ids are read: a decode step streams the chosen experts' weights and no other.
//
//   x [A, K] (the (token, expert) pairs, grouped), weight [E, N, K] (every expert, stacked),
//   expert_ids [U] int64, offsets [U + 1] int64: rows offsets[u] .. offsets[u + 1] - 1 of x
//   belong to expert expert_ids[u]. -> out [A, N]
//
// The work is U groups of N output rows, split across threads as one list (a thread may finish
// one expert's rows and start the next's), so a step with few experts still uses every core.

// Calls body(u, n_begin, n_end) for the part of the flat [U * N] range [begin, end) that lies
// in each group u.
template <typename Body>
static void for_each_group_part(int64_t N, int64_t begin, int64_t end, const Body& body) {
  for (int64_t i = begin; i < end;) {
    const int64_t u = i / N, n_begin = i % N, n_end = std::min(N, n_begin + (end - i));
    body(u, n_begin, n_end);
    i += n_end - n_begin;
  }
}

static void check_groups(const at::Tensor& x, const at::Tensor& expert_ids,
                         const at::Tensor& offsets, int64_t num_experts) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x is [A, K], contiguous");
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong);
  TORCH_CHECK(expert_ids.is_contiguous() && offsets.is_contiguous());
  TORCH_CHECK(offsets.numel() == expert_ids.numel() + 1, "offsets is [U + 1]");
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[expert_ids.numel()] == x.size(0), "offsets span x's rows");
  for (int64_t u = 0; u < expert_ids.numel(); ++u) {
    TORCH_CHECK(ids[u] >= 0 && ids[u] < num_experts, "expert id out of range: ", ids[u]);
    TORCH_CHECK(off[u] <= off[u + 1], "offsets must not decrease");
  }
}

// x [A, K] bf16, weight [E, N, K] bf16 -> [A, N] bf16 (float32 sums, rounded once).
at::Tensor moe_bf16_gemv(at::Tensor x, at::Tensor weight, at::Tensor expert_ids,
                         at::Tensor offsets) {
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.size(2) == x.size(1));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16);
  check_groups(x, expert_ids, offsets, weight.size(0));
  const int64_t N = weight.size(1), K = weight.size(2), U = expert_ids.numel();
  const int64_t ahead = prefetch_bytes.load();
  auto out = at::empty({x.size(0), N}, x.options());
  const at::Tensor activations = gemv_activations(x);
  const Activation* xp = activations.data_ptr<Activation>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  at::parallel_for(0, U * N, 16, [&](int64_t begin, int64_t end) {
    for_each_group_part(N, begin, end, [&](int64_t u, int64_t n_begin, int64_t n_end) {
      const at::BFloat16* expert = wp + ids[u] * N * K;
      for (int64_t row = off[u]; row < off[u + 1]; row += 8) {  // 8 rows per weight pass
        with_rows(std::min<int64_t>(8, off[u + 1] - row), [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          float sums[R];
          for (int64_t n = n_begin; n < n_end; ++n) {
            bf16_row_dot<R>(xp + row * K, expert + n * K, K, ahead, sums);
            for (int m = 0; m < R; ++m) op[(row + m) * N + n] = static_cast<at::BFloat16>(sums[m]);
          }
        });
      }
    });
  });
  return out;
}

// x [A, K] (K % 32 == 0), weight pairs [E, (N + 1) / 2, 2K] int8 (pair_rows per expert),
// scales [E, N] float32 -> [A, N] in x's dtype.
at::Tensor moe_int8_gemv(at::Tensor x, at::Tensor weight, at::Tensor scales, at::Tensor expert_ids,
                         at::Tensor offsets) {
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.scalar_type() == at::kChar);
  TORCH_CHECK(weight.size(2) == 2 * x.size(1), "weight is in row pairs, [E, (N + 1) / 2, 2K]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous());
  const int64_t E = weight.size(0), P = weight.size(1), N = scales.size(1), K = x.size(1);
  TORCH_CHECK(scales.size(0) == E && P == (N + 1) / 2, "scales is [E, N]");
  TORCH_CHECK(K % PAIR_CHUNK == 0, "moe_int8_gemv takes K a multiple of 32, got ", K);
  check_groups(x, expert_ids, offsets, E);
  const Int16Rows xq = int16_rows(x);
  const int64_t U = expert_ids.numel(), ahead = prefetch_bytes.load();
  auto out = at::empty({x.size(0), N}, x.options());
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int16_t* xp = xq.values.data_ptr<int16_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "moe_int8", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, U * P, 8, [&](int64_t begin, int64_t end) {
      for_each_group_part(P, begin, end, [&](int64_t u, int64_t p_begin, int64_t p_end) {
        const int8_t* expert = wp + ids[u] * P * 2 * K;
        const float* expert_scales = sp + ids[u] * N;
        for (int64_t row = off[u]; row < off[u + 1]; row += 8) {
          with_rows(std::min<int64_t>(8, off[u + 1] - row), [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            float sums[2][R];
            for (int64_t p = p_begin; p < p_end; ++p) {
              int8_pair_dot<R>(xp + row * K, expert + p * 2 * K, K, ahead, sums);
              for (int r = 0; r < 2 && 2 * p + r < N; ++r)
                for (int m = 0; m < R; ++m)
                  op[(row + m) * N + 2 * p + r] = static_cast<scalar_t>(
                      sums[r][m] * xq.scales[row + m] * expert_scales[2 * p + r]);
            }
          });
        }
      });
    });
  });
  return out;
}
