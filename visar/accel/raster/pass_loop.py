"""The raster pass loop: every raster decode that drafts is this one loop over passes (`decode_passes`).

What differs between the shapes of pass is a `PassEngine`: `ChainPasses` (chain.py: sjd, mc-sjd,
spec, gsd, lantern), `DraftTreePasses` (tree_passes.py: sjd-pac, tree-mc-sjd), `StaticTreePasses`
(static_tree.py: lantern++) and `FrontPasses` (zipar/engine.py: the zipar family, wavefront). Every
pass of a decode has the engine's one size (a method's `budget=N` sets it): sizes chosen pass by
pass lost to the best fixed size on every method they ran, and `auto` chooses among fixed sizes by
timing them (docs/SPEED.md).

A running batch (`Request.slots`, `RunningBatch`) decodes `slots` images of a longer queue at once,
a finished image's slot taken by the next before the next pass, so no slot feeds padding for a
finished image while the queue lasts. The queue is an `ImageSource`: a call's fixed list is one
closed from the start; an open one (`Request.source`) takes images while the batch decodes, from
any thread, until it is closed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from ...progress import progress_bar
from ..core.source import ImageSource
from .slots import SlotState


class PassEngine(Protocol):
    """One shape of pass. It reads and writes the decode's `SlotState` (slots.py), given at its
    construction; the loop, not the engine, starts images in slots and hands finished ones over.

    `with engine:` holds what a decode holds open (the KV cache, a draft model's); `plan()` is the
    next pass's shape (None: every image is done), the pass's one read-back of the device; `step(plan)`
    is the pass: propose drafts, score them in one model call (or one per group of a refill pass),
    verify them under the acceptance rule, commit the pass's tokens and statistics, carry drafts over
    and trim the cache, traced as one graph (`run_pass`); `stats()` the decode's statistics.

    An image's first pass is the loop's next pass after it takes its slot (`SlotState.fresh`): an
    engine that scores the condition with the pass's drafts (chain, draft trees) does so in `step`;
    one whose first step is a plain AR step (static trees, fronts) takes that step in `plan`, before
    it shapes the pass.
    """

    def __enter__(self) -> PassEngine: ...

    def __exit__(self, *exc) -> None: ...

    def plan(self) -> Any | None: ...

    def step(self, plan) -> None: ...

    def stats(self) -> dict: ...


def power_of_two(n: int) -> int:
    """The least power of two >= n (0 stays 0): the widths a pass is padded to, so that scoring (and a
    compiled pass) meets a few shapes, not one a width."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def run_pass(engine: PassEngine, plan) -> None:
    """One pass of a planned shape. Only `plan` reads the device back (the pass's shape); this part
    traces as one graph (tests/accel/raster/test_engine_conformance.py)."""
    engine.step(plan)


# compile options -> run_pass under torch.compile (False once compiling failed on this platform): one
# compiled function for every engine and decode, so a later decode reuses the code compiled for its shapes
COMPILED_PASSES: dict[tuple, Callable | bool] = {}


def options_key(compile_options: dict) -> tuple:
    return tuple(sorted(compile_options.items()))


def pass_runner(compile_options: dict | None) -> Callable:
    """run_pass, or run_pass under torch.compile with these options (Pipeline.compile's)."""
    if compile_options is None:
        return run_pass
    key = options_key(compile_options)
    if key not in COMPILED_PASSES:
        # dynamic=None whatever the model's setting: a Python number a pass reads or counts (the
        # scorer's forward passes) becomes an input after it first changes, instead of a new graph
        # for each of its values; the few shapes of pass are still compiled once each
        COMPILED_PASSES[key] = torch.compile(run_pass, **{**compile_options, "dynamic": None})
    return COMPILED_PASSES[key] or run_pass


class RunningBatch:
    """The images of an `ImageSource` decoded `slots` at a time (the slots of a `SlotState`). Between
    passes, the slots whose image is done give it up (`SlotState.release`: its tokens and per-image
    statistics, handed to `hand_over(index, tokens [N], {"forward_passes", "commit_pass" [N], the
    engine's `SlotState.count_per_image` counts})` at once, so a caller can save it) and take the next
    images of the source (`SlotState.admit`); a slot left when the source has none waiting idles (an
    engine gives a finished image no slots). An image's passes and commit_pass are counted from its
    own first pass, so they, like its tokens, are those of its decode alone. A closed source's last
    images are handed over at the end; an open source's as soon as they are done (one read-back a
    pass)."""

    def __init__(self, source: ImageSource, state: SlotState, hand_over: Callable | None = None):
        self.source, self.state, self.hand_over = source, state, hand_over
        # an open source's images go to the hand-over alone (a service's batch may run for ever): nothing
        # of them is kept past it, and the source forgets them once they have taken their slots
        self.keep = hand_over is None or source.fixed
        self.next = sum(image is not None for image in state.holds)  # the next image to admit
        self.source.forget(self.next, state.holds)  # the first slots' images were read as the engine started
        self.tokens: list[Tensor] = []  # kept: each image's, in the source's order
        self.passes: list[int | None] = []
        self.commit_pass: list[Tensor] = []
        self.counts: dict[str, list[int | None]] = {name: [] for name in state.counts}  # kept, by image
        self.finished = 0  # images handed over or cancelled in their slots
        self.images_passes = [0, 0.0]  # not kept: the images handed over and the sum of their tokens a pass
        self.passes_run = 0  # the batch's passes (a refill pass makes two model calls, counted once)

    def collect(self, rows: list[int]):
        holds = self.state.holds
        images = [holds[row] for row in rows]
        tokens, passes, commit_pass, counts = self.state.release(rows)
        for i, (row, image, image_tokens, image_passes, image_commits) in enumerate(
            zip(rows, images, tokens, passes.tolist(), commit_pass, strict=True)
        ):
            image_counts = {name: count[i] for name, count in counts.items()}
            if self.keep:
                grow = image + 1 - len(self.passes)
                for kept in (self.tokens, self.passes, self.commit_pass, *self.counts.values()):
                    kept.extend([None] * grow)
                self.tokens[image], self.passes[image], self.commit_pass[image] = (
                    image_tokens,
                    image_passes,
                    image_commits,
                )
                for name, count in image_counts.items():
                    self.counts[name][image] = count
            else:
                self.images_passes[0] += 1
                self.images_passes[1] += self.state.num_tokens / max(image_passes, 1)
            holds[row] = None
            self.finished += 1
            if self.hand_over is not None:
                info = {"forward_passes": image_passes, "commit_pass": image_commits, **image_counts}
                self.hand_over(image, image_tokens, info)

    def refill(self):
        """Slots whose image is done: release it, admit the next images into free slots (one read-back a
        pass while the source has images waiting or is open)."""
        available, holds = self.source.count(), self.state.holds
        if self.next >= available and self.source.closed:
            return
        done, cancelled = self.state.done().tolist(), self.source.cancelled
        rows = [row for row, image in enumerate(holds) if image is not None and done[row]]
        if rows:
            self.collect(rows)
        if cancelled:  # their slots freed unfinished, nothing handed over
            for row, image in enumerate(holds):
                if image in cancelled:
                    holds[row] = None
                    self.finished += 1
        free = [row for row, image in enumerate(holds) if image is None]
        images, next_before = [], self.next
        while len(images) < len(free) and self.next < available:
            if self.next not in cancelled:
                images.append(self.next)
            self.next += 1
        if images:
            self.state.admit(free[: len(images)], images)
        if self.next > next_before or cancelled:
            self.source.forget(self.next, holds)

    def idle(self) -> bool:
        """No slot holds an image and none waits (an open source's spares are not worth a pass)."""
        return all(image is None for image in self.state.holds) and self.next >= self.source.count()

    def exhausted(self) -> bool:
        """The source is closed and every image of it has had a slot."""
        return self.source.closed and self.next >= self.source.count()

    def finish(self, stats: dict) -> tuple[Tensor, dict]:
        """After the last pass: the images still in slots, then every image's tokens [Q, N] and the
        engine's statistics with the per-image ones of the whole queue (None: an image cancelled)."""
        if rows := [row for row, image in enumerate(self.state.holds) if image is not None]:
            self.collect(rows)
        num_tokens, slots = self.state.num_tokens, len(self.state.holds)
        if self.keep:
            passes = [p for p in self.passes if p is not None]  # a cancelled image's are None
            tokens, commit_pass = torch.stack(self.tokens), torch.stack(self.commit_pass).cpu()
            images, tokens_a_pass = len(passes), sum(num_tokens / max(p, 1) for p in passes)
        else:  # handed over, not kept
            tokens, commit_pass = self.state.tokens[:0, :num_tokens], stats["commit_pass"][:0]
            images, tokens_a_pass = self.images_passes
        return tokens, {
            **stats,
            "forward_passes_per_image": self.passes,  # kept images' (an open batch keeps none)
            **{f"{name}_per_image": counts for name, counts in self.counts.items()},
            "tokens_per_forward": tokens_a_pass / max(images, 1),
            "commit_pass": commit_pass,
            "slots": slots,
            "images": images,
            "refills": images - min(slots, images),
            "batch_passes": self.passes_run,
        }


def score_first_passes_apart(batch: int, fresh: tuple[int, ...], device, score: Callable) -> Tensor:
    """A running batch's pass in which slots `fresh` (new images) have their first pass: they feed
    their condition and the other slots their committed tokens, so each group is scored in a call of
    its own (`score(rows [R], first) -> [R, ...]`), and the two are joined in slot order -> [B, ...]."""
    new = torch.tensor(fresh, device=device)
    old = torch.tensor([row for row in range(batch) if row not in fresh], device=device)
    new_scores, old_scores = score(new, True), score(old, False)
    joined = new_scores.new_empty(batch, *new_scores.shape[1:])
    return joined.index_copy(0, new, new_scores).index_copy(0, old, old_scores)


def running_batch(request, state: SlotState) -> RunningBatch | None:
    """The running batch a request asks for (`Request.slots`: over its open `source`, else over its
    images as a closed one), or None."""
    if request.slots is None:
        return None
    source = request.source or ImageSource(request.cond, request.cond_mask, request.generators, null=request.null)
    return RunningBatch(source, state, None if request.on_image is None else request.hand_over)


@torch.no_grad()
def decode_passes(engine: PassEngine, state: SlotState, request, desc: str) -> tuple[Tensor, dict]:
    """Run `engine`'s passes over the slots of `state` until its plan says stop -> (tokens [B, N], or
    [Q, N] of a running batch's queue (`Request.slots`, refilled before each pass), stats). A compiled
    request (`Request.compile_passes`): each pass, bookkeeping and model call, under torch.compile (on a
    GPU with mode="reduce-overhead", one CUDA graph per shape of pass); where compiling fails, the pass
    runs eagerly from then on, with one warning (torch.compile fails before it runs anything, so the
    pass is not run twice). desc: the progress bar's label (the bar counts finished images of a queue)."""
    compile_options, queue = request.compile_passes, running_batch(request, state)
    step = pass_runner(compile_options)
    if queue is None:
        bar = progress_bar(total=state.num_tokens, enabled=request.progress, desc=desc)
    else:
        total = queue.source.count() if queue.source.closed else None  # an open source's count is not known
        bar = progress_bar(total=total, enabled=request.progress, desc=desc, unit="img")
    try:
        with engine:
            while True:
                if queue is not None:
                    queue.refill()
                    if queue.idle():  # an open source with nothing to decode: wait for an image or the close
                        if queue.source.wait_past(queue.next):
                            continue
                        break
                if (plan := engine.plan()) is None:
                    if queue is None or queue.exhausted():
                        break
                    continue  # every slot is done, and an image came (or may) since the refill
                if queue is not None:
                    queue.source.before_pass()  # a paced source's pass waits for its step
                    queue.passes_run += 1
                try:
                    step(engine, plan)
                except Exception as err:
                    if step is run_pass:
                        raise
                    run_pass(engine, plan)  # an error of the pass itself is raised here, as eagerly
                    COMPILED_PASSES[options_key(compile_options)] = False
                    step = run_pass
                    warn_compile_failed(err)
                if request.progress:  # a read-back, so only when a bar shows
                    bar.update((queue.finished if queue is not None else int(state.committed.min())) - bar.n)
            stats = engine.stats()
    finally:
        bar.close()
    return queue.finish(stats) if queue is not None else batch_result(state, stats)


def batch_result(state: SlotState, stats: dict) -> tuple[Tensor, dict]:
    """A decode without a running batch, every image in a slot of its own -> (tokens [B, N], the
    engine's stats with each `SlotState.count_per_image` statistic's per-image list, its slots')."""
    counts = {f"{name}_per_image": counts for name, counts in state.image_counts().items()}
    return state.tokens[:, : state.num_tokens], stats | counts


def compile_failure(err: Exception) -> str:
    """What made torch.compile fail, in one line: torch wraps the compiler's own error
    (BackendCompilerFailed.inner_exception), which is the one worth reading."""
    root = err
    while isinstance(inner := root.__cause__ or getattr(root, "inner_exception", None), Exception):
        root = inner
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    reason = f"{type(root).__name__}: {lines[0][:300] if lines else ''}"
    return reason if root is err else f"{type(err).__name__}, {reason}"


def warn_compile_failed(err: Exception):
    warnings.warn(
        f"torch.compile failed on this platform ({compile_failure(err)}); a decode's passes run eagerly "
        "instead (the same outputs, without the compiled speed-up)",
        RuntimeWarning,
        stacklevel=3,
    )
