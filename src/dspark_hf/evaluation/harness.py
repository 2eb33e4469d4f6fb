"""Evaluation harness (`dspark-hf bench`): plain decoding against one or more drafters on benchmark prompt sets.

For every dataset × temperature, each prompt is decoded plainly and with every drafter, in an order that rotates
per prompt so that drifting machine load hits all alike; speed is a ratio measured in the same run. Any assistant
that goes through `generate(assistant_model=...)` works: acceptance comes from `assistant.generation_stats` when it
fills one (this package's drafters do), else from the rounds logged while it runs: `stats.record_draft_rounds` for
this package's decoders, the timed `generate()` calls of one of transformers' own assistants (`observe_assistant`).
At T = 0 every output must equal plain greedy's, token for token; at T > 0 (sampling with a fixed seed per prompt)
losslessness is distributional, so only speed and acceptance are reported.

The kernel-neutral baseline: on a CPU where the verify kernels run a step faster than transformers' own linears (see
`verify_linears`), part of any speedup over plain decoding is the kernel, not speculation. Where the target's verifies
can use them, each prompt is also decoded plainly with every one-token step through the kernels measured for this
machine (`verify_linears.measured_steps`: what a gated plain round costs; the JSON keys keep their old name,
"padded"), and every run reports `speedup_vs_padded` beside `speedup`: what speculation itself buys. The baseline is
the faster of the two. Its steps run transformers' own forward; a round's skips the per-layer wrappers
(`kernels.lean_forward`), a saving the baseline does not get.

The compiled baseline (`compiled_baseline=True`, `dspark-hf bench --compiled-baseline`): each prompt is also decoded
plainly by transformers' own compiled decoding, a static cache sized for the prompt (its length plus
`max_new_tokens`, rounded up to a power of two from 256: a short prompt does not attend over a long prompt's slots)
and the decoding step compiled by inductor (`dynamic=False`), as a user who compiles would run it; every run then
reports `speedup_vs_compiled`. Each cache size compiles once, in the warm-up (about a minute for SmolLM2-135M on 2
CPU cores; inductor keeps its kernels on disk for the next process).

Draft latency against block length: each drafter proposes exactly L drafts per round (`fixed_draft_length`) on one
prompt for every L, timed in real decoding rounds the same way for all: an autoregressive drafter pays one forward
per draft, a DSpark drafter one block pass plus its sequential head. Drafters without such a setting fall back to
the main run's rounds grouped by how many drafts they proposed.

Draft trees side by side with the chain: `tree_budgets` (`dspark-hf bench --tree-budget 0,8,16,32`) runs each
DSpark drafter once per budget (`config.tree_budget`, restored afterwards), labelled "LABEL chain" and "LABEL tree N".

The pieces: the logged rounds (`rounds.py`), the entries and table of a result (`report.py`), the command's datasets
and assistants (`inputs.py`); this module runs the decodes.
"""

import contextlib
import inspect
import statistics
import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from ..decoding.gate import GateMemory
from ..decoding.stats import record_draft_rounds
from ..kernels import verify_head, verify_linears
from ..kernels.runtime import runtime_for
from ..models.settings import check_tree_budget
from ..serving.engine import Engine
from ..utils.prompts import encode
from .inputs import load_assistant, parse_datasets, parse_drafters
from .report import BASELINES, _baseline_entry, _run_entry, format_evaluation, model_card_results
from .report import _decode_phase_entry as _decode_phase_entry
from .rounds import FirstTokenClock, RoundLog, observe_assistant, round_breakdown, stats_from_rounds


PADDED = "padded plain"  # the mode label of the kernel-neutral baseline (plain steps through the verify kernels)
COMPILED = "compiled plain"  # the mode label of transformers' compiled static-cache plain decoding
OWN = "own plain"  # the mode label of this package's plain decoding (its decode round with no drafter)
# the extra plain baselines: mode label -> the name its JSON fields carry (`report.BASELINES`, in its order)
EXTRA_BASELINES = dict(zip((PADDED, COMPILED, OWN), BASELINES))
WARMUP_TOKENS = 256  # the warm-up decodes this much of the first prompt

logger = logging.get_logger(__name__)


def generation_kwargs(temperature: float) -> dict:
    """generate() settings for one temperature: greedy at 0, else pure sampling (no top-k / top-p truncation)."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}


def _policy(assistant, verify_policy: str | None) -> dict:
    """`generate()`'s `verify_policy=` for a DSpark drafter (None: its own config's); nothing for other assistants."""
    if verify_policy is None or not hasattr(getattr(assistant, "config", None), "verify_policy"):
        return {}
    return {"verify_policy": verify_policy}


def _decode(
    target, ids, max_new_tokens, assistant, temperature, seed, verify_policy=None, baseline=None, compiled=None
):
    """One generate(): (new tokens (n,), seconds, acceptance stats or None for plain, logged rounds as a `RoundLog`).
    `baseline` decodes plainly as one of the extra baselines, by name (`EXTRA_BASELINES`): "padded" with the verify
    kernels' one-token steps (`verify_linears.measured_steps`, the linears the way measured on this machine, as a
    decode loop's plain round runs them); "compiled" by transformers' compiled static-cache decoding with the settings
    `compiled` (`compiled_settings`; its cache is reset); "own" by this package's plain decoding (`_own_decode`)."""
    if temperature:
        torch.manual_seed(seed)
    if baseline == "own":
        return _own_decode(target, ids, max_new_tokens, temperature, seed)
    if hasattr(assistant, "generation_stats"):
        assistant.generation_stats = None  # never read the previous call's
    steps = verify_linears.measured_steps(target) if baseline == "padded" else contextlib.nullcontext()
    clock = FirstTokenClock() if assistant is None else None  # a plain run's own prefill, for the decoding phase
    settings = generation_kwargs(temperature) | ({"streamer": clock} if clock is not None else {})
    settings |= _policy(assistant, verify_policy)
    if baseline == "compiled":
        cache = compiled["cache"] if "cache" in compiled else compiled["past_key_values"]  # (`compiled_settings`)
        cache.reset()  # the run's one static cache, emptied
        settings |= compiled
    with record_draft_rounds() as rounds, observe_assistant(assistant) as own, steps:
        called = time.perf_counter()
        out, seconds = timed_generate(target, ids, max_new_tokens, assistant, **settings)
    if own:  # one of transformers' assistants: its last round's acceptance shows only in the output's length
        own[-1].accepted = max(0, min(own[-1].proposed, ids.shape[1] + out.numel() - own.input_lengths[-1] - 1))
        rounds = own
    stats = None
    if assistant is not None:
        stats = getattr(assistant, "generation_stats", None)
        stats = stats_from_rounds(rounds) if stats is None else stats
        stats.num_prompt_tokens, stats.num_new_tokens = ids.shape[1], out.numel()
    log = RoundLog(rounds)
    if log and log[0].verify_seconds is not None:
        log.prefill_seconds = log[0].start - called
    elif clock is not None and clock.first is not None:
        log.prefill_seconds = clock.first - called
    return out.cpu(), seconds, stats, log


def _own_decode(target, ids, max_new_tokens, temperature, seed):
    """Plain decoding through this package's decode round: an `Engine` without a drafter, so every round is one token
    through the round's forward (`kernels.lean_forward`), its cache and its measured kernels, as the drafter's rounds
    run. What a speculative run gains over this is what speculation itself buys. A sampled row draws with its seed
    (the package's noise), not transformers' sampler: compare its speed only. `_decode`'s tuple, with no stats."""
    engine = Engine(target, max_batch_size=1)
    sampling = {} if not temperature else {"do_sample": True, "temperature": float(temperature), "seed": seed}
    start = time.perf_counter()
    (out,) = engine.generate([ids[0]], max_new_tokens=max_new_tokens, **sampling)
    seconds = time.perf_counter() - start
    return torch.tensor(out, dtype=torch.long), seconds, None, RoundLog([])


def compiled_settings(target, slots: int) -> dict:
    """generate() settings for transformers' compiled plain decoding, made once a run: a `StaticCache` of `slots`
    slots (one size for every prompt, reset before each call) and a compile config that holds on the CPU too. The
    same cache and config every call: transformers compiles again for another config object, and dynamo for another
    cache."""
    from transformers import StaticCache

    from ..utils.compat import compile_everywhere

    forward = inspect.signature(target.forward).parameters
    cache_arg = "cache" if "cache" in forward else "past_key_values"  # transformers 5.24 renamed it
    cache = StaticCache(config=target.config, max_cache_len=slots)
    return {cache_arg: cache, "compile_config": compile_everywhere(dynamic=False, fullgraph=True)}


def compiled_slots(ids, max_new_tokens: int, smallest: int = 256) -> int:
    """The static cache's size for a prompt: its length plus `max_new_tokens`, rounded up to a power of two, at least
    `smallest` (few sizes, so few compiles)."""
    slots = smallest
    while slots < ids.shape[1] + max_new_tokens:
        slots *= 2
    return slots


@contextlib.contextmanager
def fixed_draft_length(assistant, length: int):
    """Make `assistant` propose exactly `length` drafts per round; yields False when it has no such setting.

    This package's drafters (they fill `generation_stats` and have `config.block_size`): block size `length` and the
    "fixed" verify policy; transformers' assistant models: `num_assistant_tokens = length` on a constant schedule
    with no confidence cut. Everything is restored afterwards.
    """
    config = getattr(assistant, "config", None)
    if hasattr(assistant, "generation_stats") and hasattr(config, "block_size"):
        holder, changes = config, {"block_size": length}
        if hasattr(config, "verify_policy"):
            changes["verify_policy"] = "fixed"
        if getattr(config, "sts_temperatures", None) is not None:  # one per position
            changes["sts_temperatures"] = (list(config.sts_temperatures) + [1.0] * length)[:length]
        if getattr(config, "tree_calibration", None):  # one per depth: the deepest one's maps for the new depths
            fit = list(config.tree_calibration)
            changes["tree_calibration"] = (fit + [fit[-1]] * length)[:length]
    elif getattr(assistant, "generation_config", None) is not None:
        holder = assistant.generation_config
        changes = {
            "num_assistant_tokens": length,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        }
    else:
        yield False
        return
    saved = {key: getattr(holder, key) for key in changes}
    for key, value in changes.items():
        setattr(holder, key, value)
    try:
        yield True
    finally:
        for key, value in saved.items():
            setattr(holder, key, value)


def _latency_by_length(round_lists) -> dict[int, tuple[list[float], list[float]]]:
    """{drafts proposed: (drafting ms, whole-round ms)} over drafting rounds; a round lasts until the next begins."""
    by_length = defaultdict(lambda: ([], []))
    for rounds in round_lists:
        for r, following in zip(rounds, [*rounds[1:], None]):
            if r.first or not r.proposed:
                continue
            draft, whole = by_length[r.proposed]
            draft.append(1e3 * r.seconds)
            if following is not None:
                whole.append(1e3 * (following.start - r.start))
    return by_length


def measure_latency(
    target, ids, assistant, lengths, new_tokens=48, fallback_rounds=(), progress=True, verify_policy=None
) -> dict:
    """Median drafting and whole-round latency (ms) per round against the draft length L, greedy on prompt `ids`.

    Returns parallel lists `lengths`, `draft_ms`, `round_ms`, `rounds` (rounds measured) and `acceptance_length`
    (τ of that run; None for the fallback), plus `method`: "fixed_draft_length", or "per_round" when the assistant
    has no draft-length setting and `fallback_rounds` (lists of `DraftRound`s of the main run) are grouped instead.
    """
    rows = {}
    for length in tqdm(list(lengths), desc="draft latency", disable=not progress, leave=False):
        with fixed_draft_length(assistant, length) as supported:
            if not supported:
                break
            _, _, stats, rounds = _decode(target, ids, new_tokens, assistant, 0.0, 0, verify_policy=verify_policy)
        draft, whole = _latency_by_length([rounds]).get(length, ([], []))
        rows[length] = (draft, whole, stats.acceptance_length)
    method = "fixed_draft_length" if rows or not lengths else "per_round"
    if method == "per_round":
        rows = {n: (d, w, None) for n, (d, w) in sorted(_latency_by_length(fallback_rounds).items())}
    return {
        "method": method,
        "new_tokens": new_tokens,
        "lengths": list(rows),
        "draft_ms": [statistics.median(d) if d else None for d, _, _ in rows.values()],
        "round_ms": [statistics.median(w) if w else None for _, w, _ in rows.values()],
        "rounds": [len(d) for d, _, _ in rows.values()],
        "acceptance_length": [tau for _, _, tau in rows.values()],
    }


@contextlib.contextmanager
def tree_budget(assistant, budget: int | None):
    """`assistant.config.tree_budget = budget` within the block (None: unchanged), restored afterwards."""
    config = getattr(assistant, "config", None)
    if budget is None or config is None:
        yield
        return
    if not hasattr(config, "tree_budget"):
        raise ValueError(f"{type(assistant).__name__} drafts no trees (its config has no `tree_budget`).")
    before = config.tree_budget
    config.tree_budget = budget
    try:
        yield
    finally:
        config.tree_budget = before


@contextlib.contextmanager
def gate_memory(target, assistant, memory):
    """Within the block the draft gate of `assistant` on `target` carries `memory` (a `gate.GateMemory`; None:
    unchanged), and the one it carried before is restored after. Each way of a run keeps its own: the tree-budget
    variants of one drafter are one object, and one variant's measurements (a tree's dearer draft pass, a gate left
    shut) would otherwise steer another's gate, as a first sampling study found (docs/results.md)."""
    if memory is None or assistant is None:
        yield
        return
    gates = runtime_for(target).gates
    before = gates.get(assistant)
    gates[assistant] = memory
    try:
        yield
    finally:
        if before is None:
            gates.pop(assistant, None)
        else:
            gates[assistant] = before


def tree_variants(drafters: dict, budgets) -> tuple[dict, dict]:
    """({label: assistant}, {label: tree budget}) with every DSpark drafter once per budget ("LABEL chain", "LABEL tree
    N", "LABEL tree auto"); other assistants keep their label (budget None)."""
    if not budgets:
        return dict(drafters), dict.fromkeys(drafters)
    for budget in budgets:
        check_tree_budget(budget)
    labelled, by_label = {}, {}
    for label, assistant in drafters.items():
        if not hasattr(getattr(assistant, "config", None), "tree_budget"):
            labelled[label], by_label[label] = assistant, None
            continue
        for b in budgets:
            name = f"{label} tree {b}" if b else f"{label} chain"
            labelled[name], by_label[name] = assistant, b
    return labelled, by_label


def describe_assistant(assistant, verify_policy: str | None = None) -> dict:
    """What a result says of an assistant; `verify_policy`: the one the run passed to `generate()`, if any."""
    config = assistant.config
    return {
        "model_type": getattr(config, "model_type", None),
        "name_or_path": getattr(assistant, "name_or_path", None) or None,
        "block_size": getattr(config, "block_size", None),
        "verify_policy": _policy(assistant, verify_policy).get(
            "verify_policy", getattr(config, "verify_policy", None)
        ),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "num_parameters": sum(p.numel() for p in assistant.parameters()),
        "dtype": str(assistant.dtype).replace("torch.", ""),
        "untrained": bool(getattr(assistant, "is_untrained", False)),
    }


def run_evaluation(
    target,
    tokenizer,
    drafters: dict,
    datasets: dict[str, list[dict]],
    max_new_tokens: int = 128,
    temperatures=(0.0,),
    seed: int = 0,
    latency_lengths=(),
    latency_new_tokens: int = 48,
    progress: bool = True,
    padded_baseline: bool | None = None,
    tree_budgets=(),
    verify_policy: str | None = None,
    compiled_baseline: bool = False,
    own_baseline: bool = False,
) -> dict:
    """Plain decoding vs every drafter on every dataset at every temperature, plus the draft-latency sweep.

    drafters: {label: assistant model}; datasets: {name: prompt records (see `utils.prompts.read_prompts`)};
    padded_baseline: also decode plainly with 2-row steps (see the module docstring); None: where the target's verifies
    use the few-rows products (`verify_head.version(target) > 0`). Returns a JSON-ready dict: `runs` (one entry per
    dataset × temperature × drafter, see `_run_entry`), `baselines` (plain decoding per dataset × temperature),
    `latency` ({label: `measure_latency`}), `padded_baseline` and `all_identical` (T = 0 runs). `tree_budgets`:
    each DSpark drafter once per budget (`tree_variants`); the latency sweep then covers the chains only.
    `verify_policy`: passed to every DSpark drafter's `generate()` (None: each drafter's own). `compiled_baseline`:
    also decode plainly by transformers' compiled static-cache decoding (see the module docstring). `own_baseline`:
    also decode plainly through this package's own decode round (`_own_decode`; `speedup_vs_own`).
    """
    if not drafters:
        raise ValueError("run_evaluation needs at least one drafter: {label: assistant model}.")
    drafters, budgets = tree_variants(drafters, tree_budgets)
    if not datasets or not all(datasets.values()):
        raise ValueError("run_evaluation needs at least one dataset, each with at least one prompt record.")
    temperatures = [float(t) for t in temperatures]
    if any(t < 0 for t in temperatures):
        raise ValueError(f"Temperatures must be >= 0 (0 = greedy), got {temperatures}.")
    for baseline in EXTRA_BASELINES:
        if baseline in drafters:
            raise ValueError(f"{baseline!r} labels a plain baseline; give that drafter another label.")
    if padded_baseline is None:
        padded_baseline = verify_head.version(target) > 0
    wanted = {"padded": padded_baseline, "compiled": compiled_baseline, "own": own_baseline}
    encoded = {name: [encode(tokenizer, r) for r in records] for name, records in datasets.items()}
    first = next(iter(encoded.values()))[0]
    warm = first[:, :WARMUP_TOKENS]  # a long prompt's prefill would only cost time here
    for label, assistant in (None, None), *drafters.items():  # warm-up of every path (its gate memory kept by none)
        with tree_budget(assistant, budgets.get(label)), gate_memory(target, assistant, GateMemory()):
            timed_generate(target, warm, 4, assistant, **_policy(assistant, verify_policy))
    if wanted["padded"]:
        _decode(target, warm, 4, None, 0.0, 0, baseline="padded")
    compiled_plain = {}  # static cache size -> the settings of transformers' compiled decoding with a cache that size
    if wanted["compiled"]:
        sizes = sorted({compiled_slots(ids, max_new_tokens) for prompts in encoded.values() for ids in prompts})
        logger.info(f"Compiling transformers' static-cache plain decoding for caches of {sizes} slots ...")
        start = time.perf_counter()
        for size in sizes:
            compiled_plain[size] = compiled_settings(target, size)
            _decode(target, warm[:, : size - 4], 4, None, 0.0, 0, baseline="compiled", compiled=compiled_plain[size])
        logger.info(f"... compiled in {time.perf_counter() - start:.0f} s")
    if wanted["own"]:
        _decode(target, warm, 4, None, 0.0, 0, baseline="own")
    extra = [label for label, name in EXTRA_BASELINES.items() if wanted[name]]
    modes = [None, *extra[::-1], *drafters]  # None: plain decoding; the extra baselines in the order they always had
    runs, baselines, greedy_rounds = [], [], defaultdict(list)
    memories = {label: GateMemory() for label in drafters}  # each way its own gate memory (`gate_memory`)
    for name, prompts in encoded.items():
        for temperature in temperatures:
            decoded = {mode: [] for mode in modes}
            bar = tqdm(prompts, desc=f"{name} T={temperature:g}", disable=not progress)
            for i, ids in enumerate(bar):
                shift = i % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    assistant = drafters.get(mode)  # None for the plain modes
                    baseline = EXTRA_BASELINES.get(mode)
                    compiled = compiled_plain[compiled_slots(ids, max_new_tokens)] if mode == COMPILED else None
                    with tree_budget(assistant, budgets.get(mode)), gate_memory(target, assistant, memories.get(mode)):
                        run = _decode(
                            target, ids, max_new_tokens, assistant, temperature, seed + i, verify_policy,
                            baseline=baseline, compiled=compiled,
                        )  # fmt: skip
                    decoded[mode].append(run)
                bar.set_postfix({label: f"τ {decoded[label][-1][2].acceptance_length:.2f}" for label in drafters})
            extras = {EXTRA_BASELINES[label]: decoded[label] for label in extra}
            baselines.append(_baseline_entry(name, temperature, prompts, decoded[None], extras))
            for label in drafters:
                runs.append(_run_entry(name, temperature, label, prompts, decoded[label], decoded[None], extras))
                runs[-1]["tree_budget"] = budgets[label]
                if temperature == 0:
                    greedy_rounds[label] += [d[3] for d in decoded[label]]
    latency = {}
    if latency_lengths:
        for label, assistant in drafters.items():
            if budgets[label]:  # the sweep fixes the block length: a chain's measure
                continue
            latency[label] = measure_latency(
                target,
                first,
                assistant,
                latency_lengths,
                latency_new_tokens,
                greedy_rounds[label],
                progress,
                verify_policy,
            )
    greedy = [r for r in runs if r["temperature"] == 0]
    return {
        "max_new_tokens": max_new_tokens,
        "temperatures": temperatures,
        "seed": seed,
        "device": str(target.device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
        "drafters": {label: describe_assistant(a, verify_policy) for label, a in drafters.items()},
        "datasets": {name: {"num_prompts": len(p)} for name, p in encoded.items()},
        "all_identical": all(r["all_identical"] for r in greedy) if greedy else None,
        "padded_baseline": bool(padded_baseline),
        "compiled_baseline": bool(compiled_baseline),
        "own_baseline": bool(own_baseline),
        "runs": runs,
        "baselines": baselines,
        "latency": latency,
    }


def run_bench(target, tokenizer, drafter, records, max_new_tokens=128, progress=True) -> dict:
    """Plain vs `drafter` greedy on `records`: the harness's run entry (see `evaluation.harness.run_evaluation`) plus
    `tokens_per_second_dspark`, `block_size` and `verify_policy`."""
    result = run_evaluation(
        target, tokenizer, {"dspark": drafter}, {"prompts": records}, max_new_tokens, progress=progress
    )
    run = result["runs"][0]
    return {
        **run,
        "max_new_tokens": max_new_tokens,
        "tokens_per_second_dspark": run["tokens_per_second"],
        "block_size": drafter.config.block_size,
        "verify_policy": getattr(drafter.config, "verify_policy", None),
    }


@torch.no_grad()
def timed_generate(target, input_ids, max_new_tokens, drafter=None, **generate_kwargs):
    """generate() on `input_ids` (1, L), greedy unless `generate_kwargs` say otherwise: (new tokens (n,), seconds)."""
    input_ids = input_ids.to(target.device)
    settings = {"do_sample": False, **generate_kwargs}
    start = time.perf_counter()
    out = target.generate(
        input_ids,
        max_new_tokens=max_new_tokens,
        assistant_model=drafter,
        attention_mask=torch.ones_like(input_ids),
        **settings,
    )
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out[0, input_ids.shape[1] :], time.perf_counter() - start


__all__ = [
    "FirstTokenClock",
    "COMPILED",
    "PADDED",
    "RoundLog",
    "describe_assistant",
    "fixed_draft_length",
    "format_evaluation",
    "generation_kwargs",
    "load_assistant",
    "measure_latency",
    "model_card_results",
    "observe_assistant",
    "parse_datasets",
    "parse_drafters",
    "round_breakdown",
    "run_bench",
    "run_evaluation",
    "stats_from_rounds",
    "timed_generate",
    "tree_budget",
    "tree_variants",
]
