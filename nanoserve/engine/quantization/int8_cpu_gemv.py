"""A weight-streaming int8 GEMV for CPU decode steps, compiled once per machine with the host's
C++ compiler (`torch.utils.cpp_extension`).

Decoding multiplies a few tokens' activations by every weight once, so the step is as fast as
the weights stream from memory. PyTorch's int8 weight-only kernel (`_weight_int8pack_mm`)
spends more time converting than reading: it stays well short of the memory bandwidth, so int8
weights (half the bytes of bf16) barely beat oneDNN's packed bf16 product. This kernel reads
each int8 weight row once, widens it to float32 in SIMD registers, multiplies it by every
token's activations (kept in float32 in L1) and scales the sums by the row's scale:

    out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]        (float32 accumulation)

the same arithmetic as `_weight_int8pack_mm` up to the order of the float32 sums. Rows are
split across torch's intra-op threads.

The source is compiled with `-march=native` into torch's extension cache (~/.cache/
torch_extensions) the first time int8 weights are loaded (tens of seconds) and loaded from
there afterwards. Without a compiler (or ninja) the int8 method keeps PyTorch's kernel; the
start-up log says which one runs.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger("nanoserve.quantization")

# Most tokens one call multiplies: each row is read once for all of them, and their float32
# activations (MAX_ROWS * in_features * 4 bytes) stay in L1/L2. Longer inputs (prefills) are
# compute-bound and take another path.
MAX_ROWS = 8

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// How far ahead of the product the weights are fetched: with the hardware prefetcher alone a
// core streams a weight matrix at about half the rate it does with this.
constexpr int64_t AHEAD = 4096;  // bytes (= int8 weights)

// sums[m] = dot(x[m], w) for M activation rows and one weight row of length K. The row is
// read front to back (rows one after another: one sequential stream for the prefetcher); each
// 16 weights are widened to float32 once and used for all M rows, and U accumulators per row
// (interleaved along k) hide the FMA latency.
template <int M>
static void row_dot(const float* x, const int8_t* w, int64_t K, float* sums) {
  constexpr int U = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  int64_t k = 0;
#ifdef __AVX512F__
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  for (; k + 16 * U <= K; k += 16 * U) {
    // Ask for the cache line AHEAD bytes on (a prefetch never faults past the end).
    if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k + AHEAD), _MM_HINT_T0);
    for (int u = 0; u < U; ++u) {
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16 * u));
      const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      for (int m = 0; m < M; ++m)
        acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16 * u), wf, acc[m][u]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 total = acc[m][0];
    for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[m][u]);
    sums[m] = _mm512_reduce_add_ps(total);
  }
#else
  for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
  for (; k < K; ++k)  // the tail (all of it without AVX-512)
    for (int m = 0; m < M; ++m) sums[m] += x[m * K + k] * static_cast<float>(w[k]);
}

// out [M, N] float32 = (x [M, K] @ w [N, K].T) * scales [N], rows of w split across threads.
template <int M>
static void gemv(const float* x, const int8_t* w, const float* scales, int64_t N, int64_t K,
                 float* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float sums[M];
    for (int64_t n = begin; n < end; ++n) {
      row_dot<M>(x, w + n * K, K, sums);
      for (int m = 0; m < M; ++m) out[m * N + n] = sums[m] * scales[n];
    }
  });
}

// x [M, K] (M <= 8), weight [N, K] int8, scales [N] -> [M, N] in x's dtype.
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor weight, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1));
  TORCH_CHECK(weight.scalar_type() == torch::kInt8 && weight.is_contiguous());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "int8_gemv takes 1 to 8 rows");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto sf = scales.to(torch::kFloat32).contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (M) {
    case 1: gemv<1>(xp, wp, sp, N, K, op); break;
    case 2: gemv<2>(xp, wp, sp, N, K, op); break;
    case 3: gemv<3>(xp, wp, sp, N, K, op); break;
    case 4: gemv<4>(xp, wp, sp, N, K, op); break;
    case 5: gemv<5>(xp, wp, sp, N, K, op); break;
    case 6: gemv<6>(xp, wp, sp, N, K, op); break;
    case 7: gemv<7>(xp, wp, sp, N, K, op); break;
    default: gemv<8>(xp, wp, sp, N, K, op); break;
  }
  return out.to(x.scalar_type());
}
"""

Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cpu_key(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """A short name for this CPU's instruction sets: `-march=native` builds are only reused on
    a CPU with the same ones (a home directory may be shared between machines)."""
    try:
        lines = cpuinfo.read_text().splitlines()
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


@cache
def load_int8_gemv() -> Gemv | None:
    """The compiled kernel (built on first use, then cached on disk), or None if it can't be."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name=f"nanoserve_int8_gemv_{cpu_key()}",
            cpp_sources=SOURCE,
            functions=["int8_gemv"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # no compiler, no ninja, a compile error: keep PyTorch's kernel
        logger.warning("int8 GEMV not compiled (%s); using PyTorch's int8 kernel", error)
        return None
    return module.int8_gemv
