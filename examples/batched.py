"""Batched speculative decoding with `dspark_hf.Engine`: several prompts at once, then one streamed request.

Usage:
    python examples/batched.py
    python examples/batched.py --max-batch-size 2 --max-new-tokens 48

The Engine batches requests continuously (they join and leave between rounds); each request gets the tokens plain
decoding would give it alone. `drafter=None` makes the same engine a plain batched decoder.
"""

import argparse

import dspark_hf


PROMPTS = ["What is a prime number?", "Write a haiku about autumn.", "How do I reverse a list in Python?"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    target, tokenizer, drafter = dspark_hf.load_default()
    engine = dspark_hf.Engine(target, drafter, tokenizer=tokenizer, max_batch_size=args.max_batch_size)

    def prompt_ids(text):  # the chat template applied, as token ids
        chat = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)

    # 1. Run a list of prompts to completion (greedy); new tokens per prompt, in order.
    outputs = engine.generate([prompt_ids(p) for p in PROMPTS], max_new_tokens=args.max_new_tokens)
    for prompt, new_tokens in zip(PROMPTS, outputs):
        print(f"### {prompt}\n{tokenizer.decode(new_tokens, skip_special_tokens=True)}\n")
    print(f"τ = {engine.stats['acceptance_length']:.2f} tokens per request-round")

    # 2. A sampled request streamed as rounds commit its tokens; a seed makes the output reproducible.
    engine.start()  # a background loop: add_request() and abort() may now come from any thread
    try:
        request = engine.add_request(
            prompt_ids("Tell me a short story."), max_new_tokens=args.max_new_tokens, do_sample=True,
            temperature=0.7, seed=0,
        )  # fmt: skip
        for chunk in request.stream():
            print(tokenizer.decode(chunk), end="", flush=True)
        print()
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
