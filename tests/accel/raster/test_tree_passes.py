"""Draft-tree speculative Jacobi decoding (sjd-pac, tree-mc-sjd): exact joint law, batch invariance, bad input.

The exactness tests enumerate the joint law of the tiny LlamaGen of tests/laws.py
(vocabulary 6, 2x2 tokens) and draw 20,000 images per case, at CFG with top-k, top-p with
temperature, all of them, and (tree-mc-sjd) the entropy temperature's target; the negative control
verifies every candidate of a tree against p itself (no residual after a rejected sibling) and must
fail the same test.
"""

import pytest
import torch
from laws import (
    CFG_TOPK,
    CFG_TOPK_TOPP,
    CFG_TOPK_TOPP_ENTROPY,
    SAMPLES,
    TOPP_TEMP,
    VOCAB,
    compare_laws,
    draw,
    exact_law,
    sequence_index,
    tiny_llamagen,
)

from visar.accel import METHODS, Request, get_method
from visar.accel.core import candidates, tree_acceptance
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.core.stats import COMMON_STATS
from visar.accel.raster import draft_trees
from visar.accel.raster.methods import ar
from visar.errors import VisarError


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen()


CASES = [
    ("tree-mc-sjd", dict(window=8, branch=2, depth=3), CFG_TOPK),
    ("tree-mc-sjd", dict(window=6, branch=3, depth=2, init="random", neighbours=""), TOPP_TEMP),
    ("tree-mc-sjd", dict(window=7, branch=6, depth=2), CFG_TOPK_TOPP),  # every token a candidate
    ("sjd-pac", {}, CFG_TOPK_TOPP),
    ("sjd-pac", dict(window=10, branch=2, depth=3), TOPP_TEMP),
    ("tree-mc-sjd", dict(window=6, branch=3, depth=2), CFG_TOPK_TOPP_ENTROPY),  # the entropy temperature's target
]


@pytest.mark.slow
@pytest.mark.parametrize("name, options, params", CASES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)])
def test_joint_law_is_exact(model, name, options, params):
    label, seed = 1, 7000 + len(options)
    tokens, stats = draw(name, model, label, params, SAMPLES, seed, **options)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, label, params))
    print(f"{name} {options}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue > 1e-3 and tv < tolerance, (pvalue, tv, tolerance)
    assert stats["tokens_per_forward"] > 1.2  # the trees were used
    # image i's tokens do not depend on its batch: images 0 and 2 again, beside another class and seed
    cond = torch.tensor([label, 2, label])
    gens = [torch.Generator().manual_seed(s) for s in (seed, 77, seed + 2)]
    small, small_stats = get_method(name).fn(Request(model, cond, params, gens), **options)
    assert torch.equal(small[[0, 2]], tokens[[0, 2]])
    assert [small_stats["forward_passes_per_image"][i] for i in (0, 2)] == [
        stats["forward_passes_per_image"][i] for i in (0, 2)
    ]


@pytest.mark.slow
def test_dropping_the_residual_after_a_rejected_candidate_is_detected(model, monkeypatch):
    """Negative control: each candidate tested against p rather than the residual its earlier siblings left."""
    monkeypatch.setattr(tree_acceptance, "ladder_residual", lambda target, draft: target)
    tokens, _ = draw("tree-mc-sjd", model, 1, TOPP_TEMP, SAMPLES, 4100, window=6, branch=3, depth=2, init="random")
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, 1, TOPP_TEMP))
    print(f"no residual: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue < 1e-3 and tv > tolerance


@pytest.mark.slow
def test_candidates_reported_with_the_wrong_law_are_detected(model, monkeypatch):
    """Negative control of the candidates drawn at once: each extra candidate reported with the law
    of the first draw (ignoring the candidates ranked before it) biases the law, and the test sees it."""

    def first_draw_law(weights, first, tokens, picked):
        left = weights.scatter(-1, first, 0.0)
        return (left / left.sum(-1, keepdim=True))[..., None, :].expand(*tokens.shape, -1)

    monkeypatch.setattr(candidates, "candidate_laws", first_draw_law)
    tokens, _ = draw("tree-mc-sjd", model, 1, TOPP_TEMP, SAMPLES, 4100, window=6, branch=3, depth=2, init="random")
    with pytest.raises(AssertionError):  # a zero-probability sequence drawn, or a law off by chi-square and TV
        pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, 1, TOPP_TEMP))
        print(f"wrong candidate laws: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
        assert pvalue > 1e-3 and tv < tolerance


@pytest.mark.one_thread  # tokens of a batch against each image alone
@pytest.mark.parametrize("name", ["sjd-pac", "tree-mc-sjd"])
def test_greedy_equals_plain_ar_and_batches_do_not_matter(model16_vocab16, name):
    greedy = SamplingParams(top_k=1, guidance_scale=1.5)
    cond = torch.tensor([0, 1, 2])
    reference, _ = ar.autoregressive(Request(model16_vocab16, cond, greedy, make_generators(3, 0)))
    tokens, stats = get_method(name).fn(
        Request(model16_vocab16, cond, greedy, make_generators(3, 0)), window=8, branch=2, depth=2
    )
    assert torch.equal(tokens, reference)
    assert set(COMMON_STATS) <= set(stats) and stats["rows_per_pass"] == 8
    assert sum(stats["forward_passes_per_image"]) < 3 * 16  # fixed points found: fewer passes than tokens
    # sampled: image 1 alone gives what it gave in the batch of 3
    params = SamplingParams(guidance_scale=2.0, temperature=1.1)
    batch, batch_stats = get_method(name).fn(Request(model16_vocab16, cond, params, make_generators(3, 5)))
    alone, alone_stats = get_method(name).fn(Request(model16_vocab16, cond[1:2], params, [make_generators(3, 5)[1]]))
    assert torch.equal(alone[0], batch[1])
    assert alone_stats["forward_passes_per_image"][0] == batch_stats["forward_passes_per_image"][1]


def test_tree_layout():
    layout = draft_trees.DraftTree.build(16, 3, 3)  # SJD-PAC's: 13 tree nodes, the main path goes on to 16 nodes
    assert layout.num_nodes == 16 and layout.main_length == 6 and layout.num_side == 10
    assert layout.tree.depth[layout.main].tolist() == list(range(6))
    # a side node sees the main path only above its branch point
    assert layout.main_depth.tolist()[:7] == [0, 1, 0, 0, 2, 1, 1]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(branch=0), "branch must be an integer >= 1"),
        (dict(depth=0), "depth must be an integer >= 1"),
        (dict(window=1), "window must be an integer >= 2"),
        (dict(window=8, branch=3, depth=3), "13 nodes, more than the window of 8"),
        # counted before a path is listed: 6 ** 16 paths once filled the memory (the fuzz test found it)
        (dict(window=64, depth=17), "branch 6 and depth 17 has over 64 nodes"),
        (dict(window=64, branch=1, depth=10**9), "has over 64 nodes"),
        (dict(window=[]), "window must be an integer >= 2, got \\[\\]"),  # a list is no cache key
        (dict(budget="fast"), "budget for tree-mc-sjd must be a whole number of rows"),
        (dict(budget=0), "budget for tree-mc-sjd must be a whole number"),
        (dict(budget=4), "a tree of branch 6 and depth 2 needs 7 or more, got 4"),
        (dict(depth=18, branch=1, window=40), "branches past the image's 16 tokens"),
        (dict(neighbours="left,below"), "unknown neighbour 'below'"),
        (dict(neighbours=["left"]), "neighbours must be a comma-separated string"),
    ],
)
def test_bad_tree_options(model16_vocab16, options, message):
    calls = []
    model16_vocab16.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(VisarError, match=message):
        get_method("tree-mc-sjd").fn(
            Request(model16_vocab16, torch.tensor([0]), SamplingParams(), make_generators(1, 0)), **options
        )
    assert not calls  # refused before any model call
    model16_vocab16._forward_hooks.clear()


@pytest.mark.parametrize("method", ["tree-mc-sjd", "zipar-tree"])
def test_branch_is_clipped_to_the_vocabulary_by_one_rule(method):
    """A default branch larger than a small vocabulary runs with every token a candidate, in both tree
    methods (tree_passes.clip_branch), where tree-mc-sjd used to refuse it."""
    model = tiny_llamagen(vocab=4, block_size=16, seed=3, std=0.3)
    assert get_method(method).defaults["branch"] > 4
    tokens, stats = get_method(method).fn(Request(model, torch.tensor([0]), SamplingParams(), make_generators(1, 0)))
    assert tokens.shape == (1, 16) and int(tokens.max()) < 4
    if method == "tree-mc-sjd":
        assert stats["branch"] == 4


def test_a_chain_without_side_nodes_equals_plain_ar_greedy(model16_vocab16):
    """branch 1: the tree is its main path alone (M nodes, no side node), which the path buffer must fit."""
    greedy = SamplingParams(top_k=1)
    cond = torch.tensor([0, 1])
    reference, _ = ar.autoregressive(Request(model16_vocab16, cond, greedy, make_generators(2, 0)))
    for name in ("sjd-pac", "tree-mc-sjd"):
        tokens, stats = get_method(name).fn(
            Request(model16_vocab16, cond, greedy, make_generators(2, 0)), window=8, branch=1
        )
        assert torch.equal(tokens, reference) and stats["rows_per_pass"] == 8


def test_registered_and_long_windows_are_clipped(model16_vocab16):
    assert METHODS["sjd-pac"].lossless and METHODS["tree-mc-sjd"].lossless
    tokens, stats = get_method("tree-mc-sjd").fn(
        Request(model16_vocab16, torch.tensor([0]), SamplingParams(), make_generators(1, 0)),
        window=200,
        branch=2,
        depth=2,
    )
    assert tokens.shape == (1, 16) and stats["rows_per_pass"] == 2 + 16  # root + side + 16 main drafts


def test_neighbour_candidates_never_wrap_round_a_row():
    canvas = torch.arange(16)[None]  # a 4 x 4 grid whose tokens are their indices
    index = torch.tensor([[0, 3, 4, 7, 9]])
    found = draft_trees.neighbour_candidates(canvas, index, 4, draft_trees.NEIGHBOURS)
    assert found[0].tolist() == [[-1, -1, -1, -1], [2, -1, -1, -1], [-1, 0, -1, 1], [6, 3, 2, -1], [8, 5, 4, 6]]
