"""Where the speculative Jacobi engine's drafts come from (`chain.speculative_decode`), and how they carry over.

A `Proposer` gives each pass its draft tokens and the law q each was drawn from. `JacobiProposer`
carries the slots after a commit over as the next drafts, through an updater: SJD's fresh draws
from p (`independent_carry`) or MC-SJD's couplings with the old drafts (`maximal_coupling_carry`,
`GumbelCarry`); new slots come from a draft initialiser (`drafts.INITIALISERS`). A draft model's
proposer is draft_model.py's. Why a carried draft's q must be the p that produced it: docs/RASTER.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import VisarError
from ..core.acceptance import gumbel_coupling, keyed_uniforms
from ..core.sampling import sample_from_probs
from .drafts import FillRequest, made
from .slots import SlotState

# Rows of the per-iteration uniform block [B, 4 * window] each image draws from its generator (RESIDUAL
# and CARRY side by side: `Window.draw_rows` takes both in one slice).
ACCEPT, RESIDUAL, CARRY, DRAFT = range(4)
NUM_PURPOSES = 4
GUMBEL_NOISE = 1  # purpose id of the position-keyed Gumbel noise


@dataclass
class Window:
    """The shape of one iteration and the randomness each image drew for it."""

    window_len: Tensor  # [B] slots scored for each image: 1 (a plain AR step) .. window, 0 when done
    uniforms: Tensor  # [B, 4 * window]: the ACCEPT, RESIDUAL, CARRY and DRAFT rows side by side (`row`)
    max_drafts: int  # G, the draft slots of the pass (padding past an image's own window_len - 1)
    # the slots whose image has its first pass now (its condition is fed): every slot at a decode's
    # first pass, a running batch's new images later (`pass_loop.RunningBatch`)
    fresh: tuple[int, ...] = ()
    # What the plan's read-back told the host, so that a pass skips the masks it does not need:
    # every image's window has all G + 1 slots (none done, none clipped), and the fewest tokens
    # any image has committed (0 where the plan did not read it).
    full: bool = False
    least_committed: int = 0
    # [B, S] committed + j: the image index of slot j, for the pass's S >= G + 1 scored slots (the
    # chain engine's, made once a pass; None: made where needed)
    slot_index: Tensor | None = None
    # the most positions a draft model must catch up on before it drafts (`Proposer.catch_up_need`,
    # read back by the plan with the pass's shape; 0 for proposers without a model)
    catch_up: int = 0

    def row(self, purpose: int, length: int) -> Tensor:
        """[B, length] the uniforms of one purpose for the first `length` slots (one slice)."""
        start = purpose * (self.uniforms.shape[1] // NUM_PURPOSES)
        return self.uniforms[:, start : start + length]

    def draw_rows(self, length: int) -> Tensor:
        """[B, 2 * length] the RESIDUAL uniforms of the first `length` slots, then the CARRY ones: one
        slice where the pass spans the window (the two rows lie side by side), else a cat."""
        width = self.uniforms.shape[1] // NUM_PURPOSES
        if length == width:
            return self.uniforms[:, RESIDUAL * width : (CARRY + 1) * width]
        return torch.cat([self.row(RESIDUAL, length), self.row(CARRY, length)], 1)


class Proposer(Protocol):
    """Where drafts come from. `forward_passes` counts the proposer's own model calls."""

    forward_passes: int
    # the carry-over draws from p at every slot with the CARRY uniforms (SJD's): verification makes
    # that draw with its own and hands it to `after_commit` (p_draws)
    draws_from_p: bool

    def start(self, state: SlotState) -> None:
        """A decode starts: make what the proposer keeps, telling `state` what a new image resets there
        (`SlotState.per_slot`, `SlotState.parts`)."""
        ...

    def catch_up_need(self, state: SlotState) -> Tensor | None:
        """What the next `propose` must know on the host (a 0-d integer tensor the plan reads back with
        the pass's shape, into `Window.catch_up`), or None."""
        ...

    def propose(self, state: SlotState, window: Window) -> tuple[Tensor, Tensor]:
        """-> draft_tokens [B, G], draft_probs [B, G, V] for image indices committed + j, G = max_drafts."""
        ...

    def after_commit(
        self,
        state: SlotState,
        window: Window,
        target_probs: Tensor,
        slot_tokens: Tensor,
        commit_count: Tensor,
        slot_laws: Tensor,
        p_draws: Tensor | None = None,
    ) -> None:
        """Called with the pass's p [B, L, V], the output token of every slot [B, L], the commits [B]
        and the law each slot token follows [B, L, V] (p, or a relaxed rule's p~ at a verified draft),
        before `state.committed` moves on; p_draws [B, L]: the draw from p `draws_from_p` asks for,
        where the engine made it."""
        ...

    def close(self) -> None: ...


# -- carry-over updaters: the next drafts from this pass's p and slot outputs -------------------------


@dataclass
class CarryRequest:
    state: SlotState
    target_probs: Tensor  # [B, L, V] this pass's p at every slot
    slot_tokens: Tensor  # [B, L] the verified-or-resampled token of every slot (maximal coupling of (q, p))
    slot_laws: Tensor  # [B, L, V] the law each slot token follows: p, or LANTERN's p~ at a verified draft
    # [B, L] the absolute image-token index each slot predicts, and this iteration's carry uniforms of
    # each image; or functions that make them, called only by an updater that reads them
    index_source: Tensor | Callable[[], Tensor]
    uniform_source: Tensor | Callable[[], Tensor]
    p_draws: Tensor | None = None  # [B, L] the draw from p with those uniforms, where verification made it

    @property
    def slot_index(self) -> Tensor:
        return made(self, "index_source")

    @property
    def uniforms(self) -> Tensor:
        return made(self, "uniform_source")


# An updater returns the next drafts [B, L] and the law each was drawn from [B, L, V]: the next
# pass verifies a draft against the q recorded for it, so that q must be its true law.


def independent_carry(request: CarryRequest) -> tuple[Tensor, Tensor]:
    """SJD: a fresh draw from p at every slot, independent of the old draft (verification's, where it drew it)."""
    if request.p_draws is not None:
        return request.p_draws, request.target_probs
    return sample_from_probs(request.target_probs, request.uniforms), request.target_probs


def maximal_coupling_carry(request: CarryRequest) -> tuple[Tensor, Tensor]:
    """MC-SJD (pi_MC): the speculative test at every slot, no break; P(keep old draft) = 1 - TV(p, q).
    Under a relaxed rule (LANTERN) the slot token follows p~, and p~ is recorded as its law."""
    return request.slot_tokens, request.slot_laws


class GumbelCarry:
    """MC-SJD (pi_GS): Gumbel-max with noise keyed to (image key, absolute position).

    The rows of one pass [B, L, V] are kept for the next, whose slots mostly sit at the same
    positions: a row is hashed once while its position stays in a window, and the noise held is
    one pass's, whatever span of positions the engine's window covers (zipar's fronts spread a
    pass over the whole grid, where a ring indexed by position would need a row per position).
    """

    def __init__(self):
        self.noise: Tensor | None = None  # [B, L', V] the rows of the last pass
        self.row_position: Tensor | None = None  # [B, L'] the position of each row

    def __call__(self, request: CarryRequest) -> Tensor:
        vocab = request.target_probs.shape[-1]
        positions = request.slot_index  # [B, L]
        if self.noise is None:
            noise = keyed_uniforms(request.state.keys, positions, GUMBEL_NOISE, vocab)
        else:
            match = positions[:, :, None] == self.row_position[:, None, :]  # [B, L, L']
            noise = self.noise.gather(1, match.long().argmax(-1)[..., None].expand(-1, -1, vocab))
            fresh = ~match.any(-1)  # rows new to the window: hashed for every slot, kept where fresh (no sync)
            rows = keyed_uniforms(request.state.keys, positions, GUMBEL_NOISE, vocab)
            noise = torch.where(fresh[..., None], rows, noise)
        self.noise, self.row_position = noise, positions
        return gumbel_coupling(request.target_probs, noise), request.target_probs

    def forget(self, rows: Tensor):
        """Slots `rows` start new images (other keys): none of their held rows match a position."""
        if self.row_position is not None:
            self.row_position[rows] = -1


def forget_nothing(rows: Tensor) -> None:
    """`Carry.forget` of an updater that holds nothing from pass to pass."""


@dataclass(frozen=True)
class Carry:
    """How the slots past a commit become the next pass's drafts: `draw`, an updater (a CarryRequest ->
    the next drafts [B, M] and the law each was drawn from [B, M, V]), and `forget(rows)`, what slots
    [R] that a running batch refills make it drop of their old images (the Gumbel carry's noise rows;
    a stateless updater holds nothing). The chain, draft-tree and front engines carry with one."""

    draw: Callable[[CarryRequest], tuple[Tensor, Tensor]]
    forget: Callable[[Tensor], None] = forget_nothing

    def admit(self, rows: Tensor, images: Tensor):
        self.forget(rows)


FRESH_DRAWS = Carry(independent_carry)  # SJD's carry: stateless, so one object serves every decode
COUPLINGS = {"maximal": maximal_coupling_carry, "gumbel": GumbelCarry}
CARRIES = {"none": independent_carry, **COUPLINGS}  # what a relaxed method may carry over with


def carry_updater(coupling: str, method: str, choices: dict = COUPLINGS) -> Carry:
    """The carry-over named by a method's `coupling` option (a fresh Gumbel carry per decode: it keeps
    its last pass's noise rows by slot, which a refilled slot must drop)."""
    if not isinstance(coupling, str) or coupling not in choices:
        raise VisarError(f"unknown coupling {coupling!r} for {method}; use one of {', '.join(choices)}")
    updater = choices[coupling]
    if isinstance(updater, type):
        updater = updater()
        return Carry(updater, updater.forget)
    return Carry(updater)


class JacobiProposer:
    """Drafts from the previous pass (carried over by `carry`), new slots from `initialiser`."""

    def __init__(self, initialiser: Callable, carry: Carry):
        self.initialiser, self.carry = initialiser, carry
        self.draws_from_p = carry.draw is independent_carry
        self.forward_passes = 0

    def catch_up_need(self, state: SlotState) -> None:
        return None  # drafts come from the last pass: nothing to feed first

    def start(self, state: SlotState):
        batch, vocab, device = state.tokens.shape[0], state.vocab_size, state.tokens.device
        self.window = state.window
        self.slots = torch.arange(self.window, device=device)  # sliced each pass rather than made again
        self.slot_prefix = [self.slots[:n] for n in range(self.window + 1)]  # those slices, made once
        self.rows = torch.arange(batch, device=device)[:, None]  # [B, 1] each image's row, for indexing
        self.canvas_slots = torch.arange(state.tokens.shape[1], device=device)
        self.last_canvas: Tensor | None = None  # this pass's canvas, once built (`proposal_canvas`)
        self.carry_tokens = torch.zeros(batch, self.window, dtype=torch.long, device=device)
        self.carry_probs = torch.zeros(batch, self.window, vocab, device=device)
        self.carried = torch.zeros(batch, self.window, dtype=torch.bool, device=device)  # [B, C] slot holds a draft
        state.per_slot(False, self, "carried")  # a new image: nothing carried, and its carry holds nothing old
        state.parts.append(self.carry)

    def canvas(self, state: SlotState) -> Tensor:
        """[B, N + window] committed tokens and carried drafts at their indices, -1 elsewhere."""
        canvas = torch.where(self.canvas_slots < state.committed[:, None], state.tokens, -1)
        slots = self.slot_prefix[self.carry_tokens.shape[1]]  # the last pass's slots: every carried draft
        index = state.committed[:, None] + slots  # < N + window
        return canvas.scatter(1, index, torch.where(self.carried, self.carry_tokens, canvas.gather(1, index)))

    def proposal_canvas(self, state: SlotState) -> Tensor:
        """`canvas` as the last `propose` saw it (the carry-over moves only after the commit): built
        once a pass, by whichever of the initialiser and the caller asks first."""
        if self.last_canvas is None:
            self.last_canvas = self.canvas(state)
        return self.last_canvas

    def propose(self, state: SlotState, window: Window) -> tuple[Tensor, Tensor]:
        self.last_canvas = None
        num_slots = window.max_drafts
        # more slots than the last pass had (after a span of plain-AR passes)
        if num_slots > self.carry_tokens.shape[1]:
            more = num_slots - self.carry_tokens.shape[1]
            self.carry_tokens, self.carry_probs, self.carried = (
                F.pad(self.carry_tokens, (0, more)),
                F.pad(self.carry_probs, (0, 0, 0, more)),
                F.pad(self.carried, (0, more)),
            )
        draft_tokens, draft_probs, from_carry = self.carry_tokens, self.carry_probs, self.carried  # [B, G]
        if num_slots < draft_tokens.shape[1]:  # fewer slots than the last pass carried (the image's end)
            draft_tokens, draft_probs, from_carry = (x[:, :num_slots] for x in (draft_tokens, draft_probs, from_carry))
        if num_slots == 0:  # a pass of plain AR steps: no draft slots
            return draft_tokens, draft_probs
        # Every slot the carry-over does not cover is filled, padding past an image's window too (its
        # draft is never tested, and no real slot sees a padding slot's input): asking which slots
        # need a draft would cost ops, and whether any does would wait for the device.
        request = FillRequest(
            state,
            self.slot_index(state, window, num_slots),
            lambda: window.row(DRAFT, num_slots),
            lambda: self.proposal_canvas(state),
            above_committed=num_slots <= state.grid_size[1],
            sources_inside=window.least_committed >= state.grid_size[1],
            consecutive=True,
        )
        fill_tokens, fill_probs = self.initialiser(request)
        draft_tokens = torch.where(from_carry, draft_tokens, fill_tokens)
        if fill_probs.dtype != torch.bool:  # a bool one-hot (`FillRequest.sources_inside`) the where takes as 0 / 1
            fill_probs = fill_probs.to(draft_probs.dtype)
        draft_probs = torch.where(from_carry[..., None], draft_probs, fill_probs)
        return draft_tokens, draft_probs

    def after_commit(self, state, window, target_probs, slot_tokens, commit_count, slot_laws, p_draws=None):
        length = target_probs.shape[1]
        slot_index = lambda: self.slot_index(state, window, length)  # noqa: E731 (read by the Gumbel coupling only)
        uniforms = lambda: window.row(CARRY, length)  # noqa: E731 (read by SJD's fresh draws only)
        request = CarryRequest(state, target_probs, slot_tokens, slot_laws, slot_index, uniforms, p_draws)
        carry, law = self.carry.draw(request)
        # Slots commit_count .. window_len - 1 become drafts for the indices right after the new commit
        # (new tensors of this pass's length less one, as every image commits a token or is done; not
        # copies into the window's: the next pass has no more slots unless a plain-AR span ends, and
        # `propose` pads for those).
        source = commit_count[:, None] + self.slot_prefix[length - 1]  # [B, L - 1] the slot each carries
        shift = source.clamp(max=length - 1)
        self.carry_tokens = carry.gather(1, shift)
        self.carry_probs = law[self.rows, shift]  # [B, L - 1, V]: one index, not an expand and a gather
        # a carried slot holds a draft where its source lies in the window (every slot's is L long when full)
        self.carried = source < (length if window.full else window.window_len[:, None])

    def slot_index(self, state: SlotState, window: Window, length: int) -> Tensor:
        """[B, length] the image index of each slot: the plan's, else made here."""
        if window.slot_index is None:
            return state.committed[:, None] + self.slot_prefix[length]
        return window.slot_index[:, :length]

    def close(self):
        pass
