"""Training blocks: random anchors, teacher-forced block labels and the training attention mask.

A training sequence of length L carries many blocks at once (DSpark paper §3.3, DFlash §4.2). Block n starts at
anchor position a_n: slot j (0-based) holds the anchor embedding (j = 0) or the mask, sits at position a_n + j,
and predicts the token at a_n + j + 1. Every block sees the target context at positions < a_n (the anchor's own
hidden state does not exist yet at inference) and its own slots, bidirectionally; never another block.
"""

from dataclasses import dataclass

import torch


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """Up to `num_anchors` distinct anchors per sequence, uniformly among positions a where both a and a + 1 are
    inside the loss mask (so at least the first draft has a label). Sequences with fewer candidates get fewer
    anchors; the rest is padding with `valid = False`.

    loss_mask (B, L) bool -> anchors (B, N) long, anchor_valid (B, N) bool, with N = num_anchors.
    """
    bsz, length = loss_mask.shape
    ok = loss_mask[:, :-1] & loss_mask[:, 1:]  # (B, L-1)
    anchors = torch.zeros(bsz, num_anchors, dtype=torch.long)
    valid = torch.zeros(bsz, num_anchors, dtype=torch.bool)
    for b in range(bsz):
        candidates = ok[b].nonzero().flatten()
        if candidates.numel() == 0:
            continue
        pick = candidates[torch.randperm(candidates.numel(), generator=generator)[:num_anchors]].sort().values
        anchors[b, : pick.numel()], valid[b, : pick.numel()] = pick, True
    return anchors, valid


def block_attention_mask(seq_len: int, anchors: torch.Tensor, block_size: int, context_window: int | None = None):
    """Boolean mask (True = visible) of block queries over [context (L) ; all block slots (N·γ)].

    anchors (B, N) -> (B, 1, N·γ, L + N·γ). With `context_window` W, a block sees only the W context positions
    before its anchor (`DSparkConfig.context_window`), as decoding then does.
    """
    bsz, n = anchors.shape
    context_pos = torch.arange(seq_len, device=anchors.device)
    sees_context = context_pos[None, None, :] < anchors[:, :, None]  # (B, N, L): context strictly before the anchor
    if context_window is not None:
        sees_context &= context_pos[None, None, :] >= anchors[:, :, None] - context_window
    block_id = torch.arange(n, device=anchors.device).repeat_interleave(block_size)  # (N·γ,)
    same_block = block_id[:, None] == block_id[None, :]  # (N·γ, N·γ)
    ctx = sees_context.repeat_interleave(block_size, dim=1)  # (B, N·γ, L)
    own = same_block[None].expand(bsz, -1, -1)  # (B, N·γ, N·γ)
    # A padding anchor (position 0) sees no context, only its own slots: its rows stay finite, its loss is masked.
    mask = torch.cat([ctx, own], dim=-1)
    return mask[:, None]


@dataclass
class BlockBatch:
    """Everything one drafter training step needs for N blocks per sequence.

    anchors (B, N); prev_ids (B, N, γ) = [anchor, x*_1 .. x*_{γ-1}] (teacher forcing for the sequential head);
    labels (B, N, γ) = x*_1 .. x*_γ; valid (B, N, γ): position supervised (inside the sequence and the loss mask,
    and every earlier position of its block valid); label_positions (B, N, γ) = a + k, where the target's logits
    give p_t for the label; position_ids (B, L + N·γ); attention_mask (B, 1, N·γ, L + N·γ).
    """

    anchors: torch.Tensor
    prev_ids: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    label_positions: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor


def make_blocks(
    input_ids, loss_mask, block_size: int, num_anchors: int, generator=None, context_window: int | None = None
) -> BlockBatch:
    """Sample anchors and build labels, validity, positions and the attention mask. input_ids, loss_mask (B, L);
    `context_window`: the drafter's (`block_attention_mask`).

    The anchors are drawn on the CPU (from a seeded CPU `generator`, so a step's blocks are the same on any device);
    the rest is built on `input_ids`' device."""
    device = input_ids.device
    bsz, length = input_ids.shape
    anchors, anchor_valid = sample_anchors(loss_mask.bool().cpu(), num_anchors, generator)
    anchors, anchor_valid = anchors.to(device), anchor_valid.to(device)
    offsets = torch.arange(block_size, device=device)
    label_pos = anchors[:, :, None] + offsets + 1  # (B, N, γ): token position predicted by slot j
    inside = label_pos < length
    safe = label_pos.clamp(max=length - 1)
    labels = torch.gather(input_ids, 1, safe.flatten(1)).view_as(safe)
    supervised = inside & torch.gather(loss_mask.bool(), 1, safe.flatten(1)).view_as(safe) & anchor_valid[..., None]
    valid = supervised.long().cumprod(dim=-1).bool()
    prev_ids = torch.cat([torch.gather(input_ids, 1, anchors)[..., None], labels[..., :-1]], dim=-1)
    block_positions = (anchors[:, :, None] + offsets).flatten(1)  # (B, N·γ)
    position_ids = torch.cat([torch.arange(length, device=device).expand(bsz, -1), block_positions], dim=-1)
    return BlockBatch(
        anchors=anchors,
        prev_ids=prev_ids,
        labels=labels,
        valid=valid,
        label_positions=safe - 1,  # p_t of the token at a + k + 1 comes from the target's logits at a + k
        position_ids=position_ids,
        attention_mask=block_attention_mask(length, anchors, block_size, context_window),
    )
