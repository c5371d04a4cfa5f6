"""What every raster engine owes a running batch (as diffusers' SchedulerCommonTest does for schedulers):
one case per engine and method family, each held to the same checks.

Engines: chains (`ChainPasses`: sjd, mc-sjd, mc-sjd with Gumbel coupling, mc-sjd at a number budget,
spec with a draft model, gsd, lantern), draft trees (`DraftTreePasses`: sjd-pac, tree-mc-sjd), the
static tree (`StaticTreePasses`: lantern++) and row fronts (`FrontPasses`: zipar, zipar-mc-sjd,
zipar-tree, pjd (a start lag), and wavefront on a model with local dependence). For each:

- every image of a running batch (7 images, 2 slots, CFG on) has the tokens, the passes and the
  commit_pass of its decode alone (its own seed), whatever slot it took and whoever shared the batch,
  and is handed to `on_image` once, as it finishes; the refills are counted, and the batch runs the
  passes of its images laid on its slots in turn, each in the first slot that frees (no slot holds
  a finished image while one waits), an image's first pass as the engine takes it (the first-pass
  rules: `PassEngine`);
- images that join an open source late (4 images at 3 slots, 3 more before the 6th pass) are their
  decodes alone too;
- a pass (`PassEngine.step`, propose to commit) traces as one graph, without breaks;
- `budget=N` (the engines that take one: the drafting raster methods) is `window=N`: every pass of N
  rows; any other value, "auto" among them (a size chosen per pass lost to the best fixed size,
  docs/SPEED.md), is one sentence.

The statistics per image are the running-batch cases' passes, commit_pass and (zipar-tree) side_taken
against each image's decode alone. The quick tier runs the per-case tests on one case per engine
(`QUICK`); CI runs them all.

Then the rules no case shows: an admitted image's first pass is the next pass's, not the admit's; the
exact wavefront stays AR's tokens when it refills; and the joint law holds with refills happening, each
against a negative control that refills wrongly (slow).
"""

import heapq
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch
import torch._dynamo as dynamo
from conftest import law_samples
from laws import (
    CFG_TOPK,
    SAMPLES,
    TOPP_TEMP,
    VOCAB,
    JoinsBetweenPasses,
    LocalLlamaGen,
    compare_laws,
    exact_law,
    perturbed,
    sequence_index,
    tiny_llamagen,
    unit_codebook,
)

from visar.accel import METHODS, Request, get_method
from visar.accel.core.method_registry import decode_queue
from visar.accel.core.sampling import SamplingParams, draw_uniforms, make_generators
from visar.accel.core.scoring import GuidedScorer
from visar.accel.raster import chain, slots, static_tree, tree_passes
from visar.accel.raster.methods import ar
from visar.accel.raster.pass_loop import batch_result, run_pass
from visar.accel.raster.zipar import engine
from visar.errors import VisarError

pytestmark = pytest.mark.usefixtures("private_neighbour_cache")

PARAMS = SamplingParams(guidance_scale=2.0, top_k=20)
LABELS = [0, 2, 1, 1, 0, 2, 1]
SEED = 70
DRAFT = "draft"  # stands for the case's draft model in its options


@dataclass(frozen=True)
class Case:
    name: str
    options: dict = field(default_factory=dict)
    # where an image's first pass is a plain AR step that the engine takes in `plan`, inside the loop's
    # pass: "never" (chains, draft trees: scored with the pass's drafts), "admitted" (row fronts: an
    # admitted image's), "always" (the static tree: the decode's first images' too, before any pass)
    first_step_in_plan: str = "never"
    local: bool = False  # decodes the model of local dependence (wavefront)
    passes_vary: bool = True  # its images leave at different passes (plain zipar's passes are a formula)


CASES = {
    # chains
    "sjd": Case("sjd", dict(window=4)),
    "mc-sjd": Case("mc-sjd", dict(window=8)),
    "mc-sjd-gumbel": Case("mc-sjd", dict(window=5, coupling="gumbel", init="random")),
    "mc-sjd-budget": Case("mc-sjd", dict(budget=4)),  # every pass of the budget's size, whatever the batch
    "spec": Case("spec", dict(window=3, draft=DRAFT)),
    "gsd": Case("gsd", dict(window=6, group_size=2)),
    "lantern": Case("lantern", dict(window=4, delta=0.2, coupling="maximal")),
    # draft trees
    "sjd-pac": Case("sjd-pac", dict(window=8, branch=2, depth=3)),
    "tree-mc-sjd": Case("tree-mc-sjd", dict(window=8, branch=3, depth=2)),
    # the static tree
    "lantern++": Case("lantern++", dict(draft=DRAFT, tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]), "always"),
    # row fronts
    "zipar": Case("zipar", dict(s=2), "admitted", passes_vary=False),
    "zipar-mc-sjd": Case("zipar-mc-sjd", dict(s=2, window=4), "admitted"),
    "zipar-mc-sjd-gumbel": Case("zipar-mc-sjd", dict(s=2, window=4, coupling="gumbel", budget=3), "admitted"),
    "zipar-tree": Case("zipar-tree", dict(s=2, window=4, branch=4), "admitted"),
    "zipar-tree-random": Case("zipar-tree", dict(s=1, window=3, branch=3, init="random"), "admitted"),
    "pjd": Case("pjd", dict(start_lag=3, s=1, window=4), "admitted"),  # a start lag apart from the running lag
    "wavefront": Case("wavefront", {}, "admitted", local=True, passes_vary=False),
}


# the quick tier's cases: each engine once (the chain with a draft model and with the Gumbel coupling, the
# two tree engines, the richest fronts, the exact wavefront); CI runs every case (slow)
QUICK = ("mc-sjd-gumbel", "spec", "sjd-pac", "lantern++", "zipar-tree", "wavefront")
EVERY_CASE = [case_id if case_id in QUICK else pytest.param(case_id, marks=pytest.mark.slow) for case_id in CASES]


@pytest.fixture(scope="module")
def models() -> dict:
    model = tiny_llamagen(vocab=32, block_size=36, seed=6, std=0.3)  # a 6 x 6 grid
    return {
        "model": model,
        "local": tiny_llamagen(vocab=32, block_size=36, seed=7, std=0.5, cls=LocalLlamaGen),
        DRAFT: perturbed(model, seed=1, scale=0.3),
        "book": unit_codebook(32, 8, seed=0),  # what gsd, lantern and lantern++ compare tokens by
    }


def conditions(images: range) -> tuple[torch.Tensor, list[torch.Generator]]:
    """Images `images` of the queue: their labels and generators (image i seeded SEED + i)."""
    return torch.tensor([LABELS[i] for i in images]), [torch.Generator().manual_seed(SEED + i) for i in images]


def decode(models: dict, case: Case, images: range, **request) -> tuple[torch.Tensor, dict]:
    model = models["local" if case.local else "model"]
    options = {key: models[DRAFT] if value is DRAFT else value for key, value in case.options.items()}
    cond, generators = conditions(images)
    if "source" in request:
        cond, _, generators = request["source"].snapshot()
    return get_method(case.name).fn(
        Request(model, cond, PARAMS, generators, tokenizer=models["book"], **request), **options
    )


@pytest.fixture(scope="module")
def alone(models):
    """(case id, image) -> the image decoded by itself: (tokens [N], stats), each decoded once."""
    decoded = {}

    def image_alone(case_id: str, image: int) -> tuple[torch.Tensor, dict]:
        if (case_id, image) not in decoded:
            tokens, stats = decode(models, CASES[case_id], range(image, image + 1))
            decoded[case_id, image] = tokens[0], stats
        return decoded[case_id, image]

    return image_alone


def batch_passes_of_a_greedy_queue(case: Case, passes: list[int], slots: int) -> int:
    """The passes a running batch takes when every image, in queue order, takes the first slot that
    frees (none holds a finished image while one waits), each image holding its slot for its own
    passes, less the first where the engine takes that one inside another pass (`Case`)."""
    free = [0] * slots
    for image, own in enumerate(passes):
        admitted = image >= slots
        folded = case.first_step_in_plan == "always" or (case.first_step_in_plan == "admitted" and admitted)
        heapq.heappush(free, heapq.heappop(free) + own - folded)
    return max(free)


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
@pytest.mark.parametrize("case_id", EVERY_CASE)
def test_each_image_of_a_running_batch_is_its_decode_alone(models, alone, case_id):
    case, handed = CASES[case_id], []
    assert get_method(case.name).refills
    on_image = lambda image, tokens, info: handed.append((image, tokens.clone(), info))  # noqa: E731
    tokens, stats = decode(models, case, range(len(LABELS)), slots=2, on_image=on_image)
    passes = stats["forward_passes_per_image"]
    assert tokens.shape[0] == len(LABELS) and stats["slots"] == 2 and stats["refills"] == len(LABELS) - 2
    assert sorted(image for image, _, _ in handed) == list(range(len(LABELS)))  # each once, as it finished
    for image, image_tokens, info in handed:
        assert torch.equal(image_tokens, tokens[image]) and info["forward_passes"] == passes[image], image
        assert torch.equal(info["commit_pass"].cpu(), stats["commit_pass"][image]), image
    infos = {image: info for image, _, info in handed}
    for image in range(len(LABELS)):
        own_tokens, own = alone(case_id, image)
        assert torch.equal(tokens[image], own_tokens), image
        assert passes[image] == own["forward_passes_per_image"][0], image
        assert torch.equal(stats["commit_pass"][image], own["commit_pass"][0]), image
        if "side_taken_per_image" in own:  # a statistic the engine counts by slot, handed over by image
            assert stats["side_taken_per_image"][image] == own["side_taken_per_image"][0], image
            assert infos[image]["side_taken"] == stats["side_taken_per_image"][image], image
    # the batch shared its passes: fewer than its images took one after another, no slot left idle
    assert stats["forward_passes"] < sum(passes)
    assert stats["batch_passes"] == batch_passes_of_a_greedy_queue(case, passes, slots=2)
    if case.passes_vary:  # images left at different passes: refills happened mid-decode
        assert len(set(passes)) > 1
    if case.name == "zipar-tree":
        assert sum(stats["side_taken_per_image"]) > 0


def test_a_call_without_slots_hands_each_image_over_with_its_statistics(models):
    """Without a running batch the images are handed over at the call's end (`decode_queue`), each with
    its per-image statistics (zipar-tree's side_taken too) at its index in the caller's queue."""
    case, handed = CASES["zipar-tree"], {}
    model, (cond, generators) = models["model"], conditions(range(len(LABELS)))
    request = Request(model, cond, PARAMS, generators, tokenizer=models["book"], first_image=10)
    request = replace(request, on_image=lambda image, tokens, info: handed.setdefault(image, (tokens, info)))
    tokens, stats = decode_queue(request, get_method(case.name), case.options)
    assert sorted(handed) == [10 + image for image in range(len(LABELS))]
    for image in range(len(LABELS)):
        image_tokens, info = handed[10 + image]
        assert torch.equal(image_tokens, tokens[image]), image
        assert info["forward_passes"] == stats["forward_passes_per_image"][image], image
        assert info["side_taken"] == stats["side_taken_per_image"][image], image
    assert sum(stats["side_taken_per_image"]) > 0


@pytest.mark.one_thread  # images against their decodes alone, bit for bit
@pytest.mark.parametrize("case_id", EVERY_CASE)
def test_images_that_join_an_open_source_late_are_their_decodes_alone(models, alone, case_id):
    """4 images at 3 slots, 3 more added after the 5th pass: all 7 handed over as decoded alone."""
    source, handed = JoinsBetweenPasses(conditions, 4, {6: 3}), {}
    on_image = lambda image, tokens, info: handed.setdefault(image, (tokens.clone(), info))  # noqa: E731
    tokens, stats = decode(models, CASES[case_id], range(4), slots=3, source=source, on_image=on_image)
    assert source.asked > 6 and len(tokens) == 0 and stats["images"] == len(LABELS)  # handed over, not kept
    assert stats["slots"] == 3 and stats["refills"] == len(LABELS) - 3 and sorted(handed) == list(range(len(LABELS)))
    for image, (image_tokens, info) in handed.items():
        own_tokens, own = alone(case_id, image)
        assert torch.equal(image_tokens, own_tokens), image
        assert info["forward_passes"] == own["forward_passes_per_image"][0], image
        assert torch.equal(info["commit_pass"].cpu(), own["commit_pass"][0]), image


# -- one traced graph a pass ------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", EVERY_CASE)
def test_a_pass_traces_as_one_graph(models, case_id, monkeypatch):
    """Only the plan (a pass's shape: its width, whether an image is left, a draft's catch-up, the
    carried laws' K) reads the device back; the step, propose to commit with the model call and the
    bookkeeping, is one graph without breaks, so a compiled pass replays as one CUDA graph per shape.
    Traced after a few real passes of the case's own decode."""
    traced = []

    def trace_a_pass(engine, state, *loop_options):
        with torch.no_grad(), engine:
            for _ in range(3):
                run_pass(engine, engine.plan())
            traced.append(dynamo.explain(run_pass)(engine, engine.plan()))
        return batch_result(state, {})  # a result for the method to return

    for module in (chain, tree_passes, static_tree, engine):
        monkeypatch.setattr(module, "decode_passes", trace_a_pass)
    decode(models, CASES[case_id], range(2))
    dynamo.reset()
    (explained,) = traced
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


# -- budget=N: every pass N rows; its bad values ----------------------------------------------------------

BUDGET_METHODS = sorted(name for name, method in METHODS.items() if "budget" in method.options)
FRONT_METHODS = ("zipar-sjd", "zipar-mc-sjd", "zipar-gsd", "zipar-tree", "pjd")


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
        ("pjd", 3, {}),
    ],
)
def test_a_number_budget_is_the_window(name, size, options):
    """budget=N decodes every pass at N rows: token for token the method at window=N, and stats say N."""
    grid = tiny_llamagen(block_size=16, seed=3)
    tokenizer = unit_codebook(grid.vocab_size, 3, 0) if name == "zipar-gsd" else None

    def run(**size_option):
        request = Request(grid, torch.tensor([0, 1, 2]), TOPP_TEMP, make_generators(3, 5), tokenizer=tokenizer)
        return get_method(name).fn(request, **size_option, **options)

    numbered, stats = run(budget=size)
    windowed, fixed = run(window=size)
    assert torch.equal(numbered, windowed)
    assert stats["budget"] == size and stats["window"] == size and fixed["budget"] == "fixed"
    assert stats["forward_passes"] == fixed["forward_passes"]


def decode_one_at_budget(models: dict, name: str, budget):
    request = Request(models["model"], torch.tensor([0]), PARAMS, make_generators(1, 0), tokenizer=models["book"])
    return get_method(name).fn(request, budget=budget)


@pytest.mark.parametrize("name", BUDGET_METHODS)
@pytest.mark.parametrize("value", ["fast", 0, -2, 1.5, True, [4]])
def test_a_bad_budget_is_one_sentence(models, name, value):
    number = "slots per front and pass" if name in FRONT_METHODS else "rows per pass"
    with pytest.raises(VisarError, match=f"budget for {name} must be a whole number of {number} >= 1, or None"):
        decode_one_at_budget(models, name, value)


@pytest.mark.parametrize("name", BUDGET_METHODS)
def test_budget_auto_says_where_choosing_went(models, name):
    """budget="auto" was a size chosen every few passes; it is gone, and the sentence says what to use."""
    with pytest.raises(VisarError, match=r"budget='auto' is gone .* or use method='auto', which times fixed sizes"):
        decode_one_at_budget(models, name, "auto")


# -- the first-pass contract ------------------------------------------------------------------------------


def test_an_admitted_image_has_its_first_pass_in_the_next_pass(models, monkeypatch):
    """The contract of `SlotState.admit`, on the row fronts: the slot is reset, and the new image's first
    pass (its prefill and token 0) is the next pass's, not the admit's."""
    engines = []

    def keep_the_engine(front_passes, state, *loop_options):
        engines.append((front_passes, state))
        return batch_result(state, {})  # a result for the method to return; the passes run below

    monkeypatch.setattr(engine, "decode_passes", keep_the_engine)
    labels = torch.tensor(LABELS[:6])
    request = Request(models["model"], labels, PARAMS, make_generators(len(labels), SEED), slots=2)
    get_method("zipar-tree").fn(request, s=2, window=4, branch=4)
    ((fronts, state),) = engines
    with torch.no_grad(), fronts:
        while not state.done().any():
            run_pass(fronts, fronts.plan())
        row = int(state.done().long().argmax())
        state.release([row])
        calls = fronts.scorer.forward_passes
        state.admit([row], [2])
        assert fronts.scorer.forward_passes == calls and int(fronts.fronts.count[row].sum()) == 0
        plan = fronts.plan()  # the prefill of the admitted slot, then the pass's shape
        assert fronts.scorer.forward_passes == calls + 1 and int(fronts.fronts.count[row].sum()) == 1
        run_pass(fronts, plan)
        assert fronts.scorer.forward_passes == calls + 2 and int(fronts.fronts.count[row].sum()) > 1


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_wavefront_refills_and_stays_raster(models):
    """The exact wavefront at 4 slots over 6 images: AR's tokens, each image 6 + 2 x 5 passes."""
    labels = torch.tensor(LABELS[:6])
    reference, _ = ar.autoregressive(Request(models["local"], labels, PARAMS, make_generators(6, 2)))
    tokens, stats = get_method("wavefront").fn(Request(models["local"], labels, PARAMS, make_generators(6, 2), slots=4))
    assert torch.equal(tokens, reference) and stats["refills"] == 2
    assert stats["forward_passes_per_image"] == [6 + 2 * 5] * 6


# -- the joint law with refills (slow) --------------------------------------------------------------------


def admit_under_old_conditions(monkeypatch):
    """Negative control: admit resets the slots' cache rows (both CFG halves) but keeps their old
    images' conditions."""
    monkeypatch.setattr(
        GuidedScorer, "admit", lambda self, rows, images: self.model.reset_cache_rows(self.halves(rows, self.batch))
    )


@pytest.mark.slow
def test_the_chain_s_joint_law_holds_with_refills(monkeypatch):
    """mc-sjd (Gumbel): images of class 2 queued between images of class 1, 64 slots: the class-2 images
    follow class 2's exact law. Negative control: a refill that keeps the slot's old condition (its
    cache reset, its tokens restarted) fails the same test."""
    model, name, options = tiny_llamagen(device="cpu"), "mc-sjd", {"window": 4, "coupling": "gumbel"}
    n = law_samples(SAMPLES)
    labels = torch.tensor([1 + (i % 3 == 0) for i in range(2 * n)])  # a third of them class 2
    picked = (labels == 2).nonzero()[:, 0]

    def class_two_law(seed):
        request = Request(model, labels, CFG_TOPK, make_generators(len(labels), seed), slots=64)
        tokens, stats = get_method(name).fn(request, **options)
        assert stats["refills"] == len(labels) - 64
        return compare_laws(sequence_index(tokens[picked], VOCAB), exact_law(model, 2, CFG_TOPK))

    pvalue, tv, tolerance = class_two_law(9000)
    print(f"{name} with refills: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue > 1e-3 and tv < tolerance

    admit_under_old_conditions(monkeypatch)
    try:
        pvalue, tv, tolerance = class_two_law(9001)
    except AssertionError as err:  # top-k 4: class 1's law draws sequences class 2's cannot
        assert "zero-probability" in str(err)
        print(f"{name} refilled with stale conditions: drew a sequence of probability 0")
        return
    print(f"{name} refilled with stale conditions: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue < 1e-3 and tv > tolerance


CFG = SamplingParams(guidance_scale=2.0, temperature=0.9)  # no zero-probability sequence: a statistic decides


def draw_two_classes(model, slots: int):
    """tree-mc-sjd: SAMPLES images of classes 1 and 2 in turn, `slots` at a time -> (tokens, stats, class
    of each)."""
    which = torch.arange(SAMPLES) % 2 + 1
    request = Request(model, which, CFG, make_generators(SAMPLES, 900), slots=slots)
    tokens, stats = get_method("tree-mc-sjd").fn(request, window=6, branch=3, depth=2)
    return tokens, stats, which


@pytest.mark.slow
def test_the_draft_tree_s_joint_law_is_exact_with_refills():
    model = tiny_llamagen()
    tokens, stats, which = draw_two_classes(model, slots=500)
    assert stats["refills"] == SAMPLES - 500 and stats["tokens_per_forward"] > 1.2
    for label in (1, 2):
        law = exact_law(model, label, CFG)
        pvalue, tv, tolerance = compare_laws(sequence_index(tokens[which == label], VOCAB), law)
        print(f"class {label}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
        assert pvalue > 1e-3 and tv < tolerance, (label, pvalue, tv, tolerance)


@pytest.mark.slow
def test_a_draft_tree_image_admitted_under_the_slot_s_old_condition_is_detected(monkeypatch):
    """Negative control: a refilled slot draws the old class's law about half the time."""
    model = tiny_llamagen()
    admit_under_old_conditions(monkeypatch)
    tokens, _, which = draw_two_classes(model, slots=500)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens[which == 1], VOCAB), exact_law(model, 1, CFG))
    print(f"old condition: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue < 1e-3 and tv > tolerance


SLOTS = 500  # 40 images a slot: nearly every image is admitted into a refilled slot
TREE = dict(s=2, window=8, branch=3)


@pytest.fixture(scope="module")
def model4():
    """2x2 tokens, vocabulary 6: 1296 sequences, enumerable."""
    return tiny_llamagen(vocab=6, block_size=4, seed=0, std=0.5)


def refilled_tree_draws(model4) -> tuple[bool, str, dict]:
    """SAMPLES images of label 1 by zipar-tree (s >= W: exact) in SLOTS slots -> (whether they follow
    the enumerated law, the comparison, stats)."""
    label, cond = 1, torch.full((SAMPLES,), 1)
    request = Request(model4, cond, CFG_TOPK, make_generators(SAMPLES, 3200), slots=SLOTS)
    tokens, stats = get_method("zipar-tree").fn(request, **TREE)
    assert stats["refills"] == SAMPLES - SLOTS
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, model4.vocab_size), exact_law(model4, label, CFG_TOPK))
    return pvalue > 1e-3 and tv < tolerance, f"p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}", stats


@pytest.mark.slow
def test_tree_fronts_with_refills_sample_the_exact_law(model4):
    ok, summary, stats = refilled_tree_draws(model4)
    print("zipar-tree refilled", summary, "side taken", np.mean(stats["side_taken_per_image"]))
    assert ok, summary
    assert np.mean(stats["side_taken_per_image"]) > 0.05


@pytest.mark.slow
def test_a_front_image_reusing_its_first_uniforms_is_detected(model4, monkeypatch):
    """Negative control: an image's first pass reads its uniforms without consuming them (the state's
    `first_draws`), so its next pass draws token 1 with the number that drew token 0; the two tokens
    are coupled."""

    def peek(generators, count):
        states = [generator.get_state() for generator in generators]
        draws = draw_uniforms(generators, count)
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)
        return draws

    monkeypatch.setattr(slots, "draw_uniforms", peek)  # the state draws only an image's first uniforms with it
    ok, summary, _ = refilled_tree_draws(model4)
    print("zipar-tree refilled, first uniforms reused", summary)
    assert not ok, summary
