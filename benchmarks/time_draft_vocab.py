"""Time a drafting step with and without a draft vocabulary on the embedded SmolLM2 target (median of 30 calls).

    python benchmarks/time_draft_vocab.py [DRAFTER]       # default: the shipped drafter

Prints the milliseconds of the LM-head product of a 7-token block, of 7 sequential-head biases and of a whole
`sample_block`, for the drafter as saved (its draft vocabulary, if any) and over the whole vocabulary.
"""

import statistics
import sys
import time

import torch

from dspark_hf.default import load_default


def median_ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.no_grad()
def main() -> None:
    target, _, drafter = load_default(sys.argv[1] if len(sys.argv) > 1 else None)
    lm_head = target.get_output_embeddings()
    torch.manual_seed(0)
    hidden = torch.randn(1, drafter.config.block_size, drafter.config.hidden_size)
    sequence = torch.tensor([[1, 2, 3, 4]])
    saved = drafter.draft_vocab_ids
    for label, ids in (("draft vocabulary", saved), ("whole vocabulary", None)):
        if ids is None and label == "draft vocabulary":
            continue  # the drafter has none
        drafter.set_draft_vocab(ids)
        base = median_ms(lambda: drafter.draft_base_logits(hidden, lm_head))
        bias = median_ms(lambda: [drafter.draft_sequential_bias(sequence[:, -1:], hidden[:, :1]) for _ in hidden[0]])
        block = median_ms(lambda: drafter.sample_block(hidden, sequence, lm_head))
        print(
            f"{label:17s} LM head {base:6.2f} ms   sequential bias x{len(hidden[0])} {bias:6.2f} ms   "
            f"sample_block {block:6.2f} ms"
        )


if __name__ == "__main__":
    main()
