"""One online training step: target features on the fly (no offline cache), all blocks in one drafter pass."""

from dataclasses import dataclass

import torch

from .data import BlockBatch, make_blocks
from .loss import dspark_loss


def freeze(target):
    """The target (and so the borrowed embedding and LM head) is never trained: no gradients, eval mode."""
    target.requires_grad_(False)
    return target.eval()


@torch.no_grad()
def target_features(target, input_ids: torch.LongTensor, layer_ids: list[int]):
    """Raw outputs of the tapped layers (B, L, m·d) and the final post-norm hidden state (B, L, d)."""
    taps = [i + 1 for i in layer_ids]  # entry 0 of hidden_states is the embedding output
    out = target.base_model(input_ids=input_ids, output_hidden_states=taps + [-1], use_cache=False)
    states = out.hidden_states
    return torch.cat([states[i] for i in taps], dim=-1), out.last_hidden_state


def drafter_block_hidden(drafter, features, input_ids, blocks: BlockBatch, embed_tokens) -> torch.Tensor:
    """A DSpark drafter's backbone output of every block, all in one pass with the training mask: (B, N, γ, d).

    `drafter` may be wrapped for data parallelism: its forward goes through the wrapper (gradient sync), the
    helper methods through the wrapped module.
    """
    return getattr(drafter, "module", drafter).block_hidden(features, input_ids, blocks, embed_tokens, drafter)


def special_token_ids(config) -> list[int]:
    """The EOS and BOS ids of a model config that every vocabulary shortlist keeps (the drafter must be able to
    propose the end of a response)."""
    ids = []
    for value in (config.eos_token_id, config.bos_token_id):
        ids += [value] if isinstance(value, int) else list(value or [])
    return ids


def vocab_shortlist(dataset, size: int, always: list[int] | None = None) -> torch.LongTensor | None:
    """The `size` most frequent supervised tokens of a `TokenDataset` (plus `always`, e.g. EOS), sorted: (V',).

    Training on a shortlist computes the LM head, the sequential bias and both softmaxes over V' columns instead of
    V: p_d and p_t are both renormalised over the shortlist. On the embedded SmolLM2 (V = 49,152) the LM head and
    loss are most of a step. Inference uses the same shortlist as the draft vocabulary when the trainer saves it
    (`shortlist_draft_vocab`), else the full vocabulary. None when `size` is 0.
    """
    if size <= 0:
        return None
    counts = torch.bincount(torch.from_numpy(dataset.supervised_tokens().astype("int64")))
    ranked = counts.argsort(descending=True)[: min(size, int((counts > 0).sum()))]
    ids = torch.cat([ranked, torch.tensor(always or [], dtype=torch.long)]).unique()
    return ids


@dataclass
class BlockPredictions:
    """Teacher-forced predictions for N blocks per sequence: draft_logits and target_logits (B, N, γ, V) (V' over
    a shortlist), confidence_logits (B, N, γ) or None, labels (B, N, γ) as indices into those logits (-1: outside
    the shortlist), the `BlockBatch` they belong to, and teacher_logits (B, N, γ, V): a drafter being distilled
    (`distil_from`) on the same blocks, or None."""

    draft_logits: torch.Tensor
    target_logits: torch.Tensor
    confidence_logits: torch.Tensor | None
    labels: torch.Tensor
    blocks: BlockBatch
    teacher_logits: torch.Tensor | None = None


def block_target_logits(drafter, last_hidden, blocks, lm_head, vocab_ids=None) -> torch.Tensor:
    """The target's logits at each block position, (B, N, γ, V) (V': `vocab_ids`), from its last hidden states
    (B, L, d), through the drafter's `base_logits`."""
    positions = blocks.label_positions.flatten(1)  # (B, N·γ)
    picked = torch.gather(last_hidden, 1, positions[..., None].expand(-1, -1, last_hidden.shape[-1]))
    return drafter.base_logits(picked, lm_head, vocab_ids).view(*blocks.labels.shape, -1)


def block_predictions(
    drafter,
    target,
    input_ids,
    loss_mask,
    num_anchors: int,
    generator=None,
    vocab_ids=None,
    features=None,
    teacher=None,
) -> BlockPredictions:
    """Sample blocks, run the target (features, p_t) and the drafter (p_d, and confidence if it has a head) on them.

    The drafter's `training_logits` decides how it drafts the blocks (DSpark: one parallel pass; EAGLE-3: the
    unrolled training-time test).

    vocab_ids (V',) sorted, or None for the full vocabulary (see `vocab_shortlist`). features: offline mode, the
    precomputed `target_features` of `input_ids` ((B, L, m·d), (B, L, d), e.g. from a `FeatureCache`); the target's
    forward is then not run (its embedding and LM head still are). teacher: a frozen drafter of the same block size
    and target layers, run on the same blocks (`check_teacher`).
    """
    module = getattr(drafter, "module", drafter)  # unwrap DistributedDataParallel for the head methods
    config = module.config
    window = getattr(config, "context_window", None)  # DSpark only
    blocks = make_blocks(input_ids, loss_mask, config.block_size, num_anchors, generator, window)
    if features is None:
        features = target_features(target, input_ids, config.target_layer_ids)
    features, last_hidden = features
    lm_head, embed = target.get_output_embeddings(), target.get_input_embeddings()
    draft_logits, conf = module.training_logits(features, input_ids, blocks, embed, lm_head, vocab_ids, drafter)
    with torch.no_grad():
        target_logits = block_target_logits(module, last_hidden, blocks, lm_head, vocab_ids)
        teacher_logits = None
        if teacher is not None:
            teacher_logits = teacher.training_logits(features, input_ids, blocks, embed, lm_head, vocab_ids)[0]
    labels = blocks.labels
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(labels.device)
        index = torch.searchsorted(vocab_ids, labels).clamp(max=len(vocab_ids) - 1)
        labels = torch.where(vocab_ids[index] == labels, index, -1)
    return BlockPredictions(draft_logits, target_logits, conf, labels, blocks, teacher_logits)


def check_teacher(teacher, drafter) -> None:
    """A drafter can be distilled into `drafter` only if it drafts the same blocks from the same target features."""
    student, other = getattr(drafter, "module", drafter).config, teacher.config
    for name in ("block_size", "target_layer_ids"):
        if getattr(other, name, None) != getattr(student, name, None):
            raise ValueError(
                f"`distil_from`: the teacher drafter's `{name}` is {getattr(other, name, None)!r}, the trained "
                f"drafter's {getattr(student, name, None)!r}; distil only between drafters of the same {name}."
            )


def training_loss(
    drafter,
    target,
    input_ids,
    loss_mask,
    num_anchors: int,
    generator=None,
    vocab_ids=None,
    features=None,
    teacher=None,
    **loss_kwargs,
):
    """DSpark loss of one batch. input_ids, loss_mask (B, L); features and teacher as in `block_predictions`.
    Returns a `DSparkLossOutput`."""
    p = block_predictions(drafter, target, input_ids, loss_mask, num_anchors, generator, vocab_ids, features, teacher)
    return dspark_loss(
        p.draft_logits,
        p.target_logits,
        p.labels,
        p.blocks.valid,
        p.confidence_logits,
        teacher_logits=p.teacher_logits,
        **loss_kwargs,
    )
