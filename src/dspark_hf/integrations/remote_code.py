"""Remote code: the package modules a checkpoint folder ships for `trust_remote_code=True`, and the Hub
`custom_generate/` folder, for users who do not install this package.

transformers loads remote code from one flat folder and fetches only the files named by `from .module import ...`
lines (one dot). The package is layered into subpackages, so `write_flat` copies the modules side by side and
rewrites their relative imports to that form. `MODULES` is the explicit list; `tests/test_remote_code.py` checks it
is exactly what the drafters and the generation hook import, and loads both folders in a process without the package.
"""

import ast
import json
import os
import re
from pathlib import Path

from ..utils.files import atomic_write_text


PACKAGE = Path(__file__).resolve().parents[1]

# Dotted names below `dspark_hf`, lowest layer first: everything `models.modeling_dspark`,
# `models.modeling_eagle3` and `integrations.generation` import, directly or not (imports inside functions too).
MODULES = (
    "utils.files",
    "utils.checkpoints",
    "utils.compat",
    "utils.devices",
    "kernels.options",
    "kernels.fingerprint",
    "kernels.few_rows",
    "kernels.weights",
    "kernels.runtime",
    "kernels.packed_linear",
    "kernels.verify_attention",
    "kernels.verify_head",
    "kernels.verify_linears",
    "kernels.lean_forward",
    "kernels.threads",
    "kernels.freshness",
    "models.settings",
    "models.configuration_dspark",
    "models.configuration_eagle3",
    "models.heads",
    "models.modeling_dspark_layers",
    "models.modeling_dspark_gemma4",
    "models.modeling_dspark",
    "models.modeling_eagle3",
    "decoding.stats",
    "decoding.randomness",
    "decoding.acceptance",
    "decoding.scheduler",
    "decoding.ragged_cache",
    "decoding.rows",
    "decoding.trees",
    "decoding.lookup",
    "decoding.gate",
    "decoding.profiling",
    "decoding.policy",
    "decoding.drafting",
    "decoding.core",
    "integrations.generation",
)
ROOTS = ("models.modeling_dspark", "models.modeling_eagle3", "integrations.generation")

_IMPORT_LINE = re.compile(r"^(\s*from\s+)(\.+[\w.]*)(\s+import\b)")


def _resolve(module: str, node: ast.ImportFrom) -> tuple[list[str], bool]:
    """The package modules a relative `from ... import ...` in `module` names (dotted, below `dspark_hf`), and
    whether they are the imported names (`from ..kernels import verify_head`) rather than the source."""
    package = module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    source = ".".join([*base, node.module] if node.module else base)
    if not source or (PACKAGE / source.replace(".", "/")).is_dir():  # a package: the names are its modules
        return [f"{source}.{alias.name}".lstrip(".") for alias in node.names], True
    return [source], False


def imports_of(module: str) -> dict[int, tuple[list[str], bool]]:
    """{line number: `_resolve`} for every relative import of `module`, in functions too."""
    tree = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
    nodes = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    return {node.lineno: _resolve(module, node) for node in nodes}


def closure(roots=ROOTS) -> set[str]:
    """`roots` and every package module they import, directly or not."""
    found, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in found:
            found.add(module)
            todo += [m for targets, _ in imports_of(module).values() for m in targets]
    return found


def flat_source(module: str) -> str:
    """The source of `module` with its relative imports rewritten for a flat folder of `MODULES`:
    `from ..decoding.core import X` -> `from .core import X`, `from ..kernels import verify_head` -> `from . import
    verify_head`."""
    lines = (PACKAGE / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8").split("\n")
    for lineno, (targets, names_are_modules) in imports_of(module).items():
        missing = [t for t in targets if t not in MODULES]
        if missing:
            raise RuntimeError(
                f"dspark_hf.{module} imports {missing}, which remote code does not ship: add to MODULES."
            )
        match = _IMPORT_LINE.match(lines[lineno - 1])
        if match is None:
            raise RuntimeError(
                f"dspark_hf.{module}:{lineno}: start a relative import on its line: `from .x import y`."
            )
        source = "." if names_are_modules else "." + targets[0].rsplit(".", 1)[-1]
        lines[lineno - 1] = match.group(1) + source + lines[lineno - 1][match.end(2) :]
    return "\n".join(lines)


def write_flat(folder: str | os.PathLike, modules=MODULES) -> list[Path]:
    """Copy `modules` into `folder`, side by side, imports rewritten; returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = [m.rsplit(".", 1)[-1] for m in modules]
    if len(set(names)) != len(names):
        raise RuntimeError(f"Remote-code modules need distinct file names: {sorted(names)}.")
    written = []
    for module, name in zip(modules, names):
        path = folder / f"{name}.py"
        atomic_write_text(flat_source(module), path)
        written.append(path)
    return written


def write_remote_code(model, folder: str | os.PathLike) -> None:
    """After `save_pretrained` of one of this package's drafters: the modules and the config's `auto_map`, so that
    `AutoModel.from_pretrained(folder, trust_remote_code=True)` works without this package. Other classes (a user's
    subclass defined elsewhere) get nothing."""
    model_module, config_module = type(model).__module__, type(model.config).__module__
    prefix = f"{__package__.rsplit('.', 1)[0]}."
    if not (model_module.startswith(prefix) and config_module.startswith(prefix)):
        return
    write_flat(folder)
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = {
        "AutoConfig": f"{config_module.rsplit('.', 1)[-1]}.{type(model.config).__name__}",
        "AutoModel": f"{model_module.rsplit('.', 1)[-1]}.{type(model).__name__}",
    }
    atomic_write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", config_path)
