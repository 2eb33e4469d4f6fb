"""Readers of the local corpora: text that installs offline from a package registry (docs/data.md lists each, its
licence and its install command). Each is optional except the Python standard library, which is always on disk;
a missing corpus reads as empty.

- Python standard library: files, public documented functions (signature, docstring, source), longer docstrings.
- `fortunes` (Debian): sayings.
- `wordnet-base` (Debian): synsets (words, part of speech, gloss) and the familiar nouns.
- man pages under /usr/share/man: command, one-line description and plain text.
- `python3.X-doc` (Debian): the reStructuredText sources of the Python documentation.
- READMEs that installed Debian packages ship in /usr/share/doc.

File lists are sorted, so whatever draws from them with a seeded generator is deterministic.
"""

import ast
import functools
import glob
import gzip
import os
import random
import re
import sysconfig
import textwrap


# Locations of the optional Debian corpora (see docs/data.md for the packages).
FORTUNE_DIR = "/usr/share/games/fortunes"
WORDNET_DIR = "/usr/share/wordnet"
MAN_DIR = "/usr/share/man"
DOC_DIR = "/usr/share/doc"


def read_text(path: str) -> str:
    """The text of a file (gunzipped if it ends in .gz, undecodable bytes replaced); empty if it cannot be read."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            return f.read()
    except (OSError, EOFError):
        return ""


def stdlib_files() -> list[str]:
    """Python files of the running interpreter's standard library, without its test suites and demos."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "turtledemo", "ensurepip",
            "__phello__", "__pycache__"}  # fmt: skip
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith(("config-", "test_")))
        names = [f for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test_")]
        files.extend(os.path.join(dirpath, f) for f in names)
    return sorted(files)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, sysconfig.get_paths()["stdlib"])[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def stdlib_functions(path: str) -> list[dict]:
    """Public documented functions and methods of one standard-library file: name, signature, docstring, source."""
    source = read_text(path)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    module = _module_name(path)
    lines = source.splitlines(keepends=True)
    found = []

    def visit(body, prefix=""):
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and not prefix:
                visit(node.body, node.name + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node) or ""
                if len(doc) < 25:
                    continue
                args = ast.unparse(node.args)
                if prefix and args.startswith("self"):
                    args = args[4:].lstrip(", ")
                segment = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).rstrip()
                found.append(
                    dict(module=module, name=prefix + node.name, signature=f"{node.name}({args})",
                         doc=doc, summary=doc.split("\n\n")[0].replace("\n", " ").strip(), source=segment)
                )  # fmt: skip

    visit(tree.body)
    return found


def stdlib_docstrings(path: str) -> list[str]:
    """Longer module, class and function docstrings of one standard-library file (text to summarise)."""
    try:
        tree = ast.parse(read_text(path))
    except (SyntaxError, ValueError):
        return []
    docs = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 300:
                docs.append(doc)
    return list(dict.fromkeys(docs))


@functools.lru_cache(maxsize=2)
def fortunes() -> tuple[str, ...]:
    """Sayings from the `fortunes` Debian package (plain-text files separated by `%` lines), English only."""
    items = []
    for path in sorted(glob.glob(os.path.join(FORTUNE_DIR, "*"))):
        if "." in os.path.basename(path) or not os.path.isfile(path):
            continue
        for item in read_text(path).split("\n%\n"):
            item = item.strip("%\n ").strip()
            if 20 <= len(item) <= 500:
                items.append(item)
    return tuple(dict.fromkeys(items))


@functools.lru_cache(maxsize=4)
def wordnet_entries(pos_files=("noun", "verb", "adj", "adv")) -> tuple[dict, ...]:
    """WordNet 3.0 synsets (`wordnet-base`): words, part of speech and gloss, in file order."""
    names = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
    entries = []
    for pos in pos_files:
        path = os.path.join(WORDNET_DIR, f"data.{pos}")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(" ") or " | " not in line:
                    continue
                head, gloss = line.split(" | ", 1)
                fields = head.split()
                count = int(fields[3], 16)
                words = [fields[4 + 2 * i].replace("_", " ") for i in range(count)]
                words = [re.sub(r"\(\w+\)$", "", w) for w in words]
                entries.append(dict(words=words, pos=names[pos], gloss=gloss.strip(), lexfile=int(fields[1])))
    return tuple(entries)


@functools.lru_cache(maxsize=2)
def wordnet_common_nouns() -> frozenset[str]:
    """Nouns tagged at least once in WordNet's semantic concordance (`index.noun` tagsense_cnt > 0): familiar words."""
    path = os.path.join(WORDNET_DIR, "index.noun")
    common = set()
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(" "):
                    continue
                fields = line.split()
                p_cnt = int(fields[3])
                if int(fields[5 + p_cnt]) > 0:
                    common.add(fields[0].replace("_", " "))
    return frozenset(common)


_ROFF_SKIP = {"TH", "Dd", "Dt", "Os", "so", "ds", "de", "nr", "if", "ie", "el", "ig", "ft", "ps", "ne", "in", "ti",
              "ll", "na", "nh", "hy", "ad", "fi", "nf", "EX", "EE", "RS", "RE", "UR", "UE", "MT", "ME", "TQ", "tr",
              "cs", "ss", "mso", "rm", "ta", "bp", "Bl", "El", "Bd", "Ed", "Pp", "PD", "IX", "ev", "lf", "rr", "as",
              "TS", "TE", "Sh", "Ss", "Nm", "Nd"}  # fmt: skip


def roff_to_text(source: str) -> str:
    """Rough plain text of a man page (man or mdoc macros): enough to read and summarise, not a formatter."""
    out = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"", ".\\}", '\\"')):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            macro, rest = (parts[0] if parts else ""), (parts[1] if len(parts) > 1 else "")
            rest = rest.replace('"', "")
            if macro in ("SH", "Sh"):
                out += ["", rest.upper()]
            elif macro in ("SS", "Ss"):
                out += ["", rest]
            elif macro == "Nm":
                out.append(rest)
            elif macro == "Nd":
                out.append("- " + rest)
            elif macro in ("PP", "P", "LP", "sp", "Pp"):
                out.append("")
            elif macro in ("IP", "It") and rest:
                out.append(rest.split(" ")[0] if macro == "IP" else rest)
            elif macro in _ROFF_SKIP or not rest:
                continue
            else:
                out.append(rest)
        else:
            out.append(line)
    text = "\n".join(out)
    text = re.sub(r"\\f(\[[^\]]*\]|\(..|.)", "", text)
    for old, new in (("\\-", "-"), ("\\(aq", "'"), ("\\(dq", '"'), ("\\(em", "--"), ("\\(en", "-"), ("\\(bu", "*"),
                     ("\\(co", "(c)"), ("\\(lq", '"'), ("\\(rq", '"'), ("\\e", "\\"), ("\\&", ""), ("\\ ", " "),
                     ("\\|", ""), ("\\^", ""), ("\\c", ""), ("\\%", "")):  # fmt: skip
        text = text.replace(old, new)
    text = re.sub(r"\\\(..|\\\[[^\]]*\]|\\[*n]\(..|\\[*n].|\\s[-+]?\d+|\\[hvwo]'[^']*'", "", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


@functools.lru_cache(maxsize=2)
def man_pages(per_family: int = 25) -> tuple[str, ...]:
    """Paths of the English man pages installed under /usr/share/man/man[1-8] (those of installed packages).

    At most `per_family` pages (evenly spaced by name) of each family of names (`git-*`, `gcloud_*`, ...), so one
    package with thousands of sub-command pages does not crowd out the rest."""
    paths = []
    for section in range(1, 9):
        paths += glob.glob(os.path.join(MAN_DIR, f"man{section}", "*"))
    families: dict[str, list[str]] = {}
    for path in sorted({os.path.realpath(p) for p in paths if os.path.isfile(p)}):
        families.setdefault(re.split(r"[_.-]", os.path.basename(path))[0], []).append(path)
    kept = []
    for members in families.values():
        step = max(1, len(members) / per_family)
        kept += [members[int(i * step)] for i in range(min(per_family, len(members)))]
    return tuple(sorted(kept))


def man_page(path: str) -> tuple[str, str, str]:
    """(command, one-line description, plain text) of one man page; empty strings for a redirect."""
    text = roff_to_text(read_text(path))
    match = re.search(r"^NAME\s*\n+\s*(.+?)\s+-+\s+(.+?)\s*$", text, re.M)
    if not match or len(text) < 200:
        return "", "", ""
    return match.group(1).split(",")[0].strip(), match.group(2).strip(), text


def python_doc_files() -> list[str]:
    """reStructuredText sources of the Python documentation (`python3.X-doc`), if installed."""
    found = glob.glob(os.path.join(DOC_DIR, "python3*", "html", "_sources", "**", "*.txt"), recursive=True)
    return sorted({os.path.realpath(p) for p in found})


def clean_rst(text: str) -> str:
    """reStructuredText to readable text: roles to their titles, no directives, no underline rows."""
    text = re.sub(r":[\w:+-]+:`~?!?([^`<]+?)(?:\s*<[^>]*>)?`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"`([^`<]+?)(?:\s*<[^>]*>)?`_+", r"\1", text)
    lines = [ln for ln in text.splitlines() if not re.fullmatch(r"\s*([=\-~^*#\"'+`.]){3,}\s*", ln)]
    lines = [ln for ln in lines if not re.match(r"\s*\.\. ", ln) and not re.match(r"\s+:\w[\w-]*:", ln)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def readme_files() -> list[str]:
    """README files that installed Debian packages ship in /usr/share/doc/<package>/."""
    paths = glob.glob(os.path.join(DOC_DIR, "*", "README*"))
    return sorted(p for p in paths if os.path.isfile(p) and not p.endswith((".html", ".pdf", ".png")))


def excerpt(text: str, rng: random.Random, min_chars: int = 300, max_chars: int = 1400) -> str | None:
    """Consecutive paragraphs of `text` from a random start, between min_chars and max_chars long (None if none)."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 40]
    if not paragraphs:
        return None
    for _ in range(4):
        start = rng.randrange(len(paragraphs))
        parts, size = [], 0
        for p in paragraphs[start:]:
            if size + len(p) > max_chars:
                break
            parts.append(p)
            size += len(p) + 2
            if size >= min_chars and rng.random() < 0.5:
                break
        if size >= min_chars:
            return "\n\n".join(parts)
    return None
