"""Static-tree speculative decoding: a draft model proposes a fixed-shape tree, the target verifies it in one pass.

Papers and upstream code:
- EAGLE-1 static trees and their recursive rejection sampling (Li et al. 2024; SpecInfer, Miao
  et al. 2024). Lossless.
- LANTERN++ (Jang, Park et al., ICLR-W SCOPE 2025, arXiv 2502.06352; jadohu/LANTERN,
  `models/ea_model_llamagen.py::evaluate_posterior_v1`, `--static_tree`), whose default tree
  `naive_extend_57` (57 nodes, depth 5, from `models/drafters/choices.py`) is the default here.

Tree nodes are written to scratch cache slots past the image (`CacheSlots`; RoPE keeps their true
positions) and the accepted path is fed again at its true slots next pass. docs/RASTER.md
("Static draft trees") has the iteration and the KV cache design.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ...errors import VisarError
from ...models.base import RasterModel
from ..core.method_registry import Request
from ..core.sampling import sample_from_probs
from ..core.scoring import GuidedScorer
from ..core.stats import DecodeLog
from ..core.tree_acceptance import TreeIndex, verify_tree
from .pass_loop import decode_passes
from .slots import SlotState

# Each path lists child ranks from the root: [0] is the root's first child, [0, 1] that child's second.
NAIVE_EXTEND_57 = (
    [[r] for r in range(5)]
    + [[0, r] for r in range(4)] + [[1, r] for r in range(3)] + [[2, r] for r in range(3)] + [[3, 0], [3, 1], [4, 0]]
    + [[0, 0, r] for r in range(4)] + [[0, 1, r] for r in range(3)] + [[0, 2, r] for r in range(3)]
    + [[0, 3, 0], [0, 3, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0], [2, 0, 0]]
    + [[0, 0, 0, r] for r in range(4)] + [[0, 0, 1, r] for r in range(3)] + [[0, 0, 2, 0], [0, 0, 2, 1], [0, 0, 3, 0]]
    + [[0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0], [0, 2, 0, 0]]
    + [[0, 0, 0, 0, r] for r in range(3)] + [[0, 0, 0, 1, 0], [0, 0, 0, 1, 1], [0, 0, 1, 0, 0], [0, 0, 1, 0, 1]]
    + [[0, 0, 1, 1, 0], [0, 0, 2, 0, 0]]
)  # fmt: skip
TREES = {"naive_extend_57": NAIVE_EXTEND_57, "chain5": [[0] * d for d in range(1, 6)]}


@dataclass(frozen=True)
class StaticTree:
    """Node 0 is the root (the last committed token); nodes 1..T are sorted by depth, then path."""

    paths: tuple[tuple[int, ...], ...]  # [T] child-rank paths of nodes 1..T
    parent: Tensor  # [T + 1] parent id (-1 for the root)
    depth: Tensor  # [T + 1]
    children: Tensor  # [T + 1, C] child ids in rank order, -1 padded
    ancestors: Tensor  # [T + 1, T + 1] bool: column j is node i itself or one of its ancestors

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return len(self.paths[-1])  # sorted by depth: the last path is a deepest (no read of `depth`)

    def verify_index(self) -> TreeIndex:
        """The index tensors `tree_acceptance.verify_tree` reads (made once per tree)."""
        return TreeIndex.build(self.parent.tolist(), [0] + [p[-1] for p in self.paths])

    @classmethod
    def from_paths(cls, paths) -> StaticTree:
        """Paths of child ranks, e.g. [[0], [1], [0, 0]]: every parent present, sibling ranks 0, 1, ..."""
        try:
            paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        except (TypeError, ValueError, OverflowError) as err:
            raise VisarError(f"a draft tree is a list of paths of child ranks, e.g. [[0], [1], [0, 0]]: {err}") from err
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise VisarError("a draft tree needs at least one node, and paths of ranks >= 0 (the root is implicit)")
        index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
        for p in paths:
            if p[:-1] not in index:
                raise VisarError(f"draft tree node {list(p)} has no parent {list(p[:-1])}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
                raise VisarError(f"draft tree node {list(p)}: sibling ranks must be 0, 1, 2, ... without gaps")
        size = len(paths) + 1
        parents = [-1] + [index[p[:-1]] for p in paths]
        parent = torch.tensor(parents)
        depth = torch.tensor([0] + [len(p) for p in paths])
        width = max(sum(1 for p in paths if p[:-1] == q) for q in [()] + paths)
        children = torch.full((size, width), -1)
        for p in paths:
            children[index[p[:-1]], p[-1]] = index[p]
        lineage = [{0}]  # each node and its ancestors, built in Python: a tree of T nodes costs one tensor
        for i in range(1, size):
            lineage.append(lineage[parents[i]] | {i})
        ancestors = torch.tensor([[j in line for j in range(size)] for line in lineage])
        return cls(tuple(paths), parent, depth, children, ancestors)


def resolve_tree(tree) -> StaticTree:
    if isinstance(tree, StaticTree):
        return tree
    if isinstance(tree, str):
        if tree not in TREES:
            raise VisarError(f"unknown draft tree {tree!r}; named trees: {', '.join(TREES)} (or a list of paths)")
        tree = TREES[tree]
    return StaticTree.from_paths(tree)


class CacheSlots:
    """A KV cache laid out as [condition ; image tokens ; scratch slots ; 1 trash slot], where tree
    nodes off the committed path sit at scratch slots and left padding writes to the trash slot."""

    def __init__(self, model: RasterModel, num_scratch: int):
        self.num_cond, self.num_tokens = model.num_condition_tokens, model.num_image_tokens
        self.max_pos = self.num_cond + self.num_tokens - 1
        self.scratch = self.num_cond + self.num_tokens
        self.trash = self.scratch + num_scratch
        self.size = self.trash + 1
        self.device = model.device
        self.slots = torch.arange(self.size, device=self.device)
        # made once, not once a pass: the slots as a mask row, which of them are true (condition and
        # image) slots, the trash slot alone, and a chain's columns by width
        self.slot_row = self.slots[None, None]  # [1, 1, S]
        self.true_slots = (self.slots < self.scratch)[None, None]  # [1, 1, S]
        self.trash_only = (self.slots == self.trash)[None, None]  # [1, 1, S]
        self.columns: dict[int, Tensor] = {}

    def chain(
        self, tokens: Tensor, fed: Tensor, committed: Tensor, width: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Committed tokens fed .. committed - 1 of each image (at most `width`), at their true slots,
        left-padded to `width`. -> (tokens [B, P], input_pos [B, P], cache_pos [B, P], mask [B, P, S]);
        the last column is each image's newest committed token (the root), when it has one to feed."""
        if width not in self.columns:
            self.columns[width] = torch.arange(width, device=self.device) - width  # [P] -width .. -1
        committed = committed[:, None]
        index = committed + self.columns[width]  # [B, P]
        real = index >= fed[:, None]
        feed = tokens.gather(1, index.clamp(min=0))
        input_pos = (self.num_cond + torch.where(real, index, committed - 1)).clamp(0, self.max_pos)
        cache_pos = torch.where(real, input_pos, self.trash)
        causal = (self.slot_row <= input_pos[..., None]) & self.true_slots
        mask = torch.where(real[..., None], causal, self.trash_only)
        return feed, input_pos, cache_pos, mask


class TreeAttention(CacheSlots):
    """Inputs, slots and masks of one pass over a static tree: node i at scratch slot scratch + i - 1."""

    def __init__(self, scorer: GuidedScorer, tree: StaticTree):
        super().__init__(scorer.model, tree.num_nodes)
        self.scorer, self.tree = scorer, tree
        # [T + 1, S]: the scratch slots each node sees (its ancestors and itself; the root has none)
        self.node_scratch = torch.zeros(tree.num_nodes + 1, self.size, dtype=torch.bool, device=self.device)
        self.node_scratch[:, self.scratch : self.trash] = tree.ancestors[:, 1:].to(self.device)

    def run(self, tokens: Tensor, input_pos: Tensor, cache_pos: Tensor, mask: Tensor) -> Tensor:
        """One pass over inputs at explicit positions, slots and visibility -> guided logits [B, L, V]."""
        return self.scorer.logits(tokens, input_pos, mask=mask, cache_pos=cache_pos)

    def nodes(self, node_ids: Tensor, node_tokens: Tensor, committed: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Tree nodes node_ids [n] (>= 1) of every image: tokens node_tokens [B, n], at scratch slots."""
        root_pos = self.num_cond + committed - 1  # [B]
        depth = self.tree.depth.to(self.device)[node_ids]
        input_pos = (root_pos[:, None] + depth[None]).clamp(max=self.max_pos)  # [B, n]
        cache_pos = (self.scratch + node_ids - 1)[None].expand_as(input_pos)
        prefix = (self.slot_row <= root_pos[:, None, None]) & self.true_slots  # [B, 1, S]
        mask = prefix | self.node_scratch[node_ids][None]
        return node_tokens, input_pos, cache_pos, mask


class TreeDrafter:
    """The draft model's side: catch up on committed tokens, then one pass per tree depth."""

    def __init__(self, draft: RasterModel, tree: StaticTree, request: Request):
        self.tree, self.scorer = tree, GuidedScorer.for_request(request, draft)
        self.attention = TreeAttention(self.scorer, tree)
        depth = tree.depth.tolist()
        has_children = (tree.children >= 0).any(1).tolist()
        device = self.attention.device
        self.levels = []  # per depth: its parents (nodes with children) and, per child rank, the children there
        for d in range(tree.max_depth):
            parents = [i for i in range(tree.num_nodes + 1) if depth[i] == d and has_children[i]]
            kids = tree.children[parents].tolist()  # [n][C], read once: which children exist is known here
            ranks = []
            for rank in range(tree.children.shape[1]):
                at = [j for j in range(len(parents)) if kids[j][rank] >= 0]  # parents with a child of this rank
                if at:  # (children fill ranks 0, 1, ..: a parent without this rank has no later one)
                    index = [torch.tensor(x, device=device) for x in (at, [kids[j][rank] for j in at])]
                    ranks.append((*index, torch.tensor([parents[j] for j in at], device=device)))
            self.levels.append((torch.tensor(parents, device=device), ranks))

    def propose(self, state: SlotState, uniforms: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
        """-> node_tokens [B, T + 1], node_q [B, T + 1, V] (the law each node was drawn from),
        node_ok [B, T + 1] (False where the draft ran out of tokens to draw). uniforms [B, T + 1];
        `state.fed` [B]: the committed tokens each image has fed (the target's count: the draft feeds the
        same tokens, one pass after the other); width: the most committed tokens any image has not fed
        yet (read by the plan)."""
        tokens, fed, committed, tree = state.tokens, state.fed, state.committed, self.tree
        batch = committed.shape[0]
        device = self.attention.device
        # the tokens committed since the last call; the newest is the root, its output q(root's children)
        root_logits = self.attention.run(*self.attention.chain(tokens, fed, committed, width))[:, -1]
        size, vocab = tree.num_nodes + 1, root_logits.shape[-1]
        node_tokens = torch.zeros(batch, size, dtype=torch.long, device=device)
        node_q = torch.zeros(batch, size, vocab, device=device)
        node_ok = torch.ones(batch, size, dtype=torch.bool, device=device)
        for depth, (parents, ranks) in enumerate(self.levels):
            if depth == 0:
                parent_q = self.scorer.target_probs(root_logits)[:, None]  # [B, 1, V]
            else:
                logits = self.attention.run(*self.attention.nodes(parents, node_tokens[:, parents], committed))
                parent_q = self.scorer.target_probs(logits)  # [B, n, V]
            remaining = parent_q.clone()
            for at, kids, kid_parents in ranks:  # at [k]: this level's parents with a child of this rank
                mass = remaining.sum(-1, keepdim=True)  # [B, n, 1]
                law = remaining / mass.clamp(min=torch.finfo(mass.dtype).tiny)
                drawn = sample_from_probs(law[:, at], uniforms[:, kids])  # [B, k]
                node_tokens[:, kids] = drawn
                node_q[:, kids] = law[:, at]
                node_ok[:, kids] = (mass[:, at, 0] > 0) & node_ok[:, kid_parents]
                remaining[:, at] = remaining[:, at].scatter(-1, drawn[..., None], 0.0)
        return node_tokens, node_q, node_ok


@dataclass
class TreeWalk:
    """The outcome of verifying every image's tree from the root down."""

    path: Tensor  # [B, D + 1] the accepted nodes' tokens, then the final draw
    accepted: Tensor  # [B] accepted depth
    tried_at: Tensor  # [B, D] bool: a child was tested at this depth


def walk_tree(
    index: TreeIndex, probs: Tensor, node_tokens, node_q, node_ok, accept_u, final_u, active, relax
) -> TreeWalk:
    """Try each node's children in rank order with the (relaxed) speculative test, follow the first
    accepted one; after all are rejected, or at a leaf, draw one more token from the current
    residual (or p): `tree_acceptance.verify_tree`, every node at once, a child the draft could not
    draw (node_ok False) skipped. probs [B, T + 1, V]: the target at every node; accept_u [B, D, C]
    (a child's test: its depth's and rank's); final_u [B]."""
    present = node_ok & active[:, None]
    test_u = accept_u.flatten(1)[:, index.depth_rank]
    verdict = verify_tree(index, probs, node_tokens, node_q, test_u, final_u, present, present, relax)
    return TreeWalk(verdict.path[:, 1:], verdict.accepted, (verdict.tried.float() @ index.at_depth) > 0)


def pass_draws(tree: StaticTree) -> int:
    """The uniforms an image draws a pass: the draft's draws, the accept tests, the final draw."""
    return tree.num_nodes + 1 + tree.max_depth * tree.children.shape[1] + 1


class StaticTreePlan(NamedTuple):
    active: Tensor  # [B] images not done
    uniforms: Tensor  # [B, T + 1 + D * C + 1]: draft draws, accept tests, the final draw
    width: int  # committed tokens not fed yet (to the target or the draft: they feed the same), the most of any image


class StaticTreePasses:
    """lantern++'s passes: a draft model proposes a static tree after each image's committed prefix,
    the target scores it in one pass (tree nodes in scratch cache slots), the (relaxed) speculative
    test walks it, and the accepted path plus one token commits. An image's first step is a plain
    AR step, taken by the plan (`start_images`).

    relax(p, q, x) -> p~: the target each child is tested against (None: p itself, lossless); a
    rejection continues from norm((p~ - q)+)."""

    def __init__(self, request: Request, state: SlotState, draft: RasterModel, tree: StaticTree, relax):
        model = request.model
        self.state, self.tree, self.relax, self.device = state, tree, relax, model.device
        self.batch, self.total = request.batch_size, model.num_image_tokens
        self.target = TreeAttention(GuidedScorer.for_request(request), tree)
        self.drafter = TreeDrafter(draft, tree, request)
        self.size, self.max_depth = tree.num_nodes + 1, tree.max_depth
        self.block = pass_draws(tree)
        self.depths = tree.depth.to(self.device)
        self.index = tree.verify_index().to(self.device)
        self.node_range = torch.arange(1, self.size, device=self.device)
        self.depth_range = torch.arange(self.max_depth + 1, device=self.device)
        # pass numbers in the log are one past the passes planned: an image's prefill counts as a
        # pass of its own, numbered as the pass before the one it starts in (1 for a decode's images)
        self.log = DecodeLog(self.batch, model.grid_size, self.max_depth, self.device)
        self.log.count_at_once = request.compile_passes is not None
        state.record, state.parts = self.log, [self.target.scorer, self.drafter.scorer, self.log]

    def __enter__(self):
        self.target.scorer.open_cache(self.target.size)
        self.drafter.scorer.open_cache(self.drafter.attention.size)
        return self

    def __exit__(self, *exc):
        try:
            self.target.scorer.close_cache()
        finally:
            self.drafter.scorer.close_cache()

    def start_images(self, fresh: tuple[int, ...]):
        """The first step of the images in slots `fresh`: the prefill (target and draft) and token 0
        drawn with the image's first uniform, logged as its first pass. A decode's first pass starts
        every slot in one call; a refill, even of every slot at once, calls the model for its rows."""
        state = self.state
        rows = None if state.passes == 0 else torch.tensor(fresh, device=self.device)
        index = slice(None) if rows is None else rows
        self.log.passes_per_image[index] = 1
        self.log.commit_pass[index, 0] = state.passes + 1
        # token 0's uniform: each image's first draw (`first_draws=1`)
        state.tokens[index, 0] = sample_from_probs(self.target.scorer.prefill(rows), state.first_uniforms[index, 0])
        self.drafter.scorer.prefill(rows)  # the draft's cache holds the condition, nothing fed yet
        state.committed[index] = 1

    def plan(self) -> StaticTreePlan | None:
        state = self.state
        if state.fresh:
            self.start_images(state.fresh)
        active = state.committed < self.total
        # the one read-back of the loop: whether any image is left, and the most committed tokens any
        # image has not fed to the target and the draft (both feed them at the next pass's start)
        left, width = torch.stack([active.any().long(), (state.committed - state.fed).max()]).tolist()
        if not left:
            return None
        state.next_pass()
        return StaticTreePlan(active, state.uniforms.take(self.block), max(width, 1))

    def step(self, plan: StaticTreePlan):
        state = self.state
        node_tokens, node_q, node_ok = self.drafter.propose(state, plan.uniforms[:, : self.size], plan.width)
        # nodes past the image's end are never verified: the deepest usable depth leaves room for one more token
        node_ok = node_ok & (self.depths[None] <= (self.total - 1 - state.committed)[:, None])
        chain = self.target.chain(state.tokens, state.fed, state.committed, plan.width)
        nodes = self.target.nodes(self.node_range, node_tokens[:, 1:], state.committed)
        logits = self.target.run(*(torch.cat([a, b], 1) for a, b in zip(chain, nodes, strict=True)))
        state.fed = state.committed.clone()
        probs = self.target.scorer.target_probs(logits[:, chain[0].shape[1] - 1 :])  # [B, T + 1, V]
        max_depth, width = self.max_depth, self.tree.children.shape[1]
        accept_u = plan.uniforms[:, self.size : self.size + max_depth * width].view(self.batch, max_depth, width)
        walk = walk_tree(
            self.index, probs, node_tokens, node_q, node_ok, accept_u, plan.uniforms[:, -1], plan.active, self.relax
        )
        self.commit(plan, walk)

    def commit(self, plan: StaticTreePlan, walk: TreeWalk):
        state, depth, log, active = self.state, self.depth_range, self.log, plan.active
        committed = state.committed
        state.tokens.scatter_(1, committed[:, None] + depth, walk.path)
        kept = active[:, None] & (depth <= walk.accepted[:, None]) & (committed[:, None] + depth < self.total)
        log.commit(committed[:, None] + depth, kept, state.passes + 1)
        slot = depth[:-1].expand(self.batch, -1)
        log.drafts(committed[:, None] + slot, slot, walk.tried_at, slot < walk.accepted[:, None])
        log.count_pass(active)
        state.committed = committed + torch.where(active, walk.accepted + 1, 0)

    def stats(self) -> dict:
        stats = self.log.stats(
            self.target.scorer.forward_passes, draft_forward_passes=self.drafter.scorer.forward_passes
        )
        return {**stats, "tree_nodes": self.tree.num_nodes, "tree_depth": self.max_depth}


def tree_decode(
    request: Request,
    draft: RasterModel,
    tree: StaticTree,
    relax: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict]:
    """Draft a static tree, verify it in one target pass, commit the accepted path + 1, pass after
    pass (`StaticTreePasses` on the pass loop). -> (tokens [B, N], stats)."""
    # each image's first draw is token 0's (its prefill's AR step), then the passes', drawn 16 at a time
    depth, block = tree.max_depth, 16 * pass_draws(tree)
    state = SlotState(request, window=depth, spare=depth + 1, keyed=False, first_draws=1, block=block, tracks_fed=True)
    engine = StaticTreePasses(request, state, draft, tree, relax)
    return decode_passes(engine, state, request, "tree")
