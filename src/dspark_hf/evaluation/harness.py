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

Draft latency against block length: each drafter proposes exactly L drafts per round (`fixed_draft_length`) on one
prompt for every L, timed in real decoding rounds the same way for all: an autoregressive drafter pays one forward
per draft, a DSpark drafter one block pass plus its sequential head. Drafters without such a setting fall back to
the main run's rounds grouped by how many drafts they proposed.

Draft trees side by side with the chain: `tree_budgets` (`dspark-hf bench --tree-budget 0,8,16,32`) runs each
DSpark drafter once per budget (`config.tree_budget`, restored afterwards), labelled "LABEL chain" and "LABEL tree N".
"""

import contextlib
import functools
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging

from ..decoding.drafting import is_drafter
from ..decoding.stats import DraftRound, DSparkGenerationStats, record_draft_rounds
from ..kernels import verify_head, verify_linears
from ..kernels.packed_linear import inference_dtype
from ..utils.prompts import encode


logger = logging.get_logger(__name__)

PADDED = "padded plain"  # the mode label of the kernel-neutral baseline (plain steps through the verify kernels)
WARMUP_TOKENS = 256  # the warm-up decodes this much of the first prompt


def generation_kwargs(temperature: float) -> dict:
    """generate() settings for one temperature: greedy at 0, else pure sampling (no top-k / top-p truncation)."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}


def stats_from_rounds(rounds) -> DSparkGenerationStats:
    """Acceptance statistics of one generate() from its logged `DraftRound`s (assistants without generation_stats).

    A first round without drafts is the plain prefill, not a step; the last round is the one that stopped.
    """
    steps = [r for r in rounds if r.proposed or not r.first]
    stats = DSparkGenerationStats(block_size=max([r.proposed for r in steps], default=1))
    for i, r in enumerate(steps):
        stats.record_step(r.proposed, r.accepted or 0, stopped=i == len(steps) - 1)
    return stats


class RoundLog(list):
    """The `DraftRound`s of one generate(), and `prefill_seconds`: from the call to the first round's start (the
    prompt's prefill and setup), where this package's decoder logged verify timings, or to the first new token of a
    plain run (`FirstTokenClock`); else None."""

    prefill_seconds: float | None = None


class FirstTokenClock(BaseStreamer):
    """A streamer that notes when generate() hands over its first new token (`first`, `time.perf_counter()`): the
    end of a plain run's prefill. generate() puts the prompt first, then each new token."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _decode(target, ids, max_new_tokens, assistant, temperature, seed, padded=False):
    """One generate(): (new tokens (n,), seconds, acceptance stats or None for plain, logged rounds as a `RoundLog`);
    `padded`: plain decoding with the verify kernels' one-token steps (`verify_linears.measured_steps`, the linears
    the way measured on this machine, as a decode loop's plain round runs them)."""
    if temperature:
        torch.manual_seed(seed)
    if hasattr(assistant, "generation_stats"):
        assistant.generation_stats = None  # never read the previous call's
    steps = verify_linears.measured_steps(target) if padded else contextlib.nullcontext()
    clock = FirstTokenClock() if assistant is None else None  # a plain run's own prefill, for the decoding phase
    settings = generation_kwargs(temperature) | ({"streamer": clock} if clock is not None else {})
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


class _AssistantRounds(list):
    """`DraftRound`s, and the input length of each round's `generate()` call."""

    def __init__(self):
        super().__init__()
        self.input_lengths: list[int] = []


@contextlib.contextmanager
def observe_assistant(assistant):
    """Time the drafting rounds of one of transformers' own assistants (not this package's drafters): each round is
    one call of its public `generate()`, wrapped on the instance for the block and restored after. A round's
    acceptance is read from the next round's input length (the target commits the accepted drafts and one token)."""
    rounds = _AssistantRounds()
    if assistant is None or is_drafter(assistant) or not hasattr(assistant, "generate"):
        yield rounds
        return
    inner = assistant.generate

    def timed(*args, **kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        length = ids.shape[1]
        if rounds:
            rounds[-1].accepted = max(0, min(rounds[-1].proposed, length - rounds.input_lengths[-1] - 1))
        _sync(ids)
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        sequences = getattr(out, "sequences", out)
        _sync(sequences)
        rounds.append(DraftRound(start, time.perf_counter() - start, sequences.shape[1] - length, first=not rounds))
        rounds.input_lengths.append(length)
        return out

    assistant.generate = timed
    try:
        yield rounds
    finally:
        del assistant.generate


def _sync(tensor) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _pool(stats) -> DSparkGenerationStats:
    start = DSparkGenerationStats(block_size=max(s.block_size for s in stats))
    return functools.reduce(DSparkGenerationStats.merge, stats, start)


def _mismatch(index: int, plain: torch.Tensor, other: torch.Tensor) -> dict:
    n = min(plain.numel(), other.numel())
    differ = (plain[:n] != other[:n]).nonzero()
    first = int(differ[0]) if differ.numel() else n
    return {"index": index, "first_difference": first, "plain_new_tokens": plain.numel(), "new_tokens": other.numel()}


def _totals(decoded) -> tuple[int, float]:
    """(new tokens, seconds) summed over a list of `_decode` results."""
    return sum(d[0].numel() for d in decoded), sum(d[1] for d in decoded)


def _rate(tokens: int, seconds: float) -> float:
    """Tokens per second (0 when nothing was timed)."""
    return tokens / seconds if seconds else 0.0


def round_breakdown(round_lists) -> dict | None:
    """Where a round's time goes, mean ms per round over the logged rounds of this package's decoders: `draft` (the
    gate and the draft pass with its sampling), `verify` (the target's forward), `bookkeeping` (acceptance, commit,
    cache trimming) and `round` (all three), plus `rounds` counted and `drafted` (rounds that drafted). None when the
    rounds carry no verify timings (transformers' own assistants)."""
    rounds = [r for rs in round_lists for r in rs if r.verify_seconds is not None and r.end is not None]
    if not rounds:
        return None
    draft = statistics.fmean(1e3 * r.seconds for r in rounds)
    verify = statistics.fmean(1e3 * r.verify_seconds for r in rounds)
    whole = statistics.fmean(1e3 * (r.end - r.start) for r in rounds)
    return {
        "draft": draft,
        "verify": verify,
        "bookkeeping": whole - draft - verify,
        "round": whole,
        "rounds": len(rounds),
        "drafted": sum(1 for r in rounds if r.proposed),
    }


def _decode_phase(decoded, prefills) -> tuple[int, float]:
    """(tokens after the first, seconds after the prefill) summed over prompts: the decoding phase alone."""
    tokens = sum(max(d[0].numel() - 1, 0) for d in decoded)
    return tokens, sum(max(d[1] - p, 0.0) for d, p in zip(decoded, prefills))


def _run_entry(dataset, temperature, label, prompts, decoded, plain, padded=None) -> dict:
    """Everything measured for one dataset × temperature × drafter; `padded`: the kernel-neutral baseline's decodes."""
    stats = [s for _, _, s, _ in decoded]
    pooled = _pool(stats)
    tokens, seconds = _totals(decoded)
    draft_ms = [1e3 * r.seconds for d in decoded for r in d[3] if not r.first]
    per_prompt, mismatches = [], []
    for i, ((out, secs, s, rounds), ref, ids) in enumerate(zip(decoded, plain, prompts)):
        identical = None
        if temperature == 0:
            identical = torch.equal(out, ref[0])
            if not identical:
                mismatches.append(_mismatch(i, ref[0], out))
                logger.warning(
                    f"{dataset} prompt {i}: {label} output differs from plain greedy at new token "
                    f"{mismatches[-1]['first_difference']}. Please report this as a bug."
                )
        per_prompt.append(
            {
                "index": i,
                "prompt_tokens": ids.shape[1],
                "new_tokens": out.numel(),
                "seconds": secs,
                "seconds_plain": ref[1],
                "draft_seconds": sum(r.seconds for r in rounds),
                "acceptance_length": s.acceptance_length,
                "num_target_forwards": s.num_target_forwards,
                "lookup_rounds": s.lookup_rounds,
                "gated_rounds": s.gated_rounds,
                "fewer_threads_rounds": s.fewer_threads_rounds,
                "identical": identical,
            }
        )
    reached, accepted = pooled.position_counts()
    tps, plain_tps = _rate(tokens, seconds), _rate(*_totals(plain))
    padded_tps = _rate(*_totals(padded)) if padded else None
    return {
        "dataset": dataset,
        "temperature": temperature,
        "drafter": label,
        "num_prompts": len(decoded),
        "all_identical": None if temperature else not mismatches,
        "mismatches": mismatches,
        "acceptance_length": pooled.acceptance_length,
        "mean_prompt_acceptance_length": statistics.fmean(s.acceptance_length for s in stats),
        "per_position_acceptance": pooled.per_position_acceptance,
        "position_reached": reached,
        "position_accepted": accepted,
        "acceptance_length_by_draft_length": pooled.acceptance_length_by_draft_length,
        "mean_verify_length": pooled.mean_verify_length,
        "mean_accepted_depth": pooled.mean_accepted_depth,
        "num_target_forwards": pooled.num_target_forwards,
        "lookup_rounds": pooled.lookup_rounds,  # rounds that verified a lookup chain (`context_lookup`)
        "gated_rounds": pooled.gated_rounds,  # rounds the draft gate made plain
        "fewer_threads_rounds": pooled.fewer_threads_rounds,  # rounds at fewer threads (`kernels/threads.py`)
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tps,
        "tokens_per_second_plain": plain_tps,
        "speedup": tps / plain_tps if plain_tps else 0.0,
        "tokens_per_second_padded": padded_tps,
        # the kernel-neutral baseline: the faster of plain and plain with the measured kernels (`measured_steps`)
        "speedup_vs_padded": tps / max(padded_tps, plain_tps) if padded_tps else None,
        "draft_ms_per_round": statistics.fmean(draft_ms) if draft_ms else None,
        "draft_ms_per_round_median": statistics.median(draft_ms) if draft_ms else None,
        "draft_fraction": sum(draft_ms) / 1e3 / seconds if seconds else 0.0,
        "round_ms": round_breakdown(d[3] for d in decoded),
        **_decode_phase_entry(decoded, plain),
        "per_prompt": per_prompt,
    }


def _decode_phase_entry(decoded, plain) -> dict:
    """The decoding phase without the prompt's prefill, which costs the same with and without a drafter (long prompts
    spend most of a short generate() there): the plain step's mean ms and the speedup over plain decoding. Each run
    is charged its own prefill (`RoundLog.prefill_seconds`: to the drafted run's first round, to the plain run's first
    new token), so that the prefill's run-to-run spread (seconds at 8k tokens) stays out of the ratio; a plain run
    without one is charged the drafted run's. Empty where the drafted run's was not logged."""
    prefills = [d[3].prefill_seconds if isinstance(d[3], RoundLog) else None for d in decoded]
    if not prefills or None in prefills:
        return {}
    plain_prefills = [
        p[3].prefill_seconds if isinstance(p[3], RoundLog) and p[3].prefill_seconds is not None else own
        for p, own in zip(plain, prefills)
    ]
    plain_tokens, plain_seconds = _decode_phase(plain, plain_prefills)
    tokens, seconds = _decode_phase(decoded, prefills)
    plain_tps, tps = _rate(plain_tokens, plain_seconds), _rate(tokens, seconds)
    return {
        "prefill_seconds": statistics.fmean(prefills),
        "plain_prefill_seconds": statistics.fmean(plain_prefills),
        "plain_step_ms": 1e3 * plain_seconds / plain_tokens if plain_tokens else None,
        "decode_speedup": tps / plain_tps if plain_tps else None,
    }


def _baseline_entry(dataset, temperature, prompts, plain, padded=None) -> dict:
    """Plain decoding on one dataset × temperature, and the padded (kernel-neutral) baseline where it ran.

    `padded_identical` (T = 0): whether 2-row steps gave plain greedy's tokens; the products agree to float rounding,
    so a difference is possible in principle but makes only the timing less comparable, never a drafter's output.
    """
    per_prompt = [
        {"index": i, "prompt_tokens": ids.shape[1], "new_tokens": out.numel(), "seconds": secs}
        for i, ((out, secs, _, _), ids) in enumerate(zip(plain, prompts))
    ]
    padded_identical = None
    if padded:
        for row, (_, secs, _, _) in zip(per_prompt, padded):
            row["seconds_padded"] = secs
        if temperature == 0:
            padded_identical = all(torch.equal(p[0], q[0]) for p, q in zip(plain, padded))
    tokens, seconds = _totals(plain)
    return {
        "dataset": dataset,
        "temperature": temperature,
        "num_prompts": len(plain),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": _rate(tokens, seconds),
        "tokens_per_second_padded": _rate(*_totals(padded)) if padded else None,
        "padded_identical": padded_identical,
        "per_prompt": per_prompt,
    }


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


def measure_latency(target, ids, assistant, lengths, new_tokens=48, fallback_rounds=(), progress=True) -> dict:
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
            _, _, stats, rounds = _decode(target, ids, new_tokens, assistant, 0.0, 0)
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


def tree_variants(drafters: dict, budgets) -> tuple[dict, dict]:
    """({label: assistant}, {label: tree budget}) with every DSpark drafter once per budget ("LABEL chain", "LABEL tree
    N"); other assistants keep their label (budget None)."""
    if not budgets:
        return dict(drafters), dict.fromkeys(drafters)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in budgets):
        raise ValueError(f"Tree budgets must be ints >= 0 (0: the chain), got {list(budgets)}.")
    labelled, by_label = {}, {}
    for label, assistant in drafters.items():
        if not hasattr(getattr(assistant, "config", None), "tree_budget"):
            labelled[label], by_label[label] = assistant, None
            continue
        for b in budgets:
            name = f"{label} tree {b}" if b else f"{label} chain"
            labelled[name], by_label[name] = assistant, b
    return labelled, by_label


def describe_assistant(assistant) -> dict:
    config = assistant.config
    return {
        "model_type": getattr(config, "model_type", None),
        "name_or_path": getattr(assistant, "name_or_path", None) or None,
        "block_size": getattr(config, "block_size", None),
        "verify_policy": getattr(config, "verify_policy", None),
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
) -> dict:
    """Plain decoding vs every drafter on every dataset at every temperature, plus the draft-latency sweep.

    drafters: {label: assistant model}; datasets: {name: prompt records (see `utils.prompts.read_prompts`)};
    padded_baseline: also decode plainly with 2-row steps (see the module docstring); None: where the target's verifies
    use the few-rows products (`verify_head.version(target) > 0`). Returns a JSON-ready dict: `runs` (one entry per
    dataset × temperature × drafter, see `_run_entry`), `baselines` (plain decoding per dataset × temperature),
    `latency` ({label: `measure_latency`}), `padded_baseline` and `all_identical` (T = 0 runs). `tree_budgets`:
    each DSpark drafter once per budget (`tree_variants`); the latency sweep then covers the chains only.
    """
    if not drafters:
        raise ValueError("run_evaluation needs at least one drafter: {label: assistant model}.")
    drafters, budgets = tree_variants(drafters, tree_budgets)
    if not datasets or not all(datasets.values()):
        raise ValueError("run_evaluation needs at least one dataset, each with at least one prompt record.")
    temperatures = [float(t) for t in temperatures]
    if any(t < 0 for t in temperatures):
        raise ValueError(f"Temperatures must be >= 0 (0 = greedy), got {temperatures}.")
    if PADDED in drafters:
        raise ValueError(f"{PADDED!r} labels the padded plain baseline; give that drafter another label.")
    if padded_baseline is None:
        padded_baseline = verify_head.version(target) > 0
    encoded = {name: [encode(tokenizer, r) for r in records] for name, records in datasets.items()}
    first = next(iter(encoded.values()))[0]
    warm = first[:, :WARMUP_TOKENS]  # a long prompt's prefill would only cost time here
    for label, assistant in (None, None), *drafters.items():  # warm-up of every path
        with tree_budget(assistant, budgets.get(label)):
            timed_generate(target, warm, 4, assistant)
    modes = [None, *drafters]  # None: plain decoding
    if padded_baseline:
        _decode(target, warm, 4, None, 0.0, 0, padded=True)
        modes.insert(1, PADDED)
    runs, baselines, greedy_rounds = [], [], defaultdict(list)
    for name, prompts in encoded.items():
        for temperature in temperatures:
            decoded = {mode: [] for mode in modes}
            bar = tqdm(prompts, desc=f"{name} T={temperature:g}", disable=not progress)
            for i, ids in enumerate(bar):
                shift = i % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    assistant = drafters.get(mode)  # None for both plain modes
                    with tree_budget(assistant, budgets.get(mode)):
                        run = _decode(target, ids, max_new_tokens, assistant, temperature, seed + i, mode == PADDED)
                    decoded[mode].append(run)
                bar.set_postfix({label: f"τ {decoded[label][-1][2].acceptance_length:.2f}" for label in drafters})
            padded = decoded.get(PADDED)
            baselines.append(_baseline_entry(name, temperature, prompts, decoded[None], padded))
            for label in drafters:
                runs.append(_run_entry(name, temperature, label, prompts, decoded[label], decoded[None], padded))
                runs[-1]["tree_budget"] = budgets[label]
                if temperature == 0:
                    greedy_rounds[label] += [d[3] for d in decoded[label]]
    latency = {}
    if latency_lengths:
        for label, assistant in drafters.items():
            if budgets[label]:  # the sweep fixes the block length: a chain's measure
                continue
            latency[label] = measure_latency(
                target, first, assistant, latency_lengths, latency_new_tokens, greedy_rounds[label], progress
            )
    greedy = [r for r in runs if r["temperature"] == 0]
    return {
        "max_new_tokens": max_new_tokens,
        "temperatures": temperatures,
        "seed": seed,
        "device": str(target.device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
        "drafters": {label: describe_assistant(a) for label, a in drafters.items()},
        "datasets": {name: {"num_prompts": len(p)} for name, p in encoded.items()},
        "all_identical": all(r["all_identical"] for r in greedy) if greedy else None,
        "padded_baseline": bool(padded_baseline),
        "runs": runs,
        "baselines": baselines,
        "latency": latency,
    }


SUMMARY_COLUMNS = (
    "dataset",
    "drafter",
    "T",
    "prompts",
    "identical",
    "τ",
    "verify",
    "draft ms",
    "tok/s",
    "plain",
    "speedup",
    "vs padded",
)


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_evaluation(result: dict) -> str:
    """A text table per dataset × drafter × temperature, latency rows per drafter, and any mismatch."""
    rows = [SUMMARY_COLUMNS]
    for r in result["runs"]:
        n = r["num_prompts"]
        identical = "-" if r["all_identical"] is None else f"{n - len(r['mismatches'])}/{n}"
        rows.append(
            (
                r["dataset"],
                r["drafter"],
                f"{r['temperature']:g}",
                str(r["num_prompts"]),
                identical,
                _fmt(r["acceptance_length"]),
                _fmt(r["mean_verify_length"]),
                _fmt(r["draft_ms_per_round"], ".1f"),
                _fmt(r["tokens_per_second"], ".1f"),
                _fmt(r["tokens_per_second_plain"], ".1f"),
                f"{r['speedup']:.2f}x",
                "-" if r.get("speedup_vs_padded") is None else f"{r['speedup_vs_padded']:.2f}x",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for r in result["runs"]:
        rates = " ".join(_fmt(x) for x in r["per_position_acceptance"])
        lines.append(f"acceptance by position  {r['dataset']} / {r['drafter']} / T={r['temperature']:g}: {rates}")
    for b in result.get("baselines", []):
        if b.get("tokens_per_second_padded") is not None:
            same = "" if b["padded_identical"] is None else f", same tokens as plain: {b['padded_identical']}"
            rate = b["tokens_per_second_padded"]
            lines.append(
                f"padded plain (verify kernels, no drafts)  {b['dataset']} / T={b['temperature']:g}: {rate:.1f} tok/s "
                f"= {rate / b['tokens_per_second']:.2f}x of plain{same}"
            )
    for label, lat in result.get("latency", {}).items():
        cells = ", ".join(
            f"L={n}: {_fmt(d, '.1f')} ({_fmt(w, '.1f')})"
            for n, d, w in zip(lat["lengths"], lat["draft_ms"], lat["round_ms"])
        )
        lines.append(f"draft ms per round (whole round) by draft length, {label} [{lat['method']}]: {cells}")
    for r in result["runs"]:
        for m in r["mismatches"]:
            lines.append(
                f"MISMATCH {r['dataset']} / {r['drafter']} prompt {m['index']}: differs from plain greedy at new "
                f"token {m['first_difference']} ({m['new_tokens']} vs {m['plain_new_tokens']} tokens)"
            )
    return "\n".join(lines)


def model_card_results(result: dict, drafter: str | None = None, temperature: float = 0.0) -> dict:
    """{dataset: run} of one drafter at one temperature: the `results` argument of `hub.model_card`."""
    labels = list(result["drafters"])
    if drafter is None:
        if len(labels) != 1:
            raise ValueError(f"The result holds several drafters {labels}; pass drafter= one of them.")
        drafter = labels[0]
    runs = {r["dataset"]: r for r in result["runs"] if r["drafter"] == drafter and r["temperature"] == temperature}
    if not runs:
        raise ValueError(f"No run of drafter {drafter!r} at T={temperature:g}; drafters {labels}.")
    return runs


def parse_datasets(prompts=(), datasets: str | None = None) -> dict[str, Path]:
    """{name: JSONL path} from `--prompts FILE` (named by the file stem) and `--datasets name=path,...`."""
    named = {}
    for path in prompts or ():
        named[Path(path).stem] = Path(path)
    for item in (datasets or "").split(","):
        if not item.strip():
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--datasets takes name=path.jsonl pairs separated by commas, got {item!r}.")
        named[name.strip()] = Path(path.strip())
    for name, path in named.items():
        if not path.is_file():
            raise ValueError(f"Dataset {name!r}: no file at {path}.")
    return named


def parse_drafters(specs) -> dict[str, str]:
    """{label: path} from `--drafter [LABEL=]PATH` values; the label defaults to the folder's name."""
    named = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = Path(spec.rstrip("/")).name or spec, spec
        if label in named:
            raise ValueError(f"Two drafters labelled {label!r}: name them with --drafter LABEL=PATH.")
        named[label] = path
    return named


def load_assistant(path: str, dtype: torch.dtype | None = None):
    """A drafter or assistant model from a folder or Hub id: DSpark (ours or DeepSpec's), else any Auto model.

    `dtype` None: a DSpark drafter in `packed_linear.inference_dtype()` (bf16 on a CPU that computes it natively),
    any other assistant in float32."""
    from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ..integrations.deepspec import is_deepspec_config
    from ..models.modeling_dspark import DSparkDraftModel

    config = PretrainedConfig.get_config_dict(path)[0]
    if config.get("model_type") == "dspark" or is_deepspec_config(config):
        return DSparkDraftModel.from_pretrained(path, dtype=dtype or inference_dtype()).eval()
    auto = AutoModelForCausalLM if config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel
    return auto.from_pretrained(path, dtype=dtype or torch.float32).eval()


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


__all__ = [
    "round_breakdown",
    "run_bench",
    "fixed_draft_length",
    "tree_budget",
    "tree_variants",
    "format_evaluation",
    "generation_kwargs",
    "load_assistant",
    "measure_latency",
    "model_card_results",
    "parse_datasets",
    "parse_drafters",
    "run_evaluation",
    "stats_from_rounds",
]


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
