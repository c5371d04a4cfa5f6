"""Draft initialisers of the speculative Jacobi engines: tokens for window slots no carried draft covers.

Every Jacobi-style method's `init` option names one of `INITIALISERS`: "random" (a uniform
token, q uniform) or a training-free 2-D draft. Neighbouring image tokens are often equal (flat
backgrounds, the inside of a shape), so a new window slot is better drafted by copying a
neighbour than by a uniform token:

- "above": the token one row up; "left": the token one column to the left (never wrapping
  round a row end); either falls back to a uniform random token when that neighbour is unknown.
- "above-left": both neighbours, the slot's draft uniform choosing between them with
  probability 1/2 each; one of them when only one is known; random when neither is.

A neighbour is known when the canvas has it (a committed token or a carried draft) or when an
earlier slot of the same call copied a known token into it, so a run of new slots along a
row repeats the last known token. A randomly filled slot is not a source: copying a uniform
token would only make a worse draft (accepted with p(x) rather than min(1, V p(x))).

Exactness. A copy is a function of what the verifier's test uniforms are independent of (the
canvas, earlier drafts and this iteration's draft uniforms), so the distribution it was drawn
from is the one-hot on it, q = onehot(x), and the speculative test accepts it with probability
p(x); for "above-left" q = (onehot(above) + onehot(left)) / 2, accepted with min(1, 2 p(x)).
The test against the enumerated joint law (tests/accel/raster/test_zipar.py) holds for all three.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import VisarError
from .slots import SlotState


@dataclass
class FillRequest:
    """What an initialiser may look at. A 2-D initialiser (token above / to the left) reads the canvas."""

    state: SlotState
    draft_index: Tensor  # [B, G] absolute image-token index of every draft slot
    # [B, G] this iteration's draft uniforms of each image, or a function that takes them (`uniforms`)
    uniform_source: Tensor | Callable[[], Tensor]
    # [B, N + window] committed tokens and carried drafts at their indices, -1 elsewhere; or a function
    # that builds it, called only by an initialiser that reads it (`canvas`)
    source: Tensor | Callable[[], Tensor]
    # every slot's token one row up lies in the committed prefix (`state.tokens`, where the canvas
    # holds the same): a chain window no longer than a row, so no slot copies another's copy
    above_committed: bool = False
    # and lies inside the image (every image has committed a row or more): no uniform fallback, and
    # the one-hot q comes as bool [B, G, V] (the asker, `JacobiProposer`, merges it by a where)
    sources_inside: bool = False
    # draft_index[b] is committed[b] + 0 .. G - 1 (a Jacobi window's or a tree's main path): slot j's
    # neighbour one row up is slot j - W of the same call, so copies of copies follow columns
    consecutive: bool = False

    @property
    def uniforms(self) -> Tensor:
        return made(self, "uniform_source")

    @property
    def canvas(self) -> Tensor:
        return made(self, "source")


def made(holder, name: str) -> Tensor:
    """holder's field `name`, which holds a tensor or a function that makes it: made on first read
    and kept (a pass builds what only some initialisers or updaters read, only when one does)."""
    value = getattr(holder, name)
    if callable(value):
        value = value()
        setattr(holder, name, value)
    return value


def random_init(request: FillRequest) -> tuple[Tensor, Tensor]:
    """Uniform random tokens, with q = uniform (so acceptance is min(1, V p(x)))."""
    vocab = request.state.vocab_size
    tokens = (request.uniforms * vocab).long().clamp(max=vocab - 1)
    probs = torch.full((*tokens.shape, vocab), 1.0 / vocab, device=tokens.device)
    return tokens, probs


def neighbour_fill(request: FillRequest, above: bool, left: bool) -> tuple[Tensor, Tensor]:
    """Copy the known neighbour(s) of every slot (left to right, so later slots may copy earlier copies).

    request.draft_index < 0 marks a slot that needs no draft (its output is ignored).
    -> draft_tokens [B, G], draft_probs [B, G, V].
    """
    width = request.state.grid_size[1]
    index = request.draft_index  # [B, G]
    tokens, probs = random_init(request)  # the fallback: uniform tokens, q uniform
    canvas = request.canvas.clone()  # [B, C] known tokens, -1 elsewhere; copies are written in as they are made
    last = canvas.shape[1] - 1
    choose_above = request.uniforms < 0.5  # [B, G]: the mixture's pick when both neighbours are known
    up_tokens = torch.full_like(index, -1)  # [B, G] the known neighbour above each slot, -1 = none
    left_tokens = torch.full_like(index, -1)
    # Sequential over slots only because a slot may copy a copy made for an earlier one.
    for g in (index >= 0).any(0).nonzero().flatten().tolist():
        slot = index[:, g]  # [B]
        valid = slot >= 0
        if above:
            up = canvas.gather(1, (slot - width).clamp(0, last)[:, None])[:, 0]
            up_tokens[:, g] = torch.where(valid & (slot >= width), up, -1)
        if left:
            lt = canvas.gather(1, (slot - 1).clamp(0, last)[:, None])[:, 0]
            left_tokens[:, g] = torch.where(valid & (slot % width > 0), lt, -1)
        up, lt = up_tokens[:, g], left_tokens[:, g]
        pick = torch.where((up >= 0) & (lt >= 0), torch.where(choose_above[:, g], up, lt), torch.maximum(up, lt))
        tokens[:, g] = torch.where(pick >= 0, pick, tokens[:, g])
        target = slot.clamp(0, last)[:, None]
        current = canvas.gather(1, target)  # a carried draft already there stays
        canvas.scatter_(1, target, torch.where((pick[:, None] >= 0) & (current < 0), pick[:, None], current))
    # q: weight 1 on the one known neighbour, 1/2 on each of two (adding up to 1 when they agree)
    has_up, has_left = up_tokens >= 0, left_tokens >= 0
    share = torch.where(has_up & has_left, 0.5, 1.0)  # [B, G]
    copy_q = torch.zeros_like(probs)
    copy_q.scatter_add_(-1, up_tokens.clamp(min=0)[..., None], (share * has_up)[..., None])
    copy_q.scatter_add_(-1, left_tokens.clamp(min=0)[..., None], (share * has_left)[..., None])
    return tokens, torch.where((has_up | has_left)[..., None], copy_q, probs)


def above_init(request: FillRequest) -> tuple[Tensor, Tensor]:
    """The token one row up (q one-hot), else a uniform token: `neighbour_fill(above=True, left=False)`
    without its loop over slots, the same tokens and q.

    A slot copies the token one row up: the canvas's, or, where the canvas has none there, the copy
    made for an earlier slot of this pass at that index (a window longer than the row). Chains of
    such copies resolve in one gather per link, instead of a dozen small ops per slot and pass.
    """
    width = request.state.grid_size[1]
    index = request.draft_index  # [B, G]
    if request.above_committed:  # every source committed: no canvas to build, no chain to follow
        return above_committed_fill(request, index - width)
    tokens, probs = random_init(request)
    source = index - width
    has_source = (index >= 0) & (source >= 0)
    last = request.canvas.shape[1] - 1
    known = torch.where(has_source, request.canvas.gather(1, source.clamp(0, last)), -1)  # [B, G]
    if request.consecutive:
        return one_hot_or(latest_known_above(known, width), tokens, probs)
    # the earlier slot (in pass order, as neighbour_fill visits them) that drafts the source index
    earlier = torch.ones(index.shape[1], index.shape[1], dtype=torch.bool, device=index.device).tril(-1)
    match = (index[:, None, :] == source[:, :, None]) & earlier & (index[:, None, :] >= 0)  # [B, G, G]
    chained = has_source & (known < 0) & match.any(-1)
    # Each chained slot copies from an earlier slot; a slot's token is its chain's root's. Pointer
    # jumping finds every root in ceil(log2 G) gathers, a number fixed by the shape (a loop until
    # nothing changes would read the device back every round).
    root = torch.where(chained, match.to(torch.int8).argmax(-1), torch.arange(index.shape[1], device=index.device))
    for _ in range((index.shape[1] - 1).bit_length()):
        root = root.gather(1, root)
    return one_hot_or(known.gather(1, root), tokens, probs)


def latest_known_above(known: Tensor, width: int) -> Tensor:
    """Consecutive slots (`FillRequest.consecutive`): known [B, G] each slot's token one row up (-1:
    none) -> the token each slot copies: its own known one, else the copy made for slot j - W, and so
    on up its column; -1 where none in the column is known. A forward fill down each column of the
    slots laid out W a row: the same copies as `above_init`'s chains, in a dozen ops at any G."""
    batch, slots = known.shape
    rows = -(-slots // width)
    grid = F.pad(known, (0, rows * width - slots), value=-1).view(batch, rows, width)
    row = torch.arange(rows, device=known.device)[None, :, None]
    latest = torch.where(grid >= 0, row, -1).cummax(1).values  # the last row at or above with a known token
    # where none is known (latest -1) row 0 of that column is -1 itself, so gathering it gives -1
    return grid.gather(1, latest.clamp(min=0)).view(batch, -1)[:, :slots]


def above_committed_fill(request: FillRequest, source: Tensor) -> tuple[Tensor, Tensor]:
    """`above_init` where every slot is real and its source, when inside the image, is committed:
    the committed token there (q one-hot), else a uniform token (q uniform), in a few ops."""
    vocab, committed = request.state.vocab_size, request.state.tokens
    if request.sources_inside:  # q one-hot, as bool (a caller that asks for this takes it as 0 / 1)
        up = committed.gather(1, source)
        return up, request.state.vocab_ids() == up[..., None]
    has_source = source >= 0
    up = committed.gather(1, source.clamp(min=0))
    tokens = torch.where(has_source, up, (request.uniforms * vocab).long().clamp(max=vocab - 1))
    one_hot = request.state.vocab_ids() == up[..., None]  # [B, G, V]
    return tokens, torch.where(has_source[..., None], one_hot, 1.0 / vocab)


def one_hot_or(copies: Tensor, tokens: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    """The copied token (q one-hot on it) where `copies` [B, G] has one (>= 0), else `tokens` and `probs`."""
    q = torch.zeros_like(probs).scatter_(-1, copies.clamp(min=0)[..., None], 1.0)
    copied = copies >= 0
    return torch.where(copied, copies, tokens), torch.where(copied[..., None], q, probs)


def left_init(request: FillRequest) -> tuple[Tensor, Tensor]:
    """The token one column to the left in the same row (q one-hot), else a uniform token."""
    return neighbour_fill(request, above=False, left=True)


def above_left_init(request: FillRequest) -> tuple[Tensor, Tensor]:
    """The token above or the one to the left, 1/2 each (q the two-point mixture), else a uniform token."""
    return neighbour_fill(request, above=True, left=True)


# Every Jacobi-style method's `init` option names one of these.
INITIALISERS: dict[str, Callable[[FillRequest], tuple[Tensor, Tensor]]] = {
    "random": random_init,
    "above": above_init,
    "left": left_init,
    "above-left": above_left_init,
}


def resolve_initialiser(init) -> Callable:
    """An `init` option (a name in INITIALISERS, or a callable taking a FillRequest) -> the initialiser."""
    if callable(init):
        return init
    if not isinstance(init, str) or init not in INITIALISERS:
        raise VisarError(f"unknown draft initialiser {init!r}; known: {', '.join(sorted(INITIALISERS))}")
    return INITIALISERS[init]
