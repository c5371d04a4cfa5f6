"""zipar's registered methods: `zipar`, its Jacobi fronts (`zipar-sjd`, `zipar-mc-sjd`, `zipar-gsd`),
its tree fronts (`zipar-tree`) and the exact `wavefront`, each a wrapper over `engine.decode_fronts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from ....errors import VisarError
from ....models.lag_mask import check_lag
from ...core.acceptance import SPECULATIVE, AcceptanceRule
from ...core.checks import check_budget, check_flag
from ...core.method_registry import Request, register_method
from ..chain import check_spans
from ..drafts import resolve_initialiser
from ..methods.relaxed import gsd_rule
from ..proposers import Carry, carry_updater, independent_carry, maximal_coupling_carry
from ..tree_passes import clip_branch, parse_neighbours
from .engine import FrontSettings, decode_fronts
from .plan import token_grid
from .tree_fronts import FrontTrees


def covers_rows(options: dict, model) -> bool:
    """s >= W: a row starts only once the row above is complete, so every token sees its raster
    context (zipar is plain AR; Jacobi fronts sample the exact law)."""
    return options["s"] >= token_grid(model, "zipar")[1]


# What zipar and its Jacobi and tree fronts register about their exactness (zipar-gsd adds its group size).
EXACT_WHEN_ROWS_COVERED = dict(exact_when=covers_rows, exact_when_text="s >= the grid width", exact_example={"s": 1024})


@register_method(
    "zipar",
    lossless=False,
    description="ZipAR next-set decoding (He et al. 2025): row r+1 starts once row r has s tokens, every row "
    "front advances in one pass, W + (H-1)s passes (unfinished rows above are not seen)",
    **EXACT_WHEN_ROWS_COVERED,
    refills=True,
)
def zipar(request: Request, *, s: int = 8) -> tuple[Tensor, dict]:
    """ZipAR next-set decoding (He et al. 2025): row r + 1 starts once row r has s tokens, and every
    started row advances one token per pass, in W + (H - 1) * min(s, W) passes. Lossy for s < W
    (docs/RASTER.md says what is approximated); with s >= W it is plain AR, token for token.

    s: the window, an integer >= 1 (the released code's default is 8).
    """
    return decode_fronts(request, FrontSettings("zipar", s))


@dataclass(frozen=True)
class JacobiFrontOptions:
    """The options zipar-sjd, zipar-mc-sjd, zipar-gsd and zipar-tree share, as the caller gave them."""

    s: int  # the lag
    window: int  # slots per front and pass
    init: str | Callable  # the draft initialiser's name, or one
    cross_row: bool  # a front may also draft from the row above's drafts of the same pass
    budget: int | None  # the window's other name (`auto`'s candidates set it), None keeps `window`
    start_lag: int | None = None  # tokens of the row above before a row's first (None: s)


def jacobi_fronts(
    request: Request,
    method: str,
    options: JacobiFrontOptions,
    carry: Carry,
    rule: AcceptanceRule = SPECULATIVE,
    trees: FrontTrees | None = None,
) -> tuple[Tensor, dict]:
    """What zipar-sjd, zipar-mc-sjd, zipar-gsd and zipar-tree share: their front options checked and
    handed to `decode_fronts` with the method's carry-over, rule and trees."""
    budget = check_budget(options.budget, method, "slots per front and pass")
    window = budget or options.window
    if window == 1:  # one slot per front is plain zipar: it drafts nothing for zipar-tree's trees to branch from
        trees = None
    initialiser, cross_row = resolve_initialiser(options.init), check_flag("cross_row", options.cross_row)
    settings = FrontSettings(method, options.s, window, initialiser, carry, rule, cross_row, trees, options.start_lag)
    tokens, stats = decode_fronts(request, settings)
    return tokens, {**stats, "budget": budget or "fixed"}


@register_method(
    "zipar-sjd",
    lossless=False,
    description="zipar whose row fronts each run a speculative Jacobi window",
    **EXACT_WHEN_ROWS_COVERED,
    refills=True,
)
def zipar_sjd(
    request: Request,
    *,
    s: int = 8,
    window: int = 16,
    init: str | Callable = "random",
    cross_row: bool = True,
    budget: int | None = None,
    start_lag: int | None = None,
) -> tuple[Tensor, dict]:
    """ZipAR whose row fronts each run a speculative Jacobi window (SJD: fresh drafts from p).

    s: the ZipAR window; window: slots per front and pass (clipped at the row end and by the lag
    s); init: the draft initialiser for new slots ("random", "above", "left", "above-left";
    "random" by default, as for gsd and lantern: a lossy method's init changes its output, so the
    default stays the one its quality was measured with, docs/DETAILS.md); cross_row: a front may
    also draft past its lag from the row above's drafts of the same pass (kept only when those are
    accepted; without it lower fronts settle at exactly s behind the row above, one token a pass,
    and the combination needs as many passes as zipar); budget: slots per front and pass, the
    window's other name (`auto`'s candidates set it), None keeps `window`; start_lag: tokens of the
    row above that a row's first token waits for (None: s; with start_lag > s, s is the running lag
    once a row has started, as in PJD, `pjd`).
    Lossy for s < W as zipar is; lossless for s >= W.
    """
    options = JacobiFrontOptions(s, window, init, cross_row, budget, start_lag)
    return jacobi_fronts(request, "zipar-sjd", options, Carry(independent_carry))


@register_method(
    "zipar-mc-sjd",
    lossless=False,
    description="zipar whose row fronts each run a coupled speculative Jacobi window",
    **EXACT_WHEN_ROWS_COVERED,
    refills=True,
)
def zipar_mc_sjd(
    request: Request,
    *,
    s: int = 8,
    window: int = 16,
    coupling: str = "maximal",
    init: str | Callable = "random",
    cross_row: bool = True,
    budget: int | None = None,
    start_lag: int | None = None,
) -> tuple[Tensor, dict]:
    """ZipAR whose row fronts each run a coupled speculative Jacobi window (MC-SJD).

    coupling: "maximal" or "gumbel" (noise keyed to image and absolute position); other options
    as zipar-sjd.
    """
    options = JacobiFrontOptions(s, window, init, cross_row, budget, start_lag)
    return coupled_fronts(request, "zipar-mc-sjd", options, coupling)


def coupled_fronts(request: Request, method: str, options: JacobiFrontOptions, coupling: str) -> tuple[Tensor, dict]:
    """zipar-mc-sjd's decode, which pjd presets."""
    tokens, stats = jacobi_fronts(request, method, options, carry_updater(coupling, method))
    return tokens, {**stats, "coupling": coupling}


def scaled_lag(width: int) -> int:
    """pjd's start lag and window where left out: PJD's 8 for Lumina-mGPT's 48-token rows, scaled with the
    row, ceil(W / 6)."""
    return -(-width // 6)


@register_method(
    "pjd",
    lossless=False,
    description="PJD's row schedule (Liao et al., CVPR 2026) on zipar-mc-sjd's exact fronts: a row starts W/6 "
    "tokens behind the row above (8 on Lumina-mGPT's 48), then runs 2 behind, windows of W/6, no drafts from above",
    **EXACT_WHEN_ROWS_COVERED,
    refills=True,
)
def pjd(
    request: Request,
    *,
    start_lag: int | None = None,
    s: int = 2,
    window: int | None = None,
    coupling: str = "maximal",
    init: str | Callable = "random",
    cross_row: bool = False,
    budget: int | None = None,
) -> tuple[Tensor, dict]:
    """Parallel Jacobi decoding's row schedule (Liao et al., CVPR 2026; boyaliao/PJD) on
    zipar-mc-sjd's fronts: row r + 1 starts once row r has `start_lag` tokens and then runs `s`
    tokens behind it (a token (r, c) waits for c + s tokens of row r - 1), each front a coupled
    Jacobi window of `window` slots that sees the committed tokens above, never their drafts (PJD's
    row-causal mask: `cross_row=False`).

    start_lag and window: None scales PJD's 8, set for Lumina-mGPT's 48-token rows, with the row:
    ceil(W / 6) (8 at W = 48, 4 at 24, 3 on visar-tiny-c2i's 16; chosen on held-out images over
    the constants themselves, docs/RASTER.md "PJD").

    What is PJD's and what is not: its schedule and mask. Its acceptance is not: every front here
    samples its own masked conditional exactly (resampling at a rejection, recording each draft's
    law), where the official lower rows keep only accepted drafts and its carry keeps a draft with
    its old law (tools/pjd_official.py runs those rules; docs/RASTER.md has the comparison). So the
    law differs from AR's only by what zipar approximates (a token does not see the rows above past
    column c + s - 1), and with s >= W it is exact. Other options as zipar-mc-sjd.
    """
    scaled = scaled_lag(token_grid(request.model, "pjd")[1])
    start_lag = scaled if start_lag is None else start_lag
    window = scaled if window is None else window
    options = JacobiFrontOptions(s, window, init, cross_row, budget, start_lag)
    return coupled_fronts(request, "pjd", options, coupling)


@register_method(
    "zipar-tree",
    lossless=False,
    description="zipar whose row fronts each run a coupled Jacobi window with tree-mc-sjd's draft tree at its head",
    **EXACT_WHEN_ROWS_COVERED,
    refills=True,
)
def zipar_tree(
    request: Request,
    *,
    s: int = 2,
    window: int = 8,
    branch: int = 10,
    depth: int = 2,
    init: str | Callable = "above",
    neighbours: str = "left,above,above-right,above-left",
    cross_row: bool = True,
    budget: int | None = None,
    start_lag: int | None = None,
) -> tuple[Tensor, dict]:
    """ZipAR whose row fronts each run zipar-mc-sjd's window with tree-mc-sjd's tree at its head.

    branch: candidates for each front's first draft (K, clipped to the vocabulary's size): its
    draft, then the known `neighbours` of that index not tried yet (one-hot laws; "left", "above",
    "above-left", "above-right", comma-separated, "" for none), then draws without replacement
    from the draft's law; depth: 2 (the tree: a side node per extra candidate) or 1 (no tree:
    zipar-mc-sjd with maximal coupling); other options as zipar-sjd. Verified by recursive
    rejection with the speculative test, not GSD's grouped one (lossy for s < W as zipar is,
    lossless for s >= W). Defaults, init "above" included, chosen on held-out seeds for passes and
    detector accuracy (docs/DEFAULTS.md).
    """
    model = request.model
    height = token_grid(model, "zipar-tree")[0]
    check_spans(window, 0, 0)
    branch = clip_branch(branch, model)
    if depth not in (1, 2) or isinstance(depth, bool):
        raise VisarError(
            f"zipar-tree drafts trees of depth 2 (K candidates for each front's first draft) or 1 (none), "
            f"got depth {depth!r}"
        )
    names = parse_neighbours(neighbours)
    trees = None
    if depth == 2 and branch > 1 and window > 1:  # depth 1, or one candidate or slot: nothing to branch
        trees = FrontTrees(branch, names, request.batch_size, height, model.device, model.vocab_size)
    options = JacobiFrontOptions(s, window, init, cross_row, budget, start_lag)
    tokens, stats = jacobi_fronts(request, "zipar-tree", options, Carry(maximal_coupling_carry), trees=trees)
    # counted by the engine where a tree ran (`SlotState.count_per_image`); none ran (depth 1, one
    # candidate or a budget of one slot a front): no side taken
    taken = stats.get("side_taken_per_image", [0] * len(tokens))
    return tokens, {**stats, "branch": branch, "depth": depth, "side_taken_per_image": taken}


def covers_rows_in_groups_of_one(options: dict, model) -> bool:
    """zipar-gsd: s >= W, and groups of one (the speculative test)."""
    return covers_rows(options, model) and options["group_size"] == 1


@register_method(
    "zipar-gsd",
    lossless=False,
    description="zipar whose row fronts each run a GSD window (grouped acceptance)",
    exact_when=covers_rows_in_groups_of_one,
    exact_when_text="s >= the grid width and group_size=1",
    exact_example={"s": 1024, "group_size": 1},
    refills=True,
)
def zipar_gsd(
    request: Request,
    *,
    s: int = 8,
    group_size: int = 14,
    prob_gap: float = 0.15,
    max_distance: float = 0.05,
    residual: str = "speculative",
    window: int = 16,
    init: str | Callable = "random",
    cross_row: bool = True,
    budget: int | None = None,
    start_lag: int | None = None,
) -> tuple[Tensor, dict]:
    """ZipAR whose row fronts each run a GSD window: SJD drafts, verified with GSD's grouped test
    (raster/methods/relaxed.py; lossy even for s >= W). group_size, prob_gap, max_distance, residual as `gsd`;
    request.tokenizer: the model's VQ tokenizer (or its codebook [V, C]), passed by
    Pipeline.generate; other options as zipar-sjd.
    """
    token_grid(request.model, "zipar-gsd")
    check_lag(s)
    rule = gsd_rule(request.model, request.tokenizer, group_size, prob_gap, max_distance, "zipar-gsd", residual)
    options = JacobiFrontOptions(s, window, init, cross_row, budget, start_lag)
    tokens, stats = jacobi_fronts(request, "zipar-gsd", options, Carry(independent_carry), rule=rule)
    groups = {"group_size": group_size, "prob_gap": prob_gap, "max_distance": max_distance}
    return tokens, {**stats, **groups, "residual": residual}


@register_method(
    "wavefront",
    lossless=True,
    description="exact wavefront decoding for models that declare local dependence (model.dependency_reach)",
    requires=("dependency_reach",),
    refills=True,
)
def wavefront(request: Request) -> tuple[Tensor, dict]:
    """Exact wavefront decoding of a model whose dependence is known local.

    The model must declare `dependency_reach = R` (an int >= 0; docs/RASTER.md, "ZipAR, Jacobi row
    fronts and the wavefront", states the local attention pattern it promises). Tokens (r, c) with
    equal c + (R + 1) r come out of one pass, W + (R + 1)(H - 1) passes in all, and the tokens are
    plain AR's (same per-position draws).
    """
    model = request.model
    token_grid(model, "wavefront")
    reach = getattr(model, "dependency_reach", None)
    if isinstance(reach, bool) or not isinstance(reach, int) or reach < 0:
        raise VisarError(
            f"wavefront is exact only for a model whose dependence is known local, declared as "
            f"model.dependency_reach = R (columns to the right in the rows above, an integer >= 0); "
            f"{type(model).__name__} declares {reach!r}: use zipar for a model with global attention"
        )
    tokens, stats = decode_fronts(request, FrontSettings("wavefront", reach + 1))
    return tokens, {**stats, "dependency_reach": reach}
