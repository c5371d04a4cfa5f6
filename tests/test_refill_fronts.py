"""zipar's row fronts as a running batch that refills (issue 46): `FrontPasses.admit` resets a finished
slot for a queued image and draws its randomness, and the next pass starts with the image's first pass
(the condition's prefill) for that slot alone.

- `admit` calls no model: the admitted image's first pass runs when the loop plans its next pass;

- at a fixed window, every image of a running batch (6 images, 2 slots, CFG on) has the tokens, the
  passes and the commit_pass of its decode alone (its own seed), for zipar, zipar-mc-sjd (maximal
  and Gumbel coupling), zipar-tree and wavefront, and through `Pipeline.generate(batch_size=)`;
- zipar-tree with s >= W still samples the model's joint law when nearly every image is admitted
  into a refilled slot (enumerated as in tests/laws.py); negative control: an admitted image whose
  first pass's uniforms are not consumed (its next pass reuses them) biases the law, and the same
  test sees it.
"""

import numpy as np
import pytest
import torch
from laws import CFG_TOPK, SAMPLES, LocalLlamaGen, compare_laws, exact_law, sequence_index, tiny_llamagen, tiny_pipeline

from visar.accel import Request, get_method
from visar.accel.core.sampling import SamplingParams, draw_uniforms, make_generators
from visar.accel.raster.methods import ar
from visar.accel.raster.pass_loop import run_pass
from visar.accel.raster.zipar import engine

PARAMS = SamplingParams(guidance_scale=2.0, top_k=20)
LABELS = torch.tensor([0, 2, 1, 1, 0, 2])
SEED = 40


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen(vocab=32, block_size=36, seed=6, std=0.3)  # a 6 x 6 grid


def alone(name: str, model, options: dict, image: int) -> tuple[torch.Tensor, dict]:
    """Image `image` of the call decoded by itself: its label and its generator (seed + its index)."""
    request = Request(model, LABELS[image : image + 1], PARAMS, [torch.Generator().manual_seed(SEED + image)])
    return get_method(name).fn(request, **options)


def assert_as_alone(name: str, model, options: dict, tokens: torch.Tensor, stats: dict):
    for image in range(len(LABELS)):
        own_tokens, own = alone(name, model, options, image)
        assert torch.equal(tokens[image], own_tokens[0]), image
        assert stats["forward_passes_per_image"][image] == own["forward_passes_per_image"][0], image
        assert torch.equal(stats["commit_pass"][image], own["commit_pass"][0]), image
        if "side_taken_per_image" in own:
            assert stats["side_taken_per_image"][image] == own["side_taken_per_image"][0], image


@pytest.mark.parametrize(
    "name, options",
    [
        ("zipar", dict(s=2)),
        ("zipar-mc-sjd", dict(s=2, window=4)),
        ("zipar-mc-sjd", dict(s=2, window=4, coupling="gumbel", budget=3)),
        ("zipar-tree", dict(s=2, window=4, branch=4)),
        ("zipar-tree", dict(s=1, window=3, branch=3, init="random")),
    ],
)
@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_each_image_of_a_running_batch_is_its_decode_alone(model, name, options):
    finished = []
    request = Request(
        model, LABELS, PARAMS, make_generators(len(LABELS), SEED), slots=2,
        on_image=lambda image, tokens, info: finished.append(image),
    )  # fmt: skip
    tokens, stats = get_method(name).fn(request, **options)
    assert stats["slots"] == 2 and stats["refills"] == 4 and sorted(finished) == list(range(6))
    if "window" in options:  # plain zipar's passes are a formula; drafting fronts' images leave at different passes
        assert len(set(stats["forward_passes_per_image"])) > 1
    assert_as_alone(name, model, options, tokens, stats)
    if name == "zipar-tree":
        assert sum(stats["side_taken_per_image"]) > 0


def test_an_admitted_image_has_its_first_pass_in_the_next_pass(model, monkeypatch):
    """The contract of `PassEngine.admit`: the slot is reset, and the new image's first pass (its
    prefill and token 0) is the next pass's, not the admit's."""
    engines = []

    def keep_the_engine(front_passes, *loop_options):
        engines.append(front_passes)
        return front_passes.finish()  # a result for the method to return; the passes run below

    monkeypatch.setattr(engine, "decode_passes", keep_the_engine)
    request = Request(model, LABELS, PARAMS, make_generators(len(LABELS), SEED), slots=2)
    get_method("zipar-tree").fn(request, s=2, window=4, branch=4)
    (fronts,) = engines
    with torch.no_grad(), fronts:
        while not fronts.done().any():
            run_pass(fronts, fronts.plan())
        row = int(fronts.done().long().argmax())
        fronts.release([row])
        calls = fronts.scorer.forward_passes
        fronts.admit([row], [2])
        assert fronts.scorer.forward_passes == calls and int(fronts.fronts.count[row].sum()) == 0
        plan = fronts.plan()  # the prefill of the admitted slot, then the pass's shape
        assert fronts.scorer.forward_passes == calls + 1 and int(fronts.fronts.count[row].sum()) == 1
        run_pass(fronts, plan)
        assert fronts.scorer.forward_passes == calls + 2 and int(fronts.fronts.count[row].sum()) > 1


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_wavefront_refills_and_stays_raster():
    local = tiny_llamagen(vocab=32, block_size=36, seed=7, std=0.5, cls=LocalLlamaGen)
    reference, _ = ar.autoregressive(Request(local, LABELS, PARAMS, make_generators(6, 2)))
    tokens, stats = get_method("wavefront").fn(Request(local, LABELS, PARAMS, make_generators(6, 2), slots=4))
    assert torch.equal(tokens, reference) and stats["refills"] == 2
    assert stats["forward_passes_per_image"] == [6 + 2 * 5] * 6


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_pipeline_batch_size_runs_zipar_tree_as_a_running_batch():
    pipe = tiny_pipeline("llamagen")
    labels, options = [0, 1, 2, 0, 1], dict(s=2, window=3, branch=3)
    seen = []
    out = pipe.generate(
        class_labels=labels, method="zipar-tree", batch_size=2, seed=5, output_type="tokens",
        on_image=lambda index, tokens, info: seen.append(index), **options,
    )  # fmt: skip
    assert out.stats["refills"] == 3 and sorted(seen) == list(range(5))
    for image, label in enumerate(labels):
        own = pipe.generate(class_labels=[label], method="zipar-tree", seed=5 + image, output_type="tokens", **options)
        assert torch.equal(out.tokens[image], own.tokens[0])
        assert torch.equal(out.stats["commit_pass"][image], own.stats["commit_pass"][0])
        assert out.stats["forward_passes_per_image"][image] == own.stats["forward_passes_per_image"][0]


# -- the joint law with refills ------------------------------------------------------------------------------

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
def test_an_admitted_image_reusing_its_first_uniforms_is_detected(model4, monkeypatch):
    """Negative control: the admitted image's first pass reads its uniforms without consuming them, so
    its next pass draws token 1 with the number that drew token 0; the two tokens are coupled."""

    def peek(generators, count):
        states = [generator.get_state() for generator in generators]
        draws = draw_uniforms(generators, count)
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)
        return draws

    monkeypatch.setattr(engine, "draw_uniforms", peek)  # the engine draws only an admitted image's first pass
    ok, summary, _ = refilled_tree_draws(model4)
    print("zipar-tree refilled, first uniforms reused", summary)
    assert not ok, summary
