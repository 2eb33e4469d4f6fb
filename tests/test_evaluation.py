"""The evaluation harness (`dspark-hf bench`): JSON structure, acceptance bookkeeping, identity check, sampling,
several drafters (a DSpark drafter and a plain transformers assistant), the latency sweep, plots, model card."""

import json

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.cli import main
from dspark_hf.decoding.stats import record_draft_rounds
from dspark_hf.evaluation import harness as evaluation
from dspark_hf.evaluation.harness import (
    fixed_draft_length,
    format_evaluation,
    model_card_results,
    parse_datasets,
    parse_drafters,
    run_evaluation,
    stats_from_rounds,
)
from dspark_hf.integrations.hub import model_card
from dspark_hf.utils.prompts import encode
from helpers import char_tokenizer, pin_drafter


PROMPTS_A = ['{"prompt": "Hello there"}', '{"prompt": "Speculative"}']
PROMPTS_B = ['{"prompt": "abc def"}', '{"prompt": "xyz"}', '{"prompt": "never used (limit 2)"}']


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One `dspark-hf bench` run: 2 datasets x 2 drafters (DSpark, plain Llama assistant) x T = 0, 1, plots."""
    root = tmp_path_factory.mktemp("bench")
    torch.manual_seed(0)
    target = make_target()
    target.save_pretrained(root / "target")
    char_tokenizer(99).save_pretrained(root / "target")
    make_drafter(target).save_pretrained(root / "dspark")
    make_target(num_layers=1, seed=3).save_pretrained(root / "assistant")
    (root / "a.jsonl").write_text("\n".join(PROMPTS_A) + "\n")
    (root / "b.jsonl").write_text("\n".join(PROMPTS_B) + "\n")
    args = ["bench", "--target", str(root / "target"), "--max-new-tokens", "10", "--limit", "2"]
    args += ["--prompts", str(root / "a.jsonl"), "--datasets", f"bee={root / 'b.jsonl'}", "--temperature", "0,1"]
    args += ["--drafter", str(root / "dspark"), "--drafter", f"llama={root / 'assistant'}"]
    args += ["--latency-lengths", "1-3,6", "--latency-new-tokens", "12", "--out", str(root / "out")]
    code = main(args)
    return code, root / "out", json.loads((root / "out" / "evaluation.json").read_text())


def test_cli_json_structure(cli_run):
    code, _, result = cli_run
    assert code == 0 and result["all_identical"] is True
    assert list(result["drafters"]) == ["dspark", "llama"]
    assert [d["model_type"] for d in result["drafters"].values()] == ["dspark", "llama"]
    assert {name: d["num_prompts"] for name, d in result["datasets"].items()} == {"a": 2, "bee": 2}
    keys = {(r["dataset"], r["drafter"], r["temperature"]) for r in result["runs"]}
    assert keys == {(d, m, t) for d in ("a", "bee") for m in ("dspark", "llama") for t in (0.0, 1.0)}
    assert len(result["baselines"]) == 4
    assert result["padded_baseline"] is True  # a float32 CPU target: the kernel-neutral baseline runs by default
    for baseline in result["baselines"]:
        assert baseline["tokens_per_second_padded"] > 0 and all(
            p["seconds_padded"] > 0 for p in baseline["per_prompt"]
        )
        assert baseline["padded_identical"] is (True if baseline["temperature"] == 0 else None)
    for run in result["runs"]:
        assert run["num_prompts"] == 2 and len(run["per_prompt"]) == 2
        assert run["tokens_per_second"] > 0 and run["tokens_per_second_plain"] > 0 and run["speedup"] > 0
        assert run["draft_ms_per_round"] > 0 and 0 < run["draft_fraction"] < 1
        padded = run["tokens_per_second_padded"]
        baseline = max(padded, run["tokens_per_second_plain"])  # the faster of padded and plain decoding
        assert run["speedup_vs_padded"] == pytest.approx(run["tokens_per_second"] / baseline)
        if run["temperature"] == 0:
            assert run["all_identical"] is True and all(p["identical"] for p in run["per_prompt"])
            assert all(p["new_tokens"] == 10 for p in run["per_prompt"])  # no EOS in the tiny models
        else:  # sampling: losslessness is distributional, no identity check
            assert run["all_identical"] is None and run["mismatches"] == []
    assert len(next(r for r in result["runs"] if r["drafter"] == "dspark")["per_position_acceptance"]) == 4


def test_per_position_acceptance_is_consistent_with_tau(cli_run):
    for run in cli_run[2]["runs"]:
        reached, accepted, forwards = run["position_reached"], run["position_accepted"], run["num_target_forwards"]
        assert run["acceptance_length"] == pytest.approx(1 + sum(accepted) / forwards)
        for rate, r, a in zip(run["per_position_acceptance"], reached, accepted):
            assert (rate is None and r == 0) or rate == pytest.approx(a / r)
        assert all(later <= earlier for earlier, later in zip(reached, reached[1:]))  # one must pass k to reach k+1
        curve = run["acceptance_length_by_draft_length"]
        known = [t for t in curve if t is not None]
        assert known[0] >= 1 and all(b >= a for a, b in zip(known, known[1:]))  # τ(L) cannot fall with L


def test_latency_sweep_and_restored_settings(cli_run):
    latency = cli_run[2]["latency"]
    for label in ("dspark", "llama"):
        lat = latency[label]
        assert lat["method"] == "fixed_draft_length" and lat["lengths"] == [1, 2, 3, 6]
        assert all(ms > 0 for ms in lat["draft_ms"]) and all(n > 0 for n in lat["rounds"])
        assert all(w is None or w > d for d, w in zip(lat["draft_ms"], lat["round_ms"]))  # a round includes drafting


def test_plots_and_summary(cli_run, capsys):
    _, out, result = cli_run
    for name in ("acceptance_by_position.png", "tau_vs_draft_length.png", "latency_vs_block_length.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_evaluation(result)
    assert table.splitlines()[0].split()[:3] == ["dataset", "drafter", "T"]
    rows = [line.split() for line in table.splitlines()]
    assert ["bee", "llama", "1", "2", "-"] in [row[:5] for row in rows]  # no identity check when sampling
    assert ["a", "dspark", "0", "2", "2/2"] in [row[:5] for row in rows] and "MISMATCH" not in table
    assert table.splitlines()[0].endswith("speedup  vs padded")
    assert "padded plain (verify kernels, no drafts)  bee / T=0: " in table and "same tokens as plain: True" in table


def test_results_feed_the_model_card(cli_run, tmp_path):
    result = cli_run[2]
    with pytest.raises(ValueError, match="several drafters"):
        model_card_results(result)
    runs = model_card_results(result, drafter="dspark")
    assert set(runs) == {"a", "bee"} and all(r["temperature"] == 0 for r in runs.values())
    config = make_drafter(make_target()).config
    card = model_card(config, results=runs)
    bee = runs["bee"]
    assert (
        f"| bee | 2 | {bee['acceptance_length']:.2f} | {bee['speedup']:.2f}x | {bee['speedup_vs_padded']:.2f}x |"
        in card
    )
    assert "vs padded plain" in card


def test_oracle_drafter_accepts_every_position():
    target, tok = make_target(), char_tokenizer(99)
    drafter = make_drafter(target, verify_policy="fixed")
    record = {"prompt": "Hello there"}
    ids = encode(tok, record)
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)  # prefill + 3 full rounds of 4 drafts + bonus
    pin_drafter(drafter, ref)
    result = run_evaluation(target, tok, {"oracle": drafter}, {"one": [record]}, 16, progress=False)
    (run,) = result["runs"]
    assert run["all_identical"] and run["per_position_acceptance"] == [1.0] * 4
    assert run["acceptance_length"] == 5.0 and run["acceptance_length_by_draft_length"] == [2.0, 3.0, 4.0, 5.0]


def test_padded_baseline_switch():
    """Off on request, off by default where verifies use no few-rows product (bf16), and its label is reserved."""
    tok, records = char_tokenizer(99), [{"prompt": "pad"}]
    target = make_target()
    drafter = make_drafter(target)
    for model, padded in ((target, False), (make_target().to(torch.bfloat16), None)):
        result = run_evaluation(model, tok, {"d": make_drafter(model)}, {"x": records}, 6, padded_baseline=padded,
                                progress=False)  # fmt: skip
        (run,), (baseline,) = result["runs"], result["baselines"]
        assert result["padded_baseline"] is False and run["speedup_vs_padded"] is None
        assert baseline["tokens_per_second_padded"] is None and "seconds_padded" not in baseline["per_prompt"][0]
        assert format_evaluation(result).splitlines()[1].split()[-2:] == [f"{run['speedup']:.2f}x", "-"]
    with pytest.raises(ValueError, match="labels a plain baseline"):
        run_evaluation(target, tok, {evaluation.PADDED: drafter}, {"x": records}, 6, progress=False)


def _compiled_run(monkeypatch, records):
    """run_evaluation with the compiled baseline, each generate()'s settings and static cache size recorded."""
    seen = []
    settings = evaluation.compiled_settings

    def spy(target, slots):
        seen.append(slots)
        out = settings(target, slots)
        assert out["compile_config"]._compile_all_devices  # compiled on the CPU too
        return out

    monkeypatch.setattr(evaluation, "compiled_settings", spy)
    target = make_target()
    result = run_evaluation(target, char_tokenizer(99), {"d": make_drafter(target)}, {"x": records, "y": records[:1]},
                            6, progress=False, compiled_baseline=True)  # fmt: skip
    return result, seen


def test_compiled_baseline_times_transformers_static_cache_decoding(monkeypatch):
    """`compiled_baseline=True` decodes each prompt once more by transformers' static-cache decoding, through one
    cache size for the run, and reports its rate, its identity with plain greedy and each drafter's speedup over it.
    (Compiling itself is switched off here, the plumbing is what is tested; the slow suite compiles.)"""
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: function)
    records = [{"prompt": "compile"}, {"prompt": "a somewhat longer prompt"}]
    result, seen = _compiled_run(monkeypatch, records)
    (run, _), (baseline, _) = result["runs"], result["baselines"]  # two datasets
    assert result["compiled_baseline"] and seen == [256]  # one static cache per size the prompts need
    assert [evaluation.compiled_slots(torch.zeros(1, n), 128) for n in (1, 128, 129, 700)] == [256, 256, 512, 1024]
    assert baseline["compiled_identical"] is True and baseline["tokens_per_second_compiled"] > 0
    assert all("seconds_compiled" in row for row in baseline["per_prompt"])
    assert run["speedup_vs_compiled"] == pytest.approx(run["tokens_per_second"] / run["tokens_per_second_compiled"])
    assert "compiled plain (transformers)" in format_evaluation(result)
    with pytest.raises(ValueError, match="labels a plain baseline"):
        run_evaluation(make_target(), char_tokenizer(99), {evaluation.COMPILED: make_drafter(make_target())},
                       {"x": records}, 6, progress=False)  # fmt: skip


@pytest.mark.slow
def test_compiled_baseline_compiles_and_keeps_plain_greedy(monkeypatch):
    result, _ = _compiled_run(monkeypatch, [{"prompt": "compile"}])
    assert result["baselines"][0]["compiled_identical"] is True


def test_own_baseline_is_this_packages_plain_decoding(monkeypatch):
    """`own_baseline=True` decodes each prompt once more through the package's own decode round without a drafter
    (the Engine): greedy, its tokens are plain greedy's; each run reports its speedup over it. A corrupted own
    decode is reported as not identical (the check can fail)."""
    target, tok = make_target(), char_tokenizer(99)
    records = [{"prompt": "own"}, {"prompt": "a longer prompt"}]
    result = run_evaluation(target, tok, {"d": make_drafter(target)}, {"x": records}, 6, progress=False,
                            own_baseline=True)  # fmt: skip
    (run,), (baseline,) = result["runs"], result["baselines"]
    assert result["own_baseline"] and baseline["own_identical"] is True and baseline["tokens_per_second_own"] > 0
    assert all("seconds_own" in row for row in baseline["per_prompt"])
    assert run["speedup_vs_own"] == pytest.approx(run["tokens_per_second"] / run["tokens_per_second_own"])
    assert "own plain (this package's round, no drafter)" in format_evaluation(result)
    real = evaluation._own_decode

    def corrupted(*args):
        out, *rest = real(*args)
        return (out + 1) % 99, *rest

    monkeypatch.setattr(evaluation, "_own_decode", corrupted)
    result = run_evaluation(target, tok, {"d": make_drafter(target)}, {"x": records}, 6, progress=False,
                            own_baseline=True)  # fmt: skip
    assert result["baselines"][0]["own_identical"] is False
    with pytest.raises(ValueError, match="labels a plain baseline"):
        run_evaluation(target, tok, {evaluation.OWN: make_drafter(target)}, {"x": records}, 6, progress=False)


def test_identity_check_reports_an_injected_mismatch(monkeypatch):
    target, tok = make_target(), char_tokenizer(99)
    records = [{"prompt": "first"}, {"prompt": "second"}]
    broken = encode(tok, records[1])
    real = evaluation.timed_generate

    def lossy(target, ids, max_new_tokens, drafter=None, **kwargs):
        out, seconds = real(target, ids, max_new_tokens, drafter, **kwargs)
        if drafter is not None and torch.equal(ids, broken):
            out = out.clone()
            out[3] = (out[3] + 1) % 99
        return out, seconds

    monkeypatch.setattr(evaluation, "timed_generate", lossy)
    result = run_evaluation(target, tok, {"d": make_drafter(target)}, {"x": records}, 8, progress=False)
    (run,) = result["runs"]
    assert result["all_identical"] is False and run["all_identical"] is False
    assert [p["identical"] for p in run["per_prompt"]] == [True, False]
    assert run["mismatches"] == [{"index": 1, "first_difference": 3, "plain_new_tokens": 8, "new_tokens": 8}]
    assert "MISMATCH x / d prompt 1: differs from plain greedy at new token 3" in format_evaluation(result)


def test_sampling_is_seeded():
    target, tok = make_target(), char_tokenizer(99)
    drafter = make_drafter(target)
    records = [{"prompt": "seeded"}, {"prompt": "sampling"}]

    def run():
        result = run_evaluation(target, tok, {"d": drafter}, {"x": records}, 12, temperatures=(1,), progress=False)
        return [(p["acceptance_length"], p["num_target_forwards"]) for p in result["runs"][0]["per_prompt"]]

    assert run() == run()


def test_logged_rounds_match_the_drafters_own_stats():
    target = make_target()
    drafter = make_drafter(target)
    ids = torch.randint(0, 99, (1, 9))
    with record_draft_rounds() as rounds:
        target.generate(ids, max_new_tokens=15, do_sample=False, assistant_model=drafter)
    own, logged = drafter.generation_stats, stats_from_rounds(rounds)
    assert not any(r.first for r in rounds) and all(r.seconds > 0 for r in rounds)
    assert logged.verify_lengths == own.verify_lengths and logged.accepted_lengths == own.accepted_lengths
    assert logged.stopped == own.stopped


def test_fixed_draft_length_restores_the_drafter():
    target = make_target()
    drafter = make_drafter(target)
    before = (drafter.config.block_size, drafter.config.verify_policy, list(drafter.config.sts_temperatures))
    with fixed_draft_length(drafter, 7) as supported:
        assert supported and drafter.config.block_size == 7 and len(drafter.config.sts_temperatures) == 7
        target.generate(torch.randint(0, 99, (1, 5)), max_new_tokens=30, do_sample=False, assistant_model=drafter)
        lengths = drafter.generation_stats.verify_lengths
        assert lengths[0] == 7 and max(lengths) == 7
    assert (drafter.config.block_size, drafter.config.verify_policy, drafter.config.sts_temperatures) == before
    with fixed_draft_length(object(), 3) as supported:
        assert not supported


def test_argument_parsing_errors(tmp_path, capsys):
    good = tmp_path / "gsm8k.jsonl"
    good.write_text('{"prompt": "1 + 1"}\n')
    assert parse_datasets([str(good)], f"math={good}") == {"gsm8k": good, "math": good}
    with pytest.raises(ValueError, match="name=path"):
        parse_datasets([], "just-a-name")
    with pytest.raises(ValueError, match="no file"):
        parse_datasets([], f"x={tmp_path / 'missing.jsonl'}")
    assert parse_drafters(["runs/dspark2", "eagle=runs/e3"]) == {"dspark2": "runs/dspark2", "eagle": "runs/e3"}
    with pytest.raises(ValueError, match="LABEL=PATH"):
        parse_drafters(["a/best", "b/best"])
    assert main(["bench"]) == 2
    assert "needs prompts" in capsys.readouterr().err
