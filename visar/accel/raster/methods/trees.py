"""The draft-tree engine's registered methods: sjd-pac and tree-mc-sjd (`raster/tree_passes.py` is their engine)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ...core.method_registry import Request, register_method
from ..drafts import resolve_initialiser
from ..tree_passes import check_tree, parse_neighbours, tree_jacobi_decode


@register_method(
    "sjd-pac",
    lossless=True,
    description="SJD-PAC (Kang et al. 2026): a K-ary draft tree after each commit, a chain to the window, every "
    "slot verified; candidates drawn from the law they are verified under, exact at any batch size",
    refills=True,
)
def sjd_pac(
    request: Request,
    *,
    window: int = 16,
    branch: int = 3,
    depth: int = 3,
    init: str | Callable = "random",
    budget: int | None = None,
) -> tuple[Tensor, dict]:
    """SJD-PAC (Kang et al. 2026), exact at every batch size.

    window: tree nodes per pass, the root included (L); branch: candidates at each branching
    position (K); depth: the tree's depth, root included (D: positions 1 .. D - 1 branch);
    init: the draft of a new slot, "random" as upstream ("above", "left", "above-left" as sjd).
    Defaults are those of upstream's `eval_model.py` (L = 16, K = 3, D = 3). budget: tree nodes
    per pass, the window's other name (`auto`'s candidates set it), None keeps `window`.
    """
    layout = check_tree(request.model, window, branch, depth)
    return tree_jacobi_decode(request, layout, resolve_initialiser(init), (), budget, "sjd-pac")


@register_method(
    "tree-mc-sjd",
    lossless=True,
    description="coupled draft trees: SJD-PAC's tree verified by recursive rejection, MC-SJD's coupled "
    "carry-over and 2-D drafts for new slots, exact at any batch size",
    refills=True,
)
def tree_mc_sjd(
    request: Request,
    *,
    window: int = 64,
    branch: int = 6,
    depth: int = 2,
    init: str | Callable = "above",
    neighbours: str = "left,above,above-right,above-left",
    budget: int | None = None,
) -> tuple[Tensor, dict]:
    """Coupled draft trees: SJD-PAC's tree after each commit, MC-SJD's coupled carry-over, 2-D drafts.

    window: tree nodes per pass, the root included (rows per pass); branch: candidates at each
    of the first depth - 1 draft positions: the carried (or initialised) draft, then the known
    `neighbours` of the position not tried yet (one-hot laws; "left", "above", "above-left",
    "above-right", comma-separated, "" for none), then draws without replacement from the
    carried draft's law; init: the draft of a new slot ("above"). Defaults chosen on held-out
    seeds for passes and rows per pass (docs/DEFAULTS.md). budget: as sjd-pac's.
    """
    layout = check_tree(request.model, window, branch, depth)
    names = parse_neighbours(neighbours)
    return tree_jacobi_decode(request, layout, resolve_initialiser(init), names, budget, "tree-mc-sjd")
