"""A transformers text-generation pipeline that drafts with DSpark: pass `assistant_model=drafter` per call.

Usage:
    python examples/pipeline.py
    python examples/pipeline.py --prompt "Name three rivers." --max-new-tokens 48

The reply is the one the pipeline gives without the drafter (greedy, float32), only in fewer target forwards.
"""

import argparse

from transformers import pipeline

import dspark_hf  # importing it routes generate(assistant_model=<a DSpark drafter>) to DSpark


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="Write a haiku about speculative decoding.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    # The embedded pair: SmolLM2-135M-Instruct and the drafter shipped inside the package.
    target, tokenizer, drafter = dspark_hf.load_default()
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)

    chat = [{"role": "user", "content": args.prompt}]
    reply = pipe(chat, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(reply[0]["generated_text"][-1]["content"])  # the last message of the chat is the assistant's reply

    # τ: tokens committed per target forward in that call, the bonus token included (plain decoding has 1.0).
    print(f"τ = {drafter.generation_stats.acceptance_length:.2f}")


if __name__ == "__main__":
    main()
