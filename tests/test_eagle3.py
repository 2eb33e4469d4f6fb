"""The EAGLE-3 baseline drafter: lossless in generate(), training-time test == inference drafting, training, I/O."""

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModel, DynamicCache

from conftest import make_target
from dspark_hf import Eagle3Config, Eagle3DraftModel
from dspark_hf.decoding.stats import record_draft_rounds
from dspark_hf.training.config import DSparkTrainingConfig
from dspark_hf.training.data import make_blocks
from dspark_hf.training.dataset import TokenDataset
from dspark_hf.training.step import target_features
from dspark_hf.training.trainer import DSparkTrainer


def make_eagle(target, seed=1, attn="eager", **overrides) -> Eagle3DraftModel:
    """A random EAGLE-3 drafter for `target` (block 4, low/mid/high taps [0, 1, 2] of the 4-layer target)."""
    torch.manual_seed(seed)
    fields = dict(block_size=4, target_layer_ids=[0, 1, 2])
    fields.update(overrides)
    config = Eagle3Config.for_target(target.config, **fields)
    config._attn_implementation = attn
    return Eagle3DraftModel(config).eval()


class ForceTokens:
    """A logits processor that records the raw draft logits and forces the tokens of `sequence` (teacher forcing
    through the real drafting path): one-hot logits at the token that follows the current prefix."""

    def __init__(self, sequence: torch.Tensor, diverge_at: int | None = None, vocab: int = 99):
        self.tokens, self.diverge_at, self.vocab, self.raw = sequence[0].tolist(), diverge_at, vocab, []
        self.start = None

    def __call__(self, ids, logits):
        self.raw.append(logits.clone())
        self.start = ids.shape[1] if self.start is None else self.start
        pos = ids.shape[1]
        token = self.tokens[pos] if pos < len(self.tokens) else 0
        if self.diverge_at is not None and pos - self.start == self.diverge_at:
            token = (token + 1) % self.vocab
        forced = torch.full_like(logits, -1e4)
        forced[:, token] = 1e4
        return forced


def pin_eagle(drafter, sequence, diverge_at=None):
    """Make `drafter` propose the tokens of `sequence` (its real forwards and cache still run); with `diverge_at=k`
    the draft at round slot k is wrong, so exactly k drafts survive each full round."""
    original = drafter.draft

    def draft(sequence_ids, *args, logits_processor=None, **kwargs):
        forcer = ForceTokens(sequence, diverge_at, drafter.config.vocab_size)
        return original(sequence_ids, *args, logits_processor=forcer, **kwargs)

    drafter.draft = draft
    return drafter


def greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


# -- lossless in generate() ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 5, 17])
def test_random_eagle_matches_greedy(target, prompt_len):
    drafter = make_eagle(target)
    ids = torch.randint(0, 99, (1, prompt_len))
    ref = greedy(target, ids, max_new_tokens=23)
    with record_draft_rounds() as rounds:
        out = greedy(target, ids, max_new_tokens=23, assistant_model=drafter)
    assert torch.equal(ref, out)
    stats = drafter.generation_stats
    assert stats.num_new_tokens == 23
    assert sum(stats.accepted_lengths) + stats.num_target_forwards + 1 == 23
    # the harness times every drafting round; full rounds propose block_size drafts
    assert [r.proposed for r in rounds] == stats.verify_lengths and max(stats.verify_lengths) == 4
    assert all(r.seconds > 0 for r in rounds)


def test_sdpa_eagle_matches_greedy(target):
    drafter = make_eagle(target, attn="sdpa")
    ids = torch.randint(0, 99, (1, 7))
    assert torch.equal(
        greedy(target, ids, max_new_tokens=15), greedy(target, ids, max_new_tokens=15, assistant_model=drafter)
    )


def test_oracle_eagle_accepts_everything(target):
    ids = torch.randint(0, 99, (1, 5))
    ref = greedy(target, ids, max_new_tokens=30)
    drafter = pin_eagle(make_eagle(target), ref)
    out = greedy(target, ids, max_new_tokens=30, assistant_model=drafter)
    assert torch.equal(ref, out)
    stats = drafter.generation_stats
    gamma = drafter.config.block_size
    assert stats.num_target_forwards == math.ceil((30 - 1) / (gamma + 1))
    assert stats.per_position_acceptance == [1.0] * gamma


@pytest.mark.parametrize("diverge_at", [0, 2])
def test_eagle_diverging_at_a_position(target, diverge_at):
    """Partial acceptance every round: the drafter's cache must be cropped and refilled consistently."""
    ids = torch.randint(0, 99, (1, 4))
    ref = greedy(target, ids, max_new_tokens=21)
    drafter = pin_eagle(make_eagle(target), ref, diverge_at=diverge_at)
    assert torch.equal(ref, greedy(target, ids, max_new_tokens=21, assistant_model=drafter))
    stats = drafter.generation_stats
    assert all(
        a == min(diverge_at, v) or s for v, a, s in zip(stats.verify_lengths, stats.accepted_lengths, stats.stopped)
    )


def test_left_padded_prompt_matches_greedy(target):
    drafter = make_eagle(target)
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.randint(1, 99, (1, 6))], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    ref = greedy(target, ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    out = greedy(target, ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, assistant_model=drafter)
    assert torch.equal(ref, out)


def test_block_size_is_read_per_call(target):
    """The evaluation harness sweeps the draft length by setting `config.block_size` between calls."""
    drafter = make_eagle(target)
    ids = torch.randint(0, 99, (1, 5))
    drafter.config.block_size = 9  # longer than trained: drafting is autoregressive, any length works
    assert torch.equal(
        greedy(target, ids, max_new_tokens=25), greedy(target, ids, max_new_tokens=25, assistant_model=drafter)
    )
    assert max(drafter.generation_stats.verify_lengths) == 9


# -- training-time test == inference -------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_training_time_test_equals_sequential_drafting(target, attn):
    """For every anchor block, the TTT logits equal what `draft` computes from that prefix when fed the same tokens
    (teacher-forced through the logits processor), with a fresh cache and with one carried over from earlier rounds."""
    drafter = make_eagle(target, attn=attn)
    gamma, length = drafter.config.block_size, 20
    seq = torch.randint(0, 99, (2, length))
    feats, _ = target_features(target, seq, drafter.config.target_layer_ids)
    blocks = make_blocks(seq, torch.ones_like(seq, dtype=torch.bool), gamma, 8, torch.Generator().manual_seed(0))
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        logits, conf = drafter.training_logits(feats, seq, blocks, embed, lm_head)
    assert conf is None and logits.shape == (2, 8, gamma, 99)
    checked = 0
    for b in range(2):
        carried, consumed = DynamicCache(), 0  # one cache across this row's anchors, as in generate()
        for n in blocks.anchors[b].sort().indices.tolist():
            a = int(blocks.anchors[b, n])
            steps = min(gamma, length - 1 - a)  # teacher-forced inputs must exist inside the sequence
            for cache, context in ((DynamicCache(), feats[b : b + 1, :a]), (carried, feats[b : b + 1, consumed:a])):
                forcer = ForceTokens(seq[b : b + 1])
                drafter.draft(seq[b : b + 1, : a + 1], context, cache, embed, lm_head, steps, logits_processor=forcer)
                assert cache.get_seq_length() == a + 1  # exact entries 0..a kept, self-fed ones dropped
                inference = torch.cat(forcer.raw)  # (steps, V)
                torch.testing.assert_close(logits[b, n, :steps], inference, atol=1e-4, rtol=1e-4)
                checked += steps
            consumed = a
    assert checked >= 2 * 8 * 2


def test_training_logits_on_a_shortlist_are_the_full_columns(target):
    drafter = make_eagle(target)
    seq = torch.randint(0, 99, (1, 16))
    feats, _ = target_features(target, seq, drafter.config.target_layer_ids)
    blocks = make_blocks(seq, torch.ones_like(seq, dtype=torch.bool), 4, 4, torch.Generator().manual_seed(1))
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    vocab_ids = torch.arange(0, 99, 3)
    with torch.no_grad():
        full, _ = drafter.training_logits(feats, seq, blocks, embed, lm_head)
        short, _ = drafter.training_logits(feats, seq, blocks, embed, lm_head, vocab_ids)
    torch.testing.assert_close(short, full[..., vocab_ids])


# -- training through the shared pipeline --------------------------------------------------------------------------


def tiny_dataset(n=12):
    gen = np.random.default_rng(0)
    seqs = [gen.integers(0, 99, size=24).tolist() for _ in range(n)]
    return TokenDataset.from_sequences(seqs, [3] * n)


def test_dspark_trainer_trains_an_eagle(tmp_path):
    """The same trainer, data and loss fit an EAGLE-3 drafter: on a fixed batch the L1 distance to the target's
    distribution falls (the learnable term; the CE against random data labels cannot)."""
    target = make_target()
    cfg = DSparkTrainingConfig(
        drafter_kind="eagle3", output_dir=str(tmp_path / "run"), block_size=3, seq_len=24, batch_size=2,
        num_anchors=4, max_steps=30, save_every=30, log_every=1, learning_rate=3e-2,
    )  # fmt: skip
    trainer = DSparkTrainer(cfg, target, tiny_dataset())
    assert isinstance(trainer.accelerator.unwrap_model(trainer.drafter), Eagle3DraftModel)
    ids, mask, _ = trainer.batch_for(0)

    def fixed_l1():
        with torch.no_grad():
            return trainer._loss(trainer.drafter, ids, mask, torch.Generator().manual_seed(0)).tv.item()

    before = fixed_l1()
    drafter = trainer.train()
    assert fixed_l1() < 0.85 * before
    assert isinstance(drafter, Eagle3DraftModel) and drafter.config.num_hidden_layers == 1
    back = AutoModel.from_pretrained(tmp_path / "run" / "checkpoint-30")
    assert isinstance(back, Eagle3DraftModel)
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(r["conf"] == 0.0 for r in logged) and logged[-1]["accept_rate"][0] > 0


def test_train_cli_with_drafter_kind_eagle3_and_resume(tmp_path):
    from dspark_hf.cli import main

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    tiny_dataset().save(tmp_path / "data.npz")
    (tmp_path / "train.json").write_text(json.dumps({"drafter_kind": "eagle3", "block_size": 3}))
    args = ["train", "--config", str(tmp_path / "train.json"), "--set", f"data={tmp_path / 'data.npz'}",
            f"target={tmp_path / 'target'}", f"output_dir={tmp_path / 'run'}", "seq_len=24", "batch_size=2",
            "num_anchors=4", "max_steps=2", "save_every=1"]  # fmt: skip
    assert main(args + ["--stop-after", "1"]) == 0
    assert main(args + ["--resume"]) == 0
    assert (tmp_path / "run/latest").read_text() == "checkpoint-2"
    saved = json.loads((tmp_path / "run/checkpoint-2/config.json").read_text())
    assert saved["model_type"] == "dspark_eagle3" and saved["block_size"] == 3


# -- configuration, save / load ------------------------------------------------------------------------------------


def test_config_defaults_and_validation(target):
    config = Eagle3Config.for_target(make_target(num_layers=12).config)
    assert config.num_hidden_layers == 1 and config.target_layer_ids == [1, 5, 9]  # low, middle, high (L-3)
    assert not hasattr(config, "sequential_head")  # no DSpark-only fields
    with pytest.raises(ValueError, match="exactly one decoder layer"):
        Eagle3Config.for_target(target.config, num_hidden_layers=2)
    with pytest.raises(ValueError, match="made for another target"):
        Eagle3Config.for_target(target.config).check_target(make_target(vocab_size=101).config)
    with pytest.raises(ValueError, match="drafter_kind"):
        DSparkTrainingConfig(drafter_kind="medusa")


def test_save_and_load_round_trip(target, tmp_path):
    drafter = make_eagle(target)
    drafter.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "dspark_eagle3"
    for loaded in (Eagle3DraftModel.from_pretrained(tmp_path, target=target), AutoModel.from_pretrained(tmp_path)):
        assert isinstance(loaded, Eagle3DraftModel)
        for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
            assert torch.equal(a, b), name
    ids = torch.randint(0, 99, (1, 6))
    loaded = Eagle3DraftModel.from_pretrained(tmp_path).eval()
    assert torch.equal(
        greedy(target, ids, max_new_tokens=12, assistant_model=drafter),
        greedy(target, ids, max_new_tokens=12, assistant_model=loaded),
    )
    with pytest.raises(ValueError, match="made for another target"):
        Eagle3DraftModel.from_pretrained(tmp_path, target=make_target(vocab_size=101))
