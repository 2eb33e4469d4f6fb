"""Draft trees: best-first growth of a token tree per row, and the tensors that verify one in a single target forward.

DSpark's block hidden states h_k do not depend on the drafted tokens, so every node at depth k shares the base logits
U_k (one LM-head product per depth, as for a chain); a node's children are the top candidates of U_k + B_k(its
token) (the sequential head's bias, a rank-r product; the RNN head carries its state per node; no head: U_k alone).
A tree grows best-first by estimated path acceptance, the product of the draft probabilities along its path (the
idea of EAGLE-2's dynamic trees): the candidate with the best path estimate joins next, then its own children become
candidates. A child's estimate never exceeds its parent's, so nodes join in non-increasing order of their estimate,
after their parent: every prefix of the join order is a tree, and the verify policy can cut it anywhere.
With `config.tree_calibration` (fitted by `dspark-hf calibrate`) a greedy row's children are priced by `calibrated`
instead: per depth and rank, a monotone map of the draft probability to P(target's token = this child | parent
accepted). Those are in (0, 1) too, so estimates still never rise along a path.

Layout: a row's nodes are numbered in join order; node i sits at verify slot i + 1 (slot 0 is the anchor), its
parent at slot `parents[i]` (0: the anchor), at position anchor + `depths[i]`. Siblings hold distinct tokens (the
top candidates of one distribution), so at most one child of a node can equal the target's choice there, and the
accepted nodes form one path, whose slots ascend with depth.
"""

import heapq
import itertools
import math
from dataclasses import dataclass, field

import torch

from .rows import Drafts
from .scheduler import conditional_confidences


@dataclass
class Tree:
    """One row's tree, nodes in join order: token, parent node (-1: the anchor), depth (1 = the first draft
    position), path estimate, the sequential head's state to expand it with, and its path of tokens."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    states: list = field(default_factory=list)

    def add(self, token: int, parent: int, score: float, state) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self.states.append(state)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The drafted tokens from the first position down to `node` (the anchor excluded; [] for the anchor)."""
        tokens = []
        while node >= 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    def depth(self, node: int) -> int:
        return 0 if node < 0 else self.depths[node]


PROB_FLOOR = 1e-6  # draft probabilities are clipped to [floor, 1 - floor] before the logit: finite, monotone


def prob_logit(p: float) -> float:
    p = min(max(p, PROB_FLOOR), 1.0 - PROB_FLOOR)
    return math.log(p / (1.0 - p))


def calibrated(probs: list[float], depth: int, fit: list | None) -> list[float]:
    """The estimates that the target's greedy token is each of a node's children, given the node accepted: its
    children's draft probabilities `probs` (rank order, best first) at `depth` (1 = the first draft position) mapped
    by `fit` (`config.tree_calibration`: per depth, a [scale, shift] pair per rank, the last pair for later ranks)
    to sigmoid(scale · logit(p) + shift); `fit` None: `probs` as they are."""
    if fit is None:
        return probs
    pairs = fit[min(depth, len(fit)) - 1]
    out = []
    for rank, p in enumerate(probs):
        scale, shift = pairs[min(rank, len(pairs) - 1)]
        z = scale * prob_logit(p) + shift
        out.append(1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z)))
    return out


def grow_trees(expand, n_rows: int, caps: list[int], budget: int, settled=None) -> list[Tree]:
    """Best-first trees for `n_rows` rows, at most `budget` nodes each and depth <= caps[r].

    `expand(entries)` proposes children for a batch of (row, tree, node) entries (node -1: the anchor) and returns,
    per entry, (tokens, probabilities, state): its candidate children, best first, and the sequential head's state
    they share. Each round every row takes its best candidate, and the new nodes that may still have children are
    expanded together: `budget` rounds of one batched expansion each. `settled(trees, open_rows)` may end the growth
    early (the policy's choice among the nodes is already decided; open_rows[r]: row r can still grow).
    """
    trees = [Tree() for _ in range(n_rows)]
    heaps: list[list] = [[] for _ in range(n_rows)]
    order = itertools.count()  # ties: the earlier candidate first, so a parent always precedes its children

    def push(entries):
        for (r, tree, node), (tokens, probs, state) in zip(entries, expand(entries)):
            base = 1.0 if node < 0 else tree.scores[node]
            room = budget - len(tree.tokens)  # more children than nodes left could never join
            for token, prob in zip(tokens[:room], probs[:room]):
                heapq.heappush(heaps[r], (-base * prob, next(order), node, token, state))

    push([(r, trees[r], -1) for r in range(n_rows) if caps[r] > 0])
    for _ in range(budget):
        grown = []
        for r, heap in enumerate(heaps):
            if not heap or len(trees[r].tokens) >= budget:
                continue
            neg, _, parent, token, state = heapq.heappop(heap)
            node = trees[r].add(token, parent, -neg, state)
            if trees[r].depths[node] < caps[r]:
                grown.append((r, trees[r], node))
        if grown:
            push(grown)
        elif not any(heaps):
            break
        if settled is not None and settled(trees, [bool(h) and len(t.tokens) < budget for h, t in zip(heaps, trees)]):
            break
    return trees


def graft(tree: Tree, chain: list[int], estimates: list[float], budget: int) -> tuple[Tree, list[int]]:
    """`tree` with `chain` (tokens after the anchor, e.g. a lookup continuation) as one of its paths, at most
    `budget` nodes, and the nodes of that path it kept. estimates[k]: the chain's own estimate that its first k + 1
    tokens are accepted.

    The walk from the anchor follows a child holding the chain's next token where there is one (siblings stay
    distinct) and adds the rest as new nodes. A node on the chain keeps the larger of its two estimates, at most its
    parent's (a node is only accepted after its parent), so estimates still never rise along a path. The nodes are
    then put back in join order, by estimate, a parent before its children, and the first `budget` kept: the
    best-first tree of the drafter's nodes and the chain's together.
    """
    tokens, parents, depths, scores = list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.scores)
    node, path = -1, []
    for token, estimate in zip(chain, estimates):
        cap = 1.0 if node < 0 else scores[node]
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
        if child is None:
            tokens.append(token)
            parents.append(node)
            depths.append(1 if node < 0 else depths[node] + 1)
            scores.append(min(estimate, cap))
            child = len(tokens) - 1
        else:
            scores[child] = min(max(scores[child], estimate), cap)
        node = child
        path.append(node)
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:budget]
    new = {old: i for i, old in enumerate(order)}
    grafted = Tree()
    for old in order:
        grafted.add(tokens[old], -1 if parents[old] < 0 else new[parents[old]], scores[old], None)
    return grafted, [new[old] for old in path if old in new]  # a prefix of the path: parents are kept first


def unpack_trees(tokens: torch.LongTensor, parents: torch.LongTensor, counts: list[int], scores: list[list[float]]):
    """`pack_trees`' inverse for each row's first counts[r] nodes, with their path estimates (no head states)."""
    trees = []
    for row_tokens, row_parents, n, row_scores in zip(tokens.tolist(), parents.tolist(), counts, scores):
        tree = Tree()
        for token, parent, score in zip(row_tokens[:n], row_parents[:n], row_scores[:n]):
            tree.add(token, parent - 1, score, None)  # parent slot p is node p - 1; the anchor's slot 0 is -1
        trees.append(tree)
    return trees


def pack_trees(trees: list[Tree], device) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """tokens, parent slots and depths (B, N) of every row's nodes, N = the largest tree; padding columns hang off the
    anchor (parent slot 0, depth 1) and are never verified."""
    width = max((len(t.tokens) for t in trees), default=0)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    parents = torch.zeros(len(trees), width, dtype=torch.long)
    depths = torch.ones(len(trees), width, dtype=torch.long)
    for r, tree in enumerate(trees):
        n = len(tree.tokens)
        tokens[r, :n] = torch.tensor(tree.tokens, dtype=torch.long)
        parents[r, :n] = torch.tensor(tree.parents, dtype=torch.long) + 1  # node p sits at slot p + 1; anchor: 0
        depths[r, :n] = torch.tensor(tree.depths, dtype=torch.long)
    return tokens.to(device), parents.to(device), depths.to(device)


def slot_parents(parents: torch.LongTensor, width: int) -> torch.LongTensor:
    """Parent slot of every verify slot (B, W), the anchor its own parent, from the nodes' parent slots (B, ≥ W-1)."""
    return torch.cat([parents.new_zeros(parents.shape[0], 1), parents[:, : width - 1]], dim=1)


def ancestors(parents: torch.LongTensor, max_depth: int) -> torch.BoolTensor:
    """(B, W, W): slot j is slot i's ancestor or i itself; parents (B, W) from `slot_parents`."""
    bsz, width = parents.shape
    seen = torch.eye(width, dtype=torch.bool, device=parents.device).expand(bsz, -1, -1).clone()
    hop = parents.clone()  # (B, W): the ancestor `step` generations up
    for _ in range(max_depth):
        seen.scatter_(2, hop[:, :, None], True)
        hop = parents.gather(1, hop)
    return seen


def tree_attention_mask(cache_valid: torch.BoolTensor, parents: torch.LongTensor, new_valid: torch.BoolTensor,
                        max_depth: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The 4-D additive mask (B, 1, W, T + W) of a tree verify: each slot sees the valid cache and its own valid
    ancestors (itself included); a padding slot sees the cache and the anchor.

    cache_valid (B, T), parents (B, W) from `slot_parents`, new_valid (B, W). transformers takes a 4-D mask as
    given (`masking_utils`), and eager attention adds it to the scores: 0 where visible, the dtype's minimum
    elsewhere.
    """
    tree = ancestors(parents, max_depth) & new_valid[:, None, :]  # (B, W, W)
    width = tree.shape[1]
    cache = cache_valid[:, None, :].expand(-1, width, -1)  # (B, W, T)
    visible = torch.cat([cache, tree], dim=2)[:, None]  # (B, 1, W, T + W)
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


def tree_drafts(trees, device) -> Drafts:
    """`Drafts` of one tree per row (`trees.Tree`): the nodes packed on `device`, their count, and the conditionals
    of their path estimates in join order."""
    tokens, parents, depths = pack_trees(trees, device)
    conditional = [conditional_confidences(tree.scores) for tree in trees]
    return Drafts(tokens, None, [len(tree.tokens) for tree in trees], conditional, parents=parents, depths=depths)


__all__ = [
    "Tree",
    "ancestors",
    "calibrated",
    "graft",
    "grow_trees",
    "pack_trees",
    "slot_parents",
    "tree_attention_mask",
    "tree_drafts",
    "unpack_trees",
]
