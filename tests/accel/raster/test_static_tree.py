"""LANTERN++'s static draft tree (visar/accel/raster/static_tree.py): exact at lambda_cap 1, greedy equality
with AR, tree layout.

The exactness test enumerates the joint law of the tiny LlamaGen of tests/laws.py (vocabulary 6,
2x2 tokens) and draws 20,000 images. lantern++'s passes against sjd's and its bad options are
checked beside the other relaxed methods, in tests/accel/raster/test_relaxed.py.
"""

import copy

import pytest
import torch
from laws import (
    CFG_TOPK,
    SAMPLES,
    VOCAB,
    compare_laws,
    exact_law,
    perturbed,
    sequence_index,
    tiny_llamagen,
    unit_codebook,
)

from visar.accel import Request
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.raster.methods import ar, relaxed
from visar.accel.raster.static_tree import resolve_tree
from visar.errors import VisarError

pytestmark = pytest.mark.usefixtures("private_neighbour_cache")


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen()


SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.mark.slow
def test_tree_without_relaxation_is_exact(model):
    """lambda_cap = 1: recursive rejection over siblings drawn without replacement, tree attention
    over scratch slots, the accepted path re-fed next pass: the joint law is plain AR's."""
    draft, book = perturbed(model, seed=1, scale=0.3), unit_codebook(VOCAB, 3, 0)
    cond, label = torch.full((SAMPLES,), 1), 1
    options = dict(draft=draft, tree=SMALL_TREE, lambda_cap=1.0)
    tokens, stats = relaxed.lantern_pp(
        Request(model, cond, CFG_TOPK, make_generators(SAMPLES, 3), tokenizer=book), **options
    )
    pvalue, tv_all, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, label, CFG_TOPK))
    print(
        f"lantern++ lambda 1: p={pvalue:.3g} tv={tv_all:.4f} tol={tolerance:.4f} tpf={stats['tokens_per_forward']:.3f}"
    )
    assert pvalue > 1e-3 and tv_all < tolerance
    assert stats["accepted_tokens"] > 0.3 * (stats["forward_passes"] - 1)  # the tree was used
    # batch composition does not matter
    alone, _ = relaxed.lantern_pp(Request(model, cond[:1], CFG_TOPK, make_generators(1, 4), tokenizer=book), **options)
    assert torch.equal(alone[0], tokens[1])


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_k=1, guidance_scale=3.0)])
def test_tree_greedy_equals_plain_ar(model16, params):
    """Greedy: every tree and cap gives AR's tokens (the cap (lambda - 1) p(x) is 0 off the argmax)."""
    cond, book = torch.tensor([0, 2, 1]), unit_codebook(32, 4, 1)
    reference, _ = ar.autoregressive(Request(model16, cond, params, make_generators(3, 0)))
    draft = perturbed(model16, seed=5, scale=0.1)
    for tree, cap in [("naive_extend_57", 1.0), ("naive_extend_57", 5.0), ("chain5", 1.0), (SMALL_TREE, 1.0)]:
        tokens, _ = relaxed.lantern_pp(
            Request(model16, cond, params, make_generators(3, 9), tokenizer=book),
            draft=draft,
            tree=tree,
            lambda_cap=cap,
        )
        assert torch.equal(tokens, reference), (tree, cap)


def test_tree_with_an_identical_draft_commits_its_full_depth(model16):
    cond, book = torch.tensor([0, 1]), unit_codebook(32, 4, 1)
    _, stats = relaxed.lantern_pp(
        Request(model16, cond, SamplingParams(top_k=1), make_generators(2, 0), tokenizer=book),
        draft=copy.deepcopy(model16),
    )
    # a plain AR step for token 0, then 5 accepted + 1 per pass: 1 + ceil(15 / 6) passes
    assert stats["forward_passes_per_image"] == [4, 4]
    assert stats["draft_forward_passes"] == 1 + 3 * 5  # prefill, then a catch-up and 4 tree levels per pass


def test_tree_definitions():
    tree = resolve_tree("naive_extend_57")
    assert tree.num_nodes == 57 and tree.max_depth == 5
    assert [int((tree.depth == d).sum()) for d in range(1, 6)] == [5, 13, 16, 14, 9]
    small = resolve_tree(SMALL_TREE)
    assert small.children[0].tolist() == [1, 2, 3] and small.parent.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert small.ancestors[7].tolist() == [True, True, False, False, True, False, False, True]
    for bad, message in [([[0, 0]], "has no parent"), ([[0], [2]], "without gaps"), ([], "at least one node")]:
        with pytest.raises(VisarError, match=message):
            resolve_tree(bad)
    with pytest.raises(VisarError, match="unknown draft tree"):
        resolve_tree("medusa")
