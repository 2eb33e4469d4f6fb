"""The `chat` source: writing/chat/advice templates over topics (a built-in list, plus WordNet nouns when
`wordnet-base` is installed), letters and comparisons, and prompts about sayings from the `fortunes` package."""

from collections.abc import Iterator

from .corpora import fortunes, wordnet_common_nouns, wordnet_entries
from .records import mix, source_rng, user_record
from .vocabulary import (
    ACTIVITIES,
    ADVICE_TEMPLATES,
    CHAT_TEMPLATES,
    FORTUNE_TEMPLATES,
    LETTER_KINDS,
    LETTER_SUBJECTS,
    RECIPIENTS,
    ROLES,
    TONES,
    TOPICS,
)


def chat_prompts(seed: int = 0) -> Iterator[dict]:
    rng = source_rng(seed, "chat")
    topics = list(TOPICS)
    common = wordnet_common_nouns()
    senses = [e for e in wordnet_entries(("noun",)) if e["words"][0] in common and len(e["words"][0]) > 2]
    says = fortunes()

    def topic():
        prompt = rng.choice(CHAT_TEMPLATES).format(t=rng.choice(topics))
        return user_record(prompt, "chat", "topic")

    def sense():
        entry = rng.choice(senses)
        word = entry["words"][0]
        article = "" if word[0].isupper() else ("an " if word[0] in "aeiou" else "a ")
        prompt = rng.choice(CHAT_TEMPLATES).format(t=article + word)
        return user_record(f"{prompt} (By '{word}' I mean {entry['gloss'].split(';')[0]}.)", "chat", "wordnet-topic")

    def advice():
        prompt = rng.choice(ADVICE_TEMPLATES).format(a=rng.choice(ACTIVITIES))
        if rng.random() < 0.6:
            prompt = f"I'm a {rng.choice(ROLES)}. {prompt}"
        return user_record(prompt, "chat", "advice")

    def letter():
        kind, tone = rng.choice(LETTER_KINDS), rng.choice(TONES)
        article = "an" if tone[0] in "aeiou" else "a"
        prompt = f"Write {article} {tone} {kind} to {rng.choice(RECIPIENTS)} about {rng.choice(LETTER_SUBJECTS)}."
        return user_record(prompt, "chat", "letter")

    def compare():
        a, b = rng.sample(topics, 2)
        form = rng.choice(["Compare {a} and {b}.", "What do {a} and {b} have in common?",
                           "Write a short story that connects {a} and {b}.", "Which is more interesting, {a} or {b}? "
                           "Argue both sides."])  # fmt: skip
        return user_record(form.format(a=a, b=b), "chat", "compare")

    def saying():
        return user_record(rng.choice(FORTUNE_TEMPLATES).format(f=rng.choice(says)), "chat", "fortune")

    makers = [(3, topic), (4 if senses else 0, sense), (2, advice), (1, letter), (1, compare)]
    yield from mix(rng, [*makers, (3 if says else 0, saying)])
