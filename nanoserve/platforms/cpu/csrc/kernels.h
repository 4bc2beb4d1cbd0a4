// The kernels' entry points, defined in the .cpp files beside this one: what bindings.cpp gives
// Python and what decode_layers.cpp calls layer by layer.
#pragma once
#include <torch/extension.h>

#include <type_traits>

// Calls body(std::integral_constant<int, M>) for M in 1..8, so that each row count of a decode
// GEMV gets its own fully unrolled code.
template <typename Body>
void with_rows(int64_t M, const Body& body) {
  TORCH_CHECK(M >= 1 && M <= 8, "the decode GEMVs take 1 to 8 rows, got ", M);
  switch (M) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, 2>{}); break;
    case 3: body(std::integral_constant<int, 3>{}); break;
    case 4: body(std::integral_constant<int, 4>{}); break;
    case 5: body(std::integral_constant<int, 5>{}); break;
    case 6: body(std::integral_constant<int, 6>{}); break;
    case 7: body(std::integral_constant<int, 7>{}); break;
    default: body(std::integral_constant<int, 8>{}); break;
  }
}

// gemv.cpp
at::Tensor int8_gemv(at::Tensor x, at::Tensor weight, at::Tensor scales);
at::Tensor bf16_gemv(at::Tensor x, at::Tensor weight);
bool bf16_gemv_is_vectorized();
int64_t bf16_gemv_max_rows();
at::Tensor moe_bf16_gemv(at::Tensor x, at::Tensor weight, at::Tensor expert_ids,
                         at::Tensor offsets);
at::Tensor moe_int8_gemv(at::Tensor x, at::Tensor weight, at::Tensor scales, at::Tensor expert_ids,
                         at::Tensor offsets);
void set_gemv_prefetch(int64_t bytes);
int64_t gemv_prefetch();

// block_gemv.cpp
at::Tensor bf16_blocks(const at::Tensor& weight);
bool block_gemv_takes(const at::Tensor& weight);
at::Tensor bf16_gemv_weight(at::Tensor weight);
at::Tensor block_bf16_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t ahead);
c10::optional<at::Tensor> int8_gemv_blocks(const at::Tensor& weight);
void block_int8_gemv(const at::Tensor& x16, const float* x_scales, const at::Tensor& blocks,
                     const float* scales, int64_t ahead, at::Tensor& out);

// amx_gemv.cpp
bool amx_gemv_takes(const at::Tensor& weight);
bool amx_gemv_applies(const at::Tensor& x, const at::Tensor& tiles);
at::Tensor amx_gemv_layout(const at::Tensor& weight);
at::Tensor amx_bf16_gemv(const at::Tensor& x, const at::Tensor& tiles, int64_t ahead);
int64_t amx_gemv_max_rows();

// decode_attention.cpp
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping);

// fused_ops.cpp
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> weight, double eps);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor signed_sin);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor delta, at::Tensor weight,
                                                double eps);
std::tuple<at::Tensor, at::Tensor> qk_norm_rotary(at::Tensor qk, int64_t num_q_heads,
                                                  c10::optional<at::Tensor> q_weight,
                                                  c10::optional<at::Tensor> k_weight,
                                                  at::Tensor cos, at::Tensor signed_sin,
                                                  double eps);

// moe_pairs.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_group(
    at::Tensor expert_ids, at::Tensor weights, int64_t first_expert, int64_t num_local);
at::Tensor moe_combine(at::Tensor x, at::Tensor token_index, at::Tensor weights,
                       at::Tensor expert_out);

// prompt_attention.cpp
bool prompt_attention_is_available();
bool prompt_attention_uses_tiles();
at::Tensor prompt_attention(at::Tensor query, at::Tensor key, at::Tensor value, double scale,
                            bool allow_tiles);
// Tokens first .. first + count - 1 of a step: one request's, attending as one chunk (token
// first + i sees the keys the last one sees but its last count - 1 - i).
struct TokenRun {
  int64_t first, count;
};
bool paged_chunk_attention_takes(const at::Tensor& query, const at::Tensor& k_cache);
// query [T, H, D] bf16 (contiguous); caches [num_blocks, block_size, Hkv, D] bf16; block_tables
// [T, max_blocks] and seq_lens [T] int64 (contiguous): each run's rows of out [T, H, D], its
// keys and values read where they lie in the cache (through the prompt kernel's tiles).
void paged_chunk_attention(const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const std::vector<TokenRun>& runs,
                           double scale, at::Tensor& out);

// sampling.cpp
at::Tensor row_argmax(at::Tensor x);
at::Tensor draw_rows(at::Tensor probs, at::Tensor uniforms);
bool sampling_is_vectorized();

// decode_layers.cpp: the DecodeLayers class
void bind_decode_layers(pybind11::module& m);

// suffix_trie.cpp: the SuffixTrie and GrowingSuffixTrie classes (suffix decoding's tries)
void bind_suffix_tries(pybind11::module& m);
