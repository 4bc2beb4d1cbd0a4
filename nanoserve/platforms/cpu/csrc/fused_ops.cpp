// Elementwise steps of a decoder layer, each one pass over its rows instead of the 5-8 torch
// ops (and as many dispatches and temporaries) the plain PyTorch code takes. On CPU a decode
// step's rows are short (one token of 1024 values), so the plain ops cost their dispatch, not
// their arithmetic: see nanoserve/platforms/cpu/fused_ops.py.
//
// They reproduce PyTorch's roundings: bfloat16 inputs are computed in float32 and rounded to
// bfloat16 wherever the plain ops round (so RMSNorm differs only in the order of the float32
// sum of squares, and silu_mul only in its exp, within about an ulp of PyTorch's). Built with
// -ffp-contract=off: no a*b+c is fused into one rounding. Their vector paths (simd.h) take 16
// float32 lanes with AVX-512 (BF16), then 8 with AVX2; the scalar loops finish each row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "simd.h"

namespace {

// Rows per thread below which a call stays on the calling thread (decode steps).
constexpr int64_t GRAIN = 64;
// The same in values, for ops whose rows are wider and dearer than a norm's (silu_mul's rows of
// the MLP's intermediate size, an exp each): about as much work per thread as GRAIN norm rows.
constexpr int64_t GRAIN_VALUES = GRAIN * 1024;

template <typename T>
float to_float(T v) { return static_cast<float>(v); }

// The 8-lane paths below (AVX2, which AVX-512 CPUs have too) serve float32 and bfloat16.
template <typename T>
constexpr bool HAS_LANES = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;

// The sum of x[d]^2 over one row, each square rounded to float32 before it is added.
template <typename T>
float sum_of_squares(const T* x, int64_t D) {
  float sum = 0.f;
  int64_t d = 0;
#ifdef __AVX512BF16__
  if constexpr (HAS_LANES<T>) {
    __m512 total = _mm512_setzero_ps();
    for (; d + 16 <= D; d += 16) {
      const __m512 v = load16(x + d);
      total = _mm512_add_ps(total, _mm512_mul_ps(v, v));
    }
    sum = _mm512_reduce_add_ps(total);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (HAS_LANES<T>) {  // what is left past the 16-lane vectors (all of it on AVX2)
    __m256 total = _mm256_setzero_ps();
    for (; d + 8 <= D; d += 8) {
      const __m256 v = load8(x + d);
      total = _mm256_add_ps(total, _mm256_mul_ps(v, v));
    }
    sum += add_lanes8(total);
  }
#endif
  for (; d < D; ++d) sum += to_float(x[d]) * to_float(x[d]);
  return sum;
}

// out = round(x / rms(x)) * weight, over one row of D values (the weight optional).
template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t D, float eps) {
  const float inv = 1.f / std::sqrt(sum_of_squares(x, D) / static_cast<float>(D) + eps);
  int64_t d = 0;
#ifdef __AVX512BF16__
  if constexpr (HAS_LANES<T>) {  // the same two roundings as below, 16 lanes at a time
    const __m512 by = _mm512_set1_ps(inv);
    for (; d + 16 <= D; d += 16) {
      const __m512 normalized = round_to(out, _mm512_mul_ps(load16(x + d), by));
      store16(out + d, weight ? _mm512_mul_ps(normalized, load16(weight + d)) : normalized);
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (HAS_LANES<T>) {  // the same two roundings as below, 8 lanes at a time
    const __m256 by = _mm256_set1_ps(inv);
    for (; d + 8 <= D; d += 8) {
      const __m256 normalized = round_to(out, _mm256_mul_ps(load8(x + d), by));
      store8(out + d, weight ? _mm256_mul_ps(normalized, load8(weight + d)) : normalized);
    }
  }
#endif
  for (; d < D; ++d) {
    const T normalized = static_cast<T>(to_float(x[d]) * inv);  // rounded to x's dtype
    out[d] = weight ? static_cast<T>(to_float(normalized) * to_float(weight[d])) : normalized;
  }
}

#ifdef __AVX512BF16__
// round(a * cos) + round(b * signed_sin) over 16 lanes, each product rounded to T: 16 values
// of a rotated head (a from one half, b from the other), before the sum is rounded.
template <typename T>
__m512 rotated16(__m512 a, __m512 b, const T* cos, const T* sin, T* out) {
  const __m512 ac = round_to(out, _mm512_mul_ps(a, load16(cos)));
  return _mm512_add_ps(ac, round_to(out, _mm512_mul_ps(b, load16(sin))));
}
#endif

// out = x * cos + [x2, x1] * signed_sin over one head of D values, each product rounded.
template <typename T>
void rotary_row(const T* x, const T* cos, const T* sin, T* out, int64_t D) {
  const int64_t half = D / 2;
  int64_t d = 0;
#ifdef __AVX512BF16__
  if constexpr (HAS_LANES<T>) {  // 16 values of each half at once, the same roundings as below
    for (; d + 16 <= half; d += 16) {
      const __m512 first = load16(x + d), second = load16(x + d + half);
      store16(out + d, rotated16(first, second, cos + d, sin + d, out));
      const int64_t at = d + half;
      store16(out + at, rotated16(second, first, cos + at, sin + at, out));
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (HAS_LANES<T>) {  // 8 values of each half at once, the same roundings as below
    // out[at..] = round(round(a * cos) + round(b * sin)), 8 lanes from at.
    const auto rotate = [&](__m256 a, __m256 b, int64_t at) {
      const __m256 ac = round_to(out, _mm256_mul_ps(a, load8(cos + at)));
      const __m256 bs = round_to(out, _mm256_mul_ps(b, load8(sin + at)));
      store8(out + at, _mm256_add_ps(ac, bs));
    };
    for (; d + 8 <= half; d += 8) {
      const __m256 first = load8(x + d), second = load8(x + d + half);
      rotate(first, second, d);
      rotate(second, first, d + half);
    }
  }
#endif
  // out[at] from x[at] and its partner in the other half.
  const auto rotate_one = [&](T value, T swapped, int64_t at) {
    const T a = static_cast<T>(to_float(value) * to_float(cos[at]));
    const T b = static_cast<T>(to_float(swapped) * to_float(sin[at]));
    out[at] = static_cast<T>(to_float(a) + to_float(b));
  };
  for (; d < half; ++d) {  // the tail of each half (all of it without AVX2)
    rotate_one(x[d], x[d + half], d);
    rotate_one(x[d + half], x[d], d + half);
  }
}

// out = round(round(silu(gate)) * up) over one row of I values (gate and up side by side).
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t I) {
  int64_t i = 0;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    for (; i + 16 <= I; i += 16) {
      const __m512 g = load16(gate + i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));  // exp(-g)
      const __m512 silu = round_to(out, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      store16(out + i, _mm512_mul_ps(silu, load16(up + i)));
    }
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (HAS_LANES<T>) {
    for (; i + 8 <= I; i += 8) {
      const __m256 g = load8(gate + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));  // exp(-g)
      const __m256 silu = round_to(out, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
      store8(out + i, _mm256_mul_ps(silu, load8(up + i)));
    }
  }
#endif
  for (; i < I; ++i) {  // the tail (all of it without SIMD)
    const float g = to_float(gate[i]);
    const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
    out[i] = static_cast<T>(to_float(silu) * to_float(up[i]));
  }
}

// [T, D] or [T, H, D] as [T, H, D] with each row of D contiguous (copied if it is not).
at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "expected [T, D] or [T, H, D]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "bfloat16 or float32 only");
  const at::Tensor rows = x.dim() == 2 ? x.unsqueeze(1) : x;
  return rows.stride(2) == 1 ? rows : rows.contiguous();
}

// Calls fn(row index r = t * H + h, pointer to row (t, h) of x) for every row of x [T, H, D]
// (rows contiguous, any T/H strides), split across threads above `grain` rows.
template <typename T, typename Fn>
void for_each_row(const at::Tensor& x, Fn fn, int64_t grain = GRAIN) {
  const int64_t H = x.size(1), st = x.stride(0), sh = x.stride(1);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, x.size(0) * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r, xp + (r / H) * st + (r % H) * sh);
  });
}

// cos and signed_sin [T, 1, D] for T tokens of D values in `dtype` (D even), as rotary takes them.
void check_rope_tables(const at::Tensor& cos, const at::Tensor& signed_sin, int64_t T, int64_t D,
                       at::ScalarType dtype) {
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == T * D &&
              signed_sin.numel() == T * D && cos.scalar_type() == dtype &&
              signed_sin.scalar_type() == dtype && D % 2 == 0);
}

// The longest head qk_norm_rotary normalizes (on the stack, one head per row).
constexpr int64_t MAX_NORMED_HEAD_DIM = 512;

using bf16 = at::BFloat16;
// One bf16 head of x to out: RMS-normed with `weight` (none: not normed), then rotated.
using HeadFn = void (*)(const bf16* x, const bf16* weight, const bf16* cos, const bf16* sin,
                        bf16* out, float eps);

#ifdef __AVX512BF16__
// HeadFn for heads of 16 * LANES16 values, held in registers from load to store:
// rms_norm_row then rotary_row, the same roundings, without the pass between them.
template <int LANES16>
void norm_rotate_head(const bf16* x, const bf16* weight, const bf16* cos, const bf16* sin,
                      bf16* out, float eps) {
  __m512 v[LANES16];
  for (int i = 0; i < LANES16; ++i) v[i] = load16(x + 16 * i);
  if (weight != nullptr) {
    __m512 total = _mm512_setzero_ps();
    for (int i = 0; i < LANES16; ++i) total = _mm512_add_ps(total, _mm512_mul_ps(v[i], v[i]));
    const float mean = _mm512_reduce_add_ps(total) / static_cast<float>(16 * LANES16);
    const __m512 by = _mm512_set1_ps(1.f / std::sqrt(mean + eps));
    for (int i = 0; i < LANES16; ++i) {
      const __m512 normalized = round_to(out, _mm512_mul_ps(v[i], by));
      v[i] = round_to(out, _mm512_mul_ps(normalized, load16(weight + 16 * i)));
    }
  }
  constexpr int HALF = LANES16 / 2;  // out = v * cos + [v2, v1] * signed_sin, rounded as rotary
  for (int i = 0; i < HALF; ++i) {
    const int first = 16 * i, second = 16 * (i + HALF);
    store16(out + first, rotated16(v[i], v[i + HALF], cos + first, sin + first, out));
    store16(out + second, rotated16(v[i + HALF], v[i], cos + second, sin + second, out));
  }
}
#endif

// The register-held HeadFn for bf16 heads of D values, where there is one (else nullptr).
HeadFn register_head(int64_t D) {
#ifdef __AVX512BF16__
  if (D == 64) return norm_rotate_head<4>;
  if (D == 128) return norm_rotate_head<8>;
  if (D == 256) return norm_rotate_head<16>;
#endif
  return nullptr;
}

}  // namespace

// input [T, D] or [T, H, D] (any T/H strides), weight [D] or None -> the input's shape.
at::Tensor rms_norm(at::Tensor input, c10::optional<at::Tensor> weight, double eps) {
  const at::Tensor x = as_rows(input);
  const int64_t D = x.size(2);
  auto out = at::empty(input.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* w = nullptr;
    if (weight.has_value()) {
      TORCH_CHECK(weight->is_contiguous() && weight->numel() == D &&
                  weight->scalar_type() == x.scalar_type());
      w = weight->data_ptr<scalar_t>();
    }
    scalar_t* op = out.data_ptr<scalar_t>();
    for_each_row<scalar_t>(x, [&](int64_t r, const scalar_t* row) {
      rms_norm_row(row, w, op + r * D, D, static_cast<float>(eps));
    });
  });
  return out;
}

// gate_up [T, 2I] (gate, then up; any T stride) -> silu(gate) * up [T, I].
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "expected [T, 2I]");
  const at::Tensor x = as_rows(gate_up);
  const int64_t I = x.size(2) / 2;
  auto out = at::empty({x.size(0), I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_mul", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    for_each_row<scalar_t>(
        x, [&](int64_t r, const scalar_t* row) { silu_mul_row(row, row + I, op + r * I, I); },
        std::max<int64_t>(1, GRAIN_VALUES / I));
  });
  return out;
}

// x [T, H, D] (any T/H strides), cos and signed_sin [T, 1, D] contiguous -> [T, H, D].
at::Tensor rotary(at::Tensor input, at::Tensor cos, at::Tensor signed_sin) {
  TORCH_CHECK(input.dim() == 3, "expected [T, H, D]");
  const at::Tensor x = as_rows(input);
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  check_rope_tables(cos, signed_sin, T, D, x.scalar_type());
  auto out = at::empty({T, H, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rotary", [&] {
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = signed_sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_each_row<scalar_t>(x, [&](int64_t r, const scalar_t* row) {
      const int64_t t = r / H;
      rotary_row(row, cp + t * D, sp + t * D, op + r * D, D);
    });
  });
  return out;
}

// x + delta and its RMSNorm, x and delta [T, D] -> (sum, normed), both [T, D]:
// a decoder layer's residual add and the norm after it in one pass, with the roundings of the
// two ops (the sum rounded to x's dtype, then normed as rms_norm does).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor delta, at::Tensor weight,
                                                double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(),
              "x and delta: [T, D] alike");
  x = x.contiguous();
  delta = delta.contiguous();
  const int64_t D = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == D &&
              weight.scalar_type() == x.scalar_type());
  auto sum = at::empty_like(x), normed = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *dp = delta.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *np = normed.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t d = 0; d < D; ++d)
          sp[t * D + d] = static_cast<scalar_t>(to_float(xp[t * D + d]) + to_float(dp[t * D + d]));
        rms_norm_row(sp + t * D, w, np + t * D, D, static_cast<float>(eps));
      }
    });
  });
  return {sum, normed};
}

// A step's queries and keys from its fused projection: qk [T, H + Hkv, D] (rows contiguous, any
// T stride), each head RMS-normed with its weight when q_weight and k_weight [D] are given
// (Qwen3), then rotated by cos, signed_sin [T, 1, D] -> (q [T, H, D], k [T, Hkv, D]). The
// roundings of rms_norm and rotary called one after the other.
std::tuple<at::Tensor, at::Tensor> qk_norm_rotary(at::Tensor qk, int64_t num_q_heads,
                                                  c10::optional<at::Tensor> q_weight,
                                                  c10::optional<at::Tensor> k_weight,
                                                  at::Tensor cos, at::Tensor signed_sin,
                                                  double eps) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "[T, H, D] rows");
  const int64_t T = qk.size(0), H = num_q_heads, Hkv = qk.size(1) - H, D = qk.size(2);
  TORCH_CHECK(H > 0 && Hkv > 0 && q_weight.has_value() == k_weight.has_value());
  check_rope_tables(cos, signed_sin, T, D, qk.scalar_type());
  TORCH_CHECK(!q_weight.has_value() || D <= MAX_NORMED_HEAD_DIM, "head_dim up to 512 with norms");
  auto q = at::empty({T, H, D}, qk.options()), k = at::empty({T, Hkv, D}, qk.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qk.scalar_type(), "qk_norm_rotary", [&] {
    const scalar_t *qw = nullptr, *kw = nullptr;
    if (q_weight.has_value()) {
      for (const at::Tensor* w : {&*q_weight, &*k_weight})
        TORCH_CHECK(w->is_contiguous() && w->numel() == D && w->scalar_type() == qk.scalar_type());
      qw = q_weight->data_ptr<scalar_t>();
      kw = k_weight->data_ptr<scalar_t>();
    }
    const scalar_t *cp = cos.data_ptr<scalar_t>(), *sp = signed_sin.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>();
    const HeadFn in_registers = register_head(D);
    for_each_row<scalar_t>(qk, [&](int64_t r, const scalar_t* row) {
      const int64_t t = r / (H + Hkv), h = r % (H + Hkv);
      scalar_t* out = h < H ? qp + (t * H + h) * D : kp + (t * Hkv + h - H) * D;
      if (std::is_same_v<scalar_t, bf16> && in_registers != nullptr) {
        const auto as_bf16 = [](const scalar_t* p) { return reinterpret_cast<const bf16*>(p); };
        in_registers(as_bf16(row), as_bf16(h < H ? qw : kw), as_bf16(cp + t * D),
                     as_bf16(sp + t * D), reinterpret_cast<bf16*>(out), static_cast<float>(eps));
        return;
      }
      scalar_t normed[MAX_NORMED_HEAD_DIM];
      const scalar_t* head = row;
      if (qw != nullptr) {
        rms_norm_row(row, h < H ? qw : kw, normed, D, static_cast<float>(eps));
        head = normed;
      }
      rotary_row(head, cp + t * D, sp + t * D, out, D);
    });
  });
  return {q, k};
}
