"""Tiny random targets and drafters built in code (never downloaded); float32, eager attention, CPU."""

import os
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark_hf import DSparkConfig, DSparkDraftModel


os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` on two cores: one thread per worker (and per process a test starts), or OpenMP oversubscribes
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)


def make_target(vocab_size=99, num_layers=4, seed=0, config_cls=LlamaConfig, model_cls=LlamaForCausalLM, **overrides):
    """A tiny Llama (or another family) with deliberately odd sizes (hidden 32, head_dim 8, intermediate 37)."""
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **{"attn_implementation": "eager", **overrides},
    )
    model = model_cls(config).eval()
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def make_drafter(target, seed=1, randomize_heads=True, **overrides) -> DSparkDraftModel:
    """A random 2-layer drafter for `target` (block 4, layers [0, 2]); heads get non-zero weights."""
    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=2, block_size=4, markov_rank=8, target_layer_ids=[0, 2])
    fields.update(overrides)
    config = DSparkConfig.for_target(target.config, **fields)
    config._attn_implementation = "eager"
    drafter = DSparkDraftModel(config).eval()
    if randomize_heads and drafter.markov_head is not None:
        with torch.no_grad():
            torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)
            torch.nn.init.normal_(drafter.markov_head.markov_w1.weight, std=0.5)
    return drafter


@pytest.fixture
def two_threads():
    """Run at 2 intra-op threads, as a plain `pytest` run does (`make test`'s two workers run at one each), for
    kernels that choose by thread count, such as the verify attention's packed query heads; the caller's count is
    back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def target():
    return make_target()


@pytest.fixture
def drafter(target):
    return make_drafter(target)
