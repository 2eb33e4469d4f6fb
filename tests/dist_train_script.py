"""Run by `accelerate launch --multi_gpu --num_processes 2` with ACCELERATE_USE_CPU=1; ranks write checksums."""

import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState


sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import config, tiny_dataset  # noqa: E402

from conftest import make_target  # noqa: E402
from dspark_hf.training.trainer import DSparkTrainer  # noqa: E402


def main(out: Path):
    target = make_target()  # identical on every rank (seeded)
    trainer = DSparkTrainer(config(out, max_steps=3, save_every=3), target, tiny_dataset())
    drafter = trainer.train()
    state = PartialState()
    flat = torch.cat([p.detach().flatten() for p in drafter.parameters()])
    ids, _, _ = trainer.batch_for(0)
    record = {
        "rank": state.process_index,
        "world": state.num_processes,
        "sum": flat.double().sum().item(),
        "first": flat[:8].tolist(),
        "batch0": ids[0, :6].tolist(),
    }
    (out / f"rank{state.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
