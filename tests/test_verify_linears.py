"""The target's linears in verify passes, chosen per machine (`verify_linears`): packed copies beside the target,
the choice by measurement (clock injected), the same values and lossless decoding."""

import pytest
import torch
from torch import nn

from conftest import make_drafter, make_target
from dspark_hf.kernels import verify_linears
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.verify_attention import ATTN_IMPLEMENTATION
from dspark_hf.kernels.verify_linears import (
    KernelTable,
    PackedVerifyLinear,
    VerifyKernels,
    free_packs,
    kernel_choice,
    measure,
    packable,
    packs_for,
)


needs_packing = pytest.mark.skipif(not packable(make_target()), reason="oneDNN's packed operators unavailable")


def test_choice_keeps_the_fastest_way_and_pads_packed_rows_to_a_cheaper_count():
    ms = {
        "linear": {1: 10.0, 2: 30.0, 4: 30.0, 8: 35.0},
        "few rows": {2: 12.0, 4: 20.0, 8: 40.0},
        "packed": {1: 11.0, 2: 16.0, 4: 9.0, 8: 25.0},
    }
    table = KernelTable.choose(ms)
    assert table.choice == {1: ("packed", 4), 2: ("packed", 4), 4: ("packed", 4), 8: ("packed", 8)}
    ms["packed"] = {1: 11.0, 2: 16.0, 4: 15.0, 8: 25.0}
    table = KernelTable.choose(ms)
    assert table.choice == {1: ("linear", 1), 2: ("few rows", 2), 4: ("packed", 4), 8: ("packed", 8)}
    assert table.way(3) == ("packed", 3)  # unmeasured: the next measured count's way, unpadded
    assert table.way(9) == ("linear", 9)  # beyond the widest measured: transformers' own
    again = KernelTable.from_json(table.to_json())
    assert again.choice == table.choice and again.ms == ms
    with pytest.raises(ValueError, match="padded"):
        KernelTable.from_json({"choice": {"4": ["packed", 2]}})
    with pytest.raises(ValueError, match="one of"):
        KernelTable.from_json({"choice": {"4": ["magic", 4]}})


def test_measure_times_each_way_per_row_count_with_the_injected_clock(monkeypatch):
    """A fake clock that each pass advances by a cost of (way, rows): the table follows those costs exactly."""
    now = [0.0]
    cost = {"linear": lambda n: 1.0 + n, "few rows": lambda n: 0.5 + 2 * n, "packed": lambda n: 4.0 - min(n, 3)}
    seen = []

    def fake_pass(way, inputs, linears, head, packs):
        rows = next(iter(inputs.values())).shape[0]
        seen.append((way, rows))
        now[0] += cost[way](rows)

    monkeypatch.setattr(verify_linears, "_one_pass", fake_pass)
    target = make_target()
    table = measure(target, rows=(1, 2, 3, 6, 12), repeats=2, clock=lambda: now[0])
    ways = {(w, n) for w, n in seen}
    assert {n for w, n in ways if w == "few rows"} == {1, 2, 3, 6}  # only where its products act (<= 8 rows)
    assert all(seen.count(case) == 3 for case in ways)  # one untimed pass, then `repeats`
    assert table.ms["linear"] == {1: 2000.0, 2: 3000.0, 3: 4000.0, 6: 7000.0, 12: 13000.0}
    if packable(target):
        assert table.choice == {
            1: ("packed", 3),
            2: ("packed", 3),
            3: ("packed", 3),
            6: ("packed", 6),
            12: ("packed", 12),
        }
    else:
        assert table.choice == {
            1: ("linear", 1),
            2: ("few rows", 2),
            3: ("linear", 3),
            6: ("linear", 6),
            12: ("linear", 12),
        }


@needs_packing
def test_packed_scope_gives_the_same_logits_and_leaves_the_target_as_found():
    target = make_target(attn_implementation="sdpa")
    ids = torch.randint(0, 99, (2, 6))
    with torch.no_grad():
        expected = target(ids).logits
        packs = packs_for(target)
        linears = [m for m in target.modules() if type(m) is nn.Linear]
        sizes = sorted(len(g.members) for g in packs.groups)
        assert sizes == [1] * (1 + 2 * 4) + [2] * 4 + [3] * 4  # q/k/v and gate/up fused per layer; o, down, head
        for pad in (0, 16):
            with packs.scope(target, pad):
                assert all(type(m) is PackedVerifyLinear for m in linears)
                assert target.config._attn_implementation == ATTN_IMPLEMENTATION
                got = target(ids).logits
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert all(type(m) is nn.Linear for m in linears) and target.config._attn_implementation == "sdpa"
    assert packs.nbytes == sum(m.weight.numel() * 4 for m in linears)  # the stated memory cost: one more copy
    assert not any(isinstance(v, torch.Tensor) and v.is_mkldnn for v in vars(target).values())
    assert free_packs(target) == packs.nbytes and packs_for(target) is not packs


@needs_packing
def test_packed_copies_follow_weight_updates():
    target = make_target()
    ids = torch.randint(0, 99, (1, 4))
    packs = packs_for(target)
    with torch.no_grad():
        with packs.scope(target):
            target(ids)
        target.lm_head.weight.mul_(2.0)  # an in-place update (an optimizer step, a user's edit)
        expected = target(ids).logits
        with packs.scope(target):
            got = target(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_packing
@pytest.mark.parametrize("batch", [1, 3])
def test_generate_with_packed_verifies_is_identical_to_plain_greedy(monkeypatch, batch):
    monkeypatch.setattr(OPTIONS, "verify_way", "packed")
    target = make_target(attn_implementation="sdpa")
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (batch, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=30)
    out = target.generate(ids, do_sample=False, max_new_tokens=30, assistant_model=drafter)
    assert torch.equal(out, plain)
    assert all(type(m) is nn.Linear for m in target.modules() if isinstance(m, nn.Linear))
    assert packs_for(target).nbytes > 0  # the copies stay beside the target for the next call


def test_a_measured_choice_is_kept_per_target_and_used_by_decode_loops(monkeypatch):
    target = make_target()
    choice = kernel_choice(target)
    assert kernel_choice(target) is choice and kernel_choice(make_target()) is not choice
    choice.table = KernelTable({r: ("linear", r) for r in range(1, 40)})
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (1, 5))
    plain = target.generate(ids, do_sample=False, max_new_tokens=12)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although the target has a table")

    monkeypatch.setattr(verify_linears, "measure", no_measuring)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=12, assistant_model=drafter), plain)


def verifies(choice, cost, count, rows=4, way="packed"):
    """`count` verifies of `rows` rows whose table says `way`, each costing `cost[the way picked]`: the ways picked."""
    picked = []
    for _ in range(count):
        picked.append(choice.pick(rows, way))
        choice.record(rows, picked[-1], cost[picked[-1]])
    return picked


def test_the_choice_follows_measured_verify_times_and_retries_the_other_way():
    """The table says packed; verifies measured slower packed than with `F.linear` (a loaded machine) switch to
    `F.linear`, retries try packed again, and packed returns once it measures faster."""
    choice = VerifyKernels(KernelTable({4: ("packed", 4)}), retry=4, weight=0.5, max_retry=4)  # no backing off
    cost = {"packed": 0.09, "linear": 0.05}
    ways = verifies(choice, cost, 12)
    # packed (its warm-up), F.linear (an early retry), packed (measured), packed (the early retry of the other way)
    assert ways[:4] == ["packed", "linear", "packed", "packed"]
    assert ways[4:7] == ["linear"] * 3 and ways[7] == "packed" and ways[8:11] == ["linear"] * 3
    cost["packed"] = 0.01  # the load is gone
    ways += verifies(choice, cost, 12)
    assert ways[-4:] == ["packed"] * 3 + ["linear"]  # packed again, F.linear only on its retries
    assert choice.pick(2, "linear") == "linear"  # nothing else to try where the table says F.linear


def test_whole_verifies_decide_among_every_way_that_applies():
    """The table (the linears alone) says packed; whole verifies measure the few-row products fastest. Each other way
    is tried early until measured (a packed or few-row way's first verify is a warm-up), then the fastest runs, and
    the retries take the others in turn."""
    choice = VerifyKernels(KernelTable({2: ("packed", 4)}), retry=8, max_retry=8)  # no backing off
    cost = {"packed": 0.04, "few rows": 0.03, "linear": 0.06}
    ways, trials = [], []
    for _ in range(24):
        way = choice.pick(2, "packed", ["few rows", "packed"])
        ways.append(way)
        trials.append(choice.trial)
        choice.record(2, way, cost[way])
    assert trials == [way != "few rows" or i < 4 for i, way in enumerate(ways)]  # what the round times leave out
    # packed (warm-up), few rows (warm-up), packed, few rows (now measured), the best, linear (measured), the best
    assert ways[:7] == ["packed", "few rows", "packed", "few rows", "few rows", "linear", "few rows"]
    retries = [i for i, way in enumerate(ways) if i > 6 and way != "few rows"]
    assert retries == [7, 15, 23] and {ways[7], ways[15]} == {"packed", "linear"}  # every 8th, the others in turn
    table = KernelTable({1: ("few rows", 1)}, {"packed": {2: 30.0, 4: 20.0, 8: 25.0}})
    assert table.pad("packed", 1) == 4 and table.pad("packed", 5) == 8 and table.pad("few rows", 3) == 3


def test_retries_back_off_while_the_other_ways_stay_slower_and_return_when_one_catches_up():
    """A retry costs the slower way's time: while retries find it at least `margin` times the best, the interval at
    that row count doubles up to `max_retry`; a retry that finds it within the margin sets it back to `retry`."""
    choice = VerifyKernels(KernelTable({4: ("packed", 4)}), retry=4, weight=1.0, max_retry=16)
    cost = {"packed": 0.02, "linear": 0.05}
    ways = verifies(choice, cost, 60)
    retries = [i for i, way in enumerate(ways) if way == "linear"]
    assert retries == [1, 3, 11, 27, 43, 59]  # early (unmeasured, then its early retry), then 8, 16, 16, 16 apart
    cost["linear"] = 0.021  # within the margin now (another process took the cores oneDNN's calls wait on)
    ways += verifies(choice, cost, 40)
    retries = [i for i, way in enumerate(ways) if way == "linear" and i >= 60]
    assert retries == [75, 79, 83, 87, 91, 95, 99]  # the retry at 75 found it close: every 4th again


@pytest.mark.parametrize("force", [None, "packed"])
def test_two_threads_decoding_on_one_target_each_get_plain_greedy(monkeypatch, force):
    """Two threads, each with its own drafter, speculating on one target at once: the kernel scopes they enter on the
    shared target's linears (the measured way, or packed every time) must not mix one thread's products into the
    other's, so each output is the target's own greedy one."""
    import threading

    monkeypatch.setattr(OPTIONS, "verify_way", force)
    target = make_target(vocab_size=99, num_layers=4).eval()
    drafters = [make_drafter(target, seed=s) for s in (1, 2)]
    prompts = [torch.randint(0, 99, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]

    def generate(i, **kwargs):
        mask = torch.ones_like(prompts[i])
        return target.generate(prompts[i], attention_mask=mask, max_new_tokens=24, do_sample=False, **kwargs).tolist()

    plain = [generate(i) for i in range(2)]
    outputs, errors = [[], []], []

    def decode(i):
        try:
            for _ in range(3):
                outputs[i].append(generate(i, assistant_model=drafters[i]))
        except Exception as e:  # reported below: an exception in a thread would otherwise pass unseen
            errors.append(repr(e))

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert outputs == [[plain[0]] * 3, [plain[1]] * 3]


def test_a_threads_packed_scope_is_its_own():
    """Inside one thread's packed scope its linears compute through the packs; another thread at the same moment, on
    the same (re-classed) modules, finds no scope of its own and computes as `nn.Linear` does. Neither reads the
    other's scope (no process-wide registry of scopes)."""
    import threading

    target = make_target(vocab_size=99, num_layers=2).eval()
    linear = target.model.layers[0].self_attn.q_proj
    x = torch.randn(1, 3, linear.in_features)
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def in_scope():
        with torch.no_grad(), verify_linears.packs_for(target).scope(target):
            seen["type"] = type(linear)
            seen["inside"] = verify_linears._active(linear, x) is not None
            entered.set()
            checked.wait(timeout=30)

    def outside():
        entered.wait(timeout=30)
        with torch.no_grad():
            seen["other"] = verify_linears._active(linear, x)
            seen["other_out"] = linear(x)  # a re-classed module, called from a thread without a scope
        checked.set()

    threads = [threading.Thread(target=in_scope), threading.Thread(target=outside)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["type"] is verify_linears.PackedVerifyLinear and seen["inside"]
    assert seen["other"] is None
    assert torch.equal(seen["other_out"], nn.functional.linear(x, linear.weight, linear.bias))
    assert type(linear) is nn.Linear  # the scope undone on exit
