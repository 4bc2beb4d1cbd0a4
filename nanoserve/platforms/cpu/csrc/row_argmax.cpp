// Each row's argmax over a [B, V] float32 tensor: what a greedy sampler and the Gumbel trick of a
// random one ask of the logits every step, in one vectorised pass. PyTorch's max(dim) with its
// indices compares one value at a time on CPU, several times slower than its own amax.
//
// The answer is PyTorch's: the first index of the largest value, and a NaN above every number
// (the first NaN, if any). Each vector lane keeps its best value and the index it came from,
// replacing them only with a strictly larger value or a first NaN, so each lane keeps its first
// occurrence; the lanes are then reduced with the same order (ties: the smaller index).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

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

}  // namespace

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

bool row_argmax_is_vectorized() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}
