"""DSpark's sequential heads (Markov, gated Markov, RNN) and the confidence head.

The parallel backbone gives base logits `U_k` for every block position at once. A sequential head adds a bias
`B_k(x_{k-1}, ...)` over the vocabulary that depends on the previously drafted token, so the block distribution
`Π_k softmax(U_k + B_k)` becomes causal while every factor stays an exact softmax (which keeps rejection sampling
exact). The confidence head predicts `c_k ≈ P(x_k accepted | x_1..x_{k-1} accepted)` before `x_k` is sampled.

Shapes: `B` batch, `K` block positions handled in this call, `d` hidden size, `r` rank, `V` vocabulary (or `V'`,
the length of `vocab_ids`, when training restricts the output to a shortlist of the vocabulary).
Every head accepts `K` positions at once (teacher forcing in training) or `K = 1` with a carried `state`
(token-by-token sampling at inference).
"""

import torch
from torch import nn

from ..kernels.few_rows import gathered_rows


class DSparkMarkovHead(nn.Module):
    """Vanilla low-rank first-order Markov bias: `B(x_{k-1}, ·) = W1[x_{k-1}] W2` (DSpark paper, Eq. 5).

    The bias ignores the backbone state `h_k`; it only looks at the previous token (the anchor for k = 1).
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def token_embedding(self, prev_ids: torch.LongTensor) -> torch.Tensor:
        """`W1[x_{k-1}]`: (B, K) -> (B, K, r). Also the Markov input of the confidence head."""
        return self.markov_w1(prev_ids)

    def project(self, z: torch.Tensor, vocab_ids: torch.LongTensor | None = None) -> torch.Tensor:
        """`z W2` over the vocabulary, or over the shortlist `vocab_ids` (V',): (B, K, r) -> (B, K, V or V')."""
        if vocab_ids is None:
            return self.markov_w2(z)
        return nn.functional.linear(z, gathered_rows(self, self.markov_w2.weight, vocab_ids))

    def forward(self, prev_ids, hidden_states, state=None, vocab_ids=None):
        """prev_ids (B, K), hidden_states (B, K, d) -> bias (B, K, V), state (unused, passed through)."""
        return self.project(self.token_embedding(prev_ids), vocab_ids), state


class DSparkGatedMarkovHead(DSparkMarkovHead):
    """Gated Markov bias (DeepSpec's `gated` head): `B_k = W2(σ(W_g [h_k; W1[x_{k-1}]] + b) ⊙ W1[x_{k-1}])`."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__(vocab_size, hidden_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank, bias=True)

    def forward(self, prev_ids, hidden_states, state=None, vocab_ids=None):
        emb = self.token_embedding(prev_ids)  # (B, K, r)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden_states, emb], dim=-1)))  # (B, K, r)
        return self.project(gate * emb, vocab_ids), state


class DSparkRNNHead(DSparkMarkovHead):
    """Gated recurrent bias over the whole in-block prefix (DSpark paper, Eq. 6), `s_0 = 0`:

    z_k = [s_{k-1}; W1[x_{k-1}]; h_k],  (g, c, o) = split(joint_proj(z_k)),
    s_k = σ(g) ⊙ s_{k-1} + (1 - σ(g)) ⊙ tanh(c),  B_k = W2 tanh(o).
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__(vocab_size, hidden_size, rank)
        self.rank = rank
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, bias=True)

    def forward(self, prev_ids, hidden_states, state=None, vocab_ids=None):
        emb = self.token_embedding(prev_ids)  # (B, K, r)
        if state is None:
            state = emb.new_zeros(emb.shape[0], self.rank)
        outputs = []
        # The recurrence is sequential even under teacher forcing; K (the block size) is small.
        for k in range(emb.shape[1]):
            gate, cell, out = self.joint_proj(torch.cat([state, emb[:, k], hidden_states[:, k]], dim=-1)).chunk(3, -1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(cell)
            outputs.append(torch.tanh(out))
        return self.project(torch.stack(outputs, dim=1), vocab_ids), state


SEQUENTIAL_HEAD_CLASSES = {"markov": DSparkMarkovHead, "gated_markov": DSparkGatedMarkovHead, "rnn": DSparkRNNHead}


class DSparkConfidenceHead(nn.Module):
    """`c_k = σ(wᵀ [h_k; W1[x_{k-1}]] + b)` on the post-norm backbone output (DSpark paper, Eq. 7).

    Returns raw logits; Sequential Temperature Scaling divides them by a per-position temperature before the sigmoid.
    """

    def __init__(self, hidden_size: int, markov_rank: int | None):
        super().__init__()
        self.proj = nn.Linear(hidden_size + (markov_rank or 0), 1, bias=True)

    def forward(self, hidden_states: torch.Tensor, prev_embedding: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (B, K, d), prev_embedding (B, K, r) or None -> logits (B, K)."""
        if prev_embedding is not None:
            hidden_states = torch.cat([hidden_states, prev_embedding.to(hidden_states.dtype)], dim=-1)
        return self.proj(hidden_states).squeeze(-1)


def survival_probabilities(confidence_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Calibrated prefix survival `a_k = Π_{i<=k} σ(logit_i / T_i)`: (..., K) logits, (K,) temperatures -> (..., K)."""
    k = confidence_logits.shape[-1]
    conf = torch.sigmoid(confidence_logits.float() / temperatures[:k].to(confidence_logits.device))
    return torch.cumprod(conf, dim=-1)


__all__ = [
    "SEQUENTIAL_HEAD_CLASSES",
    "DSparkConfidenceHead",
    "DSparkGatedMarkovHead",
    "DSparkMarkovHead",
    "DSparkRNNHead",
    "survival_probabilities",
]
