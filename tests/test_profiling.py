"""The profiler behind verify_policy="scheduler": profiles, files, lookup next to the checkpoint, generate()."""

import importlib.util
import json

import pytest
import torch
from transformers.testing_utils import CaptureLogger

import dspark_hf.decoding.profiling as profiling
from conftest import make_drafter, make_target
from dspark_hf import DSparkDraftModel
from dspark_hf.cli import main
from dspark_hf.decoding.gate import DraftGate
from dspark_hf.decoding.profiling import (
    PROFILE_FORMAT,
    find_profile,
    load_profile,
    padded_costs,
    profile_target,
    save_profile,
    sps_for,
    sps_table,
)


def quick_profile(target, n=5, **kwargs):
    return profile_target(
        target, lengths=range(1, n + 1), context_len=16, warmup=1, repeats=2, progress=False, **kwargs
    )


HEAD = '{"format": "dspark-sps-v1", '


def greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **{"max_new_tokens": 17, **kwargs})


def test_profile_has_the_documented_keys(target):
    profile = quick_profile(target, batch_sizes=(1, 2))
    assert profile["format"] == PROFILE_FORMAT and profile["device"] == "cpu" and profile["dtype"] == "float32"
    assert profile["torch_threads"] == torch.get_num_threads() and profile["context_len"] == 16
    assert profile["target"] == {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 99}
    assert set(profile["verify_ms"]) == {str(k) for k in range(1, 6)} | {f"2,{k}" for k in range(1, 6)}
    table = sps_table(profile)
    assert list(table) == [1, 2, 3, 4, 5] and all(v > 0 for v in table.values())
    assert set(profile["sps_by_batch"]["2"]) == {"2", "4", "6", "8", "10"}
    assert set(profile["verify_ms_measured"]) == set(profile["verify_ms"])
    for keys in ([str(k) for k in range(1, 6)], [f"2,{k}" for k in range(1, 6)]):
        padded = [profile["verify_ms"][key] for key in keys]
        assert padded == sorted(padded) and padded == padded_costs([profile["verify_ms_measured"][k] for k in keys])
    assert table[3] == pytest.approx(1000.0 / profile["verify_ms_measured"]["3"])  # rates of the widths themselves
    # the machine's way for the target's linears per row count, measured first, and the CPU it was measured on
    assert profile["cpu"] == profiling.cpu_model() and set(profile["kernels"]) == {"choice", "ms"}
    assert all(way in ("linear", "few rows", "packed") for way, _ in profile["kernels"]["choice"].values())
    # the memory floor beside the costs: every linear's weight read once (the tied LM head counted once)
    linears = {m.weight.data_ptr(): m.weight.numel() * 4 for m in target.modules() if isinstance(m, torch.nn.Linear)}
    floor = profile["floor"]
    assert floor["weight_bytes"] == sum(linears.values()) and floor["ms"] > 0 and floor["read_gb_per_s"] > 0
    json.dumps(profile)  # JSON-able as is


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),  # already ordered: untouched
        ([3.0, 1.0], [1.0, 1.0]),  # a wider verify is cheaper: pad to it
        ([65.0, 110.0, 131.0, 96.0, 89.0, 95.0, 127.0, 93.0], [65.0, 89.0, 89.0, 89.0, 89.0, 93.0, 93.0, 93.0]),  # CPU
        ([], []),
    ],
)
def test_padded_costs_are_the_cheapest_width_at_or_above(values, expected):
    assert padded_costs(values) == pytest.approx(expected)


def test_profiling_leaves_the_global_rng_alone(target):
    state = torch.random.get_rng_state()
    quick_profile(target, n=2)
    assert torch.equal(state, torch.random.get_rng_state())


def test_save_load_round_trip(tmp_path, target):
    profile = quick_profile(target, n=3)
    path = save_profile(profile, tmp_path / "sub" / "sps_profile.json")
    assert load_profile(path) == json.loads(json.dumps(profile))
    assert sps_table(load_profile(path)) == sps_table(profile)


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"format": "other"}', "format"),
        (HEAD + '"device": 3, "dtype": "float32", "target": {}, "sps": {"1": 1}}', "device"),
        (HEAD + '"device": "cpu", "dtype": "float32", "target": [], "sps": {"1": 1}}', "fingerprint"),
        (HEAD + '"device": "cpu", "dtype": "float32", "target": {}, "sps": {}}', "non-empty"),
        (HEAD + '"device": "cpu", "dtype": "float32", "target": {}, "sps": {"a": 1}}', "'a'"),
        (HEAD + '"device": "cpu", "dtype": "float32", "target": {}, "sps": {"1": -2}}', "positive"),
    ],
)
def test_load_of_a_bad_file_raises_value_error(tmp_path, content, match):
    path = tmp_path / "sps_profile.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        load_profile(path)
    assert "sps_profile.json" in str(info.value) and "dspark-hf profile" in str(info.value)


def test_find_profile_next_to_the_checkpoint(tmp_path, target):
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    drafter = DSparkDraftModel.from_pretrained(tmp_path / "drafter")
    assert find_profile(drafter, target) is None  # no file: nothing found, nothing to warn about
    profile = quick_profile(target, n=drafter.config.block_size + 1)
    save_profile(profile, tmp_path / "drafter" / "sps_profile.json")
    assert find_profile(drafter, target) == sps_table(profile)


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda p: p["target"].update(hidden_size=64), "profiled for target"),
        (lambda p: p.update(dtype="bfloat16"), "cpu/bfloat16"),
        (lambda p: p.update(device="NVIDIA H200"), "NVIDIA H200/float32"),
        (lambda p: p.update(sps={"1": 5.0, "2": 4.0}), "up to 2 tokens"),
        (lambda p: p.pop("verify_head"), "version 0; this target"),  # made before it existed
        (lambda p: p.update(verify_head=True), "version 1; this target"),  # the LM head alone
    ],
)
def test_find_profile_rejects_a_mismatch_with_a_warning(tmp_path, target, change, why):
    drafter = make_drafter(target)
    drafter.config._name_or_path = str(tmp_path)
    profile = quick_profile(target, n=drafter.config.block_size + 1)
    change(profile)
    save_profile(profile, tmp_path / "sps_profile.json")
    with CaptureLogger(profiling.logger) as captured:
        assert find_profile(drafter, target) is None
    assert "Ignoring" in captured.out and why in captured.out


def test_scheduler_with_a_flat_profile_verifies_whole_blocks(target):
    drafter = make_drafter(target, verify_policy="scheduler", draft_gate=False, context_lookup=0)  # Algorithm 1 alone
    drafter.sps_profile = {b: 100.0 for b in range(1, 10)}
    ids = torch.randint(0, 99, (1, 5))
    assert torch.equal(greedy(target, ids), greedy(target, ids, assistant_model=drafter))
    stats, gamma = drafter.generation_stats, drafter.config.block_size
    # every step verifies the whole block, or what the length limit leaves of it at the end
    cur_len, max_length, expected = ids.shape[1] + 1, ids.shape[1] + 17, []
    for accepted in stats.accepted_lengths:
        expected.append(min(gamma, max_length - cur_len - 1))
        cur_len += accepted + 1
    assert stats.verify_lengths == expected and expected[0] == gamma
    assert drafter.sps_profile == {b: 100.0 for b in range(1, 10)}  # a user profile is kept as is


def test_scheduler_with_a_steep_profile_verifies_nothing(target):
    drafter = make_drafter(target, verify_policy="scheduler")
    drafter.sps_profile = {b: 100.0 / b for b in range(1, 10)}
    ids = torch.randint(0, 99, (1, 5))
    assert torch.equal(greedy(target, ids), greedy(target, ids, assistant_model=drafter))
    assert set(drafter.generation_stats.verify_lengths) == {0}


def test_scheduler_pads_verifies_to_the_cheapest_width(target):
    """A profile where 2 and 3 tokens verify slower than 4 (as 2-3 against 4-5 on this CPU): rounds that draft
    verify 3 drafts (or what the length limit leaves), never 1 or 2, and the output is plain greedy's."""
    drafter = make_drafter(target, verify_policy="scheduler", draft_gate=False)
    drafter.sps_profile = {1: 100.0, 2: 40.0, 3: 45.0, 4: 90.0, 5: 30.0}
    ids = torch.randint(0, 99, (1, 5))
    plain = greedy(target, ids, max_new_tokens=40)
    assert torch.equal(plain, greedy(target, ids, max_new_tokens=40, assistant_model=drafter))
    stats, max_length, cur_len = drafter.generation_stats, ids.shape[1] + 40, ids.shape[1] + 1
    drafted = 0
    for verified, accepted in zip(stats.verify_lengths, stats.accepted_lengths):
        assert verified in (0, 3) or verified == max_length - cur_len - 1, (verified, cur_len)
        drafted += verified == 3
        cur_len += accepted + 1
    assert drafted > 0


@pytest.mark.parametrize("draft_seconds", [1.0, 0.0])
def test_draft_gate_in_generate(target, monkeypatch, draft_seconds):
    """generate() with the draft gate: a draft pass priced at 1 s against 10 ms verifies leaves only the first
    draft and the probes; free drafts are never skipped; the features of skipped rounds reach the next draft
    (the generator checks the context count every round) and the output is plain greedy's either way."""
    from dspark_hf.decoding import policy

    monkeypatch.setattr(
        policy, "DraftGate", lambda sps, _seconds=None, **_: DraftGate(sps, draft_seconds=draft_seconds)
    )
    drafter = make_drafter(target, verify_policy="scheduler", context_lookup=0)  # lookup-only rounds: test_lookup
    drafter.sps_profile = {b: 100.0 for b in range(1, 10)}
    ids = torch.randint(0, 99, (1, 5))
    plain = greedy(target, ids, max_new_tokens=40)
    assert torch.equal(plain, greedy(target, ids, max_new_tokens=40, assistant_model=drafter))
    stats = drafter.generation_stats
    drafted = sum(1 for v in stats.verify_lengths if v > 0)
    if draft_seconds:
        assert stats.gated_rounds >= 20 and drafted <= 2 + len(stats.verify_lengths) // 9
    else:
        assert stats.gated_rounds == 0 and drafted > 0


def test_scheduler_without_a_profile_profiles_once_on_the_fly(target, monkeypatch):
    drafter = make_drafter(target, verify_policy="scheduler")
    assert getattr(drafter, "sps_profile", None) is None
    calls = []
    original = profiling.profile_target
    monkeypatch.setattr(profiling, "profile_target", lambda *a, **k: calls.append(k) or original(*a, **k))
    ids = torch.randint(0, 99, (1, 5))
    with CaptureLogger(profiling.logger) as captured:
        out = greedy(target, ids, assistant_model=drafter)
    assert torch.equal(greedy(target, ids), out)
    assert "quick profile" in captured.out and len(calls) == 1
    assert list(calls[0]["lengths"]) == list(range(1, drafter.config.block_size + 2))
    assert calls[0]["context_len"] == 64
    table = drafter.sps_profile
    assert sorted(table) == list(range(1, drafter.config.block_size + 2)) and all(v > 0 for v in table.values())
    assert torch.equal(greedy(target, ids), greedy(target, ids, assistant_model=drafter))
    assert len(calls) == 1 and drafter.sps_profile is table  # reused by later calls
    trees = make_drafter(target, verify_policy="scheduler", block_size=4, tree_budget="auto")
    assert torch.equal(greedy(target, ids), greedy(target, ids, assistant_model=trees))
    assert list(calls[1]["lengths"]) == [1, 2, 3, 4, 5, 12, 17]  # every chain width, and two up to the widest tree


def test_sps_for_prefers_the_checkpoint_profile_and_re_resolves_for_another_target(tmp_path, target):
    drafter = make_drafter(target, verify_policy="scheduler")
    drafter.config._name_or_path = str(tmp_path)
    profile = quick_profile(target, n=drafter.config.block_size + 1)
    save_profile(profile, tmp_path / "sps_profile.json")
    assert sps_for(drafter, target) == sps_table(profile) and drafter.sps_profile == sps_table(profile)
    other = make_target(num_layers=2)  # another fingerprint: the cached table no longer applies
    with CaptureLogger(profiling.logger) as captured:
        table = sps_for(drafter, other)
    assert "profiled for target" in captured.out and "quick profile" in captured.out
    assert table is drafter.sps_profile and table != sps_table(profile)


@pytest.mark.parametrize("png_arg", ["plot.png", None])  # None: beside --out
def test_cli_profile_writes_json_and_png(tmp_path, capsys, monkeypatch, png_arg):
    monkeypatch.chdir(tmp_path)  # a default must not write into the working directory
    make_target().save_pretrained(tmp_path / "target")
    (tmp_path / "runs").mkdir()
    out = tmp_path / "runs" / "p.json"
    png = tmp_path / "runs" / "p.png" if png_arg is None else tmp_path / "runs" / png_arg
    argv = ["profile", "--target", str(tmp_path / "target"), "--max-tokens", "4", "--repeats", "1"]
    argv += [] if png_arg is None else ["--png", str(png)]
    code = main(argv + ["--context-len", "16", "--out", str(out), "--device", "cpu"])
    assert code == 0
    profile = load_profile(out)
    assert sorted(sps_table(profile)) == [1, 2, 3, 4] and profile["context_len"] == 16
    assert profile["target"]["vocab_size"] == 99
    printed = capsys.readouterr().out
    assert "steps/s" in printed and str(out) in printed
    assert "memory floor:" in printed and "x floor" in printed  # each width beside the floor
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: no PNG to check")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(["p.json", png.name])


def test_cli_profile_takes_sparse_lengths(tmp_path):
    make_target().save_pretrained(tmp_path / "target")
    out = tmp_path / "p.json"
    argv = ["profile", "--target", str(tmp_path / "target"), "--lengths", "1-3,8,6", "--repeats", "1"]
    assert main(argv + ["--context-len", "16", "--out", str(out), "--png", "", "--device", "cpu"]) == 0
    table = sps_table(load_profile(out))
    assert sorted(table) == [1, 2, 3, 6, 8]
    profile = load_profile(out)
    assert [table[b] for b in sorted(table)] == [1000.0 / profile["verify_ms_measured"][str(b)] for b in sorted(table)]
    padded = [profile["verify_ms"][str(b)] for b in sorted(table)]
    assert padded == sorted(padded)  # a verify of more tokens never costs less once it may be padded


@pytest.mark.parametrize("text", ["1-x", "0,4", ""])
def test_cli_profile_rejects_bad_lengths(text):
    from dspark_hf.cli import parse_lengths

    with pytest.raises(ValueError, match="--lengths"):
        parse_lengths(text)


def test_cli_profile_bad_lengths_exit_before_loading_a_target(tmp_path, capsys):
    argv = ["profile", "--target", str(tmp_path / "missing"), "--lengths", "4-x", "--out", str(tmp_path / "p.json")]
    assert main(argv) == 2
    assert "--lengths" in capsys.readouterr().err
