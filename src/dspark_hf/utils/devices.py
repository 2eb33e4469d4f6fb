"""Where a model computes, and whether its weights survive float16: small helpers every layer of the package uses
(the kernels, decoding, integrations, serving, training)."""

import torch
from torch import nn


def module_device(module: nn.Module) -> torch.device:
    """Where the module's inputs go: its weight's device (a hooked, offloaded module: its hook's execution device)."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    weight = getattr(module, "weight", None)  # as stored: a tensor, a method (dynamic int8), None
    if callable(weight) and not isinstance(weight, torch.Tensor):  # dynamic int8: weight() is a CPU tensor
        return torch.device("cpu")
    for tensor in (weight, getattr(module, "qweight", None), *module.parameters(), *module.buffers()):
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return torch.device("cpu")


def model_device(model: nn.Module) -> torch.device:
    """Where a model computes: its first parameter's device, or, for a model offloaded with accelerate (weights on
    the meta device until a hook moves them in), its hooks' execution device."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "meta":
        return first.device
    for module in model.modules():
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return torch.device("cpu") if first is None else first.device


FLOAT16_TINY = torch.finfo(torch.float16).tiny  # 2^-14: float16's smallest normal number


def below_float16(model: nn.Module) -> list[str]:
    """Names of `model`'s floating parameters whose every nonzero value lies below float16's normal range (under
    2^-14 in magnitude), where float16 keeps at most a few bits of them or none: e.g. the q/k projections of an
    exact QK-norm twin (`tools/make_exportable_drafter.py`, ~1e-8). Such a model must run, and be stored, in
    bfloat16 or float32; in float16 those products vanish and it drafts noise."""
    names = []
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.numel():
            peak = float(param.detach().abs().max())
            if 0 < peak < FLOAT16_TINY:
                names.append(name)
    return names


def below_float16_text(names: list[str]) -> str:
    """The shared part of every message about `below_float16`'s `names` (the callers add what to do instead)."""
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    return (
        f"weights of this drafter ({shown}) lie below float16's normal range (e.g. the q/k projections of an exact "
        "QK-norm twin, ~1e-8), so float16 rounds them away and it would draft noise"
    )


__all__ = ["FLOAT16_TINY", "below_float16", "below_float16_text", "model_device", "module_device"]
