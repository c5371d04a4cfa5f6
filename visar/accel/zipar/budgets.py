"""zipar's Jacobi fronts under a budget (`decode_fronts_under`): the window per front chosen every few
passes by `budget.FrontBudget` from what a pass at each window would feed (`front_shapes`) and what
a pass costs on this device (`front_costs`); a number is the window per front.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from ..budget import (
    AUTO,
    CHAIN_SIZES,
    MAX_AGE,
    FrontBudget,
    PassCosts,
    ProbeBudget,
    SurvivalCounts,
    check_budget,
    cost_key,
    measured_costs,
    scratch_request,
)
from ..drafts import random_init
from ..jacobi import chain_costs
from ..proposers import JacobiProposer, independent_carry
from ..registry import Request
from .engine import decode_fronts
from .plan import front_windows, token_grid


def front_shapes(count: Tensor, sizes: tuple[int, ...], width: int, s: int, cross_row: bool, side_rows: int):
    """What a pass at each window would be, from the committed counts alone -> [C, 2 + max size - 1]:
    per size, the most rows an image would feed (its fronts' windows, plus `side_rows` side nodes per
    front that drafts: zipar-tree's), then how many fronts an image has with 0, 1, .. drafts (the
    batch's mean). Every size is planned at once (the batch repeated once per size)."""
    batch, num_sizes = count.shape[0], len(sizes)
    windows = torch.tensor(sizes, device=count.device).repeat_interleave(batch)
    window_len = front_windows(count.repeat(num_sizes, 1), width, s, windows, cross_row)[0]  # [C * B, H]
    drafts = (window_len - 1).clamp(min=0)
    rows = window_len.sum(1) + side_rows * (drafts > 0).sum(1)
    fronts = torch.nn.functional.one_hot(drafts, max(sizes)) * (window_len > 0)[..., None]  # [C * B, H, D + 1]
    by_drafts = fronts.sum(1).view(num_sizes, batch, -1).float().mean(1)
    return torch.cat([rows.view(num_sizes, batch).amax(1, keepdim=True).float(), by_drafts], 1)


def front_costs(request: Request, s: int, method: str, engine: dict) -> PassCosts | None:
    """Seconds per pass of the fronts' engine by rows per image: the chain engine's costs at each size
    (`jacobi.chain_costs`, shared with sjd and mc-sjd), plus what a pass of the fronts' engine costs
    beyond a chain pass of one row (its plan, the rows' checks and the carried drafts: measured with
    one slot per front, cached as the chain's)."""
    chain = chain_costs(request, lambda: JacobiProposer(random_init, independent_carry))
    if chain is None:
        return None
    model = request.model
    key = cost_key("fronts", model, request.batch_size, request.params.uses_cfg, (model.num_condition_tokens, s))
    probe_engine = {**engine, "trees": None}  # one slot per front drafts no tree

    def probe(budget: ProbeBudget):
        decode_fronts(scratch_request(request), s=s, window=2, method=method, budget=budget, **probe_engine)

    fronts = measured_costs(model, key, (1,), probe, model.device)
    if fronts is None:
        return None
    overhead = max(fronts(1) - chain(1), 0.0)
    return PassCosts(chain.sizes, tuple(seconds + overhead for seconds in chain.seconds))


def decode_fronts_under(request: Request, budget, method: str, *, window: int, s: int, **engine) -> tuple[Tensor, dict]:
    """`decode_fronts` of Jacobi fronts under a budget: None, the fixed `window`; a number, that window
    per front; "auto", each pass's window per front chosen for the most expected tokens per second
    from the measured costs per row (`front_costs`) and the decode's own counts
    (`budget.FrontBudget`), falling back to `window`, said in stats["budget"], when the costs cannot
    be measured."""
    budget = check_budget(budget, method, "slots per front and pass")
    if budget != AUTO:
        fixed = window if budget is None else budget
        if fixed == 1:  # one slot per front is plain zipar: it drafts nothing for zipar-tree's trees to branch from
            engine = {**engine, "trees": None}
        tokens, stats = decode_fronts(request, s=s, window=fixed, method=method, **engine)
        return tokens, {**stats, "budget": budget if budget is not None else "fixed"}
    costs = front_costs(request, s, method, engine)
    if costs is None:
        tokens, stats = decode_fronts(request, s=s, window=window, method=method, **engine)
        return tokens, {**stats, "budget": f"fixed window {window}: the pass costs could not be measured"}
    model = request.model
    width = token_grid(model, method)[1]
    sizes = tuple(sorted({min(size, width) for size in CHAIN_SIZES}))  # a front's window ends at its row's end
    trees = engine.get("trees")
    side_rows = 0 if trees is None else trees.branch - 1
    shapes = partial(front_shapes, width=width, s=s, cross_row=engine.get("cross_row", False), side_rows=side_rows)
    controller = FrontBudget(costs, sizes, SurvivalCounts(MAX_AGE, model.device), shapes)
    return decode_fronts(request, s=s, window=max(sizes), method=method, budget=controller, **engine)
