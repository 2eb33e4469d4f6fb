"""The long-context benchmark (`dspark-hf bench --long-context`): prompt sets built from CPython's documentation and
source, a round's time split into draft / verify / bookkeeping, the decoding phase without the prefill, the table and
the plot."""

import json
import time

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf import DSparkDraftModel
from dspark_hf.cli import main
from dspark_hf.decoding.stats import record_draft_rounds
from dspark_hf.evaluation.harness import (
    FirstTokenClock,
    RoundLog,
    _decode_phase_entry,
    round_breakdown,
    run_evaluation,
)
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
from dspark_hf.integrations.deepspec import export_deepspec
from dspark_hf.integrations.export import check_exportable, export_blockers, window_blockers
from dspark_hf.integrations.hub import model_card
from dspark_hf.integrations.speculators import speculators_config_dict
from dspark_hf.training import make_blocks
from dspark_hf.training.config import DSparkTrainingConfig
from dspark_hf.training.generate_data import LONG_PROMPT_TOKENS, DataConfig
from dspark_hf.training.sources import longdoc
from dspark_hf.training.sources.longdoc import long_document_prompts
from dspark_hf.training.step import drafter_block_hidden, target_features
from dspark_hf.training.trainer import build_drafter
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
    result = run_evaluation(target, tok, {"d": make_drafter(target)}, sets, 6, progress=False)
    assert result["all_identical"] is True
    for run in result["runs"]:
        assert run["prefill_seconds"] > 0 and run["plain_step_ms"] > 0 and run["decode_speedup"] > 0
        assert run["prefill_seconds"] < run["seconds"] / run["num_prompts"]
        assert 0 < run["plain_prefill_seconds"] < run["seconds"] / run["num_prompts"] * run["speedup"]
    rows = context_rows(result)
    assert [r["dataset"] for r in rows] == ["ctx-300", "ctx-600"] and rows[0]["prompt_tokens"] <= 300
    assert rows[1]["verify_vs_plain"] == pytest.approx(rows[1]["verify_ms"] / rows[1]["plain_step_ms"])
    runs = {run["dataset"]: run for run in result["runs"]}
    for row in rows:
        run = runs[row["dataset"]]
        reached, accepted = run["position_reached"][0], sum(run["position_accepted"])
        assert reached and row["tau_drafted"] == pytest.approx(1 + accepted / reached)
        assert row["tau_drafted"] >= row["tau"]  # rounds without drafts count one token each in τ
    table = format_long_context(result).splitlines()
    assert table[0].split()[:3] == ["length", "drafter", "tokens"] and table[2].split()[:2] == ["600", "d"]
    assert "τ drafted" in table[0]
    assistant = make_target(num_layers=1, seed=3)  # transformers' own assistant: no verify timings, no split
    other = run_evaluation(target, tok, {"a": assistant}, {"x": sets["ctx-300"]}, 4, progress=False)
    assert "decode_speedup" not in other["runs"][0] and other["runs"][0]["round_ms"] is None


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
    assert result["padded_baseline"] is False  # a third long prefill per prompt only on request
    assert (tmp_path / "long_context.png").stat().st_size > 0
    assert "verify/plain" in capsys.readouterr().out
    assert main(["bench", "--long-context", "2x"]) == 2
    assert "number of tokens" in capsys.readouterr().err


# -- the bounded context window (`DSparkConfig.context_window`) -----------------------------------------------------


@torch.no_grad()
def test_window_in_training_equals_the_drafter_on_the_last_w_features(target):
    """The training mask with a window gives each block what the drafter gives on the W features before it alone."""
    window = 5
    drafter = make_drafter(target, context_window=window)
    ids = torch.randint(0, 99, (1, 20))
    blocks = make_blocks(ids, torch.ones(1, 20, dtype=torch.bool), 4, 6, torch.Generator().manual_seed(2), window)
    feats, _ = target_features(target, ids, drafter.config.target_layer_ids)
    embed = target.get_input_embeddings()
    hidden = drafter_block_hidden(drafter, feats, ids, blocks, embed)
    anchors = blocks.anchors[0].tolist()
    assert max(anchors) > window + 1  # some blocks do lose context to the window
    for n, a in enumerate(anchors):
        start = max(a - window, 0)
        ref = drafter(
            noise_embeds=drafter.block_input_embeds(ids[:, a : a + 1], embed),
            context_hidden_states=feats[:, start:a] if a else None,
            position_ids=torch.arange(start, a + 4)[None],
        ).last_hidden_state
        torch.testing.assert_close(hidden[0, n], ref[0], atol=1e-5, rtol=1e-5)


def windowed_block_passes(target, drafter, prompt, new_tokens: int) -> list[int]:
    """Decode `prompt` greedily with a windowed drafter (W = `context_window`, blocks of 4), check the output is plain
    greedy's, the drafter cache never holds more than W context entries, and every block pass saw exactly the W
    committed positions before its anchor (against the drafter run on the final sequence's features). Returns the
    passes' anchors."""
    window, passes = drafter.config.context_window, []

    def spy(module, args, kwargs, output):
        passes.append((kwargs["position_ids"][0, -4].item(), output.last_hidden_state.clone()))
        assert kwargs["cache"].get_seq_length() <= window + 4  # W context entries + this block's own (cropped after)

    handle = drafter.register_forward_hook(spy, with_kwargs=True)
    out = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter)
    handle.remove()
    assert torch.equal(out, target.generate(prompt, max_new_tokens=new_tokens, do_sample=False))
    feats, _ = target_features(target, out, drafter.config.target_layer_ids)
    embed = target.get_input_embeddings()
    for anchor, hidden in passes:
        ref = drafter(
            noise_embeds=drafter.block_input_embeds(out[:, anchor : anchor + 1], embed),
            context_hidden_states=feats[:, anchor - window : anchor],
            position_ids=torch.arange(anchor - window, anchor + 4)[None],
        ).last_hidden_state
        torch.testing.assert_close(hidden, ref, atol=1e-4, rtol=1e-4)
    return [anchor for anchor, _ in passes]


@torch.no_grad()
def test_windowed_decoding_drafts_from_the_last_w_features_and_stays_lossless(target):
    """In generate(), every block pass sees exactly the W committed positions before its anchor, the drafter cache
    never holds more, and the output is plain greedy's."""
    drafter = make_drafter(target, context_window=6, verify_policy="fixed")
    assert len(windowed_block_passes(target, drafter, torch.randint(0, 99, (1, 17)), 24)) > 3


@torch.no_grad()
def test_windowed_drafts_after_plain_rounds_see_the_last_w_features(target, monkeypatch):
    """Rounds kept plain (the draft gate) add their positions to a row's context piece by piece, keeping only what
    the window reaches; the next draft still sees exactly the W positions before its anchor."""
    from dspark_hf.decoding.core import SpeculativeDecoder

    window, rounds = 4, []
    drafter = make_drafter(target, context_window=window, verify_policy="fixed")
    pays = SpeculativeDecoder._drafting_pays
    monkeypatch.setattr(  # plain for rounds 2..9: 8 positions pile up, twice the window
        SpeculativeDecoder,
        "_drafting_pays",
        lambda self: rounds.append(0) or (not 2 <= len(rounds) <= 9 and pays(self)),
    )
    anchors = windowed_block_passes(target, drafter, torch.randint(0, 99, (1, 11)), 20)
    assert any(b - a >= 2 * window for a, b in zip(anchors, anchors[1:]))  # a draft after the plain stretch


def test_a_rows_context_joins_its_pieces_once_and_keeps_what_the_window_reaches():
    from dspark_hf.decoding.rows import Row

    history = torch.randn(24, 3)
    row = Row([1, 2])
    row.add_context(history[:10])
    for i in range(10, 24):
        row.add_context(history[i : i + 1])
    assert len(row._context) == 15  # nothing joined while rounds add
    assert torch.equal(row.context, history) and len(row._context) == 1  # joined once, when read
    row.context = None
    assert row.context is None

    prompt, held = history[:10], []
    row.add_context(prompt, reach=4)
    assert torch.equal(row.context, history[6:10])
    assert row.context.untyped_storage().data_ptr() != prompt.untyped_storage().data_ptr()  # the prompt's let go
    for i in range(10, 24):
        row.add_context(history[i : i + 1], reach=4)
        held.append(row.context)  # (read each time: joined into one piece, which the next adds must trim too)
        assert torch.equal(held[-1][-4:], history[i - 3 : i + 1])
    assert max(map(len, held)) == 7 and min(map(len, held[3:])) == 4  # fewer than 2·reach, trimmed to reach


def test_windowed_rows_of_different_lengths_match_their_own_greedy(target):
    drafter = make_drafter(target, context_window=3)
    prompts = [[5, 17, 3], [40, 2, 9, 11, 7, 33, 8, 1, 1, 2], [61]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=15, assistant_model=drafter)
    for row, p in zip(out[:, width:].tolist(), prompts):
        assert row == target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=15)[0, len(p) :].tolist()


def test_window_is_checked_carried_by_speculators_and_refused_by_deepspec(target, tmp_path):
    with pytest.raises(ValueError, match="context_window"):
        make_drafter(target, context_window=0)
    drafter = make_drafter(target, context_window=512)
    assert DSparkDraftModel(drafter.config).config.context_window == 512
    assert export_blockers(drafter.config) == []
    check_exportable(drafter.config, "vLLM / speculators")
    # speculators declares it as sliding layers (what speculators' mask and llama.cpp's converter read)
    layers = speculators_config_dict(drafter, target)["transformer_layer_config"]
    assert layers["use_sliding_window"] and layers["sliding_window"] == 512
    assert layers["layer_types"] == ["sliding_attention"] * drafter.config.num_hidden_layers
    plain = speculators_config_dict(make_drafter(target), target)
    layers = plain["transformer_layer_config"]
    assert not layers["use_sliding_window"] and "sliding_window" not in layers
    assert set(layers["layer_types"]) == {"full_attention"}
    assert plain["sliding_window_non_causal"]  # a block's slots see each other both ways in every layer
    assert [field for field, _ in window_blockers(drafter.config)] == ["context_window"]
    with pytest.raises(ValueError, match="context_window"):
        export_deepspec(drafter, target, tmp_path / "deepspec")
    assert not (tmp_path / "deepspec").exists()
    assert "- context window: 512 (" in model_card(drafter.config)
    assert "context window" not in model_card(make_drafter(target).config)


# -- training data: the `longdoc` source ----------------------------------------------------------------------------


def test_longdoc_source_gives_long_documents_and_keeps_the_benchmark_out():
    stream = long_document_prompts(0)
    records = [next(stream, None) for _ in range(12)]
    if None in records:
        pytest.skip("too few long local documents on this machine")
    for record in records:
        text = record["messages"][0]["content"]
        assert record["source"] == "longdoc" and longdoc.MIN_CHARS <= len(text) <= longdoc.MAX_CHARS + 200
        assert any(q in text for q in longdoc.QUESTIONS)
    assert {m for _, m in SOURCES} == set(longdoc.BENCHMARK_MODULES)
    assert longdoc._benchmark_file("/usr/lib/python3.11/logging/__init__.py")
    assert longdoc._benchmark_file("/x/library/argparse.rst.txt") and not longdoc._benchmark_file("/x/json/decoder.py")
    text = "\n\n".join(f"paragraph {i} " + "x" * 990 for i in range(40))
    cut = longdoc.cut_document(text, 9_500)
    assert len(cut) <= 9_500 and text.startswith(cut) and text[len(cut) : len(cut) + 2] == "\n\n"
    assert longdoc.cut_document("short", 9_000) is None
    assert DataConfig(sources=("longdoc",)).max_prompt_tokens == LONG_PROMPT_TOKENS
    assert DataConfig(sources=("longdoc",), max_prompt_tokens=3000).max_prompt_tokens == 3000
    assert DataConfig().max_prompt_tokens == 1024


def test_training_config_sets_the_window(target, tmp_path):
    drafter = build_drafter(DSparkTrainingConfig(num_hidden_layers=2, block_size=3, markov_rank=8, context_window=4),
                            target)  # fmt: skip
    assert drafter.config.context_window == 4
    drafter.save_pretrained(tmp_path / "d")
    again = build_drafter(DSparkTrainingConfig(init_drafter=str(tmp_path / "d")), target)
    assert again.config.context_window == 4  # kept from the checkpoint when the training config leaves it unset
    with pytest.raises(ValueError, match="DSpark drafters"):
        build_drafter(DSparkTrainingConfig(drafter_kind="eagle3", context_window=4), target)
    with pytest.raises(ValueError, match="context_window"):
        DSparkTrainingConfig(context_window=0)


def test_each_run_is_charged_its_own_prefill():
    """The decoding phase subtracts the plain run's own prefill (to its first new token), not the drafted run's."""
    target = make_target()
    clock = FirstTokenClock()
    start = time.perf_counter()
    target.generate(torch.randint(0, 99, (1, 9)), max_new_tokens=5, do_sample=False, streamer=clock)
    assert clock.puts == 6 and start < clock.first < time.perf_counter()  # the prompt, then 5 tokens

    def log(prefill):
        rounds = RoundLog()
        rounds.prefill_seconds = prefill
        return rounds

    tokens = torch.arange(5)
    drafted = [(tokens, 3.0, None, log(1.0))]  # 4 tokens after the first in 2 s
    entry = _decode_phase_entry(drafted, [(tokens, 6.0, None, log(2.0))])  # ... in 4 s plain
    assert entry["decode_speedup"] == pytest.approx(2.0) and entry["plain_prefill_seconds"] == 2.0
    assert entry["plain_step_ms"] == pytest.approx(1000.0)
    fallback = _decode_phase_entry(drafted, [(tokens, 6.0, None, log(None))])  # charged the drafted run's 1 s
    assert fallback["decode_speedup"] == pytest.approx(2.5) and fallback["plain_prefill_seconds"] == 1.0
