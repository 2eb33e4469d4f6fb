"""`sampling="standard"`: standard speculative (rejection) sampling of chains has exactly the target's distribution.

The rule alone (`acceptance.accept_standard`) is checked on hand-made distributions; the whole round by the
chi-square test of test_sampling.py on the joint of the first three generated tokens (the second and third are
decided inside a round: an accepted draft, a residual draw or a bonus). Negative controls: a rule that accepts every
draft, and one that draws a rejected slot's token from p instead of the residual, must both be detected. A seed fixes
the output for one drafter and settings; greedy rows ignore the option; trees are refused with the fix named.
"""

import pytest
import torch
from test_sampling import PROMPT, chi_square_rejects, draw, exact_joint, seeded_generate, setup_models, warpers

from dspark_hf import Engine
from dspark_hf.decoding import rows
from dspark_hf.decoding.acceptance import accept_standard
from dspark_hf.decoding.randomness import draw as inverse_cdf


P = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
Q = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.4])  # puts mass where p has none (token 4) and none where p has some (3)


def one_slot(n: int, rule=accept_standard, seed: int = 0) -> torch.Tensor:
    """The committed token of n independent one-draft rounds with target p = P and draft q = Q: (n,)."""
    gen = torch.Generator().manual_seed(seed)
    drafts = inverse_cdf(Q.expand(n, -1), torch.rand(n, generator=gen, dtype=torch.float64))
    q = Q.expand(n, 1, -1)  # (n, W-1 = 1, V)
    p = P.expand(n, 2, -1)  # (n, W = 2, V): slot 1 (the bonus after an accepted draft) also P
    u, bonus_u = (
        torch.rand(n, 1, generator=gen, dtype=torch.float64),
        torch.rand(n, generator=gen, dtype=torch.float64),
    )
    accepted, bonus = rule(drafts[:, None], q, p, torch.ones(n, dtype=torch.long), u, bonus_u)
    return torch.where(accepted == 1, drafts, bonus), accepted


def rejects_p(tokens: torch.Tensor) -> tuple[bool, float, float]:
    return chi_square_rejects([(t,) for t in tokens.tolist()], {(v,): float(P[v]) for v in range(len(P))})


def test_inverse_cdf_draws_follow_the_distribution_and_never_a_zero():
    probs = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0]])  # unnormalised, zeros at both ends of a run
    tokens = inverse_cdf(probs.expand(4000, -1), torch.rand(4000, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=5)
    assert counts[0] == counts[2] == 0
    edge = inverse_cdf(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert edge.tolist() == [1, 4]
    rejects, stat, critical = chi_square_rejects([(t,) for t in tokens.tolist()], {(1,): 0.5, (3,): 0.25, (4,): 0.25})
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}"


def test_standard_rule_commits_the_target_distribution_and_accepts_one_minus_tv():
    tokens, accepted = one_slot(20000)
    rejects, stat, critical = rejects_p(tokens)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: the standard rule differs from p"
    assert (tokens != 4).all()  # p(4) = 0: never committed, though q drafts it 40 % of the time
    overlap = torch.minimum(P, Q).sum().item()  # P(accept) = Σ min(p, q) = 1 - TV(p, q)
    assert abs(accepted.float().mean().item() - overlap) < 0.02


def test_negative_controls_of_the_rule_are_detected():
    """Accepting every draft commits q; drawing a rejected slot's token from p instead of the residual over-weights
    the tokens q already covers. The same chi-square test must reject both."""

    def accept_always(draft_ids, draft_probs, target_probs, lengths, u, bonus_u):
        return accept_standard(draft_ids, draft_probs, target_probs, lengths, torch.zeros_like(u) - 1, bonus_u)

    def no_residual(draft_ids, draft_probs, target_probs, lengths, u, bonus_u):
        accepted, _ = accept_standard(draft_ids, draft_probs, target_probs, lengths, u, bonus_u)
        at = accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])
        return accepted, inverse_cdf(target_probs.gather(1, at)[:, 0], bonus_u)

    for rule in (accept_always, no_residual):
        rejects, stat, critical = rejects_p(one_slot(20000, rule)[0])
        assert rejects, f"{rule.__name__} went unnoticed (chi2 {stat:.1f} <= {critical:.1f})"


def test_standard_rule_batches_ragged_lengths():
    """Rows verifying 0, 1 and 2 drafts in one call: a row's accepted count never passes its length, and a row that
    verified nothing draws its bonus from p at slot 0."""
    v = 5
    p = torch.zeros(3, 3, v)
    p[..., 2] = 1.0  # the target always says 2
    q = torch.zeros(3, 2, v)
    q[..., 2] = 1.0
    drafts = torch.full((3, 2), 2)
    u = torch.full((3, 2), 0.5, dtype=torch.float64)
    accepted, bonus = accept_standard(drafts, q, p, torch.tensor([0, 1, 2]), u, torch.full((3,), 0.3).double())
    assert accepted.tolist() == [0, 1, 2] and bonus.tolist() == [2, 2, 2]


def standard_check(n, kind="dspark", rows=50, **sampling):
    target, drafter = setup_models(kind)
    probs = exact_joint(target, warpers(**sampling))
    torch.manual_seed(4321)
    settings = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **sampling}
    samples = draw(target, drafter, n, rows=rows, sampling="standard", **settings)
    return chi_square_rejects(samples, probs), drafter


@pytest.mark.parametrize(
    "kind, sampling",
    [
        ("dspark", dict()),
        ("dspark", dict(temperature=0.7, top_k=3, top_p=0.9)),
        ("dspark_draft_vocab", dict()),
        pytest.param("eagle3", dict(), marks=pytest.mark.slow),
    ],
)
def test_standard_sampling_matches_target_distribution(kind, sampling):
    (rejects, stat, critical), drafter = standard_check(1500, kind=kind, **sampling)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: standard sampling ({kind}) differs from the target's"
    assert sum(drafter.generation_stats.accepted_lengths) > 0  # drafts were accepted inside rounds


@pytest.mark.slow
def test_standard_sampling_single_row_matches_target_distribution():
    (rejects, stat, critical), _ = standard_check(800, rows=1)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: standard sampling (one row) differs from the target's"


def test_negative_control_accepting_every_draft_in_the_round_is_detected(monkeypatch):
    def accept_always(draft_ids, draft_probs, target_probs, lengths, u, bonus_u):
        return accept_standard(draft_ids, draft_probs, target_probs, lengths, torch.zeros_like(u) - 1, bonus_u)

    monkeypatch.setattr(rows, "accept_standard", accept_always)
    (rejects, stat, critical), _ = standard_check(1500)
    assert rejects, f"the test failed to notice a rule that accepts every draft (chi2 {stat:.1f} <= {critical:.1f})"


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=0.6), dict(top_k=2), dict(top_p=0.8)])
def test_standard_sampling_matches_target_distribution_many_samples(sampling):
    (rejects, stat, critical), _ = standard_check(6000, **sampling)
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}"


@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_standard_sampling_same_seed_same_tokens(policy):
    """generate() and the Engine: a seed gives one output for a fixed drafter and settings."""
    target, drafter = setup_models()
    prompts = [[1, 2, 3, 0, 1], [3, 1], [2, 2, 0, 1, 3, 1, 0]]
    kwargs = dict(verify_policy=policy, temperature=0.8, sampling="standard")
    first = seeded_generate(target, drafter, prompts, 5, **kwargs)
    assert first == seeded_generate(target, drafter, prompts, 5, **kwargs)
    assert first != seeded_generate(target, drafter, prompts, 6, **kwargs)
    engine = Engine(target, drafter, verify_policy=policy)
    runs = [
        [engine.add_request(p, max_new_tokens=12, do_sample=True, seed=7, sampling="standard").wait() for p in prompts]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_greedy_rows_ignore_standard_sampling():
    target, drafter = setup_models()
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=10)
    for mode in ("coupled", "standard"):
        out = target.generate(PROMPT, do_sample=False, max_new_tokens=10, assistant_model=drafter, sampling=mode)
        assert out.tolist() == plain.tolist()


def test_standard_sampling_refuses_trees_and_unknown_modes():
    target, drafter = setup_models()
    drafter.config.tree_budget = 4
    with pytest.raises(ValueError, match=r"sampling='standard' verifies chains only.*tree_budget = 0"):
        target.generate(PROMPT, do_sample=True, max_new_tokens=4, assistant_model=drafter, sampling="standard")
    with pytest.raises(ValueError, match="verifies chains only"):
        Engine(target, drafter).add_request([1, 2], do_sample=True, sampling="standard")
    target.generate(PROMPT, do_sample=False, max_new_tokens=4, assistant_model=drafter, sampling="standard")  # greedy
    drafter.config.tree_budget = 0
    with pytest.raises(ValueError, match=r"`sampling` must be one of 'coupled', 'standard', got 'rejection'"):
        target.generate(PROMPT, do_sample=True, max_new_tokens=4, assistant_model=drafter, sampling="rejection")


def test_standard_rows_do_not_take_lookup_drafts():
    """Choosing the lookup's chain over the drafter's looks at the drafter's tokens; standard rows keep theirs."""
    target, drafter = setup_models()
    drafter.config.context_lookup = 1
    prompt = torch.tensor([[1, 2, 1, 2, 1, 2, 1, 2, 1, 2]])
    torch.manual_seed(0)
    target.generate(prompt, do_sample=True, max_new_tokens=12, assistant_model=drafter, sampling="standard")
    assert drafter.generation_stats.lookup_rounds == 0 and "lookup" not in drafter.generation_stats.sources
    torch.manual_seed(0)
    target.generate(prompt, do_sample=True, max_new_tokens=12, assistant_model=drafter)  # coupled: it may
    assert drafter.generation_stats.lookup_rounds > 0
