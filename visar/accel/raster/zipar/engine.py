"""`decode_fronts`: every row front of every image, pass after pass (plan, draft, score, verify,
commit, carry over); window 1 is plain zipar, a longer window Jacobi fronts (their drafts carried
by `carried.CarriedDrafts`), and with `FrontTrees` each front also drafts a tree at its head.
docs/RASTER.md (ZipAR section) has the rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ....models.base import RasterModel
from ....models.lag_mask import check_lag
from ...core.acceptance import SPECULATIVE, AcceptanceRule
from ...core.checks import check_number
from ...core.method_registry import Request
from ...core.sampling import sample_from_probs, stream_block
from ...core.scoring import GuidedScorer
from ..chain import check_spans
from ..drafts import random_init
from ..pass_loop import decode_passes, power_of_two
from ..proposers import CARRY, DRAFT, FRESH_DRAWS, NUM_PURPOSES, RESIDUAL, Carry
from ..slots import SlotState
from .carried import CarriedDrafts
from .plan import (
    GridIndex,
    PassContext,
    PassPlan,
    fed_after_pass,
    front_outputs,
    generated_mask,
    grid_index,
    pass_inputs,
    plan_pass,
    token_grid,
    valid_commits,
    visibility,
)
from .record import FrontRecord
from .tree_fronts import FrontTrees, TreeDraft, draft_trees, score_with_sides, verify_trees


def pass_uniforms(block: Tensor, plan: PassPlan, window: int) -> Tensor:
    """Jacobi fronts: each image's block [4, H, window] for this pass (block [B, 4 * H * window], taken
    from its uniform stream), read at (purpose, row, slot) of every input -> [B, 4, M]."""
    block = block.view(plan.row.shape[0], NUM_PURPOSES, -1)
    lane = (plan.row * window + plan.slot.clamp(max=window - 1))[:, None].expand(-1, NUM_PURPOSES, -1)
    return block.gather(2, lane)


def score_fronts(scorer: GuidedScorer, plan: PassPlan, context: PassContext, drafts) -> Tensor:
    """One pass over every front's inputs -> target probs [B, M, V]."""
    feed = pass_inputs(plan, context.tokens, drafts)
    visible = visibility(plan, context.generated, context.s, context.index)  # [B, M, N]
    num_cond = scorer.model.num_condition_tokens
    mask = F.pad(visible, (num_cond, 0), value=True)  # every input sees the condition
    return scorer.target_probs(scorer.logits(feed, num_cond + plan.input_index, mask=mask))


@dataclass
class Fronts:
    """What a decode of row fronts carries from pass to pass beside the slot state (whose tokens are
    [B, N + 1] by image index, column N scratch for writes that go nowhere, and whose first uniforms
    are plain fronts' draws by image index, token i's uniform i, or Jacobi fronts' first block)."""

    count: Tensor  # [B, H] generated tokens of each row
    fed: Tensor  # [B, H] of those, how many have their KV cached
    index: GridIndex  # the grid's index tensors
    carried: CarriedDrafts | None  # Jacobi fronts: the drafts of earlier passes

    @classmethod
    def start(cls, model: RasterModel, batch: int, window: int) -> Fronts:
        """window: slots per front (1: plain fronts)."""
        height, num_tokens, device = model.grid_size[0], model.num_image_tokens, model.device
        carried = CarriedDrafts(batch, num_tokens, model.vocab_size, device) if window > 1 else None
        count = torch.zeros(batch, height, dtype=torch.long, device=device)
        return cls(count, torch.zeros_like(count), grid_index(tuple(model.grid_size), device), carried)


def front_block(height: int, window: int) -> int:
    """The uniforms a pass of Jacobi fronts takes for its fronts, per image: [4, H, window] (the first
    pass's too, so an admitted image's token 0 is that block's residual draw of row 0, slot 0)."""
    return NUM_PURPOSES * height * window


def take_blocks(state: SlotState, per_pass: int, trees: FrontTrees | None, first: bool) -> tuple[Tensor, Tensor | None]:
    """Jacobi fronts: this pass's blocks of each image's uniforms, the fronts' [B, 4 * H * window], then
    the trees' (None without trees). The decode's first pass takes each image's first uniforms, which
    an image admitted later draws for its first pass too (`first_draws`: the same two blocks)."""
    if first:
        return state.first_uniforms[:, :per_pass], None if trees is None else state.first_uniforms[:, per_pass:]
    block = state.uniforms.take(per_pass)  # then the trees', as drawn
    return block, None if trees is None else state.uniforms.take(trees.draws_per_pass())


class PassDraft(NamedTuple):
    """This pass's drafts and randomness (`pass_drafts`)."""

    tokens: Tensor | None  # [B, M] every slot's draft (None: plain fronts, or no slot has one)
    probs: Tensor | None  # [B, M, V] the law each was drawn from
    uniforms: Tensor | None  # [B, 4, M] Jacobi fronts' block (None for plain fronts)
    draws: Tensor  # [B, M] each slot's draw: ar.py's uniform of its index (plain fronts), else the residual's
    tree: TreeDraft | None  # zipar-tree's candidates and side nodes (None without trees, and in the first pass)


def pass_drafts(state: SlotState, fronts: Fronts, front_plan: FrontPlan, initialiser, window: int, trees) -> PassDraft:
    """This pass's randomness, drafts and trees."""
    plan, generated = front_plan.plan, front_plan.context.generated
    if fronts.carried is None:  # ar.py's draws by image index (`first_draws=N + 1`; N: padding's)
        return PassDraft(None, None, None, state.first_uniforms.gather(1, plan.input_index + 1), None)
    height = fronts.count.shape[1]
    block, tree_block = front_plan.blocks
    uniforms = pass_uniforms(block, plan, window)
    draft_tokens = draft_probs = tree = None
    if plan.drafts:  # a pass of one slot per front has no drafts
        draft_tokens, draft_probs = fronts.carried.propose(plan, state, generated, initialiser, uniforms[:, DRAFT])
    if trees is not None and not front_plan.first:  # the first pass is the prefill alone
        canvas = partial(fronts.carried.canvas, state, generated)
        tree_u = tree_block.view(tree_block.shape[0], height, -1)
        tree = draft_trees(trees, plan, draft_tokens, draft_probs, canvas, fronts.index.width, tree_u)
    return PassDraft(draft_tokens, draft_probs, uniforms, uniforms[:, RESIDUAL], tree)


class FrontScores(NamedTuple):
    """One pass's target laws (`FrontPasses.score`)."""

    probs: Tensor  # [B, M, V] p at every input (the first pass: [B, 1, V], token 0's)
    side_probs: Tensor | None = None  # [B, S, V] p at zipar-tree's side nodes (None without a tree)


class FrontVerdict(NamedTuple):
    """One pass's verification (`FrontPasses.verify`)."""

    slot_tokens: Tensor  # [B, M] every predicting slot's output
    accept: Tensor | None  # [B, M] its draft passed the test (None when no slot had a draft)
    side: Tensor | None  # [B, H] zipar-tree: the front took a side candidate (None when no front had a tree)


def commit_fronts(
    state: SlotState, fronts: Fronts, plan: PassPlan, verdict: FrontVerdict, log: FrontRecord, trees
) -> tuple[Tensor, Tensor]:
    """Write each front's commit (its leading accepted drafts and one token more) into the tokens
    and the record -> commits [B, H] and each input's front's commits [B, M]. trees: the fronts' trees or None."""
    count, num_tokens = fronts.count, state.num_tokens
    width = num_tokens // count.shape[1]
    valid, commits, good = valid_commits(plan, verdict.accept, count)
    extended = commits  # a taken side candidate commits its side node's draw too
    if trees is not None:
        extended = trees.extend(plan, valid, commits, count, width, verdict.side)
    log.write(count, extended, commits, good, plan.window_len)
    lane_commits = extended.gather(1, plan.row)
    skip = plan.slot >= lane_commits  # a front commits at most its window: every slot kept predicts
    state.tokens.scatter_(1, (plan.input_index + 1).masked_fill(skip, num_tokens), verdict.slot_tokens)
    return extended, lane_commits


class FrontPlan(NamedTuple):
    """One pass of row fronts: its window per front, the plan, and what its inputs are fed and see."""

    first: bool  # the condition's prefill, which predicts token 0
    plan: PassPlan
    context: PassContext  # the tokens generated before this pass, the lag, the grid's index
    # Jacobi fronts: this pass's blocks of each image's uniform stream, the fronts' [B, 4 * H * window]
    # and the trees' [B, H * (V + K + 1)] (None without trees), taken by the plan: drawing a new block
    # from the generators would break a compiled pass's graph
    blocks: tuple[Tensor, Tensor | None] | None = None


@dataclass(frozen=True)
class FrontSettings:
    """What a decode of row fronts is, fixed for the decode (`decode_fronts`' options; the defaults
    are plain zipar's)."""

    method: str  # the method's name, for the progress bar and errors
    s: int  # the lag: row r + 1 starts once row r has s tokens
    window: int = 1  # slots per front and pass (1: plain fronts)
    initialiser: Callable = random_init  # new drafts (drafts.INITIALISERS)
    carry: Carry = FRESH_DRAWS  # how drafts are carried to the next pass
    rule: AcceptanceRule = SPECULATIVE
    # Jacobi fronts: a front may also predict past its plain reach from the drafts the row above feeds
    # in the same pass (kept only if those drafts are accepted)
    cross_row: bool = False
    trees: FrontTrees | None = None  # zipar-tree's K candidates for each front's first draft (tree_fronts.py)
    start_lag: int | None = None  # tokens of the row above before a row's first (None: s; PJD's pair; `plan_pass`)


class FrontPasses:
    """All row fronts of every image, pass after pass, as `FrontSettings` says. A running batch's new
    image has its first pass at the head of the next pass (`start_fresh`)."""

    def __init__(self, request: Request, state: SlotState, settings: FrontSettings):
        model = request.model
        self.state, self.s, self.grid = state, settings.s, state.grid_size
        self.window, self.speculative = min(settings.window, self.grid[1]), settings.window > 1
        self.initialiser, self.carry, self.rule = settings.initialiser, settings.carry, settings.rule
        self.cross_row, self.trees, self.start_lag = settings.cross_row, settings.trees, settings.start_lag
        self.total, self.batch = model.num_image_tokens, request.batch_size
        self.fronts = Fronts.start(model, self.batch, self.window)
        self.per_pass = front_block(self.grid[0], self.window)
        self.scorer = GuidedScorer.for_request(request)
        self.log = FrontRecord(self.batch, self.grid, self.window, model.device)
        state.record = self.log
        state.parts = [self.scorer, self.carry]
        state.per_slot(0, self.fronts, "count", "fed")  # a new image: no token, no draft, no side taken
        if self.fronts.carried is not None:  # their packed laws go unread once no draft is carried
            state.per_slot(0, self.fronts.carried, "tokens", "valid", "entry")
        if self.trees is not None:
            state.per_slot(-1, self.trees, "refeed")
            state.count_per_image("side_taken", self.trees, "side_taken")
        scratch = 0 if self.trees is None else self.trees.scratch()
        self.cache_length = model.num_condition_tokens + self.total + scratch
        # compiled passes (`request.compile_passes`) are padded to a few shapes (`plan_pass`'s round_up)
        self.compiled = request.compile_passes is not None

    def __enter__(self):
        self.scorer.open_cache(self.cache_length)
        return self

    def __exit__(self, *exc):
        self.scorer.close_cache()

    def plan(self) -> FrontPlan | None:
        state, fronts = self.state, self.fronts
        first = state.passes == 0  # the decode's first pass: every slot's prefill, a pass of its own
        if state.fresh and not first:
            self.start_fresh()
        cross_row = self.cross_row and not first
        # what the pass needs to know on the host, read with its shape: the carried laws' K, the
        # trees' tokens to feed again
        also_read = () if fronts.carried is None else (fronts.carried.live_most(),)
        if self.trees is not None:
            also_read += (self.trees.refeed_most(),)
        window = 1 if first else self.window
        plan = plan_pass(
            fronts.count,
            fronts.fed,
            self.grid,
            self.s,
            window,
            cross_row,
            fronts.index,
            also_read,
            self.compiled,
            start_lag=self.start_lag,
        )
        if plan.row.shape[1] == 0:
            return None
        if fronts.carried is not None:
            fronts.carried.pack(plan.read[0])
        if self.trees is not None:
            self.trees.refeed_width = power_of_two(plan.read[-1]) if self.compiled else plan.read[-1]
        state.next_pass()
        self.log.reserve(state.passes)
        generated = generated_mask(fronts.count, self.grid[1], fronts.index)
        context = PassContext(state.tokens, generated, self.s, fronts.index)
        blocks = None if fronts.carried is None else take_blocks(state, self.per_pass, self.trees, first)
        return FrontPlan(first, plan, context, blocks)

    def step(self, plan: FrontPlan):
        draft = pass_drafts(self.state, self.fronts, plan, self.initialiser, self.window, self.trees)
        scores = self.score(plan, draft)
        self.commit(plan, draft, scores, self.verify(plan, draft, scores))

    def score(self, plan: FrontPlan, draft: PassDraft) -> FrontScores:
        """The target laws of every input, and of zipar-tree's side nodes (scored in the same call)."""
        if plan.first:  # the condition's prefill, which predicts token 0
            return FrontScores(self.scorer.prefill()[:, None])
        if draft.tree is None:
            return FrontScores(score_fronts(self.scorer, plan.plan, plan.context, draft.tokens))
        probs, side_probs = score_with_sides(self.scorer, self.trees, plan.plan, plan.context, draft.tokens, draft.tree)
        return FrontScores(probs, side_probs)

    def verify(self, plan: FrontPlan, draft: PassDraft, scores: FrontScores) -> FrontVerdict:
        """Every predicting slot's test and output, then each front's tree candidates (`verify_trees`)."""
        slot_tokens, accept = front_outputs(self.rule, plan.plan, scores.probs, draft)
        if draft.tree is None or draft.tree.candidates is None:  # no front has a tree this pass
            return FrontVerdict(slot_tokens, accept, None)
        probs, side_probs = scores
        slot_tokens, side = verify_trees(self.trees, plan.plan, draft.tree, probs, side_probs, slot_tokens, accept)
        return FrontVerdict(slot_tokens, accept, side)

    def commit(self, plan: FrontPlan, draft: PassDraft, scores: FrontScores, verdict: FrontVerdict):
        state, fronts, width = self.state, self.fronts, self.grid[1]
        count = fronts.count
        commits, lane_commits = commit_fronts(state, fronts, plan.plan, verdict, self.log, self.trees)
        # The slots after a front's commit become drafts for the same indices.
        if self.speculative:
            after_pass = generated_mask(count + commits, width, fronts.index)
            outputs = (scores.probs, verdict.slot_tokens, lane_commits, draft.uniforms[:, CARRY])
            fronts.carried.carry_over(self.carry.draw, plan.plan, state, *outputs, after_pass)
        fronts.fed = fed_after_pass(plan.plan, fronts.fed, count, commits)
        fronts.count = count + commits
        state.committed = fronts.count.sum(1)

    def start_fresh(self):
        """The first pass of the images admitted since the last pass (the condition's prefill, which
        predicts token 0), for their slots alone, at the head of the next pass: one model call more
        in that pass, but no pass of the others' that a new image would idle in. That pass then goes
        on with their next tokens, as a decode of each image alone does in its second pass (so their
        statistics count this first pass apart: `FrontRecord.image_commits`' admitted). Token 0's
        uniform is the one the first pass of the image's decode alone draws it with (`first_draws`)."""
        state = self.state
        index = torch.tensor(state.fresh, device=state.device)
        column = 0 if self.fronts.carried is None else RESIDUAL * self.per_pass // NUM_PURPOSES  # row 0, slot 0
        state.tokens[index, 0] = sample_from_probs(self.scorer.prefill(index), state.first_uniforms[index, column])
        self.fronts.count[index, 0] = 1
        state.committed[index] = 1

    def stats(self) -> dict:
        stats = self.log.stats(self.scorer.forward_passes)
        stats.update(s=self.s, max_fronts=self.log.max_fronts())
        if self.start_lag is not None:
            stats.update(start_lag=self.start_lag)
        if self.speculative:
            stats.update(window=self.window, cross_row=self.cross_row)
        return stats


def decode_fronts(request: Request, settings: FrontSettings) -> tuple[Tensor, dict]:
    """Decode all row fronts of every image together, pass after pass (`FrontPasses` on the pass
    loop), as `settings` says. -> (tokens [B, N], stats)."""
    model, window, start_lag, trees = request.model, settings.window, settings.start_lag, settings.trees
    grid = token_grid(model, settings.method)
    check_lag(settings.s)
    check_number(
        "start_lag (tokens of the row above before a row's first; None: s)", start_lag, 1, integer=True, allow_none=True
    )
    check_spans(window, 0, 0)
    clipped = min(window, grid[1])
    if window == 1:  # ar.py's draws: token i's uniform i of each image (N: the padding's)
        first_draws, block = model.num_image_tokens + 1, 1
    else:  # a pass's blocks (the first pass's drawn first), drawn up to 16 of the largest passes at a time
        first_draws = front_block(grid[0], clipped) + (0 if trees is None else trees.draws_per_pass())
        block = stream_block(first_draws)
    # the state's window is N: one pass spans up to the whole grid
    num_tokens = model.num_image_tokens
    state = SlotState(request, window=num_tokens, spare=1, keyed=window > 1, first_draws=first_draws, block=block)
    return decode_passes(FrontPasses(request, state, settings), state, request, settings.method)
