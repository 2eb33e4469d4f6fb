"""A round the draft gate keeps plain, against transformers' own decoding step, over a long prompt.

    python benchmarks/time_plain_rounds.py --target int4-weight --batch 4 --prompt 4k --temperature 1
    python benchmarks/time_plain_rounds.py --target fp32 --batch 1 --prompt 4k

With every round kept plain (the gate patched shut), a call with the drafter does what plain decoding does, plus the
round's own bookkeeping, so its cost per step should be transformers' step. Until 2026-12-07 each such round joined
the step's target features onto everything the row had gathered since its last draft, every prompt position
included: over a 4k prompt that copied the whole context (4096 positions × 5 tapped layers × 576 floats, 47 MB a
row) every step. Per configuration, in a rotating order: plain `generate()`, "join" (the old way, patched in) and
"pieces" (the shipped way). A streamer stamps each generated position as it comes out (one per step or plain
round), so the steps are timed without the prefill: the mean interval after the first position. One JSON line per
repeat, then the summary (ms per step, the fastest repeat, and each way's step as a ratio of plain's).
The embedded SmolLM2 target (quantized as `matrix.py` does it); run nothing else on the machine meanwhile.
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from dspark_hf.decoding import gate, rows


sys.path.insert(0, str(Path(__file__).parent))
from matrix import cpu_name, load_target, padded_batch, prompts_for  # noqa: E402


class Stamps(BaseStreamer):
    """The time of each position put after the prompt."""

    def __init__(self):
        self.times, self.prompt_seen = [], False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass

    def step_seconds(self) -> float:
        """The mean interval between positions after the first (the prefill's)."""
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)


def joined_each_round(self, features, reach=None):
    """The old `Row.add_context`: the whole context joined again with each addition, nothing dropped."""
    held = self.context
    self.context = features if held is None else torch.cat([held, features])


@contextlib.contextmanager
def way(name: str):
    """Every round plain (the gate shut); the context kept the old way for "join"."""
    should_draft, add = gate.DraftGate.should_draft, rows.Row.add_context
    gate.DraftGate.should_draft = lambda self, hints, caps: False
    if name == "join":
        rows.Row.add_context = joined_each_round
    try:
        yield
    finally:
        gate.DraftGate.should_draft, rows.Row.add_context = should_draft, add


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="fp32", help="fp32, bf16, int8-weight, int4-weight, dynamic-int8")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", default="4k", help="prompt tokens: 4k or a number")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3, help="fastest kept")
    args = parser.parse_args(argv)
    target, tokenizer, drafter = load_target(args.target)
    ids, mask = padded_batch(tokenizer, prompts_for(tokenizer, args.prompt, args.batch))
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}
    settings = sampling if args.temperature > 0 else {"do_sample": False}
    ways = ["plain", "join", "pieces"]

    def timed(name: str) -> float:
        """Seconds per step of one call."""
        extra = {} if name == "plain" else {"assistant_model": drafter}
        stamps, new = Stamps(), args.new_tokens
        with way(name):
            torch.manual_seed(0)
            target.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, streamer=stamps,
                **settings, **extra,
            )  # fmt: skip
        return stamps.step_seconds()

    for name in ways:  # warm-up
        timed(name)
    seconds = {w: [] for w in ways}
    for repeat in range(args.repeats):
        order = ways[repeat % 3 :] + ways[: repeat % 3]  # rotating, so a change of load hits every way alike
        for name in order:
            seconds[name].append(timed(name))
        print(json.dumps({"repeat": repeat, **{w: round(1000 * seconds[w][-1], 2) for w in ways}}), flush=True)
    step = {w: min(s) for w, s in seconds.items()}
    summary = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        **{k: getattr(args, k) for k in ("target", "batch", "prompt", "temperature")},
        "ms_per_step": {w: round(1000 * s, 2) for w, s in step.items()},
        "vs_plain": {w: round(step[w] / step["plain"], 3) for w in ways},
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
