"""The long-context benchmark (`dspark-hf bench --long-context`): prompt sets built from CPython's documentation and
source, a round's time split into draft / verify / bookkeeping, the decoding phase without the prefill, the table and
the plot."""

import json

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.cli import main
from dspark_hf.decoding.stats import record_draft_rounds
from dspark_hf.evaluation.harness import round_breakdown, run_evaluation
from dspark_hf.evaluation.long_context import (
    INTROS,
    QUESTIONS,
    SOURCES,
    context_rows,
    document,
    format_long_context,
    long_context_prompt,
    long_context_sets,
    parse_context_lengths,
)
from dspark_hf.utils.prompts import encode
from helpers import char_tokenizer


def long_target():
    """The tiny target with room for 1k-token prompts (RoPE needs no table; the config field is the room)."""
    target = make_target()
    target.config.max_position_embeddings = 1024
    return target


def chat_tokenizer():
    """The character tokenizer with a minimal chat template (the sets are chat records)."""
    tok = char_tokenizer(99)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    return tok


def test_context_lengths_parse():
    assert parse_context_lengths("256, 1k,2K,1.5k") == [256, 1024, 2048, 1536]
    for bad, match in (("2x", "number of tokens"), ("32", "at least 64"), (" , ", "No context lengths")):
        with pytest.raises(ValueError, match=match):
            parse_context_lengths(bad)


def test_prompts_fit_their_length_and_grow_by_context_only():
    tok = chat_tokenizer()
    short, long = (long_context_prompt(tok, n, index=1) for n in (400, 900))
    for record, n in ((short, 400), (long, 900)):
        assert 0.9 * n <= record["prompt_tokens"] <= n == record["context_length"]
        assert encode(tok, record).shape[1] == record["prompt_tokens"]
        content = record["messages"][0]["content"]
        assert content.startswith(INTROS["code"]) and content.endswith(QUESTIONS["code"])
    assert short["source"] == long["source"] == "code:" + SOURCES[1][1]
    body = short["messages"][0]["content"].rsplit("\n```", 1)[0]
    assert long["messages"][0]["content"].startswith(body)  # a longer prefix of the same file
    assert body[len(INTROS["code"]) :].rstrip("\n") in document(*SOURCES[1])
    sets = long_context_sets(tok, [400, 2000], num_prompts=2, max_prompt_tokens=700)
    assert list(sets) == ["ctx-400", "ctx-2000"]
    assert [r["source"].split(":")[0] for r in sets["ctx-400"]] == ["docs", "code"]
    assert all(r["prompt_tokens"] <= 700 for r in sets["ctx-2000"])  # capped to the model's room
    with pytest.raises(ValueError, match="no room"):
        long_context_prompt(tok, 100)


def test_rounds_split_into_draft_verify_and_bookkeeping():
    target = make_target()
    drafter = make_drafter(target)
    with record_draft_rounds() as rounds:
        target.generate(torch.randint(0, 99, (1, 9)), max_new_tokens=15, do_sample=False, assistant_model=drafter)
    assert all(r.verify_seconds > 0 and r.end >= r.start + r.seconds + r.verify_seconds for r in rounds)
    split = round_breakdown([rounds])
    assert split["rounds"] == len(rounds) == drafter.generation_stats.num_target_forwards
    assert split["draft"] + split["verify"] + split["bookkeeping"] == pytest.approx(split["round"])
    assert split["bookkeeping"] >= 0 and split["drafted"] == sum(1 for r in rounds if r.proposed)
    assert round_breakdown([[]]) is None


def test_decoding_phase_and_table():
    target, tok = long_target(), chat_tokenizer()
    sets = long_context_sets(tok, [300, 600], num_prompts=1)
    result = run_evaluation(target, tok, {"d": make_drafter(target)}, sets, 6, progress=False, time_prefill=True)
    assert result["all_identical"] is True
    for run in result["runs"]:
        assert run["prefill_seconds"] > 0 and run["plain_step_ms"] > 0 and run["decode_speedup"] > 0
    rows = context_rows(result)
    assert [r["dataset"] for r in rows] == ["ctx-300", "ctx-600"] and rows[0]["prompt_tokens"] <= 300
    assert rows[1]["verify_vs_plain"] == pytest.approx(rows[1]["verify_ms"] / rows[1]["plain_step_ms"])
    table = format_long_context(result).splitlines()
    assert table[0].split()[:3] == ["length", "drafter", "tokens"] and table[2].split()[:2] == ["600", "d"]
    plain = run_evaluation(target, tok, {"d": make_drafter(target)}, sets, 4, progress=False)
    assert "decode_speedup" not in plain["runs"][0]  # prefills are timed only on request


def test_cli_long_context(tmp_path, capsys):
    target = long_target()
    target.save_pretrained(tmp_path / "target")
    chat_tokenizer().save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "dspark")
    args = ["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "dspark"), "--limit", "1"]
    args += ["--long-context", "300,1k", "--max-new-tokens", "5", "--latency-lengths", "", "--out", str(tmp_path)]
    assert main(args) == 0
    result = json.loads((tmp_path / "evaluation.json").read_text())
    assert list(result["datasets"]) == ["ctx-300", "ctx-1k"] and result["long_context"]["lengths"] == [300, 1024]
    assert result["runs"][1]["per_prompt"][0]["prompt_tokens"] <= 1024 - 5 - 1  # capped to the target's room
    assert (tmp_path / "long_context.png").stat().st_size > 0
    assert "verify/plain" in capsys.readouterr().out
    assert main(["bench", "--long-context", "2x"]) == 2
    assert "number of tokens" in capsys.readouterr().err
