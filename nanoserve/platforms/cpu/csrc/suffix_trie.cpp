// Suffix decoding's tries in C++: spec_decode/suffix.py's SuffixTrie and GrowingSuffixTrie,
// count for count and draft for draft, without Python's ~0.25 us a node (24 nodes a token).
//
// A node is an index into flat arrays: its count, the token on the edge into it, and its
// children as a list in the order they were made (as Python's dicts keep them: a walk takes
// the first of the most frequent children). `EdgeTable` finds a child by (node, token). Nothing
// is allocated per node, so that making and dropping a request's trie (thousands of nodes) is
// a few large allocations, not thousands of small ones.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace {

using Draft = std::pair<std::vector<int>, double>;  // tokens, expected accepted tokens

// (node, token) -> child node: open addressing with linear probing; removed keys leave a
// tombstone until the table is rebuilt.
class EdgeTable {
 public:
  EdgeTable() { rebuild(MIN_SLOTS); }

  int find(uint64_t key) const {
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return values_[i];
      if (keys_[i] == EMPTY) return -1;
    }
  }

  void insert(uint64_t key, int value) {  // the key is absent
    if (2 * (used_ + 1) > keys_.size()) {
      rebuild(std::max(MIN_SLOTS, 4 * live_ + 4 > keys_.size() ? 2 * keys_.size() : keys_.size()));
    }
    size_t i = slot(key);
    while (keys_[i] != EMPTY && keys_[i] != TOMBSTONE) i = (i + 1) & mask_;
    used_ += keys_[i] == EMPTY;
    keys_[i] = key;
    values_[i] = value;
    ++live_;
  }

  void erase(uint64_t key) {  // the key is present
    size_t i = slot(key);
    while (keys_[i] != key) i = (i + 1) & mask_;
    keys_[i] = TOMBSTONE;
    --live_;
  }

 private:
  static constexpr uint64_t EMPTY = ~0ULL, TOMBSTONE = ~0ULL - 1;  // no key is either
  static constexpr size_t MIN_SLOTS = 1024;

  size_t slot(uint64_t key) const {  // splitmix64's finalizer
    key = (key ^ (key >> 30)) * 0xbf58476d1ce4e5b9ULL;
    key = (key ^ (key >> 27)) * 0x94d049bb133111ebULL;
    return static_cast<size_t>(key ^ (key >> 31)) & mask_;
  }

  void rebuild(size_t num_slots) {  // a power of two; the live keys only
    std::vector<uint64_t> keys(num_slots, EMPTY);
    std::vector<int> values(num_slots);
    keys.swap(keys_);
    values.swap(values_);
    mask_ = num_slots - 1;
    used_ = live_ = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != EMPTY && keys[i] != TOMBSTONE) insert(keys[i], values[i]);
    }
  }

  std::vector<uint64_t> keys_;
  std::vector<int> values_;
  size_t mask_ = 0, used_ = 0, live_ = 0;  // used: live keys and tombstones
};

class SuffixTrie {
 public:
  explicit SuffixTrie(int max_depth) : max_depth_(max_depth) { new_node(); }  // the root
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
          remove_child(node, child);
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
  static uint64_t key(int node, int token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(node)) << 32) |
           static_cast<uint32_t>(token);
  }

  int find(int node, int token) const { return edges_.find(key(node, token)); }

  int new_node() {  // count 0, no children: a freed one if any
    if (!free_nodes_.empty()) {
      const int node = free_nodes_.back();
      free_nodes_.pop_back();
      counts_[node] = 0;
      first_child_[node] = last_child_[node] = next_sibling_[node] = -1;
      return node;
    }
    counts_.push_back(0);
    token_.push_back(-1);
    first_child_.push_back(-1);
    last_child_.push_back(-1);
    next_sibling_.push_back(-1);
    return static_cast<int>(counts_.size()) - 1;
  }

  int make_child(int node, int token) {  // the last of node's children
    const int child = new_node();
    token_[child] = token;
    if (last_child_[node] < 0) {
      first_child_[node] = child;
    } else {
      next_sibling_[last_child_[node]] = child;
    }
    last_child_[node] = child;
    edges_.insert(key(node, token), child);
    return child;
  }

  void remove_child(int node, int child) {
    int before = -1;
    for (int c = first_child_[node]; c != child; c = next_sibling_[c]) before = c;
    (before < 0 ? first_child_[node] : next_sibling_[before]) = next_sibling_[child];
    if (last_child_[node] == child) last_child_[node] = before;
    edges_.erase(key(node, token_[child]));
  }

  void free_subtree(int root) {
    std::vector<int> stack{root};
    while (!stack.empty()) {
      const int node = stack.back();
      stack.pop_back();
      for (int c = first_child_[node]; c >= 0; c = next_sibling_[c]) {
        edges_.erase(key(node, token_[c]));
        stack.push_back(c);
      }
      first_child_[node] = last_child_[node] = -1;
      free_nodes_.push_back(node);
    }
  }

  // The longest draft after a match of `match_len` tokens: min(max_tokens, int(factor * m)),
  // the minimum taken before the conversion (so that no factor overflows an int).
  static int draft_limit(int max_tokens, double factor, int match_len) {
    return static_cast<int>(std::min<double>(max_tokens, factor * match_len));
  }

  // Of the drafts after each matched suffix (`nodes`, of lengths 1, 2, ...), the best: the
  // highest score, ties to the longer match; walks go highest possible score first and stop
  // once none left can win (suffix.py's `best_draft`).
  Draft best_draft(const std::vector<int>& nodes, int max_tokens, double factor,
                   double min_prob) const {
    std::vector<std::pair<int, int>> bounds;  // (the most a draft can score, match length)
    for (int match_len = 1; match_len <= static_cast<int>(nodes.size()); ++match_len) {
      const int limit = draft_limit(max_tokens, factor, match_len);
      bounds.emplace_back(std::min(limit, max_depth_ - match_len), match_len);
    }
    std::sort(bounds.begin(), bounds.end(), std::greater<>());
    Draft best{{}, 0.0};
    int best_len = 0;
    for (const auto& [bound, match_len] : bounds) {
      if (bound <= 0 || bound < best.second || (bound == best.second && match_len < best_len)) {
        break;
      }
      const int limit = draft_limit(max_tokens, factor, match_len);
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
    while (static_cast<int>(drafted.first.size()) < limit && first_child_[node] >= 0) {
      int likeliest = first_child_[node];
      for (int c = next_sibling_[likeliest]; c >= 0; c = next_sibling_[c]) {
        if (counts_[c] > counts_[likeliest]) likeliest = c;
      }
      prob *= static_cast<double>(counts_[likeliest]) / static_cast<double>(counts_[node]);
      if (prob < min_prob) break;
      drafted.first.push_back(token_[likeliest]);
      drafted.second += prob;
      node = likeliest;
    }
    return drafted;
  }

  int max_depth_;
  std::vector<int64_t> counts_;  // [node]
  std::vector<int> token_;        // [node]: the token on the edge into it
  std::vector<int> first_child_, last_child_, next_sibling_;  // [node]: children, made order
  EdgeTable edges_;
  std::vector<int> free_nodes_;  // removed nodes, made again first
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
