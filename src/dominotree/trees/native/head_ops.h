// The Domino head's per-node steps shared by the native DominoTree builder and the native Domino
// chain: the same ATen ops on the same shapes as trees/fast.py, so both agree with it bit for bit.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace dominotree_native {

using at::Tensor;
using at::indexing::Slice;

// GruInputs.rows: W_ih e(t) from the kept table, computing any missing block of `block` ids first
inline Tensor input_rows(const std::vector<int64_t>& toks, Tensor& table, Tensor& ready, const Tensor& embed,
                         const Tensor& w_ih, int64_t block) {
  uint8_t* done = ready.data_ptr<uint8_t>();
  std::vector<int64_t> blocks;
  for (int64_t t : toks) blocks.push_back(t / block);
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  for (int64_t b : blocks) {
    if (done[b]) continue;
    int64_t lo = b * block, hi = std::min((b + 1) * block, embed.size(0));
    table.index_put_({Slice(lo, hi)}, at::linear(embed.index({Slice(lo, hi)}).to(at::kFloat), w_ih));
    done[b] = 1;
  }
  return table.index({at::tensor(toks, at::kLong)});
}

// fast.gru_from_halves: gi = W_ih x, gh = W_hh state, gate order r, z, n
inline Tensor gru(const Tensor& gi, const Tensor& gh, const Tensor& state, int64_t G) {
  Tensor rz = at::sigmoid(gi.index({Slice(), Slice(0, 2 * G)}) + gh.index({Slice(), Slice(0, 2 * G)}));
  Tensor n = at::tanh(at::addcmul(gi.index({Slice(), Slice(2 * G)}), rz.index({Slice(), Slice(0, G)}),
                                  gh.index({Slice(), Slice(2 * G)})));
  return at::lerp(n, state, rz.index({Slice(), Slice(G)}));
}

// fast.node_rows: [W1_s s | W_hh s | s]
inline Tensor node_rows(const Tensor& states, const Tensor& s_proj) {
  return at::cat({at::linear(states, s_proj), states}, 1);
}

}  // namespace dominotree_native
