"""One pass of zipar's row fronts, as functions of each row's counts: which inputs the pass feeds
(`plan_pass`), what each may see (`visibility`) and is fed (`pass_inputs`), every predicting
slot's output (`front_outputs`), which commits hold (`valid_commits`) and which tokens have their
KV cached after it (`fed_after_pass`). The rules are in docs/RASTER.md (ZipAR section).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ....errors import VisarError
from ...core.acceptance import AcceptanceRule, verify_slots
from ...core.sampling import sample_from_probs
from ..pass_loop import power_of_two
from ..proposers import ACCEPT, RESIDUAL


def token_grid(model, method: str) -> tuple[int, int]:
    """(H, W) of the model's image-token grid; one VisarError if it has none."""
    grid = getattr(model, "grid_size", None)
    try:
        height, width = (int(g) for g in grid)
        ok = height >= 1 and width >= 1 and height * width == model.num_image_tokens
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise VisarError(
            f"{method} decodes the rows of a 2-D token grid, but {type(model).__name__} has none "
            f"(grid_size={grid!r}): it needs grid_size = (rows, columns) covering its image tokens"
        )
    return height, width


@dataclass(frozen=True)
class GridIndex:
    """The index tensors of an H x W grid that every pass reads, made once per decode (`grid_index`)."""

    height: int
    width: int
    positions: Tensor  # [N] image-token indices
    columns: Tensor  # [W]
    before_rows: Tensor  # [H] r * W - 1: the index before each row's first token


def grid_index(grid: tuple[int, int], device) -> GridIndex:
    height, width = grid
    positions = torch.arange(height * width, device=device)
    return GridIndex(height, width, positions, positions[:width], positions[::width] - 1)


@dataclass
class PassPlan:
    """The inputs of one pass for every image b, packed front by front (rows in order), M = the
    most inputs of any image (the rest of a row of the batch is padding)."""

    row: Tensor  # [B, M] the grid row of the front each input belongs to
    slot: Tensor  # [B, M] its place in the front's window: 0 = the front's last token (or a row start's input)
    input_index: Tensor  # [B, M] image-token index of the position it sits at (N - 1 for padding)
    predicts: Tensor  # [B, M] bool: its logits predict input_index + 1 (False: fed for its KV only, or padding)
    length: Tensor  # [B, M] its front's window (0: a row that only feeds; padding sits past its row's window)
    padding: Tensor  # [B, M] bool: no input (the image has fewer than M)
    drafts: bool  # some slot has a draft (some front's window has 2 slots or more)
    source: Tensor  # [B, M] image index of the token its input feeds (slot 0's: see `plan_pass`; others feed drafts)
    window_len: Tensor  # [B, H] slots of each row's predicting window, 0 = the row does not predict
    feed_only: Tensor  # [B, H] bool: the row only feeds its newest token (for its KV)
    # [B, H] bool: the row is complete and row r + 1 starts, whose input feeds its last token (or the
    # last row is complete: its last token is never read)
    fed_by_next: Tensor
    # Cross-row speculation: an input predicting (r, c) also sees the row above's drafts of this pass
    # at image indices above_start .. above_start + c + s - 1 - count[r - 1] (an empty range when
    # its prediction needs no draft, or for row 0 and row starts). All three None without cross-row drafts.
    above_start: Tensor | None = None  # [B, M] image index of row r - 1's first draft (N when none)
    above_drafts: Tensor | None = None  # [B, H] drafts row r - 1 feeds in this pass
    leans: Tensor | None = None  # [B, M] bool: predicts (r, c) with c + s - 1 past row r - 1's generated tokens
    need: Tensor | None = None  # [B, M] c + s - count[r - 1]: of row r - 1's drafts, how many it needs to hold
    drafting_fronts: int = 0  # the most fronts of any image whose window has 2 slots or more
    read: tuple[int, ...] = ()  # what `plan_pass` was asked to read back with the pass's width (`also_read`)
    # [B, M] bool: the next input is a draft for input_index + 1 (None when no front drafts: a pass of
    # plain fronts never reads it). Made by the plan, not on first use in the pass: a cached property's
    # lock would break the pass's graph under torch.compile.
    has_draft: Tensor | None = None

    @property
    def real(self) -> Tensor:
        return ~self.padding


def capped(length: Tensor, window: int | Tensor) -> Tensor:
    """length clamped to 0 .. window (an int, or a LongTensor broadcasting against length)."""
    return length.clamp(min=0, max=window) if isinstance(window, int) else length.clamp(min=0).minimum(window)


def compose_down(table: Tensor) -> Tensor:
    """Values that depend on the row above, top-down: table [B, H, D] holds each row's value as a
    function of the value of the row above (row r's entry x: its value when row r - 1's is x, every
    entry in 0 .. D - 1; row 0's a constant) -> [B, H], each row's value.

    Replaces the loop `value[r] = table[r, value[r - 1]]` over rows 1 .. H - 1 with ceil(log2 H)
    compositions, however the data looks (a Hillis-Steele scan): after the step of offset d, row r
    holds its function composed with the 2d - 1 above it. Rows r < d already hold the chain down to
    row 0's constant, and a constant composed with anything is itself, so the rows `roll` wraps
    around to them leave them as they are.
    """
    offset = 1
    while offset < table.shape[1]:
        table = table.gather(2, table.roll(offset, 1))
        offset *= 2
    return table[..., 0]


def windows_past_reach(
    count: Tensor, above: Tensor, plain_window: Tensor, width: int, s: int, cap: int | Tensor
) -> tuple[Tensor, Tensor]:
    """Cross-row windows: a started row's reach also counts the drafts the row above feeds in this
    pass, top-down (the row above's window is final before this row's is set). -> (window_len,
    above_drafts), both [B, H]; plain_window: the windows without cross-row drafts; cap: the window,
    an int or [B, 1, 1].

    A leaning row's window is capped(reach + max(window_len[r - 1] - 1, 0) - count[r]), a function of
    the window above, 0 .. W (a front's window never passes its row's end); `compose_down` chains
    those functions instead of a loop over the rows. Their entries are capped at W too, which changes
    none a chain reaches and keeps them inside 0 .. W.
    """
    leans = (count > 0) & (above < width)  # row starts (and row 0) keep the plain rule
    drafts = torch.arange(-1, width, device=count.device).clamp(min=0)  # [W + 1] drafts of an above window 0 .. W
    reach_past_count = above - count - (s - 1)  # reach - count where the row leans (above < W)
    cap = min(cap, width) if isinstance(cap, int) else cap.clamp(max=width)
    leaning = capped(reach_past_count[..., None] + drafts, cap)  # [B, H, W + 1]
    window_len = compose_down(torch.where(leans[..., None], leaning, plain_window[..., None]))
    above_drafts = (window_len.roll(1, 1) - 1).clamp(min=0) * leans  # row 0 never leans: roll's wrap is unread
    return window_len, above_drafts


def front_windows(
    count: Tensor, width: int, s: int, window: int | Tensor, cross_row: bool, start_lag: int | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Each row's predicting window at this count -> (window_len, above, above_drafts), [B, H] each:
    the slots from its count to its reach (at most `window`, an int or one per image [B]; 0 for a
    complete row or one the lag holds), above: the row above's count (W for row 0); above_drafts
    None without cross-row drafts. See `plan_pass`."""
    above = F.pad(count[:, :-1], (1, 0), value=width)  # [B, H]
    reach = above - (s - 1) * (above < width)  # W once the row above is complete
    if start_lag is not None and start_lag > s:
        # A row waits for start_lag tokens above before its first. Counts only grow, so a row whose
        # row above has fewer has not started: a reach of 0 keeps its window empty.
        reach = torch.where(above < min(start_lag, width), 0, reach)
    window_len = capped(reach - count, window if isinstance(window, int) else window[:, None])  # 0 when complete
    if not cross_row:
        return window_len, above, None
    table_cap = window if isinstance(window, int) else window[:, None, None]
    window_len, above_drafts = windows_past_reach(count, above, window_len, width, s, table_cap)
    return window_len, above, above_drafts


def plan_pass(
    count: Tensor,
    fed: Tensor,
    grid: tuple[int, int],
    s: int,
    window: int,
    cross_row: bool = False,
    index: GridIndex | None = None,
    also_read: tuple[Tensor, ...] = (),
    round_up: bool = False,
    start_lag: int | None = None,
) -> PassPlan:
    """count [B, H]: generated tokens of each row; fed [B, H]: how many of them have their KV cached;
    index: the grid's `GridIndex` (made here when None); also_read: 0-d integer tensors the engine
    needs on the host before the pass, read back with the pass's width (`PassPlan.read`), so that a
    pass has one host sync, here, and none inside it; round_up (compiled passes): the pass's width M
    and `drafting_fronts` rounded up to a power of two (the latter at most H), the rest padding, so
    that a compiled pass meets a few shapes, not one a pass.

    A row predicts columns count .. reach - 1 (at most `window` of them), where reach is the first
    column not yet allowed: W once the row above is complete, else (row above's count) - s + 1.
    start_lag (None: s; PJD's start lag, s its running lag): a row's first token also waits for
    start_lag tokens of the row above (a lag of s >= start_lag changes nothing).
    With `cross_row` a started row's reach also counts the drafts the row above feeds in this pass
    (top-down, so a front may lean on a chain of fronts above it): a slot past the plain reach
    predicts from those drafts and is kept only if they are accepted (see `valid_commits`).
    A row whose newest token has no KV yet and that does not predict feeds it alone (a finished
    row's last token, or a front waiting for the row above), unless the next row's start feeds it.
    """
    height, width = count.shape[1], grid[1]
    num_tokens = height * width
    index = grid_index(grid, count.device) if index is None else index
    window_len, above, above_drafts = front_windows(count, width, s, window, cross_row, start_lag)
    feed_only, fed_by_next = fed_alone(count, fed, window_len, width)
    inputs = window_len + feed_only  # [B, H] inputs of each row's front
    ends = inputs.cumsum(1)
    num_inputs, drafting, read = pass_width(ends, window_len, window, also_read)  # the pass's one host sync
    if round_up:
        # (drafting fronts at most the rows: the trees' scratch cache holds a side node set per row)
        num_inputs, drafting = power_of_two(num_inputs), min(power_of_two(drafting), height)
    m = torch.arange(num_inputs, device=count.device).expand(count.shape[0], -1).contiguous()
    row = torch.searchsorted(ends, m, right=True)  # [B, M]
    padding = row >= height
    row = row.clamp(max=height - 1)
    slot = m - (ends - inputs).gather(1, row)  # padding: past its row's inputs, so past its window
    newest = count + index.before_rows  # [B, H] each row's newest token
    # a front's slot 0 feeds the row's newest token; a row start sits at row r - 1's last column and
    # feeds row r - 1's newest token there (its true last token once the row is complete, else a stand-in)
    source = torch.where(count > 0, newest, F.pad(newest[:, :-1], (1, 0))).clamp(min=0).gather(1, row)
    length = window_len.gather(1, row)
    input_index = (newest.gather(1, row) + slot).masked_fill(padding, num_tokens - 1)
    predicts = slot < length
    above_start = leans = need = None  # without cross-row drafts no slot leans on the row above
    if cross_row:
        above_start, leans, need = leaning_slots(above, above_drafts, row, input_index, predicts, width, s)
    per_input = (row, slot, input_index, predicts, length, padding, drafting > 0, source)
    per_row = (window_len, feed_only, fed_by_next, above_start, above_drafts, leans, need)
    has_draft = slot + 1 < length if drafting else None
    return PassPlan(*per_input, *per_row, drafting, read, has_draft)


def pass_width(
    ends: Tensor, window_len: Tensor, window: int, also_read: tuple[Tensor, ...] = ()
) -> tuple[int, int, tuple[int, ...]]:
    """The pass width M (the most inputs of any image, ends [B, H] their cumulative counts by row), the
    most fronts of any image with a draft (a window of 2 slots or more) and `also_read`'s values (0-d
    integer tensors), read back together."""
    if window == 1 and not also_read:  # a window of one slot has no draft
        return int(ends.max()), 0, ()
    drafting = (window_len >= 2).sum(1).max() if window > 1 else torch.zeros_like(ends[0, 0])
    num_inputs, drafting, *read = torch.stack([ends.max(), drafting, *also_read]).tolist()
    return num_inputs, drafting, tuple(read)


def fed_alone(count: Tensor, fed: Tensor, window_len: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """-> `PassPlan`'s feed_only and fed_by_next [B, H]."""
    # row r complete and row r + 1 not started: count[r] - count[r + 1] = W, as counts lie in 0 .. W
    fed_by_next = count - F.pad(count[:, 1:], (0, 1)) == width
    # The last row, compared with a count of 0, is "fed by next" once complete: its last token is never
    # read. Every row above is fed by then (the last row's queries saw them), so no other row feeds.
    feed_only = (fed < count) & (window_len + fed_by_next == 0)  # neither predicts nor is fed by the next row
    return feed_only, fed_by_next


def leaning_slots(
    above: Tensor, above_drafts: Tensor, row: Tensor, input_index: Tensor, predicts: Tensor, width: int, s: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Cross-row fronts: `PassPlan`'s above_start, leans and need [B, M]. Row 0 has no drafts above
    (above_drafts 0)."""
    num_tokens = above.shape[1] * width
    above_count = above.gather(1, row)
    need = (input_index + 1) % width + s - above_count
    leans = predicts & (above_count < width) & (need > 0)
    sees_drafts = predicts & (above_drafts.gather(1, row) > 0)
    above_start = torch.where(sees_drafts, (row - 1) * width + above_count, num_tokens)
    return above_start, leans, need


def generated_mask(count: Tensor, width: int, index: GridIndex | None = None) -> Tensor:
    """count [B, H] -> [B, N] bool: image tokens generated so far (index: the grid's, or None)."""
    columns = torch.arange(width, device=count.device) if index is None else index.columns
    return (columns < count[..., None]).flatten(1)


@dataclass(frozen=True)
class PassContext:
    """What the inputs of one pass are fed from and may see (made by the plan, read by scoring)."""

    tokens: Tensor  # [B, N + 1] the generated tokens by image index (column N: scratch)
    generated: Tensor  # [B, N] bool: the image tokens generated before this pass
    s: int  # the lag
    index: GridIndex  # the grid's index tensors


def visibility(plan: PassPlan, generated: Tensor, s: int | None = None, index: GridIndex | None = None) -> Tensor:
    """Image-token slots each input may attend to: [B, M, N] bool.

    Input at index k sees (j <= k and j generated before this pass) or (j one of its front's
    drafts up to k) or j = k (its own input, a stand-in included); with cross-row speculation,
    also the row above's drafts of this pass that (r, c) = k + 1 needs: columns up to c + s - 1.
    """
    slots = torch.arange(generated.shape[1], device=generated.device) if index is None else index.positions
    k = plan.input_index[..., None]  # [B, M, 1]
    # (j <= k and generated) or (j <= k and j one of its front's drafts, which start at k - slot + 1);
    # padding (k = N - 1) sees what it may: nothing reads its outputs, and its KV goes to slot N - 1
    earlier_or_own = generated[:, None, :] | (slots > (plan.input_index - plan.slot)[..., None])
    visible = (slots <= k) & earlier_or_own | (slots == k)
    if plan.above_start is not None and s is not None:
        width = generated.shape[1] // plan.window_len.shape[1]
        # up to (r - 1, c + s - 1) for k + 1 = (r, c), and up to the last draft the row above feeds
        drafts_end = plan.above_start + plan.above_drafts.gather(1, plan.row)
        end = torch.minimum(plan.input_index + (s + 1 - width), drafts_end)  # [B, M], exclusive
        visible |= (slots >= plan.above_start[..., None]) & (slots < end[..., None])
    return visible


def pass_inputs(plan: PassPlan, tokens: Tensor, drafts: Tensor | None) -> Tensor:
    """The token fed at every input [B, M]: a generated token, a row start's stand-in, or a draft."""
    fed = tokens.gather(1, plan.source)
    if drafts is not None:  # slot i > 0 feeds the draft made for the slot before it
        fed = torch.where(plan.slot > 0, F.pad(drafts[:, :-1], (1, 0)), fed)
    return fed


def valid_commits(plan: PassPlan, accept: Tensor | None, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Which slots' outputs hold, and how many tokens each front commits.

    A front commits its leading accepted drafts and one token more (the output of its first slot
    not accepted). A slot predicting (r, c) holds if its context does: the row above is complete,
    or its columns up to c + s - 1 are generated tokens or drafts of this pass that row r - 1
    commits as drafts (rows top-down, so a chain of fronts is checked link by link). A slot that
    does not hold ends the commit before it, without the extra token: its draws used drafts that
    turned out wrong. Without cross-row speculation every predicting slot holds.

    A plan made without cross-row drafts (`plan.leans` None) has no slot leaning on the row above's
    drafts (a plain front stops at its reach), which the host knows without asking the device. With
    them the rows are checked link by link even when no slot happens to lean (the same result as the
    shortcut then, without reading the device back to find out), in a fixed number of steps
    (`compose_down`).

    accept: [B, M], None when no slot had a draft (`front_outputs`).
    -> valid [B, M], commits [B, H], good [B, H] (leading accepted slots that hold, per row).
    """
    if accept is None:  # no slot had a draft: every front predicts one slot, which commits its output
        return plan.predicts, plan.window_len, torch.zeros_like(count)  # window_len: 0 or 1
    never = plan.slot.shape[1] + 1
    if plan.leans is None:  # a plan without cross-row drafts: no slot leans on the row above's
        stop = plan.predicts & ~accept
        first = torch.full_like(count, never).scatter_reduce(
            1, plan.row, torch.where(stop, plan.slot, never), reduce="amin"
        )
        good = torch.where(plan.window_len > 0, first, 0)
        return plan.predicts, torch.where(plan.window_len > 0, first + 1, 0), good
    # A leaning slot predicting (r, c) holds when the row above's columns known after this pass reach
    # c + s - 1: count[r - 1] + good[r - 1] >= c + s, i.e. good[r - 1] >= need.
    good = compose_down(leading_held_table(plan, accept, plan.need, never))  # [B, H]
    holds = ~plan.leans | (good.roll(1, 1).gather(1, plan.row) >= plan.need)  # row 0 never leans: roll's wrap unread
    valid = plan.predicts & holds
    # the first stop held (a rejected draft, not a slot whose context failed): it commits its output too;
    # a stop that holds is a valid slot not accepted
    stop_held = valid & ~accept & (plan.slot == good.gather(1, plan.row))
    # counted in count's integer dtype: CUDA has no bool scatter_reduce (a bool one ran on CPUs only)
    stop_holds = torch.zeros_like(count).scatter_reduce(1, plan.row, stop_held.to(count.dtype), reduce="amax")
    commits = (good + stop_holds) * (plan.window_len > 0)
    return valid, commits, good


def leading_held_table(plan: PassPlan, accept: Tensor, need: Tensor, never: int) -> Tensor:
    """Each row's leading accepted slots that hold, as a function of the row above's (`compose_down`'s
    table): entry y of row r is good[r] when good[r - 1] = y, for y in 0 .. never (never = M + 1: no
    stop) -> [B, H, never + 1]. The loop it replaces, for each row top-down: a slot stops the commit
    if it is not accepted or leans with good[r - 1] < need; good[r] = its first stop (0 for a row that
    does not predict). Row 0 leans on nothing, so its entries are one constant."""
    batch, height = plan.window_len.shape
    above_good = torch.arange(never + 1, device=need.device)  # [D] every value good[r - 1] may take
    fails = plan.leans[..., None] & (above_good < need[..., None])  # [B, M, D]
    stop = (plan.predicts & ~accept)[..., None] | fails  # leaning slots predict
    first = torch.where(stop, plan.slot[..., None], never)
    table = torch.full((batch, height, never + 1), never, dtype=torch.long, device=need.device)
    table.scatter_reduce_(1, plan.row[..., None].expand_as(first), first, reduce="amin")
    return table * (plan.window_len > 0)[..., None]


def front_outputs(rule: AcceptanceRule, plan: PassPlan, target_probs: Tensor, draft) -> tuple[Tensor, Tensor]:
    """Every predicting slot's output: its draft if the test accepts it, else a draw from the
    residual (from p where no draft follows). draft: the pass's `engine.PassDraft` (drafts [B, M], their
    laws, the Jacobi block [B, 4, M], each slot's draw [B, M]). -> (slot_tokens [B, M], accept [B, M],
    None without drafts)."""
    if draft.tokens is None:  # plain fronts, or no slot with a draft: a draw with each input's uniform
        return sample_from_probs(target_probs, draft.draws), None
    uniforms = draft.uniforms
    verdict = verify_slots(
        rule, target_probs, draft.tokens, draft.probs, plan.has_draft, uniforms[:, ACCEPT], uniforms[:, RESIDUAL]
    )
    return verdict.tokens, verdict.accept


def fed_after_pass(plan: PassPlan, fed: Tensor, count: Tensor, commits: Tensor) -> Tensor:
    """[B, H] tokens of each row with their KV cached after this pass: a front's input and its
    accepted drafts (all it commits but the newest), a fed-only newest token, a row's true last token
    fed by the next row's start (those two rows commit nothing, and have all their tokens cached)."""
    fed = torch.where(plan.feed_only | plan.fed_by_next, count, fed)
    return torch.where(plan.window_len > 0, count + commits - 1, fed)
