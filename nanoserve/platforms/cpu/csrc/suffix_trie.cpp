// Suffix decoding's tries in C++: spec_decode/suffix.py's SuffixTrie and GrowingSuffixTrie,
// count for count and draft for draft, without Python's ~0.25 us a node (24 nodes a token).
//
// A node is an index into `counts_` and `children_`; a node's children are kept in the order
// they were made (as Python's dicts keep them), since a walk takes the first of the most
// frequent children. `edges_` finds a child by (node, token).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Draft = std::pair<std::vector<int>, double>;  // tokens, expected accepted tokens

class SuffixTrie {
 public:
  explicit SuffixTrie(int max_depth) : max_depth_(max_depth), counts_{0}, children_(1) {}
  virtual ~SuffixTrie() = default;

  // Counts (sign 1) or uncounts (-1) the substrings of `tokens` starting at first .. end - 1.
  void add(const std::vector<int>& tokens, int sign, int64_t first, std::optional<int64_t> end) {
    const int64_t size = static_cast<int64_t>(tokens.size());
    for (int64_t start = first; start < end.value_or(size); ++start) {
      int node = 0;
      for (int64_t i = start; i < std::min(size, start + max_depth_); ++i) {
        int child = find(node, tokens[i]);
        if (child < 0) child = make_child(node, tokens[i]);
        counts_[child] += sign;
        if (counts_[child] == 0) {  // no occurrence left below it either
          remove_child(node, tokens[i]);
          free_subtree(child);
          break;
        }
        node = child;
      }
    }
  }

  // The best draft over every matched suffix of `context` (its last max_depth tokens).
  Draft draft(const std::vector<int>& context, int max_tokens, double factor,
              double min_prob) const {
    const int64_t size = static_cast<int64_t>(context.size());
    const int64_t length = std::min<int64_t>(size, max_depth_);
    std::vector<int> nodes;  // the node of each suffix held, shortest first
    for (int64_t match_len = 1; match_len <= length; ++match_len) {
      int node = 0;
      for (int64_t i = size - match_len; i < size && node >= 0; ++i) node = find(node, context[i]);
      if (node < 0) break;  // no longer suffix can match either
      nodes.push_back(node);
    }
    return best_draft(nodes, max_tokens, factor, min_prob);
  }

  int max_depth() const { return max_depth_; }
  int64_t num_nodes() const { return static_cast<int64_t>(counts_.size()); }

 protected:
  struct Child {
    int token;
    int node;
  };

  static uint64_t key(int node, int token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(node)) << 32) |
           static_cast<uint32_t>(token);
  }

  int find(int node, int token) const {
    auto found = edges_.find(key(node, token));
    return found == edges_.end() ? -1 : found->second;
  }

  int make_child(int node, int token) {  // count 0, no children
    int child;
    if (!free_nodes_.empty()) {
      child = free_nodes_.back();
      free_nodes_.pop_back();
      counts_[child] = 0;
    } else {
      child = static_cast<int>(counts_.size());
      counts_.push_back(0);
      children_.emplace_back();
    }
    children_[node].push_back({token, child});
    edges_.emplace(key(node, token), child);
    return child;
  }

  void remove_child(int node, int token) {
    auto& kids = children_[node];
    kids.erase(std::find_if(kids.begin(), kids.end(),
                            [token](const Child& c) { return c.token == token; }));
    edges_.erase(key(node, token));
  }

  void free_subtree(int root) {
    std::vector<int> stack{root};
    while (!stack.empty()) {
      const int node = stack.back();
      stack.pop_back();
      for (const Child& c : children_[node]) {
        edges_.erase(key(node, c.token));
        stack.push_back(c.node);
      }
      children_[node].clear();
      free_nodes_.push_back(node);
    }
  }

  // Of the drafts after each matched suffix (`nodes`, of lengths 1, 2, ...), the best: the
  // highest score, ties to the longer match; walks go highest possible score first and stop
  // once none left can win (suffix.py's `best_draft`).
  Draft best_draft(const std::vector<int>& nodes, int max_tokens, double factor,
                   double min_prob) const {
    std::vector<std::pair<int, int>> bounds;  // (the most a draft can score, match length)
    for (int match_len = 1; match_len <= static_cast<int>(nodes.size()); ++match_len) {
      const int limit = std::min(max_tokens, static_cast<int>(factor * match_len));
      bounds.emplace_back(std::min(limit, max_depth_ - match_len), match_len);
    }
    std::sort(bounds.begin(), bounds.end(), std::greater<>());
    Draft best{{}, 0.0};
    int best_len = 0;
    for (const auto& [bound, match_len] : bounds) {
      if (bound <= 0 || bound < best.second || (bound == best.second && match_len < best_len)) {
        break;
      }
      const int limit = std::min(max_tokens, static_cast<int>(factor * match_len));
      Draft drafted = follow_likeliest(nodes[match_len - 1], limit, min_prob);
      if (drafted.second > best.second ||
          (drafted.second == best.second && best.second > 0 && match_len > best_len)) {
        best = std::move(drafted);
        best_len = match_len;
      }
    }
    return best;
  }

  // Walks down the most frequent child (the first made, of equals) while the running
  // probability holds.
  Draft follow_likeliest(int node, int limit, double min_prob) const {
    Draft drafted{{}, 0.0};
    double prob = 1.0;
    while (static_cast<int>(drafted.first.size()) < limit && !children_[node].empty()) {
      const Child* likeliest = &children_[node][0];
      for (const Child& c : children_[node]) {
        if (counts_[c.node] > counts_[likeliest->node]) likeliest = &c;
      }
      prob *= static_cast<double>(counts_[likeliest->node]) / static_cast<double>(counts_[node]);
      if (prob < min_prob) break;
      drafted.first.push_back(likeliest->token);
      drafted.second += prob;
      node = likeliest->node;
    }
    return drafted;
  }

  int max_depth_;
  std::vector<int64_t> counts_;             // [node]
  std::vector<std::vector<Child>> children_;  // [node]: in the order they were made
  std::unordered_map<uint64_t, int> edges_;  // (node, token) -> child
  std::vector<int> free_nodes_;              // removed nodes, made again first
};

// A request's own trie, extended token by token: the nodes of its sequence's suffixes stay
// open, so extending counts one child of each and drafting needs no walk from the root.
class GrowingSuffixTrie : public SuffixTrie {
 public:
  using SuffixTrie::SuffixTrie;

  void extend(const std::vector<int>& tokens) {
    const size_t keep = static_cast<size_t>(max_depth_ - 1);
    std::vector<int> nodes, opened;
    for (const int token : tokens) {
      nodes.assign(1, 0);
      nodes.insert(nodes.end(), open_nodes_.begin(), open_nodes_.end());
      opened.clear();
      size_t i = 0;
      for (; i < nodes.size(); ++i) {  // shortest suffix first
        const int child = find(nodes[i], token);
        if (child < 0) break;  // then every longer one is new too
        counts_[child] += 1;
        opened.push_back(child);
      }
      for (; i < nodes.size(); ++i) {
        const int child = make_child(nodes[i], token);
        counts_[child] = 1;
        opened.push_back(child);
      }
      if (opened.size() > keep) opened.resize(keep);
      open_nodes_.swap(opened);
      ++num_tokens_;
    }
  }

  // `draft` after this trie's own sequence: from its suffixes seen before (a suffix counted
  // once is the sequence's end, with nothing after it; longer suffixes are counted no more).
  Draft draft_after_own(int max_tokens, double factor, double min_prob) const {
    size_t num_seen_before = open_nodes_.size();
    while (num_seen_before > 0 && counts_[open_nodes_[num_seen_before - 1]] < 2) {
      --num_seen_before;
    }
    const std::vector<int> nodes(open_nodes_.begin(), open_nodes_.begin() + num_seen_before);
    return best_draft(nodes, max_tokens, factor, min_prob);
  }

  int64_t num_tokens() const { return num_tokens_; }

 private:
  std::vector<int> open_nodes_;  // suffixes of 1 .. max_depth - 1 tokens
  int64_t num_tokens_ = 0;
};

}  // namespace

void bind_suffix_tries(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<SuffixTrie>(m, "SuffixTrie",
                         "Counts of every substring of at most max_depth tokens (suffix.py's)")
      .def(py::init<int>(), py::arg("max_depth"))
      .def("add", &SuffixTrie::add, py::arg("token_ids"), py::arg("sign") = 1,
           py::arg("first") = 0, py::arg("end") = py::none(),
           "count (1) or uncount (-1) the substrings starting at first .. end - 1")
      .def("draft", &SuffixTrie::draft, py::arg("context"), py::arg("max_tokens"),
           py::arg("factor"), py::arg("min_prob"), "(draft, score) after context's suffixes")
      .def_property_readonly("max_depth", &SuffixTrie::max_depth)
      .def_property_readonly("num_nodes", &SuffixTrie::num_nodes);
  py::class_<GrowingSuffixTrie, SuffixTrie>(m, "GrowingSuffixTrie",
                                            "A request's own trie, extended token by token")
      .def(py::init<int>(), py::arg("max_depth"))
      .def("extend", &GrowingSuffixTrie::extend, py::arg("token_ids"),
           "count the substrings that end at each new token")
      .def("draft_after_own", &GrowingSuffixTrie::draft_after_own, py::arg("max_tokens"),
           py::arg("factor"), py::arg("min_prob"), "(draft, score) after its own sequence")
      .def_property_readonly("num_tokens", &GrowingSuffixTrie::num_tokens);
}
