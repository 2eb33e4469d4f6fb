"""`dspark-hf` command line: `demo`, `bench`, `data`, `features`, `train`, `export` and more.

User errors (bad arguments, missing or malformed files, an unreachable server) end as one line on stderr and exit
status 2, without a traceback; `--debug` or `DSPARK_DEBUG=1` shows it. Arguments and input files are checked before
any model loads. The process is ours, so glibc's malloc keeps freed memory for the next forward
(`kernels.allocator.keep_freed_memory`; `DSPARK_SYSTEM_MALLOC=1` leaves it as it is).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch


DEMO_PROMPT = "Explain in three sentences why the sky is blue."
# What a user's mistake raises (bad values, missing or unreadable files, refused connections, a missing package)
USER_ERRORS = (ValueError, OSError, ImportError)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _at_least(args, minimum: int, *options: str) -> None:
    """Each `--option` (attribute names with underscores) that is set must be >= `minimum`."""
    for name in options:
        value = getattr(args, name, None)
        if value is not None:
            _require(value >= minimum, f"--{name.replace('_', '-')} must be >= {minimum}, got {value}.")


def _check_model_path(path, option: str, drafter: bool = False):
    """A local model folder must exist (a drafter's must hold a valid config.json, returned as a config); a name that
    could be a Hub repo id and is not on disk must be fetchable (its config.json, from the cache or the Hub), so a
    mistyped local path is named before any model loads."""
    if path is None:
        return None
    from .utils.checkpoints import looks_like_hub_id

    local = Path(path).expanduser()
    if not local.exists() and looks_like_hub_id(path):
        _check_hub_id(path, option)
        return None
    if not drafter:
        _require(local.exists(), f"{option} {path}: no such folder.")
        _require(not local.is_file(), f"{option} {path} is a file; give the model's folder (config.json and weights).")
        return None
    from .integrations.registration import read_drafter_config

    try:
        return read_drafter_config(path)
    except (OSError, ValueError) as err:
        raise type(err)(f"{option}: {err}") from None


def _holds_a_causal_lm(path) -> bool:
    """Whether a local folder holds a transformers model that is none of this package's drafters (nor DeepSpec's)."""
    from .integrations.deepspec import is_deepspec_config
    from .models.configuration_dspark import DSparkConfig
    from .models.configuration_eagle3 import Eagle3Config

    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False  # missing or unreadable: the drafter check names it
    if not isinstance(config, dict) or is_deepspec_config(config):
        return False
    return config.get("model_type") not in (None, DSparkConfig.model_type, Eagle3Config.model_type)


def _check_hub_id(name: str, option: str) -> None:
    """`name` is no local path: it must be a Hub repo whose config.json can be fetched (or is cached)."""
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(name, "config.json")
    except Exception as err:  # offline, no such repo, no access: all mean the same to the user here
        reason = " ".join(str(err).split()) or type(err).__name__
        raise FileNotFoundError(
            f"{option} {name}: no such local folder, and as a Hub repo id it cannot be fetched "
            f"({type(err).__name__}: {reason[:160]}). Check the path; a Hub id needs the network or the local cache."
        ) from None


def _check_file(path, option: str) -> None:
    if path is not None and not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"{option} {path}: no such file.")


def _check_dataset(paths: str, option: str):
    """A token dataset (one .npz, or several comma-separated) that loads and holds sequences: read here, before any
    model loads (the files are small)."""
    from .training.dataset import TokenDataset

    for path in [p.strip() for p in paths.split(",") if p.strip()]:
        _check_file(path, option)
        _check_npz(path, option)
    try:
        dataset = TokenDataset.load(paths)
    except ValueError as err:
        raise ValueError(f"{option}: {err}") from None
    _require(len(dataset) > 0, f"{option} {paths} holds no sequences; build a dataset with `dspark-hf data`.")
    return dataset


def _check_npz(path: str, option: str) -> None:
    """A token dataset is a .npz (a zip archive): any other file (JSONL prompts, text, a pickle) is named as such,
    instead of numpy's word on what it tried (e.g. "pickled data ... allow_pickle=False")."""
    import zipfile

    file = Path(path).expanduser()
    if file.stat().st_size == 0 or zipfile.is_zipfile(file):
        return  # an empty file, or a .npz: TokenDataset.load says what is wrong with it, if anything
    raise ValueError(
        f"{option} {path} is not a .npz token dataset (it is not a zip archive, which a .npz is). Make one with "
        "`dspark-hf data --out FOLDER`: the target answers prompts, and FOLDER/train.npz and FOLDER/heldout.npz hold "
        "the token sequences."
    )


def _check_out_folder(out, option: str, overwrite: bool, keep_out=()) -> Path:
    """An output folder: absent or empty (or `overwrite`), and outside each of `keep_out` ((folder, why) pairs)."""
    out = Path(out).expanduser()
    for folder, why in keep_out:
        folder = Path(folder).expanduser().resolve()
        inside = out.resolve() == folder or folder in out.resolve().parents
        _require(not inside, f"{option} {out} is inside {folder} ({why}); choose a folder outside it.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{option} {out} exists and is not an empty folder; pass --overwrite to replace it.")
    return out


def _drafter_dtype(args) -> torch.dtype | None:
    """--drafter-dtype as a torch dtype; None for "auto" (`packed_linear.inference_dtype`)."""
    name = getattr(args, "drafter_dtype", "auto")
    return None if name == "auto" else getattr(torch, name)


def _load(args):
    """(target, tokenizer, drafter) from --target/--drafter, defaulting to the embedded SmolLM2 default."""
    from .default import load_default

    if args.target is None:
        target, tokenizer, drafter = load_default(drafter_path=args.drafter, drafter_dtype=_drafter_dtype(args))
        return _quantized(target, args), tokenizer, drafter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .kernels.packed_linear import inference_dtype
    from .models.modeling_dspark import DSparkDraftModel

    if args.drafter is None:
        raise ValueError("--target needs --drafter (a DSpark checkpoint made for that target).")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = DSparkDraftModel.from_pretrained(args.drafter, dtype=_drafter_dtype(args) or inference_dtype()).eval()
    return _quantized(target, args), tokenizer, drafter


def _quantized(target, args):
    """The target quantized as --quantize says (`integrations/quantization.py`), or as loaded."""
    how = getattr(args, "quantize", None)
    if how is None:
        return target
    from .integrations.quantization import quantize_target

    return quantize_target(target, how)


def cmd_demo(args) -> int:
    from .evaluation.harness import run_bench, timed_generate
    from .utils.prompts import encode

    _at_least(args, 1, "repeats", "max_new_tokens")
    _check_model_path(args.target, "--target")
    _check_model_path(args.drafter, "--drafter", drafter=True)
    target, tokenizer, drafter = _load(args)
    record = {"messages": [{"role": "user", "content": args.prompt}]}
    out, _ = timed_generate(target, encode(tokenizer, record), args.max_new_tokens, drafter)
    print(f"User: {args.prompt}\nAssistant: {tokenizer.decode(out, skip_special_tokens=True).strip()}\n", flush=True)
    # timing: the prompt `repeats` times, plain and drafted in alternating order (as in `bench`), totals compared
    result = run_bench(target, tokenizer, drafter, [record] * args.repeats, args.max_new_tokens, progress=False)
    label = " (UNTRAINED drafter: expect no speedup)" if getattr(drafter, "is_untrained", False) else ""
    print(
        f"identical to plain greedy: {result['all_identical']}   τ = {result['acceptance_length']:.2f}   "
        f"speedup over plain decoding: {result['speedup']:.2f}x "
        f"({result['tokens_per_second_dspark']:.1f} vs {result['tokens_per_second_plain']:.1f} tok/s, "
        f"{args.repeats} alternating runs each){label}"
    )
    padded = result["tokens_per_second_padded"]
    fewer, rounds = result["fewer_threads_rounds"], result["num_target_forwards"]
    if fewer:  # the padded baseline keeps every thread: it says nothing of what speculation buys here
        print(
            f"{fewer} of {rounds} rounds ran at fewer threads than torch's {torch.get_num_threads()}, which measured "
            "faster: another process is probably busy on these cores, and part of the speedup is the thread count, "
            "not speculation (plain generate() keeps every thread)"
        )
    elif padded is not None and padded > result["tokens_per_second_plain"]:
        print(
            f"speedup over plain decoding through the same verify kernels (one-token steps, no drafts): "
            f"{result['speedup_vs_padded']:.2f}x ({padded:.1f} tok/s), what speculation itself buys here"
        )
    elif padded is not None:
        print(
            f"the verify kernels do not make plain steps faster on this CPU ({padded:.1f} tok/s), so the speedup "
            "above is what speculation itself buys"
        )
    return 0 if result["all_identical"] else 1


def _int_list(text: str) -> list[int]:
    """ "1-4,8" -> [1, 2, 3, 4, 8]."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        if item:
            low, _, high = item.partition("-")
            values += list(range(int(low), int(high or low) + 1))
    return values


def _load_drafters(args):
    """(target, tokenizer, {label: drafter}) for `bench`: every `--drafter [LABEL=]PATH`, else the default drafter."""
    from .evaluation.harness import load_assistant, parse_drafters

    specs = parse_drafters(args.drafter or [])
    if not specs:
        args.drafter = None
        target, tokenizer, drafter = _load(args)
        return target, tokenizer, {"default": drafter}
    if args.target is None:
        from .default import load_default_target

        target, tokenizer = load_default_target()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    dtype = _drafter_dtype(args)
    return _quantized(target, args), tokenizer, {label: load_assistant(path, dtype) for label, path in specs.items()}


def _check_bench_args(args) -> None:
    """Everything `bench` can check before a model loads: numbers, model paths and drafter labels."""
    from .evaluation.harness import parse_drafters

    _at_least(args, 1, "limit", "max_new_tokens", "latency_new_tokens", "requests_per_client")
    _check_model_path(args.target, "--target")
    for path in parse_drafters(args.drafter or []).values():
        # bench also times transformers' own assistants (any causal LM): only this package's drafters are read
        _check_model_path(path, "--drafter", drafter=not _holds_a_causal_lm(path))


def _check_server(url: str) -> None:
    """`bench --serve --url`: the server must answer before the benchmark starts."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    _require(
        parts.scheme == "http" and bool(parts.hostname),
        f"--url {url!r} must look like http://HOST:PORT (the server's address, without /v1).",
    )
    try:
        port = parts.port
    except ValueError as err:
        raise ValueError(f"--url {url!r}: {err}.") from None
    conn = http.client.HTTPConnection(parts.hostname, port, timeout=10)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
    except (OSError, http.client.HTTPException) as err:
        raise ConnectionError(
            f"No server answers at {url} ({err}); start one with `dspark-hf serve` or check --url."
        ) from None
    finally:
        conn.close()


def cmd_bench(args) -> int:
    _check_bench_args(args)
    if args.serve:
        if len(args.prompts or []) > 1 or len(args.drafter or []) > 1:
            raise ValueError("bench --serve takes at most one --prompts file and one --drafter.")
        args.prompts = args.prompts[0] if args.prompts else None
        args.drafter = args.drafter[0] if args.drafter else None
        return cmd_load_bench(args)

    from .evaluation.harness import format_evaluation, parse_datasets, run_evaluation
    from .utils.files import atomic_write_json
    from .utils.prompts import read_prompts

    files = parse_datasets(args.prompts, args.datasets)
    try:
        temperatures = [float(t) for t in args.temperature.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--temperature {args.temperature!r} must be comma-separated numbers, e.g. 0,1.") from None
    _require(all(t >= 0 for t in temperatures), f"--temperature {args.temperature!r}: temperatures must be >= 0.")
    try:
        lengths = _int_list(args.latency_lengths)
    except ValueError:
        raise ValueError(f"--latency-lengths {args.latency_lengths!r} must look like 1-16,24.") from None
    _require(all(n >= 1 for n in lengths), f"--latency-lengths {args.latency_lengths!r}: lengths must be >= 1.")
    budgets = _tree_budgets(args.tree_budget)
    context_lengths = None
    if args.long_context:
        from .evaluation.long_context import parse_context_lengths

        context_lengths = parse_context_lengths(args.long_context)
    if not files and not context_lengths:
        raise ValueError(
            "dspark-hf bench needs prompts: --prompts FILE.jsonl (repeatable) or --datasets name=FILE.jsonl,... "
            "(see docs/evaluation.md), --long-context 256,1k,... or --serve for the load benchmark."
        )
    datasets = {name: read_prompts(path)[: args.limit] for name, path in files.items()}
    target, tokenizer, drafters = _load_drafters(args)
    if context_lengths:
        from .evaluation.long_context import long_context_sets

        room = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        cap = room - args.max_new_tokens - 1 if room else None
        datasets.update(long_context_sets(tokenizer, context_lengths, args.limit or 2, cap))
    if args.verify_policy:
        for drafter in drafters.values():
            if hasattr(drafter.config, "verify_policy"):
                drafter.config.verify_policy = args.verify_policy
    result = run_evaluation(
        target,
        tokenizer,
        drafters,
        datasets,
        max_new_tokens=args.max_new_tokens,
        temperatures=temperatures,
        seed=args.seed,
        latency_lengths=lengths,
        latency_new_tokens=args.latency_new_tokens,
        # long prompts: the padded baseline would add a third long prefill per prompt; ask for it explicitly
        padded_baseline=False if context_lengths and args.padded_baseline is None else args.padded_baseline,
        tree_budgets=budgets,
    )
    result["target"] = args.target or "SmolLM2-135M-Instruct (embedded default)"
    for name, path in files.items():
        result["datasets"][name]["path"] = str(path)
    print(format_evaluation(result))
    if context_lengths:
        from .evaluation.long_context import format_long_context, python_version

        result["long_context"] = {"lengths": context_lengths, "python": python_version()}
        print(format_long_context(result))
    written = []
    if args.out:
        from .evaluation.plots import plot_evaluation

        atomic_write_json(result, Path(args.out) / "evaluation.json")
        written += [Path(args.out) / "evaluation.json", *plot_evaluation(result, args.out)]
    if args.json:
        atomic_write_json(result, args.json)
        written.append(args.json)
    if written:
        print("wrote " + ", ".join(str(p) for p in written))
    return 1 if result["all_identical"] is False else 0


def _tree_budgets(text: str | None) -> list[int]:
    """`--tree-budget 0,8,16,32` -> [0, 8, 16, 32] (0: the chain); None -> []."""
    if text is None:
        return []
    try:
        budgets = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        budgets = []
    _require(
        bool(budgets) and all(b >= 0 for b in budgets),
        f"--tree-budget {text!r} must be comma-separated ints >= 0, e.g. 0,8,16,32 (0: the chain).",
    )
    return budgets


def _model_name(args) -> str:
    return args.model_name or (args.target.rstrip("/").split("/")[-1] if args.target else "SmolLM2-135M-Instruct")


def _check_address(host: str, port: int) -> None:
    """`serve`: a port in range that this host can bind, checked before the model loads."""
    import socket

    _require(0 <= port <= 65535, f"--port must be in 0..65535, got {port}.")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        raise OSError(f"Cannot serve on {host}:{port} ({err}); choose another --host or --port.") from None


def cmd_serve(args) -> int:
    from .serving.engine import Engine
    from .serving.server import DSparkServer, api_key_from_env

    _at_least(args, 1, "max_batch_size", "num_assistant_tokens")
    _check_address(args.host, args.port)
    api_key = args.api_key if args.api_key is not None else api_key_from_env()
    _require(api_key is None or bool(api_key.strip()), "--api-key is empty; give a key or leave the option out.")
    _check_model_path(args.target, "--target")
    _check_model_path(args.drafter, "--drafter", drafter=True)
    target, tokenizer, drafter = _load(args)
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


def cmd_load_bench(args) -> int:
    from .serving.load_bench import format_load_summary, run_curve, run_load_benchmark, write_load_result
    from .utils.prompts import read_prompts

    records = read_prompts(args.prompts)[: args.limit] if args.prompts else None
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {args.concurrency!r} must be comma-separated client counts.") from None
    _require(
        bool(concurrencies) and min(concurrencies) >= 1, f"--concurrency {args.concurrency!r}: counts must be >= 1."
    )
    if args.url:
        _check_server(args.url)
        from .serving.load_bench import BUILTIN_PROMPTS

        curve = run_curve(
            args.url, records or BUILTIN_PROMPTS, concurrencies, args.requests_per_client, args.max_new_tokens
        )
        result = {"url": args.url, "concurrencies": concurrencies, "curves": {"server": curve}, "targets": {}}
    else:
        target, tokenizer, drafter = _load(args)
        result = run_load_benchmark(
            target,
            tokenizer,
            drafter,
            records,
            concurrencies,
            configurations=[c.strip() for c in args.configs.split(",") if c.strip()],
            requests_per_client=args.requests_per_client,
            max_tokens=args.max_new_tokens,
        )
    print(format_load_summary(result))
    write_load_result(result, args.json, args.png)
    print(" ".join(f"wrote {p}" for p in (args.json, args.png) if p))
    return 0


def add_load_bench_args(bench) -> None:
    group = bench.add_argument_group("load benchmark (--serve)")
    group.add_argument("--serve", action="store_true", help="drive an HTTP server with concurrent clients instead")
    group.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated numbers of concurrent clients")
    group.add_argument(
        "--configs",
        default="plain,fixed,scheduled",
        help="comma-separated: plain, fixed (γ = the drafter's block), fixed:K (γ = K), scheduled (Algorithm 1 with "
        "the draft gate), scheduled:ungated (Algorithm 1 drafting every round)",
    )
    group.add_argument("--requests-per-client", type=int, default=2, help="closed-loop requests per client")
    group.add_argument("--png", default="load_bench.png", help="per-user vs aggregate tok/s plot ('' for none)")
    group.add_argument("--url", default=None, help="drive an already running server (one curve) instead")


def _training_target(config):
    """The target of a training config: `config.target`, or the embedded SmolLM2 when None."""
    if config.target is None:
        from .default import load_default_target

        return load_default_target()[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(config.target, dtype=torch.float32)


def _check_training_paths(config) -> None:
    """The files and folders a training config names must exist before the target loads."""
    _check_model_path(config.target, "target")
    _check_model_path(config.init_drafter, "init_drafter", drafter=True)
    _check_file(config.drafter_config, "drafter_config")
    for key in ("data", "heldout"):
        if getattr(config, key):
            _check_dataset(getattr(config, key), key)
    if config.features is not None and not Path(config.features).is_dir():
        raise FileNotFoundError(
            f"features {config.features}: no such feature cache; build it with `dspark-hf features`."
        )


def cmd_train(args) -> int:
    from .training.config import DSparkTrainingConfig
    from .training.trainer import DSparkTrainer, check_output_dir, check_resume

    _at_least(args, 1, "stop_after")
    config = DSparkTrainingConfig.from_file(args.config, args.set)
    _require(bool(config.data), "train needs a token dataset: --set data=FILE.npz (from `dspark-hf data`).")
    _check_training_paths(config)
    check_output_dir(config.output_dir, args.resume, args.overwrite)  # an earlier run is never trained over
    if args.resume:
        check_resume(config)  # a refused change or damaged checkpoints fail before the target loads
    target = _training_target(config)
    trainer = DSparkTrainer(config, target)
    drafter = trainer.train(resume=args.resume, stop_after=args.stop_after, overwrite=args.overwrite)
    print(f"step {trainer.step}/{config.max_steps}; checkpoints in {config.output_dir}")
    return 0 if drafter is not None else 1


def cmd_features(args) -> int:
    from .training.config import DSparkTrainingConfig
    from .training.features import build_features, estimate_features
    from .training.trainer import build_drafter

    _at_least(args, 1, "batch_size", "shard_tokens", "sample_batches")
    config = DSparkTrainingConfig.from_file(args.config, args.set)
    data, out = args.data or config.data, args.out or config.features
    if not data or not out:
        raise ValueError("features needs a dataset (--data or `data` in the config) and --out (or `features`).")
    dataset = _check_dataset(data, "--data")
    _check_model_path(config.target, "target")
    target = _training_target(config).eval()
    layer_ids = build_drafter(config, target).config.target_layer_ids  # the layers training will read
    settings = dict(dtype=args.dtype, shard_tokens=args.shard_tokens, batch_size=args.batch_size)
    if args.dry_run:
        estimate = estimate_features(target, dataset, layer_ids, sample_batches=args.sample_batches, **settings)
        print(f"dry run, nothing written; layers {layer_ids}: {estimate.summary()}")
        return 0
    build_features(target, dataset, out, layer_ids, **settings)
    print(f"feature cache of {data} in {out}; train offline with --set features={out}")
    return 0


def cmd_data(args) -> int:
    import json
    import logging as pylogging

    from .training.generate_data import DataConfig, build_dataset, finalize_dataset

    _at_least(args, 1, "num_prompts", "max_new_tokens", "batch_size", "chunk_size")
    _at_least(args, 0, "teacher_forced_tokens", "max_chunks")
    _require(0 <= args.heldout_fraction < 1, f"--heldout-fraction must lie in [0, 1), got {args.heldout_fraction}.")
    if args.device is not None:
        _check_device(args.device)
    for path in args.exclude_eval:
        _check_file(path, "--exclude-eval")
    _check_model_path(args.target, "--target")
    log = pylogging.getLogger("dspark_hf")
    if not log.handlers:
        log.addHandler(pylogging.StreamHandler())
    log.setLevel(pylogging.INFO)
    if args.finalize:
        finalize_dataset(args.out)
    else:
        config = DataConfig(
            num_prompts=args.num_prompts,
            sources=tuple(s.strip() for s in args.sources.split(",") if s.strip()),
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            chunk_size=args.chunk_size or 4 * args.batch_size,
            teacher_forced_tokens=args.teacher_forced_tokens,
            heldout_fraction=args.heldout_fraction,
            seed=args.seed,
            do_sample=args.sample,
            exclude_eval=tuple(args.exclude_eval),
            target=args.target or "default",
        )
        if args.target is None:
            from .default import load_default_target

            target, tokenizer = load_default_target()
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
            tokenizer = AutoTokenizer.from_pretrained(args.target)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        build_dataset(target.to(device), tokenizer, args.out, config, max_chunks=args.max_chunks)
    stats_path = Path(args.out) / "stats.json"
    if stats_path.exists():
        stats = json.loads(stats_path.read_text())
        state = "complete" if stats["complete"] else f"partial: {stats['chunks_done']}/{stats['num_chunks']} chunks"
        print(
            f"{args.out}: train {stats['train_sequences']} sequences / {stats['train_tokens']} tokens, held-out "
            f"{stats['heldout_sequences']} / {stats['heldout_tokens']} ({state}); "
            f"{stats['generated_tokens_per_second']} generated tok/s"
        )
    return 0


def cmd_export(args) -> int:
    from .default import DEFAULT_DRAFTER_DIR
    from .models.modeling_dspark import DSparkDraftModel

    args.drafter = args.drafter or str(DEFAULT_DRAFTER_DIR)
    config = _check_model_path(args.drafter, "--drafter", drafter=True)
    _check_model_path(args.target, "--target")
    _require(
        args.format == "deepspec" or not args.drop_context_window,
        f"--drop-context-window applies to --format deepspec; --format {args.format} keeps the drafter's window.",
    )
    if args.format == "deepspec" and getattr(config, "context_window", None) and not args.drop_context_window:
        from .integrations.export import window_refusal

        raise ValueError(window_refusal(config))  # before any model loads
    _check_out_folder(args.out, "--out", args.overwrite)
    tokenizer = None
    if args.target is None:
        from .default import load_default_target

        target, tokenizer = load_default_target()
    else:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    drafter = DSparkDraftModel.from_pretrained(args.drafter)
    if args.format == "gguf":
        from .integrations.gguf import export_gguf

        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.target)
        options = dict(llamacpp_dir=args.llamacpp, outtype=args.outtype, python=args.converter_python)
        out = export_gguf(drafter, target, tokenizer, args.out, overwrite=args.overwrite, **options)
        print(f"wrote a llama.cpp GGUF draft model to {out}")
        return 0
    if args.format == "speculators":
        from .integrations.speculators import export_speculators

        out = export_speculators(drafter, target, args.out, verifier=args.verifier, overwrite=args.overwrite)
        print(f"wrote a speculators (vLLM) checkpoint to {out}")
        return 0
    from .integrations.deepspec import export_deepspec

    out = export_deepspec(
        drafter, target, args.out, overwrite=args.overwrite, drop_context_window=args.drop_context_window
    )
    print(f"wrote a DeepSpec ({args.format}) checkpoint to {out}")
    return 0


def cmd_calibrate(args) -> int:
    from .training.calibration import (
        MIN_BLOCKS,
        calibration_report,
        collect_confidence,
        count_full_blocks,
        fit_sts,
        reliability_diagram,
        write_calibrated_copy,
    )

    package = Path(__file__).resolve().parent
    drafter_path = args.drafter or str(package / "default_drafter")  # the shipped drafter is read, never written
    _at_least(args, 1, "seq_len", "batches", "anchors")
    keep_out = [(package, "the installed dspark_hf package")]
    if Path(drafter_path).expanduser().is_dir():
        keep_out.append((drafter_path, "the drafter being calibrated, which is never changed in place"))
    out = _check_out_folder(args.out, "--out", args.overwrite, keep_out)
    _check_model_path(args.target, "--target")
    config = _check_model_path(drafter_path, "--drafter", drafter=True)
    dataset = _check_dataset(args.data, "--data")
    block = None if config is None else config.block_size
    if block is not None:
        blocks = count_full_blocks(dataset, block, args.seq_len)
        _require(blocks >= MIN_BLOCKS, _too_short(args.data, block, f"holds {blocks}"))
    args.drafter = drafter_path
    target, _, drafter = _load(args)
    logits, labels = collect_confidence(
        drafter,
        target,
        dataset,
        seq_len=args.seq_len,
        num_batches=args.batches,
        num_anchors=args.anchors,
        against_target=args.quantize is not None,  # the quantized target's own greedy tokens decide acceptance
    )
    block = drafter.config.block_size
    _require(len(labels) >= MIN_BLOCKS, _too_short(args.data, block, f"gave {len(labels)} in --batches"))
    temps = fit_sts(logits, labels)
    report = calibration_report(logits, labels, temps)
    report["shipped"] = calibration_report(logits, labels, drafter.sts_temperatures, folds=0)["after"]  # its own T
    report["quantize"] = args.quantize
    write_calibrated_copy(_local_checkpoint(drafter_path), out, temps, report, overwrite=args.overwrite)
    shipped_ece, fitted_ece = (sum(report[k]["ece"]) / len(temps) for k in ("shipped", "cross_fitted"))
    print(f"mean ECE with the checkpoint's temperatures {shipped_ece:.4f} -> refitted (cross-fitted) {fitted_ece:.4f}")
    if args.png:
        reliability_diagram(logits, labels, temps, args.png)
    crossed = report["cross_fitted"]["ece"]
    for k, (b, a) in enumerate(zip(report["before"]["ece"], report["after"]["ece"]), start=1):
        auc = report["after"]["auroc"][k - 1]
        auc = "-" if auc is None else f"{auc:.3f}"
        print(
            f"position {k}: T = {temps[k - 1]:.3f}  ECE {b:.4f} -> {a:.4f} (cross-fitted {crossed[k - 1]:.4f})  "
            f"AUROC {auc}"
        )
    print(f"{report['num_blocks']} held-out blocks; the calibrated drafter (config.json, calibration.json): {out}")
    before, after = (sum(report[key]["ece"]) / len(crossed) for key in ("before", "cross_fitted"))
    if after >= before:
        print(
            f"note: fitted on other blocks, STS does not lower the mean ECE here ({before:.4f} -> {after:.4f}); "
            "the head is about as calibrated as these blocks can tell; more of them (--batches) would say more."
        )
    return 0


def _too_short(data, block_size: int, found: str) -> str:
    from .training.calibration import MIN_BLOCKS

    return (
        f"--data {data} is too short to calibrate: a held-out block of this block-{block_size} drafter needs "
        f"{block_size + 1} supervised tokens in a row, and the data {found} such blocks; calibration needs at least "
        f"{MIN_BLOCKS}. Give more (or longer) held-out sequences."
    )


def _local_checkpoint(source) -> Path:
    """The drafter checkpoint's folder: a local folder, or its Hub snapshot from the cache."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(source)))
    return folder


def parse_lengths(text: str) -> list[int]:
    """`profile --lengths`: "1-16,24,32" -> [1, ..., 16, 24, 32] (`_int_list`), sorted, deduplicated, all >= 1."""
    try:
        lengths = _int_list(text)
    except ValueError:
        raise ValueError(f"--lengths {text!r} is not a list of token counts and ranges like 1-16,24,32.") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {text!r} must name token counts >= 1, e.g. 1-16,24,32,64.")
    return sorted(set(lengths))


def _check_device(name: str | None) -> str:
    """--device as given (default: cuda when available, else cpu); one this machine does not have is an error."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, mps, ...).") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        _require(count > 0, f"--device {name}: this machine has no CUDA device (torch sees none); use --device cpu.")
        _require(device.index is None or device.index < count, f"--device {name}: only {count} CUDA device(s).")
    if device.type == "mps":
        _require(torch.backends.mps.is_available(), f"--device {name}: MPS is not available here; use --device cpu.")
    return name


def cmd_profile(args) -> int:
    from .decoding.profiling import plot_profile, profile_target, save_profile

    # before the target loads: a typo fails at once
    _at_least(args, 1, "max_tokens", "context_len", "repeats")
    lengths = parse_lengths(args.lengths) if args.lengths else range(1, args.max_tokens + 1)
    device = _check_device(args.device)
    _check_model_path(args.target, "--target")
    dtype = getattr(torch, args.dtype)
    if args.target is None:
        from .default import load_default_target

        target, _ = load_default_target(dtype)
    else:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    target = _quantized(target.to(device), args)
    profile = profile_target(target, lengths=lengths, context_len=args.context_len, repeats=args.repeats)
    save_profile(profile, args.out)
    threads, context = profile["torch_threads"], profile["context_len"]
    machine = profile.get("cpu", profile["device"])
    print(f"{machine} ({profile['dtype']}, {threads} threads), verify on a cache of {context} tokens")
    kernels = profile.get("kernels")
    if kernels:  # the machine's way for the target's linears, per row count (kernels/verify_linears.py)
        print("linears per row count (way, padded to rows; ms of one pass over the target's linears per way):")
        for rows, (way, pad) in kernels["choice"].items():
            times = "  ".join(f"{w} {t[rows]:.1f}" for w, t in kernels["ms"].items() if rows in t)
            print(f"{rows:>4} {way:>8} {pad:>3}   {times}")
    print(f"{'B':>4} {'measured ms':>12} {'padded ms':>10} {'steps/s':>9}")  # padded: cheapest width >= B
    for tokens, sps in sorted(((int(b), v) for b, v in profile["sps"].items())):
        key = str(tokens)
        print(
            f"{tokens:>4} {profile['verify_ms_measured'][key]:>12.2f} {profile['verify_ms'][key]:>10.2f} {sps:>9.1f}"
        )
    print(f"wrote {args.out} (put it in the drafter checkpoint's folder for verify_policy='scheduler')")
    png = str(Path(args.out).with_suffix(".png")) if args.png is None else args.png
    if png:
        try:
            plot_profile(profile, png)
            print(f"wrote {png}")
        except ImportError as e:
            print(f"no plot: {e}")
    return 0


DEBUG_HELP = "on an error, show the traceback instead of one line (also: DSPARK_DEBUG=1)"


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error rule: one line on stderr, exit status 2 (no usage block). Subcommand parsers are
    made by `add_subparsers` with the parent's class, so every command's parser is one too."""

    commands: dict = {}  # the root's: command name -> its parser

    def error(self, message: str):
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        """Unknown options are named by the command they were given to (argparse's root would claim them)."""
        args, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self.commands.get(getattr(args, "command", None), self)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dspark-hf",
        description="DSpark speculative decoding for transformers.",
        epilog="Errors are one line; --debug (or DSPARK_DEBUG=1) shows the traceback.",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_models(p, many_drafters=False):
        p.add_argument("--target", help="target model path or Hub id (default: embedded SmolLM2-135M-Instruct)")
        if many_drafters:
            p.add_argument(
                "--drafter",
                action="append",
                metavar="[LABEL=]PATH",
                help="a drafter checkpoint, optionally labelled; repeat to compare several (default: the shipped one)",
            )
        else:
            p.add_argument("--drafter", help="DSpark drafter checkpoint (default: the shipped default drafter)")
        p.add_argument(
            "--quantize",
            choices=["int8-weight", "int4-weight", "dynamic-int8"],
            default=None,
            help="quantize the target's linears after loading (torchao int8/int4 weight-only, PyTorch dynamic int8)",
        )
        p.add_argument(
            "--drafter-dtype",
            choices=["auto", "float32", "bfloat16", "float16"],
            default="auto",
            help="the drafter's dtype; auto: bfloat16 on a CPU that computes it natively, else the target's (float32)",
        )

    demo = sub.add_parser("demo", help="reply to one prompt with the embedded default; print τ and speedup")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--repeats", type=int, default=3, help="timed runs of plain and drafted decoding, alternating")
    add_models(demo)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="evaluate drafters against plain decoding on benchmark prompt sets")
    bench.add_argument(
        "--prompts",
        action="append",
        help='JSONL with "prompt", "messages" or "turns" per line, named by its file stem; repeatable',
    )
    bench.add_argument("--datasets", help="name=FILE.jsonl,... (e.g. mt-bench=mt-bench.jsonl,gsm8k=gsm8k.jsonl)")
    bench.add_argument(
        "--long-context",
        metavar="LENGTHS",
        help="also build long-prompt sets at these lengths (e.g. 256,1k,2k,4k,8k; CPython docs and source + a "
        "question, --limit prompts each, default 2) and report τ, speed and round time per length",
    )
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--limit", type=int, default=None, help="use only the first N prompts of each dataset")
    bench.add_argument("--temperature", default="0", help="comma-separated, e.g. 0,1 (0 = greedy, checked lossless)")
    bench.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    bench.add_argument("--verify-policy", choices=["threshold", "fixed", "scheduler"], default=None)
    bench.add_argument(
        "--tree-budget",
        help="comma-separated draft-tree budgets run side by side, e.g. 0,8,16,32 (0: the chain)",
    )
    bench.add_argument(
        "--latency-lengths", default="1,2,4,6,8,12,16", help="draft lengths for the latency sweep, e.g. 1-16 ('' off)"
    )
    bench.add_argument("--latency-new-tokens", type=int, default=48, help="tokens decoded per latency-sweep length")
    bench.add_argument(
        "--padded-baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time plain decoding through the verify kernels, the kernel-neutral baseline (speedup_vs_padded); "
        "default: on where the target's verifies can use them (float32 on the CPU)",
    )
    bench.add_argument("--out", help="folder for evaluation.json and the PNG plots")
    bench.add_argument("--json", help="write the full result JSON here")
    add_models(bench, many_drafters=True)
    add_load_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", default=None, help="the id clients pass as `model` (default: the target's)")
    serve.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    serve.add_argument("--verify-policy", choices=["threshold", "fixed", "scheduler"], default=None)
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
    add_models(serve)
    serve.set_defaults(func=cmd_serve)

    train = sub.add_parser("train", help="train a DSpark drafter (online, or offline from a feature cache)")
    train.add_argument("--config", help="training config (JSON or YAML); see DSparkTrainingConfig")
    train.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config fields")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a non-empty output_dir: it replaces the earlier run there once it has its first "
        "checkpoint (without --resume or --overwrite, a non-empty output_dir is refused)",
    )
    train.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after N more steps")
    train.set_defaults(func=cmd_train)

    features = sub.add_parser("features", help="cache target features for offline training (resumable; --dry-run)")
    features.add_argument("--config", help="the training config (its target, drafter layers and data are used)")
    features.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config fields")
    features.add_argument("--data", help="token dataset (.npz); default: the config's `data`")
    features.add_argument("--out", help="cache folder (rerun to resume); default: the config's `features`")
    features.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    features.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    features.add_argument("--shard-tokens", type=int, default=65_536, help="tokens per shard file")
    features.add_argument("--sample-batches", type=int, default=3, help="--dry-run: timed target forwards")
    features.add_argument("--dry-run", action="store_true", help="print the cache size and build time; write nothing")
    features.set_defaults(func=cmd_features)

    data = sub.add_parser("data", help="build a drafter training set: target-regenerated responses + plain text")
    data.add_argument("--out", required=True, help="output folder (rerun with the same arguments to resume)")
    data.add_argument("--target", help="target model path or Hub id (default: embedded SmolLM2-135M-Instruct)")
    data.add_argument("--num-prompts", type=int, default=2000, help="prompts to answer with the target")
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--batch-size", type=int, default=16)
    data.add_argument("--chunk-size", type=int, default=None, help="prompts per resumable chunk (4 x batch size)")
    data.add_argument(
        "--sources",
        default="chat,math,code,text",
        help="comma-separated prompt sources: chat, math, code, text, and the opt-in human (people's own questions: "
        "FAQs and ShareGPT first turns; see docs/data.md)",
    )
    data.add_argument("--teacher-forced-tokens", type=int, default=0, help="tokens of plain text (no generation)")
    data.add_argument("--exclude-eval", nargs="*", default=[], metavar="FILE", help="eval JSONL files to keep out")
    data.add_argument("--heldout-fraction", type=float, default=0.05)
    data.add_argument("--sample", action="store_true", help="sample with the target's recommended settings")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--max-chunks", type=int, default=None, help="stop after N more chunks (resume later)")
    data.add_argument("--device", help="where the target generates (default: cuda when available, else cpu)")
    data.add_argument("--finalize", action="store_true", help="only merge the finished chunks into train/heldout")
    data.set_defaults(func=cmd_data)

    profile = sub.add_parser("profile", help="measure target verify steps/s per verify size (Algorithm 1's SPS)")
    profile.add_argument("--target", help="target model path or Hub id (default: embedded SmolLM2-135M-Instruct)")
    profile.add_argument("--max-tokens", type=int, default=16, help="profile verify batches of 1..N tokens")
    profile.add_argument(
        "--lengths",
        default=None,
        help="profile these verify sizes instead, e.g. 1-16,24,32,64,128 (an engine with batch b and block γ "
        "verifies up to b·(γ+1) tokens; sizes in between are looked up at the next profiled one)",
    )
    profile.add_argument("--context-len", type=int, default=256, help="prefilled KV cache length")
    profile.add_argument("--repeats", type=int, default=5, help="timed runs per size (median taken)")
    profile.add_argument("--device", default=None, help="where the target runs (default: cuda if available, else cpu)")
    profile.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    profile.add_argument(
        "--quantize", choices=["int8-weight", "int4-weight", "dynamic-int8"], default=None, help="as for bench"
    )
    profile.add_argument("--out", default="sps_profile.json")
    profile.add_argument(
        "--png", default=None, help="plot path (default: beside --out, as .png; '' for none; needs matplotlib)"
    )
    profile.set_defaults(func=cmd_profile)

    cal = sub.add_parser(
        "calibrate", help="fit STS temperatures on held-out data; write a calibrated copy of the drafter to --out"
    )
    cal.add_argument("--data", required=True, help="held-out token dataset (.npz)")
    cal.add_argument(
        "--out", required=True, help="folder for the calibrated copy of the drafter (the drafter itself is unchanged)"
    )
    cal.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    cal.add_argument("--seq-len", type=int, default=512)
    cal.add_argument("--batches", type=int, default=8)
    cal.add_argument("--anchors", type=int, default=64)
    cal.add_argument("--png", default=None, help="write a reliability diagram here")
    add_models(cal)
    cal.set_defaults(func=cmd_calibrate)

    export = sub.add_parser(
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
    export.set_defaults(func=cmd_export)
    parser.commands = dict(sub.choices)
    for command in sub.choices.values():  # `dspark-hf bench ... --debug` as well as `dspark-hf --debug bench ...`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def _debug(args) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("DSPARK_DEBUG", "").strip() not in ("", "0")


def main(argv=None) -> int:
    """Run one command; a user error prints one line on stderr and returns 2 (`--debug` / DSPARK_DEBUG=1: raise)."""
    args = build_parser().parse_args(argv)
    from .kernels.allocator import keep_freed_memory

    keep_freed_memory()  # a long prompt's prefill without millions of page faults (this process only)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if _debug(args):
            raise
        print(f"dspark-hf {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if _debug(args):
            raise
        message = str(err) or type(err).__name__
    print(f"dspark-hf {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
