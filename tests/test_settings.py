"""Settings put on a live drafter (`drafter.config.X = v`, the README's way to turn features on) are checked where
they are read: `generate()` (both ways in), the Engine's construction and each request it admits. An out-of-range
value is one `ValueError` naming the field, what it allows and the value given, before any forward; the same
checks run when a config is built or loaded (`DSparkConfig.check_runtime_settings`)."""

import json
import math

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError

import dspark_hf
from conftest import make_drafter, make_target
from dspark_hf import DSparkConfig, DSparkDraftModel, Engine
from dspark_hf.models.configuration_dspark import MAX_TREE_BUDGET


IDS = torch.tensor([[5, 6, 7, 8]])

# (field, a value @strict lets through, what the message must say besides the field and the value)
OUT_OF_RANGE = [
    ("tree_budget", -1, f"0..{MAX_TREE_BUDGET}"),
    ("tree_budget", MAX_TREE_BUDGET + 1, f"0..{MAX_TREE_BUDGET}"),
    ("tree_budget", 10000, f"0..{MAX_TREE_BUDGET}"),
    ("context_lookup", -1, "0..8"),
    ("context_lookup", 9, "0..8"),
    ("context_lookup", 100, "0..8"),
    ("context_window", 0, ">= 1"),
    ("context_window", -5, ">= 1"),
    ("confidence_threshold", -0.1, "[0, 1]"),
    ("confidence_threshold", 1.5, "[0, 1]"),
    ("confidence_threshold", math.nan, "[0, 1]"),
    ("confidence_threshold", math.inf, "[0, 1]"),
    ("verify_policy", "greedy", "'threshold', 'fixed', 'scheduler'"),
    ("verify_policy", "", "'threshold', 'fixed', 'scheduler'"),
    ("block_size", 0, ">= 1"),
    ("block_size", -3, ">= 1"),
    ("sts_temperatures", [1.0, 0.0, 1.0, 1.0], "4 positive"),
    ("sts_temperatures", [1.0, -2.0, 1.0, 1.0], "4 positive"),
    ("sts_temperatures", [1.0, math.nan, 1.0, 1.0], "4 positive"),
    ("sts_temperatures", [1.0, math.inf, 1.0, 1.0], "4 positive"),
    ("sts_temperatures", [1.0, 1.0], "4 positive"),  # one per block position
    ("draft_vocab_size", -1, "0..99"),
    ("draft_vocab_size", 100, "0..99"),
    ("mask_token_id", -1, "0..98"),
    ("mask_token_id", 99, "0..98"),
]


def _ids(cases):
    return [f"{name}={value!r}" for name, value, _ in cases]


def _expect(name, value, allowed):
    """The message names the field, what it allows and the value given, on one line."""

    def check(err):
        message = str(err.value)
        assert "\n" not in message, message
        assert f"`{name}`" in message and allowed in message and repr(value) in message, message

    return check


@pytest.fixture(scope="module")
def pair():
    target = make_target()
    return target, make_drafter(target, mask_token_id=None)


def _live(pair, name, value):
    """A fresh drafter of the pair's weights with `config.<name> = value` set as a user sets it."""
    target, drafter = pair
    live = make_drafter(target, mask_token_id=None)
    live.load_state_dict(drafter.state_dict())
    setattr(live.config, name, value)  # @strict checks the type only
    return target, live


@pytest.mark.parametrize("name, value, allowed", OUT_OF_RANGE, ids=_ids(OUT_OF_RANGE))
def test_generate_refuses_an_out_of_range_setting(pair, name, value, allowed):
    target, drafter = _live(pair, name, value)
    with pytest.raises(ValueError) as err:
        target.generate(IDS, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    _expect(name, value, allowed)(err)
    with pytest.raises(ValueError) as err:  # the hook without routing: the same check
        target.generate(IDS, max_new_tokens=4, custom_generate=dspark_hf.speculative_generate, drafter=drafter)
    _expect(name, value, allowed)(err)


@pytest.mark.parametrize("name, value, allowed", OUT_OF_RANGE, ids=_ids(OUT_OF_RANGE))
def test_the_engine_refuses_an_out_of_range_setting(pair, name, value, allowed):
    target, drafter = _live(pair, name, value)
    with pytest.raises(ValueError) as err:
        Engine(target, drafter, verify_policy="fixed")
    _expect(name, value, allowed)(err)


def test_the_engine_checks_again_when_a_request_arrives(pair):
    """The Engine reads the drafter's config every round: a setting changed after it was built is refused when a
    request arrives, and the engine serves on once it is set back."""
    target, drafter = _live(pair, "context_lookup", 3)
    engine = Engine(target, drafter, verify_policy="fixed")
    drafter.config.tree_budget = -1
    with pytest.raises(ValueError, match=r"`tree_budget` must be \"auto\" or an int in 0\.\.128.*got -1"):
        engine.add_request([5, 6, 7], max_new_tokens=3)
    assert not engine.has_unfinished()
    drafter.config.tree_budget = 0
    request = engine.add_request([5, 6, 7], max_new_tokens=3)
    while engine.has_unfinished():
        engine.step()
    assert len(request.output_ids) == 3


@pytest.mark.parametrize("name, value, allowed", OUT_OF_RANGE, ids=_ids(OUT_OF_RANGE))
def test_building_or_loading_a_config_refuses_the_same_values(tmp_path, name, value, allowed):
    fields = {"vocab_size": 99, "num_target_layers": 4, "target_layer_ids": [0, 2], "block_size": 4}
    if name == "block_size":  # a block of 0 would also need 0 temperatures: give the ones it checks first
        fields.pop("block_size")
    with pytest.raises(ValueError) as err:
        DSparkConfig(**{**fields, name: value})
    _expect(name, value, allowed)(err)
    if isinstance(value, float) and not math.isfinite(value):
        return  # not JSON
    folder = tmp_path / "ckpt"
    folder.mkdir()
    config = DSparkConfig(**fields).to_dict()
    (folder / "config.json").write_text(json.dumps({**config, name: value}))
    with pytest.raises(ValueError) as err:
        DSparkConfig.from_pretrained(folder)
    _expect(name, value, allowed)(err)


# bool is an int subclass, and an int where a float is expected is accepted by @strict: each must be refused anyway
WRONG_TYPES = [
    ("tree_budget", True),
    ("tree_budget", 2.0),
    ("context_lookup", False),
    ("context_lookup", "3"),
    ("context_window", True),
    ("block_size", True),
    ("confidence_threshold", True),
    ("confidence_threshold", "0.5"),
    ("verify_policy", 1),
    ("draft_gate", 1),
    ("confidence_head", 0),
    ("draft_vocab_size", True),
    ("mask_token_id", True),
    ("sts_temperatures", [True, 1.0, 1.0, 1.0]),
]


@pytest.mark.parametrize("name, value", WRONG_TYPES, ids=[f"{n}={v!r}" for n, v in WRONG_TYPES])
def test_wrong_types_are_refused_on_assignment_and_where_read(pair, name, value):
    target, drafter = pair
    with pytest.raises((StrictDataclassError, ValueError), match=name):
        setattr(make_drafter(target, mask_token_id=None).config, name, value)
    # a value that got past the assignment check (a copied __dict__, an older config object) is still refused
    _, live = _live(pair, name, getattr(drafter.config, name))
    live.config.__dict__[name] = value
    with pytest.raises(ValueError, match=f"`{name}`") as err:
        target.generate(IDS, max_new_tokens=4, do_sample=False, assistant_model=live)
    assert repr(value) in str(err.value)


def test_the_bounds_themselves_are_accepted(pair):
    target, drafter = pair
    config = drafter.config
    for name, values in {
        "tree_budget": [0, 1, MAX_TREE_BUDGET],
        "context_lookup": [0, 1, 8],
        "context_window": [None, 1, 10**6],
        "confidence_threshold": [0, 0.0, 1, 1.0],
        "verify_policy": ["threshold", "fixed", "scheduler"],
        "draft_vocab_size": [0],
    }.items():
        before = getattr(config, name)
        for value in values:
            setattr(config, name, value)
            config.check_runtime_settings(drafter)
        setattr(config, name, before)


def test_settings_fixed_by_the_weights_are_refused_when_changed_on_a_live_drafter(pair):
    """The draft vocabulary, the mask token and the heads are weights: the config must describe the drafter."""
    target, _ = pair
    drafter = make_drafter(target, mask_token_id=None)
    drafter.config.draft_vocab_size = 20  # instead of set_draft_vocab
    with pytest.raises(
        ValueError, match=r"`draft_vocab_size` is 20, but this drafter drafts among 0 .*set_draft_vocab"
    ):
        target.generate(IDS, max_new_tokens=4, assistant_model=drafter)
    drafter.set_draft_vocab(list(range(20)))  # the way to set it
    target.generate(IDS, max_new_tokens=4, assistant_model=drafter)
    drafter.set_draft_vocab(None)

    drafter.config.mask_token_id = 3  # this drafter learned a mask embedding
    with pytest.raises(ValueError, match=r"`mask_token_id` must be None for this drafter .*got 3"):
        target.generate(IDS, max_new_tokens=4, assistant_model=drafter)
    drafter.config.mask_token_id = None
    with_token = make_drafter(target, mask_token_id=3)
    with_token.config.mask_token_id = None
    with pytest.raises(ValueError, match=r"`mask_token_id` must be a token id in 0\.\.98 for this drafter.*got None"):
        target.generate(IDS, max_new_tokens=4, assistant_model=with_token)

    headless = make_drafter(target, confidence_head=False)
    headless.config.confidence_head = True
    with pytest.raises(ValueError, match="`confidence_head` must be False for this drafter"):
        target.generate(IDS, max_new_tokens=4, assistant_model=headless)
    drafter.config.sequential_head = "none"
    drafter.config.confidence_with_markov = False
    with pytest.raises(ValueError, match="`sequential_head` must be 'markov' for this drafter"):
        target.generate(IDS, max_new_tokens=4, assistant_model=drafter)
    drafter.config.sequential_head = "markov"  # the confidence head still reads the Markov embedding
    with pytest.raises(ValueError, match="`confidence_with_markov` must be True for this drafter"):
        target.generate(IDS, max_new_tokens=4, assistant_model=drafter)


def test_a_huge_tree_budget_is_refused_before_it_costs_anything(pair):
    """tree_budget=10000 under "fixed" verified 10,000 nodes a round (207 s for 20 tokens): refused at once."""
    target, drafter = _live(pair, "verify_policy", "fixed")
    drafter.config.tree_budget = 10000
    with pytest.raises(
        ValueError, match=rf"`tree_budget` must be \"auto\" or an int in 0\.\.{MAX_TREE_BUDGET} .*got 10000"
    ):
        target.generate(IDS, max_new_tokens=20, assistant_model=drafter)
    drafter.config.tree_budget = MAX_TREE_BUDGET  # the cap itself runs, and stays lossless
    plain = target.generate(IDS, max_new_tokens=6, do_sample=False)
    assert torch.equal(plain, target.generate(IDS, max_new_tokens=6, do_sample=False, assistant_model=drafter))


def test_a_loaded_drafter_with_a_bad_saved_setting_names_it(tmp_path, pair):
    target, drafter = pair
    drafter.save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**config, "context_lookup": 9}))
    with pytest.raises(ValueError, match=r"`context_lookup` must be an int in 0\.\.8 .*got 9"):
        DSparkDraftModel.from_pretrained(tmp_path / "d")
