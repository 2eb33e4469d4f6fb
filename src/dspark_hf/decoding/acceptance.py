"""Verification rules: which drafts the target accepts and which token it adds (pure tensor functions).

Greedy: accept the longest prefix where each draft equals the target's argmax, then add the target's argmax at the
first mismatch (the bonus). Sampling (speculative sampling, DSpark paper §2.1 / §6): accept draft x_k with
probability min(1, p_k(x_k) / q_k(x_k)), where q_k is the exact, *biased* draft distribution x_k was drawn from;
at the first rejection draw the bonus from norm(max(0, p_k - q_k)), or from the target's next distribution when all
drafts are accepted. Both keep the output exactly the target's own (token-identical, or identically distributed).
"""

import torch


def accept_greedy(
    draft_ids: torch.LongTensor, target_ids: torch.LongTensor, lengths: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Batched greedy acceptance with ragged verify lengths.

    draft_ids (B, W-1): drafts; row r proposes `lengths[r]` of them (the rest is padding).
    target_ids (B, W): the target's argmax at every verify slot; slot j predicts the token after draft j (slot 0:
    after the anchor). lengths (B,). Returns accepted draft counts (B,) and bonus tokens (B,).
    """
    slots = torch.arange(draft_ids.shape[1], device=draft_ids.device)
    match = (draft_ids == target_ids[:, :-1]) & (slots[None] < lengths[:, None])  # (B, W-1)
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # length of the all-match prefix
    bonus = target_ids.gather(1, accepted[:, None])[:, 0]
    return accepted, bonus


def accept_tree(
    draft_ids: torch.LongTensor,
    parents: torch.LongTensor,
    choices: torch.LongTensor,
    lengths: torch.LongTensor,
    max_depth: int,
) -> tuple[torch.BoolTensor, torch.LongTensor, torch.LongTensor]:
    """Batched acceptance of draft trees (`decoding/trees.py`): walk from the anchor, at each node moving to the child
    whose token is the target's choice there; the bonus is the choice where the walk stops.

    draft_ids (B, N): node tokens; parents (B, N): each node's parent slot (0: the anchor; node i sits at slot i + 1);
    choices (B, W), W <= N + 1: the target's token at every verify slot (greedy: the processed argmax), slot s
    predicting the token after slot s; lengths (B,): nodes verified (the first lengths[r] nodes, a tree). Siblings
    must hold distinct tokens, so at most one child matches and the accepted nodes form a path.
    Returns on_path (B, W) (slot 0 always), accepted depth (B,) and bonus tokens (B,).
    """
    width = choices.shape[1]
    nodes, up = draft_ids[:, : width - 1], parents[:, : width - 1]
    verified = torch.arange(width - 1, device=choices.device)[None] < lengths[:, None]
    # node i matches when its token is the choice at its parent's slot; it is on the path when its ancestors match
    match = (nodes == choices.gather(1, up)) & verified  # (B, W-1)
    on_path = torch.cat([match.new_ones(match.shape[0], 1), match], dim=1)  # (B, W)
    up = torch.cat([up.new_zeros(up.shape[0], 1), up], dim=1)
    for _ in range(max_depth - 1):  # depth-d nodes are settled after d - 1 rounds
        on_path = on_path & on_path.gather(1, up)
    depth = on_path[:, 1:].sum(dim=1)
    # along a path slots ascend with depth: the walk ends at the highest slot on it
    last = (on_path * torch.arange(width, device=choices.device)[None]).argmax(dim=1)
    bonus = choices.gather(1, last[:, None])[:, 0]
    return on_path, depth, bonus


def accept_speculative_sampling(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.LongTensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Exact rejection sampling for one request.

    target_probs (n+1, V): the target's processed distributions at the n+1 verify slots; draft_probs (n, V): the
    processed draft distributions the n drafts `draft_ids` (n,) were drawn from. Returns (accepted count, bonus).
    """
    n = draft_ids.shape[0]
    if n:
        p = target_probs[:n].gather(1, draft_ids[:, None])[:, 0]  # (n,)
        q = draft_probs.gather(1, draft_ids[:, None])[:, 0]
        u = torch.rand(n, device=p.device, generator=generator)
        # accept while u < p / q (written u·q < p: no division, and q > 0 for a token that was drawn from q)
        rejected = (u * q >= p).nonzero()
        accepted = int(rejected[0]) if rejected.numel() else n
    else:
        accepted = 0
    if accepted == n:
        bonus_dist = target_probs[n]
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp(min=0)
        bonus_dist = residual if residual.sum() > 0 else target_probs[accepted]
    bonus = torch.multinomial(bonus_dist / bonus_dist.sum(), 1, generator=generator)
    return accepted, int(bonus)


__all__ = ["accept_greedy", "accept_speculative_sampling", "accept_tree"]
