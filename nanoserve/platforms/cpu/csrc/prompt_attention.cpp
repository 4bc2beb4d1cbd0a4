// One prompt chunk's attention in bf16: the chunk's Q queries over its context of K keys (its
// cached prefix, then its own tokens), each query seeing the keys up to its own position, the
// causal mask aligned to the bottom right (query i sees keys 0 .. K - Q + i). What PyTorch's
// flash SDPA computes, with a lighter softmax and the two products on AMX's tile units where the
// CPU has them (Intel Xeon since Sapphire Rapids), else on AVX-512 BF16's pair dot products
// (AMD Zen 4 and 5, Intel Cooper Lake): the same blocks, the same packed operands.
//
// Flash attention, as in the papers: the queries are cut into blocks of QUERY_BLOCK tokens, the
// keys into blocks of KEY_BLOCK. One task is (KV head, query block): the GQA group's query heads
// that share the KV head are stacked into one block of rows, so each key block is read once for
// all of them. Per key block: scores S = Q K^T (AMX, float32), the block's maximum per row, the
// probabilities P = exp(S - running max) rounded to bf16, and O += P V (AMX, float32). The running
// maximum moves only when a block's maximum passes it by more than 2^8 (so O is rescaled rarely,
// not per block; probabilities up to 256 lose nothing in float32 or bf16); the row sums divide O
// at the end.
//
// Both kinds of product take B in "VNNI" order (pairs of rows interleaved: each 32-bit word holds
// two consecutive k of one column), so each KV head's keys and values are repacked once per call,
// block by block, before the tasks start. A run of one request's tokens in a paged step (a verify
// step's drafts, a short chunk; decode_attention.cpp finds them) is such a chunk too, its keys
// and values read where they lie in the cache: there each task packs the key blocks it reads
// (a run of up to 128 tokens is one query block, so each is packed once per KV head).
// Tiles are 16 rows of 64 bytes (16 float32 or 32 bf16),
// and the vector products work in 32 columns at least: head dims must be a multiple of 32. Blocks
// past the end (the last query block, the last key block) are zero-padded so every product is
// whole.
//
// Tasks go largest first (query blocks at the end see the most keys) to threads that take the
// next one as they finish, which evens out the causal triangle's work.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "simd.h"

#if defined(__AVX512BF16__)
#define NANOSERVE_PROMPT_KERNEL 1
#endif

namespace {

using bf16 = at::BFloat16;

constexpr int64_t QUERY_BLOCK = 128;  // queries per task and head
constexpr int64_t KEY_BLOCK = 128;    // keys per block (a multiple of 32)
constexpr float RESCALE_HEADROOM = 8.f;  // log2 of how far a row's maximum may run ahead

#ifdef NANOSERVE_PROMPT_KERNEL

// 64-byte aligned float32 or bf16 storage (a tile row is one cache line).
template <typename T>
struct AlignedBuffer {
  T* data = nullptr;
  int64_t size = 0;
  void reserve(int64_t n) {
    if (n <= size) return;
    std::free(data);
    data = static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
    size = n;
  }
  ~AlignedBuffer() { std::free(data); }
};

// A thread's working set for one task: M = group * QUERY_BLOCK rows at most.
struct TaskScratch {
  AlignedBuffer<bf16> queries;        // [M, D]
  AlignedBuffer<float> scores;        // [M, KEY_BLOCK]
  AlignedBuffer<bf16> probabilities;  // [M, KEY_BLOCK]
  AlignedBuffer<float> out;           // [M, D]
  AlignedBuffer<float> row_max, row_sum;  // [M] (row_max in log2 units, scaled)
  AlignedBuffer<int64_t> widths;          // [M / 4]: keys of the block each 4 rows see
  AlignedBuffer<int64_t> ends;            // [M]: the keys each row sees in all (0: padding)
  AlignedBuffer<bf16> keys, values;       // [KEY_BLOCK * D] each: a block packed from the cache
  void reserve(int64_t M, int64_t D) {
    queries.reserve(M * D), scores.reserve(M * KEY_BLOCK), probabilities.reserve(M * KEY_BLOCK);
    out.reserve(M * D), row_max.reserve(M), row_sum.reserve(M), widths.reserve(M / 4);
    ends.reserve(M);
    keys.reserve(KEY_BLOCK * D), values.reserve(KEY_BLOCK * D);
  }
};

// rows[k] (16 words each) -> rows[p]: word p of every row, in row order (a 16 x 16 transpose
// of 32-bit words, in shuffles).
inline void transpose_words(__m512i (&rows)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // t[i], t[i + 1]: rows i, i + 1's words 0, 1 / 2, 3 of a lane
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  __m512i v[4][4];  // v[g][e], lane L: word 4L + e of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    const __m512i *low = t + 4 * g, *high = t + 4 * g + 1;
    v[g][0] = _mm512_unpacklo_epi64(low[0], low[2]);
    v[g][1] = _mm512_unpackhi_epi64(low[0], low[2]);
    v[g][2] = _mm512_unpacklo_epi64(high[0], high[2]);
    v[g][3] = _mm512_unpackhi_epi64(high[0], high[2]);
  }
  for (int e = 0; e < 4; ++e) {  // word 4L + e of all 16 rows: lane L of v[0..3][e], in order
    const __m512i x = _mm512_shuffle_i32x4(v[0][e], v[1][e], 0x44);
    const __m512i y = _mm512_shuffle_i32x4(v[0][e], v[1][e], 0xEE);
    const __m512i z = _mm512_shuffle_i32x4(v[2][e], v[3][e], 0x44);
    const __m512i w = _mm512_shuffle_i32x4(v[2][e], v[3][e], 0xEE);
    rows[e] = _mm512_shuffle_i32x4(x, z, 0x88);
    rows[4 + e] = _mm512_shuffle_i32x4(x, z, 0xDD);
    rows[8 + e] = _mm512_shuffle_i32x4(y, w, 0x88);
    rows[12 + e] = _mm512_shuffle_i32x4(y, w, 0xDD);
  }
}

// Keys -> [D/2, KEY_BLOCK, 2]: B of S = Q K^T in VNNI order, column j being key j (zero past
// n). `group(j)`: where keys j .. j + 15 start (j a multiple of 16, below n), their rows `ld`
// apart. Each 32-bit word is one key's pair of dims: 16 keys' 32 dims are transposed at once.
template <typename GroupStart>
void pack_keys(const GroupStart& group, int64_t ld, int64_t n, int64_t D, bf16* out) {
  int* packed = reinterpret_cast<int*>(out);
  for (int64_t j = 0; j < KEY_BLOCK; j += 16) {
    const int64_t present = std::clamp<int64_t>(n - j, 0, 16);
    const bf16* first = present > 0 ? group(j) : nullptr;
    for (int64_t d = 0; d < D; d += 32) {  // pairs d / 2 .. d / 2 + 15
      __m512i rows[16];
      for (int64_t k = 0; k < 16; ++k)
        rows[k] = k < present ? _mm512_loadu_si512(first + k * ld + d) : _mm512_setzero_si512();
      transpose_words(rows);
      for (int64_t p = 0; p < 16; ++p)
        _mm512_storeu_si512(packed + (d / 2 + p) * KEY_BLOCK + j, rows[p]);
    }
  }
}

// Values -> [KEY_BLOCK/2, D, 2]: B of O += P V in VNNI order, rows 2i and 2i + 1 interleaved
// (zero rows past n); `group` and `ld` as for pack_keys.
template <typename GroupStart>
void pack_values(const GroupStart& group, int64_t ld, int64_t n, int64_t D, bf16* out) {
  const auto row_start = [&](int64_t r) -> const bf16* {  // row r, or none past the end
    return r < n ? group(r - r % 16) + r % 16 * ld : nullptr;
  };
  const auto row = [&](const bf16* start, int64_t d) {  // 16 values, each in a 32-bit lane
    if (start == nullptr) return _mm512_setzero_si512();
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(start + d)));
  };
  for (int64_t pair = 0; pair < KEY_BLOCK / 2; ++pair) {
    int* packed = reinterpret_cast<int*>(out + pair * D * 2);
    const bf16 *even = row_start(2 * pair), *odd = row_start(2 * pair + 1);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i low = row(even, d), high = row(odd, d);
      _mm512_storeu_si512(packed + d, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
    }
  }
}

// out[4, 16 * COLS] = a[4, P] . b[P, 16 * COLS] (plus out's own values if ACCUMULATE) on
// AVX-512 BF16, the sums held in registers: each 32-bit word of a and b is a pair of bf16 along
// P's dimension; a row's word is broadcast and multiplied into 16 columns' pairs of b at once.
// Strides are in words (a, b) and floats (out).
template <int COLS, bool ACCUMULATE>
void vector_block(const int32_t* a, int64_t lda, const int32_t* b, int64_t ldb, int64_t P,
                  float* out, int64_t ldo) {
  constexpr int ROWS = 4;
  __m512 sums[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c)
      sums[r][c] = ACCUMULATE ? _mm512_loadu_ps(out + r * ldo + 16 * c) : _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh columns[COLS];
    for (int c = 0; c < COLS; ++c)
      columns[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * ldb + 16 * c));
    for (int r = 0; r < ROWS; ++r) {
      const auto pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(a[r * lda + p]));
      for (int c = 0; c < COLS; ++c) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], pair, columns[c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) _mm512_storeu_ps(out + r * ldo + 16 * c, sums[r][c]);
}

// out[4, N] (+)= a[4, P] . b[P, N] in blocks of 64 columns (N a multiple of 32).
template <bool ACCUMULATE>
void vector_rows(const int32_t* a, int64_t lda, const int32_t* b, int64_t ldb, int64_t P,
                 float* out, int64_t ldo, int64_t N) {
  int64_t j = 0;
  for (; j + 64 <= N; j += 64) vector_block<4, ACCUMULATE>(a, lda, b + j, ldb, P, out + j, ldo);
  if (j < N) vector_block<2, ACCUMULATE>(a, lda, b + j, ldb, P, out + j, ldo);
}

// The two products of a key block on AVX-512 BF16. `widths[i]`: how many of the block's keys
// (a multiple of 32) rows 4i .. 4i + 3 see; the products skip the rest.
struct VectorProducts {
  static void start() {}
  static void finish() {}
  // scores[M, KEY_BLOCK] = queries[M, D] . packed keys ([D/2, KEY_BLOCK] pairs)
  static void scores(const bf16* queries, const bf16* keys, float* scores, int64_t M, int64_t D,
                     const int64_t* widths) {
    const auto* rows = reinterpret_cast<const int32_t*>(queries);
    for (int64_t i = 0; i < M; i += 4)
      vector_rows<false>(rows + i * D / 2, D / 2, reinterpret_cast<const int32_t*>(keys),
                         KEY_BLOCK, D / 2, scores + i * KEY_BLOCK, KEY_BLOCK, widths[i / 4]);
  }
  // out[M, D] += probabilities[M, :width] . packed values ([KEY_BLOCK/2, D] pairs)
  static void accumulate(const bf16* probabilities, const bf16* values, float* out, int64_t M,
                         int64_t D, const int64_t* widths) {
    const auto* rows = reinterpret_cast<const int32_t*>(probabilities);
    for (int64_t i = 0; i < M; i += 4)
      vector_rows<true>(rows + i * KEY_BLOCK / 2, KEY_BLOCK / 2,
                        reinterpret_cast<const int32_t*>(values), D, widths[i / 4] / 2,
                        out + i * D, D, D);
  }
};

// The keys of a block that any of rows i .. i + 31 sees (i a multiple of 32; `widths` as
// VectorProducts takes them): what a tile product of those 32 rows reads.
int64_t widest_of_32(const int64_t* widths, int64_t i) {
  return *std::max_element(widths + i / 4, widths + i / 4 + 8);
}

#ifdef NANOSERVE_AMX

// scores[M, KEY_BLOCK] = queries[M, D] . packed keys; in 32 x 32 blocks of four tiles.
void tile_scores(const bf16* queries, const bf16* keys, float* scores, int64_t M, int64_t D,
                 const int64_t* widths) {
  constexpr int64_t S_ROW = KEY_BLOCK * 4, K_ROW = KEY_BLOCK * 4;  // bytes from row to row
  for (int64_t i = 0; i < M; i += 32) {
    for (int64_t j = 0, width = widest_of_32(widths, i); j < width; j += 32) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t d = 0; d < D; d += 32) {
        _tile_loadd(4, queries + i * D + d, D * 2);
        _tile_loadd(5, queries + (i + 16) * D + d, D * 2);
        _tile_loadd(6, keys + d * KEY_BLOCK + j * 2, K_ROW);
        _tile_loadd(7, keys + d * KEY_BLOCK + (j + 16) * 2, K_ROW);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, scores + i * KEY_BLOCK + j, S_ROW);
      _tile_stored(1, scores + i * KEY_BLOCK + j + 16, S_ROW);
      _tile_stored(2, scores + (i + 16) * KEY_BLOCK + j, S_ROW);
      _tile_stored(3, scores + (i + 16) * KEY_BLOCK + j + 16, S_ROW);
    }
  }
}

// out[M, D] += probabilities[M, :width] . packed values.
void tile_accumulate(const bf16* probabilities, const bf16* values, float* out, int64_t M,
                     int64_t D, const int64_t* widths) {
  for (int64_t i = 0; i < M; i += 32) {
    const int64_t keys = widest_of_32(widths, i);
    for (int64_t d = 0; d < D; d += 32) {
      float* corner = out + i * D + d;
      _tile_loadd(0, corner, D * 4); _tile_loadd(1, corner + 16, D * 4);
      _tile_loadd(2, corner + 16 * D, D * 4); _tile_loadd(3, corner + 16 * D + 16, D * 4);
      for (int64_t k = 0; k < keys; k += 32) {
        _tile_loadd(4, probabilities + i * KEY_BLOCK + k, KEY_BLOCK * 2);
        _tile_loadd(5, probabilities + (i + 16) * KEY_BLOCK + k, KEY_BLOCK * 2);
        _tile_loadd(6, values + k * D + d * 2, D * 4);
        _tile_loadd(7, values + k * D + (d + 16) * 2, D * 4);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, corner, D * 4); _tile_stored(1, corner + 16, D * 4);
      _tile_stored(2, corner + 16 * D, D * 4); _tile_stored(3, corner + 16 * D + 16, D * 4);
    }
  }
}

// The two products of a key block on AMX's tiles (each thread configures its tile unit first).
struct TileProducts {
  static void start() { amx::TileConfig().load(); }  // 8 tiles of 16 rows: 4 sums, 2 A, 2 B
  static void finish() { _tile_release(); }
  static constexpr auto scores = tile_scores;
  static constexpr auto accumulate = tile_accumulate;
};

#endif  // NANOSERVE_AMX

// One row of a key block: its first `visible` scores count, the rest are masked. Moves the
// row's running maximum if this block passes it by more than the headroom (rescaling the row's
// output and sum), then writes exp2(score * scale_log2 - maximum) as bf16 for `width` keys
// (zeros where masked) and adds the visible ones to the row's sum.
void softmax_row(const float* scores, int64_t visible, int64_t width, float scale_log2,
                 float& row_max, float& row_sum, float* out, int64_t D, bf16* probabilities) {
  __m512 block_max = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= visible; j += 16) block_max = _mm512_max_ps(block_max, _mm512_loadu_ps(scores + j));
  if (j < visible) {
    const __mmask16 tail = (1u << (visible - j)) - 1;
    block_max = _mm512_mask_max_ps(block_max, tail, block_max, _mm512_loadu_ps(scores + j));
  }
  const float maximum = _mm512_reduce_max_ps(block_max) * scale_log2;
  if (maximum > row_max + RESCALE_HEADROOM) {  // the first block always: row_max starts at -inf
    const float shrink = std::exp2(row_max - maximum);
    row_max = maximum, row_sum *= shrink;
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_set1_ps(shrink), _mm512_loadu_ps(out + d)));
  }
  const __m512 scale = _mm512_set1_ps(scale_log2), shift = _mm512_set1_ps(row_max);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < width; j += 16) {
    auto* at = reinterpret_cast<__m256i*>(probabilities + j);
    const int64_t left = visible - j;
    if (left <= 0) {  // masked to the end of the block
      _mm256_storeu_si256(at, _mm256_setzero_si256());
      continue;
    }
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(scores + j), scale, shift);
    __m512 p = exp2_16(x);
    if (left < 16) p = _mm512_maskz_mov_ps((1u << left) - 1, p);  // the masked keys' zeros
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(at, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  }
  row_sum += _mm512_reduce_add_ps(sum);
}

// Asks for `count` bf16 from `at` in L2: the packed key or value block read next, so that its
// first pass need not wait on L3 line by line.
void prefetch_to_l2(const bf16* at, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(at);
  for (int64_t offset = 0; offset < count * 2; offset += 64)
    _mm_prefetch(bytes + offset, _MM_HINT_T1);
}

// The chunk's shapes and data, as the tasks read them. Its keys and values are either packed
// before the tasks start (`keys_packed`, `values_packed`: [Hkv, key_blocks, KEY_BLOCK * D]) or
// read where they lie in a paged cache ([num_blocks, block_size, Hkv, D], block_size a multiple
// of 16; `table`: the cache blocks of its context), each task packing the blocks it reads.
struct Chunk {
  const bf16* queries;  // [Q, H, D], tokens query_stride apart
  bf16* out;            // [Q, H, D], contiguous
  int64_t Q, K, H, Hkv, D, query_stride;
  int64_t rows;  // rows per query head in a task: task_rows(Q, H / Hkv)
  float scale_log2;
  const bf16 *keys_packed = nullptr, *values_packed = nullptr;
  int64_t key_blocks = 0;
  const bf16 *k_cache = nullptr, *v_cache = nullptr;
  const int64_t* table = nullptr;
  int64_t block_size = 0;
};

// Each head's rows in a task of a Q-token chunk whose KV heads are shared by `group` query heads:
// a whole query block, or Q rounded up to 16 (to 32 where the group is odd: the products take
// rows 32 at a time). A chunk of a few tokens then computes few rows of padding.
int64_t task_rows(int64_t Q, int64_t group) {
  const int64_t rows = group % 2 == 0 ? (Q + 15) / 16 * 16 : (Q + 31) / 32 * 32;
  return std::min(QUERY_BLOCK, rows);
}

// The packed keys and values of key block `kb` for KV head `kv_head`: the chunk's own (the next
// block's asked for in L2), or packed now from the paged cache into the task's scratch.
std::pair<const bf16*, const bf16*> key_block(const Chunk& c, int64_t kv_head, int64_t kb,
                                              bool more, TaskScratch& w) {
  const int64_t D = c.D;
  if (c.table == nullptr) {
    const bf16* keys = c.keys_packed + (kv_head * c.key_blocks + kb) * KEY_BLOCK * D;
    const bf16* values = c.values_packed + (keys - c.keys_packed);
    if (more) {  // the next block's keys and values on their way to L2
      prefetch_to_l2(keys + KEY_BLOCK * D, KEY_BLOCK * D);
      prefetch_to_l2(values + KEY_BLOCK * D, KEY_BLOCK * D);
    }
    return {keys, values};
  }
  const int64_t key0 = kb * KEY_BLOCK, n = std::min(KEY_BLOCK, c.K - key0), slot = c.Hkv * D;
  const int64_t bs = c.block_size, head = kv_head * D;
  const auto in = [&](const bf16* cache) {  // where keys key0 + j .. + 15 lie in `cache`
    return [&, cache](int64_t j) {
      const int64_t key = key0 + j;
      return cache + (c.table[key / bs] * bs + key % bs) * slot + head;
    };
  };
  pack_keys(in(c.k_cache), slot, n, D, w.keys.data);
  pack_values(in(c.v_cache), slot, n, D, w.values.data);
  return {w.keys.data, w.values.data};
}

// One task: query block `block` of every query head in KV head `kv_head`'s group.
template <typename Products>
void attend_block(const Chunk& c, int64_t kv_head, int64_t block, TaskScratch& w) {
  const int64_t group = c.H / c.Hkv, R = c.rows, M = group * R, D = c.D;
  const int64_t first = block * QUERY_BLOCK, count = std::min(QUERY_BLOCK, c.Q - first);
  for (int64_t g = 0; g < group; ++g) {  // rows g * R + i: head g's query first + i
    bf16* rows = w.queries.data + g * R * D;
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(rows + i * D, c.queries + (first + i) * c.query_stride + (kv_head * group + g) * D,
                  D * sizeof(bf16));
    std::memset(rows + count * D, 0, (R - count) * D * sizeof(bf16));
  }
  std::fill(w.row_max.data, w.row_max.data + M, -INFINITY);
  std::fill(w.row_sum.data, w.row_sum.data + M, 0.f);
  std::fill(w.out.data, w.out.data + M * D, 0.f);
  const int64_t offset = c.K - c.Q;  // keys before the chunk's first query
  const int64_t last_key = offset + first + count - 1;
  for (int64_t g = 0; g < group; ++g)  // the keys each row sees (0: a padding row)
    for (int64_t i = 0; i < R; ++i) w.ends.data[g * R + i] = i < count ? offset + first + i + 1 : 0;
  for (int64_t kb = 0; kb <= last_key / KEY_BLOCK; ++kb) {
    const int64_t key0 = kb * KEY_BLOCK, keys = std::min(KEY_BLOCK, c.K - key0);
    const auto seen = [&](int64_t r) {  // how many of the block's keys row r sees
      return std::clamp<int64_t>(w.ends.data[r] - key0, 0, keys);
    };
    for (int64_t i = 0; i < M; i += 4) {  // the last real row of 4 (one head's) sees the most
      const int64_t most = std::max({seen(i), seen(i + 1), seen(i + 2), seen(i + 3)});
      w.widths.data[i / 4] = std::max<int64_t>(0, (most + 31) / 32 * 32);
    }
    const auto [key_rows, value_rows] = key_block(c, kv_head, kb, kb < last_key / KEY_BLOCK, w);
    Products::scores(w.queries.data, key_rows, w.scores.data, M, D, w.widths.data);
    for (int64_t i = 0; i < M; i += 32) {  // probabilities as far as a tile of 32 rows reads
      const int64_t span = widest_of_32(w.widths.data, i);
      for (int64_t r = i; r < i + 32; ++r)
        softmax_row(w.scores.data + r * KEY_BLOCK, seen(r), span, c.scale_log2, w.row_max.data[r],
                    w.row_sum.data[r], w.out.data + r * D, D, w.probabilities.data + r * KEY_BLOCK);
    }
    Products::accumulate(w.probabilities.data, value_rows, w.out.data, M, D, w.widths.data);
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t r = g * R + i;
      const __m512 inverse = _mm512_set1_ps(1.f / w.row_sum.data[r]);
      bf16* to = c.out + ((first + i) * c.H + kv_head * group + g) * D;
      for (int64_t d = 0; d < D; d += 16)
        store16(to + d, _mm512_mul_ps(inverse, _mm512_loadu_ps(w.out.data + r * D + d)));
    }
  }
}

// One task of attend_all: query block `block` of chunk `chunk` for KV head `kv_head`.
struct Task {
  int64_t chunk, kv_head, block, work;  // work: (query, key) pairs the block's queries see
};

// Every task of the chunks, largest first, to whichever thread is free.
template <typename Products>
void attend_all(const std::vector<Chunk>& chunks) {
  std::vector<Task> tasks;
  int64_t most_rows = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(chunks.size()); ++i) {
    const Chunk& c = chunks[i];
    most_rows = std::max(most_rows, c.H / c.Hkv * c.rows);
    for (int64_t block = 0; block * QUERY_BLOCK < c.Q; ++block) {
      const int64_t count = std::min(QUERY_BLOCK, c.Q - block * QUERY_BLOCK);
      const int64_t work = count * (c.K - c.Q + block * QUERY_BLOCK + count);
      for (int64_t kv_head = 0; kv_head < c.Hkv; ++kv_head)
        tasks.push_back({i, kv_head, block, work});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.work > b.work; });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size()), D = chunks.front().D;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1,
                   [&](int64_t, int64_t) {
    thread_local TaskScratch scratch;
    scratch.reserve(most_rows, D);
    Products::start();
    for (int64_t t; (t = next_task.fetch_add(1)) < num_tasks;) {
      const Task& task = tasks[t];
      attend_block<Products>(chunks[task.chunk], task.kv_head, task.block, scratch);
    }
    Products::finish();
  });
}

// attend_all on AMX's tiles where allowed and usable, else on AVX-512 BF16's dot products.
void attend_all_on(const std::vector<Chunk>& chunks, bool allow_tiles) {
#ifdef NANOSERVE_AMX
  if (allow_tiles && amx::tiles_permitted()) return attend_all<TileProducts>(chunks);
#endif
  attend_all<VectorProducts>(chunks);
}

// Each KV head's keys and values in key blocks of VNNI pairs: [Hkv, key_blocks, KEY_BLOCK * D].
std::pair<at::Tensor, at::Tensor> pack_context(const at::Tensor& key, const at::Tensor& value) {
  const int64_t K = key.size(0), Hkv = key.size(1), D = key.size(2);
  const int64_t key_blocks = (K + KEY_BLOCK - 1) / KEY_BLOCK;
  at::Tensor keys_packed = at::empty({Hkv, key_blocks, KEY_BLOCK * D}, key.options());
  at::Tensor values_packed = at::empty({Hkv, key_blocks, KEY_BLOCK * D}, value.options());
  at::parallel_for(0, Hkv * key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t head = t / key_blocks, key0 = t % key_blocks * KEY_BLOCK;
      const int64_t n = std::min(KEY_BLOCK, K - key0);
      const bf16* keys = key.data_ptr<bf16>() + key0 * key.stride(0) + head * D;
      const bf16* values = value.data_ptr<bf16>() + key0 * value.stride(0) + head * D;
      pack_keys([&](int64_t j) { return keys + j * key.stride(0); }, key.stride(0), n, D,
                keys_packed.data_ptr<bf16>() + t * KEY_BLOCK * D);
      pack_values([&](int64_t j) { return values + j * value.stride(0); }, value.stride(0), n, D,
                  values_packed.data_ptr<bf16>() + t * KEY_BLOCK * D);
    }
  });
  return {keys_packed, values_packed};
}

#endif  // NANOSERVE_PROMPT_KERNEL

}  // namespace

bool prompt_attention_is_available() {
#ifdef NANOSERVE_PROMPT_KERNEL
  return true;
#else
  return false;
#endif
}

bool prompt_attention_uses_tiles() {
#ifdef NANOSERVE_AMX
  return amx::tiles_permitted();
#else
  return false;
#endif
}

at::Tensor prompt_attention(at::Tensor query, at::Tensor key, at::Tensor value, double scale,
                            bool allow_tiles) {
  TORCH_CHECK(prompt_attention_is_available(), "prompt_attention needs AVX-512 BF16 or AMX");
#ifdef NANOSERVE_PROMPT_KERNEL
  const int64_t Q = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t K = key.size(0), Hkv = key.size(1);
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16, "bf16 queries, keys and values only");
  TORCH_CHECK(D % 32 == 0 && H % Hkv == 0 && K >= Q && value.size(0) == K, "unsupported shapes");
  for (const at::Tensor& t : {query, key, value})
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == D && t.stride(0) % 2 == 0,
                "each token's heads must be contiguous");
  at::Tensor out = at::empty({Q, H, D}, query.options());
  const auto [keys_packed, values_packed] = pack_context(key, value);
  Chunk chunk{query.data_ptr<bf16>(), out.data_ptr<bf16>(), Q, K, H, Hkv, D, query.stride(0),
              task_rows(Q, H / Hkv), static_cast<float>(scale * M_LOG2E)};
  chunk.keys_packed = keys_packed.data_ptr<bf16>();
  chunk.values_packed = values_packed.data_ptr<bf16>();
  chunk.key_blocks = keys_packed.size(1);
  attend_all_on({chunk}, allow_tiles);
  return out;
#else
  return at::Tensor();
#endif
}

bool paged_chunk_attention_takes(const at::Tensor& query, const at::Tensor& k_cache) {
#ifdef NANOSERVE_PROMPT_KERNEL
  return query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
         query.size(2) % 32 == 0 && k_cache.size(1) % 16 == 0;
#else
  return false;
#endif
}

void paged_chunk_attention(const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const std::vector<TokenRun>& runs,
                           double scale, at::Tensor& out) {
  TORCH_CHECK(paged_chunk_attention_takes(query, k_cache), "bf16, head dims of 32k, blocks of 16k");
#ifdef NANOSERVE_PROMPT_KERNEL
  const int64_t H = query.size(1), D = query.size(2), Hkv = k_cache.size(2);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  std::vector<Chunk> chunks;
  for (const TokenRun& run : runs) {  // (the caller checked each context against its table)
    const int64_t last = run.first + run.count - 1, rows = run.first * H * D;
    Chunk c{query.data_ptr<bf16>() + rows, out.data_ptr<bf16>() + rows, run.count, lens[last],
            H, Hkv, D, H * D, task_rows(run.count, H / Hkv), static_cast<float>(scale * M_LOG2E)};
    c.k_cache = k_cache.data_ptr<bf16>(), c.v_cache = v_cache.data_ptr<bf16>();
    c.table = tables + last * block_tables.size(1), c.block_size = k_cache.size(1);
    chunks.push_back(c);
  }
  if (!chunks.empty()) attend_all_on(chunks, true);
#endif
}
