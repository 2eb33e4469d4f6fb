"""`dspark-hf export`: a drafter written in another engine's format: DeepSpec (SGLang), speculators (vLLM) or GGUF
(llama.cpp); the writers are in `integrations/`."""

from .checks import check_model_path, check_out_folder, require


def add_parser(subparsers):
    export = subparsers.add_parser(
        "export",
        help="write a drafter in another format (DeepSpec for SGLang, speculators for vLLM, GGUF for llama.cpp)",
    )
    export.add_argument("--format", choices=["deepspec", "speculators", "gguf"], default="deepspec")
    export.add_argument("--drafter", help="DSpark drafter checkpoint to export (default: the shipped default drafter)")
    export.add_argument("--target", help="its target (path or Hub id; default: embedded SmolLM2-135M-Instruct)")
    export.add_argument("--out", required=True, help="output folder, empty or absent (gguf: the .gguf file)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    export.add_argument(
        "--verifier", help="speculators: the target's Hub id or path recorded for vLLM (default: the drafter's target)"
    )
    export.add_argument("--llamacpp", help="gguf: llama.cpp source folder (its converter runs; default $LLAMACPP_DIR)")
    export.add_argument(
        "--outtype",
        default="auto",
        choices=["auto", "f32", "f16", "bf16", "q8_0"],
        help="gguf: tensor type (auto: f16, or bf16 when weights lie below float16's range)",
    )
    export.add_argument("--converter-python", help="gguf: Python with llama.cpp's converter requirements")
    export.add_argument(
        "--drop-context-window",
        action="store_true",
        help="deepspec: export a drafter that has a context_window (the shipped default has 512) without it, as the "
        "DeepSpec format has no sliding window. The weights are the same, but the engine's drafter then attends to "
        "the whole context: on prompts longer than the window its drafts, and so acceptance and speed-up, may differ "
        "from what the drafter was measured with; the output is still the target's. speculators and gguf keep the "
        "window.",
    )
    return export


def run(args) -> int:
    from ..default import DEFAULT_DRAFTER_DIR
    from ..models.modeling_dspark import DSparkDraftModel
    from .loading import load_target

    args.drafter = args.drafter or str(DEFAULT_DRAFTER_DIR)
    _check_args(args)
    target, tokenizer = load_target(args.target, with_tokenizer=args.format == "gguf")
    drafter = DSparkDraftModel.from_pretrained(args.drafter)
    if args.format == "gguf":
        from ..integrations.gguf import export_gguf

        options = dict(llamacpp_dir=args.llamacpp, outtype=args.outtype, python=args.converter_python)
        out = export_gguf(drafter, target, tokenizer, args.out, overwrite=args.overwrite, **options)
        print(f"wrote a llama.cpp GGUF draft model to {out}")
        return 0
    if args.format == "speculators":
        from ..integrations.speculators import export_speculators

        out = export_speculators(drafter, target, args.out, verifier=args.verifier, overwrite=args.overwrite)
        print(f"wrote a speculators (vLLM) checkpoint to {out}")
        return 0
    from ..integrations.deepspec import export_deepspec

    out = export_deepspec(
        drafter, target, args.out, overwrite=args.overwrite, drop_context_window=args.drop_context_window
    )
    print(f"wrote a DeepSpec ({args.format}) checkpoint to {out}")
    return 0


def _check_args(args) -> None:
    """The drafter, the target, the format's options and --out, before any model loads."""
    config = check_model_path(args.drafter, "--drafter", drafter=True)
    check_model_path(args.target, "--target")
    require(
        args.format == "deepspec" or not args.drop_context_window,
        f"--drop-context-window applies to --format deepspec; --format {args.format} keeps the drafter's window.",
    )
    if args.format == "deepspec" and getattr(config, "context_window", None) and not args.drop_context_window:
        from ..integrations.export import window_refusal

        raise ValueError(window_refusal(config))  # before any model loads
    check_out_folder(args.out, "--out", args.overwrite)
