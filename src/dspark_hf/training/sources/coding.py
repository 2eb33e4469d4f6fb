"""The `code` source: tasks built from Python standard-library functions (signature, docstring, source), generic
programming tasks across languages, and command-line questions from the NAME lines of installed man pages.
(Named `coding`, not `code`, so as not to share a name with the standard library's module.)"""

import re
from collections.abc import Iterator

from .corpora import man_page, man_pages, stdlib_files, stdlib_functions
from .records import mix, source_rng, user_record
from .vocabulary import CLI_TEMPLATES, CODE_TASKS, CODE_TEMPLATES, LANGUAGES, STDLIB_TEMPLATES


def _strip_docstring(source: str) -> str:
    return re.sub(r'(\)\s*(?:->[^:]*)?:\s*\n)(\s+)("""|\'\'\')(.*?)\3\s*\n', r"\1", source, count=1, flags=re.S)


def code_prompts(seed: int = 0) -> Iterator[dict]:
    rng = source_rng(seed, "code")
    files = stdlib_files()
    rng.shuffle(files)
    pool: list[dict] = []
    cursor, parsed, passes = [0, 0], {}, 64  # [position, cycle]
    commands = []
    man_files = list(man_pages())
    rng.shuffle(man_files)
    man_cursor = [0]

    def stdlib():
        # Parse files lazily and take a few functions from each per pass, so early prompts cover many modules.
        while not pool and cursor[0] < len(files) * passes:
            index, rnd = cursor[0] % len(files), cursor[0] // len(files)
            if index not in parsed:
                parsed[index] = stdlib_functions(files[index])
                rng.shuffle(parsed[index])
            pool.extend(parsed[index][4 * rnd : 4 * rnd + 4])
            cursor[0] += 1
            if not pool and cursor[0] == len(files) * passes and cursor[1] < 2:
                cursor[:] = [0, cursor[1] + 1]  # every function used: again, with other templates
        if not pool:
            return None
        fn = pool.pop()
        template = rng.choice(STDLIB_TEMPLATES)
        lines = fn["source"].count("\n") + 1
        if "{source" in template and not (3 <= lines <= 45):
            template = STDLIB_TEMPLATES[0]
        source = fn["source"]
        text = template.format(**{**fn, "source_nodoc": _strip_docstring(source)})
        return user_record(text, "code", "stdlib")

    def task():
        return user_record(rng.choice(CODE_TEMPLATES).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS)),
                       "code", "task")  # fmt: skip

    def cli():
        while not commands and man_cursor[0] < len(man_files):
            cmd, desc, _ = man_page(man_files[man_cursor[0]])
            man_cursor[0] += 1
            if cmd and desc and "/man1/" in man_files[man_cursor[0] - 1]:
                commands.append((cmd, desc))
        if not commands:
            return None
        cmd, desc = commands.pop()
        return user_record(rng.choice(CLI_TEMPLATES).format(cmd=cmd, desc=desc), "code", "cli")

    yield from mix(rng, [(4, stdlib), (3, task), (1 if man_files else 0, cli)])
