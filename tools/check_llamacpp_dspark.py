"""Run an exported DSpark GGUF drafter in llama.cpp beside the SmolLM2 target GGUF and compare with plain greedy.

For each prompt (chat-formatted with the target's template), this runs llama.cpp's `llama-completion` (plain greedy,
`--temp 0`) and `llama-speculative-simple --spec-type draft-dspark` (the same target plus the drafter, greedy), checks
that the generated texts are identical, and reports each tool's own decode speed (llama.cpp's timers) and the
drafter's acceptance (`n_accept / n_drafted`). Build the tools and export the drafter with
`tools/llamacpp_dspark.sh`, which then calls this script. The texts are identical only with a build without
llamafile's sgemm (`-DGGML_LLAMAFILE=OFF`, as the script builds) and flash attention off (`-fa off`, the default of
`--llama-args`): both make a token's logits depend on how many tokens share its batch (docs/engines.md).

    python tools/check_llamacpp_dspark.py --bin /work/envs/llamacpp/build/bin --draft draft.gguf \
        --prompts /work/shared/data/eval/mt-bench.jsonl --num-prompts 10 --max-new-tokens 128 --threads 2
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path


def read_prompts(path: Path, n: int) -> list[str]:
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            turns = row.get("turns") or [row.get("prompt") or row.get("question") or row.get("problem")]
            prompts.append(str(turns[0]))
        if len(prompts) == n:
            break
    return prompts


def run(cmd: list[str], timeout: float) -> tuple[str, str, float]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, done.stderr, wall


def generated(stdout: str, question: str) -> str:
    """The text after the echoed prompt: both tools echo the prompt (llama-completion without its special tokens),
    so the generation starts after the "assistant" line that follows the question."""
    start = stdout.find(question)
    marker = stdout.find("assistant\n", start + len(question)) if start >= 0 else -1
    if marker < 0:
        raise ValueError(f"the tool's output does not echo the chat prompt: {stdout[:300]!r}")
    return stdout[marker + len("assistant\n") :].rstrip("\n").removesuffix(" [end of text]").rstrip("\n")


def plain_speed(stderr: str) -> tuple[float, int]:
    """llama_perf 'eval time = X ms / N runs': decode tok/s and N (the prompt is timed separately)."""
    match = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr.split("prompt eval time")[-1])
    if not match:
        raise ValueError(f"no eval timing in llama-completion's log:\n{stderr[-2000:]}")
    ms, runs = float(match.group(1)), int(match.group(2))
    return runs / (ms / 1000.0), runs


def spec_stats(stderr: str) -> dict:
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", stderr)
    drafted = re.search(r"n_drafted = (\d+)", stderr)
    accepted = re.search(r"n_accept  = (\d+)", stderr)
    if not (decoded and drafted and accepted):
        raise ValueError(f"no speculative statistics in the log:\n{stderr[-2000:]}")
    return dict(
        tokens=int(decoded.group(1)),
        seconds=float(decoded.group(2)),
        tok_s=float(decoded.group(3)),
        drafted=int(drafted.group(1)),
        accepted=int(accepted.group(1)),
    )


def transformers_side(folder: str, prompts: list[str], max_new_tokens: int, threads: int) -> list[dict]:
    """transformers plain greedy and + drafter (whole block verified, as llama.cpp does with --spec-draft-p-min 0):
    decode tok/s (prefill timed by a 1-token generate and subtracted), acceptance of the drafted tokens."""
    import torch

    from dspark_hf import DSparkDraftModel
    from dspark_hf.default import load_default_target

    torch.set_num_threads(threads)
    target, tokenizer = load_default_target()
    drafter = DSparkDraftModel.from_pretrained(folder, target=target)
    drafter.config.verify_policy = "fixed"

    def timed(ids, n, **kwargs):
        start = time.perf_counter()
        out = target.generate(ids, do_sample=False, max_new_tokens=n, **kwargs)
        return out, time.perf_counter() - start

    rows = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        _, prefill = timed(ids, 1)
        plain, t_plain = timed(ids, max_new_tokens)
        spec, t_spec = timed(ids, max_new_tokens, assistant_model=drafter)
        stats = drafter.generation_stats
        n = plain.shape[1] - ids.shape[1]
        rows.append(
            dict(
                identical=bool(torch.equal(plain, spec)),
                plain_tok_s=(n - 1) / max(t_plain - prefill, 1e-9),
                spec_tok_s=(n - 1) / max(t_spec - prefill, 1e-9),
                tokens=n,
                drafted=sum(stats.verify_lengths),
                accepted=sum(stats.accepted_lengths),
            )
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", type=Path, required=True, help="llama.cpp build/bin folder")
    parser.add_argument("--draft", type=Path, required=True, help="the exported GGUF drafter")
    parser.add_argument("--target", type=Path, help="target GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--prompts", type=Path, default=Path("/work/shared/data/eval/mt-bench.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-max", type=int, default=7, help="--spec-draft-n-max (the drafter's block size)")
    parser.add_argument("--spec-type", default="draft-dspark")
    parser.add_argument(
        "--llama-args",
        default="-fa off",
        help="extra arguments for both llama.cpp tools (default '-fa off': with flash attention on, llama.cpp's "
        "speculative output can differ from its plain greedy output; docs/engines.md, 'Identical to plain greedy')",
    )
    parser.add_argument("--json", type=Path, help="also write the per-prompt results here")
    parser.add_argument(
        "--transformers-drafter",
        help="also time transformers plain greedy and transformers + this drafter (the exported checkpoint folder) "
        "on the same prompts, for a four-way table",
    )
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from dspark_hf.default import gguf_path

    folder, name = gguf_path()
    args.target = args.target or Path(folder) / name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)  # the target's chat template
    common = ["-m", str(args.target), "-n", str(args.max_new_tokens), "--temp", "0", "-t", str(args.threads)]
    common += ["-s", "0", "-c", "2048", *args.llama_args.split()]
    rows, prompts = [], []
    for i, question in enumerate(read_prompts(args.prompts, args.num_prompts)):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(prompt)
        out, err, _ = run([str(args.bin / "llama-completion"), *common, "-no-cnv", "-p", prompt], 600)
        plain_text = generated(out, question)
        plain_tok_s, plain_tokens = plain_speed(err)
        spec_cmd = [str(args.bin / "llama-speculative-simple"), *common, "-p", prompt]
        if not args.spec_type.startswith("ngram"):  # ngram-*: a drafter-free control of llama.cpp's own numerics
            spec_cmd += ["-md", str(args.draft)]
        spec_cmd += ["--spec-type", args.spec_type, "--spec-draft-n-max", str(args.draft_max)]
        spec_cmd += ["--spec-draft-p-min", "0"]
        out, err, _ = run(spec_cmd, 600)
        spec_text = generated(out, question)
        stats = spec_stats(err)
        # llama-speculative-simple may accept past -n by up to a block: the plain text must be all of its start
        row = dict(
            prompt=i,
            identical=spec_text.startswith(plain_text),
            plain_chars=len(plain_text),
            spec_chars=len(spec_text),
            plain_tok_s=round(plain_tok_s, 2),
            plain_tokens=plain_tokens,
            spec_tok_s=stats["tok_s"],
            spec_tokens=stats["tokens"],
            accept_rate=round(stats["accepted"] / max(stats["drafted"], 1), 3),
            drafted=stats["drafted"],
            accepted=stats["accepted"],
        )
        if not row["identical"]:
            cut = next((k for k, (a, b) in enumerate(zip(plain_text, spec_text)) if a != b), None)
            row["first_difference_at_char"] = cut
        rows.append(row)
        print(json.dumps(row), flush=True)
    same = sum(r["identical"] for r in rows)
    plain = sum(r["plain_tokens"] for r in rows) / sum(r["plain_tokens"] / r["plain_tok_s"] for r in rows)
    spec = sum(r["spec_tokens"] for r in rows) / sum(r["spec_tokens"] / r["spec_tok_s"] for r in rows)
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    summary = dict(
        prompts=len(rows),
        identical=same,
        plain_tok_s=round(plain, 1),
        dspark_tok_s=round(spec, 1),
        speedup=round(spec / plain, 3),
        accept_rate=round(accepted / max(drafted, 1), 3),
    )
    if args.transformers_drafter:
        hf = transformers_side(args.transformers_drafter, prompts, args.max_new_tokens, args.threads)
        tokens = sum(r["tokens"] - 1 for r in hf)
        summary.update(
            transformers_identical=sum(r["identical"] for r in hf),
            transformers_plain_tok_s=round(tokens / sum((r["tokens"] - 1) / r["plain_tok_s"] for r in hf), 1),
            transformers_dspark_tok_s=round(tokens / sum((r["tokens"] - 1) / r["spec_tok_s"] for r in hf), 1),
            transformers_accept_rate=round(sum(r["accepted"] for r in hf) / max(sum(r["drafted"] for r in hf), 1), 3),
        )
        same = min(same, summary["transformers_identical"])
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(dict(summary=summary, rows=rows), indent=2))
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
