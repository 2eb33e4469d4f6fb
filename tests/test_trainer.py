"""The training loop: config files and overrides, atomic checkpoints, and resume that replays nothing."""

import json

import numpy as np
import pytest
import torch

from conftest import make_target
from dspark_hf.training.config import DSparkTrainingConfig
from dspark_hf.training.dataset import TokenDataset
from dspark_hf.training.trainer import DSparkTrainer, lr_factor


def tiny_dataset(n=12):
    gen = np.random.default_rng(0)
    seqs = [gen.integers(0, 99, size=int(gen.integers(10, 40))).tolist() for _ in range(n)]
    return TokenDataset.from_sequences(seqs, [3] * n)


def config(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "run"),
        num_hidden_layers=1,
        block_size=3,
        markov_rank=8,
        seq_len=24,
        batch_size=2,
        num_anchors=4,
        max_steps=4,
        save_every=2,
        log_every=1,
        learning_rate=1e-2,
    )
    base.update(kw)
    return DSparkTrainingConfig(**base)


def test_config_from_file_with_overrides_and_unknown_keys(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"block_size": 5, "learning_rate": 1e-3}))
    cfg = DSparkTrainingConfig.from_file(path, ["max_steps=7", "sequential_head=rnn"])
    assert (cfg.block_size, cfg.max_steps, cfg.sequential_head, cfg.learning_rate) == (5, 7, "rnn", 1e-3)
    with pytest.raises(ValueError, match="Unknown training option"):
        DSparkTrainingConfig.from_file(None, ["blok_size=3"])
    with pytest.raises(ValueError, match="batch_size"):
        DSparkTrainingConfig(batch_size=0)


def test_dataset_roundtrip_and_batches(tmp_path):
    ds = tiny_dataset()
    ds.save(tmp_path / "d.npz")
    back = TokenDataset.load(tmp_path / "d.npz")
    assert back.tokens.dtype == np.uint16 and np.array_equal(back.tokens, ds.tokens) and len(back) == 12
    ids, mask = back.batch([0, 1], seq_len=48, generator=torch.Generator().manual_seed(0))
    n0 = len(ds.sequence(0)[0])
    assert ids.shape == mask.shape == (2, 48) and not mask[:, :3].any()
    assert mask[0, 3:n0].all() and not mask[0, n0:].any() and ids[0, :n0].tolist() == ds.sequence(0)[0].tolist()
    ids, mask = back.batch([0], seq_len=8, generator=torch.Generator().manual_seed(0))  # cropped window
    assert ids.shape == (1, 8)


def test_several_datasets_load_as_one(tmp_path):
    """`data=a.npz,b.npz` (a grown data set: a second `dspark-hf data` run) trains on both, in order; token dtypes
    widen to the larger one; a missing file is named."""
    a = tiny_dataset(5)
    b = TokenDataset.from_sequences([[70_000, 1, 2, 3], [4, 5]], [1, 0])  # ids past uint16
    a.save(tmp_path / "a.npz")
    b.save(tmp_path / "b.npz")
    both = TokenDataset.load(f"{tmp_path / 'a.npz'}, {tmp_path / 'b.npz'}")
    assert len(both) == 7 and both.num_tokens == a.num_tokens + 6 and both.tokens.dtype == np.uint32
    for i in range(5):
        assert both.sequence(i)[0].tolist() == a.sequence(i)[0].tolist() and both.sequence(i)[1] == 3
    assert both.sequence(5)[0].tolist() == [70_000, 1, 2, 3] and both.sequence(5)[1] == 1
    assert both.sequence(6)[0].tolist() == [4, 5] and both.sequence(6)[1] == 0
    assert TokenDataset.load([tmp_path / "b.npz", tmp_path / "a.npz"]).sequence(0)[0][0] == 70_000
    with pytest.raises(ValueError, match="nope.npz"):
        TokenDataset.load(f"{tmp_path / 'a.npz'},{tmp_path / 'nope.npz'}")
    with pytest.raises(ValueError, match="No token dataset"):
        TokenDataset.load(" , ")


def test_seeded_batches_are_fixed_and_shared_by_evaluation_and_calibration():
    """One helper draws every seeded batch (training steps, held-out evaluation, calibration): a pure function of
    the seed, and the returned generator continues that stream (anchor sampling draws from it next)."""
    ds = tiny_dataset()
    first = list(ds.seeded_batches(3, batch_size=4, seq_len=8, first_seed=10_000))
    again = list(ds.seeded_batches(3, batch_size=4, seq_len=8, first_seed=10_000))
    for (ids, mask, gen), (ids2, mask2, gen2) in zip(first, again):
        assert torch.equal(ids, ids2) and torch.equal(mask, mask2)
        assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=gen2))
    assert not torch.equal(first[0][0], first[1][0])  # consecutive seeds, different batches
    ids, mask, _ = ds.sample_batch(4, 8, seed=10_001)
    assert torch.equal(ids, first[1][0]) and torch.equal(mask, first[1][1])


def test_lr_schedule_warmup_then_cosine():
    assert lr_factor(0, 4, 100) == 0.25 and lr_factor(3, 4, 100) == 1.0
    assert lr_factor(100, 4, 100) == pytest.approx(0.0, abs=1e-9)


def test_resume_continues_exactly(tmp_path):
    target = make_target()
    straight = DSparkTrainer(config(tmp_path / "a"), target, tiny_dataset()).train()
    first = DSparkTrainer(config(tmp_path / "b"), target, tiny_dataset())
    first.train(stop_after=2)  # as if killed after the step-2 checkpoint
    assert (tmp_path / "b/run/latest").read_text() == "checkpoint-2"
    resumed = DSparkTrainer(config(tmp_path / "b"), target, tiny_dataset())
    final = resumed.train(resume=True)
    assert resumed.step == 4
    for (name, a), (_, b) in zip(straight.state_dict().items(), final.state_dict().items()):
        assert torch.equal(a, b), name
    logged = [json.loads(line) for line in (tmp_path / "a/run/log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in logged)
    assert sorted(p.name for p in (tmp_path / "a/run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_train_cli_runs_and_resumes(tmp_path):
    from dspark_hf.cli import main

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    tiny_dataset().save(tmp_path / "data.npz")
    args = [
        "train",
        "--set",
        f"data={tmp_path / 'data.npz'}",
        f"target={tmp_path / 'target'}",
        f"output_dir={tmp_path / 'run'}",
        "num_hidden_layers=1",
        "block_size=3",
        "markov_rank=8",
        "seq_len=24",
        "batch_size=2",
        "num_anchors=4",
        "max_steps=3",
        "save_every=1",
    ]
    assert main(args + ["--stop-after", "2"]) == 0
    assert (tmp_path / "run/latest").read_text() == "checkpoint-2"
    assert main(args + ["--resume"]) == 0
    assert (tmp_path / "run/latest").read_text() == "checkpoint-3"


def test_a_drafter_config_file_is_a_valid_training_config(tmp_path):
    target = make_target()
    from conftest import make_drafter

    make_drafter(target, block_size=3).config.to_json_file(tmp_path / "drafter.json")
    cfg = DSparkTrainingConfig.from_file(tmp_path / "drafter.json", [f"output_dir={tmp_path / 'run'}", "max_steps=1"])
    assert cfg.drafter_config == str(tmp_path / "drafter.json")
    trainer = DSparkTrainer(cfg, target, tiny_dataset())
    assert trainer.accelerator.unwrap_model(trainer.drafter).config.block_size == 3
    trainer.train()


def test_shape_settings_override_a_drafter_config_file(tmp_path):
    """`--config hub_configs/X.json --set num_hidden_layers=1 sequential_head=none` trains that shape, not the
    file's."""
    from conftest import make_drafter
    from dspark_hf.training.trainer import build_drafter

    target = make_target()
    make_drafter(target, block_size=3, num_hidden_layers=2).config.to_json_file(tmp_path / "drafter.json")
    cfg = DSparkTrainingConfig.from_file(
        tmp_path / "drafter.json", ["num_hidden_layers=1", "block_size=4", "sequential_head=none"]
    )
    drafter = build_drafter(cfg, target)
    assert (drafter.config.num_hidden_layers, drafter.config.block_size) == (1, 4)
    assert drafter.config.sequential_head == "none" and not drafter.config.confidence_with_markov
    assert len(drafter.config.sts_temperatures) == 4 and len(drafter.layers) == 1
    unchanged = build_drafter(DSparkTrainingConfig.from_file(tmp_path / "drafter.json"), target)
    assert (unchanged.config.num_hidden_layers, unchanged.config.block_size) == (2, 3)
    with pytest.raises(ValueError, match="drafter_kind"):
        build_drafter(DSparkTrainingConfig.from_file(tmp_path / "drafter.json", ["drafter_kind=eagle3"]), target)


def test_two_cpu_processes_stay_in_sync(tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo): different batches per rank, identical weights after steps."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "dist_train_script.py"
    # On CPU, accelerate's torchrun path (--multi_gpu) plus ACCELERATE_USE_CPU gives gloo multi-process training;
    # `--cpu` alone would start a single process.
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert r0["batch0"] != r1["batch0"]  # each rank saw its own data
    assert r0["sum"] == r1["sum"] and r0["first"] == r1["first"]  # ...and the gradients were all-reduced


# `dspark-hf` run by the kill -9 test: with PAUSE_IN_SAVE=k it stops for good inside the save of checkpoint-k, its
# weights and optimiser state written to the temporary folder but not yet its manifest (nor renamed, nor `latest`
# moved), and says so by creating the file PAUSED: the test kills it there, mid-save, whatever the machine's speed.
KILL_9_CHILD = """
import os, sys, threading
from pathlib import Path
import dspark_hf.training.trainer as trainer
pause, write_manifest = os.environ.get("PAUSE_IN_SAVE"), trainer.write_manifest
def paused_write_manifest(folder):
    if pause is not None and Path(folder).name == f".checkpoint-{pause}.tmp":
        Path(os.environ["PAUSED"]).touch()
        threading.Event().wait()  # until SIGKILL
    write_manifest(folder)
trainer.write_manifest = paused_write_manifest
from dspark_hf.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_then_resume_loses_nothing(tmp_path):
    """SIGKILL a training process mid-run (inside the save of checkpoint-7: 6 is complete, 7's files half
    written); `--resume` finishes with exactly the weights of an uninterrupted run (which trains beside it, one thread
    each). The child stops itself at that point, so the kill lands there however loaded the machine is."""
    import os
    import signal
    import subprocess
    import sys

    from clocks import wait_for

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    tiny_dataset().save(tmp_path / "data.npz")
    steps, killed_in = 12, 7

    def command(run):
        return [
            sys.executable,
            "-c",
            KILL_9_CHILD,
            "train",
            "--set",
            f"data={tmp_path / 'data.npz'}",
            f"target={tmp_path / 'target'}",
            f"output_dir={tmp_path / run}",
            "num_hidden_layers=1",
            "block_size=3",
            "markov_rank=8",
            "seq_len=24",
            "batch_size=2",
            "num_anchors=4",
            f"max_steps={steps}",
            "save_every=1",
            "log_every=1",
        ]

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    paused = tmp_path / "paused"
    errors = (tmp_path / "straight.err").open("w")
    straight = subprocess.Popen(command("straight"), env=env, stdout=subprocess.DEVNULL, stderr=errors)
    killed_env = dict(env, PAUSE_IN_SAVE=str(killed_in), PAUSED=str(paused))
    with (tmp_path / "killed.err").open("w") as killed_errors:  # a file, not a pipe: a full pipe would block it
        proc = subprocess.Popen(command("killed"), env=killed_env, stdout=subprocess.DEVNULL, stderr=killed_errors)
    try:
        wait_for(lambda: paused.exists() or proc.poll() is not None, timeout=300, what="the pause before the kill")
        assert proc.poll() is None, "the run ended before the pause: " + (tmp_path / "killed.err").read_text()[-3000:]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    run = tmp_path / "killed"
    assert (run / "latest").read_text() == f"checkpoint-{killed_in - 1}"  # the last complete one
    assert (run / f".checkpoint-{killed_in}.tmp").is_dir() and not (run / f"checkpoint-{killed_in}").exists()
    resumed = subprocess.run(command("killed") + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert straight.wait(timeout=300) == 0, (tmp_path / "straight.err").read_text()
    errors.close()
    from dspark_hf import DSparkDraftModel

    a = DSparkDraftModel.from_pretrained(run / f"checkpoint-{steps}")
    b = DSparkDraftModel.from_pretrained(tmp_path / "straight" / f"checkpoint-{steps}")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    logged = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert logged == list(range(1, killed_in + 1)) + list(range(killed_in, steps + 1))  # step 7 logged twice


def test_init_from_target_copies_the_top_layers():
    from dspark_hf.training.trainer import build_drafter

    target = make_target()
    drafter = build_drafter(DSparkTrainingConfig(num_hidden_layers=2, block_size=3, markov_rank=8), target)
    top = target.model.layers
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, top[2].self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[1].mlp.down_proj.weight, top[3].mlp.down_proj.weight)
    d = target.config.hidden_size
    assert torch.equal(drafter.fc.weight[:, -d:], torch.eye(d)) and not drafter.fc.weight[:, :-d].any()
    plain = build_drafter(DSparkTrainingConfig(num_hidden_layers=2, init_from_target=False), target)
    assert not torch.equal(plain.layers[0].self_attn.q_proj.weight, top[2].self_attn.q_proj.weight)


def test_heldout_evaluation_keeps_the_best_drafter(tmp_path):
    target = make_target()
    tiny_dataset().save(tmp_path / "heldout.npz")
    cfg = config(tmp_path, heldout=str(tmp_path / "heldout.npz"), eval_every=2, eval_batches=2)
    DSparkTrainer(cfg, target, tiny_dataset()).train()
    records = [json.loads(line) for line in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_greedy_tau" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(1.0 <= r["eval_greedy_tau"] <= 4.0 for r in evals)
    best = json.loads((tmp_path / "run/best/trainer_state.json").read_text())
    assert best["eval_greedy_tau"] == max(r["eval_greedy_tau"] for r in evals)


def test_greedy_tau_counts_leading_correct_drafts():
    from dspark_hf.training import dspark_loss

    vocab = 5
    labels = torch.tensor([[[1, 2, 3], [1, 2, 3]]])  # two blocks of γ = 3
    draft = torch.zeros(1, 2, 3, vocab)
    draft[0, 0, torch.arange(3), torch.tensor([1, 2, 0])] = 5.0  # 2 leading correct
    draft[0, 1, torch.arange(3), torch.tensor([0, 2, 3])] = 5.0  # first wrong: 0 accepted
    out = dspark_loss(draft, draft, labels, torch.ones(1, 2, 3, dtype=torch.bool))
    assert out.greedy_tau.item() == 1 + (2 + 0) / 2


def test_a_stage_starts_from_an_earlier_drafter(tmp_path):
    """`init_drafter`: a curriculum's next stage continues from the previous stage's weights, with a fresh run."""
    target = make_target()
    first = DSparkTrainer(config(tmp_path), target, tiny_dataset()).train()
    stage2 = config(tmp_path, output_dir=str(tmp_path / "stage2"), init_drafter=str(tmp_path / "run/checkpoint-4"),
                    max_steps=1, train_vocab_size=20)  # fmt: skip
    trainer = DSparkTrainer(stage2, target, tiny_dataset())
    start = trainer.accelerator.unwrap_model(trainer.drafter)
    for name, p in first.state_dict().items():
        assert torch.equal(p, start.state_dict()[name]), name
    assert trainer.step == 0 and len(trainer.vocab_ids) <= 22
    trained = trainer.train()
    assert any(not torch.equal(p, trained.state_dict()[n]) for n, p in first.state_dict().items())


def test_distil_from_pulls_a_drafter_towards_another(tmp_path):
    """`distil_from`: the trained drafter's block distributions approach the teacher drafter's (KL on a held batch
    falls), which training on the target alone does not do; a teacher drafting other blocks is refused."""
    from dspark_hf.training.step import block_predictions

    target = make_target()
    DSparkTrainer(config(tmp_path / "t", seed=1, max_steps=2), target, tiny_dataset()).train()
    teacher_dir = str(tmp_path / "t/run/checkpoint-2")
    judge = DSparkTrainer(config(tmp_path / "judge", distil_from=teacher_dir), target, tiny_dataset())

    def distance_to_teacher(drafter):
        ids, mask, _ = judge.batch_for(10_000)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            p = block_predictions(drafter.eval(), target, ids, mask, 4, gen, teacher=judge.teacher)
        kl = p.teacher_logits.softmax(-1) * (p.teacher_logits.log_softmax(-1) - p.draft_logits.log_softmax(-1))
        return float((kl.sum(-1) * p.blocks.valid).sum() / p.blocks.valid.sum())

    start = distance_to_teacher(judge.accelerator.unwrap_model(judge.drafter))  # seed 0: where both runs start
    quiet = dict(alpha_ce=0.0, alpha_tv=0.0, alpha_kl=1.0, alpha_conf=0.0, max_steps=12, save_every=12)
    distilled = DSparkTrainer(config(tmp_path / "d", distil_from=teacher_dir, **quiet), target, tiny_dataset())
    control = DSparkTrainer(config(tmp_path / "c", **quiet), target, tiny_dataset())  # the target's KL instead
    after, other = distance_to_teacher(distilled.train()), distance_to_teacher(control.train())
    assert after < 0.5 * start and after < 0.5 * other, (start, after, other)
    with pytest.raises(ValueError, match="block_size"):
        DSparkTrainer(config(tmp_path / "bad", block_size=4, distil_from=teacher_dir), target, tiny_dataset())


@pytest.mark.parametrize("keep", [True, False])
def test_checkpoints_draft_over_the_training_shortlist(tmp_path, keep):
    """With `train_vocab_size`, every checkpoint carries the shortlist as its draft vocabulary (inference drafts
    among the tokens the drafter learnt to rank); `shortlist_draft_vocab=false` leaves the full vocabulary."""
    from dspark_hf import DSparkDraftModel

    target = make_target()
    target.config.eos_token_id = 98  # kept even if too rare for the shortlist
    cfg = config(tmp_path, train_vocab_size=20, shortlist_draft_vocab=keep, max_steps=2)
    trainer = DSparkTrainer(cfg, target, tiny_dataset())
    trainer.train()
    saved = DSparkDraftModel.from_pretrained(tmp_path / "run/checkpoint-2")
    if keep:
        assert saved.config.draft_vocab_size == len(trainer.vocab_ids)
        assert torch.equal(saved.draft_vocab_ids, trainer.vocab_ids.cpu())
        assert 98 in saved.draft_vocab_ids.tolist()
    else:
        assert saved.config.draft_vocab_size == 0 and saved.draft_vocab_ids is None


def test_max_time_fits_the_schedule_to_the_budget(tmp_path, monkeypatch):
    """A time budget stops the run and ends the cosine schedule there, with a checkpoint; the clock is simulated (each
    step 'takes' one second), so nothing here is timed."""
    import dspark_hf.training.trainer as trainer_module

    clock = iter(range(10_000))
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: float(next(clock)))
    cfg = config(tmp_path, max_steps=1000, max_time=30, save_every=1000, log_every=1000)
    trainer = DSparkTrainer(cfg, make_target(), tiny_dataset())
    rates, step = [], trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda: [step(), rates.append(trainer.scheduler.get_last_lr()[0])][0])
    trainer.train()
    assert 20 <= trainer.step <= 31, trainer.step  # ~30 one-second steps, not 1000
    # fitted from the second step on: the warm-up is 4 % of ~30 steps, not of max_steps (40 steps at ~1e-5)
    assert rates[2] > 0.9 * cfg.learning_rate
    assert trainer.total_steps == trainer.step
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-9)  # the cosine ended with the run
    assert (tmp_path / "run/latest").read_text() == f"checkpoint-{trainer.step}"
    state = json.loads((tmp_path / f"run/checkpoint-{trainer.step}/trainer_state.json").read_text())
    assert state["total_steps"] == trainer.step


def test_max_time_must_not_be_negative():
    with pytest.raises(ValueError, match="max_time"):
        DSparkTrainingConfig(max_time=-1)
