"""`TargetRuntime`: one object per target holds what is kept for it on this machine, held by decoders and Engines,
freed with the target, never set on it."""

import gc
import weakref

import torch

from conftest import make_drafter, make_target
from dspark_hf.decoding.core import SpeculativeDecoder
from dspark_hf.decoding.policy import gate_memory
from dspark_hf.kernels.runtime import TargetRuntime, runtime_for
from dspark_hf.kernels.threads import round_threads
from dspark_hf.kernels.verify_linears import kernel_choice, packs_for
from dspark_hf.serving.engine import Engine


def test_one_runtime_per_target_holds_its_parts_and_the_decoders_hold_it():
    target, other = make_target().eval(), make_target(seed=1).eval()
    drafter = make_drafter(target)
    runtime = runtime_for(target)
    assert isinstance(runtime, TargetRuntime) and runtime_for(target) is runtime
    assert runtime_for(other) is not runtime
    assert kernel_choice(target) is runtime.kernels and round_threads(target) is runtime.threads
    assert packs_for(target) is runtime.packs
    assert gate_memory(drafter, target) is runtime.gates[drafter]
    assert gate_memory(drafter, other) is not runtime.gates[drafter]  # a drafter's measurements are per target
    assert SpeculativeDecoder(target, drafter).runtime is runtime
    assert Engine(target, drafter).decoder.runtime is runtime
    before = set(vars(target))
    mask = torch.ones(1, 5, dtype=torch.long)
    target.generate(torch.arange(1, 6)[None], attention_mask=mask, max_new_tokens=6, assistant_model=drafter)
    assert runtime.plan is not None and set(vars(target)) == before  # filled in, nothing left on the target


def test_the_runtime_is_freed_with_its_target():
    target = make_target().eval()
    drafter = make_drafter(target)
    mask = torch.ones(1, 5, dtype=torch.long)
    target.generate(torch.arange(1, 6)[None], attention_mask=mask, max_new_tokens=6, assistant_model=drafter)
    runtime = weakref.ref(runtime_for(target))
    gone = weakref.ref(target)
    del target, drafter
    gc.collect()
    assert gone() is None and runtime() is None
