"""Fast DominoTree builder: the same heap, the same pops, far fewer tensor calls.

A node's GRU step and its children's scores depend only on its own path, so they can be
computed before it is popped. When a popped node has no cached expansion, the builder expands
it together with the best entries still on the heap (the nodes most likely to be popped next)
in one batched call. Per round it also hoists what every node shares: the top-M candidates,
their base logits and W2 rows, and W1's hidden-state half applied to H_d. Per node it makes one
product with the new state, [W1_s; W_hh] s: the first half scores the node's children, the second
is the GRU's state half for every child of it (shared by all siblings); the GRU's input half,
W_ih e(t), is a row of a table kept across rounds (`GruInputs`). So a batch of expansions costs two
small matrix products instead of four, the largest of them (W_ih, 3G x h) gone. A node is kept
as one row [W1_s s | W_hh s | s], so a batch gathers its parents in one stack; in the usual batch
(one child depth) the depth's base logits enter as the W2 product's bias; the root's row depends
on its token alone and is kept with the input table. Nodes at the depth limit are never expanded.
The pop sequence, tokens and parents are those of trees/dominotree.build_dominotree.
"""
from __future__ import annotations

import heapq
from typing import Callable

import torch
import torch.nn.functional as F

from ..drafters.domino import gru_cell
from .dominotree import _embedder, depth_candidates, greedy_chain_states, marginal_children, vocabulary_wide
from .tree import DraftTree


class GruInputs:
    """W_ih e(t), the GRU's input half, for tokens t of a fixed embedding matrix, kept once computed.

    Rows are computed in fixed blocks of `block` consecutive ids, the first time a token of the
    block is needed: every row always comes from the same product shape, so its value does not
    depend on which tokens were asked for first (the trees stay deterministic across requests).
    Memory grows with the blocks touched, at most vocabulary x 3G floats."""

    def __init__(self, embed: torch.Tensor, w_ih: torch.Tensor, block: int = 32):
        self.embed, self.w_ih, self.block = embed, w_ih, block
        # a normal tensor, even when made inside a round's inference mode: HeadWeights.warm fills it
        # from outside one (an inference tensor refuses in-place writes there)
        with torch.inference_mode(False):
            self.table = torch.empty(embed.shape[0], w_ih.shape[0])   # pages are committed as rows are written
            # computed blocks; a uint8 tensor so the native builder (trees/native/) reads and sets it too
            self.ready = torch.zeros(-(-embed.shape[0] // block), dtype=torch.uint8)
        self._ready = self.ready.numpy()
        self.warmed: set[tuple] = set()   # token sets HeadWeights.warm filled
        self.roots: dict[int, torch.Tensor] = {}   # root token -> its tree node row (the builder's cache)
        self.versions = (embed._version, w_ih._version)

    def matches(self, embed: torch.Tensor, w_ih: torch.Tensor) -> bool:
        """Built for this embedding and these (unmodified) weights."""
        return (embed is self.embed and w_ih.data_ptr() == self.w_ih.data_ptr()
                and (embed._version, w_ih._version) == self.versions)

    def ready_blocks(self) -> set[int]:
        return set(torch.nonzero(self.ready).flatten().tolist())

    def fill(self, tokens: list[int]) -> None:
        """Compute the blocks that hold `tokens` and are not computed yet."""
        for b in sorted({t // self.block for t in tokens}):
            if self._ready[b]:
                continue
            lo, hi = b * self.block, min((b + 1) * self.block, self.embed.shape[0])
            with torch.no_grad():   # entered per computed block, not per rows() call (the hot path)
                self.table[lo:hi] = F.linear(self.embed[lo:hi].float(), self.w_ih)
            self._ready[b] = 1

    def rows(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), 3G]."""
        self.fill(tokens)
        return self.table[tokens]


class HeadWeights:
    """float32 views of a DominoHead's weights, split for the hoisted computation, and the GRU
    input table made on first use (keep one HeadWeights across rounds: DominoDrafter.tree_weights)."""

    def __init__(self, head):
        h = head.config.hidden_size
        self.w_ih = head.prefix_gru.weight_ih_l0.detach().float()
        self.w_hh = head.prefix_gru.weight_hh_l0.detach().float()
        w1 = head.embed_proj[0].weight.detach().float()
        self.w1_h, self.w1_s = w1[:, :h], w1[:, h:]
        self.w2 = head.embed_proj[2].weight.detach().float()
        self.s_proj = torch.cat([self.w1_s, self.w_hh])         # [r + 3G, G]: one product per new state
        self.inputs: GruInputs | None = None

    def gru(self, state, x):
        return gru_cell(state, x, self.w_ih, self.w_hh)

    def input_rows(self, embed, tokens: list[int]) -> torch.Tensor:
        """W_ih e(t) for the tokens: from the kept table when `embed` is a weight matrix."""
        if not isinstance(embed, torch.Tensor):
            return F.linear(_embedder(embed)(torch.tensor(tokens)), self.w_ih)
        return self.table_for(embed).rows(tokens)

    def warm(self, embed: torch.Tensor, tokens: torch.Tensor) -> None:
        """Fill the table for `tokens` (a draft vocabulary's ids: every token a tree can hold) now,
        once, rather than a block at a time inside the rounds that first draft them."""
        table = self.table_for(embed)
        key = (tokens.data_ptr(), len(tokens))
        if key not in table.warmed:
            table.fill(tokens.tolist())
            table.warmed.add(key)

    def root_rows(self, embed) -> dict:
        """The builder's root-row cache for this embedding (a fresh dict for an embedding module,
        whose weights are not tracked)."""
        return self.table_for(embed).roots if isinstance(embed, torch.Tensor) else {}

    def table_for(self, embed: torch.Tensor) -> GruInputs:
        if self.inputs is None or not self.inputs.matches(embed, self.w_ih):
            self.inputs = GruInputs(embed, self.w_ih)
        return self.inputs


def gru_from_halves(gi: torch.Tensor, gh: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """gru_cell's step from its two products: gi = W_ih x, gh = W_hh state (gate order r, z, n).
    (1 - z) n + z s is written as lerp(n, s, z): one kernel instead of four."""
    G = state.shape[-1]
    rz = torch.sigmoid(gi[:, :2 * G] + gh[:, :2 * G])
    n = torch.tanh(torch.addcmul(gi[:, 2 * G:], rz[:, :G], gh[:, 2 * G:]))
    return torch.lerp(n, state, rz[:, G:])


def kept_root_row(W: HeadWeights, embed, root_token: int) -> torch.Tensor:
    """The root's node row [W1_s s | W_hh s | s]: a function of its token alone (zero state before
    it), so kept with the input table across rounds."""
    roots = W.root_rows(embed)
    row = roots.get(root_token)
    if row is None:
        G = W.w_hh.shape[1]
        state = gru_from_halves(W.input_rows(embed, [root_token]), torch.zeros(1, 3 * G), torch.zeros(1, G))
        row = torch.cat([F.linear(state, W.s_proj), state], 1)[0]
        if len(roots) >= 4096:
            roots.clear()
        roots[root_token] = row
    return row


def build_dominotree_fast(base_logits: torch.Tensor, hidden: torch.Tensor, head, embed, root_token: int,
                          budget: int, node_topk: int = 8, corr_topm: int | None = 64,
                          normalization: str = "topm", prefix_len: int = 1, max_depth: int | None = None,
                          stop: Callable[[int, float], bool] | None = None, conditioning: str = "path",
                          weights: HeadWeights | None = None, lookahead: int = 32,
                          vocab_ids: torch.Tensor | None = None) -> DraftTree:
    base_logits, hidden = base_logits.float(), hidden.float()
    W = weights or HeadWeights(head)
    base_logits, vocab_ids = vocabulary_wide(base_logits, vocab_ids, W.w2.shape[0], corr_topm, normalization,
                                             conditioning)
    D = base_logits.shape[0] if max_depth is None else min(max_depth, base_logits.shape[0])
    emb = _embedder(embed)
    k = min(node_topk, base_logits.shape[-1] if corr_topm is None else min(corr_topm, base_logits.shape[-1]))
    r, G = W.w1_s.shape[0], W.w_hh.shape[1]
    top = depth_candidates(base_logits, corr_topm, vocab_ids)
    cands = None if top is None else top[0]
    # Hoisted per round: W1_h H_d, candidate base logits and W2 rows, prefix-depth children.
    zh = F.linear(hidden[:D], W.w1_h) if D else None
    if cands is not None:
        M = cands.shape[1]
        base_c = top[1][:D]
        w2_c = W.w2[cands[:D].reshape(-1)]                    # [D * M, r]: every depth's candidate rows
        w2_d = w2_c.view(-1, M, r)                            # ... by depth
    prefix_kids = {d: marginal_children(base_logits[d - 1], node_topk,
                                        None if top is None else (top[0][d - 1], top[1][d - 1]))
                   for d in range(1, min(prefix_len, D) + 1)}
    fixed = None
    if conditioning == "greedy":
        root_state = gru_from_halves(W.input_rows(embed, [root_token]), torch.zeros(1, 3 * G), torch.zeros(1, G))
        fixed = torch.cat(greedy_chain_states(base_logits, hidden, head, emb, root_state, prefix_len))

    def node_rows(states: torch.Tensor) -> torch.Tensor:
        """[W1_s s | W_hh s | s] for new states: the first part scores their children, the second is
        the GRU's state half for every child of them, the third the state itself (one row per node:
        a batch's parents are gathered in one stack)."""
        return torch.cat([F.linear(states, W.s_proj), states], 1)

    def candidate_log_probs(corrected: torch.Tensor, z: torch.Tensor, base_rows: torch.Tensor) -> torch.Tensor:
        """The top-M candidates' corrected logits normalised over themselves ("topm") or over the
        whole corrected vocabulary ("exact")."""
        if normalization == "topm":
            return torch.log_softmax(corrected, -1)
        return corrected - torch.logsumexp(base_rows + F.linear(z, W.w2), -1, keepdim=True)

    def expand(zs: torch.Tensor, child_depths: list[int]):
        """Children (tokens, log-probs) at the given child depths of parents whose W1_s s rows are zs."""
        out = [None] * len(child_depths)
        rows = [i for i, d in enumerate(child_depths) if d > prefix_len]
        for i, d in enumerate(child_depths):
            if d <= prefix_len:
                out[i] = prefix_kids[d]
        if not rows:
            return out
        depth_set = {child_depths[i] for i in rows}
        if fixed is None and cands is not None and len(depth_set) == 1:
            # The usual batch: one depth's candidates, its base logits a bias of the W2 product.
            d = depth_set.pop() - 1
            z = F.silu((zs if len(rows) == len(zs) else zs[rows]) + zh[d])
            corrected = F.linear(z, w2_d[d], base_c[d])
            best = torch.topk(candidate_log_probs(corrected, z, base_logits[d]), k, dim=-1)
            ids, vals = cands[d][best.indices], best.values
        else:
            di = torch.tensor([child_depths[i] - 1 for i in rows])
            zs = F.linear(fixed[di], W.w1_s) if fixed is not None else zs[rows]
            z = F.silu(zh[di] + zs)                           # [n, r]
            if cands is None:
                lp = torch.log_softmax(base_logits[di] + F.linear(z, W.w2), -1)
                best = torch.topk(lp, k, dim=-1)
                ids, vals = best.indices, best.values
            else:
                # One product against all depths' candidates, then each row's own depth: cheaper
                # here than gathering [n, M, r] W2 rows per expansion.
                every = F.linear(z, w2_c).view(len(rows), D, M)
                corrected = base_c[di] + every[torch.arange(len(rows)), di]
                best = torch.topk(candidate_log_probs(corrected, z, base_logits[di]), k, dim=-1)
                ids, vals = torch.gather(cands[di], 1, best.indices), best.values
        for j, (t, v) in enumerate(zip(ids.tolist(), vals.tolist())):
            out[rows[j]] = (t, v)
        return out

    root_row = kept_root_row(W, embed, root_token)
    tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
    rows_of: list[torch.Tensor | None] = [root_row]     # each tree node's row (None: no children possible)
    cache: dict[int, tuple] = {}           # heap entry id -> (node row, children)
    heap, counter = [], 0
    if D >= 1:
        for tok, lp in zip(*expand(root_row[None, :r], [1])[0]):
            heapq.heappush(heap, (-lp, counter, tok, 1, 0))
            counter += 1
    while heap and len(tokens) - 1 < budget:
        entry = heapq.heappop(heap)
        neg, eid, tok, depth, parent = entry
        if stop is not None and stop(len(tokens) - 1, -neg):
            break
        room = budget - (len(tokens) - 1)
        if eid not in cache and room > 1:     # the budget's last node needs no state or children
            batch = [entry] + heapq.nsmallest(min(lookahead, room) - 1, heap)
            batch = [e for e in batch if e[1] not in cache and e[3] < D]   # depth-limit nodes have no children
            if batch:
                par = torch.stack([rows_of[e[4]] for e in batch])
                new_rows = node_rows(gru_from_halves(W.input_rows(embed, [e[2] for e in batch]),
                                                     par[:, r:r + 3 * G], par[:, r + 3 * G:]))
                kids = expand(new_rows[:, :r], [e[3] + 1 for e in batch])
                for e, row, kid in zip(batch, new_rows, kids):
                    cache[e[1]] = (row, kid)
        row, kids = cache.pop(eid, (None, None))
        idx = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        rows_of.append(row)
        if kids is not None:
            for ctok, lp in zip(*kids):
                heapq.heappush(heap, (neg - lp, counter, ctok, depth + 1, idx))
                counter += 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                     torch.tensor(scores, dtype=torch.float32))
