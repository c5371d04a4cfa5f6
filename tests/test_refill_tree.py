"""A running batch on the tree engines (sjd-pac, tree-mc-sjd: `DraftTreePasses`; lantern++: `StaticTreePasses`).

With fewer slots than images, a finished image's slot takes the next image between passes. Each
image's tokens, passes and commit passes are then those of its decode alone (CFG on, fixed trees),
and the joint law stays exact with refills happening (enumerated on the tiny LlamaGen of
tests/laws.py, each of two classes against its own law); the negative control admits images
without their conditions and must fail the same test.
"""

import pytest
import torch
from laws import SAMPLES, VOCAB, compare_laws, exact_law, perturbed, sequence_index, tiny_llamagen, unit_codebook

from visar.accel import Request, get_method
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.core.scoring import GuidedScorer

# a running batch's images against their decodes alone, bit for bit:
# at one torch thread, where that holds (tests/conftest.py, one_torch_thread)
pytestmark = pytest.mark.usefixtures("private_neighbour_cache")


@pytest.fixture(scope="module")
def model16():
    return tiny_llamagen(vocab=16, block_size=16, seed=3, std=0.3)  # a 4 x 4 grid


def options_of(name: str, model) -> dict:
    if name == "lantern++":
        return dict(draft=perturbed(model, seed=1, scale=0.2), tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    if name == "sjd-pac":
        return dict(window=8, branch=2, depth=3)
    return dict(window=8, branch=3, depth=2)


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
@pytest.mark.parametrize("name", ["sjd-pac", "tree-mc-sjd", "lantern++"])
def test_each_image_of_a_running_batch_decodes_as_it_would_alone(model16, name):
    params = SamplingParams(guidance_scale=2.0, top_k=8)
    book = unit_codebook(16, 3, 0)  # lantern++ compares tokens by their codes
    labels, seed = torch.tensor([0, 1, 2, 2, 1, 0]), 40
    options = options_of(name, model16)
    method = get_method(name)
    request = Request(model16, labels, params, make_generators(len(labels), seed), tokenizer=book, slots=2)
    tokens, stats = method.fn(request, **options)
    assert stats["refills"] == len(labels) - 2
    for image, label in enumerate(labels.tolist()):
        alone = Request(model16, torch.tensor([label]), params, make_generators(1, seed + image), tokenizer=book)
        alone_tokens, alone_stats = method.fn(alone, **options)
        assert torch.equal(tokens[image], alone_tokens[0]), image
        assert stats["forward_passes_per_image"][image] == alone_stats["forward_passes_per_image"][0], image
        assert torch.equal(stats["commit_pass"][image], alone_stats["commit_pass"][0]), image


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_pipeline_batch_size_runs_the_tree_engine_as_a_running_batch(model16):
    """Through Pipeline.generate: image i seeded with seed + i, at any batch_size."""
    import visar

    pipe = visar.Pipeline(model16, None, name="tiny", defaults={"guidance_scale": 2.0})
    labels, options = [0, 1, 2, 1], dict(method="tree-mc-sjd", output_type="tokens", seed=5, window=8, branch=3)
    done = []
    out = pipe.generate(class_labels=labels, batch_size=3, on_image=lambda i, t, info: done.append(i), **options)
    whole = pipe.generate(class_labels=labels, **options)
    assert torch.equal(out.tokens, whole.tokens) and sorted(done) == [0, 1, 2, 3]
    assert out.stats["forward_passes_per_image"] == whole.stats["forward_passes_per_image"]
    assert torch.equal(out.stats["commit_pass"], whole.stats["commit_pass"])


CFG = SamplingParams(guidance_scale=2.0, temperature=0.9)  # no zero-probability sequence: a statistic decides


def draw_two_classes(model, slots: int):
    """SAMPLES images of classes 1 and 2 in turn, `slots` at a time -> (tokens, stats, class of each)."""
    which = torch.arange(SAMPLES) % 2 + 1
    request = Request(model, which, CFG, make_generators(SAMPLES, 900), slots=slots)
    tokens, stats = get_method("tree-mc-sjd").fn(request, window=6, branch=3, depth=2)
    return tokens, stats, which


@pytest.mark.slow
def test_the_joint_law_is_exact_with_refills():
    model = tiny_llamagen()
    tokens, stats, which = draw_two_classes(model, slots=500)
    assert stats["refills"] == SAMPLES - 500 and stats["tokens_per_forward"] > 1.2
    for label in (1, 2):
        law = exact_law(model, label, CFG)
        pvalue, tv, tolerance = compare_laws(sequence_index(tokens[which == label], VOCAB), law)
        print(f"class {label}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
        assert pvalue > 1e-3 and tv < tolerance, (label, pvalue, tv, tolerance)


@pytest.mark.slow
def test_an_admitted_image_decoded_under_the_slot_s_old_condition_is_detected(monkeypatch):
    """Negative control: admit forgets the slot's cache but keeps its old image's condition, so a
    refilled slot draws the old class's law about half the time."""
    model = tiny_llamagen()
    monkeypatch.setattr(
        GuidedScorer, "admit", lambda self, rows, images: self.model.reset_cache_rows(self.halves(rows, self.batch))
    )
    tokens, _, which = draw_two_classes(model, slots=500)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens[which == 1], VOCAB), exact_law(model, 1, CFG))
    print(f"old condition: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue < 1e-3 and tv > tolerance
