"""The DSpark training loss: L = α_ce·CE + α_tv·L1(p_d, p_t) + α_kl·KL(p_t‖p_d) + α_conf·BCE(c, c*), position-
weighted means.

Following DeepSpec's loss (DSpark paper Eqs. 9-12): the draft distribution p_d includes the teacher-forced
sequential bias; p_t is the target's T = 1 distribution at the same position; the confidence target is the analytic
acceptance rate c* = 1 - ½‖p_d - p_t‖₁, clamped and detached; w_k = exp(-(k-1)/decay) with decay 4.0 for γ = 7.
Each term is Σ w·loss / Σ w over supervised positions (weighted means, not sums).

Deviation (off by default, α_kl = 0): the forward KL to the target's distribution, the distillation loss of
EAGLE-style drafters. L1 is what acceptance measures, but its gradient on a token's logit scales with p_d of that
token, so a drafter far from the target learns slowly; the KL's gradient (p_d - p_t) does not vanish there.

Distilling another drafter (`teacher_logits`, the training option `distil_from`): the L1 and KL terms match the
teacher drafter's block distribution instead of p_t, while the CE labels and the confidence target c* stay the
target's, so the confidence head keeps predicting acceptance by the target.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def position_weights(block_size: int, decay: float = 4.0) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..γ: (γ,)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


@dataclass
class DSparkLossOutput:
    loss: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    kl: torch.Tensor
    conf: torch.Tensor
    accuracy: torch.Tensor  # (γ,) top-1 agreement with the label per position (for logging)
    accept_rate: torch.Tensor  # (γ,) mean analytic acceptance c* per position
    greedy_tau: torch.Tensor  # teacher-forced greedy τ: 1 + mean leading-correct drafts over fully supervised blocks


def dspark_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    confidence_logits: torch.Tensor | None = None,
    decay: float = 4.0,
    alpha_ce: float = 0.1,
    alpha_tv: float = 0.9,
    alpha_conf: float = 1.0,
    alpha_kl: float = 0.0,
    teacher_logits: torch.Tensor | None = None,
) -> DSparkLossOutput:
    """draft_logits, target_logits (..., γ, V); labels, valid (..., γ); confidence_logits (..., γ) or None;
    teacher_logits (..., γ, V): another drafter's, the distribution the L1 and KL terms match (None: the target's).

    A label of -1 is outside the output vocabulary (training on a shortlist): it adds no CE and counts as a miss.
    """
    gamma = draft_logits.shape[-2]
    weights = position_weights(gamma, decay).to(draft_logits.device) * valid.float()  # (..., γ)
    denom = weights.sum().clamp(min=1e-8)
    log_pd = F.log_softmax(draft_logits.float(), dim=-1)
    in_vocab = labels >= 0
    ce = -log_pd.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * in_vocab  # (..., γ)
    zero = draft_logits.new_zeros(())
    matched = target_logits if teacher_logits is None else teacher_logits  # what the L1 and KL terms pull towards

    def l1_to(logits):  # ‖p_d - softmax(logits)‖₁ = 2·TV, (..., γ)
        return (p_d - F.softmax(logits.float(), dim=-1)).abs().sum(-1)

    tv = l1 = zero
    if alpha_tv or confidence_logits is not None:
        p_d = log_pd.exp()  # (..., γ, V): only where an L1 is taken
        l1 = l1_to(target_logits)
        tv = (weights * l1).sum() / denom
    if alpha_tv and teacher_logits is not None:
        tv = (weights * l1_to(teacher_logits)).sum() / denom
    kl = zero
    if alpha_kl:
        log_pt = F.log_softmax(matched.float(), dim=-1)
        kl_k = (log_pt.exp() * (log_pt - log_pd)).sum(-1)  # (..., γ)
        kl = (weights * kl_k).sum() / denom
    conf = zero
    # c* per position (logged as accept_rate; the confidence target): acceptance by the target, whichever the L1
    # term matches; needs the target's L1, computed above when either term asks for it
    accept = (1 - 0.5 * l1).clamp(0, 1).detach() if alpha_tv or confidence_logits is not None else None
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
        conf = (weights * bce).sum() / denom
    ce_mean = (weights * ce).sum() / (weights * in_vocab).sum().clamp(min=1e-8)
    loss = alpha_ce * ce_mean + alpha_tv * tv + alpha_kl * kl + alpha_conf * conf
    with torch.no_grad():
        flat_valid = valid.reshape(-1, gamma).float()
        hits = (draft_logits.argmax(-1) == labels).reshape(-1, gamma).float()
        count = flat_valid.sum(0).clamp(min=1)
        accuracy = (hits * flat_valid).sum(0) / count
        rate = (accept.reshape(-1, gamma) * flat_valid).sum(0) / count if accept is not None else accuracy * 0
        full = flat_valid.all(-1)  # blocks whose every position is supervised
        leading = hits.cumprod(-1).sum(-1)  # drafts a greedy verifier would accept (labels = target greedy tokens)
        greedy_tau = 1 + (leading[full].mean() if full.any() else leading.new_zeros(()))
    return DSparkLossOutput(
        loss=loss, ce=ce_mean, tv=tv, kl=kl, conf=conf, accuracy=accuracy, accept_rate=rate, greedy_tau=greedy_tau
    )
