"""Quantizing a loaded target the ways people do on a CPU, for the CLI (`--quantize`) and benchmarks.

  "int8-weight"   torchao `Int8WeightOnlyConfig` (what transformers' `TorchAoConfig("int8_weight_only")` applies
                  on load): int8 weights, one scale per output channel, float activations.
  "int4-weight"   torchao `IntxWeightOnlyConfig(weight_dtype=torch.int4)`, groups of 32 inputs (one scale per output
                  channel where the input width is not a multiple of 32): torchao's int4 weight-only layout that runs
                  on a CPU (`Int4WeightOnlyConfig`'s packings need CUDA or the `mslk` kernels).
  "dynamic-int8"  PyTorch's `torch.ao.quantization.quantize_dynamic(target, {nn.Linear}, dtype=torch.qint8)`: int8
                  weights and activations quantized per call with one scale (see `kernels/weights.py` for what that
                  means for verify passes).

Only the target's linears are quantized (embeddings stay float, as both libraries do by default); the drafter borrows
them through `kernels/weights.py` whatever their kind. torchao is imported only when asked for.
"""

import warnings

import torch
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)

QUANTIZATIONS = ("int8-weight", "int4-weight", "dynamic-int8")
INT4_GROUP = 32


def _torchao():
    try:
        import torchao.quantization as tq
    except ImportError as e:
        raise ImportError(f"Quantizing with torchao needs it installed: `pip install torchao` ({e}).") from e
    return tq


def quantize_target(target: nn.Module, how: str) -> nn.Module:
    """The target with its linears quantized `how` (one of `QUANTIZATIONS`); torchao quantizes in place, dynamic
    int8 returns a new module. Raises ValueError for an unknown name, ImportError without torchao."""
    if how not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {how!r}; choose one of {', '.join(QUANTIZATIONS)}.")
    if how == "dynamic-int8":
        with warnings.catch_warnings():  # torch.ao's deprecation notice; the API is what users still call
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            return torch.ao.quantization.quantize_dynamic(target, {nn.Linear}, dtype=torch.qint8)
    tq = _torchao()
    if how == "int8-weight":
        tq.quantize_(target, tq.Int8WeightOnlyConfig())
        return target
    from torchao.quantization.granularity import PerAxis, PerGroup

    def grouped(module, name):
        return isinstance(module, nn.Linear) and module.in_features % INT4_GROUP == 0

    def per_channel(module, name):
        return isinstance(module, nn.Linear) and module.in_features % INT4_GROUP != 0

    tq.quantize_(target, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP)), grouped)
    tq.quantize_(target, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerAxis(0)), per_channel)
    return target


__all__ = ["QUANTIZATIONS", "quantize_target"]
