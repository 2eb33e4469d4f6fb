"""The settings decoding reads when it runs, checked in one place: a DSpark config's verify policy and threshold,
draft gate, trees and their calibration, lookup drafts, context window, STS temperatures, draft vocabulary and mask
token, and the settings a drafter's weights fix. `DSparkConfig.check_runtime_settings` (the public entry) runs them
when a config is built or loaded, and `generate()` and the `Engine` before any forward, since a live drafter's config
can be changed (`drafter.config.tree_budget = 16`) where `@strict` checks only types. Each bad value is one
`ValueError` naming the field, what it allows and the value given."""

import math
from typing import Any


VERIFY_POLICIES = ("threshold", "fixed", "scheduler")
# How a sampling row is decoded (`decoding/acceptance.py`): "coupled", the seeded Gumbel-max coupling (the same tokens
# under every drafter, policy and load), or "standard" speculative (rejection) sampling of chains
SAMPLING_MODES = ("coupled", "standard")
LONGEST_LOOKUP = 8  # the longest suffix match `context_lookup` tries (decoding/lookup.py)
# The most nodes a draft tree may have (`tree_budget`). Every node is one more position of the round's verify forward
# under the "fixed" policy, and the extra accepted depth shrinks fast with size (docs/trees.md: τ 2.18 / 2.40 / 2.62
# at 8 / 16 / 32 nodes), so past this a round costs far more than it can gain (10,000 nodes took 207 s for 20 tokens).
MAX_TREE_BUDGET = 128
# `tree_budget="auto"`: a tree of this many nodes where the round can price and verify one (the scheduler policy, a
# target without sliding windows, no row sampling with sampling="standard") and this machine's profile says width is
# cheap enough: a verify of AUTO_TREE_BUDGET + 1 tokens costing at most AUTO_TREE_WIDTH_COST one-token steps. Else a
# chain. Algorithm 1 then takes, each round, only the nodes whose expected gain pays for their width. The bound keeps
# out targets whose verify cost grows with every token (a dynamically quantized target verifies token by token:
# 17 tokens cost ~17 steps); the CPUs measured so far cost 1.45x (AMD EPYC) and 1.9x (Intel Xeon) there.
AUTO_TREE_BUDGET = 16
AUTO_TREE_WIDTH_COST = 2.5
# ... and while every row's context is at most this long: a verify's width costs more over a long cache (each verified
# token attends over every cached one), which a profile taken over a short one does not show. Measured on the
# embedded pair (AMD EPYC): trees 1.03x the chain over 128-token answers to short prompts, 0.83x of it at 4k tokens.
AUTO_TREE_CONTEXT = 1024


def _refuse(name: str, allowed: str, value: Any) -> ValueError:
    """The one-line error of a bad setting: the field, what it allows, the value given."""
    return ValueError(f"`{name}` must be {allowed}, got {value!r}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int, high: int | None = None, meaning: str = "") -> None:
    """Raise `_refuse` unless `value` is an int (not a bool) in low..high (high None: no upper bound)."""
    if not _is_int(value) or value < low or (high is not None and value > high):
        allowed = f"an int >= {low}" if high is None else f"an int in {low}..{high}"
        raise _refuse(name, f"{allowed} ({meaning})" if meaning else allowed, value)


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise _refuse(name, "one of " + ", ".join(repr(c) for c in choices), value)


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _refuse(name, "True or False", value)


def check_sampling(sampling: Any, tree_budget: int = 0, do_sample: bool = True) -> None:
    """`sampling` is one of `SAMPLING_MODES`; "standard" verifies chains only, so a sampling row refuses it beside a
    tree budget (greedy rows ignore `sampling`)."""
    check_choice("sampling", sampling, SAMPLING_MODES)
    if sampling == "standard" and do_sample and tree_budget and tree_budget != "auto":  # "auto": such rows get chains
        raise ValueError(
            f"sampling='standard' verifies chains only, but drafter.config.tree_budget={tree_budget}. Set "
            "drafter.config.tree_budget = 0, or sample with sampling='coupled' (the default, which trees keep)."
        )


def check_tree_budget(value: Any) -> None:
    """`tree_budget` is "auto" or an int in 0..MAX_TREE_BUDGET."""
    if value == "auto":
        return
    if not _is_int(value) or not 0 <= value <= MAX_TREE_BUDGET:
        raise _refuse(
            "tree_budget",
            f'"auto" or an int in 0..{MAX_TREE_BUDGET} ("auto": trees where this machine pays for them; 0: draft a '
            "chain; N > 0: a tree of at most N nodes per row, each one more verified position)",
            value,
        )


def largest_tree(value: Any) -> int:
    """The most nodes a `tree_budget` setting may draft ("auto": `AUTO_TREE_BUDGET`; 0 for a chain)."""
    return AUTO_TREE_BUDGET if value == "auto" else int(value or 0)


def check_dspark_settings(config, drafter=None) -> None:
    """The DSpark settings of `config` (a `DSparkConfig`) that decoding reads; with `drafter`, also the settings its
    weights fix (`check_weights_match`)."""
    check_choice("verify_policy", config.verify_policy, VERIFY_POLICIES)
    threshold = config.confidence_threshold
    if not _is_real(threshold) or not 0.0 <= threshold <= 1.0:  # NaN fails the comparison
        raise _refuse(
            "confidence_threshold", "a number in [0, 1] (the survival the threshold policy needs)", threshold
        )
    check_bool("draft_gate", config.draft_gate)
    check_bool("confidence_head", config.confidence_head)
    check_bool("confidence_with_markov", config.confidence_with_markov)
    check_tree_budget(config.tree_budget)
    check_int(
        "context_lookup",
        config.context_lookup,
        0,
        LONGEST_LOOKUP,
        "the shortest suffix match that may draft from the context; 0: never",
    )
    if config.context_window is not None:
        check_int(
            "context_window",
            config.context_window,
            1,
            meaning="context positions a block attends to; None: the whole context",
        )
    temperatures = config.sts_temperatures
    if (
        not isinstance(temperatures, list)
        or len(temperatures) != config.block_size
        or not all(_is_real(t) and 0 < t < math.inf for t in temperatures)
    ):
        raise _refuse(
            "sts_temperatures",
            f"a list of {config.block_size} positive finite numbers (one per block position, block_size "
            f"{config.block_size})",
            temperatures,
        )
    if getattr(config, "tree_calibration", None) is not None:
        check_tree_calibration(config.tree_calibration, config.block_size)
    check_int("draft_vocab_size", config.draft_vocab_size, 0, config.vocab_size, "0: the whole vocabulary")
    if config.mask_token_id is not None:
        check_int(
            "mask_token_id", config.mask_token_id, 0, config.vocab_size - 1, "a vocabulary token; None: a learned mask"
        )
    if drafter is not None:
        check_weights_match(config, drafter)


def check_tree_calibration(fit: Any, block_size: int) -> None:
    """`tree_calibration`: one list per draft depth (block_size of them), each a non-empty list of [scale, shift]
    pairs, one per child rank, scale > 0 and both finite (`decoding/trees.calibrated`: scale > 0 keeps the map
    increasing)."""

    def pair(value: Any) -> bool:
        return (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(_is_real(v) and math.isfinite(v) for v in value)
            and value[0] > 0
        )

    if (
        not isinstance(fit, (list, tuple))
        or len(fit) != block_size
        or not all(isinstance(d, (list, tuple)) and d and all(pair(p) for p in d) for d in fit)
    ):
        raise _refuse(
            "tree_calibration",
            f"None or, for each of the {block_size} draft depths (block_size {block_size}), a non-empty list of "
            "[scale, shift] pairs, one per child rank, with scale > 0 and both finite (refit it with `dspark-hf "
            "calibrate`, or set it to None for the raw draft probabilities)",
            fit,
        )


def check_weights_match(config, drafter) -> None:
    """The settings `drafter`'s weights fix must be the ones it was built with (duck-typed: a drafter loaded with
    `trust_remote_code` counts too; attributes a drafter lacks are not checked)."""
    fixed = "the drafter was built with it and its weights depend on it; set it back"
    if hasattr(drafter, "draft_vocab_ids"):
        ids = drafter.draft_vocab_ids
        count = 0 if ids is None else len(ids)
        if config.draft_vocab_size != count:
            raise ValueError(
                f"`draft_vocab_size` is {config.draft_vocab_size}, but this drafter drafts among {count} token ids "
                "(0: the whole vocabulary); set the draft vocabulary with drafter.set_draft_vocab(ids) (None: the "
                "whole vocabulary), not on the config."
            )
    if hasattr(drafter, "mask_embedding"):
        if drafter.mask_embedding is not None and config.mask_token_id is not None:
            allowed = f"None for this drafter (it learned a mask embedding; {fixed})"
            raise _refuse("mask_token_id", allowed, config.mask_token_id)
        if drafter.mask_embedding is None and config.mask_token_id is None:
            raise _refuse(
                "mask_token_id",
                f"a token id in 0..{config.vocab_size - 1} for this drafter (it was trained with a mask token; "
                f"{fixed})",
                None,
            )
    if hasattr(drafter, "markov_head"):
        from .heads import SEQUENTIAL_HEAD_CLASSES

        built = "none"
        if drafter.markov_head is not None:
            built = next(
                (n for n, c in SEQUENTIAL_HEAD_CLASSES.items() if type(drafter.markov_head) is c),
                config.sequential_head,  # a head class this version does not know: not checked
            )
        if config.sequential_head != built:
            raise _refuse("sequential_head", f"{built!r} for this drafter ({fixed})", config.sequential_head)
    if hasattr(drafter, "confidence_head"):
        head = drafter.confidence_head
        if config.confidence_head and head is None:
            raise _refuse("confidence_head", f"False for this drafter (it has no confidence head; {fixed})", True)
        proj = getattr(head, "proj", None)
        if config.confidence_head and proj is not None and drafter.markov_head is not None:
            reads_markov = proj.in_features > config.hidden_size
            if config.confidence_with_markov != reads_markov:
                raise _refuse(
                    "confidence_with_markov",
                    f"{reads_markov} for this drafter (its confidence head reads "
                    f"{'[h_k; W1[x_(k-1)]]' if reads_markov else 'h_k alone'}; {fixed})",
                    config.confidence_with_markov,
                )


__all__ = [
    "AUTO_TREE_BUDGET",
    "AUTO_TREE_CONTEXT",
    "AUTO_TREE_WIDTH_COST",
    "LONGEST_LOOKUP",
    "MAX_TREE_BUDGET",
    "SAMPLING_MODES",
    "VERIFY_POLICIES",
    "check_choice",
    "check_dspark_settings",
    "check_int",
    "check_sampling",
    "check_tree_budget",
    "check_weights_match",
    "largest_tree",
]
