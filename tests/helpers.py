"""Test helpers: pinned (oracle / diverging) drafters, a tiny word-level tokenizer, and the near-tie check that
tells a rounding flip of a low-precision target from a bug."""

import math
import weakref

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dspark_hf.decoding.drafting import DSparkCandidateGenerator
from dspark_hf.decoding.policy import VerifyPolicy
from dspark_hf.decoding.rows import Row


_PINNED = weakref.WeakKeyDictionary()  # drafter -> the rows being drafted for, while `propose` runs
_propose = DSparkCandidateGenerator.propose


def _pinned_propose(self, rows, *args, **kwargs):
    if self.drafter not in _PINNED:
        return _propose(self, rows, *args, **kwargs)
    _PINNED[self.drafter]["rows"] = rows
    try:
        return _propose(self, rows, *args, **kwargs)
    finally:
        _PINNED[self.drafter]["rows"] = None


DSparkCandidateGenerator.propose = _pinned_propose


def pin_drafter(drafter, sequences, diverge_at: int | None = None):
    """Make `drafter` propose, for each row being decoded, the tokens of its reference sequence that follow it.

    sequences: a (B, L) tensor or a list of token lists, unpadded; a row drafts from the reference its committed
    tokens are a prefix of (token 0 once it has left them all). The base logits are replaced by ±1e4 one-hot
    logits, which dominate the (random) Markov bias, so the real sequential head, confidence head and verify policy
    still run. With `diverge_at=k` the draft at block slot k (0-based) is deliberately wrong, so exactly k drafts
    survive each full round.
    """
    references = sequences.tolist() if isinstance(sequences, torch.Tensor) else [list(s) for s in sequences]
    vocab = drafter.config.vocab_size
    drafter.config.context_lookup = 0  # every chain the pinned drafter's (tests/test_lookup.py tests the lookup's)
    state = _PINNED[drafter] = {"rows": None, "hidden": None}

    def keep_hidden(module, args, kwargs, output):
        state["hidden"] = output.last_hidden_state

    def draft_base_logits(h, lm_head):
        hidden, k = state["hidden"], h.shape[1]
        # h is hidden[:, o : o + k] (the block's positions may be asked for in two parts)
        o = next(o for o in range(hidden.shape[1]) if torch.equal(hidden[:, o : o + k], h))
        logits = torch.full((h.shape[0], k, vocab), -1e4)
        for r, row in enumerate(state["rows"]):
            ref = next((s for s in references if s[: len(row.seq)] == row.seq), [])  # [] once a row left them all
            for j in range(k):
                index = len(row.seq) + o + j  # block slot o + j predicts this token
                token = ref[index] if index < len(ref) else 0
                if diverge_at is not None and o + j == diverge_at:
                    token = (token + 1) % vocab
                logits[r, j, token] = 1e4
        return logits

    drafter.register_forward_hook(keep_hidden, with_kwargs=True)
    drafter.draft_base_logits = draft_base_logits
    return drafter


class _Row(Row):
    remaining = 10**9


class _Borrowed(torch.nn.Module):
    """A stand-in target that only lends its embedding and LM head."""

    def __init__(self, embed, lm_head):
        super().__init__()
        self.embed, self.lm_head = embed, lm_head

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head


def sample_block(drafter, target, hidden, ids, processors=None, do_sample=False, policy=None):
    """The candidate generator's token-by-token sampling of one block: hidden (1, γ, d) after the committed ids
    (1, L). `target`: the target, or its (embedding, LM head). Returns its `Drafts` (tokens (1, γ), logits
    (1, γ, V) when sampling, conditional confidences)."""
    if isinstance(target, tuple):
        target = _Borrowed(*target)
    row = _Row(ids[0].tolist(), do_sample=do_sample, seed=0 if do_sample else None)
    row.processors = processors
    generator = DSparkCandidateGenerator(drafter, target)
    policy = policy or VerifyPolicy("fixed")
    return generator._sample(hidden, [row], [hidden.shape[1]], policy, early=policy.stops_early)


def char_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: token i is one printable character, so any ASCII text round-trips."""
    chars = [chr(32 + i) for i in range(95)] + [chr(0x3B1 + i) for i in range(max(vocab_size - 95, 0))]
    vocab = {c: i for i, c in enumerate(chars[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers at |value| (bf16: 2^-7 of the power of two below it)."""
    finfo = torch.finfo(dtype)
    return finfo.eps * 2.0 ** math.floor(math.log2(max(abs(value), finfo.tiny)))


def first_divergence(plain: list[int], other: list[int], plain_logits: torch.Tensor, dtype=None, ulps: float = 4,
                     tolerance: float | None = None) -> dict:  # fmt: skip
    """Where `other` first leaves `plain` (the new tokens of two greedy runs of one prompt), and whether the plain
    run was at a near-tie there: its logit for `other`'s token within `tolerance` of its best logit.

    plain_logits (n, V): the plain run's raw logits at each new position (`output_logits=True`). tolerance: an
    absolute logit gap; None: `ulps` units in the last place of `dtype` at the best logit's magnitude (the
    rounding a different batch shape can move a logit by). Returns {"index": None} when the runs agree over their
    common length, else {"index", "plain", "other", "gap", "tolerance", "gap_ulps", "near_tie"}. Any divergence that
    is not a near-tie is a bug, whatever the dtype (reused for quantised targets with their own tolerance).
    """
    index = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), None)
    if index is None:
        return {"index": None}
    row = plain_logits[index].float()
    best = float(row.max())
    unit = ulp(best, dtype) if dtype is not None else float("nan")
    tolerance = ulps * unit if tolerance is None else tolerance
    gap = best - float(row[other[index]])
    return {"index": index, "plain": plain[index], "other": other[index], "gap": gap, "tolerance": tolerance,
            "gap_ulps": gap / unit, "near_tie": gap <= tolerance}  # fmt: skip


def tiny_qk(drafter):
    """The drafter with its q/k projections scaled by 2^-20, as an exact QK-norm twin stores them (~1e-8:
    `tools/make_exportable_drafter.py`), below float16's normal range."""
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.q_proj.weight.mul_(2.0**-20)
            layer.self_attn.k_proj.weight.mul_(2.0**-20)
    return drafter
