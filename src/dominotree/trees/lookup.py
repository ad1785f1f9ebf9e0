"""Prompt lookup as one more branch of a round's draft tree.

The branch is what followed the latest earlier occurrence of the context's last n-gram (longest n
first, as in prompt-lookup decoding). It is merged into the drafter's tree: nodes the tree already
has are shared, and each new node takes the place of the tree's lowest-scored leaf off the branch,
so the verify pass keeps its size; the branch takes at most half of the tree's nodes (measured:
a budget-8 tree given up wholly to an 8-token branch lost more than the branch brought).
Verification is unchanged (any tree is lossless), so the branch only decides which tokens the
target gets to check: copies of the prompt (a signature, a quoted number) that a small drafter
misses."""
from __future__ import annotations

import heapq

import torch

from .tree import DraftTree


class NgramIndex:
    """Incremental: maps every n-gram (min_n <= n <= max_n) of the tokens seen so far to the
    position just after its latest occurrence that is followed by a token."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens) -> None:
        toks = self.tokens
        for t in tokens:
            i = len(toks)          # t is the continuation of every n-gram ending at i - 1
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._after[tuple(toks[i - n:i])] = i
            toks.append(int(t))

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            pos = self._after.get(tuple(toks[-n:]))
            if pos is not None:
                return toks[pos:pos + k]
        return []


def lookup_reference(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """NgramIndex.lookup by a plain backwards scan (the reference the index is tested against)."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def merge_branch(tree: DraftTree, branch: list[int], max_new: int | None = None,
                 keep: list[int] | None = None) -> tuple[DraftTree, int]:
    """The tree with the path root -> branch[0] -> branch[1] -> ... in it, at the same size.

    Returns the tree and how many branch nodes are new; they are its last nodes (their score is
    the score of the node they hang from: the drafter did not score them). The branch is cut to at
    most `max_new` new nodes and to what the tree has off the branch to give up. The path of `keep`
    (an earlier branch, as far as the tree holds it) is never given up."""
    kids = [dict() for _ in range(len(tree))]
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for i in range(1, len(tree)):
        kids[parents[i]].setdefault(tokens[i], i)
    shared, used = _walk(kids, branch)
    if used == len(branch):
        return tree, 0
    node = shared[-1]
    pinned = set(shared) | set(_walk(kids, keep or [])[0])
    spare = len(tree) - len(pinned)
    room = spare if max_new is None else min(max_new, spare)
    novel = [int(t) for t in branch[used:]][:max(room, 0)]
    if not novel:
        return tree, 0

    # drop the lowest-scored leaves off the branch, one per new node (a parent whose last child
    # went becomes a leaf itself); ties drop the later node first
    n_kids = [len(k) for k in tree.children()]
    scores = tree.scores.tolist()
    heap = [(scores[i], -i) for i in range(1, len(tree)) if n_kids[i] == 0 and i not in pinned]
    heapq.heapify(heap)
    dropped = set()
    while len(dropped) < len(novel):
        _, neg = heapq.heappop(heap)
        i = -neg
        dropped.add(i)
        p = parents[i]
        n_kids[p] -= 1
        if n_kids[p] == 0 and p not in pinned:
            heapq.heappush(heap, (scores[p], -p))

    kept = [i for i in range(len(tree)) if i not in dropped]
    remap = {old: new for new, old in enumerate(kept)}
    new_tokens = [tokens[i] for i in kept] + novel
    new_parents = [-1] + [remap[parents[i]] for i in kept[1:]]
    new_parents += [remap[node]] + list(range(len(kept), len(kept) + len(novel) - 1))
    new_scores = [scores[i] for i in kept] + [scores[node]] * len(novel)
    depths = tree.depths.tolist()
    new_depths = [depths[i] for i in kept] + [depths[node] + 1 + j for j in range(len(novel))]
    merged = DraftTree(torch.tensor(new_tokens), torch.tensor(new_parents), torch.tensor(new_depths),
                       torch.tensor(new_scores, dtype=torch.float32))
    return merged, len(novel)


def _walk(kids: list[dict], branch: list[int]) -> tuple[list[int], int]:
    """The nodes root -> ... along `branch` that the tree already has, and how many tokens matched."""
    nodes = [0]
    for t in branch:
        nxt = kids[nodes[-1]].get(int(t))
        if nxt is None:
            break
        nodes.append(nxt)
    return nodes, len(nodes) - 1
