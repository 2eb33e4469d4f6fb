"""Long-context prompt sets (`dspark-hf bench --long-context 256,1k,2k,4k,8k`), built by code from CPython.

Each prompt is a document pasted before a question, the way people use chat models: the plain-text documentation
(`pydoc`) or the source of a module of the Python standard library, as shipped with the interpreter that runs this
code (the PSF licence allows it; nothing is downloaded or stored in the repository), cut at a line break so that the
chat-formatted prompt holds about the requested number of tokens, then a fixed question about it. Prompt i of every
length reads the same document (a longer prefix at a longer length), so lengths differ by context only.

The sets are reproducible for a given Python version and tokenizer (`SOURCES` names the modules; the record's
`source` field says which); `python -m dspark_hf.evaluation.long_context --lengths 256,1k --out DIR` writes them as
JSONL for other tools. They are not the evaluation sets of `docs/evaluation.md`.
"""

import importlib
import inspect
import pydoc
import sys

from .plots import context_rows, plot_long_context


# (kind, module): documentation and source code alternate, so any two prompts cover both; each is long enough
# (with SmolLM2's tokenizer) to fill an 8k-token prompt. The second eight came later (2026-12-06): `--limit 8`
# reads the first eight, as every earlier result did.
SOURCES = (
    ("docs", "logging"),
    ("code", "argparse"),
    ("docs", "pathlib"),
    ("code", "subprocess"),
    ("docs", "difflib"),
    ("code", "shutil"),
    ("docs", "threading"),
    ("code", "statistics"),
    ("docs", "collections"),
    ("code", "tarfile"),
    ("docs", "typing"),
    ("code", "zipfile"),
    ("docs", "unittest"),
    ("code", "configparser"),
    ("docs", "socket"),
    ("code", "dataclasses"),
)
QUESTIONS = {
    "docs": "Using the documentation above, explain in a few sentences what this module is for, and name two of its "
    "functions or classes with what each does.",
    "code": "Explain what the code above does, then list its main functions or classes with one sentence each.",
}
INTROS = {
    "docs": "Here is the documentation of a Python module:\n\n",
    "code": "Here is a Python source file:\n\n```python\n",
}
OUTROS = {"docs": "\n\n", "code": "\n```\n\n"}


def parse_context_lengths(text: str) -> list[int]:
    """ "256,1k,2k,4k,8k" -> [256, 1024, 2048, 4096, 8192] (k = 1024); raises ValueError naming a bad item."""
    lengths = []
    for item in (x.strip().lower() for x in str(text).split(",")):
        if not item:
            continue
        scale = 1024 if item.endswith("k") else 1
        try:
            value = float(item[:-1] if scale > 1 else item) * scale
        except ValueError:
            raise ValueError(f"Context length {item!r} must be a number of tokens such as 256, 1k or 8k.") from None
        if value < 64 or value != int(value):
            raise ValueError(f"Context length {item!r} must be a whole number of tokens, at least 64.")
        lengths.append(int(value))
    if not lengths:
        raise ValueError(f"No context lengths in {text!r}; give e.g. 256,1k,2k,4k,8k.")
    return lengths


def length_label(length: int) -> str:
    """8192 -> "8k", 1536 -> "1536", 256 -> "256"."""
    return f"{length // 1024}k" if length >= 1024 and length % 1024 == 0 else str(length)


def document(kind: str, module: str) -> str:
    """The text of one source: `pydoc`'s plain-text help of the module (the file path line dropped, it names this
    machine) or its source code."""
    mod = importlib.import_module(module)
    if kind == "code":
        return inspect.getsource(mod)
    text = pydoc.render_doc(mod, renderer=pydoc.plaintext)
    path = getattr(mod, "__file__", None) or "\0"
    return "\n".join(line for line in text.splitlines() if path not in line)


def _record(kind: str, text: str) -> dict:
    content = INTROS[kind] + text + OUTROS[kind] + "Question: " + QUESTIONS[kind]
    return {"messages": [{"role": "user", "content": content}]}


def _prompt_length(tokenizer, record: dict) -> int:
    from ..utils.prompts import encode

    return encode(tokenizer, record).shape[1]


def long_context_prompt(tokenizer, length: int, index: int = 0) -> dict:
    """Prompt `index` (cycling through `SOURCES`) at about `length` tokens, chat template included.

    The document is cut at the last line break that keeps the prompt within `length`; the record also holds
    `source` ("docs:logging", ...), `context_length` (what was asked) and `prompt_tokens` (what it is).
    """
    kind, module = SOURCES[index % len(SOURCES)]
    text = document(kind, module)
    overhead = _prompt_length(tokenizer, _record(kind, ""))
    budget = length - overhead
    if budget < 16:
        raise ValueError(f"A {length}-token prompt leaves no room for a document ({overhead} tokens of frame).")
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]

    def cut_at(chars: int) -> tuple[dict, int]:
        record = _record(kind, text[:chars])
        return record, _prompt_length(tokenizer, record)

    n = min(budget, len(offsets))
    cut = len(text) if n == len(offsets) else offsets[n][0]
    line = text.rfind("\n", 0, cut) if cut < len(text) else cut
    record, tokens = cut_at(line if line > 0 else cut)
    if tokens < 0.9 * length and line < cut:  # one very long last line: cut inside it instead
        record, tokens = cut_at(cut)
        line = cut
    chars = line if line > 0 else cut
    while tokens > length and n > 0:  # tokens merged across the cut: drop the excess and retry
        n = max(n - (tokens - length), 0)
        chars = min(chars, offsets[n][0])
        record, tokens = cut_at(chars)
    record.update(source=f"{kind}:{module}", context_length=length, prompt_tokens=tokens)
    return record


def long_context_sets(tokenizer, lengths, num_prompts: int = 2, max_prompt_tokens: int | None = None) -> dict:
    """{"ctx-256": [records], "ctx-1k": [...], ...}: `num_prompts` prompts per length.

    `max_prompt_tokens` caps every length (the target's context minus the tokens to generate, so that an "8k" set
    fits an 8k-context model); a capped set keeps its label and records the real length in `prompt_tokens`.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}.")
    sets = {}
    for length in lengths:
        size = length if max_prompt_tokens is None else min(length, max_prompt_tokens)
        sets[f"ctx-{length_label(length)}"] = [long_context_prompt(tokenizer, size, i) for i in range(num_prompts)]
    return sets


def format_long_context(result: dict) -> str:
    """The per-length table of `dspark-hf bench --long-context`: τ (of all rounds and of the rounds that drafted),
    τ relative to the shortest length, acceptance at position 1, speed against plain (whole generate() and the
    decoding phase without the prefill), and a round's ms split into draft, verify and bookkeeping beside one plain
    step. Brackets hold 95 % bootstrap intervals over the prompts (`statistics`)."""

    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    def interval(ci, spec=".2f"):
        return "" if ci is None else f" [{ci[0]:{spec}}–{ci[1]:{spec}}]"

    header = ("length", "drafter", "tokens", "identical", "τ", "τ / shortest", "τ drafted", "acc@1", "plain tok/s",
              "speedup", "decode", "draft ms", "verify ms", "other ms", "round ms", "drafted", "plain step ms",
              "verify/plain")  # fmt: skip
    lines = [header]
    for r in context_rows(result):
        lines.append(
            (
                r["dataset"][4:],
                r["drafter"],
                f"{r['prompt_tokens']:.0f}",
                str(r["identical"]),
                fmt(r["tau"]),
                fmt(r["tau_rel"]) + interval(r["tau_rel_ci"]),
                fmt(r["tau_drafted"]),
                fmt(r["acceptance_1"]),
                fmt(r["plain_tps"], ".1f"),
                fmt(r["speedup"]) + "x" + interval(r["speedup_ci"]),
                fmt(r["decode_speedup"]) + "x",
                fmt(r["draft_ms"], ".1f"),
                fmt(r["verify_ms"], ".1f"),
                fmt(r["bookkeeping_ms"], ".1f"),
                fmt(r["round_ms"], ".1f"),
                r["drafted_rounds"],
                fmt(r["plain_step_ms"], ".1f"),
                fmt(r["verify_vs_plain"]),
            )  # fmt: skip
        )
    widths = [max(len(row[c]) for row in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines)


def _pooled(runs: list[dict]) -> dict:
    """One run entry from runs of the same dataset × drafter × temperature measured in separate chunks (e.g. one
    8k prompt per command): counts and seconds summed, rates recomputed from them."""
    if len(runs) == 1:
        return runs[0]
    first, prompts = runs[0], [p for r in runs for p in r["per_prompt"]]
    reached = [sum(c) for c in zip(*(r["position_reached"] for r in runs))]
    accepted = [sum(c) for c in zip(*(r["position_accepted"] for r in runs))]
    forwards = sum(p["num_target_forwards"] for p in prompts)
    tokens, seconds = sum(p["new_tokens"] for p in prompts), sum(p["seconds"] for p in prompts)
    plain_seconds = sum(p["seconds_plain"] for p in prompts)
    merged = {
        **first,
        "num_prompts": len(prompts),
        "all_identical": None if first["all_identical"] is None else all(r["all_identical"] for r in runs),
        "mismatches": [m for r in runs for m in r["mismatches"]],
        "acceptance_length": sum(p["acceptance_length"] * p["num_target_forwards"] for p in prompts) / forwards,
        "per_position_acceptance": [a / n if n else None for a, n in zip(accepted, reached)],
        "position_reached": reached,
        "position_accepted": accepted,
        "num_target_forwards": forwards,
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "tokens_per_second_plain": tokens / plain_seconds,
        "speedup": plain_seconds / seconds,
        "per_prompt": prompts,
    }
    splits = [r["round_ms"] for r in runs if r.get("round_ms")]
    if len(splits) == len(runs):
        count = sum(s["rounds"] for s in splits)
        merged["round_ms"] = {
            key: sum(s[key] * s["rounds"] for s in splits) / count
            for key in ("draft", "verify", "bookkeeping", "round")
        } | {"rounds": count, "drafted": sum(s["drafted"] for s in splits)}
    if all(r.get("prefill_seconds") is not None for r in runs):
        prefill = sum(r["prefill_seconds"] * r["num_prompts"] for r in runs)
        plain_prefill = sum(r.get("plain_prefill_seconds", r["prefill_seconds"]) * r["num_prompts"] for r in runs)
        decode_tokens = tokens - len(prompts)
        merged["prefill_seconds"] = prefill / len(prompts)
        merged["plain_prefill_seconds"] = plain_prefill / len(prompts)
        merged["plain_step_ms"] = 1e3 * (plain_seconds - plain_prefill) / decode_tokens
        merged["decode_speedup"] = (plain_seconds - plain_prefill) / (seconds - prefill)
    return merged


def merge_results(results: list[dict]) -> dict:
    """Pool `dspark-hf bench` results measured in chunks (e.g. `--json` of one command per length or prompt): runs
    of the same dataset × drafter × temperature are pooled (`_pooled`), everything else is taken from the first."""
    groups: dict[tuple, list[dict]] = {}
    for result in results:
        for run in result["runs"]:
            groups.setdefault((run["dataset"], run["drafter"], run["temperature"]), []).append(run)
    merged = {**results[0], "runs": [_pooled(runs) for runs in groups.values()]}
    merged["datasets"] = {}
    for result in results:
        for name, info in result["datasets"].items():
            merged["datasets"].setdefault(name, {"num_prompts": 0})["num_prompts"] += info["num_prompts"]
    merged["drafters"] = {k: v for r in results for k, v in r["drafters"].items()}
    merged["all_identical"] = all(r["all_identical"] is not False for r in results)
    merged["baselines"] = [b for r in results for b in r.get("baselines", [])]
    return merged


def python_version() -> str:
    """The interpreter whose standard library the prompts come from."""
    return ".".join(map(str, sys.version_info[:3]))


def main(argv=None) -> int:
    """Write the prompt sets as JSONL files: `python -m dspark_hf.evaluation.long_context --out DIR`; or pool
    results measured in chunks: `... --merge a.json b.json --out DIR` (evaluation.json, long_context.png, table)."""
    import argparse
    import json
    from pathlib import Path

    from ..utils.files import atomic_write_json, atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,1k,2k,4k,8k")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="pool these `dspark-hf bench --json` results")
    parser.add_argument("--out", required=True, help="folder for ctx-<length>.jsonl (or the merged result)")
    args = parser.parse_args(argv)
    if args.merge:
        result = merge_results([json.loads(Path(p).read_text()) for p in args.merge])
        atomic_write_json(result, Path(args.out) / "evaluation.json")
        plot_long_context(result, Path(args.out) / "long_context.png")
        print(format_long_context(result))
        return 0

    from ..default import load_default_tokenizer

    tokenizer = load_default_tokenizer()
    sets = long_context_sets(tokenizer, parse_context_lengths(args.lengths), args.num_prompts, args.max_prompt_tokens)
    for name, records in sets.items():
        path = Path(args.out) / f"{name}.jsonl"
        atomic_write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), path)
        print(f"{path}: {len(records)} prompts, {[r['prompt_tokens'] for r in records]} tokens")
    return 0


__all__ = [
    "SOURCES",
    "context_rows",
    "document",
    "format_long_context",
    "length_label",
    "long_context_prompt",
    "long_context_sets",
    "merge_results",
    "parse_context_lengths",
]


if __name__ == "__main__":
    raise SystemExit(main())
