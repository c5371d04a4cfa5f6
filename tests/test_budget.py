"""The `budget` option: a method's rows per pass, the same for every pass (its window, tree nodes, or
slots per front under another name, as `auto`'s candidates "mc-sjd:8" write it), and its bad values,
"auto" among them (a size chosen per pass lost to the best fixed size, docs/SPEED.md)."""

import pytest
import torch
from laws import TOPP_TEMP, tiny_llamagen, unit_codebook

from visar.accel import METHODS, get_method
from visar.accel.core.method_registry import Request
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.errors import VisarError

BUDGET_METHODS = sorted(name for name, method in METHODS.items() if "budget" in method.options)
FRONT_METHODS = ("zipar-sjd", "zipar-mc-sjd", "zipar-gsd", "zipar-tree")


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen()


def run(name: str, model, cond, generators, **options):
    tokenizer = unit_codebook(model.vocab_size, 3, 0) if name == "zipar-gsd" else None
    return get_method(name).fn(Request(model, cond, TOPP_TEMP, generators, tokenizer=tokenizer), **options)


def test_the_methods_with_a_budget_are_the_drafting_raster_ones():
    assert BUDGET_METHODS == sorted(["sjd", "mc-sjd", "sjd-pac", "tree-mc-sjd", *FRONT_METHODS])


@pytest.mark.parametrize(
    "name, size, options",
    [
        ("sjd", 3, {}),
        ("mc-sjd", 2, {}),
        ("mc-sjd", 5, {"coupling": "gumbel"}),
        ("sjd-pac", 9, {"branch": 2, "depth": 3}),
        ("tree-mc-sjd", 12, {"branch": 3, "depth": 2}),
        ("zipar-sjd", 3, {"s": 2}),
        ("zipar-mc-sjd", 3, {"s": 2}),
        ("zipar-gsd", 2, {"s": 2}),
        ("zipar-tree", 3, {"s": 2, "branch": 3}),
    ],
)
def test_a_number_is_the_window(name, size, options):
    """budget=N decodes every pass at N rows: token for token the method at window=N, and stats say N."""
    grid = tiny_llamagen(block_size=16, seed=3)
    cond, gens = torch.tensor([0, 1, 2]), lambda: make_generators(3, 5)
    numbered, stats = run(name, grid, cond, gens(), budget=size, **options)
    windowed, fixed = run(name, grid, cond, gens(), window=size, **options)
    assert torch.equal(numbered, windowed)
    assert stats["budget"] == size and stats["window"] == size and fixed["budget"] == "fixed"
    assert stats["forward_passes"] == fixed["forward_passes"]


@pytest.mark.parametrize("name", BUDGET_METHODS)
@pytest.mark.parametrize("value", ["fast", 0, -2, 1.5, True, [4]])
def test_bad_budget_is_one_sentence(model, name, value):
    number = "slots per front and pass" if name in FRONT_METHODS else "rows per pass"
    with pytest.raises(VisarError, match=f"budget for {name} must be a whole number of {number} >= 1, or None"):
        run(name, model, torch.tensor([0]), make_generators(1, 0), budget=value)


@pytest.mark.parametrize("name", BUDGET_METHODS)
def test_budget_auto_says_where_choosing_went(model, name):
    """budget="auto" was a size chosen every few passes; it is gone, and the sentence says what to use."""
    with pytest.raises(VisarError, match=r"budget='auto' is gone .* or use method='auto', which times fixed sizes"):
        run(name, model, torch.tensor([0]), make_generators(1, 0), budget="auto")


def test_a_number_budget_keeps_an_image_independent_of_its_batch():
    """Every pass has the same size whatever the batch: image 1 decoded beside others equals image 1
    decoded alone from the same generator."""
    grid, params = tiny_llamagen(block_size=16, seed=5), SamplingParams(temperature=1.0)
    together, _ = get_method("mc-sjd").fn(
        Request(grid, torch.tensor([2, 1, 0]), params, make_generators(3, 7)), budget=4
    )
    alone, _ = get_method("mc-sjd").fn(Request(grid, torch.tensor([1]), params, make_generators(3, 7)[1:2]), budget=4)
    assert torch.equal(together[1], alone[0])
