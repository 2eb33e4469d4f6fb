"""`OPTIONS`: the one object whose fields turn this package's ways of running a round off, or force one.

Every field is on by default, the way rounds run; turning one off gives the path as it was before that way existed,
for side-by-side timings (benchmarks/) and for tests that pin a way. Set a field for a block and put it back after
(`monkeypatch.setattr(OPTIONS, "lean_forward", False)` in a test); the object is read at each use, never copied.

What is measured or made for one target on this machine lives in its `TargetRuntime` (`runtime.py`), not here.
"""

from dataclasses import dataclass


@dataclass
class Options:
    """Which of the package's ways rounds may take (see the module docstring)."""

    lean_forward: bool = True  # the round's target forward without transformers' wrappers (`lean_forward`)
    packs: bool = True  # packed copies of the target's linears for verifies (`verify_linears`)
    verify_way: str | None = None  # one of `verify_linears.WAYS` for every verify instead of the measured choice
    verify_head: bool = True  # the few-row products of verifies (`verify_head`)
    verify_attention: bool = True  # grouped-query attention reading each key once (`verify_attention`)
    packed_linear: bool = True  # oneDNN-packed weights for the drafter's linears (`packed_linear`)
    round_threads: bool = True  # each round's thread count measured under load (`threads`); off: the caller's
    in_place_cache: bool = True  # the target cache writes new slots in place (`decoding.ragged_cache.AppendLayer`)
    select_hidden_states: bool = True  # the target returns only the drafter's tapped layers (`decoding.core`)
    per_token_verify: bool = True  # dynamic int8 targets verify token by token (`weights.per_token_activations`)
    narrow_draft: bool = True  # greedy chains drafted among the draft vocabulary's columns alone (`decoding.drafting`)


OPTIONS = Options()


__all__ = ["OPTIONS", "Options"]
