// A decode step through every decoder layer of a Llama-family model in one call from Python.
//
// `LlamaDecoderLayer.forward` (nanoserve/core/models/llama.py) is the reference: per layer about
// fifteen tensor ops, each a few microseconds of Python and dispatch. For a decode step of a
// 0.6B model, whose matrix products stream ~1.2 GB in ~50 ms, the Python between them costs
// ~3 ms. `DecodeLayers` holds every layer's tensors and runs the same computation through the
// same kernels (the GEMVs, oneDNN's product, the paged-decode attention, SwiGLU, store_kv), with
// two pairs of steps merged into one pass each, keeping their roundings: a residual add and the
// RMSNorm after it (`add_rms_norm`), and Qwen3's per-head q/k norms and RoPE (`qk_norm_rotary`).
// So its output is bit for bit the eager step's, with Python and ~6 calls per layer left out.
// It holds no GIL while it runs.
//
// Each layer is SLOTS tensors, in the order of `Slot` below; an absent one (no bias, no q/k
// norm, no int8 scales, the dense MLP of a layer with experts and the other way round) is an
// empty tensor. A linear is (weight, scales, bias, packed): with scales it is int8 (in
// int8_gemv's layout: blocks or row pairs); else a step of up to gemv_max_rows tokens streams
// the GEMV's bf16 weight (in bf16_gemv_weight's layout) through bf16_gemv, and a larger one (or
// one with no GEMV weight) multiplies by oneDNN's packed weight, as PackedLinearMethod does.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <vector>

#include "kernels.h"

namespace {

enum Slot {
  INPUT_NORM,  // [hidden]
  // [(H + 2 Hkv) D, hidden] (int8: blocks or row pairs; bf16: bf16_gemv_weight's layout), scales [.], bias [.], oneDNN's packed weight
  QKV_WEIGHT, QKV_SCALES, QKV_BIAS, QKV_PACKED,
  Q_NORM, K_NORM,  // [D] each (Qwen3), or absent
  O_WEIGHT, O_SCALES, O_BIAS, O_PACKED,  // [hidden, H D]
  POST_NORM,  // [hidden]
  GATE_UP_WEIGHT, GATE_UP_SCALES, GATE_UP_BIAS, GATE_UP_PACKED,  // [2 I, hidden]
  DOWN_WEIGHT, DOWN_SCALES, DOWN_BIAS, DOWN_PACKED,  // [hidden, I]
  // A layer with experts in place of the MLP (moe/layer.py's SparseMoeBlock): the router
  // [E, hidden] bf16; the stacked experts, bf16 [E, 2I, hidden] and [E, hidden, I], or int8 in
  // row pairs with float32 scales [E, 2I] and [E, hidden] (moe/int8.py); the expert-load
  // counter [E] int64 that each step's choices are added to.
  ROUTER, W13, W13_SCALES, W2, W2_SCALES, EXPERT_LOAD,
  K_CACHE, V_CACHE,  // [num_blocks, block_size, Hkv, D]
  SLOTS
};

bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

c10::optional<at::Tensor> if_present(const at::Tensor& t) {
  return present(t) ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// x [T, in] @ packed.T + bias, by oneDNN: torch.ops.mkldnn._linear_pointwise, as
// PackedLinearMethod calls it from Python.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, present(bias) ? c10::IValue(bias) : c10::IValue(),
                          std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// x [T, in] @ weight.T (+ bias) -> [T, out]: what the layer's linear method does for a decode
// step of T tokens (see the top of the file; a GEMV's bias is added after it).
at::Tensor apply_linear(const at::Tensor& x, const at::Tensor* layer, Slot slot,
                        int64_t gemv_max_rows) {
  const at::Tensor &weight = layer[slot], &scales = layer[slot + 1], &bias = layer[slot + 2];
  const at::Tensor& packed = layer[slot + 3];
  at::Tensor out;
  if (present(scales)) {
    out = int8_gemv(x, weight, scales);
  } else if (present(packed) && !(present(weight) && x.size(0) <= gemv_max_rows)) {
    return packed_linear(x, packed, bias);
  } else {
    out = bf16_gemv(x, weight);
  }
  return present(bias) ? out + bias : out;
}

// What a step's tokens need besides their activations: the rotary tables of their positions,
// their slots in the cache, and each token's block table and context (as decode queries).
struct StepInputs {
  at::Tensor cos, signed_sin;  // [T, 1, D] each
  at::Tensor slot_mapping;     // [T] int64
  at::Tensor block_tables;     // [T, max_blocks] int64
  at::Tensor seq_lens;         // [T] int64
};

}  // namespace

// Every decoder layer of one model, held for its decode steps.
class DecodeLayers {
 public:
  DecodeLayers(std::vector<at::Tensor> tensors, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale, int64_t gemv_max_rows,
               int64_t top_k, bool renormalize)
      : tensors_(std::move(tensors)), H_(num_heads), Hkv_(num_kv_heads), D_(head_dim),
        eps_(eps), scale_(scale), gemv_max_rows_(gemv_max_rows), top_k_(top_k),
        renormalize_(renormalize) {
    TORCH_CHECK(!tensors_.empty() && tensors_.size() % SLOTS == 0, "SLOTS tensors per layer");
  }

  int64_t num_layers() const { return static_cast<int64_t>(tensors_.size()) / SLOTS; }

  // x [T, hidden] (the residual stream entering layer `begin`: the embedded tokens for 0) ->
  // [T, hidden] after layer `end` - 1 (not normed). A step may run its layers in spans. Where
  // output_rows [S] is given (not empty), the model's last layer finishes only those rows, as
  // LlamaModel.forward does for a prompt chunk: -> [S, hidden].
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor signed_sin, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_lens, int64_t begin, int64_t end,
                     at::Tensor output_rows) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "[T, hidden] bf16");
    TORCH_CHECK(0 <= begin && begin < end && end <= num_layers(), "layers [begin, end)");
    const StepInputs step{cos, signed_sin, slot_mapping, block_tables, seq_lens};
    // LlamaDecoderLayer.forward, attention then MLP, each added to the residual stream; each
    // residual add runs with the norm after it (the next layer's input norm after the MLP).
    at::Tensor normed = rms_norm(x, layer(begin)[INPUT_NORM], eps_), h, post, mlp;
    for (int64_t i = begin;; ++i) {
      const at::Tensor* t = layer(i);
      const bool picks_rows = i + 1 == num_layers() && present(output_rows);
      const at::Tensor attn = attention(normed, t, step, picks_rows ? &output_rows : nullptr);
      if (picks_rows) x = x.index_select(0, output_rows);  // [S, hidden]
      std::tie(h, post) = add_rms_norm(x, attn, t[POST_NORM], eps_);
      mlp = present(t[ROUTER]) ? experts(post, t)
                               : linear(silu_mul(linear(post, t, GATE_UP_WEIGHT)), t, DOWN_WEIGHT);
      if (i + 1 == end) return h + mlp;
      std::tie(x, normed) = add_rms_norm(h, mlp, layer(i + 1)[INPUT_NORM], eps_);
    }
  }

 private:
  const at::Tensor* layer(int64_t i) const { return tensors_.data() + i * SLOTS; }

  at::Tensor linear(const at::Tensor& x, const at::Tensor* t, Slot slot) const {
    return apply_linear(x, t, slot, gemv_max_rows_);
  }

  // LlamaAttention.forward for tokens attending one by one: [T, hidden] -> [T, hidden], or
  // [S, hidden] for the rows `rows` names (its output projection only for those).
  at::Tensor attention(const at::Tensor& x, const at::Tensor* t, const StepInputs& step,
                       const at::Tensor* rows) const {
    const int64_t T = x.size(0), q_size = H_ * D_, kv_size = Hkv_ * D_;
    const at::Tensor qkv = linear(x, t, QKV_WEIGHT);  // [T, (H + 2 Hkv) D]
    const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({T, H_ + Hkv_, D_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv_, D_});
    // Qwen3 normalizes each q and k head (one normalization, then their scales); then RoPE.
    auto [q, k] = qk_norm_rotary(qk, H_, if_present(t[Q_NORM]), if_present(t[K_NORM]), step.cos,
                                 step.signed_sin, eps_);  // [T, H, D], [T, Hkv, D]
    store_kv(k, v, t[K_CACHE], t[V_CACHE], step.slot_mapping);
    at::Tensor out = paged_decode_attention(q, t[K_CACHE], t[V_CACHE], step.block_tables,
                                            step.seq_lens, scale_);  // [T, H, D]
    if (rows != nullptr) out = out.index_select(0, *rows);  // [S, H, D]
    return linear(out.view({out.size(0), q_size}), t, O_WEIGHT);
  }

  // SparseMoeBlock.forward as the CPU methods run a decode step of up to 8 tokens (moe/cpu.py,
  // moe/int8.py): the router's product by the GEMV, routing as moe/routing.py's `route` does
  // (softmax in float32, PyTorch's topk: ties resolve as in transformers), the choices counted,
  // the (token, expert) pairs grouped, each chosen expert's rows streamed once for its tokens,
  // and the outputs summed back by the routing weights. [T, hidden] -> [T, hidden]
  at::Tensor experts(const at::Tensor& x, const at::Tensor* t) const {
    const at::Tensor probs = at::softmax(bf16_gemv(x, t[ROUTER]), -1, at::kFloat);  // [T, E]
    auto [weights, expert_ids] = at::topk(probs, top_k_, -1);  // [T, k] each
    if (renormalize_) weights = weights / weights.sum(-1, true);
    const at::Tensor choices = expert_ids.flatten();  // [T k]
    t[EXPERT_LOAD].index_add_(0, choices, at::ones_like(choices));
    const auto [token_index, pair_weights, expert_of, ids, offsets] =
        moe_group(expert_ids, weights, 0, t[ROUTER].size(0));  // [A] ... [U], [U + 1]
    const auto grouped = [&](const at::Tensor& rows, Slot slot) {  // [A, in] -> [A, out]
      if (present(t[slot + 1])) return moe_int8_gemv(rows, t[slot], t[slot + 1], ids, offsets);
      return moe_bf16_gemv(rows, t[slot], ids, offsets);
    };
    const at::Tensor gate_up = grouped(x.index_select(0, token_index), W13);  // [A, 2I]
    return moe_combine(x, token_index, pair_weights, grouped(silu_mul(gate_up), W2));
  }

  std::vector<at::Tensor> tensors_;
  int64_t H_, Hkv_, D_;
  double eps_, scale_;
  int64_t gemv_max_rows_;  // the most tokens a bf16 linear with a packed weight streams
  int64_t top_k_;          // experts per token (layers with experts)
  bool renormalize_;       // the top k's weights renormalized to sum to one
};

void bind_decode_layers(pybind11::module& m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers",
                                 "every decoder layer of a Llama-family model, for decode steps")
      .def(pybind11::init<std::vector<at::Tensor>, int64_t, int64_t, int64_t, double, double,
                          int64_t, int64_t, bool>(),
           "(tensors: SLOTS per layer, num_heads, num_kv_heads, head_dim, eps, scale, "
           "gemv_max_rows, top_k, renormalize)",
           pybind11::arg("tensors"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
           pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("gemv_max_rows"), pybind11::arg("top_k") = 0,
           pybind11::arg("renormalize") = false)
      .def_property_readonly("num_layers", &DecodeLayers::num_layers)
      .def_property_readonly_static("slots", [](pybind11::object) { return int64_t{SLOTS}; })
      .def("__call__", &DecodeLayers::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>(),
           "(x [T, hidden] bf16, cos, signed_sin [T, 1, D], slot_mapping [T], block_tables "
           "[T, max_blocks], seq_lens [T], begin, end, output_rows [S] or empty) -> "
           "[T or S, hidden] after layers [begin, end)");
}
