// The Python module of nanoserve's CPU kernels (built by nanoserve/platforms/cpu/kernels.py).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv,
        "[M, K] x int8 weight in row pairs or int8_gemv_blocks' blocks * [N] scales -> [M, N]");
  m.def("int8_gemv_blocks", &int8_gemv_blocks,
        "[N, K] int8 weight -> [N/64, K/2, 64, 2] blocks of 64 rows where int8_gemv multiplies "
        "them here (AVX512-BW; N % 64 == 0, K even), else None");
  m.def("bf16_gemv", &bf16_gemv,
        "[M, K] bf16 x [N, K] bf16 weight, or as bf16_gemv_weight lays it out -> [M, N] (M <= 80)");
  m.def("bf16_gemv_max_rows", &bf16_gemv_max_rows,
        "up to how many tokens bf16_gemv streams a weight once here (80 on AMX tiles, else 16)");
  m.def("bf16_gemv_weight", &bf16_gemv_weight,
        "[N, K] bf16 weight -> the layout bf16_gemv reads fastest here (AMX's tiles where "
        "amx_gemv_takes it, blocks of 64 rows where block_gemv_takes it, else the weight itself)");
  m.def("bf16_blocks", &bf16_blocks,
        "[N, K] bf16 weight (N % 64 == 0, K even) -> [N/64, K/2, 64, 2]: blocks of 64 rows, "
        "each k pair's 64 rows side by side (what bf16_gemv multiplies on AVX-512 BF16)");
  m.def("block_gemv_takes", &block_gemv_takes,
        "(weight): does bf16_gemv_weight lay it out in blocks of 64 rows here?");
  m.def("amx_gemv_layout", &amx_gemv_layout,
        "[N, K] bf16 weight (K % 32, N % 16) -> [N/16, K/32, 16, 16, 2]: tiles of 16 outputs by "
        "32 k in AMX's pair order, one KiB each (what bf16_gemv multiplies on AMX's tiles)");
  m.def("amx_bf16_gemv", &amx_bf16_gemv,
        "([M, K] bf16, a weight as amx_gemv_layout lays it out, prefetch bytes) -> [M, N] on "
        "AMX tiles (M <= 80)",
        pybind11::arg("x"), pybind11::arg("tiles"), pybind11::arg("ahead") = 0);
  m.def("amx_gemv_takes", &amx_gemv_takes,
        "(weight): does amx_gemv_layout take this plain weight here (AMX, whole tiles)?");
  m.def("amx_gemv_applies", &amx_gemv_applies,
        "(x, tiles): does bf16_gemv multiply these on AMX tiles here?");
  m.def("moe_bf16_gemv", &moe_bf16_gemv,
        "[A, K] bf16 rows grouped by expert x [E, N, K] bf16 experts -> [A, N]");
  m.def("moe_int8_gemv", &moe_int8_gemv,
        "[A, K] rows grouped by expert x [E, N/2, 2K] int8 expert pairs * [E, N] -> [A, N]");
  m.def("bf16_gemv_is_vectorized", &bf16_gemv_is_vectorized,
        "has bf16_gemv a SIMD path (AVX512-BF16 or AVX2-FMA)?");
  m.def("set_gemv_prefetch", &set_gemv_prefetch, "bytes the GEMVs prefetch ahead (0: none)");
  m.def("gemv_prefetch", &gemv_prefetch, "the GEMVs' prefetch distance in bytes");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query token per request attending over its paged K/V context");
  m.def("paged_chunk_attention_takes", &paged_chunk_attention_takes,
        "(query [T, H, D], k_cache) -> whether paged_decode_attention attends a request's "
        "tokens in a row as one chunk on these (bf16, head dims of 32k, blocks of 16k, built "
        "with the prompt kernel)");
  m.def("store_kv", &store_kv, "[T, Hkv, D] keys and values into their slots of the caches");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim of [T, H, D], weight optional");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I] (gate, then up) -> [T, I]");
  m.def("rotary", &rotary, "neox-style rotary embedding of [T, H, D] by [T, 1, D] cos/sin");
  m.def("add_rms_norm", &add_rms_norm,
        "(x + delta, RMSNorm(x + delta) * weight) of [T, D] rows: a residual add and its norm");
  m.def("qk_norm_rotary", &qk_norm_rotary,
        "(q, k) from [T, H + Hkv, D]: each head RMS-normed (with weights given), then rotated");
  m.def("moe_group", &moe_group,
        "([T, k] expert ids, [T, k] weights, first, count) -> a step's local (token, expert) "
        "pairs sorted by expert: (token_index, weights, expert_of, expert_ids, offsets)");
  m.def("moe_combine", &moe_combine,
        "(x [T, H], token_index [A], weights [A], expert_out [A, H]) -> [T, H]: each token's "
        "pairs' weighted outputs, summed in float32");
  m.def("prompt_attention", &prompt_attention,
        "([Q, H, D] queries, [K, Hkv, D] keys and values, scale, allow_tiles=True) -> [Q, H, D]: "
        "a prompt chunk over its context, causal aligned to the last key, in bf16; its products "
        "on AMX's tiles where allowed and usable, else on AVX-512 BF16",
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"),
        pybind11::arg("scale"), pybind11::arg("allow_tiles") = true);
  m.def("prompt_attention_is_available", &prompt_attention_is_available,
        "was the library built for a CPU with AVX-512 BF16 (which every AMX CPU has)?");
  m.def("prompt_attention_uses_tiles", &prompt_attention_uses_tiles,
        "was the library built with AMX, and does the OS let this process use its tiles?");
  m.def("row_argmax", &row_argmax,
        "[B, V] float32 -> [B] int64: each row's first largest value's index (NaN above all)");
  m.def("draw_rows", &draw_rows,
        "([B, V] float32 probabilities, [B] float64 uniforms in [0, 1)) -> [B] int64: per row "
        "the first token whose running sum (float64) passes its uniform times the row's sum");
  m.def("sampling_is_vectorized", &sampling_is_vectorized,
        "have row_argmax and draw_rows SIMD paths (AVX-512)?");
  bind_decode_layers(m);
  bind_suffix_tries(m);
}
