// The sampler's two passes over whole [B, V] float32 rows (nanoserve/platforms/cpu/sampler_ops.py),
// each one vectorised pass where PyTorch's CPU ops take one value at a time:
//
// row_argmax  each row's argmax, what a greedy sampler asks of the logits every step. PyTorch's
//             max(dim) with its indices compares one value at a time on CPU, several times
//             slower than its own amax. The answer is PyTorch's: the first index of the
//             largest value, and a NaN above every number (the first NaN, if any). Each vector
//             lane keeps its best value and the index it came from, replacing them only with a
//             strictly larger value or a first NaN, so each lane keeps its first occurrence;
//             the lanes are then reduced with the same order (ties: the smaller index).
// draw_rows   a random row's token by inverse transform: the first token whose running sum of
//             probabilities passes u times the row's sum (u in [0, 1), one per row), summed in
//             float64. The row's blocks of BLOCK values are summed first (vector lanes in
//             float64), the block that u falls in is found from their sums, and only its
//             values are added one by one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

// Rows' values per thread below which a call stays on the calling thread.
constexpr int64_t GRAIN_VALUES = 1 << 16;

// Is (value, index) before (best, best_index) in argmax's order?
inline bool is_better(float value, int64_t index, float best, int64_t best_index) {
  if (std::isnan(value)) return !std::isnan(best) || index < best_index;
  if (std::isnan(best)) return false;
  return value > best || (value == best && index < best_index);
}

// The argmax of values [from, to) of one row, starting from (best, best_index).
inline void scan_scalar(const float* x, int64_t from, int64_t to, float& best,
                        int64_t& best_index) {
  for (int64_t v = from; v < to; ++v) {
    if (is_better(x[v], v, best, best_index)) best = x[v], best_index = v;
  }
}

#ifdef __AVX512F__
// 16 lanes, each lane v % 16's best value and index; the row's tail loaded masked as -inf.
int64_t row_argmax_16(const float* x, int64_t V) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_index = _mm512_set1_epi32(0);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 in_row = V - v >= 16 ? 0xffff : (1u << (V - v)) - 1;
    const __m512 value = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in_row, x + v);
    // value > best, or value is NaN where best is not (a NaN best stays: it came first)
    const __mmask16 larger = _mm512_cmp_ps_mask(value, best, _CMP_GT_OQ) |
                             (_mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q) &
                              _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
    best = _mm512_mask_mov_ps(best, larger, value);
    best_index = _mm512_mask_mov_epi32(best_index, larger, index);
    index = _mm512_add_epi32(index, step);
  }
  alignas(64) float values[16];
  alignas(64) int32_t indices[16];
  _mm512_store_ps(values, best);
  _mm512_store_si512(indices, best_index);
  float row_best = values[0];
  int64_t row_index = indices[0];
  for (int lane = 1; lane < 16; ++lane) {
    if (is_better(values[lane], indices[lane], row_best, row_index)) {
      row_best = values[lane], row_index = indices[lane];
    }
  }
  return row_index;
}
#endif

int64_t argmax_of_row(const float* x, int64_t V) {
#ifdef __AVX512F__
  if (V < (int64_t{1} << 31)) return row_argmax_16(x, V);
#endif
  float best = x[0];
  int64_t best_index = 0;
  scan_scalar(x, 1, V, best, best_index);
  return best_index;
}

// draw_rows' blocks: a row's values are summed a block at a time, then one block one by one.
constexpr int64_t BLOCK = 256;

// The float64 sum of p[0 .. n).
double block_sum(const float* p, int64_t n) {
  int64_t v = 0;
  double sum = 0.0;
#ifdef __AVX512F__
  __m512d lanes = _mm512_setzero_pd();
  for (; v + 8 <= n; v += 8) lanes = _mm512_add_pd(lanes, _mm512_cvtps_pd(_mm256_loadu_ps(p + v)));
  sum = _mm512_reduce_add_pd(lanes);
#endif
  for (; v < n; ++v) sum += p[v];
  return sum;
}

// The first token of row p whose running sum passes u times the row's sum; never one of
// probability 0. `sums`: room for the block sums.
int64_t draw_from_row(const float* p, int64_t V, double u, std::vector<double>& sums) {
  const int64_t num_blocks = (V + BLOCK - 1) / BLOCK;
  sums.resize(num_blocks);
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    sums[b] = block_sum(p + b * BLOCK, std::min(BLOCK, V - b * BLOCK));
    total += sums[b];
  }
  const double target = u * total;
  double before = 0.0;  // the sum of the blocks before block b
  int64_t b = 0;
  while (b + 1 < num_blocks && !(before + sums[b] > target)) before += sums[b++];
  const int64_t first = b * BLOCK, end = std::min(V, first + BLOCK);
  int64_t last_positive = first;
  for (int64_t v = first; v < end; ++v) {
    if (!(p[v] > 0.f)) continue;
    before += p[v];
    last_positive = v;
    if (before > target) return v;
  }
  // Its values added one by one fell short of the block's sum (added in another order) by a
  // rounding: the block's last token that can be drawn.
  return last_positive;
}

}  // namespace

at::Tensor draw_rows(at::Tensor probs, at::Tensor uniforms) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.size(1) > 0 &&
                  probs.stride(1) == 1,
              "draw_rows takes [B, V > 0] float32 probabilities, each row contiguous");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == probs.size(0) &&
                  uniforms.scalar_type() == at::kDouble,
              "draw_rows takes one float64 uniform per row");
  const int64_t B = probs.size(0), V = probs.size(1), row_stride = probs.stride(0);
  const at::Tensor u = uniforms.contiguous();
  at::Tensor out = at::empty({B}, probs.options().dtype(at::kLong));
  const float* base = probs.data_ptr<float>();
  const double* u_values = u.data_ptr<double>();
  int64_t* result = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, GRAIN_VALUES / V);
  at::parallel_for(0, B, grain, [&](int64_t first, int64_t last) {
    std::vector<double> sums;
    for (int64_t b = first; b < last; ++b) {
      result[b] = draw_from_row(base + b * row_stride, V, u_values[b], sums);
    }
  });
  return out;
}

at::Tensor row_argmax(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0 &&
                  x.stride(1) == 1,
              "row_argmax takes [B, V > 0] float32 rows, each contiguous");
  const int64_t B = x.size(0), V = x.size(1), row_stride = x.stride(0);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, GRAIN_VALUES / V);
  at::parallel_for(0, B, grain, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) result[b] = argmax_of_row(base + b * row_stride, V);
  });
  return out;
}

bool sampling_is_vectorized() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}
