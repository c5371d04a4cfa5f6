"""A draft tree's sibling candidates: drawn without replacement from the law of the first, fixed
tokens first, each reported with the law it was drawn from given those before it, which recursive
rejection (tree_acceptance.py) verifies it under. All K - 1 extra candidates come from one top-k over
Gumbel keys. Used by the raster draft trees (raster/draft_trees.py, with known neighbours as the
fixed tokens) and zipar-tree's fronts (raster/zipar/tree_fronts.py).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor


def without_replacement(
    base: Tensor, first: Tensor, branch: int, noise: Tensor, fixed: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Candidates 1 .. K - 1 of each position, drawn without replacement from the law of candidate 0.

    base [B, P, V] candidate 0's law, first [B, P] its token, noise [B, P, V] one uniform per token;
    fixed [B, P, J] (optional): tokens tried first (-1 none; a raster tree's known neighbours), each
    as a one-hot law, while one is not a candidate yet. Otherwise candidate k is drawn from norm(w with
    candidates 0 .. k - 1 removed), w = max(base, tiny): a token base gives no mass weighs the
    smallest normal float, so it ranks after every token with mass (but for odds of about 1e-38,
    which its reported law carries), and where base has no mass left (a one-hot copy, or a law
    with fewer than K tokens) the draw is uniform over the unused tokens. Either way the law is
    fixed by what the verifier's uniforms are independent of, as recursive rejection needs.
    -> tokens [B, P, K], laws [B, P, K, V]: each candidate's law given those before it.
    """
    first = first[..., None]  # [B, P, 1]
    if branch == 1:
        return first, base[..., None, :]
    weights = base.clamp(min=torch.finfo(base.dtype).tiny)
    tokens, picked = ranked_candidates(weights, first, branch - 1, noise, fixed)
    laws = candidate_laws(weights, first, tokens, picked)
    return torch.cat([first, tokens], -1), torch.cat([base[..., None, :], laws], -2)


# A fixed token's key: above every drawn token's (a Gumbel key log w - log(-log u) is below
# log 1 + 17 for float32 uniforms), the earlier fixed token higher.
PICKED = 1e4


def ranked_candidates(
    weights: Tensor, first: Tensor, num_ranks: int, noise: Tensor, fixed: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Candidates 1 .. K - 1 in one top-k over every token's key: the n distinct fixed tokens that are
    not candidate 0 first, in their order, then draws without replacement from the weights.

    Why the draws are exact: with Gumbel keys log w(v) + g(v), g(v) = -log(-log u(v)) independent,
    the largest key is token v with probability w(v) / sum w, and given it the rest rank as the same
    race over the tokens left (Gumbel top-k; Plackett-Luce). So the order of the K - 1 largest keys is
    a draw one after another, each from norm(w without the tokens ranked before), in one step instead
    of K - 1 dependent rounds. A picked fixed token's key outranks every draw, and candidate 0 never
    ranks, so the draws come from w without candidate 0 and the picks, as rank by rank picking
    "the first fixed token not tried yet, else a draw" gives. (Float32 uniforms bound g to
    [-2.8, 16.6]: an order of odds below about 1e-8 is never drawn, a rounding of the law of the
    order of the inverse-CDF draw's, whose 24-bit grid resolves masses to about 6e-8.)
    weights [B, P, V] > 0, first [B, P, 1], noise [B, P, V], fixed [B, P, J] or None
    -> tokens [B, P, K - 1], picked [B, P, K - 1]: True at a picked fixed token (None without `fixed`).
    """
    keys = weights.log() - noise.log().neg_().log_()  # [B, P, V]
    if fixed is not None:
        priority = torch.where(fixed >= 0, fixed_priority(fixed.shape[-1], fixed.device), -math.inf)  # [B, P, J]
        keys.scatter_reduce_(-1, fixed.clamp(min=0), priority, "amax")
    ranked = keys.scatter_(-1, first, -math.inf).topk(num_ranks, -1)
    return ranked.indices, None if fixed is None else ranked.values >= PICKED


@functools.lru_cache(maxsize=16)
def fixed_priority(count: int, device) -> Tensor:
    """[J] the keys of fixed tokens 0 .. J - 1: PICKED + J .. PICKED + 1 (made once)."""
    return torch.arange(count, 0, -1, device=device) + PICKED


def candidate_laws(weights: Tensor, first: Tensor, tokens: Tensor, picked: Tensor | None) -> Tensor:
    """The law of each of candidates 1 .. K - 1 given those before it: one-hot for a picked fixed token,
    else norm(w without candidate 0 and the candidates ranked before it) (picks rank before every
    draw, so that is w without the picks too). -> [B, P, K - 1, V]."""
    hits = weights.new_zeros(*tokens.shape, weights.shape[-1]).scatter_(-1, tokens[..., None], 1.0)  # one-hot
    ranked_before = hits.cumsum(-2) > hits  # [B, P, K - 1, V]: the token is a candidate of an earlier rank
    left = weights.scatter(-1, first, 0.0)[..., None, :].masked_fill(ranked_before, 0.0)
    laws = left / left.sum(-1, keepdim=True)  # some token is always left: K <= V
    return laws if picked is None else torch.where(picked[..., None], hits, laws)
