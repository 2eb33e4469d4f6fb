"""Property-based checks (hypothesis) of the two places arbitrary input reaches: the OpenAI request parser (any JSON
body) and Algorithm 1's `prefix_schedule` (any confidences and SPS profile). Kept small: a few seconds in all."""

import math

import pytest


hypothesis = pytest.importorskip("hypothesis", reason="needs `pip install hypothesis` (the dev extra)")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dspark_hf.decoding.scheduler import prefix_schedule, settled_prefix_schedule  # noqa: E402
from dspark_hf.serving.openai_protocol import ProtocolError, ServingLimits, parse_chat, parse_completion  # noqa: E402
from helpers import char_tokenizer  # noqa: E402


FAST = settings(max_examples=60, deadline=None, derandomize=True)
LIMITS = ServingLimits("tiny", max_model_len=64, vocab_size=99)
TOKENIZER = char_tokenizer(99)
TOKENIZER.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}>"

# -- the request parser ---------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stream", "stream_options", "n", "logprobs", "user", "frequency_penalty",
]  # fmt: skip
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6) | json_values


def check_parsed(parsed, body) -> None:
    """What every accepted request must satisfy, whatever the body looked like."""
    gen = parsed.generation
    assert parsed.prompt_ids and all(0 <= t < LIMITS.vocab_size for t in parsed.prompt_ids)
    assert 1 <= gen["max_new_tokens"] and len(parsed.prompt_ids) + gen["max_new_tokens"] <= LIMITS.max_model_len
    assert 0 < gen["temperature"] <= 2 and 0 < gen["top_p"] <= 1 and gen["top_k"] >= 0
    temperature = body.get("temperature")
    assert gen["do_sample"] == (temperature is None or temperature > 0)  # absent or null: OpenAI's default of 1
    assert all(isinstance(s, str) and s for s in parsed.stop)


@FAST
@given(body=bodies, chat=st.booleans())
def test_any_json_body_is_parsed_or_refused_with_a_4xx(body, chat):
    parse = parse_chat if chat else parse_completion
    try:
        parsed = parse(body, TOKENIZER, LIMITS)
    except ProtocolError as err:
        assert err.status in (400, 404) and str(err)
        assert err.param is None or isinstance(body, dict)
        return
    check_parsed(parsed, body)


text = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20)
valid_bodies = st.fixed_dictionaries(
    {"prompt": text},
    optional={
        "max_tokens": st.integers(1, 10**6) | st.none(),
        "temperature": st.floats(0, 2) | st.integers(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(-1, 100),
        "seed": st.integers(-(2**31), 2**31),
        "stop": text | st.lists(text, min_size=1, max_size=4),
        "model": st.just("tiny"),
    },
)


@FAST
@given(body=valid_bodies)
def test_valid_completion_bodies_are_accepted_and_clipped_to_the_context(body):
    parsed = parse_completion(body, TOKENIZER, LIMITS)
    check_parsed(parsed, body)
    room = LIMITS.max_model_len - len(parsed.prompt_ids)
    max_tokens = body.get("max_tokens") or 16  # OpenAI's completions default
    assert parsed.generation["max_new_tokens"] == min(max_tokens, room)
    assert TOKENIZER.decode(parsed.prompt_ids) == body["prompt"]


@FAST
@given(
    messages=st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": text}), min_size=1, max_size=3
    )
)
def test_valid_chats_are_accepted(messages):
    parsed = parse_chat({"messages": messages, "max_tokens": 5}, TOKENIZER, LIMITS)
    check_parsed(parsed, {"messages": messages})
    assert messages[-1]["content"] in TOKENIZER.decode(parsed.prompt_ids)


# -- Algorithm 1 ----------------------------------------------------------------------------------------------------

probabilities = st.floats(0, 1)
blocks = st.lists(st.lists(probabilities, min_size=0, max_size=5), min_size=1, max_size=5)
# no survival below float rounding of Θ (a 1e-38 chance adds nothing to R + Σ survival in float64)
coarse = st.just(0.0) | st.floats(0.01, 1)
coarse_blocks = st.lists(st.lists(coarse, min_size=0, max_size=5), min_size=1, max_size=5)


def profile_for(confidences, rates):
    """An SPS profile covering every verify size the confidences can ask for (anchors included)."""
    largest = len(confidences) + sum(len(c) for c in confidences)
    return {b: rates[(b - 1) % len(rates)] for b in range(1, largest + 1)}


def theta(confidences, lengths, sps) -> float:
    expected = sum(1 + sum(math.prod(c[:k]) for k in range(1, n + 1)) for c, n in zip(confidences, lengths))
    return expected * sps[len(confidences) + sum(lengths)]


def survivals(confidences):
    return [[math.prod(c[:k]) for k in range(1, len(c) + 1)] for c in confidences]


rates = st.lists(st.floats(0.01, 1000), min_size=1, max_size=8)


@FAST
@given(confidences=blocks, rates=rates)
def test_prefix_schedule_is_a_greedy_prefix_that_never_loses_to_plain_decoding(confidences, rates):
    sps = profile_for(confidences, rates)
    lengths = prefix_schedule(confidences, sps)
    assert len(lengths) == len(confidences)
    surv = survivals(confidences)
    for c, s, n in zip(confidences, surv, lengths):
        assert 0 <= n <= len(c)
        assert n == 0 or s[n - 1] > 0  # never verifies a draft it gives no chance
    assert theta(confidences, lengths, sps) >= theta(confidences, [0] * len(confidences), sps) * (1 - 1e-12)
    admitted = [s[k] for s, n in zip(surv, lengths) for k in range(n)]
    left = [s[k] for s, n in zip(surv, lengths) for k in range(n, len(s)) if s[k] > 0]
    if admitted and left:
        assert min(admitted) >= max(left)  # admitted in order of survival


@FAST
@given(confidences=blocks, rates=rates)
def test_prefix_schedule_ignores_the_scale_of_the_profile(confidences, rates):
    sps = profile_for(confidences, rates)
    assert prefix_schedule(confidences, sps) == prefix_schedule(confidences, {b: 4.0 * v for b, v in sps.items()})


@FAST
@given(confidences=coarse_blocks)
def test_flat_and_falling_profiles(confidences):
    """A flat SPS admits every draft with a chance; SPS(B) = 1/B (no batching gain) admits none."""
    flat = profile_for(confidences, [7.0])
    surv = survivals(confidences)
    assert prefix_schedule(confidences, flat) == [sum(1 for x in s if x > 0) for s in surv]
    falling = {b: 1.0 / b for b in flat}
    assert prefix_schedule(confidences, falling) == [0] * len(confidences)


@FAST
@given(confidences=blocks, rates=rates, data=st.data())
def test_a_settled_partial_schedule_equals_the_full_one(confidences, rates, data):
    """Scheduling on the positions sampled so far either waits (None) or gives exactly the full block's schedule."""
    seen = [c[: data.draw(st.integers(0, len(c)))] for c in confidences]
    bound = max((math.prod(s) for s, c in zip(seen, confidences) if len(s) < len(c)), default=0.0)
    sps = profile_for(confidences, rates)
    settled = settled_prefix_schedule(seen, sps, unseen_bound=bound)
    assert settled is None or settled == prefix_schedule(confidences, sps)


@FAST
@given(bad=st.floats(allow_nan=True).filter(lambda x: not 0 <= x <= 1))
def test_a_confidence_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="not a probability"):
        prefix_schedule([[0.5, bad]], {1: 1.0, 2: 1.0, 3: 1.0})
