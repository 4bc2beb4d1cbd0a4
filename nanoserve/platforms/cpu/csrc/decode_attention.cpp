// Attention of one new token per request over its context in the paged KV cache, on CPU.
//
//   out[b, h] = sum_j softmax_j(scale * q[b, h] . k[b, j]) v[b, j]    j < seq_lens[b]
//
// Keys and values are read where they lie in the cache (block_tables[b, j / block_size],
// offset j % block_size), so nothing is gathered or padded first; everything is computed in
// float32. One task per (request, KV head) computes the query heads that share that KV head
// (grouped-query attention): each key and value row is read once for all of them. Tasks are
// dealt to torch's intra-op threads in turn (thread t of T takes tasks t, t + T, ...), not in
// runs: a prompt chunk attended token by token (attention.py) has contexts that grow along its
// tokens, and a run of the last tokens' tasks would leave one thread most of the work. An FP8
// cache is widened to float32 as it is read (simd.h). Caller: platforms/cpu/attention.py.
//
// A step's tokens need not be one per request: a verify step's drafts and a short prompt chunk
// are one request's tokens in a row, each seeing one key more than the last. Attended alone,
// each would read the whole context again; in bf16 such runs (long enough to pay for packing
// their keys) attend as the chunk they are, through prompt_attention.cpp's tiles, reading the
// context once. Every other token attends alone, as above.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

// How many keys ahead a task asks for the next K/V rows: one task's rows lie a whole slot
// (all KV heads) apart, too far apart for the hardware prefetcher to follow.
constexpr int64_t AHEAD = 8;
// Keys taken together, and query heads (of one KV head's group) taken together: each key's
// values are widened to float32 once for HEADS heads, and the HEADS * KEYS sums are
// independent, so their FMAs overlap (one dot's D / 16 FMAs, D / 8 on AVX2, each wait on the
// previous one).
constexpr int KEYS = 4;
constexpr int HEADS = 2;
// The fewest tokens of one request in a row that attend as a chunk (on bf16 tiles) rather than
// one by one; or two, where they see at least MIN_PAIR_KEYS keys (below these, packing the
// chunk's keys costs more than it saves).
constexpr int64_t MIN_RUN = 3;
constexpr int64_t MIN_PAIR_KEYS = 512;

template <typename T>
static void prefetch_row(const T* row, int64_t D) {
#if defined(__x86_64__)
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < D * static_cast<int64_t>(sizeof(T)); at += 64)
    _mm_prefetch(bytes + at, _MM_HINT_T0);
#endif
}

// scores[h * L + r] = q[h] . keys[r] for NH query heads (float32, rows D apart) and NK keys.
template <int NH, int NK, typename T>
static void score_keys(const float* q, const T* const (&keys)[NK], int64_t D, float* scores,
                       int64_t L) {
  float sums[NH][NK] = {};
  int64_t d = 0;
#ifdef __AVX512F__
  __m512 acc[NH][NK];
  for (int h = 0; h < NH; ++h)
    for (int r = 0; r < NK; ++r) acc[h][r] = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    for (int r = 0; r < NK; ++r) {
      const __m512 kv = load16(keys[r] + d);
      for (int h = 0; h < NH; ++h)
        acc[h][r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + d), kv, acc[h][r]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int r = 0; r < NK; ++r) sums[h][r] = _mm512_reduce_add_ps(acc[h][r]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 acc[NH][NK];  // NH * NK <= 8 of AVX2's 16 registers
  for (int h = 0; h < NH; ++h)
    for (int r = 0; r < NK; ++r) acc[h][r] = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) {
    for (int r = 0; r < NK; ++r) {
      const __m256 kv = load8(keys[r] + d);
      for (int h = 0; h < NH; ++h)
        acc[h][r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), kv, acc[h][r]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int r = 0; r < NK; ++r) sums[h][r] = add_lanes8(acc[h][r]);
#endif
  for (; d < D; ++d)
    for (int h = 0; h < NH; ++h)
      for (int r = 0; r < NK; ++r) sums[h][r] += q[h * D + d] * static_cast<float>(keys[r][d]);
  for (int h = 0; h < NH; ++h)
    for (int r = 0; r < NK; ++r) scores[h * L + r] = sums[h][r];
}

// out[h] += sum_r p[h * L + r] * values[r] for NH heads (out rows D apart) and NK value rows,
// keys in order (the sums match adding one key at a time).
template <int NH, int NK, typename T>
static void add_values(const float* p, int64_t L, const T* const (&values)[NK], float* out,
                       int64_t D) {
  int64_t d = 0;
#ifdef __AVX512F__
  for (; d + 16 <= D; d += 16) {
    __m512 acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = _mm512_loadu_ps(out + h * D + d);
    for (int r = 0; r < NK; ++r) {
      const __m512 vv = load16(values[r] + d);
      for (int h = 0; h < NH; ++h)
        acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * L + r]), vv, acc[h]);
    }
    for (int h = 0; h < NH; ++h) _mm512_storeu_ps(out + h * D + d, acc[h]);
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (; d + 8 <= D; d += 8) {
    __m256 acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = _mm256_loadu_ps(out + h * D + d);
    for (int r = 0; r < NK; ++r) {
      const __m256 vv = load8(values[r] + d);
      for (int h = 0; h < NH; ++h)
        acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[h * L + r]), vv, acc[h]);
    }
    for (int h = 0; h < NH; ++h) _mm256_storeu_ps(out + h * D + d, acc[h]);
  }
#endif
  for (; d < D; ++d)
    for (int h = 0; h < NH; ++h)
      for (int r = 0; r < NK; ++r)
        out[h * D + d] += p[h * L + r] * static_cast<float>(values[r][d]);
}

// Calls fn(j, rows) for the rows of keys j .. j + NK - 1, NK = KEYS while that many remain,
// then 1, asking for the rows AHEAD keys on first.
template <typename T, typename Rows, typename Fn>
static void for_key_blocks(const T* cache, const Rows& row, int64_t L, int64_t D, const Fn& fn) {
  int64_t j = 0;
  for (; j + KEYS <= L; j += KEYS) {
    const T* rows[KEYS];
    for (int r = 0; r < KEYS; ++r) {
      if (j + r + AHEAD < L) prefetch_row(cache + row(j + r + AHEAD), D);
      rows[r] = cache + row(j + r);
    }
    fn(j, rows);
  }
  for (; j < L; ++j) {
    const T* rows[1] = {cache + row(j)};
    fn(j, rows);
  }
}

// Calls fn(h, std::integral_constant<int, NH>) for the group's G heads, HEADS at a time.
template <typename Fn>
static void for_head_blocks(int64_t G, const Fn& fn) {
  int64_t h = 0;
  for (; h + HEADS <= G; h += HEADS) fn(h, std::integral_constant<int, HEADS>{});
  for (; h < G; ++h) fn(h, std::integral_constant<int, 1>{});
}

// scores [G, L] -> exp(scores - row max) in place; fills sums [G] with each row's total.
static void softmax_numerators(float* scores, int64_t G, int64_t L, float* sums) {
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * L;
    const float top = *std::max_element(row, row + L);
    float sum = 0.f;
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 shift = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (; j + 16 <= L; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
      _mm512_storeu_ps(row + j, e);
      total = _mm512_add_ps(total, e);
    }
    sum = _mm512_reduce_add_ps(total);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const __m256 shift = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    for (; j + 8 <= L; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
      _mm256_storeu_ps(row + j, e);
      total = _mm256_add_ps(total, e);
    }
    sum = add_lanes8(total);
#endif
    for (; j < L; ++j) sum += (row[j] = std::exp(row[j] - top));
    sums[g] = sum;
  }
}

// Where a task's key rows start in the cache (one request's block-table row, one KV head): for
// each key j < L, worked out once per task block by block, so that no key pays for a division
// (j / block_size costs about as much as a short row's dot product).
struct CacheRows {
  std::vector<int64_t> starts;
  void fill(const int64_t* table, int64_t L, int64_t block_size, int64_t num_kv_heads,
            int64_t head_dim, int64_t kv_head) {
    starts.resize(L);
    const int64_t slot_elems = num_kv_heads * head_dim, head_offset = kv_head * head_dim;
    for (int64_t j = 0, block = 0; j < L; ++block) {
      int64_t at = table[block] * block_size * slot_elems + head_offset;
      for (int64_t o = 0; o < block_size && j < L; ++o, ++j, at += slot_elems) starts[j] = at;
    }
  }
  int64_t operator()(int64_t j) const { return starts[j]; }
};

// The rows of out for `tokens` (indices into the step's tokens), each token attending alone.
// T: the query's and output's type; C: the cache's (T, or FP8 widened as it is read).
template <typename T, typename C>
static void attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const std::vector<int64_t>& tokens, double scale, at::Tensor& out) {
  const int64_t B = static_cast<int64_t>(tokens.size()), H = query.size(1), D = query.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const C* k = reinterpret_cast<const C*>(k_cache.data_ptr());
  const C* v = reinterpret_cast<const C*>(v_cache.data_ptr());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  const int64_t tasks = B * Hkv, threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, sums(G);
    CacheRows row;
    for (int64_t share = begin; share < end; ++share) {
      for (int64_t task = share; task < tasks; task += threads) {
        const int64_t b = tokens[task / Hkv], L = lens[b], kv_head = task % Hkv;
        row.fill(tables + b * max_blocks, L, block_size, Hkv, D, kv_head);
        const int64_t first = (b * H + kv_head * G) * D;  // this group's query heads
        for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[first + i]) * scale;
        scores.resize(G * L);
        for_key_blocks(k, row, L, D, [&](int64_t j, const auto& keys) {
          for_head_blocks(G, [&](int64_t h, auto heads) {
            score_keys<decltype(heads)::value>(&qf[h * D], keys, D, &scores[h * L + j], L);
          });
        });
        softmax_numerators(scores.data(), G, L, sums.data());
        std::fill(acc.begin(), acc.end(), 0.f);
        for_key_blocks(v, row, L, D, [&](int64_t j, const auto& values) {
          for_head_blocks(G, [&](int64_t h, auto heads) {
            add_values<decltype(heads)::value>(&scores[h * L + j], L, values, &acc[h * D], D);
          });
        });
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d)
            o[first + g * D + d] = static_cast<T>(acc[g * D + d] / sums[g]);
      }
    }
  });
}

// attend<T, C> for the cache's dtype C: the query's, or FP8.
template <typename T>
static void attend_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& tables, const at::Tensor& lens,
                         const std::vector<int64_t>& tokens, double scale, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return attend<T, at::Float8_e4m3fn>(q, k_cache, v_cache, tables, lens, tokens, scale, out);
    case at::kFloat8_e5m2:
      return attend<T, at::Float8_e5m2>(q, k_cache, v_cache, tables, lens, tokens, scale, out);
    default:
      TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "a cache in the query's dtype or FP8");
      return attend<T, T>(q, k_cache, v_cache, tables, lens, tokens, scale, out);
  }
}

// Whether token t continues token t - 1's run: one more key of context, in the same cache blocks.
static bool continues(const int64_t* tables, const int64_t* lens, int64_t max_blocks,
                      int64_t block_size, int64_t t) {
  if (lens[t] != lens[t - 1] + 1) return false;
  const int64_t blocks = (lens[t] + block_size - 1) / block_size;
  return std::equal(tables + t * max_blocks, tables + t * max_blocks + blocks,
                    tables + (t - 1) * max_blocks);
}

// The step's tokens split into runs (each one request's tokens in a row: a verify step's drafts,
// a short prompt chunk) long enough to attend as chunks, and the tokens left, which attend alone.
static std::pair<std::vector<TokenRun>, std::vector<int64_t>> split_runs(
    const at::Tensor& tables, const at::Tensor& lens, int64_t block_size) {
  const int64_t T = lens.numel(), max_blocks = tables.size(1);
  const int64_t *table = tables.data_ptr<int64_t>(), *len = lens.data_ptr<int64_t>();
  std::vector<TokenRun> runs;
  std::vector<int64_t> alone;
  for (int64_t first = 0, t; first < T; first = t) {
    for (t = first + 1; t < T && continues(table, len, max_blocks, block_size, t);) ++t;
    if (t - first >= MIN_RUN || (t - first == 2 && len[t - 1] >= MIN_PAIR_KEYS)) {
      runs.push_back({first, t - first});
    } else {
      for (int64_t i = first; i < t; ++i) alone.push_back(i);
    }
  }
  return {runs, alone};
}

// query [B, H, D]; caches [num_blocks, block_size, Hkv, D] in the query's dtype or FP8 (e4m3fn,
// e5m2: the values as stored; their scales are the caller's); block_tables [B, max_blocks] and
// seq_lens [B] int64 -> [B, H, D] in query's dtype (bf16 or float32).
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "one dtype for k and v");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.numel() == query.size(0));
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t capacity = tables.size(1) * k_cache.size(1);
  for (int64_t b = 0; b < lens.numel(); ++b) {
    const int64_t L = lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(L >= 1 && L <= capacity, "a context of ", L, " keys in ", capacity, " slots");
  }
  auto q = query.contiguous();
  auto out = at::empty_like(q);
  std::vector<TokenRun> runs;
  std::vector<int64_t> alone(q.size(0));
  std::iota(alone.begin(), alone.end(), 0);
  if (paged_chunk_attention_takes(q, k_cache))
    std::tie(runs, alone) = split_runs(tables, lens, k_cache.size(1));
  if (!runs.empty()) paged_chunk_attention(q, k_cache, v_cache, tables, lens, runs, scale, out);
  if (alone.empty()) return out;
  if (q.scalar_type() == at::kBFloat16) {
    attend_cache<at::BFloat16>(q, k_cache, v_cache, tables, lens, alone, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "bf16 or float32 only");
    attend_cache<float>(q, k_cache, v_cache, tables, lens, alone, scale, out);
  }
  return out;
}

// One token's keys (or values) as bytes: a [T, Hkv, D] tensor whose tokens may be strided (v is
// a slice of the fused qkv product) but whose heads and dims are contiguous within a token.
static const char* token_rows(const at::Tensor& x, int64_t row_bytes) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "[T, Hkv, D] rows");
  TORCH_CHECK(x.size(1) * x.size(2) * x.element_size() == row_bytes, "a cache row's size");
  return static_cast<const char*>(x.data_ptr());
}

// k, v [T, Hkv, D] written to their slots of the caches [num_blocks, block_size, Hkv, D], in
// one dtype (rows are copied as bytes, so FP8 too); slot_mapping [T] int64. What index_copy_
// does, without its per-call set-up (a decode step calls this once per layer).
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "two caches alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "keys and values in their cache's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0));
  TORCH_CHECK(v.size(0) == k.size(0), "as many values as keys");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k_cache.size(2) * k_cache.size(3) * k_cache.element_size();
  const char* k_rows = token_rows(k, row_bytes);
  const char* v_rows = token_rows(v, row_bytes);
  char* k_out = static_cast<char*>(k_cache.data_ptr());
  char* v_out = static_cast<char*>(v_cache.data_ptr());
  auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " of ", num_slots);
    std::memcpy(k_out + slot[t] * row_bytes, k_rows + t * k_step, row_bytes);
    std::memcpy(v_out + slot[t] * row_bytes, v_rows + t * v_step, row_bytes);
  }
}
