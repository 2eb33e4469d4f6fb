"""Sampling with a DSpark drafter has exactly the target's distribution (seeded statistical tests, tiny vocabulary).

The exact joint distribution of the first three generated tokens is computed from the target under the same
warpers; assisted samples (a random DSpark drafter with a non-zero Markov bias and confidence truncation on, and a
random EAGLE-3 drafter) are compared with it by a chi-square test. Negative controls show the test rejects noise
shared by two positions (and, in test_engine.py, accepting drafts without comparing them with the target's
choices). A seed fixes the output: the same tokens under every policy, alone or in a batch, with or without a
drafter.
"""

import itertools
import math
from collections import Counter

import pytest
import torch
from test_eagle3 import make_eagle
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import make_drafter, make_target


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
    """The target has 2 layers and the drafter 1 (depth plays no part in acceptance, and thousands of generate()
    calls run on them); EAGLE-3's target has 4, as it taps three distinct layers below the last."""
    if kind == "eagle3":
        target = make_target(vocab_size=VOCAB, seed=3)
        return target, make_eagle(target, block_size=3)
    target = make_target(vocab_size=VOCAB, num_layers=2, seed=3)
    shape = dict(num_hidden_layers=1, block_size=3, markov_rank=4, target_layer_ids=[0])
    drafter = make_drafter(target, **shape, verify_policy="threshold", confidence_threshold=0.3)
    if kind == "dspark_draft_vocab":  # drafts never propose token 2; the target still emits it at its rate
        drafter.set_draft_vocab([0, 1, 3])
    if kind == "dspark_bf16":  # a bf16 drafter beside the float32 target (the default on a CPU with native bf16)
        drafter = drafter.to(torch.bfloat16)
    if kind == "dspark_padded":  # Algorithm 1 on a profile where 2 tokens cost more than 3: verifies are padded
        drafter = make_drafter(target, **shape, verify_policy="scheduler", draft_gate=False)
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


# draws of the single-row path (one generate() a draw, ~20 ms each): the 50-row checks carry the statistical power,
# these prove the path; the slow suite draws 6000 (`..._many_samples`)
SINGLE_ROW_DRAWS = 400


@pytest.mark.parametrize(
    "kind, sampling",
    [
        ("dspark", dict(temperature=1.0)),
        ("dspark", dict(temperature=0.7, top_k=3, top_p=0.9)),
        ("eagle3", dict(temperature=1.0)),
        pytest.param("eagle3", dict(temperature=0.7, top_k=3, top_p=0.9), marks=pytest.mark.slow),
    ],
)
def test_sampling_matches_target_distribution(sampling, kind):
    rows = 1 if kind == "dspark" and sampling == dict(temperature=1.0) else 50  # one check on the single-row path
    n = SINGLE_ROW_DRAWS if rows == 1 else 1000 if kind == "eagle3" else 1500  # EAGLE-3's target is 2x deeper
    (rejects, stat, critical), drafter = run_check(n, kind=kind, rows=rows, **sampling)
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
    (rejects, stat, critical), drafter = run_check(SINGLE_ROW_DRAWS, kind="dspark_padded", rows=1)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: padded verification differs from the target's"
    assert 2 in drafter.generation_stats.verify_lengths  # it did draft and pad in the last call


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7), dict(top_k=2), dict(top_p=0.8)])
def test_sampling_matches_target_distribution_many_samples(sampling):
    (rejects, stat, critical), _ = run_check(6000, **sampling)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}"


def test_negative_control_noise_shared_by_two_positions_is_detected(monkeypatch):
    """Positions 2k and 2k + 1 drawing with the same noise (a counter keyed by the round, not the position, would
    do this): the tokens are no longer independent given the prefix, and the same chi-square test must say so."""
    from dspark_hf.decoding import randomness

    key = randomness.position_key
    monkeypatch.setattr(randomness, "position_key", lambda seed, position: key(seed, position - position % 2))
    (rejects, stat, critical), _ = run_check(1500)
    assert rejects, f"the test failed to notice noise reused across positions (chi2 {stat:.1f} <= {critical:.1f})"


def seeded_generate(target, drafter, prompts, seed, **kwargs) -> list[list[int]]:
    """New tokens of each left-padded prompt, sampled after `torch.manual_seed(seed)`."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    out = target.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=12, top_k=0, **kwargs,
                          **({"assistant_model": drafter} if drafter is not None else {}))  # fmt: skip
    return [row[width:].tolist() for row in out]


@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduler"])
def test_seeded_generate_is_reproducible(policy):
    """`torch.manual_seed(n)` before generate() fixes every row's output: under each policy, alone or in a batch,
    and equal to plain decoding (the Engine without a drafter) with the row's seed, drawn from torch's RNG."""
    from dspark_hf import Engine

    target, drafter = setup_models()
    prompts = [[1, 2, 3, 0, 1], [3, 1], [2, 2, 0, 1, 3, 1, 0]]
    batch = seeded_generate(target, drafter, prompts, 5, verify_policy=policy, temperature=0.8)
    alone = seeded_generate(target, drafter, prompts[:1], 5, verify_policy=policy, temperature=0.8)
    torch.manual_seed(5)
    seeds = torch.randint(0, 2**63 - 1, (3,)).tolist()  # what generate() drew, one per row
    plain = [Engine(target).generate([p], max_new_tokens=12, do_sample=True, temperature=0.8, seed=s)[0]
             for p, s in zip(prompts, seeds)]  # fmt: skip
    assert batch == plain and alone == plain[:1]
    assert sum(drafter.generation_stats.accepted_lengths) > 0  # drafts were accepted (in the last call)
