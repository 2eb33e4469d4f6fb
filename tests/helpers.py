"""Test helpers: pinned (oracle / diverging) drafters and a tiny word-level tokenizer."""

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def pin_drafter(drafter, sequence: torch.Tensor, diverge_at: int | None = None):
    """Make `drafter` propose the tokens of `sequence` (1, L) that follow the current prefix.

    The base logits are replaced by ±1e4 one-hot logits, which dominate the (random) Markov bias, so the real
    sequential head, confidence head and truncation still run. With `diverge_at=k` the draft at block slot k
    (0-based) is deliberately wrong, so exactly k drafts survive each full round.
    """
    original = drafter.sample_block
    vocab = drafter.config.vocab_size
    tokens = sequence[0].tolist()

    def sample_block(hidden_states, sequence_ids, lm_head, *args, **kwargs):
        start = sequence_ids.shape[1]

        def base_logits(h, _lm_head):
            k = h.shape[1]
            # h is hidden_states[:, o : o + k] (sample_block may ask for the block's positions in two parts)
            o = next(o for o in range(hidden_states.shape[1]) if torch.equal(hidden_states[:, o : o + k], h))
            pinned = [tokens[start + o + j] if start + o + j < len(tokens) else 0 for j in range(k)]
            if diverge_at is not None and 0 <= diverge_at - o < k:
                pinned[diverge_at - o] = (pinned[diverge_at - o] + 1) % vocab
            logits = torch.full((1, k, vocab), -1e4)
            logits[0, torch.arange(k), torch.tensor(pinned)] = 1e4
            return logits

        drafter.base_logits = base_logits
        try:
            return original(hidden_states, sequence_ids, lm_head, *args, **kwargs)
        finally:
            del drafter.base_logits

    drafter.sample_block = sample_block
    return drafter


def char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: token i is one printable character, so any ASCII text round-trips."""
    chars = [chr(32 + i) for i in range(95)] + [chr(0x3B1 + i) for i in range(max(vocab_size - 95, 0))]
    vocab = {c: i for i, c in enumerate(chars[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
