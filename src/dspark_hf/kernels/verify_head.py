"""The target's linear layers in verify passes: a faster product for a few rows of float32 on the CPU.

A verify pass runs the target on the anchor and its k drafts, so every linear layer multiplies k + 1 rows by its
weight. On the CPU, torch's float32 `linear` (MKL) is slow for exactly those shapes, and the same product written as
(W xᵀ)ᵀ can be several times faster, for the LM head most of all; one row costs the same either way. How much this
gains depends on the CPU and its BLAS: on some it is most of a verify pass, on others it loses (docs/results.md has
the dated measurements, `benchmarks/time_verify_head.py` measures a machine). Because a plain decoder that ran each
step as two rows would gain too, part of a speedup over plain `generate()` on such a CPU is this effect, not
speculation: `padded_steps` below is the baseline that separates the two.

bf16 linears (oneDNN) and GPU linears do not have the problem, and are left alone.

`verify_kernels(model)` is the scope of one verify pass: within it the model's plain float32 CPU `nn.Linear`s are
`VerifyLinear`s that compute `MIN_ROWS..max_rows` rows with `few_rows.linear_few_rows` (`max_rows` is `MAX_ROWS_HEAD`
for the LM head, `MAX_ROWS` for the other linears), and an "sdpa" target's attention reads its key/value cache
unrepeated (`verify_attention.py`). On leaving it, normally or by an exception, every module class and the config are
exactly what they were: nothing is left on the user's model between passes. The two products agree to float
rounding (the summation order differs, as it already does between any two batch sizes). Set
`OPTIONS.verify_head = False` to turn it off. Whether a verify of n rows runs these products, oneDNN's packed weights
or transformers' own linears is measured per machine (`verify_linears.py`).

`padded_steps(model)` is the kernel-neutral baseline that `dspark-hf bench` sets beside plain decoding: within it,
every one-token decoding step of `generate()` runs as two rows (the token twice, the second copy cropped from the
cache again) with the few-rows products on. Same tokens, no speculation; a drafter's speedup over it is what
speculation itself buys on such a CPU.
"""

import contextlib

import torch
from torch import nn

from .few_rows import linear_few_rows
from .options import OPTIONS
from .verify_attention import routable, routed  # (also how remote-code loading finds the module to copy)
from .weights import computes_with_weight


# recorded in SPS profiles: 1 = the LM head alone, 2 = every linear, 3 = and sdpa's GQA unrepeated, 4 = the way of
# every linear measured per machine and row count (`verify_linears`: packed, few rows or `F.linear`), 5 = one row as
# two few-rows columns among the ways measured
VERSION = 5
MIN_ROWS = 1  # a single row runs as two (`VerifyLinear.forward`); whether that pays is measured (`verify_linears`)
MAX_ROWS_HEAD = 8  # the LM head: no gain beyond 8 rows on 1 thread (docs/history.md, "The verify LM head")
MAX_ROWS = 5  # the layers' projections: slower from 6 rows on 1 thread


class VerifyLinear(nn.Linear):
    """An `nn.Linear` that computes `MIN_ROWS..max_rows` rows with `few_rows.linear_few_rows`.

    A module is one only inside `verify_kernels` (its class is swapped in and back; parameters, hooks and tying stay).
    """

    max_rows = MAX_ROWS
    computes_as_linear = True  # the same product as `nn.Linear`, on the same dense weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.numel() // max(hidden.shape[-1], 1)
        if rows == 1 and MIN_ROWS <= 1:
            # one column would be a matrix-vector product, which some BLAS builds run at half the speed of a
            # two-column product of the same weight (MKL on AMD EPYC: 46 against 21 ms over SmolLM2's linears):
            # the row twice, the first kept
            pair = hidden.reshape(1, hidden.shape[-1]).repeat(2, 1)  # a real copy: BLAS takes no zero stride
            return linear_few_rows(pair, self.weight, self.bias)[:1].reshape(*hidden.shape[:-1], -1)
        if MIN_ROWS <= rows <= self.max_rows:
            return linear_few_rows(hidden, self.weight, self.bias)
        return super().forward(hidden)


class VerifyHead(VerifyLinear):
    """The LM head's `VerifyLinear`: a few more rows pay."""

    max_rows = MAX_ROWS_HEAD


def _eligible(module) -> bool:
    return (
        type(module) is nn.Linear
        and computes_with_weight(module)  # no quantized or subclass weight, no accelerate hook (weights.py)
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
        and "forward" not in vars(module)  # someone replaced its forward already: leave it alone
    )


def eligible_linears(model) -> list[nn.Linear]:
    """The plain float32 CPU `nn.Linear`s of `model` that verify passes compute the few-rows way (quantized,
    accelerate-hooked, replaced or other-typed linears are left alone: `weights.computes_with_weight`)."""
    return [m for m in model.modules() if _eligible(m)]


def eligible(model) -> bool:
    """Whether `verify_kernels` changes any of the model's linears."""
    return any(_eligible(m) for m in model.modules())


def version(model) -> int:
    """The verify kernels this model's verifies run with, which SPS profiles record: 0 when no linear of it can run
    another way than `nn.Linear`'s, `VERSION` (linears the way measured per machine, `verify_linears`) when its
    attention is routed as well (`verify_attention.routable`), else 2."""
    if not (OPTIONS.verify_head and eligible(model)):
        return 0
    return VERSION if OPTIONS.verify_attention and routable(model) else 2


@contextlib.contextmanager
def verify_kernels(model, linears: list[nn.Linear] | None = None):
    """Within the block, `model` runs its verify pass with the few-rows products and, for "sdpa", unrepeated GQA.

    `linears`: `eligible_linears(model)`, when the caller keeps the list between passes (the decode loop does).
    Everything is undone on exit, also after an exception. Nested blocks are no-ops.
    """
    if not OPTIONS.verify_head:
        yield
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped = [m for m in (eligible_linears(model) if linears is None else linears) if type(m) is nn.Linear]
    with swapped_linears(model, swapped, lambda module: VerifyHead if module is head else VerifyLinear):
        yield


@contextlib.contextmanager
def swapped_linears(model, modules: list[nn.Linear], cls_of):
    """Within the block each of `modules` is of class `cls_of(module)` and an "sdpa" `model` attends on its
    unrepeated cache (`routed`); every class is `nn.Linear` again on exit, also after an exception. The one way a
    verify scope changes the user's linears (few-row products here, packed copies in `verify_linears`)."""
    # object.__setattr__: nn.Module.__setattr__'s parameter/buffer checks cost milliseconds a verify for 200 linears
    for module in modules:
        object.__setattr__(module, "__class__", cls_of(module))
    try:
        with routed(model):
            yield
    finally:
        for module in modules:
            object.__setattr__(module, "__class__", nn.Linear)


def one_token_step(kwargs: dict) -> bool:
    """Whether a forward's keyword inputs are a one-token decoding step with a filled cache (not a prefill, nor an
    embeddings call)."""
    input_ids = kwargs.get("input_ids")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return input_ids is not None and input_ids.shape[-1] == 1 and cache is not None and cache.get_seq_length() > 0


@contextlib.contextmanager
def step_scopes(model, enter, leave=None):
    """Within the block, every one-token decoding step of `model` (a keyword call with a filled cache: `generate()`'s
    steps) runs inside the context manager `enter(kwargs)` returns; `enter` may change the step's keyword inputs in
    place first. After the forward the scope closes, and `leave(kwargs, output)`, if given, returns the output to use.
    The hooks are removed on exit, and a scope left open by a forward that raised is closed."""
    state = {"scope": None}  # the scope of the step in flight

    def pre(module, args, kwargs):
        if args or not one_token_step(kwargs):
            return None
        scope = contextlib.ExitStack()
        scope.enter_context(enter(kwargs))
        state["scope"] = scope
        return args, kwargs

    def post(module, args, kwargs, output):
        if state["scope"] is None:
            return None
        state["scope"].close()
        state["scope"] = None
        return None if leave is None else leave(kwargs, output)

    handles = [
        model.register_forward_pre_hook(pre, with_kwargs=True),
        model.register_forward_hook(post, with_kwargs=True),
    ]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        if state["scope"] is not None:  # a forward raised between the two hooks
            state["scope"].close()


def _pad_step(kwargs: dict) -> None:
    """Turn the keyword inputs of a one-token step with a filled cache into a two-token step, in place."""
    kwargs["input_ids"] = kwargs["input_ids"].repeat(1, 2)  # (B, 2): the second copy is junk, cropped after the step
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(
                f"padded_steps needs a 2-D attention mask (batch, length); got shape {tuple(mask.shape)}."
            )
        kwargs["attention_mask"] = torch.cat([mask, mask[:, -1:]], dim=1)
    positions = kwargs.get("position_ids")
    if positions is not None:
        kwargs["position_ids"] = torch.cat([positions, positions[..., -1:] + 1], dim=-1)
    if isinstance(kwargs.get("logits_to_keep"), int) and kwargs["logits_to_keep"] > 0:
        kwargs["logits_to_keep"] = 2


def padded_steps(model):
    """Within the block, every one-token decoding step of `model.generate()` (or any keyword call with a filled
    cache) runs as two rows with the few-rows products on, and returns the first row's logits as a one-token step
    would: plain decoding at the verify kernel's speed, the kernel-neutral baseline of `dspark-hf bench`.

    The cache must support `crop` (a `DynamicCache`, the default); only `logits` is cut back to one position (hidden
    states and attentions, if asked for, keep the junk one).
    """

    def pad(kwargs):
        _pad_step(kwargs)
        return verify_kernels(model)

    def crop(kwargs, output):
        kwargs.get("cache", kwargs.get("past_key_values")).crop(-1)  # forget the junk position
        output.logits = output.logits[:, :1]  # (B, 1, V): the real token's
        return output

    return step_scopes(model, pad, crop)


__all__ = [
    "VerifyHead",
    "VerifyLinear",
    "eligible",
    "eligible_linears",
    "one_token_step",
    "padded_steps",
    "swapped_linears",
    "step_scopes",
    "verify_kernels",
    "version",
]
