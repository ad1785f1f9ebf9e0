// The Domino chain (drafters/domino.DominoDrafter.chain) as one C++ call: per depth the argmax of
// base + W2 z over every column, exact, scoring only the columns that can win.
//
// From Python a depth costs ~0.7 ms: ~40 tensor calls, several of them over the whole 49k-token
// vocabulary (the bound, its comparison, nonzero, gathers). Here a depth is one product for
// W2Bound's bound on every column,
//   W2_v z = U_v . P^T z + R_v . z <= U_v . P^T z + |R_v| |z - P P^T z|,
// one pass that scores exactly (128 terms) only the columns whose bound reaches the best top-M
// candidate's corrected logit, and the GRU step, with trees/fast.py's ops (head_ops.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "head_ops.h"

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using at::indexing::Slice;

// a dot product with eight partial sums: the compiler can keep them in one vector register
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// base [D, N] float32 logits (N: every token, or a draft vocabulary's columns); cands [D, M] the
// columns of each row's top-M (the log-prob labels are normalised over them); hidden [D, h];
// w2 [N, r], u [N, k], res_norms [N]: W2Bound's split restricted to the columns;
// p [r, k]; col_ids [N] the token id of each column (empty: the column is the token id); the GRU
// input table as the builder's.
// Returns (columns [depth], log-prob labels [depth] float32, exactly scored columns [depth]).
std::tuple<Tensor, Tensor, Tensor> chain(
    const Tensor& base, const Tensor& cands, const Tensor& hidden, const Tensor& w1_h, const Tensor& s_proj,
    const Tensor& w2, const Tensor& u, const Tensor& res_norms, const Tensor& p,
    const Tensor& col_ids, Tensor table, Tensor ready, const Tensor& embed, const Tensor& w_ih, int64_t block,
    const Tensor& root_row, int64_t prefix_len, int64_t depth) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(base.dim() == 2 && base.scalar_type() == at::kFloat && base.is_contiguous(),
              "domino_chain: base logits must be contiguous float32 [D, N]");
  TORCH_CHECK(depth <= base.size(0) && depth <= hidden.size(0), "domino_chain: depth beyond the draft");
  const int64_t N = base.size(1), M = cands.size(1), r = w2.size(1), k = p.size(1), G = s_proj.size(1);
  TORCH_CHECK(w2.size(0) == N && u.size(0) == N && res_norms.size(0) == N &&
                  (col_ids.numel() == 0 || col_ids.size(0) == N) && u.size(1) == k && p.size(0) == r,
              "domino_chain: the head's columns do not match the logits");
  for (const Tensor* t : {&w2, &u, &res_norms, &p})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "domino_chain: float32 contiguous weights");

  const float* W2 = w2.data_ptr<float>();
  Tensor cand_cols = cands.to(at::kLong).contiguous();
  Tensor ids = col_ids.to(at::kLong).contiguous();
  Tensor zh = depth > prefix_len ? at::linear(hidden.index({Slice(0, depth)}).to(at::kFloat), w1_h) : Tensor();

  std::vector<int64_t> cols(depth), scored(depth, 0);
  std::vector<float> logps(depth);
  std::vector<float> corr(M);
  Tensor row = root_row.unsqueeze(0);            // [1, r + 3G + G]: [W1_s s | W_hh s | s]
  for (int64_t d = 0; d < depth; ++d) {
    const float* b = base.data_ptr<float>() + d * N;
    int64_t best_col;
    if (d < prefix_len) {                        // the head does not correct the first depths
      Tensor lp = at::log_softmax(base[d], -1);
      best_col = at::argmax(base[d]).item<int64_t>();
      logps[d] = lp[best_col].item<float>();
    } else {
      Tensor zt = at::silu(row.index({0, Slice(0, r)}) + zh[d]).contiguous();
      const float* z = zt.data_ptr<float>();
      const int64_t* cc = cand_cols.data_ptr<int64_t>() + d * M;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < M; ++j) {
        corr[j] = b[cc[j]] + dot(W2 + cc[j] * r, z, r);
        best = std::max(best, corr[j]);
      }
      // W2Bound.upper for every column in one product: base + U P^T z + |R_v| |z - P P^T z|
      Tensor zp = at::mv(p.t(), zt);
      const float perp = at::linalg_vector_norm(zt - at::mv(p, zp)).item<float>();
      Tensor upper = at::addmv(at::add(base[d], res_norms, perp), u, zp);
      const float* up = upper.data_ptr<float>();
      // rounding slack, as corrected_argmax's: a column whose bound misses by less is scored anyway
      const float floor = best - 1e-4f * (1.f + std::fabs(best));
      float top = -std::numeric_limits<float>::infinity();
      best_col = -1;
      int64_t n_scored = 0;
      for (int64_t v = 0; v < N; ++v) {
        if (up[v] < floor) continue;
        const float s = b[v] + dot(W2 + v * r, z, r);
        ++n_scored;
        if (s > top) {                           // strictly: ties keep the lowest column
          top = s;
          best_col = v;
        }
      }
      if (best_col < 0) best_col = at::argmax(base[d]).item<int64_t>();   // every logit -inf or NaN
      scored[d] = n_scored;
      double m = -std::numeric_limits<double>::infinity(), sum = 0.0;
      for (int64_t j = 0; j < M; ++j) m = std::max(m, static_cast<double>(corr[j]));
      for (int64_t j = 0; j < M; ++j) sum += std::exp(static_cast<double>(corr[j]) - m);
      const double lse = m + std::log(sum);
      logps[d] = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < M; ++j)
        if (cc[j] == best_col) logps[d] = static_cast<float>(corr[j] - lse);
    }
    cols[d] = best_col;
    if (d + 1 < depth) {                         // the state after this depth's token
      const int64_t token = ids.numel() ? ids.data_ptr<int64_t>()[best_col] : best_col;
      Tensor gi = dominotree_native::input_rows({token}, table, ready, embed, w_ih, block);
      Tensor state = dominotree_native::gru(gi, row.index({Slice(), Slice(r, r + 3 * G)}),
                                            row.index({Slice(), Slice(r + 3 * G)}), G);
      row = dominotree_native::node_rows(state, s_proj);
    }
  }
  return {at::tensor(cols, at::kLong), at::tensor(logps, at::kFloat), at::tensor(scored, at::kLong)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dominotree_native, m) {
  m.def(
      "domino_chain(Tensor base, Tensor cands, Tensor hidden, Tensor w1_h, Tensor s_proj, Tensor w2, Tensor u, "
        "Tensor res_norms, Tensor p, Tensor col_ids, Tensor table, Tensor ready, Tensor embed, "
        "Tensor w_ih, int block, Tensor root_row, int prefix_len, int depth) -> (Tensor, Tensor, Tensor)",
      &chain);
}
