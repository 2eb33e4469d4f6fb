"""Verification: which drafts the target accepts and which token it adds (a pure tensor function).

One rule for greedy and sampling rows: the target *chooses* a token at every verify slot from its processed logits
l_t there (slot j: position t = anchor + 1 + j, logits given the committed prefix and the drafts before it); accept
the longest prefix of drafts equal to those choices, then add the choice after it (the bonus). A greedy row chooses
argmax l_t, so its output is plain greedy decoding's. A sampling row chooses y_t = argmax(l_t + g_{s,t}), where
g_{s,t} is standard Gumbel noise keyed only by the row's seed s and the position t (`randomness.py`).

Why sampling stays exact. Induction over positions: the committed token at t is y_t computed from the committed
prefix. (A draft is accepted only where it equals the choice, and every slot past the first mismatch is discarded,
so each slot that commits a token was fed the committed prefix.) g_{s,t} is independent of the noise of every
earlier position, and so of the prefix, which the earlier noise and the model determine. By the Gumbel-max property
argmax(l + g) is distributed as softmax(l) (-inf logits are never chosen), so y_t given the prefix is exactly the
target's processed distribution p_t. The drafts only decide in which round y_t is computed, never its value: the
output is the very sequence plain decoding with seed s produces, under every policy, gate timing and batch.

The drafter chooses its draft at t with the same noise, x_t = argmax(log q_t + g_{s,t}) (`drafting.py`), so
P(x_t = y_t) >= (1 - TV(p_t, q_t)) / (1 + TV(p_t, q_t)) for this Gumbel coupling, against 1 - TV for rejection
sampling (speculative sampling, DSpark paper §2.1), which would make which random draws are used depend on how many
drafts a round verified.

Standard speculative sampling (`accept_standard`, a row with `sampling="standard"`, chains only). The drafter draws
x_j ~ q_j from fresh randomness (the row's own generator, `randomness.stream_key`); the round accepts x_j with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection it draws from normalize(max(0, p_j - q_j)), and
after ℓ accepted drafts the bonus from p_ℓ. p_j is the target's processed distribution at slot j, q_j the drafter's
processed distribution the draft was drawn from (0 outside a draft vocabulary). Exact by the usual argument: at a
verified slot P(commit v) = min(q(v), p(v)) + (1 - Σ_w min(q(w), p(w))) · max(0, p(v) - q(v)) / Σ_w max(0, p(w) -
q(w)) = p(v), since both sums equal 1 - TV(p, q). Whether slot j is verified depends only on the drafts before it
(the policies' rule), and every draw is fresh, so x_j given that decision is still a draw from q_j. The acceptance
probability is 1 - TV(p, q), the best any coupling reaches, but the output depends on the drafter, the policy's
lengths and how many uniforms each round took: a seed reproduces it only with the same drafter, settings and batch.
Lookup drafts are not taken for such rows (choosing between the lookup's chain and the drafter's looks at the
drafter's tokens, which would bias the verified ones), and trees are refused (they need the without-replacement
rule of docs/trees.md).
"""

import torch

from .randomness import draw


def accept_greedy(
    draft_ids: torch.LongTensor, target_ids: torch.LongTensor, lengths: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Batched acceptance with ragged verify lengths: the longest prefix of drafts equal to the target's choices.

    draft_ids (B, W-1): drafts; row r proposes `lengths[r]` of them (the rest is padding).
    target_ids (B, W): the target's choice at every verify slot (argmax, or the seeded Gumbel-max draw); slot j
    predicts the token after draft j (slot 0: after the anchor). lengths (B,). Returns accepted draft counts (B,)
    and bonus tokens (B,).
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
    choices (B, W), W <= N + 1: the target's choice at every verify slot (the processed argmax, or a sampling row's
    Gumbel-max draw at the slot's position), slot s predicting the token after slot s; lengths (B,): nodes verified
    (the first lengths[r] nodes, a tree). Siblings must hold distinct tokens, so at most one child matches and the
    accepted nodes form a path. Returns on_path (B, W) (slot 0 always), accepted depth (B,) and bonus tokens (B,).

    Lossless as for chains: every accepted node is the target's choice given its ancestors, which are the committed
    prefix, and the bonus is the choice after the last of them, so each committed token is the choice plain decoding
    makes at its position (a sampling row: with the same seed's noise there).
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


def accept_standard(
    draft_ids: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    lengths: torch.LongTensor,
    accept_uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Batched standard speculative sampling of chains: accept draft j with probability min(1, p_j(x_j) / q_j(x_j)),
    draw the first rejected slot's token from normalize(max(0, p_j - q_j)), or after every verified draft the bonus
    from p.

    draft_ids (B, W-1): drafts, row r verifying `lengths[r]` of them; draft_probs (B, W-1, V): q_j, the distribution
    draft j was drawn from; target_probs (B, W, V): p_j, the target's processed distribution at slot j (slot j
    predicts the token after draft j; slot 0: after the anchor); lengths (B,); accept_uniforms (B, W-1) and
    bonus_uniforms (B,): fresh U[0, 1) draws (a row's entries past its length are not read). Returns accepted draft
    counts (B,) and bonus tokens (B,).
    """
    width, vocab = target_probs.shape[1], target_probs.shape[-1]
    slots = torch.arange(width - 1, device=draft_ids.device)
    q_x = draft_probs.gather(2, draft_ids[..., None])[..., 0].double()  # (B, W-1)
    p_x = target_probs[:, :-1].gather(2, draft_ids[..., None])[..., 0].double()
    keep = (accept_uniforms.double() * q_x < p_x) & (slots[None] < lengths[:, None])  # u < p / q
    accepted = keep.long().cumprod(dim=1).sum(dim=1)  # (B,)
    at = accepted[:, None, None].expand(-1, 1, vocab)
    p_next = target_probs.gather(1, at)[:, 0].float()  # (B, V): p at the slot after the accepted drafts
    q_pad = torch.cat([draft_probs, draft_probs.new_zeros(draft_probs.shape[0], 1, vocab)], dim=1)  # (B, W, V)
    q_next = q_pad.gather(1, at)[:, 0].float()
    rejected = (accepted < lengths)[:, None]
    residual = torch.where(rejected, (p_next - q_next).clamp_min(0.0), p_next)
    # p and q equal up to rounding leave no residual mass: a rejection is then (nearly) impossible, draw from p
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    return accepted, draw(residual, bonus_uniforms)


__all__ = ["accept_greedy", "accept_standard", "accept_tree"]
