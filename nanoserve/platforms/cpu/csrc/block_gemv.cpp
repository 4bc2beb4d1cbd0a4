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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

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

}  // namespace

// Can `weight` be laid out in blocks: bf16 [N, K], N % 64 == 0, K even?
static bool fits_blocks(const at::Tensor& weight) {
  return weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(0) > 0 &&
         weight.size(0) % ROWS == 0 && weight.size(1) % 2 == 0;
}

// weight [N, K] bf16 -> blocks [N/64, K/2, 64, 2] (a copy).
at::Tensor bf16_blocks(const at::Tensor& weight) {
  TORCH_CHECK(fits_blocks(weight), "bf16_blocks takes a bf16 [N, K] weight, N % 64 == 0, K even");
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.reshape({N / ROWS, ROWS, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// Does bf16_gemv_weight lay `weight` out in blocks here? Where the library has AVX-512 BF16, the
// weight fits them, and AMX's tiles do not take it instead (they read the plain weight).
bool block_gemv_takes(const at::Tensor& weight) {
#ifdef __AVX512BF16__
  return fits_blocks(weight) && !amx_gemv_takes(weight);
#else
  return false;
#endif
}

// The weight as bf16_gemv reads it fastest here: its blocks where block_gemv_takes it, else the
// weight itself.
at::Tensor bf16_gemv_weight(at::Tensor weight) {
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
