// bf16 decode products from a weight laid out for them: out[M, N] = x[M, K] . weight[N, K]^T,
// what bf16_gemv (gemv.cpp) computes, on CPUs with AVX-512 BF16 and no AMX tiles.
//
// bf16_gemv's row dot products read one weight row at a time: each 32 weights meet each token's
// 32 activations in one vdpbf16ps, and every row ends in a horizontal sum per token. At 8 tokens
// that is 9 vector loads per 64 bytes of weights and 8 horizontal sums per row, and the rate at
// which it streams the weights falls to half its one-token rate (benchmarks/RESULTS.md).
//
// Here the weight is re-laid once, at load, in blocks of 64 output rows ("block layout"):
//
//   blocks [N/64, K/2, 64, 2]: for each k pair, the 64 rows' (k, k + 1) weights side by side,
//   so one 64-byte line holds 16 rows' pair, and the block streams front to back.
//
// A line times one token's pair broadcast to every lane (vdpbf16ps) adds that pair's products
// to 16 rows' sums at once: the sums are the outputs themselves, with no horizontal sum at the
// end, and a token costs one 4-byte broadcast per 4 lines. Threads take whole blocks.
//
// int8 weights (quantization/int8.py) take the same layout, [N/64, K/2, 64, 2] int8: a k pair's
// 64 rows fill two lines, each widened half by half to int16 (16 rows' pair per register), and
// one instruction (AVX512-VNNI's vpdpwssd; AVX512-BW's vpmaddwd and an add) adds a token's int16
// pair (int8_gemv rounds activations to int16) to 16 rows' int32 sums, exactly. A lane gains at most 2 * 32768 * 127 a pair, so the integer sums
// are folded into float32 every INT32_SAFE_PAIRS pairs. Each instruction does half the work per
// weight byte of the bf16 one, so here the products, not memory, bound a step of several tokens:
// more than 4 tokens go through a block in two passes of at most 4 (the block's second pass
// reads it from the cache), which keeps every sum in a register.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t ROWS = 64;  // output rows in a block
constexpr int LINES = 4;      // 64-byte lines per k pair of a block: 16 rows' pairs each

#ifdef __AVX512BF16__
// sums[m][r] = dot(x[m], block row r) for M tokens; x as [M, K/2] 32-bit pairs, block the
// [K/2, 64, 2] bf16 at `block`.
template <int M>
void block_products(const uint32_t* x, const char* block, int64_t pairs, int64_t ahead,
                    __m512 (&sums)[M][LINES]) {
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < LINES; ++v) sums[m][v] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const char* lines = block + pair * LINES * 64;
    __m512bh w[LINES];
    for (int v = 0; v < LINES; ++v) {
      if (ahead) _mm_prefetch(lines + v * 64 + ahead, _MM_HINT_T0);
      w[v] = (__m512bh)_mm512_loadu_si512(lines + v * 64);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh token = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * pairs + pair]));
      for (int v = 0; v < LINES; ++v) sums[m][v] = _mm512_dpbf16_ps(sums[m][v], w[v], token);
    }
  }
}

template <int M>
void block_gemv(const uint32_t* x, const char* blocks, int64_t K, int64_t N, int64_t ahead,
                at::BFloat16* out) {
  const int64_t pairs = K / 2, block_bytes = pairs * ROWS * 4;
  at::parallel_for(0, N / ROWS, 1, [&](int64_t begin, int64_t end) {
    __m512 sums[M][LINES];
    for (int64_t b = begin; b < end; ++b) {
      block_products<M>(x, blocks + b * block_bytes, pairs, ahead, sums);
      for (int m = 0; m < M; ++m)
        for (int v = 0; v < LINES; ++v) store16(out + m * N + b * ROWS + v * 16, sums[m][v]);
    }
  });
}
#endif

#ifdef __AVX512BW__
constexpr int64_t INT32_SAFE_PAIRS = 256;  // pairs an int32 lane sums without overflowing

// sums[m * 64 + r] += dot(x[m], block row r) for M <= 4 tokens; x as [M, K/2] 32-bit pairs of
// int16 (row stride `stride` pairs), block the [K/2, 64, 2] int8 at `block`.
template <int M>
void int8_block_products(const uint32_t* x, int64_t stride, const int8_t* block, int64_t pairs,
                         int64_t ahead, float* sums) {
  constexpr int HALVES = 4;  // a k pair of 64 rows: two lines, each widened to two registers
  for (int64_t first = 0; first < pairs; first += INT32_SAFE_PAIRS) {
    __m512i acc[M][HALVES];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < HALVES; ++h) acc[m][h] = _mm512_setzero_si512();
    for (int64_t pair = first; pair < std::min(pairs, first + INT32_SAFE_PAIRS); ++pair) {
      const int8_t* lines = block + pair * ROWS * 2;  // two 64-byte lines: 32 rows' pair each
      if (ahead) {
        _mm_prefetch(reinterpret_cast<const char*>(lines) + ahead, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(lines) + ahead + 64, _MM_HINT_T0);
      }
      __m512i w[HALVES];
      for (int h = 0; h < HALVES; ++h)
        w[h] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines) + h));
      for (int m = 0; m < M; ++m) {
        const __m512i token = _mm512_set1_epi32(static_cast<int>(x[m * stride + pair]));
        for (int h = 0; h < HALVES; ++h) acc[m][h] = add_pair_products(acc[m][h], w[h], token);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < HALVES; ++h) {
        float* at = sums + m * ROWS + 16 * h;
        _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), _mm512_cvtepi32_ps(acc[m][h])));
      }
  }
}

// out[m, n] = x_scales[m] * scales[n] * dot(x[m], row n) for M tokens, block by block.
template <int M, typename Out>
void int8_block_gemv(const uint32_t* x, const float* x_scales, const int8_t* blocks, int64_t K,
                     int64_t N, const float* scales, int64_t ahead, Out* out) {
  const int64_t pairs = K / 2, block_bytes = pairs * ROWS * 2;
  at::parallel_for(0, N / ROWS, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[M * ROWS];
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* block = blocks + b * block_bytes;
      std::fill(sums, sums + M * ROWS, 0.f);
      int8_block_products<std::min(M, 4)>(x, pairs, block, pairs, ahead, sums);
      if constexpr (M > 4)  // the other tokens, from the cache
        int8_block_products<M - 4>(x + 4 * pairs, pairs, block, pairs, 0, sums + 4 * ROWS);
      for (int m = 0; m < M; ++m)
        for (int64_t r = 0; r < ROWS; r += 16) {  // sum * (x_scales[m] * scales[n]), 16 rows
          const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(x_scales[m]),
                                             _mm512_loadu_ps(scales + b * ROWS + r));
          const __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(sums + m * ROWS + r), scale);
          Out* to = out + m * N + b * ROWS + r;
          if constexpr (std::is_same_v<Out, float> || std::is_same_v<Out, at::BFloat16>) {
            store16(to, sum);
          } else {
            alignas(64) float values[16];
            _mm512_store_ps(values, sum);
            for (int i = 0; i < 16; ++i) to[i] = static_cast<Out>(values[i]);
          }
        }
    }
  });
}
#endif

}  // namespace

// Can `weight` be laid out in blocks: [N, K] of `dtype`, N % 64 == 0, K even?
static bool fits_blocks(const at::Tensor& weight, at::ScalarType dtype) {
  return weight.dim() == 2 && weight.scalar_type() == dtype && weight.size(0) > 0 &&
         weight.size(0) % ROWS == 0 && weight.size(1) % 2 == 0;
}

// weight [N, K] -> blocks [N/64, K/2, 64, 2] (a copy). A k pair moves as one element (int32 for
// bf16, int16 for int8): the copy then moves whole pairs, several times faster than values.
static at::Tensor blocks_of(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1);
  const auto pair = weight.element_size() == 2 ? at::kInt : at::kShort;
  const at::Tensor pairs = weight.contiguous().view(pair).reshape({N / ROWS, ROWS, K / 2});
  const at::Tensor blocks = pairs.permute({0, 2, 1}).contiguous();  // [N/64, K/2, 64] pairs
  return blocks.view(weight.scalar_type()).reshape({N / ROWS, K / 2, ROWS, 2});
}

// weight [N, K] bf16 -> blocks [N/64, K/2, 64, 2] (a copy).
at::Tensor bf16_blocks(const at::Tensor& weight) {
  TORCH_CHECK(fits_blocks(weight, at::kBFloat16),
              "bf16_blocks takes a bf16 [N, K] weight, N % 64 == 0, K even");
  return blocks_of(weight);
}

// weight [N, K] int8 -> its blocks [N/64, K/2, 64, 2] where int8_gemv multiplies them here (the
// library has AVX512-BW; N % 64 == 0, K even), else None (int8_gemv then takes row pairs).
c10::optional<at::Tensor> int8_gemv_blocks(const at::Tensor& weight) {
#ifdef __AVX512BW__
  if (fits_blocks(weight, at::kChar)) return blocks_of(weight);
#endif
  return c10::nullopt;
}

// out [M, N] (x's dtype) = x16 [M, K] int16 . blocks^T, each row m times x_scales[m] and each
// column n times scales[n]: int8_gemv's products on int8_gemv_blocks' layout.
void block_int8_gemv(const at::Tensor& x16, const float* x_scales, const at::Tensor& blocks,
                     const float* scales, int64_t ahead, at::Tensor& out) {
#ifdef __AVX512BW__
  const int64_t M = x16.size(0), K = x16.size(1), N = blocks.size(0) * ROWS;
  const auto* pairs = reinterpret_cast<const uint32_t*>(x16.data_ptr<int16_t>());
  const int8_t* bytes = blocks.data_ptr<int8_t>();
  with_rows(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "int8_blocks", [&] {
      int8_block_gemv<R>(pairs, x_scales, bytes, K, N, scales, ahead, out.data_ptr<scalar_t>());
    });
  });
#else
  TORCH_CHECK(false, "int8_gemv's blocks need a library built with AVX512-BW");
#endif
}

// Does bf16_gemv_weight lay `weight` out in blocks here? Where the library has AVX-512 BF16, the
// weight fits them, and AMX's tiles do not take it instead (in their own layout).
bool block_gemv_takes(const at::Tensor& weight) {
#ifdef __AVX512BF16__
  return fits_blocks(weight, at::kBFloat16) && !amx_gemv_takes(weight);
#else
  return false;
#endif
}

// The weight as bf16_gemv reads it fastest here: AMX's tiles where amx_gemv_takes it
// (amx_gemv.cpp), its blocks where block_gemv_takes it, else the weight itself.
at::Tensor bf16_gemv_weight(at::Tensor weight) {
  if (amx_gemv_takes(weight)) return amx_gemv_layout(weight);
  return block_gemv_takes(weight) ? bf16_blocks(weight) : weight;
}

// x [M, K] bf16 (1 <= M <= 8), blocks [N/64, K/2, 64, 2] bf16 -> [M, N] bf16 (float32 sums,
// rounded once as PyTorch rounds).
at::Tensor block_bf16_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t ahead) {
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(2) == ROWS && blocks.size(3) == 2,
              "block_bf16_gemv takes the weight as bf16_gemv_weight lays it out");
  TORCH_CHECK(blocks.scalar_type() == at::kBFloat16 && blocks.is_contiguous());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == 2 * blocks.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0) * ROWS;
  TORCH_CHECK(M >= 1 && M <= 8, "the decode GEMVs take 1 to 8 rows, got ", M);
#ifdef __AVX512BF16__
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const auto* pairs = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  const auto* bytes = reinterpret_cast<const char*>(blocks.data_ptr<at::BFloat16>());
  with_rows(M, [&](auto rows) {
    block_gemv<decltype(rows)::value>(pairs, bytes, K, N, ahead, out.data_ptr<at::BFloat16>());
  });
  return out;
#else
  TORCH_CHECK(false, "block_bf16_gemv needs a library built with AVX-512 BF16");
#endif
}
