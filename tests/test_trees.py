"""Draft trees (`drafter.config.tree_budget`): growth, the verify mask, acceptance, lossless decoding with trees."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, RepetitionPenaltyLogitsProcessor

from conftest import make_drafter, make_target
from dspark_hf import DSparkConfig, Engine
from dspark_hf.decoding.acceptance import accept_greedy, accept_tree
from dspark_hf.decoding.rows import Row, choose_tokens, process_and_choose, process_logits
from dspark_hf.decoding.trees import ancestors, grow_trees, pack_trees, slot_parents, tree_attention_mask
from helpers import char_tokenizer, pin_drafter


def greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


def tree_drafter(target, budget, **overrides):
    drafter = make_drafter(target, **{"verify_policy": "fixed", **overrides})
    drafter.config.tree_budget = budget
    return drafter


# -- growth, mask and acceptance as pure functions ---------------------------------------------------------------


def _expand_from(table):
    """An `expand` for `grow_trees` from {path tuple: [(token, prob), ...]} (missing paths have no children)."""

    def expand(entries):
        out = []
        for _, tree, node in entries:
            children = table.get(tuple(tree.path(node)), [])
            out.append(([t for t, _ in children], [p for _, p in children], None))
        return out

    return expand


TABLE = {
    (): [(1, 0.6), (2, 0.3), (3, 0.1)],
    (1,): [(4, 0.55), (5, 0.4)],
    (2,): [(6, 0.9)],
    (1, 4): [(7, 0.9)],
    (2, 6): [(8, 0.5)],
}


def test_best_first_growth_joins_nodes_by_path_estimate():
    (tree,) = grow_trees(_expand_from(TABLE), 1, caps=[3], budget=6)
    # estimates: 1: .6, 1-4: .33, 2: .3, 1-4-7: .297, 2-6: .27, 1-5: .24, ...
    assert [tree.path(i) for i in range(len(tree.tokens))] == [[1], [1, 4], [2], [1, 4, 7], [2, 6], [1, 5]]
    assert tree.scores == sorted(tree.scores, reverse=True)
    assert all(p < i for i, p in enumerate(tree.parents))  # a parent joins before its children
    (shallow,) = grow_trees(_expand_from(TABLE), 1, caps=[1], budget=6)  # depth cap 1: the root's children only
    assert shallow.tokens == [1, 2, 3]


def test_growth_stops_at_the_budget_and_for_rows_without_room():
    trees = grow_trees(_expand_from(TABLE), 2, caps=[3, 0], budget=2)
    assert [len(t.tokens) for t in trees] == [2, 0]


def test_ancestor_mask_of_a_small_tree():
    # slots: 0 anchor; 1 = a (parent 0); 2 = b (parent 0); 3 = c (parent 1); 4 = d (parent 3)
    parents = slot_parents(torch.tensor([[0, 0, 1, 3]]), 5)
    seen = ancestors(parents, max_depth=3)[0]
    assert seen.nonzero().tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 2], [3, 0], [3, 1], [3, 3],
                                       [4, 0], [4, 1], [4, 3], [4, 4]]  # fmt: skip
    valid = torch.tensor([[True, True, True, True, False]])  # slot 4 is padding
    mask = tree_attention_mask(torch.tensor([[True, False]]), parents, valid, 3, torch.float32)
    assert mask.shape == (1, 1, 5, 7)
    visible = mask[0, 0] == 0
    assert visible[:, 0].all() and not visible[:, 1].any()  # the cache: its valid slot only
    assert visible[4, 2:].tolist() == [True, True, False, True, False]  # padding: never a key, not even to itself


def test_accept_tree_walks_the_matching_path():
    # nodes: a=10 (root child), b=11 (root child), c=12 (child of b), d=13 (child of a), e=14 (child of c)
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    parents = torch.tensor([[0, 0, 2, 1, 3]])
    # the target's choice per slot: after the anchor 11 (b), after b 12 (c), after c 99 (not e)
    choices = torch.tensor([[11, 0, 12, 99, 0, 0]])
    on_path, depth, bonus = accept_tree(tokens, parents, choices, torch.tensor([5]), max_depth=3)
    assert on_path[0].tolist() == [True, False, True, True, False, False]
    assert depth.tolist() == [2] and bonus.tolist() == [99]
    # with only the first 2 nodes verified, c is out: depth 1, the bonus is the choice after b
    on_path, depth, bonus = accept_tree(tokens, parents, choices, torch.tensor([2]), max_depth=3)
    assert depth.tolist() == [1] and bonus.tolist() == [12]


def test_accept_tree_on_a_chain_is_accept_greedy():
    torch.manual_seed(3)
    for _ in range(20):
        drafts = torch.randint(0, 3, (4, 5))
        choices = torch.randint(0, 3, (4, 6))
        lengths = torch.randint(0, 6, (4,))
        chain_parents = torch.arange(5)[None].expand(4, -1)  # node i hangs off slot i
        _, depth, bonus = accept_tree(drafts, chain_parents, choices, lengths, max_depth=5)
        accepted, chain_bonus = accept_greedy(drafts, choices, lengths)
        assert torch.equal(depth, accepted) and torch.equal(bonus, chain_bonus)


def test_pack_trees_in_join_order():
    packed, up, depths = pack_trees(grow_trees(_expand_from(TABLE), 1, [3], 4), "cpu")
    assert packed.tolist() == [[1, 4, 2, 7]] and up.tolist() == [[0, 1, 0, 2]] and depths.tolist() == [[1, 2, 1, 3]]


class _Counted(Row):
    """A row whose prefix-dependent processor (a repetition penalty) records the prefix of every call."""

    remaining = 10**9

    def __init__(self, seq, do_sample):
        super().__init__(seq, do_sample=do_sample, seed=7 if do_sample else None)
        self.prefixes = []
        penalty = RepetitionPenaltyLogitsProcessor(1.7)

        def processors(ids, scores):
            self.prefixes.append(ids[0].tolist())
            return penalty(ids, scores)

        self.processors = processors


def _random_tree(generator, nodes, vocab, chain):
    """Parents (a node's parent slot) and tokens, siblings distinct; a chain hangs node i off slot i."""
    parents, tokens, depth = [], [], [0]
    for i in range(nodes):
        open_slots = [slot for slot in range(i + 1) if parents.count(slot) < vocab]  # a token left for a child
        parent = i if chain else open_slots[int(torch.randint(0, len(open_slots), (1,), generator=generator))]
        taken = {t for p, t in zip(parents, tokens) if p == parent}
        free = [t for t in range(vocab) if t not in taken]
        parents.append(parent)
        tokens.append(free[int(torch.randint(0, len(free), (1,), generator=generator))])
        depth.append(depth[parent] + 1)
    return parents, tokens, depth[1:]


@pytest.mark.parametrize("chain", [True, False])
def test_processors_run_only_along_the_walk_and_choose_as_every_slot_processed(chain):
    """`process_and_choose` processes a row with prefix-dependent processors only at the slots acceptance reaches:
    the same acceptance, the same processed logits there, as processing every slot (transformers' way)."""
    generator = torch.Generator().manual_seed(5)
    vocab, nodes, rows_n = 4, 6, 3
    calls_saved = 0
    for trial in range(40):
        drafted = [_random_tree(generator, nodes, vocab, chain) for _ in range(rows_n)]
        parents = torch.tensor([d[0] for d in drafted])
        tokens = torch.tensor([d[1] for d in drafted])
        depths = torch.tensor([d[2] for d in drafted])
        lengths = torch.randint(0, nodes + 1, (rows_n,), generator=generator)
        # logits that follow the drafts often (so walks go deep) but not always
        logits = torch.randn(rows_n, nodes + 1, vocab, generator=generator)
        for r in range(rows_n):
            for s in range(1, nodes + 1):
                logits[r, parents[r, s - 1], tokens[r, s - 1]] += 1.5
        seqs = [torch.randint(0, vocab, (5,), generator=generator).tolist() for _ in range(rows_n)]
        fresh = [_Counted(seq, do_sample=r == 1) for r, seq in enumerate(seqs)]
        eager = [_Counted(seq, do_sample=r == 1) for r, seq in enumerate(seqs)]
        up = None if chain else parents
        at = None if chain else depths
        processed, choices = process_and_choose(fresh, logits, tokens, lengths.tolist(), up, at)
        if chain:
            every = process_logits(eager, logits, tokens)
            offsets = None
        else:
            paths = [[[]] for _ in range(rows_n)]
            for r in range(rows_n):
                for s in range(1, nodes + 1):
                    paths[r].append(paths[r][parents[r, s - 1]] + [tokens[r, s - 1].item()])
            every = process_logits(eager, logits, paths=paths)
            offsets = [[0] + d for d in depths.tolist()]
        reference = choose_tokens(eager, every, counts=(lengths + 1).tolist(), offsets=offsets)
        walked = accept_tree(tokens, parents, choices, lengths, max_depth=nodes)
        expected = accept_tree(tokens, parents, reference, lengths, max_depth=nodes)
        assert all(torch.equal(a, b) for a, b in zip(walked, expected)), trial
        on_path = expected[0]
        for r in range(rows_n):
            slots = on_path[r].nonzero()[:, 0]
            assert torch.equal(processed[r, slots], every[r, slots])
            # one call per slot on the walk, each with that slot's own path as prefix
            assert len(fresh[r].prefixes) == len(slots) == expected[1][r] + 1
            assert all(eager[r].prefixes[s] == fresh[r].prefixes[k] for k, s in enumerate(slots.tolist()))
            calls_saved += len(eager[r].prefixes) - len(fresh[r].prefixes)
    assert calls_saved > 0  # the random walks did stop short


# -- lossless decoding with trees ---------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["markov", "gated_markov", "rnn", "none"])
@pytest.mark.parametrize("budget", [1, 6, 16])
def test_random_drafter_with_a_tree_matches_greedy(target, head, budget):
    extra = {"confidence_with_markov": False} if head == "none" else {}
    drafter = tree_drafter(target, budget, sequential_head=head, **extra)
    ids = torch.randint(0, 99, (1, 6))
    ref = greedy(target, ids, max_new_tokens=19)
    assert torch.equal(ref, greedy(target, ids, max_new_tokens=19, assistant_model=drafter))
    stats = drafter.generation_stats
    assert sum(stats.accepted_lengths) + stats.num_target_forwards + 1 == 19
    assert max(stats.verify_lengths) == budget and max(stats.depths) <= drafter.config.block_size


def test_threshold_policy_verifies_the_nodes_above_it(target):
    drafter = tree_drafter(target, 12, verify_policy="threshold", confidence_threshold=0.03)
    ids = torch.randint(0, 99, (1, 5))
    ref = greedy(target, ids, max_new_tokens=17)
    assert torch.equal(ref, greedy(target, ids, max_new_tokens=17, assistant_model=drafter))
    stats = drafter.generation_stats
    # a row alone verifies exactly its nodes whose path estimate reaches the threshold (estimates never increase)
    assert stats.verify_lengths == [sum(a >= 0.03 for a in s) for s in stats.survivals]
    assert len(set(stats.verify_lengths)) > 1


def test_scheduler_with_a_steep_profile_verifies_short_trees(target):
    prompts = [torch.randint(0, 99, (n,)).tolist() for n in (4, 9)]
    steep = {b: 100.0 / b for b in range(1, 200)}
    engine = Engine(target, tree_drafter(target, 10), verify_policy="scheduler", sps=steep, gate_drafts=False)
    outputs = engine.generate(prompts, max_new_tokens=15)
    assert outputs == [greedy(target, torch.tensor([p]), max_new_tokens=15)[0, len(p) :].tolist() for p in prompts]
    assert engine.stats["verified_drafts"] < 10 * engine.stats["request_rounds"] / 2


def test_oracle_tree_accepts_the_whole_depth(target):
    ids = torch.randint(0, 99, (1, 5))
    ref = greedy(target, ids, max_new_tokens=30)
    drafter = pin_drafter(tree_drafter(target, 8), ref)
    assert torch.equal(ref, greedy(target, ids, max_new_tokens=30, assistant_model=drafter))
    stats = drafter.generation_stats
    assert stats.per_position_acceptance == [1.0] * drafter.config.block_size
    assert stats.accepted_lengths[:-1] == [4] * (len(stats.accepted_lengths) - 1)


def runner_up_drafter(target, refs, wrong_at, budget):
    """Pinned to the reference but wrong at block slot `wrong_at`, where the reference token is the runner-up (one
    logit below): a chain accepts `wrong_at` drafts a round, a tree can take the runner-up branch."""
    drafter = pin_drafter(tree_drafter(target, budget, randomize_heads=False), refs, diverge_at=wrong_at)
    pinned = drafter.draft_base_logits

    def with_runner_up(h, lm_head):
        logits = pinned(h, lm_head)
        top = logits.argmax(dim=-1, keepdim=True)
        return logits.scatter(-1, (top - 1) % logits.shape[-1], 1e4 - 1.0)  # the token below each pinned one

    drafter.draft_base_logits = with_runner_up
    return drafter


@pytest.mark.parametrize("wrong_at", [0, 1])
def test_a_tree_recovers_where_the_chain_diverges(target, wrong_at):
    ids = torch.randint(0, 99, (1, 5))
    ref = greedy(target, ids, max_new_tokens=25)
    taus = {}
    for budget in (0, 10):
        drafter = runner_up_drafter(target, ref, wrong_at, budget)
        assert torch.equal(ref, greedy(target, ids, max_new_tokens=25, assistant_model=drafter))
        stats = drafter.generation_stats
        taus[budget] = stats.acceptance_length
        if budget:  # the accepted path leaves the top-1 chain: accepted nodes are not a prefix of the slots
            assert max(stats.accepted_lengths) > wrong_at
    assert taus[10] > taus[0]


def test_rows_of_different_lengths_with_trees(target):
    prompts = [[5, 17, 3], [40, 2, 9, 11, 7, 33, 8], [61], [12, 90, 4, 4, 71]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    refs = [greedy(target, torch.tensor([p]), max_new_tokens=21)[0].tolist() for p in prompts]
    for drafter in (tree_drafter(target, 7), runner_up_drafter(target, refs, 1, 7)):
        out = greedy(target, ids, attention_mask=mask, max_new_tokens=21, assistant_model=drafter)
        assert out[:, width:].tolist() == [r[len(p) :] for p, r in zip(prompts, refs)]


def test_eos_inside_a_tree():
    target = make_target()
    ids = torch.randint(0, 99, (1, 5))
    ref_long = greedy(target, ids, max_new_tokens=20)
    eos = int(ref_long[0, 5 + 6])
    target.generation_config.eos_token_id = eos
    ref = greedy(target, ids, max_new_tokens=20)
    drafter = runner_up_drafter(target, ref_long, 1, 9)
    assert torch.equal(ref, greedy(target, ids, max_new_tokens=20, assistant_model=drafter))


def test_stop_strings_and_processors_with_a_tree(target):
    tok = char_tokenizer(99)
    ids = torch.randint(0, 99, (1, 5))
    ref_long = greedy(target, ids, max_new_tokens=20)
    stop = tok.decode(ref_long[0, 5 + 8 : 5 + 10])
    kw = dict(max_new_tokens=20, stop_strings=[stop], tokenizer=tok)
    ref = greedy(target, ids, **kw)
    assert torch.equal(ref, greedy(target, ids, assistant_model=runner_up_drafter(target, ref_long, 1, 8), **kw))
    # a prefix-dependent processor: each slot is processed with its own ancestors
    kw = dict(max_new_tokens=16, repetition_penalty=1.3, return_dict_in_generate=True, output_scores=True)
    ref = greedy(target, ids, **kw)
    out = greedy(target, ids, assistant_model=tree_drafter(target, 9), **kw)
    assert torch.equal(ref.sequences, out.sequences)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ref.scores, out.scores))


def test_engine_with_trees(target):
    prompts = [torch.randint(0, 99, (n,)).tolist() for n in (1, 5, 17, 9, 3)]
    budgets = [23, 9, 30, 1, 14]
    engine = Engine(target, tree_drafter(target, 8), verify_policy="fixed", max_batch_size=3)
    requests = [engine.add_request(p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    while engine.has_unfinished():
        engine.step()
    for request, prompt, n in zip(requests, prompts, budgets):
        plain = greedy(target, torch.tensor([prompt]), max_new_tokens=n)[0, len(prompt) :]
        assert request.output_ids == plain.tolist()


# -- what trees refuse --------------------------------------------------------------------------------------------


def test_tree_budget_is_validated():
    with pytest.raises(ValueError, match="tree_budget"):
        DSparkConfig(tree_budget=-1)


def test_sliding_windows_refuse_trees(target):
    ids = torch.randint(0, 99, (1, 5))
    sliding = make_target(config_cls=MistralConfig, model_cls=MistralForCausalLM, sliding_window=6)
    with pytest.raises(ValueError, match="tree_budget=8, but MistralForCausalLM has sliding-window layers"):
        greedy(sliding, ids, max_new_tokens=5, assistant_model=tree_drafter(sliding, 8))


def test_bench_runs_chain_and_trees_side_by_side(tmp_path, capsys):
    from dspark_hf.cli import main
    from dspark_hf.evaluation.harness import run_evaluation

    target, tok = make_target(), char_tokenizer(99)
    drafter = make_drafter(target, verify_policy="fixed")
    records = [{"prompt": "Hello there"}, {"prompt": "abc"}]
    result = run_evaluation(target, tok, {"d": drafter}, {"x": records}, 12, progress=False, tree_budgets=(0, 6))
    assert [(r["drafter"], r["tree_budget"]) for r in result["runs"]] == [("d chain", 0), ("d tree 6", 6)]
    assert result["all_identical"] and drafter.config.tree_budget == 0  # restored
    chain, tree = result["runs"]
    assert chain["mean_verify_length"] <= 4 < tree["mean_verify_length"] <= 6  # nodes verified per round
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    for budgets in ("0,-8", "0,500", "0,tree"):  # the one check of `tree_budget` (settings.check_tree_budget)
        assert main(["bench", "--prompts", str(tmp_path / "p.jsonl"), "--tree-budget", budgets]) == 2
        assert "--tree-budget" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tree_budget"):
        run_evaluation(target, tok, {"d": drafter}, {"x": records}, 4, progress=False, tree_budgets=(0, 500))


def test_return_dict_hidden_states_and_pipeline_with_a_tree(target):
    """Per new token the hidden states of the slot that chose it, also when the accepted path skips slots."""
    from transformers import pipeline

    ids = torch.randint(0, 99, (2, 6))
    refs = greedy(target, ids, max_new_tokens=20)
    kw = dict(max_new_tokens=9, return_dict_in_generate=True, output_hidden_states=True, output_logits=True)
    ref = greedy(target, ids, **kw)
    out = greedy(target, ids, assistant_model=runner_up_drafter(target, refs, 1, 8), **kw)
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.logits, out.logits):
        assert torch.allclose(a, b, atol=1e-4)
    for step, (a, b) in enumerate(zip(ref.hidden_states, out.hidden_states)):
        for layer_a, layer_b in zip(a, b):
            assert layer_a.shape == layer_b.shape and torch.allclose(layer_a, layer_b, atol=1e-4), step
    pipe = pipeline("text-generation", model=target, tokenizer=char_tokenizer(99))
    assert pipe("Hello trees", max_new_tokens=12, do_sample=False) == pipe(
        "Hello trees", max_new_tokens=12, do_sample=False, assistant_model=tree_drafter(target, 6)
    )


# -- sampling: the seeded coupling makes the tree walk exact -------------------------------------------------------


def _tree_sampling_models(budget=6):
    from test_sampling import setup_models

    target, drafter = setup_models()
    drafter.config.tree_budget, drafter.config.verify_policy = budget, "fixed"  # every node verified
    return target, drafter


@pytest.mark.parametrize("policy", ["fixed", "scheduler"])
def test_seeded_sampling_with_a_tree_is_plain_seeded_sampling(policy):
    """A sampling row's tokens are the seeded sampler's own: the same with a tree of 6, 8 or 16 nodes, a chain or no
    drafter, under either policy, in generate() and the Engine (each committed token is the target's Gumbel-max
    choice at its position, whichever node carried it)."""
    from test_sampling import seeded_generate

    target, drafter = _tree_sampling_models()
    prompts = [[1, 2, 3, 0, 1], [3, 1], [2, 2, 0, 1, 3, 1, 0]]
    batch = seeded_generate(target, drafter, prompts, 5, verify_policy=policy, temperature=0.8)
    assert policy != "fixed" or max(drafter.generation_stats.verify_lengths) > 3  # more nodes than positions
    for budget in (0, 8, 16):
        drafter.config.tree_budget = budget
        assert batch == seeded_generate(target, drafter, prompts, 5, verify_policy=policy, temperature=0.8), budget
    drafter.config.tree_budget = 0
    torch.manual_seed(5)
    seeds = torch.randint(0, 2**63 - 1, (3,)).tolist()  # what generate() drew, one per row
    plain = [Engine(target).generate([p], max_new_tokens=12, do_sample=True, temperature=0.8, seed=s)[0]
             for p, s in zip(prompts, seeds)]  # fmt: skip
    assert batch == plain
    drafter.config.tree_budget = 6
    engine = Engine(target, drafter, verify_policy="fixed")
    outputs = [engine.generate([p], max_new_tokens=12, do_sample=True, temperature=0.8, seed=7)[0] for p in prompts]
    assert outputs == [Engine(target).generate([p], max_new_tokens=12, do_sample=True, temperature=0.8, seed=7)[0]
                       for p in prompts]  # fmt: skip


def _tree_chi_square(n=1500):
    from test_sampling import chi_square_rejects, draw, exact_joint, warpers

    target, drafter = _tree_sampling_models()
    probs = exact_joint(target, warpers())
    torch.manual_seed(1234)
    samples = draw(target, drafter, n, rows=50, top_k=0, top_p=1.0)
    stats = drafter.generation_stats
    return chi_square_rejects(samples, probs), stats


def test_sampling_with_a_tree_matches_target_distribution():
    """x1 comes from the prefill; x2 and x3 are decided inside the first round's tree (block 3, 6 nodes over a
    4-token vocabulary: several children per node), and their joint law must be the target's."""
    (rejects, stat, critical), stats = _tree_chi_square()
    assert max(stats.verify_lengths) == 6 and max(stats.accepted_lengths) >= 2
    assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: sampling with a tree differs from the target's"


def test_negative_control_a_node_taken_without_the_targets_choice_is_detected(monkeypatch):
    """The walk must move only to the child equal to the target's choice: taking the first node after the anchor
    whatever the target chose (x2 then follows the drafter) must make the chi-square test fail. (Subtler tree bugs,
    a node seeing its siblings or drawing with its slot's noise, do not move the first tokens' law enough on a tiny
    random target to be seen here; the greedy identity tests above catch the first.)"""
    from dspark_hf.decoding import core

    def first_node_taken(tokens, parents, choices, lengths, max_depth):
        choices = choices.clone()
        choices[:, 0] = torch.where(lengths > 0, tokens[:, 0], choices[:, 0])
        return accept_tree(tokens, parents, choices, lengths, max_depth)

    monkeypatch.setattr(core, "accept_tree", first_node_taken)
    (rejects, stat, critical), _ = _tree_chi_square()
    assert rejects, f"the test failed to notice nodes taken without the target's choice (chi2 {stat:.1f})"


# -- tree_budget="auto": trees where the round can price them and the machine's profile makes width cheap ---------


FLAT = {b: 100.0 for b in range(1, 64)}  # width free: every verify costs one step
STEEP = {b: 100.0 / b for b in range(1, 64)}  # each token one more step (a target verifying token by token)


def _spy_budgets(monkeypatch) -> list:
    """The tree budget of every draft pass (0: a chain), as the decoder resolves it round by round."""
    from dspark_hf.decoding.drafting import DSparkCandidateGenerator

    seen, original = [], DSparkCandidateGenerator.propose

    def propose(self, *args, tree_budget=0, **kwargs):
        seen.append(tree_budget)
        return original(self, *args, tree_budget=tree_budget, **kwargs)

    monkeypatch.setattr(DSparkCandidateGenerator, "propose", propose)
    return seen


def _info_lines(caplog, run) -> list[str]:
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO):
            run()
    finally:
        hf_logging.set_verbosity_warning()
    return [r.getMessage() for r in caplog.records if 'tree_budget="auto"' in r.getMessage()]


def test_auto_drafts_trees_where_the_profile_makes_width_cheap(target, monkeypatch, caplog):
    """Under Algorithm 1, "auto" drafts trees of AUTO_TREE_BUDGET nodes on a flat profile and chains on a profile
    where each verified token costs a step (one info line says why); greedy output is plain greedy either way."""
    from dspark_hf.models.settings import AUTO_TREE_BUDGET

    seen = _spy_budgets(monkeypatch)
    ids = torch.randint(0, 99, (2, 5))
    ref = greedy(target, ids, max_new_tokens=12)
    lines = {}
    for name, sps, want in (("flat", FLAT, AUTO_TREE_BUDGET), ("steep", STEEP, 0)):
        drafter = tree_drafter(target, "auto", verify_policy="scheduler", draft_gate=False)
        drafter.sps_profile = sps
        seen.clear()
        out = []

        def run(d=drafter, out=out):
            out.append(greedy(target, ids, max_new_tokens=12, assistant_model=d))

        lines[name] = _info_lines(caplog, run)
        assert torch.equal(out[0], ref), name
        assert seen and set(seen) == {want}, name
        assert drafter.config.tree_budget == "auto"  # the setting is left as it was
    assert lines["flat"] == []
    assert sum("costs 17.0 one-token steps" in line for line in lines["steep"]) == 1
    # said once per drafter and target: not again for the same drafter, again for another one
    caplog.clear()
    again = _info_lines(caplog, lambda: greedy(target, ids, max_new_tokens=4, assistant_model=drafter))
    other = tree_drafter(target, "auto", verify_policy="scheduler", draft_gate=False)
    other.sps_profile = STEEP
    caplog.clear()
    first = _info_lines(caplog, lambda: greedy(target, ids, max_new_tokens=4, assistant_model=other))
    assert again == [] and sum("costs 17.0 one-token steps" in line for line in first) == 1


def test_auto_drafts_chains_where_a_round_cannot_take_a_tree(target, monkeypatch, caplog):
    """ "auto" never refuses a call: the threshold policy (which does not price nodes against the machine), a
    sliding-window target (a tree's mask) and rows sampling with sampling="standard" (chains only) get chains, where
    an explicit budget is refused."""
    seen = _spy_budgets(monkeypatch)
    ids = torch.randint(0, 99, (1, 5))
    drafter = tree_drafter(target, "auto", verify_policy="threshold")
    lines = _info_lines(caplog, lambda: greedy(target, ids, max_new_tokens=8, assistant_model=drafter))
    assert set(seen) == {0} and any('verify_policy="threshold" does not price' in line for line in lines)
    sliding = make_target(config_cls=MistralConfig, model_cls=MistralForCausalLM, sliding_window=6)
    seen.clear()
    auto = tree_drafter(sliding, "auto", verify_policy="scheduler")
    auto.sps_profile = FLAT
    plain = greedy(sliding, ids, max_new_tokens=8)
    assert torch.equal(plain, greedy(sliding, ids, max_new_tokens=8, assistant_model=auto))
    assert set(seen) == {0}
    from test_sampling import PROMPT, setup_models

    small, sampler = setup_models()
    sampler.config.verify_policy, sampler.sps_profile = "scheduler", FLAT
    runs = {}
    for budget in (0, "auto"):
        sampler.config.tree_budget = budget
        seen.clear()
        torch.manual_seed(3)
        runs[budget] = small.generate(
            PROMPT, do_sample=True, max_new_tokens=6, assistant_model=sampler, sampling="standard"
        )
        assert set(seen) <= {0}
    assert torch.equal(runs[0], runs["auto"])  # the same chains, the same seed: the same tokens
    sampler.config.tree_budget = 8
    with pytest.raises(ValueError, match="sampling='standard' verifies chains only"):
        small.generate(PROMPT, do_sample=True, max_new_tokens=6, assistant_model=sampler, sampling="standard")


def test_auto_keeps_same_seed_same_tokens(monkeypatch):
    """Coupled sampling: "auto" (trees here) gives the tokens of a chain and of plain seeded decoding."""
    from test_sampling import seeded_generate

    seen = _spy_budgets(monkeypatch)
    target, drafter = _tree_sampling_models()
    drafter.config.verify_policy, drafter.config.draft_gate, drafter.sps_profile = "scheduler", False, FLAT
    prompts = [[1, 2, 3, 0, 1], [3, 1]]
    drafter.config.tree_budget = 0
    chain = seeded_generate(target, drafter, prompts, 5, verify_policy="scheduler", temperature=0.8)
    drafter.config.tree_budget = "auto"
    seen.clear()
    assert seeded_generate(target, drafter, prompts, 5, verify_policy="scheduler", temperature=0.8) == chain
    assert 16 in seen


def test_auto_is_a_valid_setting_and_other_strings_are_not():
    assert DSparkConfig(tree_budget="auto").tree_budget == "auto"
    with pytest.raises(ValueError, match='"auto" or an int in 0..128'):
        DSparkConfig(tree_budget="trees")


def test_a_trees_top_path_is_priced_as_the_chain(target, monkeypatch):
    """With a confidence head, a tree's first child is estimated by the head's calibrated c_k, exactly the survival the
    chain drafting that path gets, and its other children share 1 - c_k by draft probability (so Algorithm 1 prices a
    tree's top path as it prices the chain)."""
    from dspark_hf.decoding import drafting

    chains, trees = [], []
    sample, grow = drafting.DSparkCandidateGenerator._sample, drafting.grow_trees

    def recorded_sample(self, *args, **kwargs):
        chains.append(sample(self, *args, **kwargs))
        return chains[-1]

    monkeypatch.setattr(drafting.DSparkCandidateGenerator, "_sample", recorded_sample)
    monkeypatch.setattr(drafting, "grow_trees", lambda *a, **k: trees.append(grow(*a, **k)) or trees[-1])
    drafter = tree_drafter(target, 0)
    ids = torch.randint(0, 99, (1, 6))
    greedy(target, ids, max_new_tokens=9, assistant_model=drafter)
    drafter.config.tree_budget = 6
    greedy(target, ids, max_new_tokens=9, assistant_model=drafter)
    chain, (tree,) = chains[0], trees[0]
    first = chain.tokens[0, 0].item()
    (node,) = [i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == -1 and t == first]
    assert tree.scores[node] == pytest.approx(chain.conditional[0][0], abs=1e-6)
    siblings = [tree.scores[i] for i, p in enumerate(tree.parents) if p == -1 and i != node]
    assert siblings and sum(siblings) <= 1 - tree.scores[node] + 1e-6


def test_head_estimates_share_what_the_head_leaves():
    from dspark_hf.decoding.drafting import _head_estimates

    kept = [(5, 0.5), (7, 0.3), (9, 0.2)]
    high = _head_estimates(kept, 0.8, sort=True)
    assert [t for t, _ in high] == [5, 7, 9] and [e for _, e in high] == pytest.approx([0.8, 0.2 * 0.6, 0.2 * 0.4])
    low = _head_estimates(kept, 0.1, sort=True)  # a doubtful head: a sibling may be the better bet
    assert low[0] == (7, pytest.approx(0.9 * 0.6)) and (5, 0.1) in low
    assert _head_estimates(kept, 0.1, sort=False)[0] == (5, 0.1)  # a sampling row keeps its coupled draft first


def test_each_way_of_a_bench_run_keeps_its_own_gate_memory():
    """The chain and tree variants of one drafter are one object: each gets its own draft gate memory for the run,
    and the memory the drafter carried before is left untouched and restored."""
    from dspark_hf.decoding.gate import GateMemory
    from dspark_hf.evaluation.harness import gate_memory, run_evaluation
    from dspark_hf.kernels.runtime import runtime_for

    target, tok = make_target(), char_tokenizer(99)
    drafter = make_drafter(target, verify_policy="scheduler")
    drafter.sps_profile = FLAT
    gates = runtime_for(target).gates
    mine = gates[drafter] = GateMemory()
    seen = []
    with gate_memory(target, drafter, GateMemory()):
        seen.append(gates[drafter])
    assert seen[0] is not mine and gates[drafter] is mine
    records = [{"prompt": "Hello there"}, {"prompt": "abc"}]
    result = run_evaluation(target, tok, {"d": drafter}, {"x": records}, 10, progress=False, tree_budgets=(0, "auto"))
    assert result["all_identical"] and [r["tree_budget"] for r in result["runs"]] == [0, "auto"]
    assert gates[drafter] is mine and not mine.draft_seconds  # the run measured into memories of its own


def test_auto_drafts_chains_over_long_contexts(target, monkeypatch):
    """A row's context past AUTO_TREE_CONTEXT makes "auto" rounds chains (width costs more over a long cache than the
    profile shows): a row crossing it mid-call switches, with greedy output plain greedy throughout."""
    from dspark_hf.decoding import core

    monkeypatch.setattr(core, "AUTO_TREE_CONTEXT", 10)
    seen = _spy_budgets(monkeypatch)
    ids = torch.randint(0, 99, (1, 5))
    drafter = tree_drafter(target, "auto", verify_policy="scheduler", draft_gate=False)
    drafter.sps_profile = FLAT
    assert torch.equal(
        greedy(target, ids, max_new_tokens=20), greedy(target, ids, max_new_tokens=20, assistant_model=drafter)
    )
    assert seen[0] == 16 and seen[-1] == 0 and seen == sorted(seen, reverse=True)
