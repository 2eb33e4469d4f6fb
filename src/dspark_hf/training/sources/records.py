"""What every prompt source shares: its seeded generator, the record it yields, and a weighted mix of makers."""

import random
from collections.abc import Callable, Iterator


def source_rng(seed: int, name: str) -> random.Random:
    """The generator of one source (or step) `name`: sources draw only from it, so each is deterministic alone."""
    return random.Random(f"{seed}:{name}")


def user_record(text: str, source: str, kind: str) -> dict:
    """A one-turn prompt record: `{"messages": [{"role": "user", "content": text}], "source", "kind"}`."""
    return {"messages": [{"role": "user", "content": text}], "source": source, "kind": kind}


def mix(rng: random.Random, makers: list[tuple[float, Callable[[], dict | None]]]) -> Iterator[dict]:
    """Endless weighted mix of record makers; a maker returning None is skipped this time."""
    makers = [(w, m) for w, m in makers if w > 0]
    weights = [w for w, _ in makers]
    while makers:
        record = rng.choices(makers, weights)[0][1]()
        if record is not None:
            yield record
