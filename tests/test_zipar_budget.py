"""zipar's Jacobi fronts under a budget (`decode_fronts_under`, `budget.FrontBudget`): the exact law
with the window per front chosen per pass (s >= W), what a pass at each window would be, the
choices the costs drive, and the option's bad values."""

import pytest
import torch
from laws import (
    CFG_TOPK,
    SAMPLES,
    TOPP_TEMP,
    VOCAB,
    compare_laws,
    exact_law,
    sequence_index,
    tiny_llamagen,
    unit_codebook,
)

from visar.accel import budget, get_method
from visar.accel.budget import FrontBudget, PassCosts, SurvivalCounts, pin_costs
from visar.accel.drafts import resolve_initialiser
from visar.accel.registry import Request
from visar.accel.sampling import SamplingParams, UniformStream, make_generators
from visar.accel.zipar import budgets
from visar.accel.zipar import engine as zipar_engine
from visar.accel.zipar.budgets import front_shapes
from visar.accel.zipar.engine import decode_fronts
from visar.accel.zipar.plan import plan_pass
from visar.errors import VisarError

FRONT_METHODS = ("zipar-sjd", "zipar-mc-sjd", "zipar-gsd", "zipar-tree")


def run(name: str, model, cond, params, generators, tokenizer=None, **options):
    """The method `name` on these images; zipar-gsd compares tokens by their code vectors (`tokenizer`,
    a codebook; the law model's own by default)."""
    if name == "zipar-gsd" and tokenizer is None:
        tokenizer = unit_codebook(model.vocab_size, 3, 0)
    return get_method(name).fn(Request(model, cond, params, generators, tokenizer=tokenizer), **options)


def chain_costs_at(two: float, four: float):
    """Chain costs (seconds per pass) with windows 2 and 4 at these prices, window 1 at 1."""
    return lambda engine, size: {0: 0.9, 1: 1.0, 2: two, 4: four, 8: 3.0}[size]


# A second slot pays only while its draft passes more than 45% of the time, a third while drafts
# pass more than about 60%: near the law model's acceptance, so the choice follows the counts.
close_call = chain_costs_at(1.45, 1.9)


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen()


@pytest.fixture(scope="module")
def model9():
    """3 x 3 tokens, vocabulary 3: 19,683 sequences, enumerable; three rows, so the later fronts
    choose from the counts of the earlier ones."""
    return tiny_llamagen(vocab=3, block_size=9, seed=0, std=0.5)


@pytest.fixture
def choosing_every_pass(monkeypatch, model, model9):
    monkeypatch.setattr(budget, "CHOOSE_EVERY", 1)
    pin_costs(model, close_call)
    pin_costs(model9, close_call)
    yield
    pin_costs(model, None)
    pin_costs(model9, None)


LAW_CASES = [  # s = 3 = W: each row starts once the row above is complete, so the fronts are exact.
    # The costs put each method's choice near its acceptance (set on other seeds), so sizes switch.
    ("zipar-sjd", dict(init="above-left"), CFG_TOPK, close_call),
    ("zipar-mc-sjd", dict(init="above", coupling="gumbel"), TOPP_TEMP, chain_costs_at(1.25, 1.45)),
    ("zipar-gsd", dict(group_size=1), CFG_TOPK, chain_costs_at(1.3, 1.6)),
    ("zipar-tree", dict(branch=2), CFG_TOPK, chain_costs_at(1.25, 1.45)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, options, params, costs", LAW_CASES, ids=[c[0] for c in LAW_CASES])
def test_joint_law_is_exact_under_an_auto_budget(model9, choosing_every_pass, name, options, params, costs):
    label, chosen, tokens = 1, {}, []
    pin_costs(model9, costs)
    for first in range(0, SAMPLES, 40):  # each batch of 40 its own budget, choosing from its own counts
        generators = make_generators(40, 50000 + first)
        out, stats = run(name, model9, torch.full((40,), label), params, generators, s=3, budget="auto", **options)
        tokens.append(out)
        for size, passes in stats["sizes_chosen"].items():
            chosen[size] = chosen.get(size, 0) + passes
    pvalue, tv, tolerance = compare_laws(sequence_index(torch.cat(tokens), 3), exact_law(model9, label, params))
    print(f"{name}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f} sizes chosen {chosen}")
    assert pvalue > 1e-3 and tv < tolerance, (pvalue, tv, tolerance)
    assert len([size for size, passes in chosen.items() if passes > SAMPLES // 40 // 10]) >= 2, chosen


def upcoming(stream: UniformStream, count: int) -> torch.Tensor:
    """Image 0's next `count` uniforms from a UniformStream, without taking them: what its buffer
    holds, then what its generator would draw next (through a copy of its state)."""
    held = stream.buffer[0, stream.used :][:count].cpu()
    generator = stream.generators[0]
    state = generator.get_state()
    fresh = torch.rand(count - len(held), generator=generator)
    generator.set_state(state)
    return torch.cat([held, fresh])


class PeekingFronts:
    """Negative control: a budget that reads image 0's next accept uniform for row 1's first slot
    (ahead in the decode's UniformStream, `streams[-1]`) and drafts only when that test will pass easily."""

    def __init__(self, streams: list, height: int):
        self.streams, self.height = streams, height

    def size(self, count):
        block = upcoming(self.streams[-1], 4 * self.height * 2).view(4, self.height, 2)
        return 2 if block[0, 1, 0] < 0.5 else 1  # purpose 0 is ACCEPT (jacobi.ACCEPT)

    def count(self, *outcome):
        pass

    def progress(self, image_tokens):
        pass

    def stats(self):
        return {}


@pytest.mark.slow
def test_a_front_budget_that_peeks_at_the_next_uniforms_is_detected(model, monkeypatch):
    params, label, tokens = CFG_TOPK, 1, []
    streams = []  # each decode's UniformStream, caught as the fronts make it
    monkeypatch.setattr(
        zipar_engine, "UniformStream", lambda *args, **kw: streams.append(UniformStream(*args, **kw)) or streams[-1]
    )
    for i in range(3000):
        generators = make_generators(1, 4000 + i)
        request = Request(model, torch.tensor([label]), params, generators)
        peeking = PeekingFronts(streams, 2)
        out, _ = decode_fronts(request, s=2, window=2, initialiser=resolve_initialiser("random"), budget=peeking)
        tokens.append(out)
    pvalue, tv, _ = compare_laws(sequence_index(torch.cat(tokens), VOCAB), exact_law(model, label, params))
    print(f"peeking front budget: p={pvalue:.3g} tv={tv:.4f}")
    assert pvalue < 1e-6


def test_shapes_are_what_plan_pass_would_feed():
    """front_shapes plans every size at once; plan_pass, one size at a time, must agree."""
    torch.manual_seed(0)
    height, width, s = 6, 8, 2
    count = torch.zeros(3, height, dtype=torch.long)
    for b in range(3):  # a valid state of the lag: each row at most what the row above allows
        above = width
        for r in range(height):
            count[b, r] = int(torch.randint(0, max(above - s, 0) + 1, ())) if above < width else above - b
            above = int(count[b, r])
    sizes = (1, 2, 4, 8)
    for cross_row in (False, True):
        shapes = front_shapes(count, sizes, width, s, cross_row, side_rows=2)
        for i, size in enumerate(sizes):
            window_len = plan_pass(count, count.clone(), (height, width), s, size, cross_row).window_len
            drafts = (window_len - 1).clamp(min=0)
            rows = window_len.sum(1) + 2 * (drafts > 0).sum(1)
            assert shapes[i, 0] == rows.max()
            by_drafts = [((window_len > 0) & (drafts == d)).sum(1).float().mean() for d in range(max(sizes))]
            assert torch.allclose(shapes[i, 1:], torch.stack(by_drafts))


def test_the_budget_widens_windows_where_rows_are_free_and_narrows_them_where_they_cost(model):
    """On a 4 x 4 grid (s = W: one front, AR's law): flat costs choose the widest window, costs in
    proportion to the rows one slot."""
    grid = tiny_llamagen(block_size=16, seed=3)
    cond, sizes = torch.tensor([0, 1]), {}
    try:
        for name, seconds in (("flat", lambda e, size: 1.0), ("rows", lambda e, size: 0.5 + max(size, 1))):
            pin_costs(grid, seconds)
            _, stats = run("zipar-mc-sjd", grid, cond, TOPP_TEMP, make_generators(2, 0), s=4, budget="auto")
            sizes[name] = stats["sizes_chosen"]
    finally:
        pin_costs(grid, None)
    assert max(sizes["flat"], key=sizes["flat"].get) == 4, sizes
    assert set(sizes["rows"]) == {1}, sizes


def test_auto_fronts_equal_greedy_ar_and_say_what_they_chose(model, choosing_every_pass):
    cond, greedy = torch.tensor([0, 1, 2]), SamplingParams(top_k=1)
    ar_tokens, _ = run("ar", model, cond, greedy, make_generators(3, 0))
    for name in FRONT_METHODS:
        tokens, stats = run(name, model, cond, greedy, make_generators(3, 0), s=2, budget="auto")
        assert torch.equal(tokens, ar_tokens), name
        assert stats["budget"] == "auto" and stats["pass_ms"] == {0: 900.0, 1: 1000.0, 2: 1450.0, 4: 1900.0}
        assert sum(stats["sizes_chosen"].values()) == stats["forward_passes"] - 1  # all but the prefill


def test_a_number_is_the_window_per_front(model):
    cond, gens = torch.tensor([0, 1]), lambda: make_generators(2, 5)
    grid = tiny_llamagen(block_size=16, seed=3)
    numbered, stats = run("zipar-mc-sjd", grid, cond, TOPP_TEMP, gens(), s=2, budget=3)
    windowed, _ = run("zipar-mc-sjd", grid, cond, TOPP_TEMP, gens(), s=2, window=3)
    assert torch.equal(numbered, windowed) and stats["budget"] == 3 and stats["window"] == 3


def test_a_failed_measurement_falls_back_to_the_window(monkeypatch):
    monkeypatch.setattr(budgets, "chain_costs", lambda request, make_proposer: None)
    grid, cond = tiny_llamagen(block_size=16, seed=4), torch.tensor([0])
    tokens, stats = run("zipar-sjd", grid, cond, TOPP_TEMP, make_generators(1, 0), budget="auto", window=3)
    assert stats["budget"] == "fixed window 3: the pass costs could not be measured"
    fixed, _ = run("zipar-sjd", grid, cond, TOPP_TEMP, make_generators(1, 0), window=3)
    assert torch.equal(tokens, fixed)


def test_costs_past_the_largest_size_grow_in_proportion():
    costs = PassCosts((1, 2, 4), (1.0, 1.5, 2.0))
    assert costs.in_proportion(3) == 2.0 and costs.in_proportion(8) == 4.0


def test_counts_of_the_first_row_teach_nothing():
    controller = FrontBudget(PassCosts((1, 2), (1.0, 1.2)), (1, 2), SurvivalCounts(4, "cpu"), None)
    accepted, available = torch.tensor([1, 1]), torch.tensor([1, 1])
    controller.count(
        accepted, available, torch.tensor([False, True]), torch.zeros(2, 1, dtype=torch.long), torch.tensor([4])
    )
    progress = controller.settle()  # a pass's outcome is counted at the next choice
    assert controller.counts.reached.tolist() == [1, 0, 0, 0] and progress.tolist() == [4, 1]


@pytest.mark.parametrize("name", FRONT_METHODS)
@pytest.mark.parametrize("value", ["fast", 0, 1.5, True])
def test_bad_budget_is_one_sentence(model, name, value):
    message = f"budget for {name} must be 'auto', a whole number of slots per front and pass >= 1, or None"
    with pytest.raises(VisarError, match=message):
        run(name, model, torch.tensor([0]), SamplingParams(), make_generators(1, 0), budget=value)
