"""One verifier for every draft tree: recursive rejection sampling over all of a tree's nodes at once.

Papers: recursive rejection over several candidates (SpecInfer, Miao et al. 2024; SpecTr, Sun et
al. 2023), on EAGLE's static trees (Li et al. 2024) and LANTERN++'s relaxed test (Jang, Park et
al. 2025). Used by lantern++ (static_tree.py: a draft model's static tree), sjd-pac and tree-mc-sjd
(draft_trees.py: the draft tree at the head of a Jacobi window) and zipar-tree's fronts
(zipar/tree_fronts.py: one position's candidates, `residual_ladder`).

The rule at a node with children c_0 .. c_{C-1} (rank order), c_k's token x_k drawn from q_k:

    R_0 = p (the target at the node),   G_k = relax(R_k, q_k, x_k)  (R_k itself when not relaxed)
    accept c_k  <=>  u_k q_k(x_k) < G_k(x_k);  the first accepted child is taken
    R_{k+1} = norm((G_k - q_k)+)  after c_k is rejected (R_k where c_k is absent)

and after the last rejection, or at a leaf, one token is drawn from R_C. Without relax the output
follows p (lossless) when each q_k is fixed by what the test uniforms are independent of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from .acceptance import rejection_residual
from .sampling import sample_from_probs

# The residual after a rejected candidate; tests replace it to show that the law tests catch its absence.
ladder_residual = rejection_residual

Relax = Callable[[Tensor, Tensor, Tensor], Tensor]


def ladder_step(rung: Tensor, q: Tensor, x: Tensor | None, relax: Relax | None) -> tuple[Tensor, Tensor]:
    """One rung of the ladder: (G_k, R_{k+1}) from R_k, q_k and x_k (x only read by relax)."""
    goal = rung if relax is None else relax(rung, q, x)
    return goal, ladder_residual(goal, q)


def residual_ladder(probs: Tensor, candidate_q: Tensor) -> Tensor:
    """The laws one position's candidates are tested against: R_0 = p, R_k = norm((R_{k-1} - q_{k-1})+),
    and R_C, what is drawn after the last rejection. probs [..., V]; candidate_q [..., C, V] -> [..., C + 1, V]."""
    ladder = [probs]
    for k in range(candidate_q.shape[-2]):
        ladder.append(ladder_step(ladder[-1], candidate_q[..., k, :], None, None)[1])
    return torch.stack(ladder, -2)


@dataclass(frozen=True)
class TreeIndex:
    """A static tree's index tensors for `verify_tree`, made once per tree and moved to the device once.

    The verifier's law rows: row i < T is p at node i; row T + j the law left after the j-th
    non-root node, in rank order (`rank_nodes` one after another), is rejected.
    """

    num_nodes: int  # T, the root included
    max_depth: int  # D
    rank_nodes: tuple[Tensor, ...]  # rank r: the nodes of sibling rank r [n_r]
    # rank 0: their parents; rank r > 0: their elder sibling's place in rank r - 1 (None: rank r - 1 in
    # its order, as where one node has every rank, so that no copy of the rung is made)
    rank_source: tuple[Tensor | None, ...]
    goal_column: Tensor  # [T] a node's place in rank order (0 for the root)
    test_row: Tensor  # [T] the law row a node is tested against without relax (R_rank of its parent)
    final_row: Tensor  # [T] the law row drawn after all the node's children are rejected (p at a leaf)
    second_row: Tensor  # [T] R_1: the law row left when the node's rank-0 child is rejected (p at a leaf)
    nodes: Tensor  # [T] 0 .. T - 1
    parent: Tensor  # [T] (0 for the root)
    depth: Tensor  # [T]
    end_score: Tensor  # [T] depth + 1: the deepest reached node scores highest
    is_root: Tensor  # [T] bool
    earlier_t: Tensor  # [T, T] float: row j, column i: j is an elder sibling of i
    ancestors_t: Tensor  # [T, T] float: row j, column i: j is i or one of its ancestors
    at_depth: Tensor  # [T, D] float: column d holds the nodes of depth d + 1
    depth_rank: Tensor  # [T] (depth - 1) C + rank: a node's column in a [D, C] block by depth and rank (0: root)
    rank_order: Tensor  # [T - 1] the non-root nodes in rank order: rank_nodes one after another

    @classmethod
    def build(cls, parent: list[int], rank: list[int]) -> TreeIndex:
        """parent [T] (-1 for the root; parents before children), rank [T]: each node's sibling rank."""
        size = len(parent)
        depth, lineage = [0] * size, [[0]] + [[] for _ in range(1, size)]
        for i in range(1, size):
            depth[i], lineage[i] = depth[parent[i]] + 1, lineage[parent[i]] + [i]
        rank_nodes = [[i for i in range(1, size) if rank[i] == r] for r in range(max(rank[1:], default=-1) + 1)]
        place = {node: column for column, node in enumerate(i for nodes in rank_nodes for i in nodes)}
        child = {(parent[i], rank[i]): i for i in range(1, size)}  # (parent, rank) -> node
        sources = [[parent[i] for i in rank_nodes[0]]] + [
            [rank_nodes[r - 1].index(child[parent[i], r - 1]) for i in nodes] for r, nodes in enumerate(rank_nodes) if r
        ]
        test_row = [0] + [
            parent[i] if rank[i] == 0 else size + place[child[parent[i], rank[i] - 1]] for i in range(1, size)
        ]
        kids = [[i for i in range(1, size) if parent[i] == node] for node in range(size)]
        sibling = [
            [0 < i != j and parent[i] == parent[j] and rank[j] < rank[i] for i in range(size)] for j in range(size)
        ]
        max_depth = max(depth)
        long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
        return cls(
            size,
            max_depth,
            tuple(map(long, rank_nodes)),
            tuple(None if r and s == list(range(len(rank_nodes[r - 1]))) else long(s) for r, s in enumerate(sources)),
            long([place.get(i, 0) for i in range(size)]),
            long(test_row),
            long([size + place[k[-1]] if k else i for i, k in enumerate(kids)]),
            long([size + place[k[0]] if k else i for i, k in enumerate(kids)]),
            torch.arange(size),
            long([max(p, 0) for p in parent]),
            long(depth),
            long(depth) + 1,
            long(depth) == 0,
            torch.tensor(sibling, dtype=torch.float),
            torch.tensor([[j in lineage[i] for i in range(size)] for j in range(size)], dtype=torch.float),
            torch.tensor([[depth[i] == d + 1 for d in range(max_depth)] for i in range(size)]).float().view(size, -1),
            long([max(depth[i] - 1, 0) * len(rank_nodes) + rank[i] for i in range(size)]),
            long([i for nodes in rank_nodes for i in nodes]),
        )

    def to(self, device) -> TreeIndex:
        """The same index on `device` (once per decode, not per pass)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                moved[f.name] = value.to(device)
            elif isinstance(value, tuple):
                moved[f.name] = tuple(v if v is None else v.to(device) for v in value)
        return replace(self, **moved)


@dataclass
class TreeVerdict:
    reached: Tensor  # [B, T] the node and all its ancestors taken (one node per depth at most)
    accepted: Tensor  # [B] accepted depth a: the pass commits a + 1 tokens
    path: Tensor  # [B, D + 2] column d: the token at depth d of the reached path, column a + 1 the final draw
    tried: Tensor  # [B, T] the node's test decided something (its parent reached, no elder sibling accepted)
    accept: Tensor  # [B, T] the node's own test passed
    laws: Tensor  # [B, 2T - 1, V] the law rows (TreeIndex): p at each node, then what each rejection leaves


def verify_tree(
    index: TreeIndex,
    probs: Tensor,
    node_tokens: Tensor,
    node_q: Tensor,
    test_u: Tensor,
    final_u: Tensor,
    valid: Tensor,
    present: Tensor | None = None,
    relax: Relax | None = None,
) -> TreeVerdict:
    """Verify every node of every image at once (a loop over sibling ranks, none over depth).

    probs [B, T, V] the target at every node; node_tokens [B, T]; node_q [B, T, V] the law each
    node's token was drawn from (given its elder siblings); test_u [B, T] each node's test's uniform,
    final_u [B] the final draw's; valid [B, T]: nodes whose test may pass; present [B, T] (optional): the
    nodes that are candidates at all (an absent one leaves its younger siblings the law it found);
    relax(p, q, x) -> p~: what each child is tested against (None: the rung itself, lossless).
    """
    laws, goals = rejection_laws(index, probs, node_tokens, node_q, present, relax)
    rows = torch.arange(len(node_tokens), device=node_tokens.device)[:, None]
    goal_x = laws[rows, index.test_row, node_tokens] if goals is None else goals[rows, index.goal_column, node_tokens]
    accept = (test_u * node_q[rows, index.nodes, node_tokens] < goal_x) & valid
    # A test decides only when no elder sibling passed; the first that passes is taken.
    blocked = (accept.float() @ index.earlier_t) > 0
    taken = (accept & ~blocked) | index.is_root
    reached = ((~taken).float() @ index.ancestors_t) == 0  # the node and every ancestor taken
    accepted = (reached * index.depth).amax(-1)
    end = (reached * index.end_score).argmax(-1)  # the deepest reached node
    # The final token: from what the end node's last rejected child left, or p at a leaf.
    final = sample_from_probs(laws[rows[:, 0], index.final_row[end]], final_u)
    path = reached_path(index, reached, accepted, node_tokens, final)
    tried = reached[:, index.parent] & ~blocked & valid & ~index.is_root
    return TreeVerdict(reached, accepted, path, tried, accept, laws)


def rejection_laws(
    index: TreeIndex, probs: Tensor, node_tokens: Tensor, node_q: Tensor, present: Tensor | None, relax: Relax | None
) -> tuple[Tensor, Tensor | None]:
    """The ladder of every node's children, one sibling rank at a time -> the law rows [B, 2T - 1, V]
    (TreeIndex) and, under relax, each non-root node's G in rank order [B, T - 1, V] (else None)."""
    left, goals = [], []
    sizes = [len(nodes) for nodes in index.rank_nodes]
    # Every rank's q (and x, present) read at once, in rank order, then cut by rank.
    by_rank = lambda values: values[:, index.rank_order].split(sizes, 1) if sizes else ()  # noqa: E731
    qs = by_rank(node_q)
    xs = by_rank(node_tokens) if relax is not None else [None] * len(sizes)
    presents = by_rank(present[..., None]) if present is not None else [None] * len(sizes)
    for rank, source in enumerate(index.rank_source):
        rung = probs if rank == 0 else left[-1]
        rung = rung if source is None else rung[:, source]  # R_rank of each node's parent
        goal, after = ladder_step(rung, qs[rank], xs[rank], relax)
        if presents[rank] is not None:
            after = torch.where(presents[rank], after, rung)
        left.append(after)
        goals.append(goal)
    return torch.cat([probs, *left], 1), None if relax is None else torch.cat(goals, 1)


def reached_path(index: TreeIndex, reached: Tensor, accepted: Tensor, node_tokens: Tensor, final: Tensor) -> Tensor:
    """[B, D + 2]: column d the reached node of depth d, column accepted + 1 the final draw, 0 elsewhere."""
    last = index.max_depth + 1  # unreached nodes write 0 to the last column (the final draw's after a leaf at D)
    column = torch.where(reached, index.depth, last)
    path = node_tokens.new_zeros(len(node_tokens), last + 1).scatter_(1, column, torch.where(reached, node_tokens, 0))
    return path.scatter_(1, (accepted + 1)[:, None], final[:, None])
