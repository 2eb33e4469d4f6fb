"""The checks every command runs on its arguments and input files before any model loads.

Each raises what a user's mistake raises (`ValueError`, or an `OSError` for a missing file or folder, a refused
connection or an address that cannot be bound), with the option, the value and the fix in one line: `main` prints it
as `dspark-hf <command>: error: ...` and exits with status 2 (`--debug` or `DSPARK_DEBUG=1` shows the traceback).
"""

import json
from pathlib import Path

import torch


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def at_least(args, minimum: int, *options: str) -> None:
    """Each `--option` (attribute names with underscores) that is set must be >= `minimum`."""
    for name in options:
        value = getattr(args, name, None)
        if value is not None:
            require(value >= minimum, f"--{name.replace('_', '-')} must be >= {minimum}, got {value}.")


def int_list(text: str) -> list[int]:
    """ "1-4,8" -> [1, 2, 3, 4, 8]."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        if item:
            low, _, high = item.partition("-")
            values += list(range(int(low), int(high or low) + 1))
    return values


def check_model_path(path, option: str, drafter: bool = False):
    """A local model folder must exist (a drafter's must hold a valid config.json, returned as a config); a name that
    could be a Hub repo id and is not on disk must be fetchable (its config.json, from the cache or the Hub), so a
    mistyped local path is named before any model loads."""
    if path is None:
        return None
    from ..utils.checkpoints import looks_like_hub_id

    local = Path(path).expanduser()
    if not local.exists() and looks_like_hub_id(path):
        check_hub_id(path, option)
        return None
    if not drafter:
        require(local.exists(), f"{option} {path}: no such folder.")
        require(not local.is_file(), f"{option} {path} is a file; give the model's folder (config.json and weights).")
        return None
    from ..integrations.registration import read_drafter_config

    try:
        return read_drafter_config(path)
    except (OSError, ValueError) as err:
        raise type(err)(f"{option}: {err}") from None


def holds_a_causal_lm(path) -> bool:
    """Whether a local folder holds a transformers model that is none of this package's drafters (nor DeepSpec's)."""
    from ..integrations.deepspec import is_deepspec_config
    from ..models.configuration_dspark import DSparkConfig
    from ..models.configuration_eagle3 import Eagle3Config

    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False  # missing or unreadable: the drafter check names it
    if not isinstance(config, dict) or is_deepspec_config(config):
        return False
    return config.get("model_type") not in (None, DSparkConfig.model_type, Eagle3Config.model_type)


def check_hub_id(name: str, option: str) -> None:
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


def check_file(path, option: str) -> None:
    if path is not None and not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"{option} {path}: no such file.")


def check_dataset(paths: str, option: str):
    """A token dataset (one .npz, or several comma-separated) that loads and holds sequences: read here, before any
    model loads (the files are small)."""
    from ..training.dataset import TokenDataset

    for path in [p.strip() for p in paths.split(",") if p.strip()]:
        check_file(path, option)
        check_npz(path, option)
    try:
        dataset = TokenDataset.load(paths)
    except ValueError as err:
        raise ValueError(f"{option}: {err}") from None
    require(len(dataset) > 0, f"{option} {paths} holds no sequences; build a dataset with `dspark-hf data`.")
    return dataset


def check_npz(path: str, option: str) -> None:
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


def check_out_folder(out, option: str, overwrite: bool, keep_out=()) -> Path:
    """An output folder: absent or empty (or `overwrite`), and outside each of `keep_out` ((folder, why) pairs)."""
    out = Path(out).expanduser()
    for folder, why in keep_out:
        folder = Path(folder).expanduser().resolve()
        inside = out.resolve() == folder or folder in out.resolve().parents
        require(not inside, f"{option} {out} is inside {folder} ({why}); choose a folder outside it.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{option} {out} exists and is not an empty folder; pass --overwrite to replace it.")
    return out


def check_device(name: str | None) -> str:
    """--device as given (default: cuda when available, else cpu); one this machine does not have is an error."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, mps, ...).") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        require(count > 0, f"--device {name}: this machine has no CUDA device (torch sees none); use --device cpu.")
        require(device.index is None or device.index < count, f"--device {name}: only {count} CUDA device(s).")
    if device.type == "mps":
        require(torch.backends.mps.is_available(), f"--device {name}: MPS is not available here; use --device cpu.")
    return name


def check_address(host: str, port: int) -> None:
    """`serve`: a port in range that this host can bind, checked before the model loads."""
    import socket

    require(0 <= port <= 65535, f"--port must be in 0..65535, got {port}.")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        raise OSError(f"Cannot serve on {host}:{port} ({err}); choose another --host or --port.") from None


def check_server(url: str) -> None:
    """`bench --serve --url`: the server must answer before the benchmark starts."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    require(
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
