"""Speculative Jacobi decoding with a draft tree at the head of the window: SJD-PAC and tree-mc-sjd.

Papers and upstream code the rules were checked against:
- SJD-PAC (Kang et al., CVPR 2026, arXiv 2603.18599; KangJialiang/SJD-PAC at 4fbc099,
  `scheduler/sjd_pac_iteration_lumina_mgpt.py`).
- MC-SJD / SCD (So et al., ICML 2026, arXiv 2510.24211; junhyukso/SCD): coupled carry-over.
- Recursive rejection sampling over several candidates (SpecInfer, Miao et al. 2024; SpecTr, Sun et
  al. 2023).

One pass per image: draft a tree after the committed prefix (draft_trees.py), score it in one
target pass, verify every node, commit the reached path plus one token, carry the main path's
outputs over. `tree_jacobi_decode` is the engine. docs/RASTER.md ("Draft trees") has the rules,
where the two methods differ from upstream and the randomness.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ...errors import VisarError
from ...models.base import RasterModel
from ..core.checks import check_budget, check_number
from ..core.method_registry import Request
from ..core.sampling import stream_block
from ..core.scoring import GuidedScorer
from ..core.stats import DecodeLog
from .draft_trees import (
    NEIGHBOURS,
    DraftTree,
    DraftTreeScorer,
    DraftTreeVerdict,
    draft_tree,
    tree_randomness,
    tree_uniforms,
    verify_draft_tree,
)
from .pass_loop import decode_passes, score_first_passes_apart
from .proposers import Carry, JacobiProposer, Window, maximal_coupling_carry
from .slots import SlotState


class DraftTreePlan(NamedTuple):
    """One tree pass (of the engine's one `layout`): the images still decoding, and their uniforms."""

    active: Tensor  # [B] images not done
    window: Window  # the main path's drafts for the proposer
    extra_u: Tensor  # [B, (D - 1) V] the extra candidates' uniforms (one per token: `candidate_noise`)
    test_u: Tensor  # [B, T + M + 1] the node tests' and draws' uniforms
    fresh: tuple[int, ...] = ()  # the slots whose image has its first pass now (its condition is fed)


class DraftTreePasses:
    """The tree engine's passes: a draft tree after each image's committed prefix (draft_trees.py),
    scored in one pass, every node verified, the reached path plus one token committed, the main
    path's outputs carried over (MC-SJD's coupling), `layout` the tree every pass drafts."""

    def __init__(
        self, request: Request, state: SlotState, layout: DraftTree, initialiser: Callable, neighbours: tuple[str, ...]
    ):
        model = request.model
        self.state, self.neighbours = state, neighbours
        self.device, self.total, self.vocab = model.device, model.num_image_tokens, model.vocab_size
        self.batch = batch = request.batch_size
        self.scorer = GuidedScorer.for_request(request)
        self.proposer = JacobiProposer(initialiser, Carry(maximal_coupling_carry))
        self.log = DecodeLog(batch, model.grid_size, layout.main_length, self.device)
        self.log.count_at_once = request.compile_passes is not None
        # the log's pass numbers are the state's
        state.record, state.parts = self.log, [self.scorer, self.log]  # and the proposer's (`Proposer.start`)
        self.tree_scorer = DraftTreeScorer(self.scorer, layout)
        self.layout = layout.to(self.device)
        # the reached path's columns 1 .. M past the newest committed token, made once (`commit`)
        self.path_columns = torch.arange(1, layout.main_length + 1, device=self.device)

    def __enter__(self):
        self.scorer.open_cache(self.tree_scorer.size)
        self.proposer.start(self.state)
        return self

    def __exit__(self, *exc):
        self.scorer.close_cache()

    def plan(self) -> DraftTreePlan | None:
        active = self.state.committed < self.total
        if not bool(active.any()):  # the one read-back of the loop
            return None
        window, extra_u, test_u = tree_randomness(self.state.uniforms, self.layout, active, self.vocab)
        return DraftTreePlan(active, window, extra_u, test_u, self.state.next_pass())

    def step(self, plan: DraftTreePlan):
        layout = self.layout
        drafts = draft_tree(self.proposer, self.state, plan.window, layout, self.neighbours, plan.extra_u)
        probs = self.score(plan, drafts)
        valid = plan.active[:, None] & (layout.tree.depth[None] <= (self.total - self.state.committed)[:, None])
        self.commit(plan, probs, verify_draft_tree(layout, probs, *drafts, valid, plan.test_u))

    def score(self, plan: DraftTreePlan, drafts) -> Tensor:
        state, tree_scorer = self.state, self.tree_scorer
        if not plan.fresh or len(plan.fresh) == self.batch:  # one call: every slot's first pass, or none's
            return tree_scorer.probs(state, drafts[0], len(plan.fresh) == self.batch)  # [B, T, V]
        score = lambda rows, first: tree_scorer.probs(state, drafts[0][rows], first, rows)  # noqa: E731
        return score_first_passes_apart(self.batch, plan.fresh, self.device, score)

    def commit(self, plan: DraftTreePlan, probs: Tensor, verdict: DraftTreeVerdict):
        state, layout, active, log = self.state, self.layout, plan.active, self.log
        commit_count = torch.where(active, verdict.accepted + 1, 0)  # the reached path and one token more
        # the reached path and the token after it, past each image's commit: column d at index committed - 1 + d
        index = state.committed[:, None] - 1 + self.path_columns  # [B, M]
        state.tokens.scatter_(1, index.clamp(min=0), verdict.path[:, 1:])
        node_index = state.committed[:, None] + layout.depth_less_one
        node_slot = layout.draft_slot.expand(len(active), -1)
        log.drafts(node_index, node_slot, verdict.tried & active[:, None], verdict.accept)
        log.commit(index, (self.path_columns <= commit_count[:, None]) & (index < self.total), state.passes)
        log.count_pass(active)
        # The main path's outputs past the commit are the next drafts, coupled to the old ones.
        main_probs = probs[:, layout.main]
        self.proposer.after_commit(state, plan.window, main_probs, verdict.main_outputs, commit_count, main_probs)
        state.fed = torch.where(active, state.committed + verdict.main_reached, state.fed)
        state.committed = (state.committed + commit_count).clamp(max=self.total)
        self.scorer.truncate_cache(self.tree_scorer.num_cond + state.fed)

    def stats(self) -> dict:
        layout = self.layout
        shape = {"window": layout.num_nodes, "branch": layout.branch, "depth": layout.depth}
        return {**self.log.stats(self.scorer.forward_passes), **shape, "rows_per_pass": layout.num_nodes}


def tree_jacobi_decode(
    request: Request, layout: DraftTree, initialiser: Callable, neighbours: tuple[str, ...], budget, method: str
) -> tuple[Tensor, dict]:
    """Propose a tree, score it in one pass, verify every node, commit, carry over, pass after pass
    (`DraftTreePasses` on the pass loop): the tree `layout`, or under a number budget the tree of that
    many nodes. -> (tokens [B, N], stats)."""
    if check_budget(budget, method) is not None:
        layout = check_tree(request.model, check_tree_budget(budget, layout, method), layout.branch, layout.depth)
    main_len, block = layout.main_length, stream_block(tree_uniforms(layout, request.model.vocab_size))
    # each pass's uniforms, the same numbers as a draw per pass, drawn up to 16 passes at a time
    state = SlotState(request, window=main_len, spare=main_len + 1, keyed=True, block=block, tracks_fed=True)
    engine = DraftTreePasses(request, state, layout, initialiser, neighbours)
    tokens, stats = decode_passes(engine, state, request, "tree")
    return tokens, {**stats, "budget": budget or "fixed"}


def check_tree_budget(budget: int, layout: DraftTree, method: str) -> int:
    """A number budget is the tree's window: it must hold the root and every branching node (and one
    draft), else one VisarError that names the budget, not the window the user did not set."""
    least = max(2, sum(layout.branch**d for d in range(layout.depth)))
    if budget < least:
        raise VisarError(
            f"budget for {method} is the tree's nodes per pass: a tree of branch {layout.branch} and depth "
            f"{layout.depth} needs {least} or more, got {budget}"
        )
    return budget


def parse_neighbours(neighbours: str) -> tuple[str, ...]:
    """ "left,above" -> ("left", "above"), or one VisarError naming the unknown neighbour."""
    if not isinstance(neighbours, str):
        raise VisarError(f"neighbours must be a comma-separated string such as 'left,above', got {neighbours!r}")
    names = tuple(n.strip() for n in neighbours.split(",") if n.strip())
    unknown = [n for n in names if n not in NEIGHBOURS]
    if unknown:
        raise VisarError(f"unknown neighbour {unknown[0]!r}; use a comma-separated list of {', '.join(NEIGHBOURS)}")
    return names


def clip_branch(branch: int, model: RasterModel) -> int:
    """Candidates per branching position: `branch`, at most the vocabulary's size (candidates are
    distinct tokens), so a default runs on a model of any vocabulary (tree-mc-sjd, zipar-tree)."""
    check_number("branch", branch, 1, integer=True)
    return min(branch, model.vocab_size)


def check_tree(model: RasterModel, window: int, branch: int, depth: int) -> DraftTree:
    """The draft tree of these options, or one clear VisarError (before any model call). Its branch
    is clipped to the vocabulary (`clip_branch`), a main path longer than the image to the image
    (its extra nodes could only be padding)."""
    layout = DraftTree.build(window, clip_branch(branch, model), depth)
    branch = layout.branch
    if depth - 1 > model.num_image_tokens:
        raise VisarError(f"depth {depth} branches past the image's {model.num_image_tokens} tokens: lower depth")
    longest = layout.num_nodes - layout.main_length + model.num_image_tokens + 1  # main path: root + N drafts
    return DraftTree.build(longest, branch, depth) if window > longest else layout
