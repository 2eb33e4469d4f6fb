"""Sampling with a DSpark drafter has exactly the target's distribution (seeded statistical tests, tiny vocabulary).

The exact joint distribution of the first three generated tokens is computed from the target under the same
warpers; assisted samples (a random DSpark drafter with a non-zero Markov bias and confidence truncation on, and a
random EAGLE-3 drafter) are compared with it by a chi-square test. A negative control shows the test rejects a
drafter that reports the unbiased logits instead of the ones its tokens were drawn from.
"""

import itertools
import math
from collections import Counter

import pytest
import torch
from test_eagle3 import make_eagle
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import make_drafter, make_target
from dspark_hf.decoding.drafting import DSparkCandidateGenerator


VOCAB, N_TOKENS = 4, 3
PROMPT = torch.tensor([[1, 2, 3, 0, 1]])


def warpers(temperature=1.0, top_k=None, top_p=None) -> LogitsProcessorList:
    """The warpers generate() builds, in its order (temperature, top-k, top-p)."""
    out = LogitsProcessorList()
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        out.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        out.append(TopPLogitsWarper(top_p))
    return out


@torch.no_grad()
def exact_joint(target, processors, prompt=PROMPT) -> dict[tuple, float]:
    """P(x1, x2, x3 | prompt) under the processed target distribution, by enumeration."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=N_TOKENS):
        ids, p = prompt, 1.0
        for tok in seq:
            logits = processors(ids, target(ids).logits[:, -1].float())
            p *= torch.softmax(logits, -1)[0, tok].item()
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=-1)
        probs[seq] = p
    return probs


def chi_square_rejects(samples: list[tuple], probs: dict[tuple, float], z: float = 3.09) -> tuple[bool, float, float]:
    """Pearson chi-square at α ≈ 1e-3 (Wilson-Hilferty critical value); cells with expectation < 5 are pooled."""
    n, counts = len(samples), Counter(samples)
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        expected = n * p
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[cell], pooled_exp + expected
            continue
        stat, df = stat + (counts[cell] - expected) ** 2 / expected, df + 1
    if pooled_exp > 0:
        stat, df = stat + (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9), df + 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical, stat, critical


def draw(target, drafter, n, rows=1, **sampling) -> list[tuple]:
    """`n` samples of the first `N_TOKENS` generated tokens, `rows` independent rows of the prompt per generate()."""
    samples = []
    for _ in range(-(-n // rows)):
        # 5 new tokens so that the first verify round drafts γ = 3 tokens for x2..x4
        ids = PROMPT.repeat(rows, 1)
        out = target.generate(ids, do_sample=True, max_new_tokens=5, assistant_model=drafter, **sampling)
        samples += [tuple(row[PROMPT.shape[1] : PROMPT.shape[1] + N_TOKENS].tolist()) for row in out]
    return samples[:n]


PADDED_SPS = {1: 10.0, 2: 4.0, 3: 8.0, 4: 5.0}


def setup_models(kind="dspark"):
    target = make_target(vocab_size=VOCAB, seed=3)
    if kind == "eagle3":
        return target, make_eagle(target, block_size=3)
    drafter = make_drafter(target, block_size=3, markov_rank=4, verify_policy="threshold", confidence_threshold=0.3)
    if kind == "dspark_draft_vocab":  # drafts never propose token 2; the target still emits it at its rate
        drafter.set_draft_vocab([0, 1, 3])
    if kind == "dspark_bf16":  # a bf16 drafter beside the float32 target (the default on a CPU with native bf16)
        drafter = drafter.to(torch.bfloat16)
    if kind == "dspark_padded":  # Algorithm 1 on a profile where 2 tokens cost more than 3: verifies are padded
        drafter = make_drafter(target, block_size=3, markov_rank=4, verify_policy="scheduler", draft_gate=False)
        drafter.sps_profile = PADDED_SPS
    return target, drafter


def run_check(n, temperature=1.0, top_k=None, top_p=None, kind="dspark", rows=50):
    """Rows of one batch are independent draws (each row's output is its own plain distribution, tested below), so
    most checks draw 50 at a time; `rows=1` keeps the single-row path."""
    target, drafter = setup_models(kind)
    probs = exact_joint(target, warpers(temperature, top_k, top_p))
    torch.manual_seed(1234)
    sampling = {"temperature": temperature, "top_k": top_k or 0, "top_p": top_p or 1.0}
    samples = draw(target, drafter, n, rows=rows, **sampling)
    return chi_square_rejects(samples, probs), drafter


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.9)])
def test_sampling_matches_target_distribution(sampling, kind):
    rows = 1 if kind == "dspark" and sampling == dict(temperature=1.0) else 50  # one check on the single-row path
    (rejects, stat, critical), drafter = run_check(1500, kind=kind, rows=rows, **sampling)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: {kind} sampling differs from the target's distribution"


def test_sampling_in_a_batch_matches_each_rows_target_distribution():
    """Rows of two prompts of different lengths (left-padded) sampled together: each row's tokens follow its own
    prompt's distribution."""
    target, drafter = setup_models()
    other = torch.tensor([[3, 1]])
    ids = torch.tensor([PROMPT[0].tolist(), [0] * 3 + other[0].tolist()])
    mask = torch.tensor([[1] * 5, [0] * 3 + [1] * 2])
    torch.manual_seed(99)
    samples = ([], [])
    copies = 20  # the two rows 20 times over: 40 rows a call, each an independent draw
    for _ in range(1000 // copies):
        out = target.generate(ids.repeat(copies, 1), attention_mask=mask.repeat(copies, 1), do_sample=True,
                              max_new_tokens=5, assistant_model=drafter, top_k=0, top_p=1.0)  # fmt: skip
        for i, row in enumerate(out):
            samples[i % 2].append(tuple(row[5 : 5 + N_TOKENS].tolist()))
    for row, prompt in enumerate((PROMPT, other)):
        rejects, stat, critical = chi_square_rejects(samples[row], exact_joint(target, warpers(), prompt))
        assert not rejects, f"row {row}: chi2 {stat:.1f} > {critical:.1f}"
    assert max(drafter.generation_stats.verify_lengths) > 0  # it did draft


def test_sampling_with_a_draft_vocabulary_matches_target_distribution():
    """Drafts never propose token 2 (q = 0 there): the residual distribution has to supply it at the target's rate."""
    (rejects, stat, critical), _ = run_check(1500, kind="dspark_draft_vocab")
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: sampling with a draft vocabulary differs from the target's"


def test_sampling_with_a_bf16_drafter_matches_target_distribution():
    """The draft distribution comes from bf16 products (packed on the CPU); verification uses exactly that q."""
    (rejects, stat, critical), drafter = run_check(1500, kind="dspark_bf16")
    assert drafter.dtype == torch.bfloat16
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: sampling with a bf16 drafter differs from the target's"


def test_sampling_with_padded_verifies_matches_target_distribution():
    """Algorithm 1 with verifies padded to the cheapest width (here 2 drafts, never 1, unless the length limit cuts
    the block) keeps the target's distribution."""
    # one row: the profile prices verifies of up to 4 tokens, a batch of rows would verify nothing
    (rejects, stat, critical), drafter = run_check(1500, kind="dspark_padded", rows=1)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: padded verification differs from the target's"
    assert 2 in drafter.generation_stats.verify_lengths  # it did draft and pad in the last call


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7), dict(top_k=2), dict(top_p=0.8)])
def test_sampling_matches_target_distribution_many_samples(sampling):
    (rejects, stat, critical), _ = run_check(6000, **sampling)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}"


@pytest.mark.slow
def test_negative_control_unbiased_logits_are_detected(monkeypatch):
    """Reporting softmax(U) instead of softmax(U + B) for tokens drawn from softmax(U + B) must be caught."""
    target, drafter = setup_models()
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(6.0)  # a strong bias makes the error large
    original = DSparkCandidateGenerator._sample

    def wrong_logits(self, hidden_states, *args, **kwargs):
        draft = original(self, hidden_states, *args, **kwargs)
        n = draft.logits.shape[1]
        draft.logits = drafter.base_logits(hidden_states[:, :n], self.lm_head)  # the bias is missing: wrong q
        return draft

    monkeypatch.setattr(DSparkCandidateGenerator, "_sample", wrong_logits)
    probs = exact_joint(target, warpers())
    torch.manual_seed(1234)
    rejects, stat, critical = chi_square_rejects(draw(target, drafter, 3000, rows=50), probs)
    assert rejects, f"the test failed to notice a wrong draft distribution (chi2 {stat:.1f} <= {critical:.1f})"
