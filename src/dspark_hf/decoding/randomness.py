"""Counter-based randomness: a sampling row's noise at a position depends only on (its seed, that position).

Sampling rows choose every token by the Gumbel-max rule: the token at absolute position t (its index in the row's
prompt + output) is argmax_v (l_t(v) + g_{s,t}(v)), where l_t are the processed logits at t and g_{s,t} ∈ R^V is
standard Gumbel noise keyed by the row's seed s and t. The draft at t is chosen with the same g_{s,t} from the
drafter's logits, so the two agree as often as the coupling allows, and the token committed at t is the same
function of (s, t, the target's distribution at t) whichever round computes it (`acceptance.py` has the proof).

g_{s,t} comes from a torch generator seeded with a 32-bit key of (s, t): `key = mix32(((base_s & M) + t) & M) ^
(base_s >> 32)` with base_s = splitmix64's finalizer of s and mix32 a bijection of 32-bit words. For a fixed seed
distinct positions get distinct keys (so one row never reuses noise), and rows of different seeds get unrelated
keys. The CPU generator (mt19937) takes 32-bit seeds, which is why the key has 32 bits; a CUDA generator (Philox)
takes it as is. The noise is identical across calls, batches and machines of one device type; a CPU and a GPU draw
different (equally valid) noise.

Cost: one generator seeding, V uniforms and two logarithms per (row, position), made only for sampling rows and only
for the positions a round examines, and cached on the row until the position is committed: about 0.2-0.5 ms per
position at V = 49152 on a 2-core AMD EPYC. Uniforms are float32 (resolution 2^-24; 0 is raised to 2^-25), so the
sampled distribution is the target's up to float32 rounding, as with `torch.multinomial`.

Rows decoded with standard speculative sampling (`Row.sampling == "standard"`, `acceptance.accept_standard`) draw
from one sequential generator per row instead (`stream_key`): each draft, acceptance test and residual or bonus draw
takes fresh uniforms, so no decision of a round can have seen the randomness a later one uses.
"""

import torch


_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
_TINY = 2.0**-25  # a uniform of 0 becomes this: log(0) would rule a token out


def _splitmix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words that spreads every input bit over the output."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix32(x: int) -> int:
    """A bijection of 32-bit words (xor-shift / odd-multiply rounds)."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def position_key(seed: int, position: int) -> int:
    """The 32-bit generator seed of (row seed, absolute position); distinct positions of one seed never collide."""
    base = _splitmix64(seed & _M64)
    return _mix32(((base & _M32) + position) & _M32) ^ (base >> 32)


def stream_key(seed: int) -> int:
    """The 32-bit generator seed of a row's sequential stream (standard sampling), unrelated to its position keys."""
    base = _splitmix64((seed ^ 0x5EED5EED5EED5EED) & _M64)
    return (base & _M32) ^ (base >> 32)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.LongTensor:
    """Inverse-CDF draws: probs (n, V) non-negative (need not sum to 1), uniforms (n,) in [0, 1) -> tokens (n,).

    Token v is drawn when u·Σp falls in [cdf(v - 1), cdf(v)), so with probability p(v) / Σp; a token of probability 0
    spans an empty interval and is never drawn. The cumulative sum runs in float64.
    """
    cdf = probs.double().cumsum(dim=-1)  # (n, V)
    total = cdf[:, -1:]
    point = torch.minimum(uniforms.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True)[:, 0]


def gumbel_noise(seed: int, positions, vocab_size: int, device) -> torch.Tensor:
    """Standard Gumbel noise g_{seed, t} for each position t: (len(positions), V) float32 on `device`."""
    device = torch.device(device)
    out = torch.empty(len(positions), vocab_size, device=device)
    for i, position in enumerate(positions):
        generator = torch.Generator(device=device).manual_seed(position_key(seed, position))
        out[i].uniform_(generator=generator)
    return out.clamp_min_(_TINY).log_().neg_().log_().neg_()  # uniforms lie in [0, 1 - 2^-24]


def gumbel_choice(logits: torch.Tensor, noise: torch.Tensor) -> torch.LongTensor:
    """argmax(logits + noise) over the last dimension: a draw from softmax(logits) (-inf logits are never chosen)."""
    return (logits.float() + noise.to(logits.device)).argmax(dim=-1)


__all__ = ["draw", "gumbel_choice", "gumbel_noise", "position_key", "stream_key"]
