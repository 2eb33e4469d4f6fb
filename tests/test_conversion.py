"""DeepSpec interop: DeepSpec-format checkpoints load exactly, ours export and come back bit-exact, and the
converted drafter reproduces DeepSpec's own forward (reference outputs in fixtures/, see fixtures/README.md)."""

import json
import math
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)

from conftest import make_drafter, make_target
from dspark_hf import DSparkDraftModel
from dspark_hf.cli import main as cli_main
from dspark_hf.integrations.deepspec import (
    convert_deepspec_state_dict,
    dspark_config_from_deepspec,
    export_deepspec,
    is_deepspec_config,
    load_deepspec_checkpoint,
)
from helpers import sample_block


REFERENCE = Path(__file__).parent / "fixtures" / "deepspec_qwen3_reference.safetensors"
MASK_TOKEN = 5
HEADS = {"vanilla": "markov", "gated": "gated_markov", "rnn": "rnn"}
# DSpark fields compared after ours -> DeepSpec -> ours
DSPARK_FIELDS = (
    "target_model_type",
    "hidden_size",
    "num_target_layers",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "use_qk_norm",
    "final_logit_softcapping",
    "target_layer_ids",
    "block_size",
    "mask_token_id",
    "sequential_head",
    "markov_rank",
    "confidence_head",
    "confidence_with_markov",
    "sts_temperatures",
    "verify_policy",
    "confidence_threshold",
    "target_revision",
)


# -- a DeepSpec-format fixture, written the way DeepSpec's build_draft_config + save_pretrained would ------------


def qwen3_target_config() -> Qwen3Config:
    """The tiny Qwen3 target: vocab 99, hidden 32, 4 layers, head_dim 8, odd FFN 37."""
    return Qwen3Config(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )


def make_qwen3_target(seed=0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_target_config()).eval()
    model.generation_config.eos_token_id = None  # never stop early: compare whole continuations
    model.generation_config.pad_token_id = None
    return model


def deepspec_config(target_config, head="vanilla", rank=8, confidence=True, with_markov=True) -> dict:
    """Target config dict + DSpark fields (DeepSpec `qwen3/config.py::build_draft_config`)."""
    config = target_config.to_dict()
    config.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=target_config.num_hidden_layers,
        num_hidden_layers=2,
        block_size=4,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * 2,
        mask_token_id=MASK_TOKEN,
        target_layer_ids=[0, 2],
        num_anchors=2,
        enable_confidence_head=confidence,
        markov_rank=rank,
    )
    if confidence:  # DeepSpec writes these two only when they apply
        config["confidence_head_with_markov"] = with_markov
    if rank > 0:
        config["markov_head_type"] = head
    return config


def deepspec_shapes(config: dict) -> dict[str, tuple]:
    """Key -> shape of DeepSpec's `Qwen3DSparkModel.state_dict()`, spelled out from its modeling code."""
    d, vocab, hd, rank = config["hidden_size"], config["vocab_size"], config["head_dim"], config["markov_rank"]
    heads, kv, ffn = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    shapes = {
        "embed_tokens.weight": (vocab, d),
        "lm_head.weight": (vocab, d),
        "fc.weight": (d, len(config["target_layer_ids"]) * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    for i in range(config["num_hidden_layers"]):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        shapes.update(
            {
                attn + "q_proj.weight": (heads * hd, d),
                attn + "k_proj.weight": (kv * hd, d),
                attn + "v_proj.weight": (kv * hd, d),
                attn + "o_proj.weight": (d, heads * hd),
                attn + "q_norm.weight": (hd,),
                attn + "k_norm.weight": (hd,),
                mlp + "gate_proj.weight": (ffn, d),
                mlp + "up_proj.weight": (ffn, d),
                mlp + "down_proj.weight": (d, ffn),
                f"layers.{i}.input_layernorm.weight": (d,),
                f"layers.{i}.post_attention_layernorm.weight": (d,),
            }
        )
    if rank > 0:
        shapes.update({"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank)})
        extra = {"gated": ("gate_proj", rank, d + rank), "rnn": ("joint_proj", 3 * rank, 2 * rank + d)}
        if config["markov_head_type"] in extra:
            name, out_dim, in_dim = extra[config["markov_head_type"]]
            shapes[f"markov_head.{name}.weight"] = (out_dim, in_dim)
            shapes[f"markov_head.{name}.bias"] = (out_dim,)
    if config["enable_confidence_head"]:
        in_dim = d + (rank if config["confidence_head_with_markov"] else 0)
        shapes.update({"confidence_head.proj.weight": (1, in_dim), "confidence_head.proj.bias": (1,)})
    return shapes


def formula_tensor(name: str, shape: tuple) -> torch.Tensor:
    """Deterministic 'random' values from a formula (no RNG), so DeepSpec's run and ours see the same weights."""
    phase = zlib.crc32(name.encode()) % 6283 / 1000.0
    x = torch.sin(torch.arange(math.prod(shape), dtype=torch.float64) * 0.731 + phase).reshape(shape)
    if name.endswith("norm.weight"):
        x = 1.0 + 0.2 * x
    elif name.endswith("bias"):
        x = 0.1 * x
    elif "markov" in name or "embed" in name or name == "target_hidden_states":
        x = 0.5 * x
    else:
        x = x / math.sqrt(shape[-1])
    return x.float()


def formula_state_dict(config: dict) -> dict[str, torch.Tensor]:
    return {name: formula_tensor(name, shape) for name, shape in deepspec_shapes(config).items()}


def write_deepspec_checkpoint(folder: Path, config: dict, state_dict: dict, prefix: str = "", shards: int = 1) -> Path:
    """config.json + safetensors shards (as transformers' save_pretrained lays them out)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    keys = sorted(state_dict)
    for i in range(shards):
        part = {prefix + k: state_dict[k].contiguous() for k in keys[i::shards]}
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, folder / name, metadata={"format": "pt"})
    return folder


def borrowed_modules(borrowed: dict) -> tuple[nn.Embedding, nn.Linear]:
    embed = nn.Embedding.from_pretrained(borrowed["embed_tokens.weight"])
    vocab, d = borrowed["lm_head.weight"].shape
    lm_head = nn.Linear(d, vocab, bias=False)
    lm_head.weight = nn.Parameter(borrowed["lm_head.weight"])
    return embed, lm_head


def assert_same_weights(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# -- config mapping -----------------------------------------------------------------------------------------------


def test_is_deepspec_config():
    target_config = qwen3_target_config()
    assert is_deepspec_config(deepspec_config(target_config))
    assert not is_deepspec_config(target_config.to_dict())
    ours = make_drafter(make_qwen3_target(), mask_token_id=MASK_TOKEN).config.to_dict()
    ours["architectures"] = ["DSparkDraftModel"]
    assert not is_deepspec_config(ours)


@pytest.mark.parametrize(
    "kwargs, head",
    [
        (dict(head="vanilla"), "markov"),
        (dict(head="gated"), "gated_markov"),
        (dict(head="rnn"), "rnn"),
        (dict(rank=0, with_markov=False), "none"),
        (dict(rank=0, confidence=False), "none"),
    ],
)
def test_config_fields_are_mapped(kwargs, head):
    source = deepspec_config(qwen3_target_config(), **kwargs)
    config = dspark_config_from_deepspec(source)
    # target fingerprint, from the copied target fields (num_hidden_layers there is the draft depth)
    assert (config.target_model_type, config.hidden_size, config.vocab_size, config.num_target_layers) == (
        "qwen3",
        32,
        99,
        4,
    )
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    # draft shapes
    assert config.num_hidden_layers == 2
    assert (config.intermediate_size, config.num_attention_heads, config.num_key_value_heads) == (37, 4, 2)
    assert (config.head_dim, config.hidden_act, config.rms_norm_eps) == (8, "silu", 1e-6)
    assert config.rope_parameters["rope_theta"] == source["rope_parameters"]["rope_theta"]
    assert config.use_qk_norm and config.final_logit_softcapping is None and not config.tie_word_embeddings
    # DSpark fields
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (4, MASK_TOKEN, [0, 2])
    assert config.sequential_head == head and config.markov_rank == source["markov_rank"]
    assert config.confidence_head == source["enable_confidence_head"]
    assert config.confidence_with_markov == source.get("confidence_head_with_markov", False)


def test_legacy_rope_fields_are_mapped():
    source = deepspec_config(qwen3_target_config())
    del source["rope_parameters"]
    source.update(rope_theta=1_000_000.0, rope_scaling=None)  # a config.json written by transformers 4.x
    assert dspark_config_from_deepspec(source).rope_parameters["rope_theta"] == 1_000_000.0


# -- loading DeepSpec checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "model.", "_orig_mod."])
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_every_weight_arrives(tmp_path, prefix, head):
    config = deepspec_config(qwen3_target_config(), head=head)
    state_dict = formula_state_dict(config)
    write_deepspec_checkpoint(tmp_path, config, state_dict, prefix=prefix, shards=2)
    drafter = DSparkDraftModel.from_pretrained(tmp_path)  # dispatches on architectures, not model_type
    assert isinstance(drafter, DSparkDraftModel) and not drafter.training
    ours = {k: v for k, v in state_dict.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    assert_same_weights(drafter.state_dict(), ours)


def test_convert_state_dict_splits_borrowed_weights():
    state_dict = formula_state_dict(deepspec_config(qwen3_target_config()))
    ours, borrowed = convert_deepspec_state_dict({"model." + k: v for k, v in state_dict.items()})
    assert sorted(borrowed) == ["embed_tokens.weight", "lm_head.weight"]
    assert sorted(ours) == sorted(set(state_dict) - set(borrowed))
    assert all(ours[k] is state_dict[k] for k in ours)


def test_load_dtype_and_target_check(tmp_path):
    config = deepspec_config(qwen3_target_config())
    write_deepspec_checkpoint(tmp_path, config, {k: v.bfloat16() for k, v in formula_state_dict(config).items()})
    assert load_deepspec_checkpoint(tmp_path).dtype == torch.bfloat16  # default: the checkpoint's dtype
    assert load_deepspec_checkpoint(tmp_path, dtype=torch.float32).dtype == torch.float32
    load_deepspec_checkpoint(tmp_path, target=make_qwen3_target())
    with pytest.raises(ValueError, match="another target"):
        load_deepspec_checkpoint(tmp_path, target=make_target(vocab_size=101))


def test_bad_checkpoints_raise_clear_errors(tmp_path):
    config = deepspec_config(qwen3_target_config())
    state_dict = formula_state_dict(config)

    extra = {**state_dict, "layers.0.extra.weight": torch.ones(2)}
    unknown = write_deepspec_checkpoint(tmp_path / "unknown", config, extra)
    with pytest.raises(ValueError, match=r"unknown weight\(s\) \['layers.0.extra.weight'\]"):
        load_deepspec_checkpoint(unknown)

    fewer = {k: v for k, v in state_dict.items() if k != "fc.weight"}
    missing = write_deepspec_checkpoint(tmp_path / "missing", config, fewer)
    with pytest.raises(ValueError, match=r"missing weight\(s\) \['fc.weight'\]"):
        DSparkDraftModel.from_pretrained(missing)

    shapes = {**state_dict, "markov_head.markov_w1.weight": torch.zeros(99, 7)}
    with pytest.raises(ValueError, match="wrong shape.*markov_w1"):
        load_deepspec_checkpoint(write_deepspec_checkpoint(tmp_path / "shape", config, shapes))

    pickled = tmp_path / "pickle"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    torch.save(state_dict, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickle weights"):
        DSparkDraftModel.from_pretrained(pickled)

    no_type = dict(config)
    del no_type["markov_head_type"]
    with pytest.raises(ValueError, match="markov_head_type"):
        dspark_config_from_deepspec(no_type)
    with pytest.raises(ValueError, match="Unknown DeepSpec `markov_head_type='crf'`"):
        dspark_config_from_deepspec(dict(config, markov_head_type="crf"))
    with pytest.raises(ValueError, match="embedding output"):
        dspark_config_from_deepspec(dict(config, target_layer_ids=[-1, 2]))


# -- exporting ours -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["markov", "gated_markov", "rnn", "none"])
def test_ours_to_deepspec_to_ours_is_bit_exact(tmp_path, head):
    target = make_qwen3_target()
    extra = dict(confidence_with_markov=False) if head == "none" else {}
    drafter = make_drafter(target, sequential_head=head, mask_token_id=MASK_TOKEN, **extra)
    drafter.config.sts_temperatures = [1.0, 1.5, 2.0, 2.5]
    drafter.config.target_revision = "0123456789abcdef0123456789abcdef01234567"
    out = export_deepspec(drafter, target, tmp_path / "deepspec")

    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3DSparkModel"] and written["model_type"] == "qwen3"
    assert "target_model_type" not in written  # a Qwen3 target: exactly DeepSpec's own layout
    assert written["num_hidden_layers"] == 2 and written["num_target_layers"] == 4
    assert written["layer_types"] == ["full_attention"] * 2 and written["tie_word_embeddings"] is False
    assert written["markov_rank"] == (0 if head == "none" else 8)
    assert written.get("markov_head_type") == {v: k for k, v in HEADS.items()}.get(head)
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors.pop("embed_tokens.weight"), target.get_input_embeddings().weight)
    assert torch.equal(tensors.pop("lm_head.weight"), target.get_output_embeddings().weight)
    assert sorted(tensors) == sorted(drafter.state_dict())

    back = DSparkDraftModel.from_pretrained(out)
    assert_same_weights(back.state_dict(), drafter.state_dict())
    for field in DSPARK_FIELDS:
        if not (field == "markov_rank" and head == "none"):  # DeepSpec stores rank 0 for "no head"
            assert getattr(back.config, field) == getattr(drafter.config, field), field
    assert not list(tmp_path.glob(".deepspec.tmp-*"))  # the temporary folder was renamed into place


def test_export_drops_the_draft_vocabulary(tmp_path):
    """DeepSpec drafts over the whole vocabulary: the export leaves the draft vocabulary out and loads back without
    it, every other weight bit-exact."""
    target = make_qwen3_target()
    drafter = make_drafter(target, mask_token_id=MASK_TOKEN)
    drafter.set_draft_vocab(list(range(0, 40)))
    out = export_deepspec(drafter, target, tmp_path / "deepspec")
    assert "draft_vocab_ids" not in load_file(out / "model.safetensors")
    back = DSparkDraftModel.from_pretrained(out)
    assert back.draft_vocab_ids is None and back.config.draft_vocab_size == 0
    drafter.set_draft_vocab(None)
    assert_same_weights(back.state_dict(), drafter.state_dict())


def test_llama_family_drafters_export_as_the_qwen3_layout(tmp_path):
    """Qwen3DSparkModel's layer is ours with QK-norm: a Llama-target drafter built with QK-norm and a vocabulary mask
    token exports to it (llama3 RoPE scaling and a tied target head included) and comes back bit-exact."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    target = make_target(
        rope_theta=500000.0, rope_scaling=dict(scaling, original_max_position_embeddings=16), tie_word_embeddings=True
    )
    drafter = make_drafter(target, use_qk_norm=True, mask_token_id=MASK_TOKEN)
    out = export_deepspec(drafter, target, tmp_path / "deepspec")

    written = json.loads((out / "config.json").read_text())
    # Qwen3 draft layers, so model_type "qwen3" (DeepSpec and vLLM build Qwen3Config); the target family is recorded
    assert (written["architectures"], written["model_type"], written["target_model_type"]) == (
        ["Qwen3DSparkModel"],
        "qwen3",
        "llama",
    )
    config = AutoConfig.from_pretrained(out)
    assert isinstance(config, Qwen3Config) and config.head_dim == 8
    assert config.rope_parameters == drafter.config.rope_parameters and config.rope_parameters["rope_type"] == "llama3"
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["lm_head.weight"], target.get_input_embeddings().weight)  # tied: copied, not shared

    back = DSparkDraftModel.from_pretrained(out, target=target)
    assert_same_weights(back.state_dict(), drafter.state_dict())
    for field in DSPARK_FIELDS:
        assert getattr(back.config, field) == getattr(drafter.config, field), field
    assert back.config.target_model_type == "llama"


def test_export_refuses_drafters_deepspec_cannot_represent(tmp_path):
    target = make_target()  # Llama: a drafter built with exportable=False has no QK-norm and a learned mask
    with pytest.raises(ValueError, match="QK-norm.*mask embedding.*use_qk_norm=True"):
        export_deepspec(make_drafter(target, use_qk_norm=False, mask_token_id=None), target, tmp_path / "out")
    with pytest.raises(ValueError, match=r"mlp_bias=True"):
        biased = make_drafter(target, use_qk_norm=True, mask_token_id=MASK_TOKEN, mlp_bias=True)
        export_deepspec(biased, target, tmp_path / "out")
    gemma = make_target(config_cls=Gemma3TextConfig, model_cls=Gemma3ForCausalLM)
    with pytest.raises(ValueError, match="'gemma3_text' \\(Gemma-family\\).*Gemma4DSparkModel.*sqrt\\(d\\)"):
        export_deepspec(make_drafter(gemma, mask_token_id=MASK_TOKEN), gemma, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    qwen3 = make_qwen3_target()
    export_deepspec(make_drafter(qwen3, mask_token_id=MASK_TOKEN), qwen3, tmp_path / "out")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_deepspec(make_drafter(qwen3, mask_token_id=MASK_TOKEN), qwen3, tmp_path / "out")


def test_export_warns_that_vllm_has_only_the_vanilla_markov_head(tmp_path, caplog):
    target = make_qwen3_target()
    with caplog.at_level("WARNING", logger="dspark_hf.integrations.deepspec"):
        export_deepspec(make_drafter(target, mask_token_id=MASK_TOKEN), target, tmp_path / "markov")
        assert "vLLM" not in caplog.text
        export_deepspec(make_drafter(target, sequential_head="rnn", mask_token_id=MASK_TOKEN), target, tmp_path / "r")
    assert "'rnn' sequential head" in caplog.text and "vanilla Markov head" in caplog.text


def test_cli_export(tmp_path):
    target = make_qwen3_target()
    target.save_pretrained(tmp_path / "target")
    make_drafter(target, mask_token_id=MASK_TOKEN).save_pretrained(tmp_path / "drafter")
    argv = ["export", "--format", "deepspec", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "out")]
    assert cli_main([*argv, "--target", str(tmp_path / "target")]) == 0
    assert is_deepspec_config(json.loads((tmp_path / "out" / "config.json").read_text()))


# -- behaviour and numerics ---------------------------------------------------------------------------------------


def test_converted_drafter_generates_like_plain_greedy(tmp_path):
    target = make_qwen3_target()
    config = deepspec_config(target.config)
    state_dict = formula_state_dict(config)
    state_dict["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    state_dict["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    drafter = DSparkDraftModel.from_pretrained(write_deepspec_checkpoint(tmp_path, config, state_dict), target=target)
    drafter.config.verify_policy = "fixed"
    ids = torch.randint(3, 99, (1, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=17)
    assisted = target.generate(ids, do_sample=False, max_new_tokens=17, assistant_model=drafter)
    assert torch.equal(plain, assisted)
    assert drafter.generation_stats.num_new_tokens == 17


def reference_inputs():
    """The inputs DeepSpec's forward saw: 8 tokens, loss mask [0,0,1,1,0,0,1,1] -> anchors exactly [2, 6]."""
    seq_len = 8
    input_ids = torch.tensor([[(7 * i + 3) % 99 for i in range(seq_len)]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1.0]])
    target_hidden_states = formula_tensor("target_hidden_states", (1, seq_len, 2 * 32))
    return input_ids, loss_mask, target_hidden_states


def dspark_block_outputs(drafter, borrowed, input_ids, target_hidden_states, anchors):
    """Teacher-forced block outputs in DeepSpec's training layout: all blocks in one pass over the full context.

    Block b (anchor a_b) has slots at a_b + j, sees context positions < a_b and its own block; slot j's label is
    the token at a_b + j + 1 (clamped at the end), and its previous token is the anchor, then the labels.
    """
    embed, lm_head = borrowed_modules(borrowed)
    gamma, seq_len, n_blocks = drafter.config.block_size, input_ids.shape[1], anchors.numel()
    slots = torch.arange(gamma)
    noise = drafter.block_input_embeds(input_ids[:, anchors], embed)  # (1, N·γ, d)
    position_ids = torch.cat([torch.arange(seq_len), (anchors[:, None] + slots).flatten()])[None]
    block_of = torch.arange(n_blocks * gamma) // gamma  # block index of every query slot
    sees_context = torch.arange(seq_len)[None, :] < anchors[block_of][:, None]  # (N·γ, S): strictly before anchor
    sees_block = block_of[:, None] == block_of[None, :]  # (N·γ, N·γ)
    mask = torch.cat([sees_context, sees_block], dim=1)[None, None]
    hidden = drafter(noise, target_hidden_states, position_ids, mask).last_hidden_state  # (1, N·γ, d)
    labels = input_ids[0, (anchors[:, None] + slots + 1).clamp(max=seq_len - 1)]  # (N, γ)
    prev = torch.cat([input_ids[0, anchors][:, None], labels[:, :-1]], dim=1)[None]  # (1, N, γ)
    shape = (1, n_blocks, gamma, -1)
    base = drafter.base_logits(hidden, lm_head).view(shape)
    logits = drafter.block_logits(hidden.view(shape), prev, lm_head)
    confidence = drafter.confidence_logits(hidden, prev.view(1, -1)).view(1, n_blocks, gamma)
    greedy = [
        sample_block(drafter, (embed, lm_head), hidden[:, b * gamma : (b + 1) * gamma], input_ids[:, : a + 1]).tokens
        for b, a in enumerate(anchors.tolist())
    ]
    return base, logits - base, confidence, torch.cat(greedy)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_matches_deepspec_reference_forward(tmp_path, head):
    reference = load_file(REFERENCE)
    config = deepspec_config(qwen3_target_config(), head=head)
    state_dict = formula_state_dict(config)
    drafter = DSparkDraftModel.from_pretrained(write_deepspec_checkpoint(tmp_path, config, state_dict))
    drafter.config._attn_implementation = "eager"
    input_ids, _, target_hidden_states = reference_inputs()
    anchors = reference["anchor_positions"][0]
    assert anchors.tolist() == [2, 6] and torch.equal(reference["input_ids"], input_ids)
    _, borrowed = convert_deepspec_state_dict(state_dict)
    with torch.no_grad():
        outputs = dspark_block_outputs(drafter, borrowed, input_ids, target_hidden_states, anchors)
    base, bias, confidence, greedy = outputs
    torch.testing.assert_close(base, reference["backbone_logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(bias, reference[f"markov_bias.{head}"], atol=1e-5, rtol=0)
    torch.testing.assert_close(confidence, reference[f"confidence_logits.{head}"], atol=1e-5, rtol=0)
    assert torch.equal(greedy, reference[f"greedy_tokens.{head}"])


def cache_deepspec_repo(tmp_path, monkeypatch, repo_id="deepseek-ai/dspark_tiny_block4", head="rnn"):
    """A real HF cache snapshot of a DeepSpec repo (models--org--name/{refs/main, snapshots/<sha>}); offline mode."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    config = deepspec_config(qwen3_target_config(), head=head)
    state_dict = formula_state_dict(config)
    write_deepspec_checkpoint(repo / "snapshots" / commit, config, state_dict)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo_id, state_dict


def test_hub_repo_in_the_local_cache_loads_offline(tmp_path, monkeypatch):
    repo_id, state_dict = cache_deepspec_repo(tmp_path, monkeypatch)
    drafter = DSparkDraftModel.from_pretrained(repo_id)
    assert drafter.config.sequential_head == "rnn"
    assert torch.equal(drafter.markov_head.joint_proj.weight, state_dict["markov_head.joint_proj.weight"])


def test_auto_model_returns_a_drafter_for_deepspec_checkpoints(tmp_path, monkeypatch):
    """DeepSpec's config.json says model_type "qwen3": stock AutoModel builds a plain Qwen3Model from the draft layers
    (the silent wrong model); after `import dspark_hf` it returns the DSpark drafter, for a folder and a repo id."""
    config = deepspec_config(qwen3_target_config(), head="gated")
    state_dict = formula_state_dict(config)
    folder = write_deepspec_checkpoint(tmp_path / "folder", config, state_dict)
    stock = AutoModel.from_pretrained.__func__.__wrapped__(AutoModel, folder)
    assert type(stock) is Qwen3Model  # what the routing prevents

    for source in (folder, str(folder)):
        drafter = AutoModel.from_pretrained(source, trust_remote_code=True)  # the habitual flag is harmless here
        assert isinstance(drafter, DSparkDraftModel) and drafter.config.sequential_head == "gated_markov"
        assert torch.equal(drafter.markov_head.gate_proj.weight, state_dict["markov_head.gate_proj.weight"])
    repo_id, cached = cache_deepspec_repo(tmp_path, monkeypatch)
    drafter = AutoModel.from_pretrained(repo_id)
    assert isinstance(drafter, DSparkDraftModel)
    assert torch.equal(drafter.markov_head.joint_proj.weight, cached["markov_head.joint_proj.weight"])

    for source in (folder, repo_id):  # a drafter is not a language model of its own
        with pytest.raises(ValueError, match="not a causal language model.*assistant_model=drafter"):
            AutoModelForCausalLM.from_pretrained(source)

    # everything else is untouched: a plain Qwen3 folder, and an uncached repo id offline (transformers' own error)
    make_qwen3_target().save_pretrained(tmp_path / "qwen3")
    assert type(AutoModel.from_pretrained(tmp_path / "qwen3")) is Qwen3Model
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3")) is Qwen3ForCausalLM
    with pytest.raises(OSError):
        AutoModel.from_pretrained("org/not-in-the-cache")


def test_uncached_repo_id_is_downloaded(tmp_path, monkeypatch):
    """Not in the cache and online: config.json is fetched, then only the *.json / *.safetensors files."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    config = deepspec_config(qwen3_target_config())
    remote_state = formula_state_dict(config)
    remote = write_deepspec_checkpoint(tmp_path / "remote", config, remote_state)
    (remote / "train_config.py").write_text("not needed to load\n")
    calls = []

    def hf_hub_download(repo_id, filename, subfolder=None, local_files_only=False, **hub):
        calls.append(("file", repo_id, filename, local_files_only))
        if local_files_only:
            raise LocalEntryNotFoundError("not in the cache")
        return str(remote / filename)

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False, **hub):
        calls.append(("snapshot", repo_id, tuple(allow_patterns), local_files_only))
        return str(remote)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    drafter = DSparkDraftModel.from_pretrained("deepseek-ai/dspark_fresh_block4")
    assert torch.equal(drafter.fc.weight, remote_state["fc.weight"])
    assert calls == [
        ("file", "deepseek-ai/dspark_fresh_block4", "config.json", True),
        ("file", "deepseek-ai/dspark_fresh_block4", "config.json", False),
        ("snapshot", "deepseek-ai/dspark_fresh_block4", ("*.json", "*.safetensors"), False),
    ]
    calls.clear()
    with pytest.raises(OSError):  # local_files_only: no download, the ordinary path reports the missing repo
        DSparkDraftModel.from_pretrained("deepseek-ai/dspark_fresh_block4", local_files_only=True)
    assert calls[0] == ("file", "deepseek-ai/dspark_fresh_block4", "config.json", True)
    assert not any(c[0] == "snapshot" for c in calls)
