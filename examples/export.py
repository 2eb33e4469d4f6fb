"""Write a DSpark drafter in the formats other engines load: speculators (vLLM) and DeepSpec (SGLang).

Usage:
    python examples/export.py --out exported                       # the shipped default drafter
    python examples/export.py --drafter runs/mine/calibrated --out exported

The same as `dspark-hf export --format speculators|deepspec`. GGUF for llama.cpp runs llama.cpp's own converter
(`dspark-hf export --format gguf --llamacpp LLAMA_CPP_SOURCE`); docs/engines.md has the commands of each engine.
"""

import argparse
from pathlib import Path

import dspark_hf
from dspark_hf.integrations.deepspec import export_deepspec
from dspark_hf.integrations.speculators import export_speculators


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="DSpark checkpoint (default: the shipped default drafter)")
    parser.add_argument("--out", required=True, help="folder for the exported checkpoints (one sub-folder each)")
    parser.add_argument("--overwrite", action="store_true", help="replace earlier exports in --out")
    args = parser.parse_args(argv)

    # The target is needed too: the formats store its embedding / LM head, and the drafter is checked against it.
    target, _, drafter = dspark_hf.load_default(drafter_path=args.drafter)
    out = Path(args.out)

    # vLLM: `vllm serve <this folder>` (it reads the target from the config; docs/engines.md has the other forms).
    folder = export_speculators(drafter, target, out / "speculators", overwrite=args.overwrite)
    print(f"speculators (vLLM): {folder}")

    # DeepSpec has no sliding window: a drafter trained with one (the default's 512 positions) is refused unless
    # the window is dropped; the weights are the same, only the drafts on longer prompts may differ.
    window = getattr(drafter.config, "context_window", None)
    folder = export_deepspec(
        drafter, target, out / "deepspec", overwrite=args.overwrite, drop_context_window=bool(window)
    )
    print(f"DeepSpec (SGLang): {folder}")


if __name__ == "__main__":
    main()
