"""The target's forward in a decode round, without transformers' per-layer plumbing, for Llama-shaped decoders.

A round's forward over 1–8 tokens of SmolLM2-135M spends ~21 ms in its linears and ~15 ms elsewhere on a 2-core AMD
EPYC, much of it Python between the products. About 2 ms of that (5 %) is transformers' per-layer wrappers: the
decorators that map deprecated arguments, the gradient-checkpointing layer, the output-capturing hooks, keyword
plumbing and the attention interface's lookup, in every layer. `forward` runs the same computation with the same
modules, in the same order, as the model's own `forward` does: embedding, `create_causal_mask`, the rotary
embedding, then per layer the input norm, q/k/v projections (and Qwen3's q/k norms), `apply_rotary_pos_emb`, the
cache update, the attention function the config names, the output projection, the residual, the post-attention norm,
the MLP and the residual, and last the final norm and the LM head. Only the wrappers around them are skipped, so the
logits are bit-identical to the model's own forward in the same kernel scope (tests/test_lean_forward.py). Where they
are transformers' own, the RMSNorms and the rotary embedding run inline, the same operators on the same values (a
norm that is hooked, swapped or of another class is called as a module). The
linears go through their modules (the verify kernels, quantized linears and their hooks act as before), except that
inside a packed scope q/k/v and gate/up without hooks run as their group's one product
(`verify_linears.fused_product`), which is what their modules would compute.

It applies (`supports`) to the exact decoder-layer classes of `LAYERS` (Llama, Qwen2, Qwen3, Mistral) with no sliding
window in use, in inference (no grad, eval mode), with no hooks on the modules it skips but transformers' own output
capturing (checked again when a module it reaches is swapped or wrapped, e.g. an adapter or a debugging wrapper put on
an MLP after a first `generate()`), and to the inputs a round passes (`input_ids`, a 2-D or 4-D mask, `position_ids`, a
cache, the hidden states wanted). Everything else runs the model's own forward: `run_target(model, **inputs)` picks.
`OPTIONS.lean_forward = False` turns it off (side-by-side timings, or a model whose modeling code changed under
the same class names).

The hidden states come back as transformers returns them: index 0 the embeddings, i the output of layer i, the last
the final norm's output; a list of indices keeps those and leaves None elsewhere, as a model that records its
outputs does (`compat.selects_hidden_states`).
"""

import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..utils.compat import only_capturing_hooks
from .options import OPTIONS
from .runtime import runtime_for
from .verify_linears import fused_product


# decoder-layer class name -> the attention's extra keyword (None: Llama passes none); checked by exact class, from
# the modeling module of the model's own package
LAYERS = {
    "LlamaDecoderLayer": None,
    "Qwen2DecoderLayer": "sliding_window",
    "Qwen3DecoderLayer": "sliding_window",
    "MistralDecoderLayer": "sliding_window",
}


class _Plan:
    """What `forward` needs to know of a model between two changes of its `_signature`: whether the structure fits
    (`_structure`) and the modules whose hooks decide, per call, which shortcuts apply. Made once per signature, so a
    round's checks are a pass over these lists, not a walk of the model. It refers to the modules weakly: kept beside
    the model, it must not keep the model alive through a module that refers back to it."""

    def __init__(self, model: nn.Module, signature: tuple | None, skipped: list[nn.Module]):
        self.signature = signature
        self.supported = signature is not None and _structure(model)
        self._skipped = _refs(skipped)  # modules whose own forward is not called (model, base, layers, attentions)
        if not self.supported:
            return
        base, layers = model.model, model.model.layers
        fused, norms = _fused_modules(layers), _norms(base, layers)
        self._fused = _refs(fused)  # the projections and MLPs, run as `F.linear` or fused products
        self._norms = _refs(norms)
        self._rest = _refs(list({id(m): m for m in fused + norms}.values()))
        self.norm_class = _norm_class(layers, sys.modules[type(base).__module__])  # None: not transformers' own
        # per layer, the modules the forward reaches, in `_PARTS` order (read once here, not through `__getattr__`)
        self._parts = [_refs([_part(layer, name) for name in _PARTS]) for layer in layers]

    def parts(self) -> list[list[nn.Module]]:
        """Per layer, its modules in `_PARTS` order."""
        return [_live(refs) for refs in self._parts]

    skipped = property(lambda self: _live(self._skipped))
    fused = property(lambda self: _live(self._fused))
    norms = property(lambda self: _live(self._norms))
    rest = property(lambda self: _live(self._rest))  # fused and norms, each once


# a decoder layer's modules as the forward uses them, by attribute path
_PARTS = (
    "input_layernorm", "self_attn", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "post_attention_layernorm", "mlp", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


def _part(layer: nn.Module, path: str) -> nn.Module:
    for name in path.split("."):
        layer = getattr(layer, name)
    return layer


def _refs(modules: list[nn.Module]) -> list[weakref.ref]:
    return [weakref.ref(m) for m in modules]


def _live(refs: list[weakref.ref]) -> list[nn.Module]:
    """The modules (a module gone since cannot be among them: the signature that made the plan changed with it)."""
    return [m for m in (r() for r in refs) if m is not None]


def _structure(model: nn.Module) -> bool:
    """Whether `model` is a `*ForCausalLM` over a base model of `LAYERS` decoder layers, built as transformers builds
    them (the exact classes of the layers, their attentions and MLPs, attribute names, no sliding window in use, no
    pretraining tensor parallelism)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not layers or not all(hasattr(base, n) for n in ("embed_tokens", "norm", "rotary_emb")):
        return False
    module = sys.modules.get(type(base).__module__)
    causal_lm = f"{type(base).__name__.removesuffix('Model')}ForCausalLM"
    if getattr(model, "lm_head", None) is None or getattr(module, causal_lm, None) is not type(model):
        return False
    for layer in layers:
        name = type(layer).__name__
        if name not in LAYERS or getattr(module, name, None) is not type(layer):
            return False
        attn = layer.self_attn
        if type(attn) is not getattr(module, name.replace("DecoderLayer", "Attention"), None):
            return False  # a wrapped attention (one that hands on its module's attributes too) runs its own forward
        if LAYERS[name] and getattr(attn, "sliding_window", None) is not None:
            return False
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx", "scaling")):
            return False
        mlp_class = getattr(module, name.replace("DecoderLayer", "MLP"), None)
        if type(layer.mlp) is not mlp_class:
            return False
    config = model.config
    if getattr(config, "pretraining_tp", 1) != 1:
        return False
    if type(layers[0]).__name__ == "MistralDecoderLayer" and getattr(config, "sliding_window", None) is not None:
        return False  # Mistral's attention takes the window from the config, and its mask is a sliding one
    return all(hasattr(module, n) for n in ("apply_rotary_pos_emb", "eager_attention_forward"))


def supports(model: nn.Module) -> bool:
    """Whether `forward` can stand in for `model(...)` now (see the module docstring). The model's structure is
    checked again whenever a module it reaches was swapped, wrapped or re-classed since the last check (`_signature`,
    read every call); the hooks, mode and gradients are checked every call."""
    return _plan(model) is not None


def _plan(model: nn.Module) -> "_Plan | None":
    """The model's `_Plan` where `forward` can stand in for it now, else None."""
    if not OPTIONS.lean_forward or torch.is_grad_enabled() or model.training:
        return None
    signature, skipped = _signature(model)
    runtime = runtime_for(model)  # the plan is kept there, made again when the signature changes
    plan = runtime.plan
    if plan is None or plan.signature != signature:
        plan = runtime.plan = _Plan(model, signature, skipped)
    return plan if plan.supported and only_capturing_hooks(plan.skipped) else None


def _signature(model: nn.Module) -> tuple[tuple | None, list[nn.Module]]:
    """(what `_structure`'s verdict depends on, the modules whose own forward `forward` skips).

    The signature holds the identity (`id`) of every module `forward` reaches: the model's, its base model's, each
    decoder layer's, attention's and MLP's children (embedding, rotary embedding, norms, projections, activation, LM
    head); the class of each module whose forward it re-implements (model, base model, layers, attentions, MLPs); each
    attention's `sliding_window` and the config fields `_structure` reads. A module swapped, wrapped or given another
    class anywhere among them changes it. Read from the `_modules` dictionaries, not through `nn.Module.__getattr__`,
    so it costs little per round (docs/reliability.md). Ids, not the modules: kept beside the model, the modules
    would keep alive a replaced one, or the model itself if a child refers to it. An id the allocator reuses for a
    new module can only stand for a module of the class recorded at its place, which is what the verdict reads.
    None: not a model of the expected shape."""
    base = model._modules.get("model")
    layers = None if base is None else base._modules.get("layers")
    config = getattr(model, "config", None)
    if layers is None or config is None:
        return None, []
    parts = [
        type(model),
        type(base),
        *map(id, model._modules.values()),
        *map(id, base._modules.values()),
        getattr(config, "num_hidden_layers", None),
        getattr(config, "pretraining_tp", 1),
        getattr(config, "sliding_window", None),
    ]
    skipped = [model, base]
    attentions = []
    for layer in layers._modules.values():
        children = layer._modules
        attn, mlp = children.get("self_attn"), children.get("mlp")
        parts += [type(layer), type(attn), type(mlp), *map(id, children.values())]
        skipped.append(layer)
        if attn is not None:
            parts += [*map(id, attn._modules.values()), vars(attn).get("sliding_window")]
            attentions.append(attn)
        if mlp is not None:
            parts += map(id, mlp._modules.values())
    return tuple(parts), skipped + attentions


INPUTS = {"input_ids", "attention_mask", "position_ids", "output_hidden_states", "use_cache"}  # and the cache


def run_target(model: nn.Module, **inputs):
    """`forward(model, **inputs)` where `supports(model)` and the inputs are a round's (token ids, position ids and a
    cache to update, optionally a mask and the hidden states wanted), else `model(**inputs)`."""
    cache = [name for name in ("cache", "past_key_values") if inputs.get(name) is not None]
    if (
        len(cache) == 1
        and set(inputs) <= INPUTS | set(cache)
        and inputs.get("input_ids") is not None
        and inputs.get("position_ids") is not None
        and inputs.get("use_cache", True)
    ):
        plan = _plan(model)
        if plan is not None:
            return forward(model, **inputs, plan=plan)
    return model(**inputs)


def forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    output_hidden_states: bool | list[int] = False,
    use_cache: bool = True,
    plan: _Plan | None = None,
    **cache: object,
) -> CausalLMOutputWithPast:
    """The model's forward over `input_ids` (B, W) at `position_ids` (B, W), updating the cache given as the one
    keyword left (`cache=` or `past_key_values=`). Returns logits (B, W, V) and the hidden states asked for. `plan`:
    `_plan(model)` if the caller has it (`run_target`)."""
    (past,) = cache.values()
    plan = plan or _plan(model)
    if plan is None:
        raise ValueError("lean_forward.forward: the model is not one `supports` accepts now; call `run_target`.")
    base = model.model
    modeling = sys.modules[type(base).__module__]
    hidden = base.embed_tokens(input_ids)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, modeling.eager_attention_forward)
    direct = attend is sdpa_attention_forward and attention_mask is not None
    if direct:  # the mask transformers would build, without its plumbing; a 4-D mask is taken as it is
        mask = attention_mask if attention_mask.dim() == 4 else _slot_mask(attention_mask, input_ids.shape[1])
    else:
        mask = create_causal_mask(model.config, hidden, attention_mask, past, position_ids)
    cos, sin = base.rotary_emb(hidden, position_ids=position_ids)
    layers = base.layers[: model.config.num_hidden_layers]
    wanted = _wanted(output_hidden_states, len(layers) + 1)
    states = [hidden if 0 in wanted else None]
    extra = {"sliding_window": None} if LAYERS[type(layers[0]).__name__] else {}
    # siblings run as one product, plain linears as `F.linear` and the norms inline, only where none of them has a
    # hook (one pass over them all where none has, as almost always)
    clean = only_capturing_hooks(plan.rest)
    fuse = clean or only_capturing_hooks(plan.fused)
    linear = _linear if fuse else _call
    qk_norms = hasattr(layers[0].self_attn, "q_norm")  # (Qwen3) every layer is of the same class
    norm = _inline_norm if _norms_inline(plan, clean) else _call
    rotate = _inline_rotary if _plain_rotary(modeling) else None
    if rotate is not None:  # (B, 1, W, hd): what `apply_rotary_pos_emb` broadcasts over the heads, made once
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for i, (ln1, attn, q_proj, k_proj, v_proj, o_proj, ln2, mlp, gate, up, down) in enumerate(
        plan.parts()[: len(layers)]
    ):
        residual = hidden
        x = norm(ln1, hidden)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        qkv = fused_product((q_proj, k_proj, v_proj), x) if fuse else None
        if qkv is None:
            q, k, v = (linear(p, x).view(shape) for p in (q_proj, k_proj, v_proj))
        else:
            q, k, v = (p.view(shape) for p in qkv.split(_widths(attn), dim=-1))
        if qk_norms:
            q, k = norm(attn.q_norm, q), norm(attn.k_norm, k)
        if rotate is None:
            q, k = modeling.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        else:
            q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        k, v = past.update(k, v.transpose(1, 2), attn.layer_idx)
        if direct:
            out = _sdpa(q, k, v, mask, attn.scaling)
        else:
            out, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **extra)
        hidden = residual + linear(o_proj, out.reshape(*x.shape[:-1], -1).contiguous())
        hidden = hidden + _mlp(mlp, gate, up, down, norm(ln2, hidden), fuse)
        if i + 1 < len(layers):
            states.append(hidden if i + 1 in wanted else None)
    hidden = norm(base.norm, hidden)
    states.append(hidden if len(layers) in wanted else None)
    return CausalLMOutputWithPast(
        logits=model.lm_head(hidden),
        hidden_states=tuple(states) if output_hidden_states not in (None, False) else None,
        **{_CACHE_FIELD: past},
    )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scaling: float) -> torch.Tensor:
    """What transformers' SDPA attention function computes for q (B, H, W, hd) over k, v (B, H_kv, T, hd), as
    (B, W, H, hd), with grouped heads broadcast where it copies the keys per group (`repeat_kv`, W > 1 with a mask:
    the same values, without copying the cache every layer), and its own way elsewhere: SDPA's grouped heads without
    a mask, the query's heads folded onto the key heads for one token with one."""
    batch, heads, width, dim = q.shape
    groups = heads // k.shape[1]
    if groups > 1 and width == 1 and mask is not None:
        out = F.scaled_dot_product_attention(q.reshape(batch, -1, groups, dim), k, v, attn_mask=mask, scale=scaling)
        return out.reshape(batch, heads, width, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2)


def _slot_mask(attention_mask: torch.Tensor, width: int) -> torch.BoolTensor | None:
    """The (B, 1, W, T) boolean mask `create_causal_mask` makes for SDPA from a 2-D mask (B, T) over every slot of
    the cache, the W new ones last: slot j of the new ones sees the valid slots up to itself (causal by slot, not by
    position: a ragged cache's holes make the two differ). None, as there, for one token and no hole."""
    if width == 1 and bool(attention_mask.all()):
        return None
    slots = attention_mask.shape[1]
    seen = (
        torch.arange(slots, device=attention_mask.device)[None]
        <= torch.arange(slots - width, slots, device=attention_mask.device)[:, None]
    )  # (W, T)
    return attention_mask.bool()[:, None, None, :] & seen


# the output's cache field: `cache` from transformers 5.25 on, `past_key_values` before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _widths(attn: nn.Module) -> list[int]:
    return [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]


def _mlp(mlp: nn.Module, gate: nn.Module, up: nn.Module, down: nn.Module, x: torch.Tensor, fuse: bool):
    """`mlp(x)` = down(act(gate(x)) * up(x)), gate and up as one packed product where they are one group, else as
    the MLP's own forward computes it (`fuse`: no hook on the MLP, so its forward may be run in its place)."""
    if not fuse:
        return mlp(x)
    gate_up = fused_product((gate, up), x)
    if gate_up is None:
        return _linear(down, mlp.act_fn(_linear(gate, x)) * _linear(up, x))
    g, u = gate_up.split([gate.out_features, up.out_features], dim=-1)
    return _linear(down, mlp.act_fn(g.contiguous()) * u.contiguous())


# -- the norms and the rotary embedding, inline where they are transformers' own ------------------------------------
#
# A decoding step of a 30-layer model calls 61 norms and 30 rotary embeddings. As modules and functions they cost
# ~2-3 ms a step on 2 CPU threads each, beyond their arithmetic (benchmarks/time_compiled_step.py's study: each
# piece of plumbing a few percent of a 1-token step). Inline, the same operators run in the same order on the same
# values, so the logits stay bit-identical (tests/test_lean_forward.py).


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _inline_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the `*RMSNorm.forward` of Llama, Qwen2, Qwen3 and Mistral computes, operator for operator."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _norm_class(layers, modeling) -> type | None:
    """The modeling module's own RMSNorm class where its forward is its own (the one `_inline_norm` computes)."""
    cls = getattr(modeling, f"{type(layers[0]).__name__.removesuffix('DecoderLayer')}RMSNorm", None)
    if cls is None or cls.forward.__qualname__ != f"{cls.__name__}.forward":
        return None
    return cls


def _norms_inline(plan: _Plan, clean: bool = False) -> bool:
    """Whether every norm is the modeling module's own RMSNorm class, with its own forward and no hook (`clean`: the
    caller found no hook on any of them)."""
    if plan.norm_class is None or not all(type(n) is plan.norm_class for n in plan.norms):
        return False
    return clean or only_capturing_hooks(plan.norms)


def _norms(base: nn.Module, layers) -> list[nn.Module]:
    """Every norm the forward calls. They run inline where each is of `_norm_class` (checked every forward, with
    their hooks: a norm swapped, re-classed or hooked is called as a module)."""
    norms = [base.norm]
    for layer in layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        attn = layer.self_attn
        if hasattr(attn, "q_norm"):
            norms += [attn.q_norm, attn.k_norm]
    return norms


def _inline_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as `apply_rotary_pos_emb` computes it for each of q and k."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _plain_rotary(modeling) -> bool:
    """Whether the modeling module's `apply_rotary_pos_emb` is its own plain function (not one a kernel hub swapped
    in): the one `_inline_rotary` computes."""
    function = getattr(modeling, "apply_rotary_pos_emb", None)
    return (
        getattr(function, "__module__", None) == modeling.__name__
        and getattr(function, "__wrapped__", None) is None
        and getattr(modeling, "rotate_half", None) is not None
    )


def _fused_modules(layers) -> list[nn.Module]:
    """The modules a fused product or `_linear` skips calling: every projection and the MLP, in every layer."""
    out = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return out


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a module without hooks: `F.linear` itself for a plain `nn.Linear` (what its forward runs), the
    module's forward for any other (a verify kernel's class inside a scope, a quantized linear)."""
    if type(module) is nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module.forward(x)


def _wanted(output_hidden_states: bool | list[int], count: int) -> set[int]:
    if output_hidden_states is True:
        return set(range(count))
    if not output_hidden_states:
        return set()
    return {i % count for i in output_hidden_states if -count <= i < count}


__all__ = ["LAYERS", "forward", "run_target", "supports"]
