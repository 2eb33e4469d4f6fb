"""The `text` source: summarise/explain/question excerpts of local text (Python docs, man pages, /usr/share/doc
READMEs, standard-library docstrings) and WordNet word-sense questions."""

from collections.abc import Iterator

from .corpora import (
    clean_rst,
    excerpt,
    man_page,
    man_pages,
    python_doc_files,
    read_text,
    readme_files,
    stdlib_docstrings,
    stdlib_files,
    wordnet_entries,
)
from .records import mix, source_rng, user_record
from .vocabulary import SYNONYM_TEMPLATES, TEXT_TEMPLATES, WORD_TEMPLATES


def text_prompts(seed: int = 0) -> Iterator[dict]:
    rng = source_rng(seed, "text")
    corpora = {
        "pydoc": (python_doc_files(), lambda p: clean_rst(read_text(p))),
        "man": (man_pages(), lambda p: man_page(p)[2]),
        "readme": (readme_files(), read_text),
        "docstring": (stdlib_files(), lambda p: "\n\n".join(stdlib_docstrings(p))),
    }
    weights = {"pydoc": 3, "man": 2, "readme": 1, "docstring": 2}
    order = {k: rng.sample(paths, len(paths)) for k, (paths, _) in corpora.items()}
    position = dict.fromkeys(corpora, 0)
    entries = wordnet_entries()
    synonyms = [e for e in entries if len(e["words"]) > 1]

    def passage(name):
        def make():
            paths, reader = corpora[name]
            if position[name] >= len(order[name]):
                position[name] = 0  # wrap: new random excerpts of the same documents
            path = order[name][position[name]]
            position[name] += 1
            text = excerpt(reader(path), rng)
            if text is None:
                return None
            return user_record(rng.choice(TEXT_TEMPLATES).format(x=text, n=rng.choice([2, 3, 4, 5])), "text", name)

        return make

    def word():
        e = rng.choice(entries)
        return user_record(rng.choice(WORD_TEMPLATES).format(w=e["words"][0], g=e["gloss"].split(";")[0], p=e["pos"]),
                       "text", "wordnet")  # fmt: skip

    def synonym():
        e = rng.choice(synonyms)
        a, b = rng.sample(e["words"], 2)
        return user_record(rng.choice(SYNONYM_TEMPLATES).format(a=a, b=b), "text", "wordnet")

    makers = [(weights[k] if corpora[k][0] else 0, passage(k)) for k in corpora]
    makers += [(1.5 if entries else 0, word), (0.5 if synonyms else 0, synonym)]
    yield from mix(rng, makers)
