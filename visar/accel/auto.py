"""`auto`: the fastest lossless raster decoding for this model, device and batch size.

Plain AR, or tree-mc-sjd under `budget="auto"` (which itself runs a draft tree, or its one-branch
case, mc-sjd's coupled chain, whichever the measured pass costs favour; then each pass's size is
chosen from what the decode has accepted so far, `visar.accel.budget`). The choice between AR and
drafting is made before the first pass, from the measured cost of an AR step, of each chain window
and of each tree, and the prior acceptance: drafting must promise AUTO_MARGIN more tokens per
second than AR, so a device where rows cost (a CPU at a large batch) samples plainly. Every branch
samples the model's exact law.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.base import RasterModel
from .ar import ar_costs, sample_tokens
from .budget import PRIOR_ACCEPT
from .drafts import resolve_initialiser
from .jacobi import JacobiProposer, chain_costs, maximal_coupling_carry
from .registry import Request, get_method, register_method
from .sampling import SamplingParams
from .tree_jacobi import parse_neighbours, slot_tokens, tree_costs, tree_layouts, tree_prior_rates

# Drafting must promise this much more than AR's tokens per second before `auto` drafts: the prior
# acceptance is a guess until the decode has counts, and a wrong guess must not cost more than AR.
AUTO_MARGIN = 0.1


def drafting_pays(request: Request) -> tuple[bool, str]:
    """Whether tree-mc-sjd under an auto budget is expected to beat AR here, and why (for the stats)."""
    model = request.model
    defaults = get_method("tree-mc-sjd").defaults
    initialiser = resolve_initialiser(defaults["init"])
    ar = ar_costs(request)
    chain = chain_costs(request, lambda: JacobiProposer(initialiser, maximal_coupling_carry))
    layouts = tree_layouts(model, min(defaults["branch"], model.vocab_size), defaults["depth"])
    names = parse_neighbours(defaults["neighbours"])
    tree = tree_costs(request, layouts, initialiser, names) if layouts else None
    if ar is None or chain is None:
        return False, "ar: the pass costs could not be measured"
    ar_rate = 1 / ar(1)
    chain_rate = max(slot_tokens([PRIOR_ACCEPT] * s, s - 1) / chain(s) for s in chain.sizes)
    rate = chain_rate
    if tree is not None:
        some = next(iter(layouts.values()))
        for size in tree.sizes:
            drafts = layouts[size].main_length - 1
            rates = tree_prior_rates(some.branch, some.depth, drafts)
            rate = max(rate, slot_tokens(rates, drafts) / tree(size))
    gain = rate / ar_rate
    return gain > 1 + AUTO_MARGIN, f"expected {gain:.2f}x AR's tokens per second from drafting (prior acceptance)"


@register_method(
    "auto",
    lossless=True,
    description="the fastest lossless method for this model, device and batch: plain AR, or tree-mc-sjd / mc-sjd "
    "with each pass's size matched to the measured pass costs",
    batch_invariant=False,
)
def auto(
    model: RasterModel,
    cond: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    *,
    cond_mask: Tensor | None = None,
    progress: bool = False,
) -> tuple[Tensor, dict]:
    """Plain AR, or tree-mc-sjd with budget="auto" (a draft tree or mc-sjd's chain, each pass's size
    chosen for the most tokens per second), whichever the pass costs measured on this device at
    this batch size favour (measured once per process; stats["auto"] says which ran and why)."""
    request = Request(model, cond, params, generators, cond_mask, progress)
    drafting, why = drafting_pays(request)
    if not drafting:
        tokens, stats = sample_tokens(request)
        return tokens, {**stats, "auto": "ar", "auto_reason": why}
    tokens, stats = get_method("tree-mc-sjd").fn(
        model, cond, params, generators, cond_mask=cond_mask, progress=progress, budget="auto"
    )
    ran = "mc-sjd" if stats.get("tree") == "chain" else "tree-mc-sjd"
    return tokens, {**stats, "auto": ran, "auto_reason": why}
