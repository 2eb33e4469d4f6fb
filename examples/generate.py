"""Greedy and sampled generation with a DSpark drafter, plus the same through a pipeline.

Usage:
    python examples/generate.py                      # embedded default (SmolLM2-135M-Instruct)
    python examples/generate.py --drafter path/to/dspark-checkpoint
"""

import argparse

import torch
from transformers import pipeline

import dspark_hf


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="DSpark checkpoint (default: the shipped default drafter)")
    parser.add_argument("--prompt", default="Give me three tips for writing readable Python.")
    args = parser.parse_args(argv)

    target, tokenizer, drafter = dspark_hf.load_default(drafter_path=args.drafter)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

    plain = target.generate(**inputs, max_new_tokens=64, do_sample=False)
    assisted = target.generate(**inputs, max_new_tokens=64, do_sample=False, assistant_model=drafter)
    stats = drafter.generation_stats
    print(tokenizer.decode(assisted[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    print(
        f"identical to plain greedy: {torch.equal(plain, assisted)}; τ = {stats.acceptance_length:.2f}; "
        f"{stats.num_target_forwards} target forwards for {stats.num_new_tokens} tokens"
    )

    # Sampling is lossless too: rejection sampling against the drafter's biased distribution.
    sampled = target.generate(**inputs, max_new_tokens=32, do_sample=True, temperature=0.7, assistant_model=drafter)
    print(tokenizer.decode(sampled[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))

    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    reply = pipe(messages, assistant_model=drafter, max_new_tokens=32, do_sample=False)
    print(reply[0]["generated_text"][-1]["content"])


if __name__ == "__main__":
    main()
