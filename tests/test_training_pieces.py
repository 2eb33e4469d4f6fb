"""Training pieces: anchors, the block mask (training pass == inference pass), labels, and the DSpark loss."""

import math

import pytest
import torch
from transformers import DynamicCache

from conftest import make_drafter
from dspark_hf.training import dspark_loss, make_blocks, position_weights, sample_anchors
from dspark_hf.training.step import drafter_block_hidden, freeze, target_features, training_loss


def test_anchors_lie_inside_the_loss_mask():
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, 5:15] = True
    mask[1, 18:] = True  # only one candidate: 18 (19 is last)
    anchors, valid = sample_anchors(mask, 6, torch.Generator().manual_seed(0))
    assert valid[0].all() and valid[1].sum() == 1
    a0 = anchors[0]
    assert len(set(a0.tolist())) == 6 and ((a0 >= 5) & (a0 <= 13)).all()
    assert anchors[1, 0] == 18


def test_block_labels_and_cumulative_validity():
    ids = torch.arange(10)[None] + 10
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 7] = False
    blocks = make_blocks(ids, mask, block_size=4, num_anchors=9, generator=torch.Generator().manual_seed(0))
    n_valid = 7  # anchors need positions a and a + 1 in the mask: 0..5 and 8
    assert blocks.valid[0, n_valid:].sum() == 0
    for n, a in enumerate(blocks.anchors[0, :n_valid].tolist()):
        assert blocks.prev_ids[0, n, 0] == ids[0, a]
        for k in range(4):
            pos = a + k + 1
            inside = all(p < 10 and p != 7 for p in range(a + 1, pos + 1))
            assert bool(blocks.valid[0, n, k]) == inside
            if pos < 10:
                assert blocks.labels[0, n, k] == ids[0, pos]
                assert blocks.label_positions[0, n, k] == pos - 1


@torch.no_grad()
def test_training_pass_equals_inference_pass_per_block(target):
    """All blocks at once under the training mask give exactly what inference gives for each block alone."""
    drafter = make_drafter(target)
    ids = torch.randint(0, 99, (1, 16))
    blocks = make_blocks(ids, torch.ones(1, 16, dtype=torch.bool), 4, 5, torch.Generator().manual_seed(1))
    feats, _ = target_features(target, ids, drafter.config.target_layer_ids)
    embed = target.get_input_embeddings()
    hidden = drafter_block_hidden(drafter, feats, ids, blocks, embed)
    for n, a in enumerate(blocks.anchors[0].tolist()):
        cache = DynamicCache()
        noise = drafter.block_input_embeds(ids[:, a : a + 1], embed)
        ref = drafter(
            noise_embeds=noise,
            context_hidden_states=feats[:, :a] if a else None,
            position_ids=torch.arange(0, a + 4)[None],
            cache=cache,
        ).last_hidden_state
        torch.testing.assert_close(hidden[0, n], ref[0], atol=1e-5, rtol=1e-5)


def test_position_weights_decay_4():
    w = position_weights(7, 4.0)
    assert w[0] == 1.0 and w[4] == pytest.approx(math.exp(-1.0))


def test_loss_terms_on_hand_made_distributions():
    # one block of γ = 2 over V = 3; the second position is not supervised
    draft = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.2, 0.2, 0.6]]]))
    target = torch.log(torch.tensor([[[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]]))
    labels = torch.tensor([[1, 2]])
    valid = torch.tensor([[True, False]])
    conf = torch.tensor([[0.0, 5.0]])
    out = dspark_loss(draft, target, labels, valid, conf)
    assert out.ce.item() == pytest.approx(-math.log(0.25))
    assert out.tv.item() == pytest.approx(0.5)  # |0.5-0.25| + |0.25-0.5| + 0
    c_star = 1 - 0.25
    bce = -(c_star * math.log(0.5) + (1 - c_star) * math.log(0.5))
    assert out.conf.item() == pytest.approx(bce)
    assert out.loss.item() == pytest.approx(0.1 * out.ce.item() + 0.9 * 0.5 + bce)
    assert out.accept_rate[0].item() == pytest.approx(0.75)


def test_kl_term_on_hand_made_distributions():
    # the same block: KL(p_t || p_d) at the supervised position only, added with its weight, off by default
    draft = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.2, 0.2, 0.6]]]))
    target = torch.log(torch.tensor([[[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]]))
    labels, valid = torch.tensor([[1, 2]]), torch.tensor([[True, False]])
    kl = 0.25 * math.log(0.25 / 0.5) + 0.5 * math.log(0.5 / 0.25)
    base = dspark_loss(draft, target, labels, valid)
    assert base.kl.item() == 0.0
    out = dspark_loss(draft, target, labels, valid, alpha_kl=2.0)
    assert out.kl.item() == pytest.approx(kl)
    assert out.loss.item() == pytest.approx(base.loss.item() + 2.0 * kl)
    same = dspark_loss(target, target, labels, valid, alpha_kl=1.0)
    assert same.kl.item() == pytest.approx(0.0, abs=1e-7)


def test_distillation_matches_the_teacher_and_keeps_the_confidence_target_on_the_target():
    # `teacher_logits`: the L1 and KL terms pull towards another drafter's distribution, while c* (the confidence
    # target) still measures acceptance by the target
    draft = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    teacher = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]]))
    target = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]]))
    labels, valid, conf = torch.tensor([[1]]), torch.tensor([[True]]), torch.zeros(1, 1)
    out = dspark_loss(draft, target, labels, valid, conf, alpha_kl=1.0, teacher_logits=teacher)
    assert out.kl.item() == pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5))
    assert out.tv.item() == pytest.approx(0.5)  # |0.5-0.25| + 0 + |0.25-0.5|
    assert out.accept_rate[0].item() == pytest.approx(0.75)  # 1 - ½‖p_d - p_t‖₁, against the target
    own = dspark_loss(teacher, target, labels, valid, conf, alpha_kl=1.0, teacher_logits=teacher)
    assert own.kl.item() == pytest.approx(0.0, abs=1e-7) and own.tv.item() == pytest.approx(0.0, abs=1e-7)
    assert own.accept_rate[0].item() == pytest.approx(0.75)  # the teacher itself is not the target
    # negative control: without a teacher the same call matches the target
    plain = dspark_loss(draft, target, labels, valid, conf, alpha_kl=1.0)
    assert plain.kl.item() == pytest.approx(0.25 * math.log(0.25 / 0.5) + 0.5 * math.log(0.5 / 0.25))


def test_kl_gradient_does_not_vanish_where_l1_does():
    # a drafter that puts almost no mass on the target's token: the L1 term's logit gradient is O(p_d), the KL's
    # is p_d - p_t, so only the KL moves that logit
    target = torch.log(torch.tensor([[[0.01, 0.98, 0.01]]]))
    labels, valid = torch.tensor([[1]]), torch.tensor([[True]])
    grads = {}
    for name, kwargs in {"tv": {}, "kl": {"alpha_kl": 1.0, "alpha_tv": 0.0}}.items():
        draft = torch.tensor([[[12.0, 0.0, 0.0]]], requires_grad=True)
        dspark_loss(draft, target, labels, valid, alpha_ce=0.0, **kwargs).loss.backward()
        grads[name] = -draft.grad[0, 0, 1].item()  # how hard the loss pushes the target's token up
    assert grads["kl"] == pytest.approx(0.98, abs=1e-3)
    assert 0 < grads["tv"] < 1e-4


def test_weighted_mean_normalisation():
    draft = torch.zeros(1, 2, 4)
    target = torch.zeros(1, 2, 4)
    labels = torch.zeros(1, 2, dtype=torch.long)
    both = dspark_loss(draft, target, labels, torch.tensor([[True, True]]))
    assert both.ce.item() == pytest.approx(math.log(4))  # same per-position loss: the weighted mean is that loss


def test_training_step_updates_drafter_and_leaves_target_alone(target):
    drafter = make_drafter(target).train()
    freeze(target)
    before = {k: v.clone() for k, v in drafter.named_parameters()}
    target_before = {k: v.clone() for k, v in target.named_parameters()}
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    ids = torch.randint(0, 99, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.bool)
    losses = []
    for _ in range(2):
        out = training_loss(drafter, target, ids, mask, num_anchors=6, generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert all(math.isfinite(x) for x in losses)
    for name, p in drafter.named_parameters():
        assert not torch.equal(before[name], p), f"{name} did not change"
    for name, p in target.named_parameters():
        assert torch.equal(target_before[name], p) and p.grad is None


@pytest.mark.parametrize("head", ["markov", "gated_markov", "rnn"])
def test_shortlist_logits_are_the_full_logits_columns(target, head):
    drafter = make_drafter(target, sequential_head=head)
    lm_head = target.get_output_embeddings()
    hidden, prev = (
        torch.randn(2, 3, drafter.config.block_size, drafter.config.hidden_size),
        torch.randint(0, 99, (2, 3, drafter.config.block_size)),
    )
    vocab_ids = torch.tensor([0, 5, 17, 42, 98])
    full = drafter.block_logits(hidden, prev, lm_head)
    short = drafter.block_logits(hidden, prev, lm_head, vocab_ids)
    torch.testing.assert_close(short, full[..., vocab_ids])


def test_training_on_a_shortlist(target):
    from dspark_hf.training.dataset import TokenDataset
    from dspark_hf.training.step import vocab_shortlist

    drafter = make_drafter(target)
    freeze(target)
    # supervised tokens: 7 three times, 3 twice, 11 once; the prompt token 50 is never supervised
    data = TokenDataset.from_sequences([[50, 7, 7, 3], [50, 50, 7, 3, 11]], loss_starts=[1, 2])
    assert vocab_shortlist(data, 0) is None
    assert vocab_shortlist(data, 2, always=[1]).tolist() == [1, 3, 7]
    assert vocab_shortlist(data, 10).tolist() == [3, 7, 11]

    ids = torch.randint(0, 99, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.bool)
    everything = torch.arange(target.config.vocab_size)
    full = training_loss(drafter, target, ids, mask, 6, torch.Generator().manual_seed(0))
    same = training_loss(drafter, target, ids, mask, 6, torch.Generator().manual_seed(0), vocab_ids=everything)
    for name in ("loss", "ce", "tv", "conf", "accuracy"):
        torch.testing.assert_close(getattr(same, name), getattr(full, name))
    # a shortlist of half the vocabulary: labels outside it give no CE and count as misses
    half = torch.arange(0, target.config.vocab_size, 2)
    short = training_loss(drafter, target, ids, mask, 6, torch.Generator().manual_seed(0), vocab_ids=half)
    assert torch.isfinite(short.loss)
    from dspark_hf.training.step import block_predictions

    p = block_predictions(drafter, target, ids, mask, 6, torch.Generator().manual_seed(0), half)
    labels = p.blocks.labels
    assert p.draft_logits.shape[-1] == len(half)
    torch.testing.assert_close(p.labels, torch.where(labels % 2 == 0, labels // 2, -1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: checks that blocks follow the batch")
def test_blocks_follow_the_batch_to_its_device():
    """Anchors come from a seeded CPU generator, so a step's blocks are the same on the CPU and the GPU."""
    ids, mask = torch.randint(0, 50, (2, 24)), torch.ones(2, 24, dtype=torch.bool)
    on_cpu = make_blocks(ids, mask, 4, 5, torch.Generator().manual_seed(0))
    on_gpu = make_blocks(ids.cuda(), mask.cuda(), 4, 5, torch.Generator().manual_seed(0))
    for name, value in vars(on_gpu).items():
        assert value.is_cuda, name
        assert torch.equal(value.cpu(), getattr(on_cpu, name)), name
