"""`auto`: the fastest lossless raster decoding for this model, device and batch size.

Plain AR, or tree-mc-sjd under `budget="auto"` (which itself runs a draft tree, or its one-branch
case, mc-sjd's coupled chain, whichever the measured pass costs favour; then each pass's size is
chosen from what the decode has accepted so far, `visar.accel.budget`). The choice between AR and
drafting is made before the first pass, from the measured cost of an AR step, of each chain
window (in the same rounds) and of each tree, and the prior acceptance: drafting must promise
AUTO_MARGIN more tokens per second than AR, so a device where rows cost (a CPU at a large batch)
samples plainly. Every branch samples the model's exact law.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from . import cost_store
from .ar import sample_tokens
from .drafts import resolve_initialiser
from .registry import Request, get_method, register_method
from .tree_jacobi import choose_draft_shape, decode_draft_shape, parse_neighbours, tree_layouts

# Drafting must promise this much more than AR's tokens per second before `auto` drafts: the prior
# acceptance is a guess until the decode has counts (the embedded default's first row accepts
# almost nothing), and a probe's fastest passes price a long decode's passes about 10% low; where
# drafting promises less, its gain is within the machine's noise and AR's is certain.
AUTO_MARGIN = 0.4


@register_method(
    "auto",
    lossless=True,
    description="the fastest lossless method for this model, device and batch: plain AR, or tree-mc-sjd / mc-sjd "
    "with each pass's size matched to the measured pass costs",
    batch_invariant=False,
    refills=True,
)
def auto(request: Request) -> tuple[Tensor, dict]:
    """Plain AR, or tree-mc-sjd with budget="auto" (a draft tree or mc-sjd's chain, each pass's size
    chosen for the most tokens per second), whichever the pass costs measured on this device at
    this batch size favour (measured once per process; stats["auto"] says which ran and why)."""
    defaults = get_method("tree-mc-sjd").defaults
    initialiser, neighbours = resolve_initialiser(defaults["init"]), parse_neighbours(defaults["neighbours"])
    layouts = tree_layouts(request.model, defaults["branch"], defaults["depth"])
    shape = choose_draft_shape(request, layouts, initialiser, neighbours)
    if shape is None:
        tokens, stats = sample_tokens(noting(request, auto="ar"))
        why = "the pass costs could not be measured"
        return tokens, {**stats, "auto": "ar", "auto_reason": why, "auto_costs": "no pass costs"}
    # an AR step's cost (chain size 0) was measured in the same rounds as the windows: a machine's
    # speed drifts, and ratios taken within one measurement hold
    gain = shape.rate * shape.chain(0)
    why = f"expected {gain:.2f}x AR's tokens per second from drafting (prior acceptance)"
    if gain <= 1 + AUTO_MARGIN:
        tokens, stats = sample_tokens(noting(request, auto="ar"))
        return tokens, {**stats, "auto": "ar", "auto_reason": why, "auto_costs": costs_source(shape)}
    ran = "tree-mc-sjd" if shape.use_tree else "mc-sjd"
    tokens, stats = decode_draft_shape(noting(request, auto=ran), shape, layouts, initialiser, neighbours)
    return tokens, {**stats, "auto": ran, "auto_reason": why, "auto_costs": costs_source(shape)}


def costs_source(shape) -> str:
    """Where the pass costs behind the choice came from: this process's measurement, or the file kept on disk."""
    if shape.chain.kept_on_disk:
        return f"pass costs kept on disk ({cost_store.cache_root() / cost_store.FILE_NAME}; delete it to measure again)"
    return "pass costs measured now (kept on disk for later runs)"


def noting(request: Request, **note) -> Request:
    """The request whose running batch hands each finished image over with `note` (what auto ran)."""
    if request.on_image is None:
        return request
    hand_over = request.on_image
    return replace(request, on_image=lambda index, tokens, info: hand_over(index, tokens, {**info, **note}))
