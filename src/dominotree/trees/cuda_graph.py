"""DominoTree builder for CUDA: the heap stays on the host, each pop replays one captured graph.

Per round the shared tensors (top-M candidates, their base logits and W2 rows, W1_h H_d) are
written into static buffers; per pop the graph runs the popped node's GRU step and scores its
children (one replay, one small device-to-host copy). The pop order, tokens and parents are
those of trees/dominotree.build_dominotree; `scripts/check_cuda_builder.py` checks that on a GPU
and times both, and tests/test_cuda_graph.py runs the same per-pop step eagerly on the CPU
(device="cpu": no graph) as well as captured on a GPU."""
from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F

from ..drafters.domino import gru_cell
from .fast import HeadWeights
from .tree import DraftTree


class CudaGraphDominoBuilder:
    def __init__(self, head, embed_weight: torch.Tensor, node_topk: int = 8, corr_topm: int = 64,
                 max_depth: int = 16, max_nodes: int = 256, device: str = "cuda"):
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CudaGraphDominoBuilder needs a CUDA device")
        w = HeadWeights(head)
        self.w_ih, self.w_hh = w.w_ih.to(dev), w.w_hh.to(dev)
        self.w1_h, self.w1_s, self.w2 = w.w1_h.to(dev), w.w1_s.to(dev), w.w2.to(dev)
        self.embed = embed_weight.detach().float().to(dev)
        self.k, self.M, self.D, self.dev = node_topk, corr_topm, max_depth, dev
        G, r = self.w_hh.shape[1], self.w2.shape[1]
        z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=dev)
        # per-round buffers
        self.cands, self.base_c = z(max_depth, corr_topm, dt=torch.long), z(max_depth, corr_topm)
        self.w2_c, self.zh = z(max_depth, corr_topm, r), z(max_depth, r)
        # per-pop inputs and outputs; the last state row is scratch for the warm-up steps
        self.states = z(max_nodes + 2, G)
        self.scratch = max_nodes + 1
        self.parent, self.slot = z(1, dt=torch.long), z(1, dt=torch.long)
        self.tok, self.depth = z(1, dt=torch.long), z(1, dt=torch.long)
        self.out = z(2, node_topk)   # row 0: token ids (as float), row 1: log-probs
        self.graph, self.ready = None, False

    def _step(self):
        s_par = self.states.index_select(0, self.parent)
        x = self.embed.index_select(0, self.tok)
        s = gru_cell(s_par, x, self.w_ih, self.w_hh)
        self.states.index_copy_(0, self.slot, s)
        zz = F.silu(self.zh.index_select(0, self.depth) + F.linear(s, self.w1_s))
        corrected = self.base_c.index_select(0, self.depth) + torch.einsum(
            "nr,nmr->nm", zz, self.w2_c.index_select(0, self.depth))
        top = torch.topk(torch.log_softmax(corrected, -1), self.k, dim=-1)
        ids = torch.gather(self.cands.index_select(0, self.depth), 1, top.indices)
        self.out.copy_(torch.cat([ids.float(), top.values], 0))

    def _prepare(self):
        """Warm-up steps (they run for real, so they write the scratch row, not a node's state),
        then the capture on a GPU. Runs before a build writes its root state."""
        self.parent.fill_(self.scratch)
        self.slot.fill_(self.scratch)
        self.ready = True
        if self.dev.type != "cuda":
            for _ in range(2):
                self._step()     # the same warm-up, so the CPU test covers what it writes
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()     # warm-up before capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    @torch.inference_mode()
    def build(self, base_logits, hidden, root_token: int, budget: int, prefix_len: int = 1,
              max_depth: int | None = None) -> DraftTree:
        if not self.ready:
            self._prepare()
        base_logits, hidden = base_logits.to(self.dev).float(), hidden.to(self.dev).float()
        D = min(base_logits.shape[0], self.D if max_depth is None else max_depth)
        cands = torch.topk(base_logits[:D], self.M, dim=-1).indices
        self.cands[:D] = cands
        self.base_c[:D] = torch.gather(base_logits[:D], 1, cands)
        self.w2_c[:D] = self.w2[cands]
        self.zh[:D] = F.linear(hidden[:D], self.w1_h)
        prefix = {}
        for d in range(1, min(prefix_len, D) + 1):
            top = torch.topk(torch.log_softmax(base_logits[d - 1], -1), self.k)
            prefix[d] = (top.indices.tolist(), top.values.tolist())
        # root state = one GRU step from zero over the root token (slot 0)
        zero = torch.zeros(1, self.w_hh.shape[1], device=self.dev)
        self.states[0] = gru_cell(zero, self.embed[root_token][None], self.w_ih, self.w_hh)[0]

        def children_of(node_slot, parent_slot, token, child_depth):
            """Replay: state of `node_slot` from its parent, then its children at child_depth."""
            self.parent.fill_(parent_slot)
            self.slot.fill_(node_slot)
            self.tok.fill_(token)
            self.depth.fill_(max(child_depth - 1, 0))
            self.graph.replay() if self.graph is not None else self._step()
            if child_depth <= prefix_len:
                return prefix[child_depth]
            out = self.out.tolist()
            return [int(t) for t in out[0]], out[1]

        tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
        heap, counter = [], 0
        if D >= 1:
            kids = prefix[1] if 1 <= prefix_len else self._root_children(1)
            for tok, lp in zip(*kids):
                heapq.heappush(heap, (-lp, counter, tok, 1, 0))
                counter += 1
        while heap and len(tokens) - 1 < budget:
            neg, _, tok, depth, parent = heapq.heappop(heap)
            idx = len(tokens)
            tokens.append(tok); parents.append(parent); depths.append(depth); scores.append(-neg)
            kids = children_of(idx, parent, tok, depth + 1 if depth < D else D)
            if depth < D:
                for ctok, lp in zip(*kids):
                    heapq.heappush(heap, (neg - lp, counter, ctok, depth + 1, idx))
                    counter += 1
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                         torch.tensor(scores, dtype=torch.float32))

    def _root_children(self, child_depth):
        """Depth-1 children scored with the root state (only when prefix_len == 0)."""
        s = self.states[0:1]
        zz = F.silu(self.zh[0:1] + F.linear(s, self.w1_s))
        lp = torch.log_softmax(self.base_c[0] + zz[0] @ self.w2_c[0].T, -1)
        top = torch.topk(lp, self.k)
        return self.cands[0][top.indices].tolist(), top.values.tolist()
