"""Low-precision targets: where a drafter's greedy output may leave plain greedy, and where it may not.

In bf16 a verify of W tokens rounds differently from plain decoding's one-token forward, so at a near-tie of the two
best logits the argmax can flip and the continuation differs from there on (token identity holds in fp32). The check
(`helpers.first_divergence`) asks, for every row that diverges, whether the plain run's logit for the drafter run's
token was within a few bf16 ulps of its best logit; a bug (here an off-by-one acceptance) diverges at a real gap
and is flagged by the same check. The tiny target's own kernels happen to round a verify exactly as a one-token
step, so the verify's logits are moved by one ulp at random, as a real target's batch-shape rounding moves them.
"""

import random

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.decoding import core
from dspark_hf.utils.devices import below_float16
from helpers import first_divergence, pin_drafter, tiny_qk


VOCAB, NEW = 211, 40


def round_verifies_differently(target):
    """Move every logit of a multi-token forward (a verify) one bf16 ulp up or down, at random."""
    generator = torch.Generator().manual_seed(0)

    def hook(module, args, logits):
        if logits.shape[1] == 1:  # a one-token step: plain decoding's shape
            return logits
        up = torch.rand(logits.shape, generator=generator) < 0.5
        return torch.where(up, logits.nextafter(torch.tensor(float("inf"), dtype=logits.dtype)),
                           logits.nextafter(torch.tensor(float("-inf"), dtype=logits.dtype)))  # fmt: skip

    target.lm_head.register_forward_hook(hook)


def bf16_pair():
    """A tiny bf16 target (vocabulary 211, as in the issue) whose verifies round differently, and a bf16 drafter
    pinned to the plain bf16 outputs, wrong at block slot 2, so every full round accepts two drafts and rejects the
    third."""
    target = make_target(vocab_size=VOCAB, seed=4).to(torch.bfloat16)
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(16)]
    plain = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, output_logits=True,
                             return_dict_in_generate=True) for p in prompts]  # fmt: skip
    references = [out.sequences[0].tolist() for out in plain]
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed").to(torch.bfloat16), references, diverge_at=2)
    round_verifies_differently(target)
    return target, drafter, prompts, plain


def divergences(target, drafter, prompts, plain) -> list[dict]:
    """`first_divergence` of each prompt's drafter run (alone) from its plain bf16 run."""
    found = []
    for prompt, out in zip(prompts, plain):
        spec = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, assistant_model=drafter)
        new = out.sequences[0, len(prompt) :].tolist()
        found.append(first_divergence(new, spec[0, len(prompt) :].tolist(), torch.stack(out.logits, 1)[0],
                                      torch.bfloat16))  # fmt: skip
    return found


@pytest.fixture(scope="module")
def pair():
    return bf16_pair()


def test_bf16_divergences_start_at_near_ties(pair):
    found = divergences(*pair)
    assert any(d["index"] is not None for d in found)  # rounding did flip some near-ties
    bad = [d for d in found if d["index"] is not None and not d["near_tie"]]
    assert not bad, f"divergences from plain bf16 greedy away from a near-tie (bugs, not rounding): {bad}"
    assert sum(pair[1].generation_stats.accepted_lengths) > 0  # drafts were accepted: verifies of 4 tokens


def test_negative_control_an_off_by_one_acceptance_is_flagged(pair, monkeypatch):
    """Accepting one draft more than matched (the wrong third draft) must show as a divergence at a real gap."""
    accept = core.accept_greedy

    def one_too_many(draft_ids, target_ids, lengths):
        accepted, _ = accept(draft_ids, target_ids, lengths)
        accepted = torch.minimum(accepted + 1, lengths)
        return accepted, target_ids.gather(1, accepted[:, None])[:, 0]

    monkeypatch.setattr(core, "accept_greedy", one_too_many)
    found = divergences(*pair)
    assert any(d["index"] is not None and not d["near_tie"] for d in found), found


def test_near_tie_check_reads_the_gap_in_ulps():
    logits = torch.tensor([[4.0, 4.0 - 2**-5, 1.0], [4.0, 3.0, 1.0]])  # bf16 ulp at 4.0 is 2^-5
    assert first_divergence([0, 0], [0, 0], logits, torch.bfloat16) == {"index": None}
    tie = first_divergence([0, 0], [1, 0], logits, torch.bfloat16)
    assert tie["index"] == 0 and tie["gap_ulps"] == 1 and tie["near_tie"]
    far = first_divergence([0, 0], [0, 1], logits, torch.bfloat16)
    assert far["index"] == 1 and far["gap_ulps"] == 32 and not far["near_tie"]
    assert first_divergence([0, 0], [0, 1], logits, tolerance=1.5)["near_tie"]  # a quantised target's own tolerance


def test_weights_below_float16_range_are_refused_in_float16_and_kept_in_bfloat16():
    """An exact QK-norm twin's q/k projections (~1e-8) vanish in float16: generate() says so instead of drafting
    noise; in bfloat16 they keep their precision and the output is plain greedy's, as always."""
    target = make_target()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=10)
    assert below_float16(make_drafter(target)) == []  # negative control: ordinary weights
    halved = tiny_qk(make_drafter(target)).to(torch.float16)
    with pytest.raises(ValueError, match=r"float16.*layers.0.self_attn.q_proj.weight.*bfloat16"):
        target.generate(ids, do_sample=False, max_new_tokens=10, assistant_model=halved)
    twin = tiny_qk(make_drafter(target)).to(torch.bfloat16)
    assert below_float16(twin)[:2] == ["layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight"]
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=10, assistant_model=twin), plain)
