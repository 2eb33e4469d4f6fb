"""The model options several commands share (`--target`, `--drafter`, `--quantize`, `--drafter-dtype`) and the
loading they mean: the embedded SmolLM2 target and the shipped drafter unless a path or Hub id is given."""

import torch


VERIFY_POLICIES = ["threshold", "fixed", "scheduler"]  # --verify-policy of bench and serve
QUANTIZE_CHOICES = ["int8-weight", "int4-weight", "dynamic-int8"]
TARGET_HELP = "target model path or Hub id (default: embedded SmolLM2-135M-Instruct)"


def add_model_args(parser, many_drafters: bool = False) -> None:
    """`--target`, `--drafter` (repeatable and labelled with `many_drafters`), `--quantize`, `--drafter-dtype`."""
    parser.add_argument("--target", help=TARGET_HELP)
    if many_drafters:
        parser.add_argument(
            "--drafter",
            action="append",
            metavar="[LABEL=]PATH",
            help="a drafter checkpoint, optionally labelled; repeat to compare several (default: the shipped one)",
        )
    else:
        parser.add_argument("--drafter", help="DSpark drafter checkpoint (default: the shipped default drafter)")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=None,
        help="quantize the target's linears after loading (torchao int8/int4 weight-only, PyTorch dynamic int8)",
    )
    parser.add_argument(
        "--drafter-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="the drafter's dtype; auto: bfloat16 on a CPU that computes it natively, else the target's (float32)",
    )


def drafter_dtype(args) -> torch.dtype | None:
    """--drafter-dtype as a torch dtype; None for "auto" (`packed_linear.inference_dtype`)."""
    name = getattr(args, "drafter_dtype", "auto")
    return None if name == "auto" else getattr(torch, name)


def load_target(path, dtype: torch.dtype = torch.float32, with_tokenizer: bool = False):
    """(target, tokenizer) for `--target` `path` (None: the embedded SmolLM2, whose tokenizer always comes with it);
    a given target's tokenizer is loaded only `with_tokenizer` (else None)."""
    if path is None:
        from ..default import load_default_target

        return load_default_target(dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return target, AutoTokenizer.from_pretrained(path) if with_tokenizer else None


def load_models(args):
    """(target, tokenizer, drafter) from --target/--drafter, defaulting to the embedded SmolLM2 default."""
    if args.target is None:
        from ..default import load_default

        target, tokenizer, drafter = load_default(drafter_path=args.drafter, drafter_dtype=drafter_dtype(args))
        return quantized(target, args), tokenizer, drafter
    from ..kernels.packed_linear import inference_dtype
    from ..models.modeling_dspark import DSparkDraftModel

    if args.drafter is None:
        raise ValueError("--target needs --drafter (a DSpark checkpoint made for that target).")
    target, tokenizer = load_target(args.target, with_tokenizer=True)
    drafter = DSparkDraftModel.from_pretrained(args.drafter, dtype=drafter_dtype(args) or inference_dtype()).eval()
    return quantized(target.eval(), args), tokenizer, drafter


def quantized(target, args):
    """The target quantized as --quantize says (`integrations/quantization.py`), or as loaded."""
    how = getattr(args, "quantize", None)
    if how is None:
        return target
    from ..integrations.quantization import quantize_target

    return quantize_target(target, how)
