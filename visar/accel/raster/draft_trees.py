"""The draft tree at the head of a Jacobi window (sjd-pac, tree-mc-sjd; zipar-tree's fronts use its candidates).

`DraftTree`: the layout. `draft_tree`: every node's token and the law it was drawn from (candidate 0
from the proposer, then known neighbours and draws without replacement). `DraftTreeScorer`: one target
pass over the tree. `verify_draft_tree`: every node at once by recursive rejection (`tree_acceptance`).
docs/RASTER.md ("Draft trees") has the iteration and why each candidate is drawn from the law it is verified under.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from ...errors import VisarError
from ..core import tree_acceptance
from ..core.candidates import without_replacement
from ..core.checks import check_number
from ..core.sampling import UniformStream, sample_from_probs
from ..core.scoring import GuidedScorer
from ..core.tree_acceptance import TreeIndex
from .proposers import DRAFT, NUM_PURPOSES, JacobiProposer, Window
from .slots import SlotState
from .static_tree import CacheSlots, StaticTree


@dataclass(frozen=True)
class DraftTree:
    """A K-ary tree over the first `depth` - 1 draft positions, whose rank-0 branch goes on as a chain
    (the main path) to `window` nodes in all.

    Node 0 is the root (the newest committed token), nodes are sorted by depth (StaticTree's
    order), so the main path (all ranks 0) is node `main[d]` at depth d.
    """

    tree: StaticTree
    branch: int  # K, candidates at each branching position
    depth: int  # D: positions 1 .. D - 1 branch
    index: TreeIndex  # what `tree_acceptance.verify_tree` reads
    main: Tensor  # [M] node id of the main path at depth 0 .. M - 1
    on_main: Tensor  # [T] bool
    side_slot: Tensor  # [T] scratch index of a side node (-1 on the main path)
    main_depth: Tensor  # [T] depth of the deepest main-path node among the node and its ancestors
    # [T] column of the node's token in [root ; candidate 0 of each main-path draft (M - 1) ; the K
    # candidates of each branching position]: d for rank 0 at depth d, M + (d - 1) * K + rank else
    candidate: Tensor
    main_child: Tensor  # [M] the rank-0 child of each main-path node (the last node: itself)
    main_has_child: Tensor  # [M] bool: all but the last
    main_second_row: Tensor  # [M] each main node's law row (TreeIndex) after its rank-0 child is rejected
    depth_less_one: Tensor  # [T] depth - 1: a node's position past the last committed token
    draft_slot: Tensor  # [T] max(depth - 1, 0): the draft slot a node's test is logged at

    def to(self, device) -> DraftTree:
        """The same tree with every index on `device` (moved once per decode, not per pass)."""
        moved = {
            f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)
        }
        tree = StaticTree(**{f.name: _to(getattr(self.tree, f.name), device) for f in fields(self.tree)})
        return replace(self, tree=tree, index=self.index.to(device), **moved)

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes + 1

    @property
    def main_length(self) -> int:
        return len(self.main)

    @property
    def num_side(self) -> int:
        return self.num_nodes - self.main_length

    @classmethod
    def build(cls, window: int, branch: int, depth: int) -> DraftTree:
        """The tree of these numbers, or one VisarError, checked before anything is built (a list is no
        cache key, and branch ** depth paths could fill the memory before the count said no)."""
        for name, value, minimum in (("window", window, 2), ("branch", branch, 1), ("depth", depth, 1)):
            check_number(name, value, minimum, integer=True)
        tree_nodes, level = 0, 1  # nodes at depths 0 .. D - 1, the root included, counted until past the window
        for d in range(depth):
            tree_nodes, level = tree_nodes + level, level * branch
            if tree_nodes > window:
                counted = str(tree_nodes) if d == depth - 1 else f"over {window}"
                raise VisarError(
                    f"a tree of branch {branch} and depth {depth} has {counted} nodes, more than the window of "
                    f"{window} slots: raise window or lower branch / depth"
                )
        return cls.built(window, branch, depth)

    @classmethod
    @functools.lru_cache(maxsize=256)
    def built(cls, window: int, branch: int, depth: int) -> DraftTree:
        """`build`'s tree, made once per process (its index tensors are only read): a build takes some
        500 small ops, and every decode of a tree method asks for its tree."""
        paths = [p for d in range(1, depth) for p in itertools.product(range(branch), repeat=d)]
        tree_nodes = len(paths) + 1
        paths += [(0,) * d for d in range(depth, window - tree_nodes + depth)]
        tree = StaticTree.from_paths(paths)
        main_nodes = [True] + [max(p) == 0 for p in tree.paths]
        on_main = torch.tensor(main_nodes)
        main = torch.tensor([i for i, is_main in enumerate(main_nodes) if is_main])
        side_slot = torch.where(on_main, -1, (~on_main).long().cumsum(0) - 1)
        # the deepest ancestor-or-self on the main path: the true cache slots a node may see
        main_depth = torch.tensor([0] + [next((i for i, r in enumerate(p) if r), len(p)) for p in tree.paths])
        main_depth = torch.minimum(main_depth, tree.depth)
        main_length = len(main)
        candidate = torch.tensor(
            [0] + [len(p) if p[-1] == 0 else main_length + (len(p) - 1) * branch + p[-1] for p in tree.paths]
        )
        index = tree.verify_index()
        main_child = torch.cat([main[1:], main[-1:]])
        return cls(
            tree,
            branch,
            depth,
            index,
            main,
            on_main,
            side_slot,
            main_depth,
            candidate,
            main_child,
            main_child != main,
            index.second_row[main],
            tree.depth - 1,
            (tree.depth - 1).clamp(min=0),
        )


def _to(value, device):
    return value.to(device) if isinstance(value, Tensor) else value


NEIGHBOURS = ("left", "above", "above-left", "above-right")


def neighbour_candidates(canvas: Tensor, index: Tensor, width: int, names: tuple[str, ...]) -> Tensor:
    """The known neighbours of each position, in the order named ("left", "above"): [B, P, len(names)], -1 unknown.

    canvas [B, C] committed tokens and carried drafts, -1 elsewhere; index [B, P] image-token indices (< C).
    """
    batch, num_positions = index.shape
    at = neighbour_positions(canvas.shape[1], width, names, canvas.device)[index]  # [B, P, J]
    token = canvas.gather(1, at.clamp(min=0).view(batch, -1)).view(at.shape)
    return torch.where(at >= 0, token, -1)


@functools.lru_cache(maxsize=16)
def neighbour_positions(length: int, width: int, names: tuple[str, ...], device) -> Tensor:
    """[C, J] the canvas index of each position's named neighbours (-1 off the grid's edge), made once
    per canvas length, width and names: a pass then reads the neighbours with one lookup."""
    index = torch.arange(length)
    column = index % width
    offsets = {
        "left": (1, column > 0),
        "above": (width, index >= width),
        "above-left": (width + 1, (index >= width) & (column > 0)),
        "above-right": (width - 1, (index >= width) & (column < width - 1)),
    }
    found = [torch.where(ok, (index - offset).clamp(0, length - 1), -1) for offset, ok in map(offsets.get, names)]
    return torch.stack(found, -1).to(device)


@dataclass
class DraftTreeVerdict:
    accepted: Tensor  # [B] accepted depth a: the pass commits a + 1 tokens
    path: Tensor  # [B, M + 1] column d: the token at depth d of the reached path, column a + 1 the final draw
    main_reached: Tensor  # [B] main-path nodes reached (depth >= 1): their cache slots stay valid
    tried: Tensor  # [B, T] the node's test decided something (its parent reached, no earlier sibling accepted)
    accept: Tensor  # [B, T] the node's own test passed
    main_outputs: Tensor  # [B, M] the main path's slot outputs (distributed as p of each main node)


def verify_draft_tree(
    layout: DraftTree, probs: Tensor, node_tokens: Tensor, node_q: Tensor, valid: Tensor, uniforms: Tensor
) -> DraftTreeVerdict:
    """Verify every node of every image at once (`tree_acceptance.verify_tree`), and draw the main path's
    slot outputs, which the next pass's drafts are coupled to.

    probs [B, T, V] the target at every node; node_q [B, T, V] the law each node's token was
    drawn from (given its earlier siblings); valid [B, T] nodes inside the image; uniforms
    [B, T + M + 1]: the nodes' tests, the main path's residual draws, the final draw.
    """
    num_nodes, main_len = layout.num_nodes, layout.main_length
    verdict = tree_acceptance.verify_tree(
        layout.index, probs, node_tokens, node_q, uniforms[:, :num_nodes], uniforms[:, -1], valid
    )
    main_reached = (verdict.reached & layout.on_main).sum(-1) - 1
    # Main-path slot outputs: the rank-0 child's draft if it passed, else a draw from R_1 (p at the last node).
    drawn = sample_from_probs(verdict.laws[:, layout.main_second_row], uniforms[:, num_nodes : num_nodes + main_len])
    kept = verdict.accept[:, layout.main_child] & layout.main_has_child
    main_outputs = torch.where(kept, node_tokens[:, layout.main_child], drawn)
    return DraftTreeVerdict(verdict.accepted, verdict.path, main_reached, verdict.tried, verdict.accept, main_outputs)


class DraftTreeScorer(CacheSlots):
    """Inputs, cache slots and masks of one pass over [tokens fed again ; the tree].

    Cache layout: [condition ; image tokens ; one scratch slot per side node ; 1 trash slot]. The
    main path is written at its true slots (kept when reached: no copy, no re-feed); a side node
    at its scratch slot, with its true position for RoPE; left padding writes to the trash slot.
    """

    def __init__(self, scorer: GuidedScorer, layout: DraftTree):
        super().__init__(scorer.model, layout.num_side)
        self.scorer, self.layout = scorer, layout
        device = self.device
        side = ~layout.on_main
        side_visible = torch.zeros(layout.num_nodes, self.size, dtype=torch.bool)
        side_visible[:, self.scratch + layout.side_slot[side]] = layout.tree.ancestors[:, side]
        self.side_visible = side_visible[1:].to(device)  # [T - 1, S] for nodes 1 ..
        self.depth = layout.tree.depth[1:].to(device)
        self.main_depth = layout.main_depth[1:].to(device)
        self.on_main = layout.on_main[1:].to(device)
        # where a node that is not a main one at a true slot writes: a side node its scratch slot, a
        # main node past the image the trash slot
        self.other_slot = torch.where(self.on_main, self.trash, (self.scratch + layout.side_slot[1:]).to(device))

    def nodes(self, committed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Nodes 1 .. T - 1 of every image -> (input_pos, cache_pos, mask), each [B, T - 1(, S)]."""
        root = committed[:, None] + (self.num_cond - 1)  # [B, 1] the root's position (the last condition slot at first)
        position = root + self.depth
        cache_pos = torch.where(self.on_main & (position <= self.max_pos), position, self.other_slot)
        seen = root + self.main_depth  # [B, T - 1] the last true slot each node sees
        mask = (self.true_slots & (self.slot_row <= seen[..., None])) | self.side_visible
        return position.clamp(max=self.max_pos), cache_pos, mask

    def probs(self, state: SlotState, node_tokens: Tensor, first: bool, rows=None) -> Tensor:
        """One target pass -> p at every node [B, T, V] (node 0: the root's, the law of index committed).
        rows [R]: the pass is for these slots only (node_tokens has R rows)."""
        tokens, fed, committed = (x if rows is None else x[rows] for x in (state.tokens, state.fed, state.committed))
        input_pos, cache_pos, mask = self.nodes(committed)
        if first:  # the condition is the chain; its last position is the root
            chain_pos = torch.arange(self.num_cond, device=self.device)[None].expand(committed.shape[0], -1)
            chain_mask = (self.slot_row <= chain_pos[..., None]) & self.true_slots
            fed_tokens, chain_slots = node_tokens[:, 1:], chain_pos
        else:
            # a fixed width (a path off the main branch leaves the tree by depth D - 1): no read-back, one shape
            feed, chain_pos, chain_slots, chain_mask = self.chain(tokens, fed, committed, self.layout.depth)
            fed_tokens = torch.cat([feed, node_tokens[:, 1:]], 1)
        logits = self.scorer.logits(
            fed_tokens,
            torch.cat([chain_pos, input_pos], 1),
            mask=torch.cat([chain_mask, mask], 1),
            cache_pos=torch.cat([chain_slots, cache_pos], 1),
            with_condition=first,
            rows=rows,
        )
        return self.scorer.target_probs(logits[:, chain_pos.shape[1] - 1 :])


def draft_tree(
    proposer: JacobiProposer,
    state: SlotState,
    window: Window,
    layout: DraftTree,
    neighbours: tuple[str, ...],
    uniforms: Tensor,
) -> tuple[Tensor, Tensor]:
    """Every node's token and the law it was drawn from: [B, T], [B, T, V] (node 0: the root).

    Candidate 0 of each position comes from the proposer (a carried draft or a new slot's); the
    first D - 1 positions get K - 1 more (`without_replacement`, known neighbours first). A node
    takes the candidate of its depth and rank (SJD-PAC's tree: the same candidates under every
    parent). uniforms [B, (D - 1) V]: the extra candidates' keys' (`candidate_noise`).
    """
    branch, num_branching = layout.branch, layout.depth - 1
    batch, device = state.committed.shape[0], state.committed.device
    first_tokens, first_q = proposer.propose(state, window)  # [B, M - 1], [B, M - 1, V]
    root = state.tokens.gather(1, (state.committed - 1).clamp(min=0)[:, None])
    # every node's candidate by its column (`DraftTree.candidate`); the root's law is unused
    tokens, laws = [root, first_tokens], [first_q[:, :1], first_q]
    if branch > 1 and num_branching > 0:
        fixed = None
        if neighbours:
            position = state.committed[:, None] + torch.arange(num_branching, device=device)
            fixed = neighbour_candidates(proposer.proposal_canvas(state), position, state.grid_size[1], neighbours)
        extra_tokens, extra_laws = without_replacement(
            first_q[:, :num_branching],
            first_tokens[:, :num_branching],
            branch,
            uniforms.view(batch, num_branching, -1),
            fixed,
        )
        tokens.append(extra_tokens.flatten(1))  # [B, (D - 1) K]
        laws.append(extra_laws.flatten(1, 2))
    return torch.cat(tokens, 1)[:, layout.candidate], torch.cat(laws, 1)[:, layout.candidate]


def candidate_noise(layout: DraftTree, vocab: int) -> int:
    """Uniforms of the extra candidates' draw a pass: one per token at each branching position (the
    keys of `candidates.ranked_candidates`), none when there are no extra candidates."""
    return (layout.depth - 1) * vocab if layout.branch > 1 else 0


def tree_uniforms(layout: DraftTree, vocab: int) -> int:
    """Uniforms an image draws for one pass of this tree (`tree_randomness`)."""
    return (layout.main_length - 1) + candidate_noise(layout, vocab) + layout.num_nodes + layout.main_length + 1


def tree_randomness(
    stream: UniformStream, layout: DraftTree, active: Tensor, vocab: int
) -> tuple[Window, Tensor, Tensor]:
    """This pass's uniforms, one fixed-size block per image (the next `tree_uniforms` of its stream):
    the main drafts' (in the proposer's Window), the extra candidates' [B, (D - 1) V] and the
    node tests' and draws' [B, T + M + 1]."""
    main_len, device = layout.main_length, active.device
    num_extra = candidate_noise(layout, vocab)
    uniforms = stream.take(tree_uniforms(layout, vocab))  # on the device already
    draft_u, extra_u, test_u = uniforms.split(
        [main_len - 1, num_extra, uniforms.shape[1] - main_len + 1 - num_extra], 1
    )
    window_u = torch.zeros(active.shape[0], NUM_PURPOSES * main_len, device=device)  # `Window.row`'s layout
    window_u[:, DRAFT * main_len : (DRAFT + 1) * main_len - 1] = draft_u
    return Window(active * main_len, window_u, main_len - 1), extra_u, test_u
