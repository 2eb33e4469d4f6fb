"""Context lookup: draft the tokens that followed the sequence's own suffix where it occurred before.

Answers copy from their context: an identifier from a pasted source file, a phrase from the document, a line the
model already wrote (long-context RAG and code prompts; repetition loops of small models). The drafter's attention
is bounded (`context_window`) and cannot see a span 5,000 positions back, but an exact match can: if the last n
tokens of a row occurred earlier in its sequence, the tokens that followed them there are a free draft. A round
takes, per row, whichever chain is expected to be accepted further, the drafter's block or the lookup's
continuation (`LookupDrafts.merge`); verification is unchanged, so the output stays exactly the target's
(greedy, and seeded sampling through the Gumbel-max coupling: a lookup draft is accepted where it equals the
target's own choice).

Measured on the long-context benchmark's outputs (SmolLM2, 4 prompts per length, every draft verified), the
drafter's τ 1.95 / 1.98 / 1.90 at 256 / 2k / 4k tokens rose to 2.93 / 2.25 / 2.50 with lookup at matches of n >= 3
(docs/long_context.md).

How likely a lookup draft is to be accepted is learned as the decoder runs (`LookupConfidence`): per match length,
the first position's acceptance, and a shared rate for each further position, with priors from that measurement.
"""

import itertools
import operator

import torch

from ..models.configuration_dspark import LONGEST_LOOKUP  # the longest match extended to: the better predictor
from .rows import Drafts, Row
from .trees import graft, tree_drafts, unpack_trees


class SuffixIndex:
    """Where each `min_n`-gram of a sequence ended, updated as tokens arrive, to find the suffix's earlier matches.

    `continuation(seq, count)` looks at the latest `CANDIDATES` earlier occurrences of the sequence's last `min_n`
    tokens, extends each match backwards up to `LONGEST_LOOKUP` tokens, and returns (the `count` tokens after the
    longest of them, the most recent among equals; its length n). One list entry per position (an 8k prompt: ~8k
    ints), indexed once at the row's first lookup (~5 ms of Python at 8k) and then by the tokens each round commits.
    """

    CANDIDATES = 64  # occurrences examined per lookup, latest first

    def __init__(self, min_n: int):
        self.min_n = min_n
        self.ends: dict[tuple, list[int]] = {}  # min_n-gram -> ends (exclusive) of its occurrences, ascending
        self.indexed = 0  # occurrences ending before this position are in `ends`

    def _index(self, seq: list[int]) -> None:
        # an occurrence ending at the last position is the suffix itself: left out until a token follows it
        n, stop = self.min_n, len(seq) - 1
        for end in range(max(self.indexed, n), stop + 1):
            self.ends.setdefault(tuple(seq[end - n : end]), []).append(end)
        self.indexed = max(self.indexed, stop + 1)

    def continuation(self, seq: list[int], count: int) -> tuple[list[int], int]:
        """([], 0) when the last `min_n` tokens did not occur before."""
        if count < 1 or len(seq) <= self.min_n:
            return [], 0
        self._index(seq)
        ends = self.ends.get(tuple(seq[-self.min_n :]), ())
        best_end, best = None, 0
        for end in reversed(ends[-self.CANDIDATES :]):
            n = self.min_n
            while n < LONGEST_LOOKUP and n < end and seq[end - n - 1] == seq[-n - 1]:
                n += 1
            if n > best:
                best_end, best = end, n
                if n == LONGEST_LOOKUP:
                    break
        return ([], 0) if best_end is None else (seq[best_end : best_end + count], best)


class LookupConfidence:
    """Calibrated conditional acceptance of lookup drafts, learned from the rounds that verified them.

    c_1 depends on the match length n (a 3-token match is right about half the time, an 8-token one nearly always);
    c_k for k >= 2 (the continuation goes on, given the drafts before it were accepted) is one shared rate. Each is
    a Beta estimate whose prior (`PRIOR_WEIGHT` pseudo-rounds) comes from the long-context measurement above.
    """

    FIRST = {1: 0.3, 2: 0.45, 3: 0.55, 4: 0.6, 5: 0.7, 6: 0.75, 7: 0.8, 8: 0.85}  # prior for c_1 by match length
    NEXT = 0.75  # prior for c_k, k >= 2
    PRIOR_WEIGHT = 8.0

    def __init__(self):
        self.first = {n: [p * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT] for n, p in self.FIRST.items()}
        self.next = [self.NEXT * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT]

    def conditional(self, n: int, length: int) -> list[float]:
        """c_1 .. c_length for a continuation found with an n-token match."""
        hits, seen = self.first[min(n, LONGEST_LOOKUP)]
        return [hits / seen] + [self.next[0] / self.next[1]] * (length - 1)

    def update(self, n: int, verified: int, accepted: int) -> None:
        """A row verified `verified` lookup drafts and accepted the first `accepted` of them."""
        if verified < 1:
            return
        first = self.first[min(n, LONGEST_LOOKUP)]
        first[0] += accepted >= 1
        first[1] += 1
        self.next[0] += max(0, accepted - 1)  # positions 2.. accepted
        self.next[1] += min(accepted, verified - 1)  # positions 2.. reached (their predecessor accepted)


def expected_depth(conditional: list[float], cap: int) -> float:
    """Expected accepted drafts of a chain verified up to `cap` positions: Σ_k Π_{i<=k} c_i."""
    return sum(itertools.accumulate(conditional[:cap], operator.mul))


class LookupDrafts:
    """A decoder's context lookup: it merges each row's lookup continuation into a round's `Drafts` and learns from
    what the round accepted. `min_n` (the drafter's `config.context_lookup`, read each round) is the shortest suffix
    match that may draft; the confidence (`LookupConfidence`) is learned across the decoder's rounds.

    A chain row takes the lookup's continuation instead of the drafter's block where it is expected to be accepted
    further; a tree row grafts it into its tree as one more path (`trees.graft`), so the policy chooses among the
    drafter's branches and the copied one together. The `Drafts` then say which rows took what (`Drafts.lookup`,
    `Drafts.lookup_paths`), so the round carries no lookup state of its own.
    """

    def __init__(self):
        self.confidence = LookupConfidence()

    def merge(self, rows: list[Row], drafts: Drafts, caps: list[int], min_n: int, tree_budget: int = 0):
        """(drafts, caps) with each row's lookup continuation merged in: a tree's grafted (`tree_budget` nodes at
        most), a chain's taken where its expected accepted depth is the larger, with that row's cap cut to the
        lookup's tokens (the columns after them are the drafter's, never verified). Rows with standard sampling keep
        the drafter's chain."""
        if drafts.is_tree:
            return self._graft(rows, drafts, caps, min_n, tree_budget), caps
        caps, drafts.conditional = list(caps), list(drafts.conditional)
        for i, row in enumerate(rows):
            if row.standard:  # the choice looks at the drafter's tokens, which would bias them (`acceptance.py`)
                continue
            found, n = self._continuation(row, caps[i], min_n)
            if not found:
                continue
            conditional = self.confidence.conditional(n, len(found))
            if expected_depth(conditional, caps[i]) <= expected_depth(drafts.conditional[i], caps[i]):
                continue
            if len(found) > drafts.tokens.shape[1]:  # the drafter stopped sampling early: widen the chains
                extra = len(found) - drafts.tokens.shape[1]
                drafts.tokens = torch.nn.functional.pad(drafts.tokens, (0, extra))
                if drafts.logits is not None:
                    drafts.logits = torch.nn.functional.pad(drafts.logits, (0, 0, 0, extra))
            drafts.tokens[i, : len(found)] = torch.tensor(found, device=drafts.tokens.device)
            drafts.conditional[i] = conditional
            caps[i] = min(caps[i], len(found))
            drafts.lookup[i] = n
        return drafts, caps

    def _graft(self, rows: list[Row], drafts: Drafts, caps: list[int], min_n: int, budget: int) -> Drafts:
        trees, lookup, paths = None, {}, {}
        for i, row in enumerate(rows):
            found, n = self._continuation(row, caps[i], min_n)
            if not found:
                continue
            if trees is None:
                trees = unpack_trees(drafts.tokens, drafts.parents, drafts.lengths, drafts.survival)
            estimates = itertools.accumulate(self.confidence.conditional(n, len(found)), operator.mul)
            trees[i], paths[i] = graft(trees[i], found, list(estimates), budget)
            lookup[i] = n
        if trees is None:
            return drafts
        drafts = tree_drafts(trees, drafts.tokens.device)
        drafts.lookup, drafts.lookup_paths = lookup, paths
        return drafts

    @staticmethod
    def _continuation(row: Row, cap: int, min_n: int) -> tuple[list[int], int]:
        """Up to `cap` tokens that followed the row's suffix where it occurred before, and the match length."""
        if cap < 1:
            return [], 0
        if row.suffix_index is None or row.suffix_index.min_n != min_n:
            row.suffix_index = SuffixIndex(min_n)
        return row.suffix_index.continuation(row.seq, cap)

    def learn(self, drafts: Drafts, accepted: list[int], paths: list[list[int]]) -> list[int]:
        """What this round's lookup drafts were worth: the confidence learns from each row that took one (`paths`:
        each row's accepted path of slots, the anchor's 0 first). In a tree, the lookup path's nodes within the
        verified ones count as verified, those on the accepted path as accepted. Returns the rows that verified a
        lookup draft."""
        verified_rows = []
        for i, n in drafts.lookup.items():
            verified, taken = drafts.lengths[i], accepted[i]
            if i in drafts.lookup_paths:
                path, on_path = drafts.lookup_paths[i], set(paths[i])
                verified = sum(node < drafts.lengths[i] for node in path)
                taken = 0  # the path's nodes at slot node + 1, from the first, while on the accepted path
                while taken < verified and path[taken] + 1 in on_path:
                    taken += 1
            self.confidence.update(n, verified, taken)
            if verified:
                verified_rows.append(i)
        return verified_rows

    @staticmethod
    def source(drafts: Drafts, i: int, path: list[int]) -> str:
        """Where row i's accepted drafts (its accepted `path` of slots) came from: "lookup" for its lookup chain, or
        in a tree where the accepted path runs along the grafted lookup path; else "drafter"."""
        if i not in drafts.lookup or len(path) < 2:
            return "drafter"
        if i not in drafts.lookup_paths:
            return "lookup"
        return "lookup" if [s - 1 for s in path[1:]] == drafts.lookup_paths[i][: len(path) - 1] else "drafter"


__all__ = ["LookupConfidence", "LookupDrafts", "SuffixIndex", "expected_depth"]
