"""Relaxed acceptance for visual tokens: GSD's grouped test and LANTERN's latent-proximity target.

Papers and the upstream code the rules were checked against:
- GSD: So, Shin, Kook, Park, "Grouped Speculative Decoding for Autoregressive Image
  Generation", ICCV 2025 (arXiv 2508.07747); junhyukso/GSD,
  `scheduler/jacobi_iteration_lumina_mgpt.py` (the acceptance test and its dynamic group).
- LANTERN: Jang, Park et al., "LANTERN: Accelerating Visual Autoregressive Models with Relaxed
  Speculative Decoding", ICLR 2025 (arXiv 2410.03355); jadohu/LANTERN,
  `entrypoints/generate_codebook.py` (neighbour lists) and `models/ea_model_llamagen.py`
  (`--lantern_k`, `--lantern_delta`); LANTERN++ (arXiv 2502.06352, upstream `--static_tree`).

Image tokens are redundant: several codes draw almost the same patch. gsd and lantern keep the
speculative Jacobi engine (chain.py) and change only the verification, through an
`AcceptanceRule` (the rules live in acceptance.py); lantern++ verifies a static draft tree from
a draft model (static_tree.py). The codebook and its neighbour tables are core/codebook.py's.
docs/RASTER.md ("Relaxed acceptance") has each rule, the deliberate differences from the upstream
code (LANTERN's bound kept for sampled drafts) and the default initialisers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from ....errors import VisarError
from ...core.acceptance import (
    AcceptanceRule,
    grouped_accept,
    grouped_acceptance,
    lantern_relax_bounded,
    lantern_relax_per_draft,
    lossless,
    speculative_accept,
    speculative_residual,
)
from ...core.checks import check_number
from ...core.codebook import codebook_of, nearest_codes
from ...core.method_registry import Request, register_method
from ..chain import speculative_decode
from ..draft_model import DraftModelProposer
from ..drafts import resolve_initialiser
from ..proposers import CARRIES, Carry, JacobiProposer, carry_updater, independent_carry
from .jacobi import check_draft

LANTERN_FORMS: dict[str, Callable] = {"bounded": lantern_relax_bounded, "paper": lantern_relax_per_draft}
# A rejection's residual: "optimal" draws from norm((p - q a)+), the least TV at the test's acceptance a
# (acceptance.optimal_residual); "speculative" from norm((p~ - q)+), as upstream.
RESIDUALS = ("optimal", "speculative")


def check_residual(residual) -> str:
    if residual not in RESIDUALS:
        raise VisarError(f"unknown residual {residual!r}; use one of {', '.join(RESIDUALS)}")
    return residual


# -- option checks --------------------------------------------------------------------------------------


def gsd_rule(
    model, tokenizer, group_size, prob_gap, max_distance, method: str = "gsd", residual: str = "speculative"
) -> AcceptanceRule:
    """GSD's verification: the grouped test (acceptance.grouped_accept) on the model's codebook, with
    rejections drawn from `residual`'s law; one VisarError for an option out of range."""
    check_number("group_size", group_size, 1, integer=True)
    check_number("prob_gap", prob_gap, 0)
    check_number("max_distance", max_distance, 0)
    book = codebook_of(tokenizer, model.vocab_size, method).to(model.device)
    group = dict(codebook=book, group_size=group_size, prob_gap=prob_gap, max_distance=max_distance)
    accept = lossless(False)(partial(grouped_accept, **group))
    if check_residual(residual) == "speculative" or group_size == 1:  # groups of one: the exact test's own
        return AcceptanceRule(accept, speculative_residual)
    return AcceptanceRule(accept, speculative_residual, acceptance=partial(grouped_acceptance, **group))


def lantern_neighbours(request: Request, k, form, method: str) -> Tensor:
    """LANTERN's k and form checked, and the k nearest codes of every code of the model's codebook
    [V, min(k, V - 1)], on the model's device."""
    check_number("k", k, 1, integer=True)
    if not isinstance(form, str) or form not in LANTERN_FORMS:
        raise VisarError(f"unknown lantern form {form!r}; use one of {', '.join(LANTERN_FORMS)}")
    model = request.model
    book = codebook_of(request.tokenizer, model.vocab_size, method)
    return nearest_codes(book, min(k, model.vocab_size - 1)).to(model.device)


def jacobi_or_draft_proposer(request: Request, draft, init, coupling=None):
    if draft is None:
        return JacobiProposer(resolve_initialiser(init), carry_updater(coupling or "none", "lantern", CARRIES))
    if coupling is not None:
        raise VisarError("coupling applies to Jacobi drafts (carried over between passes); a draft model drafts afresh")
    draft_model = check_draft(request.model, draft, "lantern")
    return DraftModelProposer(draft_model, request)


# -- the registered methods -----------------------------------------------------------------------------


def gsd_is_exact(options: dict, model) -> bool:
    """Groups of one: the grouped test is the speculative test, and gsd is sjd."""
    return options["group_size"] == 1


@register_method(
    "gsd",
    lossless=False,
    description="grouped speculative Jacobi decoding (So et al. 2025): accepts a draft by its group of "
    "visually equivalent tokens",
    exact_when=gsd_is_exact,
    exact_when_text="group_size=1",
    exact_example={"group_size": 1},
    refills=True,
)
def gsd(
    request: Request,
    *,
    group_size: int = 14,
    prob_gap: float = 0.15,
    max_distance: float = 0.05,
    residual: str = "speculative",
    window: int = 16,
    warmup: int = 0,
    tail: int = 0,
    init: str | Callable = "random",
) -> tuple[Tensor, dict]:
    """Grouped speculative decoding (So et al. 2025): SJD whose test accepts a draft when its group
    of visually equivalent tokens has enough target mass (lossy).

    group_size: the draft and its neighbours by target probability considered (14 as upstream;
    1 = SJD); prob_gap: a neighbour y stays when |p(y) - p(x)| <= prob_gap; max_distance: and
    when the squared distance of the code vectors ||e(y) - e(x)||^2 <= max_distance (unit-norm
    codes: 0..4). residual: what a rejection draws from, "speculative" (norm((p - q)+), upstream's)
    or "optimal" (norm((p - q a)+), a the grouped test's acceptance of each token: the least TV to
    p at that acceptance, for [B, L, V, n, C] more work a pass). Other options as `sjd`. request.tokenizer:
    the model's VQ tokenizer (or its codebook [V, C]); Pipeline.generate passes it.
    """
    rule = gsd_rule(request.model, request.tokenizer, group_size, prob_gap, max_distance, residual=residual)
    proposer = JacobiProposer(resolve_initialiser(init), Carry(independent_carry))
    tokens, stats = speculative_decode(request, proposer, window=window, warmup=warmup, tail=tail, rule=rule)
    groups = {"group_size": group_size, "prob_gap": prob_gap, "max_distance": max_distance}
    return tokens, {**stats, **groups, "residual": residual}


def lantern_is_exact(options: dict, model) -> bool:
    """No mass moved: p~ = p, and lantern is sjd, mc-sjd or spec by its drafts."""
    return options["delta"] == 0


@register_method(
    "lantern",
    lossless=False,
    description="LANTERN relaxed speculative decoding (Jang et al. 2025): mass of the draft's codebook "
    "neighbours moved onto it, output within TV delta of the target per position",
    exact_when=lantern_is_exact,
    exact_when_text="delta=0",
    exact_example={"delta": 0.0},
    refills=True,
)
def lantern(
    request: Request,
    *,
    delta: float = 0.1,
    k: int = 64,
    form: str = "bounded",
    draft=None,
    coupling: str | None = None,
    window: int | None = None,
    warmup: int = 0,
    tail: int = 0,
    init: str | Callable = "random",
) -> tuple[Tensor, dict]:
    """LANTERN relaxed speculative decoding (Jang et al. 2025): verify against a target that moves
    the mass of the draft's k nearest codebook neighbours onto it, at most delta in total (lossy).

    delta: the most target mass moved per position (0 = exact); with form="bounded" (default)
    every position's output law is within TV delta of p, whatever the drafts; form="paper": the
    paper's per-draft target, whose bound holds only for deterministic drafts (here it can be
    exceeded). k: neighbours per code (clipped to V - 1; the bounded form costs [B, L, V, k]
    memory per pass). Rejections draw from norm((p~ - q)+): with either form its TV to p is already
    the least any residual gives at the test's acceptance (tests/accel/raster/test_relaxed.py), so
    the optimal residual gsd takes would change nothing. draft: None for Jacobi drafts (as
    `sjd`, window 16 by default), or a draft model as in `spec` (window 5 by default). coupling
    (Jacobi drafts only): how drafts carry over between passes, "none" (SJD's fresh draws from p,
    the default) or MC-SJD's "maximal" / "gumbel"; a maximally coupled carry keeps each slot's
    verified token, whose law is p~, and records p~ as its q, so the bound holds with it too.
    request.tokenizer: the model's VQ tokenizer (or its codebook [V, C]); Pipeline.generate passes
    it. Other options as `sjd`.
    """
    window = (16 if draft is None else 5) if window is None else window
    check_number("delta", delta, 0, maximum=1)  # mass moved per position
    table = lantern_neighbours(request, k, form, "lantern")
    relax = lossless(False)(partial(LANTERN_FORMS[form], neighbours=table, delta=float(delta)))
    proposer = jacobi_or_draft_proposer(request, draft, init, coupling)
    rule = AcceptanceRule(speculative_accept, speculative_residual, relax)
    tokens, stats = speculative_decode(request, proposer, window=window, warmup=warmup, tail=tail, rule=rule)
    used = (coupling or "none") if draft is None else "draft model"
    return tokens, {**stats, "delta": delta, "k": table.shape[1], "form": form, "coupling": used}


def lantern_pp_is_exact(options: dict, model) -> bool:
    """A cap of 1 (or no budget) moves no mass: the tree is verified against p (EAGLE's lossless trees)."""
    return options["lambda_cap"] == 1 or options["delta"] == 0


@register_method(
    "lantern++",
    lossless=False,
    description="LANTERN++ (Jang et al. 2025): a static draft tree from a draft model (draft=), verified in one "
    "pass with tree attention, LANTERN's relaxed test with a multiplicative cap",
    exact_when=lantern_pp_is_exact,
    exact_when_text="lambda_cap=1 or delta=0",
    exact_example={"lambda_cap": 1.0},
    needs_draft=True,
    refills=True,
)
def lantern_pp(
    request: Request,
    *,
    draft=None,
    tree="naive_extend_57",
    lambda_cap: float = 5.0,
    delta: float | None = None,
    k: int = 10,
    form: str = "bounded",
) -> tuple[Tensor, dict]:
    """LANTERN++ (Jang, Park et al. 2025): a static draft tree from a draft model, verified in one
    target pass, each child tested against LANTERN's relaxed target with the multiplicative cap.

    draft: the draft model (as in `spec`; required). tree: "naive_extend_57" (57 nodes, depth 5),
    "chain5", or a list of child-rank paths such as [[0], [1], [0, 0]]. lambda_cap: a draft's
    relaxed probability is at most lambda_cap times its own (1 = exact, lossless); delta: also at
    most delta of mass moved per test (None: no additive cap); k: codebook neighbours per code;
    form: "bounded" (default) or "paper", as in `lantern`. Each sibling test moves at most
    min(delta, (lambda_cap - 1) p(x)) of mass, so a position's law moves by at most that much per
    child tried (a node has up to 5 children in the default tree). request.tokenizer: the model's
    VQ tokenizer (or its codebook [V, C]); Pipeline.generate passes it.
    """
    from ..static_tree import resolve_tree, tree_decode  # the tree engine is only needed here

    static_tree = resolve_tree(tree)
    check_number("lambda_cap", lambda_cap, 1)
    check_number("delta", delta, 0, maximum=1, allow_none=True)
    draft_model = check_draft(request.model, draft, "lantern++")  # the tree is drafted by a draft model
    table = lantern_neighbours(request, k, form, "lantern++")
    budget = 1.0 if delta is None else float(delta)  # all mass is <= 1: no additive cap
    relax = lossless(lambda_cap == 1 or budget == 0)(
        partial(LANTERN_FORMS[form], neighbours=table, delta=budget, lambda_cap=float(lambda_cap))
    )
    tokens, stats = tree_decode(request, draft_model, static_tree, relax)
    return tokens, {**stats, "lambda_cap": lambda_cap, "delta": delta, "k": table.shape[1], "form": form}
