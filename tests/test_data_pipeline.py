"""`dspark-hf data`: prompt sources, held-out split, eval guard, batched generation and resumable building."""

import gzip
import hashlib
import json
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import make_target
from dspark_hf.training.dataset import TokenDataset
from dspark_hf.training.generate_data import DataConfig, build_dataset, finalize_dataset, generate_batch
from dspark_hf.training.sources import SOURCE_FUNCTIONS, build_prompts, corpora
from dspark_hf.training.sources import human as human_source
from dspark_hf.training.sources.human import (
    human_prompts,
    human_questions,
    numbered_faq_questions,
    pod_faq_questions,
    rst_faq_questions,
    sharegpt_first_turns,
)
from dspark_hf.training.sources.identity import EvalGuard, is_heldout, normalize, prompt_text
from helpers import char_tokenizer


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_tokenizer():
    tok = char_tokenizer(99)
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("source", list(SOURCE_FUNCTIONS))
def test_sources_are_deterministic_and_diverse(source):
    if source == "human" and len(human_questions()) < 120:
        pytest.skip("the optional corpora of people's questions are not installed")

    def take(seed, n=120):
        stream = SOURCE_FUNCTIONS[source](seed)
        return [next(stream) for _ in range(n)]

    first, again, other = take(0), take(0), take(1)
    assert first == again
    assert first != other
    texts = [normalize(prompt_text(r)) for r in first]
    assert len(set(texts)) >= 100  # few repeats
    assert all(r["source"] == source and r["messages"][0]["role"] == "user" for r in first)
    # (text has one kind on a bare machine: stdlib docstrings; the Debian corpora add the others)
    assert len({r["kind"] for r in first}) >= (1 if source in ("text", "human") else 2)


RST_FAQ = """General FAQ
===========

What is Spam?
-------------

Spam is a :term:`canned` meat.

How do I open a tin with :func:`os.open`?
-----------------------------------------

Carefully.

Not a question
--------------

Why do I get strange results?
  (an indented line that is not a title)
"""

POD_FAQ = """=head1 NAME

perlfaqX - Fixture

=head2 How do I read a file into a string?

Use File::Slurp.

=head2 Why don't my E<lt>E<lt>HERE documents work?

=head2 What is C<< $x->{y} >> and L<perlref|perlref/Using References>?

=head2 Perl Books
"""

NUMBERED_FAQ = """Table of Contents

    1.1. What is this FAQ?
    1.2. What is a deb
         package?

1. Definitions

1.1.\xa0What is this FAQ?

This FAQ answers questions.

1.2.\xa0What is a deb package and how do I install one on my
computer?

A deb is an archive.
"""


def _sharegpt(conversations, truncate=0):
    text = json.dumps([{"id": f"c{i}", "conversations": turns} for i, turns in enumerate(conversations)], indent=2)
    return text[: len(text) - truncate] if truncate else text


def test_faq_and_sharegpt_parsers_on_fixtures():
    assert rst_faq_questions(RST_FAQ) == ["What is Spam?", "How do I open a tin with os.open?"]
    assert pod_faq_questions(POD_FAQ) == [
        "How do I read a file into a string?",
        "Why don't my <<HERE documents work?",
        "What is $x->{y} and perlref?",
    ]
    assert numbered_faq_questions(NUMBERED_FAQ) == [
        "What is this FAQ?",
        "What is a deb package and how do I install one on my computer?",
    ]
    human, gpt = "human", "gpt"
    convs = [
        [{"from": human, "value": "Write a poem about my cat"}, {"from": gpt, "value": "Soft paws..."}],
        [{"from": gpt, "value": "Hello! (the assistant spoke first: skipped)"}],
        [],
        [{"from": human, "value": 'Explain {braces} and "quotes" in JSON'}, {"from": human, "value": "more"}],
        [{"from": human, "value": "This last conversation is cut off by the truncation"}],
    ]
    assert list(sharegpt_first_turns(_sharegpt(convs))) == [
        "Write a poem about my cat",
        'Explain {braces} and "quotes" in JSON',
        "This last conversation is cut off by the truncation",
    ]
    assert list(sharegpt_first_turns(_sharegpt(convs, truncate=30))) == [
        "Write a poem about my cat",
        'Explain {braces} and "quotes" in JSON',
    ]
    assert list(sharegpt_first_turns("")) == []


@pytest.fixture
def human_corpora(tmp_path, monkeypatch):
    """The `human` source's corpora as small files under tmp_path (a Python FAQ, a perlfaq, a Debian FAQ, ShareGPT)."""
    faq = tmp_path / "doc" / "python3.11" / "html" / "_sources" / "faq"
    faq.mkdir(parents=True)
    (faq / "general.rst.txt").write_text(RST_FAQ)
    pod = tmp_path / "perl" / "5.36.0" / "pod"
    pod.mkdir(parents=True)
    (pod / "perlfaq4.pod").write_text(POD_FAQ)
    (tmp_path / "debian-faq.en.txt").write_text(NUMBERED_FAQ)
    users = [f"Question number {i}: how would you plan a trip to city {i}?" for i in range(150)]
    users += ["hi", users[3], "x " * 1500, "\u4f60\u597d\u4f60\u597d \u4f60\u597d \u4e16\u754c\u4f60\u597d"]
    convs = [[{"from": "human", "value": u}, {"from": "gpt", "value": "..."}] for u in users]
    (tmp_path / "sharegpt.json").write_text(_sharegpt(convs))
    monkeypatch.setattr(corpora, "DOC_DIR", str(tmp_path / "doc"))
    monkeypatch.setattr(human_source, "PERL_DIR", str(tmp_path / "perl"))
    monkeypatch.setattr(human_source, "DEBIAN_FAQ_FILE", str(tmp_path / "debian-faq.en.txt"))
    monkeypatch.setattr(human_source, "SHAREGPT_FILE", str(tmp_path / "sharegpt.json"))
    human_questions.cache_clear()
    yield tmp_path
    human_questions.cache_clear()


def test_human_source_uses_peoples_questions_verbatim(human_corpora):
    pool = human_questions()
    kinds = Counter(kind for kind, _ in pool)
    # ShareGPT: 150 usable; "hi" (too short), the repeated prompt, the 3,000-character one and the non-English one are
    # dropped. The Debian FAQ's "What is this FAQ?" is about the document itself: dropped.
    assert kinds == {"python-faq": 2, "perl-faq": 3, "debian-faq": 1, "sharegpt": 150}
    texts = [text for _, text in pool]
    assert "Python question: What is Spam?" in texts  # the subject is added when the question does not name it
    assert "Perl question: How do I read a file into a string?" in texts
    assert "Debian question: What is a deb package and how do I install one on my computer?" in texts
    assert "Question number 7: how would you plan a trip to city 7?" in texts
    records = list(human_prompts(0))
    assert len(records) == len(pool)  # finite: each question once
    assert records == list(human_prompts(0)) and records != list(human_prompts(1))
    assert all(r["source"] == "human" and r["messages"][0]["role"] == "user" for r in records)
    # A plan that asks for more than the source has is topped up by the other sources.
    plan = build_prompts(400, sources=["human", "math"], seed=0)
    assert Counter(r["source"] for r in plan) == {"human": len(pool), "math": 400 - len(pool)}


def test_human_source_is_empty_without_its_corpora(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora, "DOC_DIR", str(tmp_path / "missing"))
    for name in ("PERL_DIR", "DEBIAN_FAQ_FILE", "SHAREGPT_FILE"):
        monkeypatch.setattr(human_source, name, str(tmp_path / "missing"))
    human_questions.cache_clear()
    try:
        assert human_questions() == ()
        assert Counter(r["source"] for r in build_prompts(20, sources=["human", "chat"], seed=0)) == {"chat": 20}
    finally:
        human_questions.cache_clear()


def test_build_prompts_mixes_sources_without_duplicates():
    records = build_prompts(40, seed=3)
    assert records == build_prompts(40, seed=3)
    assert len(records) == 40
    assert Counter(r["source"] for r in records) == {"chat": 10, "math": 10, "code": 10, "text": 10}
    assert len({normalize(prompt_text(r)) for r in records}) == 40


def test_heldout_split_is_stable_and_disjoint():
    records = build_prompts(400, sources=["math", "chat"], seed=0)
    texts = [prompt_text(r) for r in records]
    held = [t for t in texts if is_heldout(t, 0.2)]
    assert 40 <= len(held) <= 130
    # The split depends on the text alone: same answer for another seed's prompt list, and for re-spaced text.
    assert all(is_heldout(t, 0.2) for t in held)
    assert all(is_heldout("  " + t.upper() + " ", 0.2) for t in held)
    other = {prompt_text(r) for r in build_prompts(400, sources=["math", "chat"], seed=1)}
    assert {t for t in other if t in set(texts) and is_heldout(t, 0.2)} <= set(held)
    assert set(held).isdisjoint(t for t in texts if not is_heldout(t, 0.2))


def test_eval_guard_removes_prompts_present_in_an_eval_file(tmp_path):
    records = build_prompts(30, sources=["math", "chat"], seed=0)
    victim, wrapped = prompt_text(records[4]), prompt_text(records[7])
    eval_file = tmp_path / "eval.jsonl"
    long_eval = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    with open(eval_file, "w") as f:
        f.write(json.dumps({"turns": [victim.upper(), "a second turn"]}) + "\n\n")
        f.write(json.dumps({"turns": [long_eval]}) + "\n")
        f.write(json.dumps({"prompt": wrapped}) + "\n")
    guard = EvalGuard([eval_file])
    assert guard.contains(victim) and guard.contains(wrapped)
    assert guard.contains(f"Summarize this: {long_eval} please")  # shares a 13-word run
    assert not guard.contains("A second turn, but longer.")
    guarded = build_prompts(30, sources=["math", "chat"], seed=0, guard=guard)
    texts = {normalize(prompt_text(r)) for r in guarded}
    assert len(guarded) == 30 and guard.rejected >= 2
    assert normalize(victim) not in texts and normalize(wrapped) not in texts


def test_batched_generation_matches_per_prompt_generate():
    target, tok = make_target(), tiny_tokenizer()
    prompts = [tok(t)["input_ids"] for t in ["hi", "What is 2 + 2?", "a longer prompt, padded less", "xyz!"]]
    max_new = 12

    def single(ids, eos):
        ids = torch.tensor([ids])  # (an explicit mask: token 0 is a space here, not padding)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                              eos_token_id=eos, pad_token_id=0)  # fmt: skip
        row = out[0, ids.shape[1] :].tolist()
        return row[: row.index(eos) + 1] if eos is not None and eos in row else row

    free = [single(p, None) for p in prompts]
    # An EOS that some (not all) responses produce early, so batching must also handle finished rows.
    counts = Counter(t for r in free for t in set(r[1:-1]))
    eos = next((t for t, c in counts.most_common() if 0 < c < len(prompts)), counts.most_common(1)[0][0])
    expected = [single(p, eos) for p in prompts]
    assert any(len(e) < max_new for e in expected)
    assert generate_batch(target, prompts, max_new, pad_id=0, eos_ids=[eos]) == expected
    assert generate_batch(target, prompts[::-1], max_new, pad_id=1, eos_ids=[eos]) == expected[::-1]


def _config(**kw):
    base = dict(num_prompts=10, sources=("math", "chat"), max_new_tokens=5, batch_size=3, chunk_size=4,
                teacher_forced_tokens=200, text_chunk_tokens=48, max_prompt_tokens=160,
                heldout_fraction=0.5)  # fmt: skip
    base.update(kw)
    return DataConfig(**base)


def _arrays(path):
    with np.load(path) as f:
        return {k: f[k].copy() for k in f.files}


def test_resume_after_interruption_gives_the_same_dataset(tmp_path):
    target, tok = make_target(), tiny_tokenizer()
    target.generation_config.eos_token_id = 5
    config = _config()
    build_dataset(target, tok, tmp_path / "full", config, progress=False)

    part = tmp_path / "part"
    manifest = build_dataset(target, tok, part, config, max_chunks=1, progress=False)
    assert len(manifest["done"]) == 1 and not (part / "train.npz").exists()
    partial = finalize_dataset(part)  # merging a partial run works and leaves it resumable
    assert not partial["finalized"]
    with pytest.raises(ValueError, match="different settings"):
        build_dataset(target, tok, part, _config(seed=1), progress=False)
    manifest = build_dataset(target, tok, part, config, progress=False)
    assert manifest["finalized"] and len(manifest["done"]) == manifest["num_chunks"] == 3

    for name in ("train.npz", "heldout.npz"):
        full, resumed = _arrays(tmp_path / "full" / name), _arrays(part / name)
        assert full.keys() == resumed.keys()
        assert all(np.array_equal(full[k], resumed[k]) for k in full)

    train, held = TokenDataset.load(part / "train.npz"), TokenDataset.load(part / "heldout.npz")
    text_windows = json.loads((part / "manifest.json").read_text())["teacher_forced"]["sequences"]
    assert len(train) + len(held) == 10 + text_windows
    assert len(held) > 0
    plan = [json.loads(line) for line in gzip.open(part / "prompts.jsonl.gz", "rt")]
    held_texts = {prompt_text(r) for r in plan if r["heldout"]}
    assert held_texts.isdisjoint(prompt_text(r) for r in plan if not r["heldout"])
    starts = train.loss_start.tolist() + held.loss_start.tolist()
    assert starts.count(0) == text_windows
    seq, start = train.sequence(0)
    assert 0 < start < len(seq) <= start + config.max_new_tokens  # prompt, then a response of at most 5 tokens
    stats = json.loads((part / "stats.json").read_text())
    assert stats["complete"] and set(stats["by_source"]) == {"math", "chat", "teacher-forced"}
    ids, mask = train.batch([0, 1], seq_len=64)
    assert ids.shape == mask.shape == (2, 64)


def test_a_planned_run_resumes_without_its_eval_files(tmp_path):
    """The guard filters the plan once; a resume on a machine without the eval files generates the same plan."""
    target, tok = make_target(), tiny_tokenizer()
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"turns": ["an evaluation question"]}) + "\n")
    config = _config(teacher_forced_tokens=0, exclude_eval=(str(eval_file),))
    manifest = build_dataset(target, tok, tmp_path / "run", config, max_chunks=0, progress=False)
    assert manifest["done"] == {} and (tmp_path / "run/prompts.jsonl.gz").exists()
    eval_file.unlink()
    manifest = build_dataset(target, tok, tmp_path / "run", config, progress=False)
    assert manifest["finalized"] and len(manifest["done"]) == manifest["num_chunks"]
    with pytest.raises(FileNotFoundError):  # a new plan still needs them
        build_dataset(target, tok, tmp_path / "new", config, progress=False)


def test_plan_is_gzipped_and_a_run_with_a_plain_plan_resumes(tmp_path):
    """The plan is written compressed (same bytes for the same plan); a run planned before that, with
    `prompts.jsonl`, resumes from it, and `plan_sha256` is the hash of the JSONL text either way."""
    target, tok = make_target(), tiny_tokenizer()
    config = _config(teacher_forced_tokens=0)
    planned = [build_dataset(target, tok, tmp_path / name, config, max_chunks=0, progress=False) for name in "ab"]
    packed = (tmp_path / "a/prompts.jsonl.gz").read_bytes()
    assert packed == (tmp_path / "b/prompts.jsonl.gz").read_bytes() and packed[:2] == b"\x1f\x8b"
    text = gzip.decompress(packed)
    assert planned[0]["plan_sha256"] == hashlib.sha256(text).hexdigest()
    (tmp_path / "a/prompts.jsonl").write_bytes(text)  # what an older run holds
    (tmp_path / "a/prompts.jsonl.gz").unlink()
    done = [build_dataset(target, tok, tmp_path / name, config, progress=False) for name in "ab"]
    assert all(m["finalized"] for m in done)
    assert not (tmp_path / "a/prompts.jsonl.gz").exists()  # the old plan was used, not a new one
    for name in ("train.npz", "heldout.npz"):
        a, b = _arrays(tmp_path / "a" / name), _arrays(tmp_path / "b" / name)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_planning_stops_when_the_sources_run_dry(monkeypatch):
    """Asking for more prompts than the sources hold, with some too long, plans what there is (it once redrew
    forever, re-encoding the whole pool each time)."""
    import dspark_hf.training.generate_data as generate_data

    pool = [{"messages": [{"role": "user", "content": f"question {i} " + "long " * (200 * (i % 3 == 0))}],
             "source": "chat", "kind": "test"} for i in range(9)]  # fmt: skip
    calls = []

    def fake_build_prompts(n, sources, seed, guard=None):
        calls.append(n)
        return pool[:n]

    monkeypatch.setattr(generate_data, "build_prompts", fake_build_prompts)
    plan = generate_data.plan_prompts(tiny_tokenizer(), _config(num_prompts=20, max_prompt_tokens=160))
    assert len(plan) == 6 and len(calls) == 1  # 3 of 9 too long; nothing more to draw
