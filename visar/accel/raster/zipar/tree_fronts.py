"""zipar-tree: tree-mc-sjd's depth-2 draft tree at the head of every Jacobi front.

The index each front's slot 0 predicts gets K candidates (its draft, then known neighbours and
draws without replacement from the draft's law); each other candidate sits in a side node, an
input at slot 1's position with its own scratch cache slot, and slot 0's p tests the candidates
in order against tree_acceptance's residual ladder (recursive rejection). docs/RASTER.md (ZipAR
section, "Tree fronts") says why a taken side candidate ends the front's commit and how its
true cache slot is fed again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ...core.candidates import without_replacement
from ...core.sampling import sample_from_probs
from ...core.scoring import GuidedScorer
from ...core.tree_acceptance import residual_ladder
from ..draft_trees import neighbour_candidates
from .plan import PassContext, PassPlan, pass_inputs, visibility


class FrontTrees:
    """tree-mc-sjd's depth-2 tree at every front: K candidates for the index its slot 0 predicts.

    branch: K; neighbours: the known neighbours tried first ("left", "above", ...); vocab: V, the
    uniforms of each front's extra candidates' keys (`candidates.ranked_candidates`); side_taken [B]
    counts the passes in which a front of each image took a side candidate (k >= 1). Between
    passes it holds which committed tokens wait to be fed again (`refeed`, [B, H] image index or
    -1): a taken side candidate's true cache slot holds candidate 0's KV, so the next pass feeds it
    there again, before any query reads it.
    """

    def __init__(self, branch: int, neighbours: tuple[str, ...], batch: int, height: int, device, vocab: int):
        self.branch, self.neighbours, self.vocab, self.height = branch, neighbours, vocab, height
        self.side_taken = torch.zeros(batch, dtype=torch.long, device=device)
        self.refeed = torch.full((batch, height), -1, dtype=torch.long, device=device)
        self.refeed_width = 0  # the most tokens any image feeds again this pass (`refeed_most`, read by the plan)

    def refeed_most(self) -> Tensor:
        """The most tokens any image waits to feed again (0-d)."""
        return (self.refeed >= 0).sum(1).max()

    def scratch(self) -> int:
        """Cache slots past the image: K - 1 side nodes per front (every row a front at most), then
        one trash slot for the padding of re-fed tokens."""
        return self.height * (self.branch - 1) + 1

    def extend(
        self, plan: PassPlan, valid: Tensor, commits: Tensor, count: Tensor, width: int, side: Tensor | None
    ) -> Tensor:
        """Commits [B, H] with one token more where a front took a side candidate (side [B, H], None
        when no front had a tree) and its slot 1's context held (the side node saw the same); the
        tokens this pass fed again are done, and those extra tokens wait for the next pass's re-feed."""
        if side is None:
            self.refeed = torch.full_like(self.refeed, -1)
            return commits
        self.side_taken += side.sum(1)
        slot1 = torch.zeros_like(commits, dtype=torch.bool).scatter_reduce(
            1, plan.row, valid & (plan.slot == 1), reduce="amax"
        )
        extended = side & (commits == 1) & slot1
        rows = torch.arange(commits.shape[1], device=commits.device)
        self.refeed = torch.where(extended, rows * width + count, -1)
        return commits + extended.long()

    def draws_per_pass(self) -> int:
        """The uniforms an image draws a pass for its trees: each row's extra candidates' keys (V), tests
        (K - 1) and draws (2: after the last rejection, at the side node)."""
        return self.height * (self.vocab + self.branch + 1)


@dataclass
class SideNodes:
    """The side nodes of one pass: candidates 1 .. K - 1 of every front with a tree, packed per image."""

    has_tree: Tensor  # [B, H] the front's slot 0 has a draft (so a slot 1 predicts the next index)
    first_input: Tensor  # [B, H] packed input of the row's slot 0
    start: Tensor  # [B, H] the row's first side node
    row: Tensor  # [B, S]
    rank: Tensor  # [B, S] the candidate it holds, 1 .. K - 1 (0 for padding)
    real: Tensor  # [B, S] bool, False for padding


def side_nodes(plan: PassPlan, branch: int) -> SideNodes:
    """K - 1 side nodes for every front whose slot 0 has a draft, packed row by row as plan_pass packs inputs."""
    inputs = plan.window_len + plan.feed_only.long()
    has_tree = plan.window_len >= 2
    per_row = has_tree.long() * (branch - 1)
    ends = per_row.cumsum(1)
    size = plan.drafting_fronts * (branch - 1)  # the most side inputs of any image (read with the plan)
    batch, height = per_row.shape
    m = torch.arange(size, device=ends.device).expand(batch, -1).contiguous()
    row = torch.searchsorted(ends, m, right=True)
    real = row < height
    row = row.clamp(max=height - 1)
    start = ends - per_row
    rank = torch.where(real, m - start.gather(1, row) + 1, 0)
    return SideNodes(has_tree, inputs.cumsum(1) - inputs, start, row, rank, real)


def front_candidates(
    trees: FrontTrees, plan: PassPlan, sides: SideNodes, drafts: Tensor, draft_q: Tensor, canvas, width, uniforms
) -> tuple[Tensor, Tensor]:
    """K candidates for the index each front's slot 0 predicts: its draft (carried or initialised),
    then tree-mc-sjd's extra candidates (`without_replacement`, known neighbours first).
    drafts [B, M], draft_q [B, M, V]; uniforms [B, H, V] -> tokens [B, H, K], laws [B, H, K, V]."""
    first = sides.first_input.clamp(max=plan.slot.shape[1] - 1)  # rows without inputs: any column
    base = draft_q.gather(1, first[..., None].expand(-1, -1, draft_q.shape[-1]))
    fixed = None
    if trees.neighbours:
        index = (plan.input_index + 1).gather(1, first).clamp(max=canvas.shape[1] - 2)  # rows without trees: unread
        fixed = neighbour_candidates(canvas, index, width, trees.neighbours)
    return without_replacement(base, drafts.gather(1, first), trees.branch, uniforms, fixed)


class TreeDraft(NamedTuple):
    """One pass's trees (`draft_trees`): what the side nodes feed and what verifying the candidates reads."""

    sides: SideNodes
    candidates: Tensor | None  # [B, H, K] each front's candidates (None: no front drafts this pass)
    laws: Tensor | None  # [B, H, K, V] the law each was drawn from
    side_tokens: Tensor  # [B, S] the candidate each side node feeds
    uniforms: Tensor  # [B, H, V + K + 1] the trees' block: the extra candidates' keys, the tests, the draws


def draft_trees(
    trees: FrontTrees, plan: PassPlan, drafts, draft_q, canvas: Callable[[], Tensor], width: int, uniforms: Tensor
) -> TreeDraft:
    """The candidates of every front whose slot 0 has a draft (`front_candidates`) and the side nodes
    that feed candidates 1 .. K - 1. drafts [B, M], draft_q [B, M, V] (None when no front drafts);
    canvas() -> what a known neighbour is copied from (made only when some front drafts)."""
    sides = side_nodes(plan, trees.branch)
    if sides.row.shape[1] == 0:
        return TreeDraft(sides, None, None, torch.zeros_like(sides.row), uniforms)
    candidates, laws = front_candidates(
        trees, plan, sides, drafts, draft_q, canvas(), width, uniforms[..., : trees.vocab]
    )
    side_tokens = candidates.flatten(1).gather(1, sides.row * trees.branch + sides.rank)
    return TreeDraft(sides, candidates, laws, side_tokens, uniforms)


def score_with_sides(
    scorer: GuidedScorer, trees: FrontTrees, plan: PassPlan, context: PassContext, drafts, tree: TreeDraft
) -> tuple[Tensor, Tensor]:
    """One pass over every front's inputs, the side nodes and the re-fed tokens (`FrontTrees.refeed`,
    `refeed_width` of them at most) -> p [B, M, V], side p [B, S, V].

    A side node stands in for its front's slot 1 (the same position and view) with its candidate
    in place of the front's draft: it sees its own scratch slot instead of that draft's slot. A
    re-fed token (refeed [B, H], image index or -1) is fed at its true slot, seeing what a row's
    newest token sees when it is fed (the tokens generated before it).
    """
    tokens, generated, sides = context.tokens, context.generated, tree.sides
    scratch = trees.scratch()
    num_cond, num_tokens, device = scorer.model.num_condition_tokens, generated.shape[1], generated.device
    batch, num_inputs, num_sides = plan.slot.shape[0], plan.slot.shape[1], sides.row.shape[1]
    feed = pass_inputs(plan, tokens, drafts)
    visible = visibility(plan, generated, context.s)  # [B, M, N]
    slots = torch.arange(num_tokens, device=device)
    twin = (sides.first_input + 1).gather(1, sides.row).clamp(max=num_inputs - 1)  # [B, S] its slot 1
    side_index = torch.where(sides.real, plan.input_index.gather(1, twin), num_tokens - 1)
    side_visible = visible.gather(1, twin[..., None].expand(-1, -1, num_tokens))
    side_visible &= (slots != side_index[..., None]) & sides.real[..., None]
    pending = trees.refeed.sort(1, descending=True).values[:, : trees.refeed_width]  # [B, R]
    again, index = pending >= 0, pending.clamp(min=0)
    earlier = (slots <= index[..., None]) & generated[:, None]  # [B, R, N]
    again_visible = (earlier | (slots == index[..., None])) & again[..., None]
    own = torch.arange(scratch, device=device) == torch.arange(num_sides, device=device)[:, None]  # [S, scratch]
    scratch_visible = torch.zeros(
        batch, num_inputs + num_sides + pending.shape[1], scratch, dtype=torch.bool, device=device
    )
    scratch_visible[:, num_inputs : num_inputs + num_sides] = own
    condition = torch.ones(*scratch_visible.shape[:2], num_cond, dtype=torch.bool, device=device)
    mask = torch.cat([condition, torch.cat([visible, side_visible, again_visible], 1), scratch_visible], -1)
    input_pos = num_cond + torch.cat([plan.input_index, side_index, index], 1)
    side_slots = (num_cond + num_tokens + torch.arange(num_sides, device=device)).expand(batch, -1)
    trash = num_cond + num_tokens + scratch - 1
    cache_pos = torch.cat([input_pos[:, :num_inputs], side_slots, torch.where(again, num_cond + index, trash)], 1)
    fed = torch.cat([feed, tree.side_tokens, tokens.gather(1, index)], 1)
    probs = scorer.target_probs(scorer.logits(fed, input_pos, mask=mask, cache_pos=cache_pos))
    return probs[:, :num_inputs], probs[:, num_inputs : num_inputs + num_sides]


def verify_candidates(
    probs: Tensor, candidates: Tensor, laws: Tensor, first_accepted: Tensor, uniforms: Tensor
) -> tuple[Tensor, Tensor]:
    """Recursive rejection over each front's K candidates (tree_acceptance's residual ladder).

    probs [B, H, V] p of the index slot 0 predicts; candidates [B, H, K], laws [B, H, K, V];
    first_accepted [B, H] candidate 0's test (the front's own, made by its acceptance rule);
    uniforms [B, H, K]: the tests of candidates 1 .. K - 1, then the draw after the last rejection.
    -> taken [B, H] (the first accepted candidate, K if none), token [B, H] (the committed one).
    """
    branch = candidates.shape[-1]
    ladder = residual_ladder(probs, laws)  # [B, H, K + 1, V]
    x = candidates[..., None]
    passed = (
        uniforms[..., : branch - 1] * laws[:, :, 1:].gather(-1, x[:, :, 1:])[..., 0]
        < (ladder[:, :, 1:branch].gather(-1, x[:, :, 1:])[..., 0])
    )
    passed = torch.cat([first_accepted[..., None], passed], -1)
    taken = torch.where(passed.any(-1), passed.long().argmax(-1), branch)
    final = sample_from_probs(ladder[:, :, branch], uniforms[..., branch - 1])
    token = torch.where(taken < branch, candidates.gather(-1, taken.clamp(max=branch - 1)[..., None])[..., 0], final)
    return taken, token


def verify_trees(
    trees: FrontTrees, plan: PassPlan, tree: TreeDraft, probs, side_probs, slot_tokens, accept
) -> tuple[Tensor, Tensor]:
    """Each drafting front's K candidates against its slot 0's p, by recursive rejection
    (`verify_candidates`; candidate 0's test is the front's own: accept [B, M]) -> slot tokens [B, M],
    side [B, H] (the fronts that took a side candidate). probs [B, M, V], side_probs [B, S, V]: the
    pass's scores; slot_tokens [B, M]: the fronts' outputs (`front_outputs`).

    Slot 0 outputs the taken candidate (or the draw after the last rejection). A taken side candidate
    counts as a rejection of slot 0's draft, since slot 1 and the rows below saw candidate 0; slot 1
    outputs a draw from the side node's p instead, which `FrontTrees.extend` commits when slot 1's
    context held.
    """
    sides, tree_u = tree.sides, tree.uniforms
    branch, vocab, num_inputs = trees.branch, probs.shape[-1], plan.slot.shape[1]
    first = sides.first_input.clamp(max=num_inputs - 1)
    first_probs = probs.gather(1, first[..., None].expand(-1, -1, vocab))
    taken, token = verify_candidates(
        first_probs, tree.candidates, tree.laws, accept.gather(1, first), tree_u[..., trees.vocab : -1]
    )
    side = sides.has_tree & (taken >= 1) & (taken < branch)
    side_at = (sides.start + taken - 1).clamp(0, sides.row.shape[1] - 1)
    side_law = side_probs.gather(1, side_at[..., None].expand(-1, -1, vocab))  # [B, H, V]
    side_draw = sample_from_probs(side_law, tree_u[..., -1])
    in_tree = sides.has_tree.gather(1, plan.row) & plan.real
    at_side = in_tree & (plan.slot == 1) & side.gather(1, plan.row)
    slot_tokens = torch.where(in_tree & (plan.slot == 0), token.gather(1, plan.row), slot_tokens)
    slot_tokens = torch.where(at_side, side_draw.gather(1, plan.row), slot_tokens)
    return slot_tokens, side
