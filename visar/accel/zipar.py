"""Next-set decoding of raster models: ZipAR, ZipAR with speculative Jacobi row fronts, and the exact wavefront.

Papers and the code the schedule was checked against (details and the released code's flaws in
../shared/research/parallel_family.md, sections 1 and 4):
- ZipAR: He et al., "ZipAR: Parallel Auto-regressive Image Generation through Spatial Locality",
  ICML 2025 (arXiv 2412.04062); ThisisBillhe/ZipAR, `LlamaGen-ZipAR/autoregressive/models/generate_zipar.py`
  (the schedule) and `Lumina-mGPT-ZipAR/lumina_mgpt/model/chameleon/modeling_chameleon.py` (the
  visibility rule kept here).
- Wavefront (staggered) decoding: HEVC wavefront parallel processing; ParallelNeLLoC (arXiv 2201.05213).

Schedule. Image tokens sit on an H x W grid in raster order. Token (r, c) may be predicted once
row r - 1 has min(c + s, W) tokens (s: the window), so row r + 1 starts once row r has s tokens,
and every started, unfinished row (a front) advances in the same forward pass. One token per
front and pass puts (r, c) in pass 1 + c + r * s (pass 1 is the condition prefill): the image
takes W + (H - 1) * min(s, W) passes (136 at 16x16 and s = 8, 76 at s = 4; plain AR's H * W
when s >= W). The released LlamaGen port decodes row 0 alone and needs 2W + (H - 2) s (144).

Visibility. A query predicting (r, c) sees the condition, its own input, and exactly the tokens
before (r, c) in raster order that were generated before this pass. The mask is built per query
from that rule; KV slots of tokens not generated yet are masked out, never attended as zeros
(the LlamaGen port's flaw).

Row starts. In raster order (r, 0) is predicted by the query at (r - 1, W - 1), whose input
does not exist yet when s < W. That pass feeds a stand-in there, the last generated token of
row r - 1, at the position of (r - 1, W - 1) (the RoPE geometry stays raster's). No other query
sees its KV slot, and the pass after row r - 1 finishes feeds the true last token there (for its
KV only), as it does for every finished row, so no stand-in KV outlives its row.

What is approximated (zipar is lossy): (r, c) does not see the part of the rows above that is not
generated yet ((r - 1, c + s ..) at the lag s), the row start sees a stand-in input instead of
(r - 1, W - 1), and a token's KV is computed once, with the context it had when it was fed.
With s >= W nothing is approximated: the schedule, masks and draws are plain AR's.

Jacobi fronts (`zipar-sjd`, `zipar-mc-sjd`, `zipar-gsd`). Each front runs a speculative Jacobi
window along its row: its last generated token then drafts for the next columns, clipped at the
row end and so that (r, c) is still predicted only once row r - 1 has min(c + s, W) tokens. A
front's drafts are visible to its own later slots only. Each front verifies with an acceptance
rule and commits 1..L tokens on its own; drafts come from `jacobi.INITIALISERS` (the row above is
already generated, so "above" is the natural 2-D draft) and are carried with jacobi.py's
updaters. With the speculative test (sjd, mc-sjd) a front samples exactly its own masked
conditional, so the combination approximates what zipar approximates, at the contexts the fronts
have when they commit (faster upper rows give lower rows more context); with s >= W it is
lossless (tested against the exact joint law). GSD's grouped test adds its own, unbounded,
approximation. The first pass is the condition prefill alone (one token), as in zipar.

Wavefront. A model that declares `dependency_reach = R` promises a local attention pattern: at
every layer the position that predicts (r, c) reads only the condition and the positions of the
tokens of the rows above in columns <= c + R and of the tokens left of (r, c) in its row, and a
row's last token is never read (a row start's query sits at that position before the token
exists). Then every position zipar with s = R + 1 computes reads the same keys, with the same
values, as in raster order: `wavefront` gives plain AR's tokens in W + (R + 1)(H - 1) passes.

Randomness. Plain fronts (zipar, wavefront): each image draws its N uniforms at the start, in
raster order, exactly those ar.py draws, and token i uses uniform i. Jacobi fronts: one 32-bit
key per image (position-keyed Gumbel noise), then a fixed block [4, H, window] per pass from the
image's own generator. Either way an image's tokens do not depend on the rest of its batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..errors import VisarError
from .acceptance import SPECULATIVE, AcceptanceRule, grouped_accept, lossless, speculative_residual
from .ar import with_null_condition
from .jacobi import (
    ACCEPT,
    CARRY,
    COUPLINGS,
    DRAFT,
    NUM_PURPOSES,
    RESIDUAL,
    CarryRequest,
    DecodeState,
    FillRequest,
    check_spans,
    independent_carry,
    random_init,
    resolve_initialiser,
)
from .relaxed import check_number, codebook_of
from .sampling import SamplingParams, draw_uniforms, logits_to_probs, sample_from_probs, split_cfg


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


def check_lag(s) -> int:
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise VisarError(
            f"s (the ZipAR window: tokens of a row before the next starts) must be an integer >= 1, got {s!r}"
        )
    return s


# -- one pass: which inputs, and what each may see -------------------------------------------------------


@dataclass
class PassPlan:
    """The inputs of one pass for every image b, packed front by front (rows in order), M = the
    most inputs of any image (the rest of a row of the batch is padding)."""

    row: Tensor  # [B, M] the grid row of the front each input belongs to
    slot: Tensor  # [B, M] its place in the front's window: 0 = the front's last token (or a row start's input)
    input_index: Tensor  # [B, M] image-token index of the position it sits at (N - 1 for padding)
    predicts: Tensor  # [B, M] bool: its logits predict input_index + 1 (False: fed for its KV only, or padding)
    has_draft: Tensor  # [B, M] bool: the next input is a draft for input_index + 1
    draft_start: Tensor  # [B, M] first draft index of its front (N when it has none)
    real: Tensor  # [B, M] bool, False for padding
    window_len: Tensor  # [B, H] slots of each row's predicting window, 0 = the row does not predict
    feed_only: Tensor  # [B, H] bool: the row only feeds its newest token (for its KV)
    true_start: Tensor  # [B, H] bool: the row starts, and row r - 1 is complete (its true last token is fed)


def plan_pass(count: Tensor, fed: Tensor, grid: tuple[int, int], s: int, window: int) -> PassPlan:
    """count [B, H]: generated tokens of each row; fed [B, H]: how many of them have their KV cached.

    A row predicts columns count .. reach - 1 (at most `window` of them), where reach is the first
    column not yet allowed: W once the row above is complete, else (row above's count) - s + 1.
    A row whose newest token has no KV yet and that does not predict feeds it alone (a finished
    row's last token, or a front waiting for the row above), unless the next row's start feeds it.
    """
    batch, height = count.shape
    width = grid[1]
    num_tokens = height * width
    device = count.device
    rows = torch.arange(height, device=device)
    above = torch.cat([torch.full_like(count[:, :1], width), count[:, :-1]], 1)  # [B, H]
    reach = torch.where(above >= width, width, above - s + 1)
    window_len = (reach - count).clamp(min=0, max=window)  # 0 for a complete row, as reach <= W
    true_start = (window_len > 0) & (count == 0) & (rows > 0) & (above >= width)
    fed_by_next = torch.cat([true_start[:, 1:], torch.zeros_like(true_start[:, :1])], 1)
    unfinished = count[:, -1:] < width  # the last row finishes last
    needs_kv = (fed < count) & unfinished & ~((rows == height - 1) & (count == width))
    feed_only = needs_kv & (window_len == 0) & ~fed_by_next
    inputs = window_len + feed_only.long()  # [B, H] inputs of each row's front
    ends = inputs.cumsum(1)
    num_inputs = int(ends[:, -1].max())  # the pass width (a host sync)
    m = torch.arange(num_inputs, device=device).expand(batch, -1).contiguous()
    row = torch.searchsorted(ends, m, right=True)  # [B, M]
    real = row < height
    row = row.clamp(max=height - 1)
    slot = m - (ends - inputs).gather(1, row)
    done = count.gather(1, row)
    length = window_len.gather(1, row)
    input_index = torch.where(real, row * width + done - 1 + slot, num_tokens - 1)
    predicts = real & (length > 0)
    has_draft = predicts & (slot < length - 1)
    draft_start = torch.where(predicts, row * width + done, num_tokens)
    return PassPlan(row, slot, input_index, predicts, has_draft, draft_start, real, window_len, feed_only, true_start)


def generated_mask(count: Tensor, width: int) -> Tensor:
    """count [B, H] -> [B, N] bool: image tokens generated so far."""
    columns = torch.arange(width, device=count.device)
    return (columns[None, None, :] < count[:, :, None]).flatten(1)


def visibility(plan: PassPlan, generated: Tensor) -> Tensor:
    """Image-token slots each input may attend to: [B, M, N] bool.

    Input at index k sees (j <= k and j generated before this pass) or (j one of its front's
    drafts up to k) or j = k (its own input, a stand-in included).
    """
    slots = torch.arange(generated.shape[1], device=generated.device)
    k = plan.input_index[..., None]  # [B, M, 1]
    earlier = (slots <= k) & generated[:, None, :] & plan.real[..., None]
    own_drafts = (slots >= plan.draft_start[..., None]) & (slots <= k)
    return earlier | own_drafts | (slots == k)


def pass_inputs(
    plan: PassPlan, tokens: Tensor, count: Tensor, generated: Tensor, width: int, drafts: Tensor | None
) -> Tensor:
    """The token fed at every input [B, M]: a generated token, a row start's stand-in, or a draft."""
    k = plan.input_index.clamp(min=0)
    row_above = (plan.row - 1).clamp(min=0)
    stand_in = row_above * width + count.gather(1, row_above) - 1  # row r - 1's last generated token
    source = torch.where(generated.gather(1, k), k, stand_in.clamp(min=0))
    fed = tokens.gather(1, source)
    if drafts is not None:  # slot i > 0 feeds the draft made for the slot before it
        previous = torch.cat([drafts[:, :1], drafts[:, :-1]], 1)
        fed = torch.where(plan.slot > 0, previous, fed)
    return fed


# -- the engine -------------------------------------------------------------------------------------------


class CarriedDrafts:
    """Drafts left by earlier passes, by image-token index, each with the q it was drawn from.

    Column N is scratch, for writes that must go nowhere.
    """

    def __init__(self, batch: int, num_tokens: int, vocab: int, device):
        self.num_tokens = num_tokens
        self.tokens = torch.zeros(batch, num_tokens + 1, dtype=torch.long, device=device)
        self.probs = torch.zeros(batch, num_tokens + 1, vocab, device=device)
        self.valid = torch.zeros(batch, num_tokens + 1, dtype=torch.bool, device=device)

    def propose(
        self, plan: PassPlan, state: DecodeState, target: Tensor, generated: Tensor, initialiser, uniforms: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Drafts for every slot that has one: carried if a pass left one, else the initialiser's.

        -> draft_tokens [B, M], draft_probs [B, M, V] (entries of slots without a draft are ignored).
        """
        vocab = self.probs.shape[-1]
        carried = plan.has_draft & self.valid.gather(1, target)
        draft_tokens = self.tokens.gather(1, target)
        draft_probs = self.probs.gather(1, target[..., None].expand(-1, -1, vocab))
        needs_fill = plan.has_draft & ~carried
        if bool(needs_fill.any()):
            # What a 2-D initialiser may copy from: generated tokens and carried drafts, -1 elsewhere.
            canvas = torch.where(self.valid, self.tokens, -1)
            canvas[:, : self.num_tokens] = torch.where(generated, state.tokens[:, : self.num_tokens], canvas[:, :-1])
            request = FillRequest(state, torch.where(needs_fill, target, -1), uniforms, canvas)
            fill_tokens, fill_probs = initialiser(request)
            draft_tokens = torch.where(needs_fill, fill_tokens, draft_tokens)
            draft_probs = torch.where(needs_fill[..., None], fill_probs.to(draft_probs.dtype), draft_probs)
        return draft_tokens, draft_probs

    def store(self, index: Tensor, tokens: Tensor, probs: Tensor):
        """index [B, M] (N: nowhere), tokens [B, M], probs [B, M, V]."""
        self.tokens.scatter_(1, index, tokens)
        self.probs.scatter_(1, index[..., None].expand(-1, -1, probs.shape[-1]), probs)
        self.valid.scatter_(1, index, torch.ones_like(index, dtype=torch.bool))
        self.valid[:, self.num_tokens] = False


@torch.no_grad()
def decode_fronts(
    model,
    cond: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    *,
    s: int,
    window: int = 1,
    initialiser: Callable = random_init,
    updater: Callable = independent_carry,
    rule: AcceptanceRule = SPECULATIVE,
    cond_mask: Tensor | None = None,
    progress: bool = False,
    method: str = "zipar",
) -> tuple[Tensor, dict]:
    """Decode all row fronts of every image together; window 1 = plain zipar. -> (tokens [B, N], stats)."""
    start_time = time.perf_counter()
    height, width = token_grid(model, method)
    check_lag(s)
    check_spans(window, 0, 0)
    window = min(window, width)
    batch = cond.shape[0]
    num_cond, num_tokens, vocab = model.num_condition_tokens, model.num_image_tokens, model.vocab_size
    device = model.output.weight.device
    speculative = window > 1
    if speculative:
        keys = torch.stack([torch.randint(0, 2**32, (1,), generator=g) for g in generators])[:, 0].to(device)
        carried = CarriedDrafts(batch, num_tokens, vocab, device)
    else:
        keys = torch.zeros(batch, dtype=torch.long, device=device)
        position_uniforms = draw_uniforms(generators, num_tokens).to(device)  # [B, N]: ar.py's draws, in order
    tokens = torch.zeros(batch, num_tokens + 1, dtype=torch.long, device=device)  # column N: scratch
    count = torch.zeros(batch, height, dtype=torch.long, device=device)
    fed = torch.zeros(batch, height, dtype=torch.long, device=device)
    # What initialisers and updaters read; window = N because one pass spans up to the whole grid
    # (GumbelCarry's noise ring then holds one row per position).
    state = DecodeState(tokens, count.sum(1), keys, num_tokens, vocab, (height, width), num_tokens)
    full_cond, full_mask = with_null_condition(model, cond, cond_mask, params)
    model.setup_cache(full_cond.shape[0], num_cond + num_tokens, full_mask)
    passes_per_image = torch.zeros(batch, dtype=torch.long, device=device)
    drafts_tested = torch.zeros((), dtype=torch.long, device=device)
    drafts_accepted = torch.zeros((), dtype=torch.long, device=device)
    forward_passes = 0
    max_fronts = torch.zeros((), dtype=torch.long, device=device)
    bar = tqdm(total=num_tokens, disable=not progress, desc=method, leave=False)
    try:
        while True:
            first = forward_passes == 0
            plan = plan_pass(count, fed, (height, width), s, 1 if first else window)
            if plan.row.shape[1] == 0:
                break
            max_fronts = torch.maximum(max_fronts, (plan.window_len > 0).sum(1).max())
            generated = generated_mask(count, width)
            state.committed = count.sum(1)
            target = plan.input_index + 1  # [B, M] image index each input predicts (N: scratch)

            draft_tokens = draft_probs = None
            if speculative:  # each image's block [4, H, window], read at (purpose, row, slot) of every input
                block = (
                    draw_uniforms(generators, NUM_PURPOSES * height * window).to(device).view(batch, NUM_PURPOSES, -1)
                )
                lane = (plan.row * window + plan.slot.clamp(max=window - 1))[:, None].expand(-1, NUM_PURPOSES, -1)
                uniforms = block.gather(2, lane)  # [B, 4, M]
                if bool(plan.has_draft.any()):
                    draft_tokens, draft_probs = carried.propose(
                        plan, state, target, generated, initialiser, uniforms[:, DRAFT]
                    )

            if first:  # the condition prefill predicts token 0
                logits = model(cond=full_cond, input_pos=torch.arange(num_cond, device=device))[:, -1:]
            else:
                feed = pass_inputs(plan, tokens, count, generated, width, draft_tokens)
                visible = visibility(plan, generated)  # [B, M, N]
                condition = torch.ones(*visible.shape[:2], num_cond, dtype=torch.bool, device=device)
                mask = torch.cat([condition, visible], -1)
                input_pos = num_cond + plan.input_index
                if params.uses_cfg:
                    feed, input_pos, mask = (torch.cat([x, x]) for x in (feed, input_pos, mask))
                mask = mask & model.cache_key_valid[:, None, :]  # padded caption slots stay hidden
                logits = model(feed, input_pos=input_pos, mask=mask)
            forward_passes += 1
            target_probs = logits_to_probs(split_cfg(logits, params), params)  # [B, M, V]

            # Every predicting slot's output: its draft if the test accepts it, else a draw from the
            # residual (from p where no draft follows). Plain fronts: a draw with the position's uniform.
            if draft_tokens is not None:
                # A relaxed rule (LANTERN) verifies against p~; slots without a draft and the carry keep p.
                verified = target_probs if rule.relax is None else rule.relax(target_probs, draft_probs, draft_tokens)
                accept = plan.has_draft & rule.accept(verified, draft_probs, draft_tokens, uniforms[:, ACCEPT])
                residual = torch.where(plan.has_draft[..., None], rule.residual(verified, draft_probs), target_probs)
                slot_tokens = torch.where(accept, draft_tokens, sample_from_probs(residual, uniforms[:, RESIDUAL]))
            else:
                accept = torch.zeros_like(plan.predicts)
                if speculative:
                    draw = uniforms[:, RESIDUAL]
                else:
                    draw = position_uniforms.gather(1, target.clamp(max=num_tokens - 1))
                slot_tokens = sample_from_probs(target_probs, draw)

            # A front commits its leading accepted drafts and one token more (its first slot not accepted).
            stop = plan.predicts & ~accept
            first_stop = torch.full_like(count, window).scatter_reduce(
                1, plan.row, torch.where(stop, plan.slot, window), reduce="amin"
            )
            commits = torch.where(plan.window_len > 0, first_stop + 1, 0)  # [B, H]
            lane_commits = commits.gather(1, plan.row)
            keep = plan.predicts & (plan.slot < lane_commits)
            tokens.scatter_(1, torch.where(keep, target, num_tokens), slot_tokens)
            drafts_tested += (plan.has_draft & (plan.slot < lane_commits)).sum()
            drafts_accepted += (plan.has_draft & (plan.slot < lane_commits - 1)).sum()
            passes_per_image += (count[:, -1] < width).long()

            if speculative:  # the slots after a front's commit become drafts for the same indices
                request = CarryRequest(
                    state, target_probs, slot_tokens, target.clamp(max=num_tokens - 1), uniforms[:, CARRY]
                )
                after = torch.where(plan.predicts & (plan.slot >= lane_commits), target, num_tokens)
                carried.store(after, updater(request), target_probs)

            # KV cached by this pass: a front's input and its accepted drafts, a fed-only newest token,
            # a row's true last token fed by the next row's start.
            fed = torch.where(plan.window_len > 0, count + commits - 1, fed)
            fed = torch.where(plan.feed_only, count, fed)
            fed_by_next = torch.cat([plan.true_start[:, 1:], torch.zeros_like(plan.true_start[:, :1])], 1)
            fed = torch.where(fed_by_next, width, fed)
            count = count + commits
            if progress:
                bar.update(int(count.sum(1).min()) - bar.n)
    finally:
        bar.close()
        model.clear_cache()
    elapsed = time.perf_counter() - start_time
    stats = {
        "forward_passes": forward_passes,
        "tokens_per_forward": float((num_tokens / passes_per_image.double()).mean()),
        "latency_s": elapsed,
        "forward_passes_per_image": passes_per_image.tolist(),
        "s": s,
        "max_fronts": int(max_fronts),
    }
    if speculative:
        stats["window"] = window
        stats["acceptance_rate"] = float(drafts_accepted) / max(int(drafts_tested), 1)
    return tokens[:, :num_tokens], stats


# -- the registered methods --------------------------------------------------------------------------------


def zipar(
    model,
    cond: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    *,
    cond_mask: Tensor | None = None,
    progress: bool = False,
    s: int = 8,
) -> tuple[Tensor, dict]:
    """ZipAR next-set decoding (He et al. 2025): row r + 1 starts once row r has s tokens, and every
    started row advances one token per pass, in W + (H - 1) * min(s, W) passes. Lossy for s < W
    (see the module docstring); with s >= W it is plain AR, token for token.

    s: the window, an integer >= 1 (the released code's default is 8).
    """
    return decode_fronts(model, cond, params, generators, s=s, cond_mask=cond_mask, progress=progress)


def zipar_sjd(
    model,
    cond: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    *,
    cond_mask: Tensor | None = None,
    progress: bool = False,
    s: int = 8,
    window: int = 16,
    init: str | Callable = "random",
) -> tuple[Tensor, dict]:
    """ZipAR whose row fronts each run a speculative Jacobi window (SJD: fresh drafts from p).

    s: the ZipAR window; window: slots per front and pass (clipped at the row end and by the lag
    s); init: the draft initialiser for new slots ("random", "above", "left", "above-left").
    Lossy for s < W as zipar is; lossless for s >= W.
    """
    token_grid(model, "zipar-sjd")
    initialiser = resolve_initialiser(init)
    return decode_fronts(
        model,
        cond,
        params,
        generators,
        s=s,
        window=window,
        initialiser=initialiser,
        updater=independent_carry,
        cond_mask=cond_mask,
        progress=progress,
        method="zipar-sjd",
    )


def zipar_mc_sjd(
    model,
    cond: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    *,
    cond_mask: Tensor | None = None,
    progress: bool = False,
    s: int = 8,
    window: int = 16,
    coupling: str = "maximal",
    init: str | Callable = "random",
) -> tuple[Tensor, dict]:
    """ZipAR whose row fronts each run a coupled speculative Jacobi window (MC-SJD).

    coupling: "maximal" or "gumbel" (noise keyed to image and absolute position); other options
    as zipar-sjd.
    """
    token_grid(model, "zipar-mc-sjd")
    initialiser = resolve_initialiser(init)
    if coupling not in COUPLINGS:
        raise VisarError(f"unknown coupling {coupling!r} for zipar-mc-sjd; use one of {', '.join(COUPLINGS)}")
    updater = COUPLINGS[coupling]
    updater = updater() if isinstance(updater, type) else updater
    tokens, stats = decode_fronts(
        model,
        cond,
        params,
        generators,
        s=s,
        window=window,
        initialiser=initialiser,
        updater=updater,
        cond_mask=cond_mask,
        progress=progress,
        method="zipar-mc-sjd",
    )
    return tokens, {**stats, "coupling": coupling}


def zipar_gsd(
    model,
    cond: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    *,
    cond_mask: Tensor | None = None,
    progress: bool = False,
    tokenizer=None,
    s: int = 8,
    group_size: int = 14,
    prob_gap: float = 0.15,
    max_distance: float = 0.05,
    window: int = 16,
    init: str | Callable = "random",
) -> tuple[Tensor, dict]:
    """ZipAR whose row fronts each run a GSD window: SJD drafts, verified with GSD's grouped test
    (relaxed.py; lossy even for s >= W). group_size, prob_gap, max_distance as `gsd`; tokenizer:
    the model's VQ tokenizer (or its codebook [V, C]), passed by Pipeline.generate; other options
    as zipar-sjd.
    """
    token_grid(model, "zipar-gsd")
    check_lag(s)
    check_number("group_size", group_size, 1, integer=True)
    check_number("prob_gap", prob_gap, 0)
    check_number("max_distance", max_distance, 0)
    initialiser = resolve_initialiser(init)
    book = codebook_of(tokenizer, model.vocab_size, "zipar-gsd").to(model.output.weight.device)
    accept = lossless(False)(
        partial(grouped_accept, codebook=book, group_size=group_size, prob_gap=prob_gap, max_distance=max_distance)
    )
    tokens, stats = decode_fronts(
        model,
        cond,
        params,
        generators,
        s=s,
        window=window,
        initialiser=initialiser,
        updater=independent_carry,
        rule=AcceptanceRule(accept, speculative_residual),
        cond_mask=cond_mask,
        progress=progress,
        method="zipar-gsd",
    )
    return tokens, {**stats, "group_size": group_size, "prob_gap": prob_gap, "max_distance": max_distance}


def wavefront(
    model,
    cond: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    *,
    cond_mask: Tensor | None = None,
    progress: bool = False,
) -> tuple[Tensor, dict]:
    """Exact wavefront decoding of a model whose dependence is known local.

    The model must declare `dependency_reach = R` (an int >= 0; the module docstring states the
    local attention pattern it promises). Tokens (r, c) with equal c + (R + 1) r come out of one
    pass, W + (R + 1)(H - 1) passes in all, and the tokens are plain AR's (same per-position draws).
    """
    token_grid(model, "wavefront")
    reach = getattr(model, "dependency_reach", None)
    if isinstance(reach, bool) or not isinstance(reach, int) or reach < 0:
        raise VisarError(
            f"wavefront is exact only for a model whose dependence is known local, declared as "
            f"model.dependency_reach = R (columns to the right in the rows above, an integer >= 0); "
            f"{type(model).__name__} declares {reach!r}: use zipar for a model with global attention"
        )
    tokens, stats = decode_fronts(
        model, cond, params, generators, s=reach + 1, cond_mask=cond_mask, progress=progress, method="wavefront"
    )
    return tokens, {**stats, "dependency_reach": reach}
