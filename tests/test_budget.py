"""Budgets matched to the device (visar.accel.budget): the exact law under sizes chosen
per pass, a negative control that peeks at the next pass's randomness, the cost measurement and
its fallback, the choices the cost model makes, and the budget option's bad values."""

import numpy as np
import pytest
import torch
from laws import (
    CFG_TOPK,
    CFG_TOPK_TOPP,
    SAMPLES,
    TOPP_TEMP,
    VOCAB,
    compare_laws,
    exact_law,
    sequence_index,
    tiny_llamagen,
)

from visar.accel import budget, get_method, jacobi, proposers
from visar.accel.budget import PassCosts, SurvivalCounts, WindowBudget, age_rates, expected_tokens, pin_costs
from visar.accel.drafts import resolve_initialiser
from visar.accel.registry import Request
from visar.accel.sampling import SamplingParams, make_generators
from visar.errors import VisarError

# Pass costs under which the best size depends on the acceptance seen so far (one pass of 2 slots
# pays at the prior, 4 slots once drafts pass often, 1 slot once they rarely do): a decode switches.
COSTS = {"chain": {0: 0.9, 1: 1.0, 2: 1.2, 4: 1.6}}  # size 0: an AR step


def pinned(engine: str, size: int) -> float:
    return COSTS[engine][size] if engine in COSTS else 1.8 + 0.05 * size  # a tree's, of any size


def trees_pay(engine: str, size: int) -> float:
    """Costs under which a tree beats every chain (rows nearly free, as on a GPU), and its longer main
    path pays only while drafts pass."""
    return 1.0 if engine == "chain" else 0.1 * size


def deep_trees_pay(engine: str, size: int) -> float:
    """As `trees_pay`, for sjd-pac's deeper tree, whose two sizes differ by one main-path node."""
    return 1.0 if engine == "chain" else 0.5 + 0.05 * size


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen()


@pytest.fixture
def choosing_every_pass(monkeypatch, model):
    """The law model's images take 1-4 passes: choose before every pass, with pinned costs."""
    monkeypatch.setattr(budget, "CHOOSE_EVERY", 1)
    pin_costs(model, pinned)
    yield
    pin_costs(model, None)


def draw_in_batches(name, model, label, params, n, batch, seed, **options):
    """n images in batches of `batch` (each batch its own budget), image i seeded seed + i; -> tokens,
    the sizes chosen over all batches."""
    tokens, chosen = [], {}
    for first in range(0, n, batch):
        cond = torch.full((batch,), label)
        out, stats = get_method(name).fn(Request(model, cond, params, make_generators(batch, seed + first)), **options)
        tokens.append(out)
        for size, passes in stats.get("sizes_chosen", {}).items():
            chosen[size] = chosen.get(size, 0) + passes
    return torch.cat(tokens), chosen


CASES = [  # (method, options, sampling, costs): the tree methods once as chains, once as trees
    ("sjd", dict(budget="auto"), CFG_TOPK, pinned),
    ("mc-sjd", dict(budget="auto"), TOPP_TEMP, pinned),
    ("mc-sjd", dict(budget="auto", coupling="gumbel", init="random"), CFG_TOPK_TOPP, pinned),
    ("tree-mc-sjd", dict(budget="auto", branch=3, depth=2), CFG_TOPK_TOPP, pinned),
    ("tree-mc-sjd", dict(budget="auto", branch=5, depth=2), TOPP_TEMP, trees_pay),
    ("sjd-pac", dict(budget="auto", branch=2, depth=3), CFG_TOPK, deep_trees_pay),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, options, params, costs", CASES, ids=[f"{n}-{i}" for i, (n, *_) in enumerate(CASES)])
def test_joint_law_is_exact_under_an_auto_budget(model, choosing_every_pass, name, options, params, costs):
    label, seed = 1, 9000 + 100 * len(options)
    pin_costs(model, costs)
    tokens, chosen = draw_in_batches(name, model, label, params, SAMPLES, 40, seed, **options)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, label, params))
    print(f"{name} {options}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f} sizes chosen {chosen}")
    assert pvalue > 1e-3 and tv < tolerance, (pvalue, tv, tolerance)
    assert len(chosen) >= 2, chosen  # the budget did change sizes between passes


class PeekingBudget:
    """Negative control: a budget that reads the next pass's accept uniform of image 0 (through a copy
    of its generator) and drafts only when that test will pass easily, which no real budget can."""

    def __init__(self, generators, window):
        self.generators, self.window = generators, window

    def size(self):
        state = self.generators[0].get_state()
        upcoming = torch.rand(4 * self.window, generator=self.generators[0])[0]  # row ACCEPT, slot 0
        self.generators[0].set_state(state)
        return self.window if upcoming >= 0.5 else 1  # drafts only when the first will likely fail

    def count(self, *outcome):
        pass


@pytest.mark.slow
def test_a_budget_that_peeks_at_the_next_uniforms_is_detected(model):
    params, label, n = CFG_TOPK, 1, 3000
    tokens = []
    for i in range(n):
        generators = make_generators(1, 4000 + i)
        request = Request(model, torch.tensor([label]), params, generators)
        proposer = proposers.JacobiProposer(resolve_initialiser("random"), proposers.independent_carry)
        out, _ = jacobi.speculative_decode(request, proposer, window=4, budget=PeekingBudget(generators, 4))
        tokens.append(out)
    pvalue, tv, tolerance = compare_laws(sequence_index(torch.cat(tokens), VOCAB), exact_law(model, label, params))
    print(f"peeking budget: p={pvalue:.3g} tv={tv:.4f}")
    assert pvalue < 1e-6


def test_auto_budget_tokens_are_reproducible_and_equal_greedy_ar(model, choosing_every_pass):
    """Lossless under greedy sampling means AR's tokens; the same seed twice, the same tokens."""
    cond, greedy = torch.tensor([0, 1, 2]), SamplingParams(top_k=1)
    ar_tokens, _ = get_method("ar").fn(Request(model, cond, greedy, make_generators(3, 0)))
    for name in ("sjd", "mc-sjd", "tree-mc-sjd", "sjd-pac"):
        tokens, stats = get_method(name).fn(Request(model, cond, greedy, make_generators(3, 0)), budget="auto")
        assert torch.equal(tokens, ar_tokens), name
        again, _ = get_method(name).fn(Request(model, cond, greedy, make_generators(3, 0)), budget="auto")
        assert torch.equal(again, tokens), name


def test_stats_say_which_sizes_ran_and_what_they_cost(model, choosing_every_pass):
    _, stats = get_method("mc-sjd").fn(
        Request(model, torch.tensor([0, 1]), TOPP_TEMP, make_generators(2, 0)), budget="auto"
    )
    assert stats["budget"] == "auto"
    assert sum(stats["sizes_chosen"].values()) == stats["forward_passes"]
    assert set(stats["sizes_chosen"]) <= {1, 2, 4}
    assert stats["pass_ms"] == {0: 900.0, 1: 1000.0, 2: 1200.0, 4: 1600.0}


def test_costs_are_measured_once_and_a_failed_measurement_falls_back(model, monkeypatch, tmp_path):
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path))  # nothing kept on disk by another test
    cond, calls = torch.tensor([0]), []
    real = jacobi.speculative_decode

    def counting(*args, **kwargs):
        calls.append(kwargs.get("budget"))
        return real(*args, **kwargs)

    monkeypatch.setattr(jacobi, "speculative_decode", counting)
    fresh = tiny_llamagen(seed=11)
    get_method("sjd").fn(Request(fresh, cond, TOPP_TEMP, make_generators(1, 0)), budget="auto")
    probes = sum(isinstance(b, budget.ProbeBudget) for b in calls)
    # one untimed, then windows 1, 2, 4 on a 4-token image each round (fewer where the costs prune them)
    assert 1 + budget.PROBE_ROUNDS <= probes <= 1 + budget.PROBE_ROUNDS * 3
    calls.clear()
    _, stats = get_method("sjd").fn(Request(fresh, cond, TOPP_TEMP, make_generators(1, 0)), budget="auto")
    assert not any(isinstance(b, budget.ProbeBudget) for b in calls) and stats["budget"] == "auto"

    def failing(*args, **kwargs):
        if isinstance(kwargs.get("budget"), budget.ProbeBudget):
            raise RuntimeError("interrupted")
        return real(*args, **kwargs)

    monkeypatch.setattr(jacobi, "speculative_decode", failing)
    other = tiny_llamagen(seed=12)
    tokens, stats = get_method("sjd").fn(
        Request(other, cond, TOPP_TEMP, make_generators(1, 0)), budget="auto", window=3
    )
    assert stats["budget"] == "fixed window 3: the pass costs could not be measured"
    fixed, _ = get_method("sjd").fn(Request(other, cond, TOPP_TEMP, make_generators(1, 0)), window=3)
    assert torch.equal(tokens, fixed)


def test_expected_tokens_grow_with_the_age_of_carried_drafts():
    assert expected_tokens([0.5, 0.9], 0) == 1.0
    for drafts in (1, 3, 7):  # one rate at every age: 1 + sum of 0.5^j, whatever the ages
        assert expected_tokens([0.5] * 3, drafts) == pytest.approx(2 - 0.5**drafts, abs=1e-3)
    # drafts carried longer pass more often, and a longer window holds older drafts at its first
    # slots: it commits more than its youngest drafts' rate alone would give
    young_then_old = [0.2, 0.5, 0.9]
    long = expected_tokens(young_then_old, 15)
    assert long > expected_tokens(young_then_old, 3) and long > 2 - 0.2**15


def read_rates(counts: SurvivalCounts) -> list[float]:
    """What WindowBudget.choose does with the counts: read them, let them decay, shrink to rates."""
    reached, passed = counts.reached.tolist(), counts.passed.tolist()
    counts.forget()
    return age_rates(reached, passed, 0.5, 1.0)


def test_survival_counts_follow_each_age_and_relax_to_the_prior():
    counts = SurvivalCounts(3, "cpu")
    accepted = torch.tensor([2, 0])  # image 0 passed slots 0 and 1, failed 2; image 1 failed slot 0
    age = torch.tensor([[2, 1, 0], [2, 1, 0]])
    counts.count(accepted, torch.tensor([3, 3]), torch.tensor([True, True]), age)
    assert counts.reached.tolist() == [1, 1, 2] and counts.passed.tolist() == [0, 1, 1]
    first = read_rates(counts)
    r0 = (0 + 0.5) / 2  # age 0: reached once, failed; shrunk towards the prior 0.5
    r1 = (1 + 1 - (1 - r0) * budget.AGE_DECAY) / 2  # towards age 0's rate, its failures shrunk by AGE_DECAY
    r2 = (1 + 1 - (1 - r1) * budget.AGE_DECAY) / 3
    assert first == pytest.approx([r0, r1, r2])
    for _ in range(60):  # nothing reached since: the estimates relax to the prior, extrapolated by age
        rates = read_rates(counts)
    decay = budget.AGE_DECAY
    assert rates == pytest.approx([0.5, 1 - 0.5 * decay, 1 - 0.5 * decay**2], abs=1e-3)


def test_the_budget_follows_the_slowest_image(model):
    costs = PassCosts((1, 2, 4), (1.0, 1.2, 1.9))
    controller = WindowBudget(costs, costs.sizes, lambda s: s - 1, SurvivalCounts(4, "cpu"), (16, 16))
    drafts = torch.tensor([[0, 0, 0]] * 2)
    sizes = []
    # past the first row, every draft passes for image 0 and none for image 1: the batch moves at
    # image 1's pace, one token a pass, which the cheapest pass gives as well
    for step in range(40):
        sizes.append(controller.size())
        accepted, committed = torch.tensor([3, 0]), torch.tensor([16 + 4 * step, 16 + step])
        controller.count(accepted, torch.tensor([3, 3]), torch.tensor([True, True]), drafts, committed)
    assert sizes[0] == 2  # the prior: 2 slots pay, 4 do not yet
    assert sizes[-1] == 1


def test_a_choice_counts_its_passes_as_one_count_a_pass_would():
    # WindowBudget keeps each pass's outcome until its next choice and counts them joined (ages of
    # several widths padded): the same float counts, decays between choices included, as counting
    # every pass when it ends.
    costs = PassCosts((1, 2, 4, 8), (1.0, 1.1, 1.3, 1.8))
    controller = WindowBudget(costs, costs.sizes, lambda s: s - 1, SurvivalCounts(8, "cpu"), (4, 4))
    direct = SurvivalCounts(8, "cpu")
    rng = torch.Generator().manual_seed(3)
    for step in range(23):
        if controller.passes % budget.CHOOSE_EVERY == 0 and step:
            direct.forget()  # where the controller's choice reads and decays its counts
        size = controller.size()
        width = max(size - 1, 1)
        available = torch.randint(0, width + 1, (3,), generator=rng)
        accepted = torch.minimum(torch.randint(0, width + 1, (3,), generator=rng), available)
        active = torch.tensor([True, step % 3 > 0, step < 20])
        age = torch.randint(0, 12, (3, width), generator=rng)
        committed = torch.tensor([4 + step, 2 * step, 3 * step])
        controller.count(accepted, available, active, age, committed)
        direct.count(accepted, available, active & (committed >= 4), age)
    controller.settle()
    counts = controller.counts
    assert torch.equal(counts.reached, direct.reached) and torch.equal(counts.passed, direct.passed)
    assert direct.reached.sum() > 0  # the check compared counts, not two empty tallies


@pytest.mark.parametrize("name", ["sjd", "mc-sjd", "sjd-pac", "tree-mc-sjd"])
@pytest.mark.parametrize("value", ["fast", 0, -2, 1.5, True, [4]])
def test_bad_budget_is_one_sentence(model, name, value):
    with pytest.raises(VisarError, match=f"budget for {name} must be 'auto', a whole number of rows per pass"):
        get_method(name).fn(Request(model, torch.tensor([0]), SamplingParams(), make_generators(1, 0)), budget=value)


def test_a_number_is_the_window(model):
    cond, gens = torch.tensor([0, 1]), lambda: make_generators(2, 5)
    numbered, stats = get_method("mc-sjd").fn(Request(model, cond, TOPP_TEMP, gens()), budget=2)
    windowed, _ = get_method("mc-sjd").fn(Request(model, cond, TOPP_TEMP, gens()), window=2)
    assert (
        torch.equal(numbered, windowed)
        and stats["budget"] == 2
        and stats["sizes_chosen"] == {2: stats["forward_passes"]}
    )
    assert np.isfinite(stats["tokens_per_forward"])


def test_costs_kept_on_disk_are_not_measured_again_by_a_later_process(monkeypatch, tmp_path):
    from visar.accel import cost_store

    monkeypatch.setenv("VISAR_CACHE", str(tmp_path))
    cond, calls = torch.tensor([0]), []
    real = jacobi.speculative_decode

    def counting(*args, **kwargs):
        calls.append(isinstance(kwargs.get("budget"), budget.ProbeBudget))
        return real(*args, **kwargs)

    monkeypatch.setattr(jacobi, "speculative_decode", counting)

    def decode(model):
        calls.clear()
        _, stats = get_method("sjd").fn(Request(model, cond, TOPP_TEMP, make_generators(1, 0)), budget="auto")
        return any(calls), stats["pass_ms"]

    probed, measured = decode(tiny_llamagen(seed=21))
    assert probed and (tmp_path / cost_store.FILE_NAME).exists()
    # the same weights in a new instance (as a new process loads them): read back, nothing probed
    assert decode(tiny_llamagen(seed=21)) == (False, measured)
    assert decode(tiny_llamagen(seed=22))[0]  # other weights: another entry, measured
    (tmp_path / cost_store.FILE_NAME).write_text("{cut short")  # a damaged file: measured again
    assert decode(tiny_llamagen(seed=21))[0]
