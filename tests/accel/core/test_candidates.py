"""A draft tree's sibling candidates drawn at once (visar/accel/core/candidates.py): the joint law of
drawing them one after another without replacement, fixed tokens first, and each reported law."""

import numpy as np
import pytest
import torch
from laws import SAMPLES, compare_laws

from visar.accel.core import candidates


def reference_candidates(base: list[float], first: int, branch: int, fixed: list[int]) -> dict:
    """The candidate rule one rank after another, exactly: {(x_1 .. x_{K-1}): probability}. Rank by
    rank: the first fixed token not tried yet, else a draw from base without the tried tokens
    (uniform over the untried ones where that has no mass)."""
    laws = {(): 1.0}
    for _ in range(branch - 1):
        longer = {}
        for tried, mass in laws.items():
            used = {first, *tried}
            fresh = [x for x in fixed if x >= 0 and x not in used]
            if fresh:
                longer[(*tried, fresh[0])] = mass
                continue
            left = [0.0 if v in used else base[v] for v in range(len(base))]
            if sum(left) == 0:
                left = [0.0 if v in used else 1.0 for v in range(len(base))]
            for v, w in enumerate(left):
                if w > 0:
                    longer[(*tried, v)] = longer.get((*tried, v), 0.0) + mass * w / sum(left)
        laws = longer
    return laws


@pytest.mark.parametrize(
    "base, first, branch, fixed",
    [
        ([0.4, 0.3, 0.0, 0.2, 0.1, 0.0], 1, 4, []),
        ([0.4, 0.3, 0.0, 0.2, 0.1, 0.0], 1, 6, []),  # draws past the law's support: uniform over the rest
        ([0.05, 0.5, 0.25, 0.0, 0.2, 0.0], 2, 5, [4, 2, -1, 4]),  # a neighbour that is candidate 0, a repeat
        ([0.05, 0.5, 0.25, 0.0, 0.2, 0.0], 2, 3, [5, 0, 1]),  # more neighbours than ranks: no draw
    ],
)
def test_candidates_drawn_at_once_follow_the_rule_drawn_rank_by_rank(base, first, branch, fixed):
    """The extra candidates of one top-k over Gumbel keys have the joint law of drawing them one
    after another without replacement (fixed tokens first), and each reported law is the
    candidate's law given those before it; chi-square and TV against the enumerated law."""
    vocab, n = len(base), SAMPLES
    generator = torch.Generator().manual_seed(5)
    noise = torch.rand(n, 1, vocab, generator=generator)
    tokens, laws = candidates.without_replacement(
        torch.tensor(base).expand(n, 1, -1),
        torch.full((n, 1), first),
        branch,
        noise,
        torch.tensor(fixed).expand(n, 1, -1) if fixed else None,
    )
    assert (tokens[:, 0, 0] == first).all() and torch.equal(laws[:, 0, 0], torch.tensor(base).expand(n, -1))
    exact = reference_candidates(base, first, branch, fixed)
    cells = {ranks: i for i, ranks in enumerate(exact)}
    extra = [tuple(row) for row in tokens[:, 0, 1:].tolist()]
    assert set(extra) <= set(cells), "a candidate sequence the rule never draws"
    if len(cells) > 1:  # else every draw is the one sequence, as checked above
        law = np.array(list(exact.values()))
        pvalue, tv, tolerance = compare_laws(np.array([cells[ranks] for ranks in extra]), law)
        assert pvalue > 1e-3 and tv < tolerance, (pvalue, tv, tolerance)
    for i in range(20):  # each reported law: the rule's law of that rank given the ranks before it
        ranks = extra[i]
        for k in range(1, branch):
            expected = torch.zeros(vocab, dtype=torch.float64)
            for r, p in exact.items():
                if r[: k - 1] == ranks[: k - 1]:
                    expected[r[k - 1]] += p
            expected = (expected / expected.sum()).float()
            torch.testing.assert_close(laws[i, 0, k], expected, atol=1e-6, rtol=0)
