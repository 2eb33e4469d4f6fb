"""The `longdoc` source (opt-in): a long document pasted before a question, for drafters that must hold up on long
prompts (docs/long_context.md). Documents are the Python documentation (reStructuredText), standard-library source
and man pages installed on this machine, cut at a paragraph break to between `MIN_CHARS` and `MAX_CHARS` characters
(about 1.5k to 7.5k tokens of SmolLM2's tokenizer), then one of `QUESTIONS` about them. The target answers them, so
a drafter trains on answers whose context reaches thousands of tokens back.

The modules `dspark-hf bench --long-context` reads (`evaluation.long_context.SOURCES`) never appear here, so the
benchmark stays out of the training data.
"""

from collections.abc import Iterator

from .corpora import clean_rst, man_page, man_pages, python_doc_files, read_text, stdlib_files
from .records import source_rng, user_record


MIN_CHARS, MAX_CHARS = 6_000, 30_000
# the long-context benchmark's documents (evaluation/long_context.py SOURCES), kept out of training
BENCHMARK_MODULES = ("logging", "argparse", "pathlib", "subprocess", "difflib", "shutil", "threading", "statistics",
                     "collections", "tarfile", "typing", "zipfile", "unittest", "configparser", "socket",
                     "dataclasses")  # fmt: skip
QUESTIONS = (
    "Summarise the document above in a few sentences.",
    "What is the main purpose of what is described above? Answer briefly.",
    "List three things the text above explains, with one sentence each.",
    "Based on the text above, what would a newcomer need to know first? Explain.",
    "Explain the most important idea in the text above to a beginner.",
    "Which parts of the text above are the hardest to understand, and why? Explain them simply.",
)
FRAMES = (
    "Here is a document:\n\n{doc}\n\nQuestion: {q}",
    "{doc}\n\n{q}",
    'Read the following text.\n\n"""\n{doc}\n"""\n\n{q}',
)


def _benchmark_file(path: str) -> bool:
    name = path.replace("\\", "/")
    return any(f"/{m}.py" in name or f"/{m}/" in name or f"/{m}.rst" in name or f"/{m}.txt" in name
               for m in BENCHMARK_MODULES)  # fmt: skip


def cut_document(text: str, length: int) -> str | None:
    """The first `length` characters of `text`, ending at the last paragraph (else line) break; None if the text is
    shorter than `MIN_CHARS`."""
    if len(text) < MIN_CHARS:
        return None
    if len(text) <= length:
        return text.strip()
    end = text.rfind("\n\n", 0, length)
    if end < MIN_CHARS:
        end = text.rfind("\n", 0, length)
    return text[: end if end >= MIN_CHARS else length].strip()


def long_document_prompts(seed: int = 0) -> Iterator[dict]:
    rng = source_rng(seed, "longdoc")
    corpora = {
        "pydoc": ([p for p in python_doc_files() if not _benchmark_file(p)], lambda p: clean_rst(read_text(p))),
        "pysource": ([p for p in stdlib_files() if not _benchmark_file(p)], read_text),
        "man": (man_pages(), lambda p: man_page(p)[2]),
    }
    order = {k: rng.sample(paths, len(paths)) for k, (paths, _) in corpora.items()}
    position = dict.fromkeys(corpora, 0)

    def document(name):
        def make():
            paths, reader = corpora[name]
            if position[name] >= len(paths):
                return None  # every document used once: a long document is not worth repeating
            path = order[name][position[name]]
            position[name] += 1
            doc = cut_document(reader(path), rng.randint(MIN_CHARS, MAX_CHARS))
            if doc is None:
                return None
            text = rng.choice(FRAMES).format(doc=doc, q=rng.choice(QUESTIONS))
            return user_record(text, "longdoc", name)

        return make

    makers = [(w, k, document(k)) for k, w in (("pydoc", 3), ("pysource", 2), ("man", 1)) if corpora[k][0]]
    while makers:  # until every document was used once
        _, name, make = rng.choices(makers, [w for w, _, _ in makers])[0]
        record = make()
        if record is not None:
            yield record
        makers = [m for m in makers if position[m[1]] < len(corpora[m[1]][0])]
