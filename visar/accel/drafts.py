"""Training-free 2-D drafts for the speculative Jacobi engine: the token above, the token to the left.

Neighbouring image tokens are often equal (flat backgrounds, the inside of a shape), so a new
window slot is better drafted by copying a neighbour than by a uniform token. Registered in
`jacobi.INITIALISERS` (from `visar.accel`) as:

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
The test against the enumerated joint law (tests/test_zipar.py) holds for all three.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .jacobi import FillRequest, random_init


def neighbour_fill(request: FillRequest, above: bool, left: bool) -> tuple[Tensor, Tensor]:
    """Copy the known neighbour(s) of every slot (left to right, so later slots may copy earlier copies).

    request.draft_index < 0 marks a slot that needs no draft (its output is ignored).
    -> draft_tokens [B, G], draft_probs [B, G, V].
    """
    width = request.state.grid_size[1]
    vocab = request.state.vocab_size
    index = request.draft_index  # [B, G]
    tokens, probs = random_init(request)  # the fallback: uniform tokens, q uniform
    canvas = request.canvas.clone()  # [B, C] known tokens, -1 elsewhere; copies are written in as they are made
    last = canvas.shape[1] - 1
    choose_above = request.uniforms < 0.5  # [B, G]: the mixture's pick when both neighbours are known
    for g in range(index.shape[1]):
        slot = index[:, g]  # [B]
        valid = slot >= 0
        up = canvas.gather(1, (slot - width).clamp(0, last)[:, None])[:, 0]
        up = torch.where(valid & (slot >= width), up, -1) if above else torch.full_like(slot, -1)
        lt = canvas.gather(1, (slot - 1).clamp(0, last)[:, None])[:, 0]
        lt = torch.where(valid & (slot % width > 0), lt, -1) if left else torch.full_like(slot, -1)
        both = (up >= 0) & (lt >= 0)
        pick = torch.where(both, torch.where(choose_above[:, g], up, lt), torch.maximum(up, lt))  # -1: none known
        known = pick >= 0
        if not bool(known.any()):
            continue
        tokens[:, g] = torch.where(known, pick, tokens[:, g])
        # q: weight 1 on the one known neighbour, 1/2 on each of two (adding up to 1 when they agree)
        weight_up = torch.where(up >= 0, torch.where(both, 0.5, 1.0), 0.0)[:, None]
        weight_left = torch.where(lt >= 0, torch.where(both, 0.5, 1.0), 0.0)[:, None]
        copy_q = torch.zeros(slot.shape[0], vocab, device=probs.device)
        copy_q.scatter_add_(1, up.clamp(min=0)[:, None], weight_up)
        copy_q.scatter_add_(1, lt.clamp(min=0)[:, None], weight_left)
        probs[:, g] = torch.where(known[:, None], copy_q, probs[:, g])
        target = slot.clamp(0, last)[:, None]
        current = canvas.gather(1, target)  # a carried draft already there stays
        canvas.scatter_(1, target, torch.where((known & valid)[:, None] & (current < 0), pick[:, None], current))
    return tokens, probs


def above_init(request: FillRequest) -> tuple[Tensor, Tensor]:
    """The token one row up (q one-hot), else a uniform token."""
    return neighbour_fill(request, above=True, left=False)


def left_init(request: FillRequest) -> tuple[Tensor, Tensor]:
    """The token one column to the left in the same row (q one-hot), else a uniform token."""
    return neighbour_fill(request, above=False, left=True)


def above_left_init(request: FillRequest) -> tuple[Tensor, Tensor]:
    """The token above or the one to the left, 1/2 each (q the two-point mixture), else a uniform token."""
    return neighbour_fill(request, above=True, left=True)


SPATIAL_INITIALISERS = {"above": above_init, "left": left_init, "above-left": above_left_init}
