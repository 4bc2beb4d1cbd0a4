// bf16 products of a few tokens on AMX's tile units: out[M, N] = x[M, K] . weight[N, K]^T for
// a decode step's tokens, a verify step's drafts or a short prompt (up to 80 tokens), what
// bf16_gemv (gemv.cpp) computes, where the CPU has the tiles.
//
// Such products are bound by the rate at which the weights stream from memory, so the
// arithmetic only has to keep up with it. With AVX-512 every 32 weights cost one dot-product
// instruction per token: at 8 tokens it no longer keeps up. A tile product (TDPBF16PS) adds
// A [rows, 32 bf16] times B [16 pairs of rows, 16 columns x 2] to float32 sums [rows, 16] in one
// instruction. Here the tokens are A, read in place from x (a tile is up to 16 tokens by 32 k),
// and the weight is B, in AMX's pair order: each k pair's two weights of one output side by side
// as one 32-bit word. `amx_gemv_layout` lays the weight out once so that every tile is 1 KiB in
// a row, [N/16, K/32, 16, 16, 2] (16 outputs, then 32 k in pairs, then 16 outputs' pair words),
// and a block of 16 outputs streams front to back, as the hardware prefetcher likes best. A tile
// of sums is 16 outputs of each of its tokens: stored row by row, nothing transposed.
//
// Tokens come in groups of 16 (a tile's rows): each weight tile is loaded once and multiplied
// by every group's tile in turn, one tile of sums per group (up to 5 groups: 5 tiles of sums,
// the weight's tile and two token tiles, so that one group's tokens load while the other's
// product runs, make the 8 tile registers): the weight streams once for up to 80 tokens. Past
// one group, a last partial group takes the last 16 tokens, overlapping the group before it,
// and keeps the sums of its own tokens only: nothing is copied or padded.
//
// Threads take equal runs of 16-output blocks, each streaming its own contiguous part of the
// weight, one block after another.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "simd.h"

namespace {

using bf16 = at::BFloat16;

constexpr int64_t BLOCK_ROWS = 16;    // outputs (weight rows) in a tile
constexpr int64_t TILE_K = 32;        // bf16 in a tile row (64 bytes)
constexpr int64_t TILE_ELEMS = BLOCK_ROWS * TILE_K;  // bf16 in a weight tile (1 KiB)
constexpr int64_t GROUP_TOKENS = 16;  // a token tile's rows
constexpr int MOST_GROUPS = 5;  // tiles of sums beside the weight's tile and two token tiles
constexpr int64_t MOST_TOKENS = GROUP_TOKENS * MOST_GROUPS;

#ifdef NANOSERVE_AMX

// Is `tiles` a weight as amx_gemv_layout lays it out ([N/16, K/32, 16, 16, 2] bf16)?
bool is_tile_layout(const at::Tensor& tiles) {
  return tiles.dim() == 5 && tiles.size(2) == BLOCK_ROWS && tiles.size(3) == BLOCK_ROWS &&
         tiles.size(4) == 2 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous();
}

// The tiles (the intrinsics take their numbers as literals): 0 .. 4 the float32 sums [rows
// tokens, 16 outputs] of each token group, 6 a weight tile [16 pairs, 16 outputs x 2], 5 and 7
// a token group's [rows tokens, 32 k]. rows: M for one group, else 16.
void configure_tiles(int64_t rows) {
  amx::TileConfig config;
  for (const int tile : {0, 1, 2, 3, 4, 5, 7}) config.rows[tile] = rows;
  config.load();
}

// Each group's tile of sums is spelled out once here: sums tile G += tokens (7 for even groups,
// 5 for odd ones: the next group's tokens load while this group's product runs) . weight (6).
template <int G>
inline void load_and_multiply(const bf16* group_tokens, int64_t stride) {
  static_assert(G >= 0 && G < MOST_GROUPS, "tiles 0-4 hold sums");
  if constexpr (G % 2 == 0) {
    _tile_loadd(7, group_tokens, stride);
  } else {
    _tile_loadd(5, group_tokens, stride);
  }
  if constexpr (G == 0) _tile_dpbf16ps(0, 7, 6);
  if constexpr (G == 1) _tile_dpbf16ps(1, 5, 6);
  if constexpr (G == 2) _tile_dpbf16ps(2, 7, 6);
  if constexpr (G == 3) _tile_dpbf16ps(3, 5, 6);
  if constexpr (G == 4) _tile_dpbf16ps(4, 7, 6);
}

// Zeroes (store false) or stores (store true, to sums + G * 256) the tile of sums G.
template <int G>
inline void zero_or_store(bool store, float* sums) {
  float* at = sums + G * GROUP_TOKENS * BLOCK_ROWS;
#define NANOSERVE_ZERO_OR_STORE(TILE) \
  {                                   \
    if (store) {                      \
      _tile_stored(TILE, at, 64);     \
    } else {                          \
      _tile_zero(TILE);               \
    }                                 \
  }
  if constexpr (G == 0) NANOSERVE_ZERO_OR_STORE(0)
  if constexpr (G == 1) NANOSERVE_ZERO_OR_STORE(1)
  if constexpr (G == 2) NANOSERVE_ZERO_OR_STORE(2)
  if constexpr (G == 3) NANOSERVE_ZERO_OR_STORE(3)
  if constexpr (G == 4) NANOSERVE_ZERO_OR_STORE(4)
#undef NANOSERVE_ZERO_OR_STORE
}

// Multiplies the weight tile (tile 6) by token groups G .. GROUPS - 1, each group's tile loaded
// in turn from `tokens_k` (the tokens' columns k .. k + 31, rows K apart): group g's first
// token is 16 g, the last group's `last_row`.
template <int G, int GROUPS>
inline void multiply_groups(const bf16* tokens_k, int64_t K, int64_t last_row) {
  if constexpr (G < GROUPS) {
    const int64_t first = G == GROUPS - 1 ? last_row : G * GROUP_TOKENS;
    load_and_multiply<G>(tokens_k + first * K, K * 2);
    multiply_groups<G + 1, GROUPS>(tokens_k, K, last_row);
  }
}

template <int G, int GROUPS>
inline void zero_and_store_groups(bool store, float* sums) {
  if constexpr (G < GROUPS) {
    zero_or_store<G>(store, sums);
    zero_and_store_groups<G + 1, GROUPS>(store, sums);
  }
}

// Asks for the weight tile at `at` (16 lines) in L2. Every line, not one per tile: the tile
// loads then find the weight in L2, and L1 keeps the token tiles that every weight tile meets
// (prefetched into L1, or one line a tile, the products of 16 tokens and more ran slower).
inline void prefetch_tile_to_l2(const char* at) {
  for (int line = 0; line < 16; ++line) _mm_prefetch(at + line * 64, _MM_HINT_T1);
}

// sums[g][m * 16 + r] = dot(token m of group g, weight row r of the block) for the block's K/32
// tiles at `block` (1 KiB each, in a row), the tokens [M, K] bf16, the last group from
// `last_row` on.
template <int GROUPS>
void block_products(const bf16* block, const bf16* tokens, int64_t K, int64_t last_row,
                    int64_t ahead, float* sums) {
  const char* stream = reinterpret_cast<const char*>(block);
  zero_and_store_groups<0, GROUPS>(false, sums);
  for (int64_t k = 0, tile = 0; k < K; k += TILE_K, ++tile) {
    if (ahead > 0) prefetch_tile_to_l2(stream + tile * TILE_ELEMS * 2 + ahead);
    _tile_loadd(6, block + tile * TILE_ELEMS, 64);
    multiply_groups<0, GROUPS>(tokens + k, K, last_row);
  }
  zero_and_store_groups<0, GROUPS>(true, sums);
}

// Weight blocks [first, last) times the tokens (M of them, GROUPS groups of `rows`, the last
// from row M - rows on) into out: one thread's share. Each token's 16 sums of a block are
// rounded to bf16 as PyTorch rounds.
template <int GROUPS>
void products_of_blocks(const bf16* tiles, const bf16* tokens, int64_t K, int64_t M,
                        int64_t rows, int64_t N, int64_t ahead, int64_t first, int64_t last,
                        bf16* out) {
  alignas(64) float sums[GROUPS * GROUP_TOKENS * BLOCK_ROWS];
  const int64_t last_row = M - rows, last_group = (GROUPS - 1) * GROUP_TOKENS;
  configure_tiles(rows);
  for (int64_t block = first; block < last; ++block) {
    block_products<GROUPS>(tiles + block * BLOCK_ROWS * K, tokens, K, last_row, ahead, sums);
    for (int64_t m = 0; m < M; ++m) {  // the last group's row of token m: m - last_row
      const int64_t row = m < last_group ? m : last_group + m - last_row;
      store16(out + m * N + block * BLOCK_ROWS, _mm512_load_ps(sums + row * BLOCK_ROWS));
    }
  }
  _tile_release();
}

// products_of_blocks for the group count known at run time.
template <int GROUPS = 1>
void products_for_groups(int groups, const bf16* tiles, const bf16* tokens, int64_t K,
                         int64_t M, int64_t rows, int64_t N, int64_t ahead, int64_t first,
                         int64_t last, bf16* out) {
  if constexpr (GROUPS < MOST_GROUPS) {
    if (groups > GROUPS)
      return products_for_groups<GROUPS + 1>(groups, tiles, tokens, K, M, rows, N, ahead,
                                             first, last, out);
  }
  products_of_blocks<GROUPS>(tiles, tokens, K, M, rows, N, ahead, first, last, out);
}

#endif  // NANOSERVE_AMX

}  // namespace

// Does amx_gemv_layout take this plain [N, K] weight (so that bf16_gemv multiplies it on the
// tiles, for up to 80 tokens)? Where the CPU has them, a bf16 weight of whole tiles.
bool amx_gemv_takes(const at::Tensor& weight) {
#ifdef NANOSERVE_AMX
  return amx::tiles_permitted() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
         weight.is_contiguous() && weight.size(1) % TILE_K == 0 && weight.size(0) % BLOCK_ROWS == 0;
#else
  return false;
#endif
}

// [N, K] bf16 -> [N/16, K/32, 16, 16, 2]: block b, k tile t, pair p, output r, half h holds
// weight[16 b + r, 32 t + 2 p + h]: each tile of 16 outputs by 32 k is one KiB, in AMX's pair
// order, a block's tiles one after another. Only where amx_gemv_takes the weight.
at::Tensor amx_gemv_layout(const at::Tensor& weight) {
  TORCH_CHECK(amx_gemv_takes(weight), "amx_gemv_layout: no AMX here, or not whole tiles");
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.view({N / BLOCK_ROWS, BLOCK_ROWS, K / TILE_K, TILE_K / 2, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous();
}

bool amx_gemv_applies(const at::Tensor& x, const at::Tensor& tiles) {
#ifdef NANOSERVE_AMX
  return amx::tiles_permitted() && is_tile_layout(tiles) && x.dim() == 2 &&
         x.scalar_type() == at::kBFloat16 && x.size(1) == tiles.size(1) * TILE_K &&
         x.size(0) >= 1 && x.size(0) <= MOST_TOKENS;
#else
  return false;
#endif
}

// The most tokens one amx_bf16_gemv call takes (0 where the CPU has no tiles).
int64_t amx_gemv_max_rows() {
#ifdef NANOSERVE_AMX
  return amx::tiles_permitted() ? MOST_TOKENS : 0;
#else
  return 0;
#endif
}

// x [M, K] bf16 (1 <= M <= 80), tiles: a [N, K] weight as amx_gemv_layout lays it out
// -> [M, N] bf16 (float32 sums, rounded once), prefetching `ahead` bytes down the weight's
// stream. Only where amx_gemv_applies (which checks all of that, and that the CPU has the tiles).
at::Tensor amx_bf16_gemv(const at::Tensor& x, const at::Tensor& tiles, int64_t ahead) {
  TORCH_CHECK(amx_gemv_applies(x, tiles), "amx_bf16_gemv: no AMX here, or unsupported shapes");
#ifdef NANOSERVE_AMX
  const int64_t M = x.size(0), K = x.size(1), N = tiles.size(0) * BLOCK_ROWS;
  const int groups = static_cast<int>((M + GROUP_TOKENS - 1) / GROUP_TOKENS);
  const int64_t rows = groups == 1 ? M : GROUP_TOKENS;
  const at::Tensor tokens = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t blocks = N / BLOCK_ROWS, threads = std::min<int64_t>(at::get_num_threads(), blocks);
  const bf16 *w = tiles.data_ptr<bf16>(), *t = tokens.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t share = begin; share < end; ++share)  // equal runs of blocks
      products_for_groups(groups, w, t, K, M, rows, N, ahead, blocks * share / threads,
                          blocks * (share + 1) / threads, o);
  });
  return out;
#else
  return at::Tensor();
#endif
}
