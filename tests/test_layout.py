"""The package's import graph (read from the source with `ast`, imports inside functions included) follows the
declared layer order: no cycles, and no module imports a module of a higher layer."""

import ast
import fnmatch
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dspark_hf"

# lowest first; a module may import its own layer and the layers below it (the subpackages of src/dspark_hf/)
LAYERS = [
    ("utils: files, prompt records, checkpoint checks, transformers' private API", ["utils", "utils.*"]),
    ("kernels: CPU products for drafting and verifying", ["kernels", "kernels.*"]),
    ("models: configs and drafters, pure nn", ["models", "models.*"]),
    ("decoding: the speculative round", ["decoding", "decoding.*"]),
    ("integrations: transformers, the Hub, other projects' formats", ["integrations", "integrations.*"]),
    ("serving: Engine, OpenAI protocol, HTTP server", ["serving", "serving.*"]),
    ("the package: public API and the shipped drafter", ["__init__", "default"]),
    ("training", ["training", "training.*"]),
    ("evaluation", ["evaluation", "evaluation.*"]),
    ("command line", ["cli", "cli.*"]),
]

# Loaded as remote code (`trust_remote_code=True`, no package installed), a drafter's modeling file routes
# generate() itself; imported as part of the package it does nothing (see the bottom of modeling_dspark.py).
ALLOWED_UPWARD = {
    ("models.modeling_dspark", "integrations.generation"),
    ("models.modeling_eagle3", "integrations.generation"),
}


def import_graph() -> dict[str, set[str]]:
    """{module: the package modules it imports}, dotted below `dspark_hf` (a package's own name for its __init__)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package and len(parts) > 1 else parts)
        package = parts if is_package and len(parts) > 1 else parts[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
                if not source or (PACKAGE / source.replace(".", "/")).is_dir():  # names may be modules
                    deps.update(f"{source}.{alias.name}".lstrip(".") for alias in node.names)
                deps.add(source or "__init__")
        graph[name] = deps
    return {name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}


def layer_of(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return index
    raise AssertionError(f"dspark_hf.{module} is in no layer: add it to LAYERS in tests/test_layout.py")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_upward_imports():
    graph = import_graph()
    upward = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, deps in sorted(graph.items())
        for b in sorted(deps)
        if layer_of(b) > layer_of(a) and (a, b) not in ALLOWED_UPWARD
    ]
    assert upward == []


def test_the_checks_can_fail():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert layer_of("cli") > layer_of("decoding.core") > layer_of("models.modeling_dspark")


def code_names(source: str) -> set[str]:
    """The names a module's code uses: its identifiers and attribute names, and strings that are a whole identifier
    (`getattr(m, "_name")`); not its comments, nor prose in docstrings."""
    import io
    import tokenize

    found = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME:
            found.add(token.string)
        elif token.type == tokenize.STRING and token.string.strip("\"'").isidentifier():
            found.add(token.string.strip("\"'"))
    return found


def private_torch_users(entry) -> set[str]:
    """The modules (dotted below dspark_hf) whose code uses the private torch name of a `PRIVATE_TORCH` entry."""
    name = entry.name.split()[0].split(".")[-1]  # "torch.ops.mkldnn._linear_pointwise" -> "_linear_pointwise"
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for path in PACKAGE.rglob("*.py")
        if name in code_names(path.read_text())
    }


def test_private_torch_names_are_used_only_where_their_table_says():
    """`utils.compat.PRIVATE_TORCH` lists, per private torch name, the modules that use it: a new use elsewhere, or
    an entry no module uses any more, fails here until the table says so."""
    from dspark_hf.utils.compat import PRIVATE_TORCH, PrivateTorchName

    assert {entry.name.split()[0].split(".")[-1] for entry in PRIVATE_TORCH} >= {"_packed_params", "_linear_pointwise"}
    for entry in PRIVATE_TORCH:
        assert private_torch_users(entry) == set(entry.used_in), entry.name
    # the check can fail: a name used in a module its entry does not list
    wrong = PrivateTorchName("torch.ops.mkldnn._linear_pointwise", ("kernels.packed_linear",), "", ())
    assert private_torch_users(wrong) != set(wrong.used_in)
    assert code_names('x = getattr(m, "_packed_params")  # _global_forward_hooks\n"""a _linear_pointwise"""') == {
        "x", "getattr", "m", "_packed_params"
    }  # fmt: skip


def resolve(dotted: str):
    """The object a dotted `dspark_hf.a.b.C.d` names: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_every_name_and_command_the_docs_show_exists():
    import re

    from dspark_hf.cli import build_parser

    docs = [PACKAGE.parents[1] / "README.md", *sorted((PACKAGE.parents[1] / "docs").glob("*.md"))]
    text = "\n".join(path.read_text(encoding="utf-8") for path in docs)
    names = set(re.findall(r"\bdspark_hf(?:\.[A-Za-z_]\w*)+", text))
    assert len(names) > 10
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert missing == []
    commands = set(re.findall(r"`dspark-hf (\w+)", text))
    subparsers = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert commands and commands <= set(subparsers.choices), commands - set(subparsers.choices)
