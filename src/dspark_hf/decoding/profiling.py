"""Hardware profile of the target for DSpark's Algorithm 1 (`verify_policy="scheduler"`).

Algorithm 1 maximises Θ = τ · SPS(B), where SPS(B) is how many target verify steps per second the hardware runs
with B tokens in the verify batch (anchors included). `profile_target` measures it: the median wall-clock time of a
forward of k new tokens on top of a prefilled KV cache. A profile is saved as `sps_profile.json` next to the drafter
checkpoint (`dspark-hf profile`), and `generate()` picks it up when the device, dtype and target match; otherwise it
takes a quick profile on the fly (`sps_for`).

Imports only torch, transformers and tqdm at module level (matplotlib lazily, for `plot_profile`).
"""

import contextlib
import inspect
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from ..kernels.lean_forward import run_target
from ..kernels.verify_head import eligible_linears, version
from ..kernels.verify_linears import KernelTable, kernel_choice
from ..kernels.weights import per_token_activations, per_token_linears, plain_tensor, quantization, unpacked_weight
from ..models.settings import largest_tree
from ..utils.devices import model_device
from .ragged_cache import AppendCache
from .scheduler import SPS


logger = logging.get_logger(__name__)

PROFILE_FORMAT = "dspark-sps-v1"
PROFILE_FILE = "sps_profile.json"
DEFAULT_MAX_TOKENS = 16
_FINGERPRINT_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")


# -- identity of the hardware and the target ----------------------------------------------------------------------


def _device_name(device) -> str:
    """The device type ("cpu", "mps", ...) or the CUDA device name ("NVIDIA H200"); other strings pass through."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return device
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError):
            return str(device)
    return device.type


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+"), which CPU profiles record: the verify
    kernels' speed, and so the SPS curve, differs between CPUs that report the same flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def run_facts() -> dict:
    """What a benchmark's JSON names its machine by: the CPU model, torch's intra-op threads and torch's version."""
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_key(device, dtype) -> str:
    """A stable name for (device, dtype), e.g. "cpu/float32" or "NVIDIA H200/bfloat16"."""
    return f"{_device_name(device)}/{_dtype_name(dtype)}"


def target_fingerprint(target) -> dict:
    """{model_type, hidden_size, num_hidden_layers, vocab_size} of the target's (text) config, and how its linears
    are quantized ("quantization", only for a quantized target: `weights.quantization`)."""
    config = target.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fingerprint = {}
    for field in _FINGERPRINT_FIELDS:
        value = getattr(text, field, None)
        if value is None:
            value = getattr(config, field, None)
        fingerprint[field] = value
    quantized = quantization(target)
    if quantized is not None:  # only then: profiles of full-precision targets keep their fingerprint
        fingerprint["quantization"] = quantized
    return fingerprint


def _target_device_dtype(target) -> tuple[torch.device, torch.dtype]:
    return model_device(target), next(target.parameters()).dtype


# -- measuring ----------------------------------------------------------------------------------------------------


def padded_costs(values: list[float]) -> list[float]:
    """Suffix minima: entry i is the cheapest of `values[i:]`, the cost of a verify of at least that many tokens.

    A verify forward's time is not monotone in its width: on a CPU, matrix-product kernels make some widths slower
    than wider ones (2 and 3 tokens against 4 or 5, measured for SmolLM2-135M), consistently across contexts and
    days. A verify can be padded with the block's further drafts to any wider width it can fill, so what a verify
    of k tokens costs is the cheapest width at or above k. The scheduler prices that itself, within the drafts a
    round has (`scheduler.SPSCurve`); this is the same curve over every profiled width, for reports and plots.
    """
    out, running = [], math.inf
    for value in reversed(values):
        running = min(running, float(value))
        out.append(running)
    return out[::-1]


def weight_bytes(target) -> int:
    """Bytes of the weights one decoding step reads: every linear's weight (the LM head included), each storage
    once. Quantized or wrapped weights count as their stored bytes: PyTorch's dynamic int8 `Linear` as its int8
    weight, a tensor subclass (torchao's) as the plain tensors it is made of (`__tensor_flatten__`), and one that
    gives neither its storage nor its parts as its elements' bytes."""
    seen, alive = {}, []  # (unpacked weights are kept alive, so that no two share an address while counted)
    for module in target.modules():
        if not isinstance(module, torch.nn.Linear) and not type(module).__name__.endswith("Linear"):
            continue
        weight = unpacked_weight(module)
        if isinstance(weight, torch.Tensor):
            alive.append(weight)
            for tensor in _stored_tensors(weight):
                try:
                    storage = tensor.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
                except (RuntimeError, NotImplementedError, TypeError):  # no storage to point at
                    seen[("tensor", id(tensor))] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _stored_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding `tensor`'s data: itself, or a subclass's inner tensors where it names them
    (`__tensor_flatten__`, as torchao's quantized weights do), whose own storage pointer PyTorch refuses to give."""
    if plain_tensor(tensor) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in _stored_tensors(getattr(tensor, name))]


def memory_floor_ms(nbytes: int, device: torch.device, repeats: int = 7) -> tuple[float, float]:
    """(the milliseconds a read of `nbytes` takes here, the read bandwidth in GB/s): a sum over a float32 tensor of
    that size on `device`, the median of `repeats` after one untimed. What a step that reads each weight once
    cannot beat: the memory floor that a forward's cost is compared with."""
    big = torch.ones(max(nbytes // 4, 1), device=device)
    big.sum()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        big.sum()
        _sync(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return seconds * 1000.0, nbytes / seconds / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@torch.no_grad()
def profile_target(
    target,
    lengths: Iterable[int] = range(1, DEFAULT_MAX_TOKENS + 1),
    context_len: int = 256,
    warmup: int = 2,
    repeats: int = 5,
    batch_sizes: Iterable[int] = (1,),
    progress: bool = True,
) -> dict:
    """Median wall-clock time of one target verify forward of k tokens on a prefilled cache of `context_len` tokens.

    For every batch size b and k in `lengths`: a (b, k) forward with the cache, cropped back after each run;
    `warmup` untimed rounds, then `repeats` timed ones, each round visiting every length once. Returns a JSON-able
    profile (format "dspark-sps-v1"): `verify_ms_measured`, the medians, keyed by "k" (batch 1) or "b,k";
    `verify_ms`, the cost of a verify of at least k tokens per batch size (`padded_costs`: the cheapest median at
    k or wider); and `sps` {B: 1000 / median ms} keyed by the verify-batch token count B = b·k (anchors included,
    Algorithm 1's B), taken from batch size 1 (else the smallest batch size profiled); with several batch sizes
    `sps_by_batch` {b: {B: steps/s}} holds them all. Token ids are random (own generator, the global RNG is untouched).
    On the CPU this is the one "measure the machine" step: first the way of the target's linears per row count
    (`verify_linears.measure`: packed, few rows or `F.linear`, kept for the target as decode loops use it), then every
    size timed that way; the profile records both (`kernels`, with the CPU model `cpu`), so a decode loop on the same
    CPU model and thread count takes the kernel choice from the profile instead of measuring again.
    """
    lengths = sorted({int(k) for k in lengths})
    batch_sizes = sorted({int(b) for b in batch_sizes})
    if not lengths or lengths[0] < 1:
        raise ValueError(f"`lengths` must be positive token counts, got {lengths}.")
    if not batch_sizes or batch_sizes[0] < 1:
        raise ValueError(f"`batch_sizes` must be positive, got {batch_sizes}.")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"Need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")
    device, dtype = _target_device_dtype(target)
    fingerprint = target_fingerprint(target)
    vocab = fingerprint["vocab_size"] or target.get_input_embeddings().num_embeddings
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and context_len + lengths[-1] > max_positions:
        context_len = max(1, max_positions - lengths[-1])
        logger.warning(f"Profiling context shortened to {context_len} tokens (max_position_embeddings).")
    generator = torch.Generator().manual_seed(0)
    # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns); older model code keeps the old one
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"

    # the machine's way for the target's linears per row count, measured once per target (`verify_linears`); each
    # width is then timed the way decode loops run it
    linears = eligible_linears(target) if device.type == "cpu" else []
    kernels = kernel_choice(target) if linears else None
    table = kernels.ensure(target, linears) if kernels is not None else None
    per_token = per_token_linears(target)

    def random_ids(b, n):
        return torch.randint(0, vocab, (b, n), generator=generator).to(device)

    measured_ms, verify_ms, sps_by_batch = {}, {}, {}
    bar = tqdm(total=len(batch_sizes) * (warmup + repeats), desc="profiling target", disable=not progress)
    try:
        for b in batch_sizes:
            cache = AppendCache()  # the cache decode rounds write in place (`ragged_cache`), not one copied per step
            target(input_ids=random_ids(b, context_len), use_cache=True, **{cache_arg: cache})
            times = {k: [] for k in lengths}
            # round robin over the lengths: a burst of load on the machine lands on every length alike instead of
            # on a few neighbouring ones
            for i in range(warmup + repeats):
                for k in lengths:
                    ids = random_ids(b, k)
                    _sync(device)
                    start = time.perf_counter()
                    with (
                        kernels.verify(target, b * k, linears) if kernels else contextlib.nullcontext(),
                        per_token_activations(target, per_token),  # as the decode loop verifies (weights.py)
                    ):
                        positions = torch.arange(context_len, context_len + k, device=device).expand(b, k)
                        mask = torch.ones(b, context_len + k, dtype=torch.long, device=device)  # as rounds pass it
                        run_target(
                            target, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            **{cache_arg: cache},
                        )  # fmt: skip
                    _sync(device)
                    elapsed = time.perf_counter() - start
                    cache.crop(-k)
                    if i >= warmup:
                        times[k].append(elapsed * 1000.0)
                bar.update(1)
            medians = [statistics.median(times[k]) for k in lengths]
            sps_by_batch[b] = {}
            for k, raw, padded in zip(lengths, medians, padded_costs(medians)):
                key = str(k) if b == 1 else f"{b},{k}"
                measured_ms[key], verify_ms[key] = raw, padded
                sps_by_batch[b][str(b * k)] = 1000.0 / raw
    finally:
        bar.close()
    profile = {
        "format": PROFILE_FORMAT,
        "device": _device_name(device),
        "dtype": _dtype_name(dtype),
        "torch_threads": torch.get_num_threads(),
        "verify_head": version(target),  # the verify kernels' version (0: none apply)
        "target": fingerprint,
        "context_len": context_len,
        "warmup": warmup,
        "repeats": repeats,
        "verify_ms": verify_ms,
        "verify_ms_measured": measured_ms,
        "sps": sps_by_batch[batch_sizes[0]],
    }
    if device.type == "cpu":
        profile["cpu"] = cpu_model()
    nbytes = weight_bytes(target)
    if nbytes:  # what every verify is compared with: reading each weight once
        floor_ms, bandwidth = memory_floor_ms(nbytes, device)
        profile["floor"] = {"weight_bytes": nbytes, "ms": floor_ms, "read_gb_per_s": bandwidth}
    if table is not None:  # rows -> [way, rows padded to], and the milliseconds of each way's pass over the linears
        profile["kernels"] = table.to_json()
    if len(batch_sizes) > 1:
        profile["sps_by_batch"] = {str(b): table for b, table in sps_by_batch.items()}
    return profile


# -- files --------------------------------------------------------------------------------------------------------


def save_profile(profile: dict, path: str | os.PathLike) -> Path:
    """Write the profile atomically (never half-written); returns the path."""
    from ..utils.files import atomic_write_json

    _validate(profile, path)
    atomic_write_json(profile, path)
    return Path(path)


def _invalid(source, why: str) -> ValueError:
    return ValueError(f"{source} is not a valid DSpark SPS profile: {why}. Re-create it with `dspark-hf profile`.")


def _validate(profile, source) -> dict:
    def bad(why):
        return _invalid(source, why)

    if not isinstance(profile, dict):
        raise bad(f"expected a JSON object, got {type(profile).__name__}")
    if profile.get("format") != PROFILE_FORMAT:
        raise bad(f'"format" is {profile.get("format")!r}, expected {PROFILE_FORMAT!r}')
    for field in ("device", "dtype"):
        if not isinstance(profile.get(field), str):
            raise bad(f'"{field}" must be a string')
    if not isinstance(profile.get("target"), dict):
        raise bad('"target" must be the target fingerprint (an object)')
    sps = profile.get("sps")
    if not isinstance(sps, dict) or not sps:
        raise bad('"sps" must be a non-empty {batch_tokens: steps_per_second} object')
    for key, value in sps.items():
        try:
            tokens, rate = int(key), float(value)
        except (TypeError, ValueError):
            raise bad(f'"sps" entry {key!r}: {value!r} is not an integer token count and a number') from None
        if tokens < 1 or not math.isfinite(rate) or rate <= 0:
            raise bad(f'"sps" entry {key!r}: {value!r} needs a token count >= 1 and a positive finite rate')
    return profile


def load_profile(path: str | os.PathLike) -> dict:
    """Read and validate a profile; ValueError with the reason on a corrupt or foreign file."""
    try:
        profile = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise _invalid(path, f"not JSON ({e})") from None
    except UnicodeDecodeError:
        raise _invalid(path, "not UTF-8 text") from None
    return _validate(profile, path)


def sps_table(profile: dict) -> dict[int, float]:
    """{verify-batch tokens B: steps per second}, what Algorithm 1 takes (`policy.VerifyPolicy`)."""
    return {int(b): float(v) for b, v in sorted(profile["sps"].items(), key=lambda kv: int(kv[0]))}


def plot_profile(profile: dict, png_path: str | os.PathLike) -> Path:
    """Verify ms and SPS vs tokens, one line per batch size (needs matplotlib; no global pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot_profile needs matplotlib: `pip install matplotlib`.") from e

    def by_batch(table: dict) -> dict[int, list[tuple[int, float]]]:
        series: dict[int, list[tuple[int, float]]] = {}
        for key, ms in table.items():
            b, k = (1, int(key)) if "," not in str(key) else map(int, str(key).split(","))
            series.setdefault(b, []).append((k, float(ms)))
        return {b: sorted(points) for b, points in sorted(series.items())}

    series, measured = by_batch(profile["verify_ms"]), by_batch(profile.get("verify_ms_measured", {}))
    fig = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(fig)
    ax_ms, ax_sps = fig.subplots(1, 2)
    for b, points in series.items():
        ks = [k for k, _ in points]
        label = f"batch {b}"
        (line,) = ax_ms.plot(ks, [ms for _, ms in points], marker="o", label=label)
        ax_sps.plot([b * k for k in ks], [1000.0 / ms for _, ms in points], marker="o", label=label)
        if b in measured:  # the raw medians, as crosses (the line: the cheapest width at or above)
            raw = measured[b]
            ax_ms.plot([k for k, _ in raw], [ms for _, ms in raw], "x", color=line.get_color(), alpha=0.6)
            ax_sps.plot(
                [b * k for k, _ in raw], [1000.0 / ms for _, ms in raw], "x", color=line.get_color(), alpha=0.6
            )
    title = "verify latency (x: measured, line: padded to the cheapest width)" if measured else "verify latency"
    ax_ms.set(xlabel="tokens per request (k)", ylabel="verify forward (ms)", title=title)
    ax_sps.set(xlabel="verify-batch tokens B", ylabel="steps / s", title="SPS(B)")
    for ax in (ax_ms, ax_sps):
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    fig.suptitle(f"{profile.get('device')} {profile.get('dtype')}, context {profile.get('context_len')}")
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return png_path


# -- finding the right profile for generate() ---------------------------------------------------------------------


def _checkpoint_dirs(drafter) -> list[Path]:
    """Local folders the drafter may have been loaded from (a Hub id resolves through the local cache only)."""
    names = [getattr(drafter, "name_or_path", None), getattr(getattr(drafter, "config", None), "_name_or_path", None)]
    dirs = []
    for name in dict.fromkeys(n for n in names if n):
        if os.path.isdir(name):
            dirs.append(Path(name))
            continue
        try:  # a Hub id: look in the local HF cache, never on the network
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(name), PROFILE_FILE)
        except Exception:  # not a repo id, no cache: nothing to find
            cached = None
        if isinstance(cached, str):
            dirs.append(Path(cached).parent)
    return dirs


def _profile_mismatch(profile: dict, target, min_tokens: int | None = None) -> str | None:
    device, dtype = _target_device_dtype(target)
    have, want = device_key(profile["device"], profile["dtype"]), device_key(device, dtype)
    if have != want:
        return f"profiled on {have}, the target runs on {want}"
    if device.type == "cpu":
        cpu, threads = profile.get("cpu"), profile.get("torch_threads")
        if cpu is not None and cpu != cpu_model():
            return f"profiled on a {cpu}, this machine is a {cpu_model()}"
        if threads is not None and threads != torch.get_num_threads():
            return f"profiled with {threads} torch threads, this process runs {torch.get_num_threads()}"
    fingerprint = target_fingerprint(target)
    stored = {field: profile["target"].get(field) for field in (*_FINGERPRINT_FIELDS, "quantization")}
    fingerprint.setdefault("quantization", None)
    if stored != fingerprint:
        return f"profiled for target {stored}, this target is {fingerprint}"
    uses = version(target)
    timed = profile.get("verify_head") or 0  # profiles before 2026-12-04 have no such field; `true` meant 1
    timed = int(timed) if isinstance(timed, (bool, int)) else -1
    if timed != uses:
        return (
            f"timed verifies with few-rows products of version {timed}; this target's verifies use version {uses} "
            "(dspark_hf.kernels.verify_head; 0: none)"
        )
    largest = max(sps_table(profile))
    if min_tokens is not None and largest < min_tokens:
        return f"covers verify batches up to {largest} tokens, the drafter's block needs {min_tokens}"
    return None


def find_profile(drafter, target) -> dict[int, float] | None:
    """The SPS table of `sps_profile.json` in the drafter's checkpoint folder, if it fits this target and hardware.

    None when there is no such file; None with a warning saying why when it is corrupt, was made on other hardware
    (device/dtype) or for another target, or covers fewer tokens than a full verify of the block (block_size + 1).
    """
    block_size = getattr(getattr(drafter, "config", None), "block_size", None)
    min_tokens = None if block_size is None else block_size + 1
    for folder in _checkpoint_dirs(drafter):
        path = folder / PROFILE_FILE
        if not path.is_file():
            continue
        try:
            profile = load_profile(path)
        except ValueError as e:
            logger.warning(f"Ignoring {path}: {e}")
            return None
        why = _profile_mismatch(profile, target, min_tokens)
        if why is not None:
            logger.warning(f"Ignoring {path}: {why}. Run `dspark-hf profile` on this machine to make a matching one.")
            return None
        use_kernels(profile, target)
        return sps_table(profile)
    return None


def use_kernels(profile: dict, target) -> bool:
    """Give `target`'s decode loops the kernel choice recorded in a matching CPU `profile` (so they do not measure
    it again); returns whether it did. A profile without one, or with an unreadable one, changes nothing."""
    kernels = profile.get("kernels")
    if not isinstance(kernels, dict) or profile.get("cpu") != cpu_model():
        return False
    try:
        table = KernelTable.from_json(kernels)
    except (KeyError, TypeError, ValueError) as e:
        logger.warning(f"The profile's kernel choice is unreadable ({e}); measuring it on first use instead.")
        return False
    choice = kernel_choice(target)
    if choice.table is None:
        choice.table = table
    return True


def _target_key(target) -> str:
    device, dtype = _target_device_dtype(target)
    return json.dumps([device_key(device, dtype), target_fingerprint(target)], sort_keys=True)


def sps_for(drafter, target) -> SPS:
    """The SPS profile Algorithm 1 uses for `drafter` verifying on `target`, cached as `drafter.sps_profile`.

    A profile the user set on the drafter wins; else `sps_profile.json` from the checkpoint folder (`find_profile`);
    else a quick on-the-fly profile (context 64, 2 repeats) with a warning. Profiles found or taken here are
    re-resolved if the same drafter later runs with another target, device or dtype.
    """
    current = getattr(drafter, "sps_profile", None)
    key = _target_key(target)
    auto = getattr(drafter, "_dspark_sps_auto", None)  # (target key, table) of a profile set here
    if current is not None and not (auto is not None and current is auto[1] and auto[0] != key):
        return current
    table = find_profile(drafter, target)
    if table is None:
        block_size = drafter.config.block_size
        logger.warning(
            'verify_policy="scheduler" found no matching sps_profile.json next to the drafter: taking a quick '
            "profile of the target now (once per drafter). For a precise one run `dspark-hf profile` and put "
            "sps_profile.json in the drafter's checkpoint folder, or set `drafter.sps_profile`."
        )
        # every chain width; for trees two more, up to the widest tree (wider verifies then take the next one up)
        widest = largest_tree(getattr(drafter.config, "tree_budget", 0)) + 1
        lengths = sorted(set(range(1, block_size + 2)) | {n for n in (12, widest) if block_size + 1 < n <= widest})
        profile = profile_target(target, lengths=lengths, context_len=64, warmup=1, repeats=2, progress=False)
        table = sps_table(profile)
    drafter.sps_profile = table
    drafter._dspark_sps_auto = (key, table)
    return table


__all__ = [
    "PROFILE_FILE",
    "PROFILE_FORMAT",
    "cpu_model",
    "device_key",
    "find_profile",
    "load_profile",
    "padded_costs",
    "plot_profile",
    "profile_target",
    "run_facts",
    "save_profile",
    "sps_for",
    "sps_table",
    "target_fingerprint",
    "use_kernels",
]
