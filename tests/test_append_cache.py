"""The target's cache writes new slots in place (`AppendCache`) and the prefill keeps only the tapped hidden states:
the same keys, values, logits and outputs as `DynamicCache` and every layer's states, without the per-forward copy."""

import pytest
import torch
from transformers import DynamicCache

from conftest import make_drafter, make_target
from dspark_hf.decoding.core import SpeculativeDecoder
from dspark_hf.decoding.ragged_cache import AppendCache, AppendLayer, RaggedCache
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.utils.compat import selects_hidden_states


def layer_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k, v) for k, v, *_ in cache]


def assert_same_cache(a, b) -> None:
    assert len(layer_tensors(a)) == len(layer_tensors(b))
    for (ka, va), (kb, vb) in zip(layer_tensors(a), layer_tensors(b)):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_append_layer_holds_what_dynamic_layer_holds_through_updates_crops_and_selects():
    generator = torch.Generator().manual_seed(0)
    ours, theirs = AppendCache(), DynamicCache()
    widths = [300, 1, 3, -2, 2, -3, 1, 4, "select", 1, -1, 2, "select", 5]
    batch = 3
    for step in widths:
        if step == "select":
            index = torch.tensor([batch - 1, 0]) if batch > 1 else torch.tensor([0])
            ours.batch_select_indices(index)
            theirs.batch_select_indices(index)
            batch = len(index)
        elif step < 0:
            ours.crop(step)
            theirs.crop(step)
        else:
            for layer in range(2):
                key = torch.randn(batch, 2, step, 4, generator=generator)
                value = torch.randn(batch, 2, step, 4, generator=generator)
                got = ours.update(key, value, layer)
                want = theirs.update(key.clone(), value.clone(), layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert_same_cache(ours, theirs)
        assert ours.get_seq_length() == theirs.get_seq_length()
    assert all(isinstance(layer, AppendLayer) for layer in ours.layers)


def test_updates_write_in_place_until_the_buffer_is_full():
    cache = AppendCache()
    cache.update(torch.randn(1, 2, 100, 4), torch.randn(1, 2, 100, 4), 0)
    layer = cache.layers[0]
    buffer, capacity = layer.key_buffer, layer.key_buffer.shape[2]
    assert capacity > 100
    for _ in range(capacity - 100 - 2):  # one slot per forward, a rejected draft cropped now and then
        cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), 0)
        cache.crop(-1)
    assert layer.key_buffer is buffer and layer.keys.data_ptr() == buffer.data_ptr()
    assert layer.keys.shape[2] == capacity - 2
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0)  # no room: a new, larger buffer
    assert layer.key_buffer is not buffer and layer.key_buffer.shape[2] > capacity
    assert layer.keys.shape[2] == capacity + 1


def test_keep_last_drops_the_oldest_slots_without_moving_the_rest():
    cache = RaggedCache("cpu", batch_size=2)
    keys = torch.arange(2 * 10, dtype=torch.float32).reshape(2, 1, 10, 1)
    cache.cache.update(keys, -keys, 0)
    cache.commit(torch.ones(2, 10, dtype=torch.bool))
    buffer = cache.cache.layers[0].key_buffer
    cache.keep_last(torch.tensor([4, 6]))
    assert cache.num_slots == 6 and cache.valid.sum(1).tolist() == [4, 6]
    assert torch.equal(cache.cache.layers[0].keys, keys[:, :, 4:])
    cache.cache.update(torch.full((2, 1, 1, 1), 99.0), torch.full((2, 1, 1, 1), -99.0), 0)
    assert cache.cache.layers[0].key_buffer is buffer  # the freed front is not reused, the room behind is
    assert cache.cache.layers[0].keys[:, 0, -1, 0].tolist() == [99.0, 99.0]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_target_computes_bit_identical_logits_over_either_cache(attn):
    target = make_target(attn_implementation=attn)
    ids = torch.randint(0, 99, (2, 40))
    logits = {}
    for name, cache in (("dynamic", DynamicCache()), ("append", AppendCache())):
        steps = [target(input_ids=ids, cache=cache, use_cache=True).logits]
        length = ids.shape[1]
        for width, rejected in ((1, 0), (3, 2), (2, 1), (4, 0)):
            new = ids[:, :width] + 1
            mask = torch.ones(2, length + width, dtype=torch.long)
            mask[1, 3] = 0  # a hole in one row, as a ragged batch has
            positions = torch.arange(length, length + width)[None].expand(2, -1)
            steps.append(target(input_ids=new, attention_mask=mask, position_ids=positions, cache=cache).logits)
            cache.crop(-rejected) if rejected else None
            length += width - rejected
        logits[name] = steps
    for a, b in zip(logits["dynamic"], logits["append"]):
        assert torch.equal(a, b)


def test_joining_an_empty_cache_takes_the_prefill_as_it_is():
    prefill = RaggedCache("cpu", batch_size=2)
    prefill.cache.update(torch.randn(2, 1, 5, 2), torch.randn(2, 1, 5, 2), 0)
    prefill.commit(torch.ones(2, 5, dtype=torch.bool))
    batch = RaggedCache("cpu")
    batch.extend(prefill)
    assert batch.cache is prefill.cache and batch.batch_size == 2 and batch.num_slots == 5


def test_the_prefill_and_verify_keep_only_the_tapped_hidden_states(monkeypatch):
    target = make_target(num_layers=5)
    drafter = make_drafter(target, target_layer_ids=[1, 3])
    assert selects_hidden_states(target)
    decoder = SpeculativeDecoder(target, drafter)
    assert decoder._hidden_states_wanted(False) == [2, 4] and decoder._hidden_states_wanted(True) is True
    ids = torch.randint(0, 99, (1, 12))
    seen = []

    def spy(module, args, output):
        seen.append([state is not None for state in output.hidden_states or ()])

    handle = target.register_forward_hook(spy)
    out = {}
    try:
        for select in (True, False):
            monkeypatch.setattr(OPTIONS, "select_hidden_states", select)
            out[select] = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    finally:
        handle.remove()
    assert torch.equal(out[True], out[False])
    kept = [flags for flags in seen if not all(flags)]
    assert kept and all(flags == [False, False, True, False, True, False] for flags in kept)


def test_the_cache_path_as_it_was_gives_the_same_tokens(monkeypatch, target, drafter):
    ids = torch.randint(0, 99, (2, 9))
    out = {}
    for in_place in (True, False):
        monkeypatch.setattr(OPTIONS, "in_place_cache", in_place)
        out[in_place] = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter)
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(out[True], plain) and torch.equal(out[False], plain)
