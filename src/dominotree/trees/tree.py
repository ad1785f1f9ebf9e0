"""DraftTree: the proposal every method hands to the target, and its flattening for one verify pass."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Node 0 is the root (the last committed token, not yet in the target's cache).

    Nodes are in build order with parents before children; `scores` is the cumulative draft
    log-probability of the node's path (0 for the root)."""
    tokens: torch.Tensor   # [N] long
    parents: torch.Tensor  # [N] long, parents[0] == -1
    depths: torch.Tensor   # [N] long, depths[0] == 0
    scores: torch.Tensor = field(default=None)  # [N] float

    def __post_init__(self):
        if self.scores is None:
            self.scores = torch.zeros(len(self.tokens), dtype=torch.float32)
        n = len(self.tokens)
        if not (len(self.parents) == len(self.depths) == len(self.scores) == n) or n == 0:
            raise ValueError("DraftTree: tokens, parents, depths and scores need the same non-zero length")

    @classmethod
    def single(cls, root: int) -> "DraftTree":
        return cls(torch.tensor([root]), torch.tensor([-1]), torch.tensor([0]))

    @classmethod
    def chain(cls, root: int, tokens, scores=None) -> "DraftTree":
        toks = [int(root)] + [int(t) for t in tokens]
        n = len(toks)
        sc = torch.zeros(n) if scores is None else torch.cat([torch.zeros(1), torch.as_tensor(scores, dtype=torch.float32)])
        return cls(torch.tensor(toks), torch.arange(-1, n - 1), torch.arange(n), sc)

    @classmethod
    def from_lists(cls, tokens, parents, scores=None) -> "DraftTree":
        """Build from python lists; depths follow from the parents (which must precede children)."""
        depths = []
        for i, p in enumerate(parents):
            if i == 0:
                if p != -1:
                    raise ValueError("node 0 must be the root (parent -1)")
                depths.append(0)
            else:
                if not 0 <= p < i:
                    raise ValueError(f"node {i}: parent {p} must come before it")
                depths.append(depths[p] + 1)
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                   torch.tensor(depths, dtype=torch.long),
                   None if scores is None else torch.as_tensor(scores, dtype=torch.float32))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        out, parents = [], self.parents.tolist()
        while node >= 0:
            out.append(node)
            node = parents[node]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: row i is True at i's ancestors and at i itself."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def flatten(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids (start + depth) and the ancestor mask for one verify pass."""
        return start + self.depths, self.ancestor_mask()

    def truncate_depth(self, max_depth: int) -> "DraftTree":
        """Drop nodes deeper than max_depth (near the end of the context)."""
        keep = (self.depths <= max_depth).nonzero().flatten()
        if len(keep) == len(self):
            return self
        remap = torch.full((len(self),), -1, dtype=torch.long)
        remap[keep] = torch.arange(len(keep))
        parents = self.parents[keep].clone()
        parents[1:] = remap[parents[1:]]
        return DraftTree(self.tokens[keep], parents, self.depths[keep], self.scores[keep])
