"""`dspark-hf serve`: the Engine behind an OpenAI-compatible HTTP server (`serving/server.py`)."""

from .checks import at_least, check_address, check_model_path, require
from .loading import VERIFY_POLICIES, add_model_args, load_models


def add_parser(subparsers):
    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", default=None, help="the id clients pass as `model` (default: the target's)")
    serve.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    serve.add_argument("--verify-policy", choices=VERIFY_POLICIES, default=None)
    serve.add_argument("--num-assistant-tokens", type=int, default=None, help="most drafts per round (default: block)")
    serve.add_argument(
        "--no-draft-gate",
        action="store_true",
        help="under verify_policy scheduler, draft every round (the gate skips drafts not expected to pay)",
    )
    serve.add_argument("--plain", action="store_true", help="plain decoding, no drafter (a baseline)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every endpoint (default: the DSPARK_API_KEY environment "
        "variable; none: no authentication, fine on 127.0.0.1 only)",
    )
    add_model_args(serve)
    return serve


def run(args) -> int:
    from ..serving.engine import Engine
    from ..serving.server import DSparkServer, api_key_from_env

    at_least(args, 1, "max_batch_size", "num_assistant_tokens")
    check_address(args.host, args.port)
    api_key = args.api_key if args.api_key is not None else api_key_from_env()
    require(api_key is None or bool(api_key.strip()), "--api-key is empty; give a key or leave the option out.")
    check_model_path(args.target, "--target")
    check_model_path(args.drafter, "--drafter", drafter=True)
    target, tokenizer, drafter = load_models(args)
    engine = Engine(
        target,
        None if args.plain else drafter,
        tokenizer=tokenizer,
        max_batch_size=args.max_batch_size,
        verify_policy=args.verify_policy,
        num_assistant_tokens=args.num_assistant_tokens,
        gate_drafts=False if args.no_draft_gate else None,
    )
    server = DSparkServer(
        engine, tokenizer, host=args.host, port=args.port, model_name=_model_name(args), api_key=api_key
    )
    mode = "plain decoding" if args.plain else f"DSpark ({args.verify_policy or drafter.config.verify_policy})"
    untrained = " with an UNTRAINED drafter" if not args.plain and getattr(drafter, "is_untrained", False) else ""
    print(f"serving {server.limits.model_name} ({mode}{untrained}) at {server.url}/v1  (Ctrl-C stops)", flush=True)
    server.serve_forever()
    return 0


def _model_name(args) -> str:
    return args.model_name or (args.target.rstrip("/").split("/")[-1] if args.target else "SmolLM2-135M-Instruct")
