"""DeepSpec's Gemma-4 layout (`Gemma4DSparkModel`): DeepSpec-format checkpoints load exactly into the
`draft_layer="gemma4"` drafter, reproduce DeepSpec's own forward over fresh and growing caches (reference outputs in
fixtures/, see fixtures/README.md), decode losslessly on a Gemma-4 target, and export back bit-exact."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_conversion import (
    assert_same_weights,
    borrowed_modules,
    deepspec_config,
    formula_tensor,
    reference_inputs,
    write_deepspec_checkpoint,
)
from transformers import AutoModel, Gemma4ForCausalLM, Gemma4TextConfig
from transformers.cache_utils import DynamicCache

from conftest import make_drafter
from dspark_hf import DSparkConfig, DSparkDraftModel
from dspark_hf.cli import main as cli_main
from dspark_hf.integrations.deepspec import convert_deepspec_state_dict, dspark_config_from_deepspec, export_deepspec
from dspark_hf.models.modeling_dspark_gemma4 import DSparkGemma4DecoderLayer
from helpers import sample_block


REFERENCE = Path(__file__).parent / "fixtures" / "deepspec_gemma4_reference.safetensors"
MASK_TOKEN = 4  # Gemma-4's mask token, as in DeepSeek's released drafter
VARIANTS = ("kv_shared", "v_proj")  # attention_k_eq_v=True (the released 12B drafter's layout) / False
# the decoding rounds of the cache reference: (anchor position, anchor token); the context grows 5 -> 7 -> 10
ROUNDS = ((5, 17), (7, 3), (10, 42))


# -- a tiny Gemma-4 target and DeepSpec-format drafters for it --------------------------------------------------


def gemma4_target_config(k_eq_v=True) -> Gemma4TextConfig:
    """Tiny Gemma-4 text target: sliding (window 4) and global layers, global head 16 != sliding head 8, one global
    KV head with K = V, soft-capping 5 (low enough to bend these logits), no per-layer inputs."""
    return Gemma4TextConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1 if k_eq_v else None,
        attention_k_eq_v=k_eq_v,
        layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention", "full_attention"],
        sliding_window=4,
        final_logit_softcapping=5.0,
        hidden_size_per_layer_input=0,
        max_position_embeddings=256,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        attn_implementation="eager",
    )


def make_gemma4_target(k_eq_v=True) -> Gemma4ForCausalLM:
    """The tiny Gemma-4 target with formula weights (no RNG), so that DeepSpec's run and ours see the same model."""
    model = Gemma4ForCausalLM(gemma4_target_config(k_eq_v)).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            value = formula_tensor(name, tuple(tensor.shape))
            tensor.copy_(1.0 + 0.1 * value if name.endswith("layer_scalar") else value)
    model.generation_config.eos_token_id = None  # never stop early: compare whole continuations
    model.generation_config.pad_token_id = None
    return model


def gemma4_deepspec_config(target_config: Gemma4TextConfig, rank=8) -> dict:
    """Target text config + DSpark fields, as DeepSpec's `gemma4/config.py::build_draft_config` writes them under its
    transformers (5.10: `global_head_dim` / `num_global_key_value_heads` plain fields, no `per_layer_config`)."""
    config = deepspec_config(target_config, rank=rank)  # the fields every DeepSpec draft config has
    del config["per_layer_config"]
    full = target_config.per_layer_config[target_config.layer_types.index("full_attention")]
    config.update(
        global_head_dim=full.head_dim,
        num_global_key_value_heads=full.num_key_value_heads if target_config.attention_k_eq_v else None,
        architectures=["Gemma4DSparkModel"],
        target_model_type="gemma4",
        target_text_model_type="gemma4_text",
        mask_token_id=MASK_TOKEN,
    )
    return config


def gemma4_deepspec_shapes(config: dict) -> dict[str, tuple]:
    """Key -> shape of DeepSpec's `Gemma4DSparkModel.state_dict()`, spelled out from its modeling code."""
    d, vocab, rank = config["hidden_size"], config["vocab_size"], config["markov_rank"]
    ffn = config["intermediate_size"]
    hd, heads, k_eq_v = config["global_head_dim"], config["num_attention_heads"], config["attention_k_eq_v"]
    kv = config["num_global_key_value_heads"] if k_eq_v else config["num_key_value_heads"]
    shapes = {
        "embed_tokens.weight": (vocab, d),
        "lm_head.weight": (vocab, d),
        "fc.weight": (d, len(config["target_layer_ids"]) * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
        "markov_head.markov_w1.weight": (vocab, rank),
        "markov_head.markov_w2.weight": (vocab, rank),
        "confidence_head.proj.weight": (1, d + rank),
        "confidence_head.proj.bias": (1,),
    }
    for i in range(config["num_hidden_layers"]):
        attn, mlp, layer = f"layers.{i}.self_attn.", f"layers.{i}.mlp.", f"layers.{i}."
        shapes.update(
            {
                attn + "q_proj.weight": (heads * hd, d),
                attn + "k_proj.weight": (kv * hd, d),
                attn + "o_proj.weight": (d, heads * hd),
                attn + "q_norm.weight": (hd,),
                attn + "k_norm.weight": (hd,),
                mlp + "gate_proj.weight": (ffn, d),
                mlp + "up_proj.weight": (ffn, d),
                mlp + "down_proj.weight": (d, ffn),
                layer + "layer_scalar": (1,),
            }
        )
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[f"{layer}{norm}_layernorm.weight"] = (d,)
        if not k_eq_v:
            shapes[attn + "v_proj.weight"] = (kv * hd, d)
    return shapes


def gemma4_formula_state_dict(config: dict) -> dict[str, torch.Tensor]:
    """Formula weights; `layer_scalar` near 1 (a real drafter's is 1 unless trained otherwise)."""
    out = {name: formula_tensor(name, shape) for name, shape in gemma4_deepspec_shapes(config).items()}
    return {k: 1.0 + 0.1 * v if k.endswith("layer_scalar") else v for k, v in out.items()}


def gemma4_checkpoint(folder: Path, variant="kv_shared", target=None):
    """A DeepSpec Gemma-4 checkpoint on disk; with `target`, its frozen embedding / LM-head copies are the target's."""
    config = gemma4_deepspec_config(gemma4_target_config(k_eq_v=variant == "kv_shared"))
    state_dict = gemma4_formula_state_dict(config)
    if target is not None:
        state_dict["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
        state_dict["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    return write_deepspec_checkpoint(folder, config, state_dict), config, state_dict


def scaled_embedding(borrowed: dict) -> torch.nn.Module:
    """DeepSpec's own embedding of the frozen copy (`Gemma4TextScaledWordEmbedding`, sqrt(d)); at decode time the
    Gemma-4 target's embedding module does the same."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    vocab, d = borrowed["embed_tokens.weight"].shape
    embed = Gemma4TextScaledWordEmbedding(vocab, d, 0, embed_scale=d**0.5)
    embed.weight = torch.nn.Parameter(borrowed["embed_tokens.weight"])
    return embed


def cache_round_inputs(seq_len=12):
    """Target features for the decoding rounds (positions 0..seq_len-1, formula values)."""
    return formula_tensor("decode_target_hidden_states", (1, seq_len, 2 * 32))


def drafter_cache_rounds(drafter, embed, lm_head):
    """DeepSpec's evaluator, step by step: each round feeds the target features of the positions committed since the
    last one (fresh cache, then growing), drafts the block anchored at `start`, and crops the cache back to `start`.
    Returns per round: post-norm block hidden (1, γ, d), greedy drafts (1, γ), their draft logits with the Markov bias
    (1, γ, V) and confidence logits (1, γ)."""
    features, gamma, cache, outputs = cache_round_inputs(), drafter.config.block_size, DynamicCache(), []
    for start, anchor in ROUNDS:
        past = cache.get_seq_length()
        noise = drafter.block_input_embeds(torch.tensor([[anchor]]), embed)  # (1, γ, d)
        position_ids = torch.arange(past, start + gamma)[None]
        hidden = drafter(noise, features[:, past:start], position_ids, cache=cache).last_hidden_state
        cache.crop(start - cache.get_seq_length())  # drop the block's entries: the cache holds context < start
        assert cache.get_seq_length() == start
        sequence = torch.tensor([[anchor]])
        tokens = sample_block(drafter, (embed, lm_head), hidden, sequence).tokens  # (1, γ)
        prev = torch.cat([sequence, tokens[:, :-1]], dim=1)  # (1, γ)
        logits = drafter.block_logits(hidden[:, None], prev[:, None], lm_head)[:, 0]
        outputs.append((hidden, tokens, logits, drafter.confidence_logits(hidden, prev)))
    return outputs


def training_outputs(drafter, borrowed, input_ids, target_hidden_states, anchors):
    """Teacher-forced block outputs in DeepSpec's training layout (as `test_conversion.dspark_block_outputs`), with
    DeepSpec's sqrt(d)-scaled embedding; returns block hidden (1, N·γ, d), draft logits (1, N, γ, V), confidence
    logits (1, N, γ) and greedy drafts (N, γ)."""
    embed, lm_head = scaled_embedding(borrowed), borrowed_modules(borrowed)[1]
    gamma, seq_len, n_blocks = drafter.config.block_size, input_ids.shape[1], anchors.numel()
    slots = torch.arange(gamma)
    noise = drafter.block_input_embeds(input_ids[:, anchors], embed)
    position_ids = torch.cat([torch.arange(seq_len), (anchors[:, None] + slots).flatten()])[None]
    block_of = torch.arange(n_blocks * gamma) // gamma
    mask = torch.cat(
        [torch.arange(seq_len)[None, :] < anchors[block_of][:, None], block_of[:, None] == block_of[None, :]], dim=1
    )[None, None]
    hidden = drafter(noise, target_hidden_states, position_ids, mask).last_hidden_state  # (1, N·γ, d)
    labels = input_ids[0, (anchors[:, None] + slots + 1).clamp(max=seq_len - 1)]
    prev = torch.cat([input_ids[0, anchors][:, None], labels[:, :-1]], dim=1)[None]  # (1, N, γ)
    logits = drafter.block_logits(hidden.view(1, n_blocks, gamma, -1), prev, lm_head)
    confidence = drafter.confidence_logits(hidden, prev.view(1, -1)).view(1, n_blocks, gamma)
    greedy = [
        sample_block(drafter, (embed, lm_head), hidden[:, b * gamma : (b + 1) * gamma], input_ids[:, : a + 1]).tokens
        for b, a in enumerate(anchors.tolist())
    ]
    return hidden, logits, confidence, torch.cat(greedy)


# -- config and loading -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_maps_to_the_gemma4_layer(variant):
    source = gemma4_deepspec_config(gemma4_target_config(k_eq_v=variant == "kv_shared"))
    config = dspark_config_from_deepspec(source)
    assert config.draft_layer == "gemma4" and config.attention_k_eq_v == (variant == "kv_shared")
    # the draft layers take the global (full-attention) head size, and with K = V the global KV heads
    assert (config.head_dim, config.num_key_value_heads) == ((16, 1) if variant == "kv_shared" else (16, 2))
    assert config.rope_parameters == source["rope_parameters"]["full_attention"]
    assert config.rope_parameters["rope_type"] == "proportional"
    assert (config.hidden_act, config.final_logit_softcapping, config.mask_token_id) == ("gelu_pytorch_tanh", 5.0, 4)
    assert (config.target_model_type, config.num_target_layers, config.vocab_size) == ("gemma4_text", 5, 101)
    # a config.json saved by transformers 5.2x holds per-layer overrides instead of the two global fields
    saved_by_525 = dict(source, per_layer_config={"0": {"head_dim": 16, "num_key_value_heads": 1}})
    del saved_by_525["global_head_dim"], saved_by_525["num_global_key_value_heads"]
    assert dspark_config_from_deepspec(saved_by_525).head_dim == 16


def test_for_target_builds_the_gemma4_layer_by_default():
    config = DSparkConfig.for_target(gemma4_target_config(), num_hidden_layers=2, block_size=4)
    assert (config.draft_layer, config.attention_k_eq_v, config.head_dim, config.num_key_value_heads) == (
        "gemma4",
        True,
        16,
        1,
    )
    assert config.mask_token_id == MASK_TOKEN and config.final_logit_softcapping == 5.0
    drafter = DSparkDraftModel(config)
    assert all(isinstance(layer, DSparkGemma4DecoderLayer) for layer in drafter.layers)
    assert drafter.layers[0].self_attn.v_proj is None and drafter.layers[0].self_attn.scaling == 1.0
    llama = DSparkConfig.for_target(gemma4_target_config(), num_hidden_layers=2, draft_layer="llama")
    assert not any(isinstance(layer, DSparkGemma4DecoderLayer) for layer in DSparkDraftModel(llama).layers)
    with pytest.raises(ValueError, match="draft_layer='gemma4'"):
        DSparkConfig.for_target(gemma4_target_config(), draft_layer="llama", attention_k_eq_v=True)
    with pytest.raises(ValueError, match="Unknown `draft_layer='gemma3'`"):
        DSparkConfig.for_target(gemma4_target_config(), draft_layer="gemma3")


def test_the_released_12b_config_maps_to_the_hub_config():
    """DeepSeek's `dspark_gemma4_12b_block7` config.json (the target's text config, as recorded in
    tools/make_hub_configs.py, plus DeepSpec's `config/dspark/dspark_gemma4_12b.py` fields) gives the drafter that
    hub_configs/gemma-4-12b.json describes: the same layer layout and shapes (q 16 x 512, one K = V head)."""
    from test_hub_configs import ROOT, _generator

    released = dict(_generator().TARGETS["gemma-4-12b"]["config"]["text_config"])
    released.update(
        architectures=["Gemma4DSparkModel"],
        target_model_type="gemma4_unified",
        target_text_model_type="gemma4_unified_text",
        num_target_layers=48,
        num_hidden_layers=5,
        layer_types=["full_attention"] * 5,
        block_size=7,
        target_layer_ids=[5, 17, 29, 41, 46],
        mask_token_id=4,
        num_anchors=512,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        markov_rank=256,
        markov_head_type="vanilla",
    )
    loaded = dspark_config_from_deepspec(released)
    hub = DSparkConfig.from_json_file(str(ROOT / "hub_configs" / "gemma-4-12b.json"))
    fields = ("draft_layer", "attention_k_eq_v", "head_dim", "num_key_value_heads", "num_attention_heads")
    fields += ("intermediate_size", "hidden_act", "rope_parameters", "final_logit_softcapping", "target_layer_ids")
    fields += ("mask_token_id", "block_size", "num_hidden_layers", "markov_rank", "sequential_head", "hidden_size")
    for field in fields:
        assert getattr(loaded, field) == getattr(hub, field), field
    assert (loaded.head_dim, loaded.num_key_value_heads, loaded.attention_k_eq_v) == (512, 1, True)
    with torch.device("meta"):  # 1.3 B parameters: shapes only
        ours = {k: tuple(v.shape) for k, v in DSparkDraftModel(hub).state_dict().items()}
    theirs = gemma4_deepspec_shapes(released)
    del theirs["embed_tokens.weight"], theirs["lm_head.weight"]
    assert ours == theirs


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_weight_arrives(tmp_path, variant):
    folder, _, state_dict = gemma4_checkpoint(tmp_path, variant)
    for drafter in (DSparkDraftModel.from_pretrained(folder), AutoModel.from_pretrained(folder)):
        assert isinstance(drafter, DSparkDraftModel) and drafter.config.draft_layer == "gemma4"
        ours = {k: v for k, v in state_dict.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
        assert_same_weights(drafter.state_dict(), ours)


def test_unsupported_gemma4_configs_raise_clear_errors(tmp_path):
    source = gemma4_deepspec_config(gemma4_target_config())
    with pytest.raises(ValueError, match="per-layer inputs or MoE"):
        dspark_config_from_deepspec(dict(source, hidden_size_per_layer_input=256))
    with pytest.raises(ValueError, match="double-wide"):
        dspark_config_from_deepspec(dict(source, use_double_wide_mlp=True, num_kv_shared_layers=2))
    no_head = dict(source)
    del no_head["global_head_dim"]
    with pytest.raises(ValueError, match="global_head_dim"):
        dspark_config_from_deepspec(no_head)
    state_dict = gemma4_formula_state_dict(source)
    state_dict["layers.0.self_attn.v_proj.weight"] = torch.zeros(16, 32)  # a v_proj although K = V
    with pytest.raises(ValueError, match=r"unknown weight\(s\) \['layers.0.self_attn.v_proj.weight'\]"):
        DSparkDraftModel.from_pretrained(write_deepspec_checkpoint(tmp_path, source, state_dict))


# -- numerics against DeepSpec's own Gemma-4 code ----------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_deepspec_training_forward(tmp_path, variant):
    """DeepSpec's training path (flex attention, its block mask): block hidden states, draft logits with the Markov
    bias (soft-capped base logits + bias), confidence logits and greedy drafts of blocks anchored at 2 and 6."""
    reference = load_file(REFERENCE)
    folder, _, state_dict = gemma4_checkpoint(tmp_path, variant)
    drafter = DSparkDraftModel.from_pretrained(folder)
    drafter.config._attn_implementation = "eager"
    input_ids, _, target_hidden_states = reference_inputs()
    anchors = reference["anchor_positions"][0]
    assert anchors.tolist() == [2, 6] and torch.equal(reference["input_ids"], input_ids)
    _, borrowed = convert_deepspec_state_dict(state_dict)
    with torch.no_grad():
        hidden, logits, confidence, greedy = training_outputs(
            drafter, borrowed, input_ids, target_hidden_states, anchors
        )
    torch.testing.assert_close(hidden, reference[f"train.{variant}.block_hidden"], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, reference[f"train.{variant}.draft_logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(confidence, reference[f"train.{variant}.confidence_logits"], atol=1e-5, rtol=0)
    assert torch.equal(greedy, reference[f"train.{variant}.greedy_tokens"])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_deepspec_over_fresh_and_growing_caches(tmp_path, variant, attn):
    """DeepSpec's evaluator path (`forward_dspark_draft_block`: SDPA, no mask, a DynamicCache cropped to the anchor
    after every block): three rounds, the first on an empty cache."""
    reference = load_file(REFERENCE)
    folder, _, state_dict = gemma4_checkpoint(tmp_path, variant)
    drafter = DSparkDraftModel.from_pretrained(folder, attn_implementation=attn)
    _, borrowed = convert_deepspec_state_dict(state_dict)
    with torch.no_grad():
        rounds = drafter_cache_rounds(drafter, scaled_embedding(borrowed), borrowed_modules(borrowed)[1])
    for r, (hidden, tokens, logits, confidence) in enumerate(rounds):
        key = f"decode.{variant}.round{r}"
        torch.testing.assert_close(hidden, reference[f"{key}.block_hidden"], atol=1e-5, rtol=0)
        assert torch.equal(tokens, reference[f"{key}.greedy_tokens"])
        torch.testing.assert_close(logits, reference[f"{key}.draft_logits"], atol=1e-5, rtol=0)
        torch.testing.assert_close(confidence, reference[f"{key}.confidence_logits"], atol=1e-5, rtol=0)


# -- decoding on a Gemma-4 target ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_on_a_gemma4_target_is_lossless_and_matches_deepspec(tmp_path, variant):
    """generate(assistant_model=drafter) on a Gemma-4 target (sliding window 4 < the sequence, global layers,
    soft-capping) equals plain greedy and DeepSpec's own decode loop (`generate_decoding_sample`) with the same
    models; the fixture drafter accepts some drafts and rejects others."""
    reference = load_file(REFERENCE)
    target = make_gemma4_target(k_eq_v=variant == "kv_shared")
    folder, _, _ = gemma4_checkpoint(tmp_path, variant, target=target)
    drafter = DSparkDraftModel.from_pretrained(folder, target=target, attn_implementation="eager")
    drafter.config.verify_policy = "fixed"
    prompt = reference["generate.prompt"]
    plain = target.generate(prompt, do_sample=False, max_new_tokens=20)
    assisted = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter)
    assert torch.equal(assisted, plain)
    assert torch.equal(assisted, reference[f"generate.{variant}.deepspec_output_ids"])
    stats = drafter.generation_stats
    assert stats.num_new_tokens == 20


@pytest.mark.parametrize("diverge_at", [None, 1, 3])
def test_generate_on_a_gemma4_target_with_pinned_drafts(diverge_at):
    """Whole blocks accepted (oracle) or exactly k per round: rejected drafts are cropped from the target's sliding
    (window 4) and global layer caches alike, and the output stays plain greedy's."""
    from helpers import pin_drafter

    target = make_gemma4_target()
    prompt = torch.tensor([[2, 17, 33, 5, 71, 9]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=21)
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), plain, diverge_at=diverge_at)
    assisted = target.generate(prompt, do_sample=False, max_new_tokens=21, assistant_model=drafter)
    assert torch.equal(assisted, plain)
    stats = drafter.generation_stats
    expected = drafter.config.block_size if diverge_at is None else diverge_at
    rounds = zip(stats.verify_lengths, stats.accepted_lengths, stats.stopped)
    assert all(accepted == min(expected, verified) or stopped for verified, accepted, stopped in rounds)
    assert sum(stats.accepted_lengths) >= (10 if diverge_at is None else 4)


# -- export -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_ours_to_deepspec_to_ours_is_bit_exact(tmp_path, variant):
    target = make_gemma4_target(k_eq_v=variant == "kv_shared")
    drafter = make_drafter(target, target_layer_ids=[0, 2])
    assert drafter.config.draft_layer == "gemma4" and drafter.config.mask_token_id == MASK_TOKEN
    with torch.no_grad():
        for layer in drafter.layers:
            layer.layer_scalar.fill_(0.75)  # travels as a buffer
    out = export_deepspec(drafter, target, tmp_path / "deepspec")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Gemma4DSparkModel"] and written["model_type"] == "gemma4_text"
    assert (written["target_model_type"], written["target_text_model_type"]) == ("gemma4", "gemma4_text")
    assert written["global_head_dim"] == 16 and written["attention_k_eq_v"] == (variant == "kv_shared")
    assert "per_layer_config" not in written and written["hidden_size_per_layer_input"] == 0
    assert written["rope_parameters"]["full_attention"] == drafter.config.rope_parameters
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(gemma4_deepspec_shapes(written))  # exactly DeepSpec's key set
    back = DSparkDraftModel.from_pretrained(out, target=target)
    assert_same_weights(back.state_dict(), drafter.state_dict())
    for field in ("draft_layer", "attention_k_eq_v", "head_dim", "num_key_value_heads", "rope_parameters"):
        assert getattr(back.config, field) == getattr(drafter.config, field), field
    assert back.config.target_model_type == "gemma4_text"


def test_cli_exports_the_gemma4_layout(tmp_path):
    target = make_gemma4_target()
    target.save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    argv = ["export", "--format", "deepspec", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "out")]
    assert cli_main([*argv, "--target", str(tmp_path / "target")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Gemma4DSparkModel"]
    back = DSparkDraftModel.from_pretrained(tmp_path / "out")
    assert_same_weights(back.state_dict(), DSparkDraftModel.from_pretrained(tmp_path / "drafter").state_dict())


def test_export_refuses_gemma4_layouts_deepspec_cannot_represent(tmp_path):
    target = make_gemma4_target()
    with pytest.raises(ValueError, match="Gemma4DSparkModel.*mask embedding"):
        export_deepspec(make_drafter(target, mask_token_id=None), target, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- training -----------------------------------------------------------------------------------------------------


def test_dspark_hf_train_trains_the_gemma4_layout_and_it_exports(tmp_path):
    """`dspark-hf train` on a Gemma-4 target builds the Gemma-4 layout (starting from the target's top layers), trains
    every drafter weight, and the checkpoint exports to Gemma4DSparkModel and back bit-exact."""
    from test_trainer import tiny_dataset

    target = make_gemma4_target()
    target.save_pretrained(tmp_path / "target")
    tiny_dataset().save(tmp_path / "data.npz")
    settings = ["num_hidden_layers=2", "block_size=3", "markov_rank=8", "seq_len=24", "batch_size=2"]
    settings += ["num_anchors=4", "max_steps=3", "save_every=3", "learning_rate=1e-2"]
    paths = [f"data={tmp_path / 'data.npz'}", f"target={tmp_path / 'target'}", f"output_dir={tmp_path / 'run'}"]
    assert cli_main(["train", "--set", *paths, *settings]) == 0

    folder = tmp_path / "run" / (tmp_path / "run" / "latest").read_text()
    trained = DSparkDraftModel.from_pretrained(folder, target=target)
    assert trained.config.draft_layer == "gemma4" and trained.config.attention_k_eq_v
    assert all(isinstance(layer, DSparkGemma4DecoderLayer) for layer in trained.layers)
    start = DSparkDraftModel(trained.config)  # the untrained start: the target's last two layers, fc passing through
    from dspark_hf.training.trainer import init_from_target

    init_from_target(start, target)
    assert torch.equal(start.layers[1].self_attn.q_proj.weight, target.model.layers[-1].self_attn.q_proj.weight)
    changed = {k for k, v in trained.named_parameters() if not torch.equal(v, start.state_dict()[k])}
    assert changed == {k for k, _ in trained.named_parameters()}  # every trainable weight moved
    assert torch.equal(trained.layers[1].layer_scalar, target.model.layers[-1].layer_scalar)  # a buffer: copied

    out = export_deepspec(trained, target, tmp_path / "deepspec")
    assert_same_weights(DSparkDraftModel.from_pretrained(out).state_dict(), trained.state_dict())


def test_model_card_names_the_layout():
    from dspark_hf.integrations.hub import model_card

    card = model_card(make_drafter(make_gemma4_target()).config)
    assert "`Gemma4DSparkModel` layout, head 16, shared K = V" in card and "dspark_gemma4_12b_block7" in card
    llama = DSparkConfig.for_target(gemma4_target_config(), num_hidden_layers=2, draft_layer="llama")
    assert "Llama blocks with QK-norm (DeepSpec `Qwen3DSparkModel`" in model_card(llama)
