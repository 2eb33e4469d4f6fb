"""The picture of speculation (`evaluation/view.py`): text as decoded, colours on drafted tokens, the legend."""

import re

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from conftest import make_drafter
from dspark_hf.evaluation.view import origins_from, render_reply, reply_html, rounds_from, token_pieces
from helpers import char_tokenizer, pin_drafter


ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
ORIGINS = [("target", 0), ("drafter", 1), ("drafter", 2), ("target", 0), ("lookup", 1), ("target", 0)]


def test_plain_text_equals_decode_and_legend_counts():
    tok = char_tokenizer(99)
    ids = tok.encode("hello!")
    out = render_reply(tok, ids, ORIGINS, color=False)
    text, legend = out.split("\n")
    assert text == tok.decode(ids) == "hello!"
    assert not ESCAPE.search(out)
    # 5 tokens after the prefill's over 2 verify passes (the target's tokens after the first)
    assert legend.startswith("drafter 2 (depth 1 2)  lookup 1  target 3  τ = 2.50 tokens per verify pass (2 passes")


def test_colours_sit_on_drafted_tokens_only():
    tok = char_tokenizer(99)
    out = render_reply(tok, tok.encode("hello!"), ORIGINS)
    text = out.split("\n")[0]
    assert ESCAPE.sub("", text) == "hello!"
    # depth 1 and 2 greens, the lookup's blue; the target's own tokens uncoloured
    assert text == "h\x1b[38;5;157me\x1b[0m\x1b[38;5;120ml\x1b[0ml\x1b[38;5;75mo\x1b[0m!"
    assert "\x1b[38;5;157m" in out.split("\n")[1]


def test_rounds_count_a_pass_cut_before_its_bonus():
    tok = char_tokenizer(99)
    origins = [("target", 0), ("drafter", 1), ("target", 0), ("drafter", 1), ("drafter", 2)]  # last pass stopped
    assert "τ = 4.00" in render_reply(tok, tok.encode("abcde"), origins, color=False)
    assert "τ = 2.00 tokens per verify pass (2 passes" in render_reply(
        tok, tok.encode("abcde"), origins, color=False, rounds=[2, 2]
    )


def test_multi_byte_character_belongs_to_the_token_completing_it():
    # GPT-2 byte-level symbols: "é" is the bytes C3 A9, written "Ã" and "©"
    vocab = {c: i for i, c in enumerate(["c", "a", "f", "Ã", "©"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="c"))
    tok.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = [0, 1, 2, 3, 4]
    assert token_pieces(tok, ids) == ["c", "a", "f", "", "é"]
    out = render_reply(tok, ids, [("target", 0)] * 3 + [("drafter", 1), ("drafter", 2)])
    assert out.split("\n")[0] == "caf\x1b[38;5;120mé\x1b[0m" and tok.decode(ids) == "café"


def test_html_escapes_the_text():
    tok = char_tokenizer(99)
    ids = tok.encode("<script>")
    page = reply_html(tok, ids, [("target", 0)] + [("drafter", 1)] * 6 + [("target", 0)])
    assert "<script>" not in page and "&lt;" in page and "&gt;" in page
    reply, legend = page.split("\n")
    assert reply.count("<span") == 6  # the drafted tokens; the target's own are unstyled
    assert "τ = 7.00" in legend and "drafter</span> 6" in legend


def test_generate_with_a_pinned_drafter(target):
    tok = char_tokenizer(99)
    ids = torch.randint(0, 99, (1, 4))
    ref = target.generate(ids, do_sample=False, max_new_tokens=13)
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), ref, diverge_at=2)
    out = target.generate(ids, do_sample=False, max_new_tokens=13, assistant_model=drafter)
    new = out[0, 4:].tolist()
    stats = drafter.generation_stats
    origins = origins_from(stats)
    assert origins == ([("target", 0)] + [("drafter", 1), ("drafter", 2), ("target", 0)] * 4)[:13]
    shown = render_reply(tok, new, origins, rounds=rounds_from(stats))
    text, legend = shown.split("\n")
    assert ESCAPE.sub("", text) == tok.decode(new)
    # each round: two drafts, light then deeper green, then the target's bonus uncoloured
    assert re.findall(r"\x1b\[38;5;(\d+)m", text) == ["157", "120"] * 4
    assert f"τ = {stats.acceptance_length:.2f}" in legend and "drafter 8 (depth" in ESCAPE.sub("", legend)
