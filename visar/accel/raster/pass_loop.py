"""The raster pass loop: every raster decode that drafts is this one loop over passes.

A pass plans which slots each image scores (a chain window after its committed prefix, a draft
tree, its row fronts, a static tree), proposes their drafts, scores them in one target forward,
verifies them under the acceptance rule, and commits what holds (tokens, statistics, carried
drafts, the cache). What differs between the shapes of pass is a `PassEngine`: `ChainPasses`
(chain.py: sjd, mc-sjd, spec, gsd, lantern), `DraftTreePasses` (tree_passes.py: sjd-pac,
tree-mc-sjd), `StaticTreePasses` (static_tree.py: lantern++) and `FrontPasses` (zipar/engine.py: the zipar
family, wavefront). Every pass of a decode has the engine's one size (a method's `budget=N` sets
it): sizes chosen pass by pass lost to the best fixed size on every method they ran, and `auto`
chooses among fixed sizes by timing them (docs/SPEED.md).

A running batch (`Request.slots`): the engine decodes `slots` images of a longer queue at once; when a
slot's image has all its tokens it leaves, and the next image of the queue takes the slot before the
next pass (`RunningBatch`), so no slot feeds padding for a finished image while the queue lasts. The
queue is an `ImageSource`: a call's fixed list is one closed from the start; an open one
(`Request.source`) takes images while the batch decodes, from any thread, until it is closed.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from ...progress import progress_bar


class PassEngine(Protocol):
    """One shape of pass, with the state it carries from pass to pass.

    `with engine:` holds what a decode holds open (the KV cache, a draft model's); `plan()` is the
    next pass's shape (None: every image is done); `propose` drafts, `score` is the target's laws
    at the drafted slots (a tensor, or the fronts' `FrontScores`; one model call, or one per group
    of a refill pass), `verify` applies the acceptance rule to them, `commit` writes the pass's
    tokens and statistics, carries drafts over and trims the cache.

    An image's first pass is the loop's next pass after it takes its slot (every slot's at a
    decode's start, `admit`'s slots later; `SlotBook.fresh`): an engine that scores the condition
    with the pass's drafts (chain, draft trees) does so in `score`; one whose first step is a
    plain AR step (static trees, fronts) takes that step in `plan`, before it shapes the pass.
    """

    desc: str  # the progress bar's label
    total: int  # image tokens, for the progress bar

    def __enter__(self) -> PassEngine: ...

    def __exit__(self, *exc) -> None: ...

    def plan(self) -> Any | None: ...

    def propose(self, plan) -> Any: ...

    def score(self, plan, drafts) -> Any: ...

    def verify(self, plan, drafts, scores) -> Any: ...

    def commit(self, plan, drafts, scores, verdict) -> None: ...

    def least_done(self) -> Tensor:
        """The fewest tokens any image has committed (a 0-d tensor; read only for a progress bar)."""
        ...

    def finish(self) -> tuple[Tensor, dict]:
        """-> (tokens [B, N], stats)."""
        ...

    # -- a running batch (only a refilling decode calls these) --

    def done(self) -> Tensor:
        """[B] bool: the slot's image has all its tokens."""
        ...

    def release(self, rows: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The finished images in slots `rows` -> (tokens [R, N], their passes [R], commit_pass [R, N]
        counted from each image's own first pass, 1 = that pass), before the slots are reused."""
        ...

    def admit(self, rows: list[int], images: list[int]) -> None:
        """Slots `rows` start queue images `images` (their conditions and generators): every state of
        the slot made as a decode of that image alone starts it, its first pass the next (no model
        call here)."""
        ...


class SlotBook:
    """The slot bookkeeping every engine keeps, the same in each: the passes planned, the slots
    whose image has its first pass in the next one (every slot at first; a running batch's new
    images later), the passes planned before each slot's image started (to count an image's
    passes and commit passes from its own first pass) and the queue image each slot holds."""

    def __init__(self, request):
        # an admitted image's generator: an open source's list grows as images join
        self.generators = request.generators if request.source is None else request.source.generators
        self.device = request.model.device
        self.passes = 0  # passes planned
        self.fresh: tuple[int, ...] = tuple(range(request.batch_size))
        self.start_pass = [0] * request.batch_size
        self.holds = list(range(request.batch_size))

    def next_pass(self) -> tuple[int, ...]:
        """Count the pass being planned -> the slots whose image has its first pass in it."""
        fresh, self.fresh = self.fresh, ()
        self.passes += 1
        return fresh

    def admit(self, rows: list[int], images: list[int]) -> tuple[Tensor, Tensor, list[torch.Generator]]:
        """Slots `rows` take queue images `images`, whose first pass is the next -> (rows [R] and
        images [R] on the device, the images' generators)."""
        for row, image in zip(rows, images, strict=True):
            self.start_pass[row], self.holds[row] = self.passes, image
        self.fresh = tuple(sorted(rows))
        index, image_index = (torch.tensor(x, device=self.device) for x in (rows, images))
        return index, image_index, [self.generators[image] for image in images]

    def started(self, rows: list[int]) -> Tensor:
        """[R] the passes planned before the images in slots `rows` started, on the device."""
        return torch.tensor([self.start_pass[row] for row in rows], device=self.device)


class ImageSource:
    """The images a running batch decodes, in order: each one's condition (a row of `cond` [Q, ...] and of
    `cond_mask` [Q, T] or None), generator and, where the caller makes them (a negative prompt per
    image), null condition (rows of `null` and `null_mask`; None: the model's). A call's fixed list
    is a source closed from the start; an open one grows by `add` (from any thread) while the batch
    decodes, and `close` says that no more will come. An image's tokens are those of its decode alone
    whenever it joins.

    While an open source holds fewer images than the batch has slots, each slot without an image
    decodes a spare (the last image's condition under a generator of its own, never handed over)
    until an image takes it: a slot is one row of every pass whether it holds an image or not."""

    def __init__(self, cond: Tensor, cond_mask: Tensor | None, generators: list, closed: bool = True, null=None):
        if cond.shape[0] == 0 or cond.shape[0] != len(generators):
            raise ValueError(
                f"a source starts with one image or more, one generator each: got {cond.shape[0]} "
                f"conditions and {len(generators)} generators"
            )
        self.cond, self.cond_mask, self.generators = cond, cond_mask, list(generators)
        self.null, self.null_mask = (None, None) if null is None else null  # null_mask may be None too
        self.closed = closed
        self.changed = threading.Condition()

    def count(self) -> int:
        """The images added so far (the loop asks once before each pass)."""
        return len(self.generators)

    def add(self, cond: Tensor, cond_mask: Tensor | None, generators: list, null=None) -> range:
        """Queue more images (cond [R, ...] laid out as the source's; null: (null [R, ...], null_mask
        [R, T]) exactly when the source was given them) -> their indices."""
        if cond.shape[0] != len(generators) or (cond_mask is None) != (self.cond_mask is None):
            raise ValueError("add one generator per condition, with a mask exactly when the source has one")
        if (null is None) != (self.null is None):
            raise ValueError("add null conditions exactly when the source was given them")
        with self.changed:
            if self.closed:
                raise ValueError("this source is closed: it takes no more images")
            first = len(self.generators)
            self.cond = torch.cat([self.cond, cond.to(self.cond.device)])
            if cond_mask is not None:
                self.cond_mask = torch.cat([self.cond_mask, cond_mask.to(self.cond_mask.device)])
            if null is not None:
                self.null = torch.cat([self.null, null[0].to(self.null.device)])
                if self.null_mask is not None:
                    self.null_mask = torch.cat([self.null_mask, null[1].to(self.null_mask.device)])
            self.generators.extend(generators)  # last: an image counts once its rows are in place
            self.changed.notify_all()
        return range(first, first + len(generators))

    def close(self):
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def wait_past(self, images: int) -> bool:
        """Block until the source holds more than `images` images (-> True) or is closed (-> False)."""
        with self.changed:
            self.changed.wait_for(lambda: self.count() > images or self.closed)
            return self.count() > images

    def snapshot(self) -> tuple[Tensor, Tensor | None, list]:
        """The conditions, masks and generators of the images so far, taken together."""
        with self.changed:
            return self.cond, self.cond_mask, list(self.generators)

    def rows(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        """The conditions [R, ...] and masks of images [R]."""
        with self.changed:
            index = images.to(self.cond.device)
            return self.cond[index], None if self.cond_mask is None else self.cond_mask[index]

    def null_rows(self, images: Tensor) -> tuple[Tensor, Tensor] | None:
        """The null conditions and masks of images [R] the caller made, or None (the model's)."""
        if self.null is None:
            return None
        with self.changed:
            index = images.to(self.null.device)
            return self.null[index], None if self.null_mask is None else self.null_mask[index]


def power_of_two(n: int) -> int:
    """The least power of two >= n (0 stays 0): the widths a pass is padded to, so that scoring (and a
    compiled pass) meets a few shapes, not one a width."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def run_pass(engine: PassEngine, plan) -> None:
    """One pass of a planned shape: propose, score, verify, commit. Only `plan` reads the device
    back (the pass's shape); this part traces as one graph (tests/accel/raster/test_compile.py)."""
    drafts = engine.propose(plan)
    scores = engine.score(plan, drafts)
    verdict = engine.verify(plan, drafts, scores)
    engine.commit(plan, drafts, scores, verdict)


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
    """The images of an `ImageSource` decoded `slots` at a time. Between passes, the slots whose image
    is done give it up (`PassEngine.release`: its tokens and per-image statistics, handed to
    `on_image(index, tokens [N], {"forward_passes", "commit_pass" [N]})` at once, so a caller can
    save it) and take the next images of the source (`PassEngine.admit`); a slot left when the source
    has none waiting idles (an engine gives a finished image no slots). An image's passes and
    commit_pass are counted from its own first pass, so they, like its tokens, are those of its
    decode alone. A closed source's last images are handed over at the end; an open source's as
    soon as they are done (one read-back a pass)."""

    def __init__(self, source: ImageSource, slots: int, on_image: Callable | None = None, started: int | None = None):
        self.source, self.on_image = source, on_image
        started = min(slots, source.count() if started is None else started)  # the images the engine starts with
        # an open source's images go to on_image alone (a service's batch may run for ever), else kept
        self.keep = on_image is None or source.closed
        self.holds: list[int | None] = [*range(started), *[None] * (slots - started)]  # the image in each slot
        self.next = started  # the next image to admit
        self.tokens: list[Tensor | None] = []
        self.passes: list[int] = []
        self.commit_pass: list[Tensor | None] = []
        self.finished = 0
        self.passes_run = 0  # the batch's passes (a refill pass makes two model calls, counted once)

    @property
    def num_images(self) -> int:
        return self.source.count()

    def collect(self, engine: PassEngine, rows: list[int]):
        tokens, passes, commit_pass = engine.release(rows)
        for row, image_tokens, image_passes, image_commits in zip(
            rows, tokens, passes.tolist(), commit_pass, strict=True
        ):
            image = self.holds[row]
            grow = image + 1 - len(self.passes)
            for kept in (self.tokens, self.passes, self.commit_pass):
                kept.extend([None] * grow)
            self.passes[image] = image_passes
            if self.keep:
                self.tokens[image], self.commit_pass[image] = image_tokens, image_commits
            self.holds[row] = None
            self.finished += 1
            if self.on_image is not None:
                self.on_image(image, image_tokens, {"forward_passes": image_passes, "commit_pass": image_commits})

    def refill(self, engine: PassEngine):
        """Slots whose image is done: release it, admit the next images into free slots (one read-back a
        pass while the source has images waiting or is open)."""
        available = self.source.count()
        if self.next >= available and self.source.closed:
            return
        done = engine.done().tolist()
        rows = [row for row, image in enumerate(self.holds) if image is not None and done[row]]
        if rows:
            self.collect(engine, rows)
        free = [row for row, image in enumerate(self.holds) if image is None][: available - self.next]
        if not free:
            return
        images = list(range(self.next, self.next + len(free)))
        engine.admit(free, images)
        for row, image in zip(free, images, strict=True):
            self.holds[row] = image
        self.next += len(free)

    def idle(self) -> bool:
        """No slot holds an image and none waits (an open source's spares are not worth a pass)."""
        return all(image is None for image in self.holds) and self.next >= self.source.count()

    def exhausted(self) -> bool:
        """The source is closed and every image of it has had a slot."""
        return self.source.closed and self.next >= self.source.count()

    def finish(self, engine: PassEngine) -> tuple[Tensor, dict]:
        """After the last pass: the images still in slots, then every image's tokens [Q, N] and the
        engine's statistics with the per-image ones of the whole queue."""
        self.collect(engine, [row for row, image in enumerate(self.holds) if image is not None])
        tokens, stats = engine.finish()
        num_tokens, passes = tokens.shape[1], self.passes
        if self.keep:
            tokens, commit_pass = torch.stack(self.tokens), torch.stack(self.commit_pass).cpu()
        else:  # handed over, not kept
            tokens, commit_pass = tokens[:0], stats["commit_pass"][:0]
        return tokens, {
            **stats,
            "forward_passes_per_image": passes,
            "tokens_per_forward": sum(num_tokens / max(p, 1) for p in passes) / max(len(passes), 1),
            "commit_pass": commit_pass,
            "slots": len(self.holds),
            "refills": len(passes) - min(len(self.holds), len(passes)),
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


def running_batch(request) -> RunningBatch | None:
    """The running batch a request asks for (`Request.slots`: over its open `source`, else over its
    images as a closed one), or None."""
    if request.slots is None:
        return None
    source = request.source or ImageSource(request.cond, request.cond_mask, request.generators, null=request.null)
    return RunningBatch(source, request.slots, request.on_image, started=request.cond.shape[0])


@torch.no_grad()
def decode_passes(
    engine: PassEngine,
    progress: bool = False,
    compile_options: dict | None = None,
    queue: RunningBatch | None = None,
) -> tuple[Tensor, dict]:
    """Run `engine`'s passes until its plan says stop; compile_options (a compiled pipeline's): each
    pass, bookkeeping and model call, under torch.compile (on a GPU with mode="reduce-overhead", one
    CUDA graph per shape of pass). Where compiling fails, the pass runs eagerly from then on, with one
    warning (torch.compile fails before it runs anything, so the pass is not run twice).
    queue: a running batch, refilled before each pass (the bar then counts finished images)."""
    step = pass_runner(compile_options)
    if queue is None:
        bar = progress_bar(total=engine.total, enabled=progress, desc=engine.desc)
    else:
        total = queue.num_images if queue.source.closed else None  # an open source's count is not known
        bar = progress_bar(total=total, enabled=progress, desc=engine.desc, unit="img")
    try:
        with engine:
            while True:
                if queue is not None:
                    queue.refill(engine)
                    if queue.idle():  # an open source with nothing to decode: wait for an image or the close
                        if queue.source.wait_past(queue.next):
                            continue
                        break
                if (plan := engine.plan()) is None:
                    if queue is None or queue.exhausted():
                        break
                    continue  # every slot is done, and an image came (or may) since the refill
                if queue is not None:
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
                if progress:  # a read-back, so only when a bar shows
                    bar.update((queue.finished if queue is not None else int(engine.least_done())) - bar.n)
            if queue is not None:
                return queue.finish(engine)
    finally:
        bar.close()
    return engine.finish()


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
