"""Third-party notices at import time that tell a dspark-hf user nothing, dropped narrowly.

Importing any transformers model class imports transformers' quantizers, and with them torchao when it is installed
(the `quantization` and `dev` extras). On a CPU build of torch, torchao's import logs that its CUDA extensions
(`_C_mxfp8`, `_C_cutlass_90a`) failed to load, and torch logs that torchao registers its Enums in a deprecated way:
four lines on stderr before every `dspark-hf` command, `--help` included. `import_torchao_quietly()` imports torchao
first, as transformers' quantizers do (`dspark_hf/__init__.py` calls it before anything imports transformers'
models), dropping exactly those records while it imports; every other message of torchao and torch, and all of
ours, stays.
"""

import contextlib
import logging
import sys
from collections.abc import Callable

import torch


def _torchao_extension_failure(record: logging.LogRecord) -> bool:
    """torchao's "Failed to load .../torchao/_C*.so" on a torch without CUDA, where its CUDA extensions cannot load."""
    message = record.getMessage()
    return torch.version.cuda is None and message.startswith("Failed to load ") and "torchao" in message


def _torchao_enum_registration(record: logging.LogRecord) -> bool:
    """torch's deprecation notice for an Enum that torchao registers as a pytree constant."""
    cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return "is an Enum subclass" in str(record.msg) and getattr(cls, "__module__", "").startswith("torchao")


@contextlib.contextmanager
def _dropping(logger_name: str, matches: Callable[[logging.LogRecord], bool]):
    """Within the block, the records of one logger for which `matches` is true are dropped."""
    logger = logging.getLogger(logger_name)
    drop = lambda record: not matches(record)  # noqa: E731 (a logging filter may be any callable)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def import_torchao_quietly() -> None:
    """Import transformers' quantizers, and so torchao if transformers uses it, without torchao's import-time notices
    described above. An import that fails is left to transformers, which imports it next and reports the failure as
    it always does."""
    if "torchao" in sys.modules:
        return
    from transformers.utils import is_torchao_available

    if not is_torchao_available():
        return
    with (
        _dropping("torchao", _torchao_extension_failure),
        _dropping("torch.utils._pytree", _torchao_enum_registration),
        contextlib.suppress(Exception),  # a failure recurs, and is reported, where transformers imports it next
    ):
        import transformers.quantizers  # noqa: F401 (torchao, and the parts of it that transformers uses)


__all__ = ["import_torchao_quietly"]
