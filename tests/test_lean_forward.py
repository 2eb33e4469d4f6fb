"""The round's target forward without transformers' wrappers (`kernels/lean_forward.py`): bit-identical to the model's
own forward in every kernel scope, for the families it takes; the model's own forward everywhere else."""

import contextlib
import gc
import weakref

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from conftest import make_drafter, make_target
from dspark_hf.decoding.ragged_cache import AppendCache
from dspark_hf.kernels import lean_forward, verify_linears
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.verify_linears import kernel_choice


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # biases on q/k/v
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),  # q/k norms
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}
WAYS = (None, "linear", "few rows", "packed")  # None: no kernel scope


def family_target(family, attn="sdpa", **overrides):
    config_cls, model_cls, fields = FAMILIES[family]
    return make_target(config_cls=config_cls, model_cls=model_cls, attn_implementation=attn, **{**fields, **overrides})


@contextlib.contextmanager
def scope(model, way, rows):
    if way is None:
        yield
        return
    old = OPTIONS.verify_way
    OPTIONS.verify_way = way
    try:
        with kernel_choice(model).verify(model, rows):
            yield
    finally:
        OPTIONS.verify_way = old


def round_inputs(batch=2, cached=9, width=4, vocab=99):
    """A prefill of `cached` tokens per row (row 0 left-padded by two) and a round of `width` tokens with a hole."""
    prompt = torch.randint(0, vocab, (batch, cached))
    prompt_mask = torch.ones(batch, cached, dtype=torch.long)
    prompt_mask[0, :2] = 0
    ids = torch.randint(0, vocab, (batch, width))
    mask = torch.cat([prompt_mask, torch.ones(batch, width, dtype=torch.long)], 1)
    mask[1, -1] = 0  # a padding slot of row 1 (it verifies one token fewer)
    positions = prompt_mask.sum(1, keepdim=True) + torch.arange(width)[None]
    return prompt, prompt_mask, ids, mask, positions


def both_forwards(model, way, hidden=(0, 2, -1), width=4, mask_4d=False):
    """(the model's own output, lean_forward's, their caches' keys) on the same prefilled cache state."""
    prompt, prompt_mask, ids, mask, positions = round_inputs(width=width)
    if mask_4d:  # a star tree's additive (B, 1, W, T + W) mask: every slot sees the cache, the anchor and itself
        batch, cached = mask.shape[0], mask.shape[1] - width
        own = torch.eye(width, dtype=torch.bool)
        own[:, 0] = True
        cache_seen = mask[:, None, None, :cached].bool().expand(-1, 1, width, -1)
        seen = torch.cat([cache_seen, own.expand(batch, 1, -1, -1)], -1)
        mask = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    outputs, keys = [], []
    for lean in (False, True):
        cache = AppendCache()
        with torch.no_grad():
            prompt_positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
            model(input_ids=prompt, attention_mask=prompt_mask, position_ids=prompt_positions, cache=cache)
            inputs = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, cache=cache)
            with scope(model, way, ids.numel()):
                assert lean_forward.supports(model)
                out = (
                    lean_forward.forward(model, **inputs, output_hidden_states=list(hidden))
                    if lean
                    else model(**inputs, output_hidden_states=list(hidden))
                )
        outputs.append(out)
        keys.append([layer.keys.clone() for layer in cache.layers])
    return outputs, keys


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("way", WAYS)
def test_bit_identical_to_the_models_forward(family, way):
    model = family_target(family)
    (own, lean), (own_keys, lean_keys) = both_forwards(model, way)
    assert torch.equal(own.logits, lean.logits)
    assert len(own.hidden_states) == len(lean.hidden_states) == model.config.num_hidden_layers + 1
    for a, b in zip(own.hidden_states, lean.hidden_states):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(own_keys, lean_keys))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bit_identical_in_bfloat16(family):
    model = family_target(family).to(torch.bfloat16)
    (own, lean), _ = both_forwards(model, "linear")
    assert own.logits.dtype == torch.bfloat16 and torch.equal(own.logits, lean.logits)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bit_identical_with_a_tree_mask_and_eager_attention(attn):
    model = family_target("llama", attn=attn)
    (own, lean), _ = both_forwards(model, "packed", hidden=(1, 3), mask_4d=True)
    assert torch.equal(own.logits, lean.logits)
    assert torch.equal(own.hidden_states[3], lean.hidden_states[3]) and lean.hidden_states[2] is None


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("mask_4d", [False, True])
def test_sdpa_runs_directly_with_grouped_heads(monkeypatch, width, mask_4d):
    """Under "sdpa" the lean forward calls SDPA itself with grouped heads broadcast (`enable_gqa`) and its own mask
    by slot, where transformers' function copies the keys per head group (`repeat_kv`) or folds the query: the same
    logits, and transformers' attention function is not called (the direct path was taken)."""
    from transformers.integrations import sdpa_attention

    model = family_target("llama")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads
    calls = []
    real = sdpa_attention.use_gqa_in_sdpa  # asked by transformers' SDPA function in every layer (grouped heads)
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", lambda *a: calls.append(1) or real(*a))
    (own, lean), _ = both_forwards(model, None, width=width, mask_4d=mask_4d)
    layers = model.config.num_hidden_layers
    assert len(calls) == 3 * layers  # the two prefills and the model's own round: none from the lean round
    assert torch.equal(own.logits, lean.logits)


def test_packed_siblings_run_as_one_product(monkeypatch):
    """Inside a packed scope the lean forward computes q/k/v and gate/up as one product each without calling those
    modules: only o, down and the LM head are module calls (the model's own forward calls all seven)."""
    model = family_target("llama")
    calls = []
    original = verify_linears.PackedVerifyLinear.forward
    monkeypatch.setattr(verify_linears.PackedVerifyLinear, "forward", lambda m, x: calls.append(m) or original(m, x))
    both_forwards(model, "packed")
    layers = model.config.num_hidden_layers
    assert len(calls) == (7 * layers + 1) + (2 * layers + 1)


def test_a_hook_on_a_sibling_linear_is_called_and_the_values_stay(monkeypatch):
    """A hook on q_proj (or any module a fused product would skip) makes the lean forward call the modules."""
    model = family_target("llama")
    seen = []
    model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda *a: seen.append(1))
    (own, lean), _ = both_forwards(model, "packed")
    assert seen == [1] * 4  # each side's prefill and its round, the lean one included
    assert torch.equal(own.logits, lean.logits)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_norms_run_inline_unless_one_is_hooked_or_swapped(family):
    """transformers' own RMSNorms (Qwen3's q/k norms too) run inline, not as module calls; a hook on one, or a norm
    of another class, makes the lean forward call every norm as a module, and the values stay the model's."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = family_target(family)
    calls = []
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.register_forward_pre_hook(lambda *a: calls.append(1))
    (own, lean), _ = both_forwards(model, "linear")
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    assert len(calls) == 4 * norms and torch.equal(own.logits, lean.logits)  # hooked: called by both sides
    fresh = family_target(family)
    calls.clear()
    fresh.model.layers[0].input_layernorm.register_forward_pre_hook(lambda *a: calls.append(1))
    (own, lean), _ = both_forwards(fresh, "linear")
    assert len(calls) == 4 and torch.equal(own.logits, lean.logits)  # one hooked norm: its calls on both sides
    plain = family_target(family)
    with torch.no_grad():
        assert lean_forward._norms_inline(lean_forward._plan(plain.eval()))
    if family == "qwen3":  # a norm of another class (Llama's, the same arithmetic) is called as a module
        norm = plain.model.layers[1].post_attention_layernorm
        other = LlamaRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon)
        other.load_state_dict(norm.state_dict())
        plain.model.layers[1].post_attention_layernorm = other
        with torch.no_grad():
            assert not lean_forward._norms_inline(lean_forward._plan(plain))
        (own, lean), _ = both_forwards(plain, "linear")
        assert torch.equal(own.logits, lean.logits)


def test_a_forward_breaks_if_the_lean_path_differs(monkeypatch):
    """Negative control: the identity test sees a changed step (the post-attention norm skipped in the MLP)."""
    model = family_target("llama")
    monkeypatch.setattr(lean_forward, "_mlp", lambda mlp, gate, up, down, x, fuse: mlp(x * 1.0001))
    (own, lean), _ = both_forwards(model, "packed")
    assert not torch.equal(own.logits, lean.logits)


def test_other_models_and_states_run_their_own_forward():
    gemma = make_target(config_cls=Gemma3TextConfig, model_cls=Gemma3ForCausalLM, attn_implementation="sdpa")
    mistral_window = family_target("mistral", sliding_window=6)
    qwen3_window = family_target("qwen3", use_sliding_window=True, sliding_window=6, max_window_layers=0)
    llama = family_target("llama")
    with torch.no_grad():
        assert not lean_forward.supports(gemma)
        assert not lean_forward.supports(mistral_window)
        assert not lean_forward.supports(qwen3_window)
        assert lean_forward.supports(llama)
        llama.train()
        assert not lean_forward.supports(llama)
        llama.eval()
    assert not lean_forward.supports(llama)  # gradients on
    OPTIONS.lean_forward = False
    try:
        with torch.no_grad():
            assert not lean_forward.supports(llama)
    finally:
        OPTIONS.lean_forward = True


def test_hooks_other_than_transformers_capture_send_it_to_the_models_forward():
    model = family_target("llama")
    ids = torch.randint(0, 99, (1, 5))
    with torch.no_grad():
        model(input_ids=ids, output_hidden_states=True)  # installs transformers' own capturing hooks
        assert any(layer._forward_hooks for layer in model.model.layers)
        assert lean_forward.supports(model)
        seen = []
        handle = model.model.layers[1].register_forward_hook(lambda *a: seen.append(1))
        assert not lean_forward.supports(model)
        positions = torch.arange(5)[None]
        lean_forward.run_target(model, input_ids=ids, attention_mask=None, position_ids=positions, cache=None)
        assert seen == [1]  # the model's own forward ran, with the user's hook
        handle.remove()
        assert lean_forward.supports(model)  # an input it does not take goes to the model's own forward
        out = lean_forward.run_target(
            model, input_ids=ids, position_ids=positions, cache=AppendCache(), logits_to_keep=1
        )
        assert out.logits.shape[1] == 1
        model.model.layers[2].self_attn.forward = model.model.layers[2].self_attn.forward  # as accelerate does
        assert not lean_forward.supports(model)
        del model.model.layers[2].self_attn.forward
        assert lean_forward.supports(model)


def test_lossless_generation_through_the_lean_forward(monkeypatch):
    """Greedy decoding with a drafter equals plain greedy with the lean forward in every round (it ran)."""
    target = make_target(attn_implementation="sdpa")
    drafter = make_drafter(target)
    ran = []
    original = lean_forward.forward
    monkeypatch.setattr(lean_forward, "forward", lambda *a, **k: ran.append(1) or original(*a, **k))
    ids = torch.randint(0, 99, (2, 7))
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    fast = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert torch.equal(plain, fast)
    assert ran


class Wrap(torch.nn.Module):
    """A debugging wrapper or adapter around a module: counts its calls and mixes the output (the first element of a
    tuple) with itself reversed, so that a lean forward that skipped it would give other tokens."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        out = self.inner(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        first = first + 0.5 * first.flip(-1)
        return (first, *out[1:]) if isinstance(out, tuple) else first


class Transparent(Wrap):
    """A wrapper that hands on every attribute it lacks to its module (as some adapters do): the attributes a lean
    forward reads are all there, the wrapper's own forward is not."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


PARTS = {  # where a wrapper goes: (the module holding it, its attribute name)
    "mlp": lambda m: (m.model.layers[1], "mlp"),
    "layer": lambda m: (m.model.layers, "1"),
    "self_attn": lambda m: (m.model.layers[1], "self_attn"),
    "input_layernorm": lambda m: (m.model.layers[1], "input_layernorm"),
    "v_proj": lambda m: (m.model.layers[1].self_attn, "v_proj"),
    "gate_proj": lambda m: (m.model.layers[1].mlp, "gate_proj"),
    "norm": lambda m: (m.model, "norm"),
    "embed_tokens": lambda m: (m.model, "embed_tokens"),
    "lm_head": lambda m: (m, "lm_head"),
}


@pytest.mark.parametrize("wrapper", [Wrap, Transparent])
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("way", ["packed", "linear"])
def test_a_module_wrapped_after_a_first_generate(monkeypatch, wrapper, part, way):
    """A module wrapped after the lean forward ran (its structure check done): the next `generate()` with a drafter
    is plain greedy of the wrapped model, with the wrapper called. Wrapped layers, attentions and MLPs send the round
    to the model's own forward; modules the lean forward calls as modules (norms, linears, the embedding, the LM
    head) stay on the lean path."""
    monkeypatch.setattr(OPTIONS, "verify_way", way)
    target = make_target(attn_implementation="sdpa")
    drafter = make_drafter(target, verify_policy="fixed")
    ran = []
    original = lean_forward.forward
    monkeypatch.setattr(lean_forward, "forward", lambda *a, **k: ran.append(1) or original(*a, **k))
    ids = torch.randint(0, 99, (2, 7))
    unwrapped = target.generate(ids, do_sample=False, max_new_tokens=20)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter), unwrapped)
    assert ran
    holder, name = PARTS[part](target)
    wrapped = wrapper(getattr(holder, name))
    setattr(holder, name, wrapped)
    plain = target.generate(ids, do_sample=False, max_new_tokens=20)
    assert not torch.equal(plain, unwrapped)  # the wrapper changes the tokens: skipping it would show
    wrapped.calls = 0
    out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter)
    assert torch.equal(out, plain) and wrapped.calls
    if part in ("mlp", "layer", "self_attn"):
        with torch.no_grad():
            assert not lean_forward.supports(target)
        setattr(holder, name, wrapped.inner)  # unwrapped again: the lean forward comes back
        with torch.no_grad():
            assert lean_forward.supports(target)


def test_a_layer_swapped_for_another_of_its_class_is_rechecked():
    """A decoder layer replaced by a new one of the same class (a reloaded or edited copy) with a sliding window the
    lean forward does not take is seen as well."""
    target = family_target("qwen3")
    with torch.no_grad():
        assert lean_forward.supports(target)
        layer = type(target.model.layers[2])(target.config, 2)
        layer.self_attn.sliding_window = 6
        target.model.layers[2] = layer
        assert not lean_forward.supports(target)


def test_the_check_keeps_no_model_alive():
    """The kept signature refers to no module: a model one of whose modules refers back to it is still freed."""
    target = family_target("llama")
    target.model.norm.owner = [target]  # e.g. a debugging wrapper or adapter that keeps its model at hand
    with torch.no_grad():
        assert lean_forward.supports(target)
    gone = weakref.ref(target)
    del target
    gc.collect()
    assert gone() is None
