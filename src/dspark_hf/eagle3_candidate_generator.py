"""`Eagle3CandidateGenerator`: transformers' assisted-decoding loop driving an EAGLE-3 drafter.

Each round of `generate()` (batch size 1): the positions the target verified last round enter the drafter's cache
with their target features (one forward, which also predicts the first draft), then each further draft is one more
forward feeding the drafter's own output back. γ drafts cost γ sequential forwards. Verification, acceptance and
the bonus token are transformers' own, against the processed draft logits returned here (lossless, exact sampling).
Everything else (target taps, context bookkeeping, stop strings, statistics) is `DrafterCandidateGenerator`'s.
"""

from .candidate_generator import DrafterCandidateGenerator


class Eagle3CandidateGenerator(DrafterCandidateGenerator):
    """Drafts `config.block_size` tokens per round with an EAGLE-3 drafter (`config.model_type == "dspark_eagle3"`),
    greedily or by sampling from its processed logits."""

    def draft(self, input_ids, context, model_kwargs, budget: int):
        return self.drafter.draft(
            input_ids,
            context,
            self.cache,
            self.embed_tokens,
            self.lm_head,
            budget,
            logits_processor=self.logits_processor,
            do_sample=self.do_sample,
            key_mask=self._key_padding(model_kwargs, input_ids.shape[1]),
        )


__all__ = ["Eagle3CandidateGenerator"]
