"""The target's LM head in verify passes: a faster product for a few rows of float32 on the CPU.

A verify pass runs the target on the anchor and its k drafts, so the LM head multiplies k + 1 rows by a
vocabulary-sized weight. On the CPU, torch's float32 `linear` (MKL) is slow for exactly that shape. On this 2-core
CPU, SmolLM2's head (49,152 × 576) takes 21–49 ms for 2–8 rows. The same product written as (W xᵀ)ᵀ takes 6–7 ms,
and one row costs 12 ms either way. A whole 4-token verify forward drops from 111 ms to 54 ms (one token: 60–80 ms).
See docs/results.md, "The verify LM head".

Plain decoding (one row) never meets those shapes; every speculative round does. bf16 and GPU heads do not have
the problem, and are left alone.

`attach(lm_head)` turns an `nn.Linear` head into a `VerifyLinear`. While its `verifying` flag is set (`with
verifying(lm_head):`, or the candidate generator between a draft and its verify), it computes `MIN_ROWS..MAX_ROWS`
rows with `utils.linear_few_rows`, the product the drafter already uses for its block logits. Otherwise it is
`nn.Linear.forward`, so the target behaves as before outside the verify passes of this package. The two products
agree to float rounding (the summation order differs, as it already does between any two batch sizes). Set
`ENABLED = False` to turn it off.
"""

import contextlib

import torch
from torch import nn

from .utils import linear_few_rows


ENABLED = True
MIN_ROWS, MAX_ROWS = 2, 8  # measured: 2.5–8x faster at 2–8 rows on 2 threads, no gain beyond 8 on 1 thread


class VerifyLinear(nn.Linear):
    """An `nn.Linear` LM head that, while `verifying` is set, computes a few rows with `utils.linear_few_rows`.

    `attach` turns a head into one in place (its class changes; its parameters, hooks and tying stay as they are).
    """

    verifying = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.verifying and ENABLED and MIN_ROWS <= hidden.numel() // max(hidden.shape[-1], 1) <= MAX_ROWS:
            return linear_few_rows(hidden, self.weight, self.bias)
        return super().forward(hidden)


def attach(lm_head) -> bool:
    """Make `lm_head` a `VerifyLinear` if it can use it: a plain `nn.Linear`, float32, on the CPU, without
    accelerate hooks. Idempotent; returns whether the head is one."""
    if isinstance(lm_head, VerifyLinear):
        return True
    if eligible(lm_head):
        lm_head.__class__ = VerifyLinear
        return True
    return False


def eligible(lm_head) -> bool:
    """Whether `attach` takes this head (or has already)."""
    return isinstance(lm_head, VerifyLinear) or (
        type(lm_head) is nn.Linear
        and lm_head.weight.device.type == "cpu"
        and lm_head.weight.dtype == torch.float32
        and not hasattr(lm_head, "_hf_hook")
        and "forward" not in vars(lm_head)  # someone replaced its forward already: leave it alone
    )


def set_verifying(lm_head, active: bool) -> None:
    """Switch an attached head's fast product on (for the next verify pass) or off; other heads are left alone."""
    if isinstance(lm_head, VerifyLinear):
        lm_head.verifying = bool(active)


@contextlib.contextmanager
def verifying(lm_head):
    """Within the block, an attached head computes few rows the fast way; any other head is untouched."""
    if not isinstance(lm_head, VerifyLinear):
        yield
        return
    previous, lm_head.verifying = lm_head.verifying, True
    try:
        yield
    finally:
        lm_head.verifying = previous


__all__ = ["VerifyLinear", "attach", "eligible", "set_verifying", "verifying"]
