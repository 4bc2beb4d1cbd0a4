// bf16 decode products on AMX's tile units: out[M, N] = x[M, K] . weight[N, K]^T for a decode
// step's few tokens, what bf16_gemv (gemv.cpp) computes, where the CPU has the tiles.
//
// A decode step's products are bound by the rate at which the weights stream from memory, so
// the arithmetic only has to keep up with it. With AVX-512 every 32 weights cost one
// dot-product instruction per token: at 8 tokens it no longer keeps up. A tile product
// (TDPBF16PS) multiplies a tile of 16 rows by 32 bf16 by one of 16 pairs of rows by 16 columns
// into 16 x 16 float32 sums in one instruction, for any number of columns. Here the weight is
// the first operand: a tile is 16 weight rows by 32 k, loaded straight from the plain row-major
// weight (the weight bf16_gemv reads: no second layout). The tokens are the second: x
// rearranged once per call into AMX's pair order [K/2, M, 2] (a few KiB, which stays in cache),
// one tile per 32 k with M columns. A tile of sums is then 16 output columns by M tokens, and
// is transposed as it is stored.
//
// Threads take equal runs of 16-row blocks, each streaming its own contiguous part of the
// weight, one block after another (two blocks side by side, sharing each token tile, streamed
// no faster: the hardware prefetcher follows 16 rows better than 32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "simd.h"

namespace {

using bf16 = at::BFloat16;

constexpr int64_t BLOCK_ROWS = 16;  // weight rows in a tile (the tile's rows)
constexpr int64_t TILE_K = 32;      // bf16 in a tile row (64 bytes)
constexpr int64_t MOST_TOKENS = 16;  // the token tile's columns

#ifdef NANOSERVE_AMX

// The tiles (the intrinsics take their numbers as literals): 0 the float32 sums [16 weight
// rows, M tokens], 2 a weight block [16 rows, 32 k] bf16, 4 the tokens [16 k pairs,
// M tokens x 2] bf16.
void configure_tiles(int64_t M) {
  amx::TileConfig config;
  for (const int tile : {0, 4}) config.bytes_per_row[tile] = M * 4;
  config.load();
}

// x [M, K] (contiguous) -> [K/2, M, 2]: each token's pair (k, k + 1) as one 32-bit word, the M
// tokens' words side by side: the token tile's rows.
at::Tensor pair_order(const at::Tensor& x) {
  const int64_t M = x.size(0), pairs = x.size(1) / 2;
  at::Tensor out = at::empty({pairs, M, 2}, x.options());
  const auto* from = reinterpret_cast<const uint32_t*>(x.data_ptr<bf16>());
  auto* to = reinterpret_cast<uint32_t*>(out.data_ptr<bf16>());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t pair = 0; pair < pairs; ++pair) to[pair * M + m] = from[m * pairs + pair];
  return out;
}

// sums[r * 16 + m] = dot(weight row r, token m) for the block of 16 rows at `weight` ([., K]
// bf16), the tokens in pair order.
void block_products(const bf16* weight, const bf16* tokens, int64_t K, int64_t M, float* sums) {
  _tile_zero(0);
  for (int64_t k = 0; k < K; k += TILE_K) {
    _tile_loadd(4, tokens + k * M, M * 4);  // the tokens' pairs k/2 .. k/2 + 15
    _tile_loadd(2, weight + k, K * 2);
    _tile_dpbf16ps(0, 2, 4);
  }
  _tile_stored(0, sums, 64);
}

// out[m, 0 .. 16) (row stride N) = sums[r * 16 + m] for r = 0 .. 15, rounded to bf16 as
// PyTorch rounds: a tile of sums, transposed.
void store_transposed(const float* sums, int64_t M, bf16* out, int64_t N) {
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  for (int64_t m = 0; m < M; ++m) store16(out + m * N, _mm512_i32gather_ps(rows, sums + m, 4));
}

// Weight blocks [first, last) times the tokens into out: one thread's share.
void products_of_blocks(const bf16* weight, const bf16* tokens, int64_t K, int64_t M,
                        int64_t N, int64_t first, int64_t last, bf16* out) {
  alignas(64) float sums[BLOCK_ROWS * 16];
  configure_tiles(M);
  for (int64_t block = first; block < last; ++block) {
    block_products(weight + block * BLOCK_ROWS * K, tokens, K, M, sums);
    store_transposed(sums, M, out + block * BLOCK_ROWS, N);
  }
  _tile_release();
}

#endif  // NANOSERVE_AMX

}  // namespace

// Does bf16_gemv multiply by this plain [N, K] weight on the tiles (for up to 16 tokens)?
bool amx_gemv_takes(const at::Tensor& weight) {
#ifdef NANOSERVE_AMX
  return amx::tiles_permitted() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
         weight.is_contiguous() && weight.size(1) % TILE_K == 0 && weight.size(0) % BLOCK_ROWS == 0;
#else
  return false;
#endif
}

bool amx_gemv_applies(const at::Tensor& x, const at::Tensor& weight) {
  return amx_gemv_takes(weight) && x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
         x.size(1) == weight.size(1) && x.size(0) >= 1 && x.size(0) <= MOST_TOKENS;
}

// x [M, K] bf16 (1 <= M <= 16, K % 32 == 0), weight [N, K] bf16 contiguous (N % 16 == 0)
// -> [M, N] bf16 (float32 sums, rounded once). Only where amx_gemv_applies (which checks all
// of that, and that the CPU has the tiles).
at::Tensor amx_bf16_gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(amx_gemv_applies(x, weight), "amx_bf16_gemv: no AMX here, or unsupported shapes");
#ifdef NANOSERVE_AMX
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor tokens = pair_order(x.contiguous());
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t blocks = N / BLOCK_ROWS, threads = std::min<int64_t>(at::get_num_threads(), blocks);
  const bf16 *w = weight.data_ptr<bf16>(), *t = tokens.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t share = begin; share < end; ++share)  // equal runs of blocks
      products_of_blocks(w, t, K, M, N, blocks * share / threads,
                         blocks * (share + 1) / threads, o);
  });
  return out;
#else
  return at::Tensor();
#endif
}
