// bf16 products of a few tokens on AMX's tile units: out[M, N] = x[M, K] . weight[N, K]^T for
// a decode step's tokens, a verify step's drafts or a short prompt (up to 80 tokens), what
// bf16_gemv (gemv.cpp) computes, where the CPU has the tiles.
//
// Such products are bound by the rate at which the weights stream from memory, so the
// arithmetic only has to keep up with it. With AVX-512 every 32 weights cost one dot-product
// instruction per token: at 8 tokens it no longer keeps up. A tile product (TDPBF16PS)
// multiplies a tile of 16 rows by 32 bf16 by one of 16 pairs of rows by 16 columns into 16 x 16
// float32 sums in one instruction, for any number of columns. Here the weight is the first
// operand: a tile is 16 weight rows by 32 k, loaded straight from the plain row-major weight
// (the weight bf16_gemv reads: no second layout). The tokens are the second, in groups of 16
// (a group is one tile's columns): x rearranged once per call into AMX's pair order, group by
// group [K/2, 16, 2] (one group of M < 16 tokens is [K/2, M, 2]; the last of several is
// zero-padded to 16), which stays in cache. Each weight tile is loaded once and multiplied by
// every group's tile in turn, one tile of sums per group (up to 5 groups: 5 tiles of sums, the
// weight's and two for the tokens, so that one group's tokens load while the other's product
// runs, make the 8 tile registers): the weight streams once for up to 80 tokens. A tile of
// sums is 16 output columns by 16 tokens, transposed as it is stored.
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
constexpr int64_t GROUP_TOKENS = 16;  // a token tile's columns
constexpr int MOST_GROUPS = 5;  // tiles of sums beside the weight's tile and two token tiles
constexpr int64_t MOST_TOKENS = GROUP_TOKENS * MOST_GROUPS;

#ifdef NANOSERVE_AMX

// The tiles (the intrinsics take their numbers as literals): 0 .. groups - 1 the float32 sums
// [16 weight rows, width tokens] of each token group, 6 a weight block [16 rows, 32 k] bf16, 5
// and 7 a token group's [16 k pairs, width tokens x 2] bf16. width: M for one group, else 16.
void configure_tiles(int groups, int64_t width) {
  amx::TileConfig config;
  for (int tile = 0; tile < groups; ++tile) config.bytes_per_row[tile] = width * 4;
  config.bytes_per_row[5] = config.bytes_per_row[7] = width * 4;
  config.load();
}

// x [M, K] (contiguous) -> groups of `width` tokens, each [K/2, width, 2]: each token's pair
// (k, k + 1) as one 32-bit word, the group's words side by side: its tile's rows. Tokens past M
// (the last group's padding) are zeros.
at::Tensor pair_order(const at::Tensor& x, int groups, int64_t width) {
  const int64_t M = x.size(0), pairs = x.size(1) / 2;
  at::Tensor out = at::zeros({groups, pairs, width, 2}, x.options());
  const auto* from = reinterpret_cast<const uint32_t*>(x.data_ptr<bf16>());
  auto* to = reinterpret_cast<uint32_t*>(out.data_ptr<bf16>());
  for (int64_t m = 0; m < M; ++m) {
    uint32_t* group = to + (m / width) * pairs * width;
    for (int64_t pair = 0; pair < pairs; ++pair) group[pair * width + m % width] = from[m * pairs + pair];
  }
  return out;
}

// The tile intrinsics name their registers by literals (the assembler sees the digits), so each
// group's tile of sums is spelled out once here: sums tile G += weight (6) . tokens (7 for even
// groups, 5 for odd ones: the next group's tokens load while this group's product runs).
template <int G>
inline void load_and_multiply(const bf16* group_tokens, int64_t stride) {
  static_assert(G >= 0 && G < MOST_GROUPS, "tiles 0-4 hold sums");
  if constexpr (G % 2 == 0) {
    _tile_loadd(7, group_tokens, stride);
  } else {
    _tile_loadd(5, group_tokens, stride);
  }
  if constexpr (G == 0) _tile_dpbf16ps(0, 6, 7);
  if constexpr (G == 1) _tile_dpbf16ps(1, 6, 5);
  if constexpr (G == 2) _tile_dpbf16ps(2, 6, 7);
  if constexpr (G == 3) _tile_dpbf16ps(3, 6, 5);
  if constexpr (G == 4) _tile_dpbf16ps(4, 6, 7);
}

// Zeroes (store false) or stores (store true, to sums + G * 256) the tile of sums G.
template <int G>
inline void zero_or_store(bool store, float* sums) {
  float* at = sums + G * BLOCK_ROWS * GROUP_TOKENS;
#define NANOSERVE_ZERO_OR_STORE(TILE) \
  if (store) {                        \
    _tile_stored(TILE, at, 64);       \
  } else {                            \
    _tile_zero(TILE);                 \
  }
  if constexpr (G == 0) NANOSERVE_ZERO_OR_STORE(0)
  if constexpr (G == 1) NANOSERVE_ZERO_OR_STORE(1)
  if constexpr (G == 2) NANOSERVE_ZERO_OR_STORE(2)
  if constexpr (G == 3) NANOSERVE_ZERO_OR_STORE(3)
  if constexpr (G == 4) NANOSERVE_ZERO_OR_STORE(4)
#undef NANOSERVE_ZERO_OR_STORE
}

// Multiplies the weight tile (tile 6) by token groups G .. GROUPS - 1 (each group's tile
// loaded in turn).
template <int G, int GROUPS>
inline void multiply_groups(const bf16* group_k, int64_t group_stride, int64_t stride) {
  if constexpr (G < GROUPS) {
    load_and_multiply<G>(group_k + G * group_stride, stride);
    multiply_groups<G + 1, GROUPS>(group_k, group_stride, stride);
  }
}

template <int G, int GROUPS>
inline void zero_and_store_groups(bool store, float* sums) {
  if constexpr (G < GROUPS) {
    zero_or_store<G>(store, sums);
    zero_and_store_groups<G + 1, GROUPS>(store, sums);
  }
}

// sums[g][r * 16 + m] = dot(weight row r, token m of group g) for the block of 16 rows at
// `weight` ([., K] bf16), the tokens in pair order (groups of `width`).
template <int GROUPS>
void block_products(const bf16* weight, const bf16* tokens, int64_t K, int64_t width,
                    float* sums) {
  const int64_t group_stride = K * width;  // bf16 per group: K/2 pairs of `width` words
  zero_and_store_groups<0, GROUPS>(false, sums);
  for (int64_t k = 0; k < K; k += TILE_K) {
    _tile_loadd(6, weight + k, K * 2);
    multiply_groups<0, GROUPS>(tokens + k * width, group_stride, width * 4);
  }
  zero_and_store_groups<0, GROUPS>(true, sums);
}

// out[m, 0 .. 16) (row stride N) = sums[r * 16 + m] for r = 0 .. 15 and the group's M tokens,
// rounded to bf16 as PyTorch rounds: a tile of sums, transposed.
void store_transposed(const float* sums, int64_t M, bf16* out, int64_t N) {
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  for (int64_t m = 0; m < M; ++m) store16(out + m * N, _mm512_i32gather_ps(rows, sums + m, 4));
}

// Weight blocks [first, last) times the tokens (M in GROUPS groups of `width`) into out: one
// thread's share.
template <int GROUPS>
void products_of_blocks(const bf16* weight, const bf16* tokens, int64_t K, int64_t M,
                        int64_t width, int64_t N, int64_t first, int64_t last, bf16* out) {
  alignas(64) float sums[GROUPS * BLOCK_ROWS * GROUP_TOKENS];
  configure_tiles(GROUPS, width);
  for (int64_t block = first; block < last; ++block) {
    block_products<GROUPS>(weight + block * BLOCK_ROWS * K, tokens, K, width, sums);
    for (int64_t g = 0; g < GROUPS; ++g) {
      const int64_t group_tokens = std::min(width, M - g * width);
      store_transposed(sums + g * BLOCK_ROWS * GROUP_TOKENS, group_tokens,
                       out + g * width * N + block * BLOCK_ROWS, N);
    }
  }
  _tile_release();
}

// products_of_blocks for the group count known at run time.
template <int GROUPS = 1>
void products_for_groups(int groups, const bf16* weight, const bf16* tokens, int64_t K,
                         int64_t M, int64_t width, int64_t N, int64_t first, int64_t last,
                         bf16* out) {
  if constexpr (GROUPS < MOST_GROUPS) {
    if (groups > GROUPS)
      return products_for_groups<GROUPS + 1>(groups, weight, tokens, K, M, width, N, first,
                                             last, out);
  }
  products_of_blocks<GROUPS>(weight, tokens, K, M, width, N, first, last, out);
}

#endif  // NANOSERVE_AMX

}  // namespace

// Does bf16_gemv multiply by this plain [N, K] weight on the tiles (for up to 80 tokens)?
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

// The most tokens one amx_bf16_gemv call takes (0 where the CPU has no tiles).
int64_t amx_gemv_max_rows() {
#ifdef NANOSERVE_AMX
  return amx::tiles_permitted() ? MOST_TOKENS : 0;
#else
  return 0;
#endif
}

// x [M, K] bf16 (1 <= M <= 96, K % 32 == 0), weight [N, K] bf16 contiguous (N % 16 == 0)
// -> [M, N] bf16 (float32 sums, rounded once). Only where amx_gemv_applies (which checks all
// of that, and that the CPU has the tiles).
at::Tensor amx_bf16_gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(amx_gemv_applies(x, weight), "amx_bf16_gemv: no AMX here, or unsupported shapes");
#ifdef NANOSERVE_AMX
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const int groups = static_cast<int>((M + GROUP_TOKENS - 1) / GROUP_TOKENS);
  const int64_t width = groups == 1 ? M : GROUP_TOKENS;
  const at::Tensor tokens = pair_order(x.contiguous(), groups, width);
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t blocks = N / BLOCK_ROWS, threads = std::min<int64_t>(at::get_num_threads(), blocks);
  const bf16 *w = weight.data_ptr<bf16>(), *t = tokens.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t share = begin; share < end; ++share)  // equal runs of blocks
      products_for_groups(groups, w, t, K, M, width, N, blocks * share / threads,
                          blocks * (share + 1) / threads, o);
  });
  return out;
#else
  return at::Tensor();
#endif
}
