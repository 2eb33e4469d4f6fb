"""`TargetRuntime`: everything this package keeps for one target on this machine, in one object.

Decoding a target fast needs what was measured or made for it here, kept from one `generate()` call to the next:

- `plan`: which modules the round's lean forward reaches (`lean_forward`), made again when the model's structure
  changes;
- `kernels`: the way its linears verify, measured per row count (`verify_linears.VerifyKernels`);
- `packs`: the packed copies of its weights those kernels read (`verify_linears.TargetPacks`);
- `threads`: each round's intra-op thread count, measured under the machine's load (`threads.RoundThreads`);
- `gates`: per drafter, the draft gate's measurements on this target (`decoding.policy.GateMemory`).

`runtime_for(target)` gives the target's one runtime, made on first use and kept beside the target under a weak
key, so it is freed with the target and nothing is ever set on the target itself. A decoder and an Engine hold it
explicitly (`SpeculativeDecoder.runtime`). Each part is filled in by the module that owns it, the first time it is
needed. This module imports none of them.
"""

import weakref

from torch import nn


class TargetRuntime:
    """The machine-specific state of one target (see the module docstring); the parts are None until first needed."""

    def __init__(self):
        self.plan = None
        self.kernels = None
        self.packs = None
        self.threads = None
        self.gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> its gate's measurements

    def __repr__(self) -> str:
        made = [name for name in ("plan", "kernels", "packs", "threads") if getattr(self, name) is not None]
        return f"TargetRuntime(made: {', '.join(made) or 'nothing yet'}; gates for {len(self.gates)} drafter(s))"


_RUNTIMES: "weakref.WeakKeyDictionary[nn.Module, TargetRuntime]" = weakref.WeakKeyDictionary()


def runtime_for(target: nn.Module) -> TargetRuntime:
    """`target`'s one `TargetRuntime`, made on first use and freed with the target."""
    runtime = _RUNTIMES.get(target)
    if runtime is None:
        runtime = _RUNTIMES[target] = TargetRuntime()
    return runtime


__all__ = ["TargetRuntime", "runtime_for"]
