// A mixture-of-experts step's (token, expert) pairs: grouped by expert before the experts run,
// and their outputs summed back into their tokens after.
//
//   moe_group    the pairs of this rank's experts, sorted by expert (stable: within an expert,
//                in token order, then top-k order); what nanoserve/moe/routing.py's
//                group_by_expert computes with ~12 tensor ops, here in two passes of a counting
//                sort over the T * k choices
//   moe_combine  out[t] = sum of the pairs of token t, each expert's output times its weight,
//                summed in float32 in pair order and rounded once: nanoserve/moe/layer.py's
//                combine (a product, index_add_, a cast), the same roundings
//
// For a decode step these ops move a few kilobytes; in PyTorch each of them costs its dispatch,
// ~0.2 ms a layer together, beside a ~3 ms product of the chosen experts. Caller: moe/cpu.py.
#include <torch/extension.h>

#include <tuple>
#include <vector>

// expert_ids [T, k] int64 (global), weights [T, k] float32 -> (token_index [A], weights [A],
// expert_of [A] local ids ascending, expert_ids [U] the local experts with pairs, offsets
// [U + 1]) for the experts first_expert .. first_expert + num_local - 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_group(
    at::Tensor expert_ids, at::Tensor weights, int64_t first_expert, int64_t num_local) {
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.sizes() == weights.sizes(), "[T, k] each");
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat);
  TORCH_CHECK(num_local >= 1, "at least one local expert");
  const auto ids = expert_ids.contiguous();
  const auto chosen_weights = weights.contiguous();
  const int64_t top_k = ids.size(1), num_choices = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* weight = chosen_weights.data_ptr<float>();
  auto is_local = [&](int64_t c) {
    return id[c] >= first_expert && id[c] < first_expert + num_local;
  };
  std::vector<int64_t> count(num_local, 0);
  for (int64_t c = 0; c < num_choices; ++c)
    if (is_local(c)) ++count[id[c] - first_expert];
  std::vector<int64_t> next(num_local);  // where each expert's next pair goes
  int64_t num_pairs = 0, num_used = 0;
  for (int64_t e = 0; e < num_local; ++e) {
    next[e] = num_pairs;
    num_pairs += count[e];
    num_used += count[e] > 0;
  }
  const auto long_options = ids.options();
  auto token_index = at::empty({num_pairs}, long_options);
  auto pair_weights = at::empty({num_pairs}, chosen_weights.options());
  auto expert_of = at::empty({num_pairs}, long_options);
  auto used = at::empty({num_used}, long_options);
  auto offsets = at::empty({num_used + 1}, long_options);
  int64_t *token = token_index.data_ptr<int64_t>(), *of = expert_of.data_ptr<int64_t>();
  float* pair_weight = pair_weights.data_ptr<float>();
  for (int64_t c = 0; c < num_choices; ++c) {
    if (!is_local(c)) continue;
    const int64_t e = id[c] - first_expert, a = next[e]++;
    token[a] = c / top_k;
    pair_weight[a] = weight[c];
    of[a] = e;
  }
  int64_t *used_id = used.data_ptr<int64_t>(), *offset = offsets.data_ptr<int64_t>();
  offset[0] = 0;
  for (int64_t e = 0, u = 0; e < num_local; ++e) {
    if (count[e] == 0) continue;
    used_id[u] = e;
    offset[u + 1] = offset[u] + count[e];
    ++u;
  }
  return {token_index, pair_weights, expert_of, used, offsets};
}

// x [T, H] (for its shape and dtype), token_index [A] int64, weights [A] float32, expert_out
// [A, H] -> [T, H] in x's dtype: each token's pairs' outputs times their weights, summed in
// float32 in pair order (zeros for a token with none), rounded once.
at::Tensor moe_combine(at::Tensor x, at::Tensor token_index, at::Tensor weights,
                       at::Tensor expert_out) {
  TORCH_CHECK(x.dim() == 2 && expert_out.dim() == 2 && expert_out.size(1) == x.size(1));
  TORCH_CHECK(token_index.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat);
  const int64_t A = expert_out.size(0), T = x.size(0), H = x.size(1);
  TORCH_CHECK(token_index.numel() == A && weights.numel() == A, "one token and weight a pair");
  const auto out = expert_out.to(at::kFloat).contiguous();  // [A, H]
  const auto tokens = token_index.contiguous();
  const auto pair_weights = weights.contiguous();
  auto sums = at::zeros({T, H}, out.options());  // [T, H] float32
  const float* row = out.data_ptr<float>();
  const int64_t* token = tokens.data_ptr<int64_t>();
  const float* weight = pair_weights.data_ptr<float>();
  float* sum = sums.data_ptr<float>();
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(token[a] >= 0 && token[a] < T, "token ", token[a], " of ", T);
    float* target = sum + token[a] * H;
    const float* source = row + a * H;
    for (int64_t h = 0; h < H; ++h) {
      const float weighted = source[h] * weight[a];  // rounded, as PyTorch's product is
      target[h] += weighted;
    }
  }
  return sums.to(x.scalar_type());
}
