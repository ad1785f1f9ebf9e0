// DominoTree's fast builder (trees/fast.py) as one C++ call: the same heap, the same batches and
// the same ATen ops on the same shapes, so the scores are bit-identical to the Python fast builder
// and the trees are its trees. What it removes is the interpreter: ~25 small tensor calls per
// batch cost ~4-5 us each from Python and ~1 us from here, and the heap bookkeeping moves too.
//
// It covers the published setting: path conditioning, top-M candidates, "topm" normalisation, a
// weight-matrix embedding. trees/native/__init__.py falls back to the Python builder for everything else.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "head_ops.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using at::Tensor;
using at::indexing::Slice;

struct Entry {            // a heap entry, ordered as Python's tuples (-score, counter, ...)
  double neg;
  int64_t id;             // insertion counter: unique, so (neg, id) is a total order
  int64_t tok, depth, parent;
  bool operator<(const Entry& o) const { return neg < o.neg || (neg == o.neg && id < o.id); }
};
struct Later {            // std heaps keep the largest on top; this puts the smallest there
  bool operator()(const Entry& a, const Entry& b) const { return b < a; }
};

struct Kids {
  std::vector<int64_t> toks;
  std::vector<double> lps;
};

// CondAdaptive's throughput stop (trees/dominotree.path_probability_stop) on a tabulated cost:
// cost[n] = C_draft + C_verify(n, context).
struct ThroughputStop {
  const double* cost = nullptr;
  int64_t size = 0;
  double phi = 0.0, theta = 0.0;
  bool active() const { return cost != nullptr; }
  bool operator()(int64_t n, double score) {
    double delta = std::exp(score);
    double next = (1.0 + phi + delta) / cost[std::min(n + 1, size - 1)];
    if (next <= theta) return true;
    phi += delta;
    theta = next;
    return false;
  }
};

std::vector<int64_t> to_longs(const Tensor& t) {
  Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}
std::vector<double> to_doubles(const Tensor& t) {   // float32 values, widened exactly (as tolist())
  Tensor c = t.contiguous();
  const float* p = c.data_ptr<float>();
  return std::vector<double>(p, p + c.numel());
}

class Builder {
 public:
  Builder(const Tensor& base_logits, const Tensor& hidden, const Tensor& cands, const Tensor& cand_logits,
          const Tensor& w1_h, const Tensor& s_proj, const Tensor& w2, const Tensor& table,
          const Tensor& ready, const Tensor& embed, const Tensor& w_ih, int64_t block, int64_t node_topk,
          int64_t prefix_len, int64_t depth_limit)
      : r_(w2.size(1)), G_(s_proj.size(1)), k_(std::min<int64_t>(node_topk, cands.size(1))), M_(cands.size(1)),
        base_(base_logits), cands_(cands), cand_logits_(cand_logits), w_ih_(w_ih), table_(table), ready_(ready),
        embed_(embed), s_proj_(s_proj), block_(block), prefix_len_(prefix_len), D_(depth_limit) {
    if (D_ > 0) {
      zh_ = at::linear(hidden.index({Slice(0, D_)}), w1_h);
      base_c_ = cand_logits.index({Slice(0, D_)});
      w2_c_ = w2.index_select(0, cands.index({Slice(0, D_)}).reshape(-1));
      w2_d_ = w2_c_.view({-1, M_, r_});
    }
    for (int64_t d = 1; d <= std::min(prefix_len_, D_); ++d) prefix_kids_[d] = marginal(d);
  }

  // fast.marginal_children with the row's top-M candidates (M >= node_topk)
  Kids marginal(int64_t d) {
    Tensor ids = cands_[d - 1].index({Slice(0, k_)});
    Tensor lp = cand_logits_[d - 1].index({Slice(0, k_)}) - at::logsumexp(base_[d - 1], -1);
    return {to_longs(ids), to_doubles(lp)};
  }

  Tensor input_rows(const std::vector<int64_t>& toks) {
    return dominotree_native::input_rows(toks, table_, ready_, embed_, w_ih_, block_);
  }
  Tensor gru(const Tensor& gi, const Tensor& gh, const Tensor& state) {
    return dominotree_native::gru(gi, gh, state, G_);
  }
  Tensor node_rows(const Tensor& states) { return dominotree_native::node_rows(states, s_proj_); }

  // fast.expand: children at the given child depths of parents whose W1_s s rows are zs
  std::vector<Kids> expand(const Tensor& zs, const std::vector<int64_t>& child_depths) {
    std::vector<Kids> out(child_depths.size());
    std::vector<int64_t> rows;
    for (size_t i = 0; i < child_depths.size(); ++i) {
      if (child_depths[i] <= prefix_len_) out[i] = prefix_kids_.at(child_depths[i]);
      else rows.push_back(static_cast<int64_t>(i));
    }
    if (rows.empty()) return out;
    bool one_depth = true;
    for (int64_t i : rows) one_depth = one_depth && child_depths[i] == child_depths[rows[0]];
    Tensor ids, vals;
    if (one_depth) {
      int64_t d = child_depths[rows[0]] - 1;
      Tensor picked = static_cast<int64_t>(rows.size()) == zs.size(0) ? zs : zs.index({at::tensor(rows, at::kLong)});
      Tensor z = at::silu(picked + zh_[d]);
      Tensor corrected = at::linear(z, w2_d_[d], base_c_[d]);
      auto best = at::topk(at::log_softmax(corrected, -1), k_, -1);
      ids = cands_[d].index({std::get<1>(best)});
      vals = std::get<0>(best);
    } else {
      std::vector<int64_t> dv;
      for (int64_t i : rows) dv.push_back(child_depths[i] - 1);
      Tensor di = at::tensor(dv, at::kLong);
      Tensor picked = zs.index({at::tensor(rows, at::kLong)});
      Tensor z = at::silu(zh_.index({di}) + picked);
      int64_t n = static_cast<int64_t>(rows.size());
      Tensor every = at::linear(z, w2_c_).view({n, D_, M_});
      Tensor corrected = base_c_.index({di}) + every.index({at::arange(n), di});
      auto best = at::topk(at::log_softmax(corrected, -1), k_, -1);
      ids = at::gather(cands_.index({di}), 1, std::get<1>(best));
      vals = std::get<0>(best);
    }
    std::vector<int64_t> flat_ids = to_longs(ids);
    std::vector<double> flat_vals = to_doubles(vals);
    for (size_t j = 0; j < rows.size(); ++j) {
      Kids& kid = out[rows[j]];
      kid.toks.assign(flat_ids.begin() + j * k_, flat_ids.begin() + (j + 1) * k_);
      kid.lps.assign(flat_vals.begin() + j * k_, flat_vals.begin() + (j + 1) * k_);
    }
    return out;
  }

  int64_t r_ = 0, G_ = 0, k_ = 0, M_ = 0;

 private:
  Tensor base_, cands_, cand_logits_, w_ih_, table_, ready_, embed_, s_proj_, zh_, base_c_, w2_c_, w2_d_;
  int64_t block_, prefix_len_, D_;
  std::unordered_map<int64_t, Kids> prefix_kids_;
};

std::tuple<Tensor, Tensor, Tensor, Tensor> build(
    const Tensor& base_logits, const Tensor& hidden, const Tensor& cands, const Tensor& cand_logits,
    const Tensor& w1_h, const Tensor& s_proj, const Tensor& w2, const Tensor& table, const Tensor& ready,
    const Tensor& embed, const Tensor& w_ih, int64_t block, const Tensor& root_row, int64_t root_token, int64_t budget,
    int64_t node_topk, int64_t prefix_len, int64_t depth_limit, int64_t lookahead, const Tensor& stop_cost) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(base_logits.dim() == 2 && cands.dim() == 2 && cand_logits.sizes() == cands.sizes(),
              "dominotree_builder: base_logits [D, N], cands and cand_logits [D, M]");
  TORCH_CHECK(cands.size(1) >= node_topk, "dominotree_builder: corr_topm must be >= node_topk");
  const int64_t D = depth_limit;
  Builder b(base_logits, hidden, cands, cand_logits, w1_h, s_proj, w2, table, ready, embed, w_ih, block,
            node_topk, prefix_len, D);
  const int64_t r = b.r_, G = b.G_;

  ThroughputStop stop;
  Tensor cost = stop_cost.to(at::kDouble).contiguous();
  if (cost.numel() > 0) {
    stop.cost = cost.data_ptr<double>();
    stop.size = cost.numel();
    stop.theta = 1.0 / stop.cost[0];
  }

  std::vector<int64_t> tokens{root_token}, parents{-1}, depths{0};
  std::vector<double> scores{0.0};
  std::vector<Tensor> rows_of{root_row};   // undefined: the node has no children
  std::unordered_map<int64_t, std::pair<Tensor, Kids>> cache;   // heap entry id -> (row, children)
  std::vector<Entry> heap;
  int64_t counter = 0;
  auto push = [&](double neg, int64_t tok, int64_t depth, int64_t parent) {
    heap.push_back({neg, counter++, tok, depth, parent});
    std::push_heap(heap.begin(), heap.end(), Later());
  };
  if (D >= 1) {
    Kids first = b.expand(rows_of[0].index({Slice(0, r)}).unsqueeze(0), {1})[0];
    for (size_t i = 0; i < first.toks.size(); ++i) push(-first.lps[i], first.toks[i], 1, 0);
  }
  while (!heap.empty() && static_cast<int64_t>(tokens.size()) - 1 < budget) {
    std::pop_heap(heap.begin(), heap.end(), Later());
    Entry e = heap.back();
    heap.pop_back();
    if (stop.active() && stop(static_cast<int64_t>(tokens.size()) - 1, -e.neg)) break;
    int64_t room = budget - (static_cast<int64_t>(tokens.size()) - 1);
    if (!cache.count(e.id) && room > 1) {   // the budget's last node needs no state or children
      std::vector<Entry> batch{e};
      int64_t more = std::min<int64_t>(std::min(lookahead, room) - 1, static_cast<int64_t>(heap.size()));
      if (more > 0) {   // heapq.nsmallest: the best entries still on the heap, best first
        std::vector<Entry> rest(heap);
        std::partial_sort(rest.begin(), rest.begin() + more, rest.end());
        batch.insert(batch.end(), rest.begin(), rest.begin() + more);
      }
      std::vector<Entry> todo;
      for (const Entry& x : batch)
        if (!cache.count(x.id) && x.depth < D) todo.push_back(x);   // depth-limit nodes have no children
      if (!todo.empty()) {
        std::vector<Tensor> par_rows;
        std::vector<int64_t> toks, child_depths;
        for (const Entry& x : todo) {
          par_rows.push_back(rows_of[x.parent]);
          toks.push_back(x.tok);
          child_depths.push_back(x.depth + 1);
        }
        Tensor par = at::stack(par_rows);
        Tensor new_rows = b.node_rows(b.gru(b.input_rows(toks), par.index({Slice(), Slice(r, r + 3 * G)}),
                                            par.index({Slice(), Slice(r + 3 * G)})));
        std::vector<Kids> kids = b.expand(new_rows.index({Slice(), Slice(0, r)}), child_depths);
        for (size_t i = 0; i < todo.size(); ++i) cache[todo[i].id] = {new_rows[i], std::move(kids[i])};
      }
    }
    int64_t idx = static_cast<int64_t>(tokens.size());
    tokens.push_back(e.tok);
    parents.push_back(e.parent);
    depths.push_back(e.depth);
    scores.push_back(-e.neg);
    auto hit = cache.find(e.id);
    if (hit == cache.end()) {
      rows_of.emplace_back();
      continue;
    }
    rows_of.push_back(hit->second.first);
    const Kids& kids = hit->second.second;
    for (size_t i = 0; i < kids.toks.size(); ++i) push(e.neg - kids.lps[i], kids.toks[i], e.depth + 1, idx);
    cache.erase(hit);
  }
  auto longs = [](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); };
  return {longs(tokens), longs(parents), longs(depths), at::tensor(scores, at::kDouble).to(at::kFloat)};
}

}  // namespace

TORCH_LIBRARY(dominotree_native, m) {
  m.def(
      "build_dominotree(Tensor base_logits, Tensor hidden, Tensor cands, Tensor cand_logits, Tensor w1_h, "
        "Tensor s_proj, Tensor w2, Tensor table, Tensor ready, Tensor embed, Tensor w_ih, int block, "
        "Tensor root_row, int root_token, int budget, int node_topk, int prefix_len, int depth_limit, int lookahead, "
        "Tensor stop_cost) -> (Tensor, Tensor, Tensor, Tensor)",
      &build);
}
