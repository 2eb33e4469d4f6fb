"""Training DSpark drafters: anchors and block masks (`data`), the DSpark loss (`loss`)."""

from .data import BlockBatch, block_attention_mask, make_blocks, sample_anchors
from .loss import DSparkLossOutput, dspark_loss, position_weights


__all__ = [
    "BlockBatch",
    "DSparkLossOutput",
    "block_attention_mask",
    "dspark_loss",
    "make_blocks",
    "position_weights",
    "sample_anchors",
]
