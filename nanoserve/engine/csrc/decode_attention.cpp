// Attention of one new token per request over its context in the paged KV cache, on CPU.
//
//   out[b, h] = sum_j softmax_j(scale * q[b, h] . k[b, j]) v[b, j]    j < seq_lens[b]
//
// Keys and values are read where they lie in the cache (block_tables[b, j / block_size],
// offset j % block_size), so nothing is gathered or padded first; everything is computed in
// float32. One task per (request, KV head) computes the query heads that share that KV head
// (grouped-query attention): each key and value row is read once for all of them. Tasks are
// split across torch's intra-op threads. Caller: attention/cpu_kernel.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

// How many keys ahead a task asks for the next K/V rows: one task's rows lie a whole slot
// (all KV heads) apart, too far apart for the hardware prefetcher to follow.
constexpr int64_t AHEAD = 8;

template <typename T>
static void prefetch_row(const T* row, int64_t D) {
#if defined(__x86_64__)
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < D * static_cast<int64_t>(sizeof(T)); at += 64)
    _mm_prefetch(bytes + at, _MM_HINT_T0);
#endif
}

// q . k over D values, q in float32.
template <typename T>
static float dot(const float* q, const T* k, int64_t D) {
  int64_t d = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; d < D; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

// out += p * v over D values, out in float32.
template <typename T>
static void add_scaled(float p, const T* v, float* out, int64_t D) {
  int64_t d = 0;
#ifdef __AVX512F__
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(out + d)));
#endif
  for (; d < D; ++d) out[d] += p * static_cast<float>(v[d]);
}

// scores [G, L] -> exp(scores - row max) in place; returns nothing, fills sums [G].
static void softmax_numerators(float* scores, int64_t G, int64_t L, float* sums) {
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * L;
    const float top = *std::max_element(row, row + L);
    float sum = 0.f;
    for (int64_t j = 0; j < L; ++j) sum += (row[j] = std::exp(row[j] - top));
    sums[g] = sum;
  }
}

// Where the cache's row for (block table row, key position j, KV head) starts.
struct CacheRows {
  const int64_t* table;  // this request's block-table row
  int64_t block_size, num_kv_heads, head_dim, kv_head;
  int64_t operator()(int64_t j) const {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    return (slot * num_kv_heads + kv_head) * head_dim;
  }
};

template <typename T>
static void attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* k = k_cache.data_ptr<T>();
  const T* v = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, sums(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, L = lens[b];
      const CacheRows row{tables + b * max_blocks, block_size, Hkv, D, task % Hkv};
      const int64_t first = (b * H + row.kv_head * G) * D;  // this group's query heads
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[first + i]) * scale;
      scores.resize(G * L);
      for (int64_t j = 0; j < L; ++j) {
        if (j + AHEAD < L) prefetch_row(k + row(j + AHEAD), D);
        for (int64_t g = 0; g < G; ++g) scores[g * L + j] = dot(&qf[g * D], k + row(j), D);
      }
      softmax_numerators(scores.data(), G, L, sums.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < L; ++j) {
        if (j + AHEAD < L) prefetch_row(v + row(j + AHEAD), D);
        for (int64_t g = 0; g < G; ++g) add_scaled(scores[g * L + j], v + row(j), &acc[g * D], D);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[first + g * D + d] = static_cast<T>(acc[g * D + d] / sums[g]);
    }
  });
}

// query [B, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] and
// seq_lens [B] int64 -> [B, H, D] in query's dtype (bf16 or float32).
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
              k_cache.scalar_type() == v_cache.scalar_type(), "one dtype for q, k and v");
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
  if (q.scalar_type() == at::kBFloat16) {
    attend<at::BFloat16>(q, k_cache, v_cache, tables, lens, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "bf16 or float32 only");
    attend<float>(q, k_cache, v_cache, tables, lens, scale, out);
  }
  return out;
}
