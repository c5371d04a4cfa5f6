"""The one slot state of a raster decode, which the pass loop owns and every engine reads and writes.

A decode works on B slots, one image each (a running batch's images take turns in them). Starting
an image in a slot (`admit`) and handing a finished one over (`release`) are written here once: an
engine says what it keeps per slot (`per_slot`: the tensors a new image starts at a value, as a
front's counts or its carried drafts; `count_per_image`: a statistic handed over with each image),
its parts that do more when an image starts (`SlotPart`: a scorer takes the images' conditions, a
draft model prefills them, a log forgets the old image) and how an image draws its randomness, and
the state starts every image as its decode alone does.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..core.method_registry import Request
from ..core.sampling import UniformStream, draw_uniforms, to_device


class SlotPart(Protocol):
    """What an engine keeps per slot beside the state: told when slots start new images."""

    def admit(self, rows: Tensor, images: Tensor) -> None: ...


class Record(Protocol):
    """An engine's statistics record, read for each image as it leaves its slot."""

    def image_commits(self, rows: list[int], start: list[int], end: int) -> tuple[Tensor, Tensor]:
        """Slots `rows`, whose images started after `start` passes, after `end` passes -> (their
        passes [R], the pass of their own that committed each token [R, N], 1 = their first)."""
        ...


def image_keys(generators: list[torch.Generator], device) -> Tensor:
    """[B] one 32-bit key per image, the first draw of its generator (for position-keyed noise)."""
    return to_device(torch.stack([torch.randint(0, 2**32, (1,), generator=g) for g in generators])[:, 0], device)


class SlotState:
    """B slots of one decode. Tokens [B, N + spare] (valid below `committed`; the spare columns are
    scratch for a pass's tokens past its commit), committed [B], and each image's randomness, drawn
    from its generator in one order: its key (`keyed` engines: position-keyed noise), then
    `first_draws` uniforms kept in `first_uniforms` [B, F] (a first step's: token 0's, a first
    block), then the stream the passes take from (`uniforms`, blocks of `block`). fed [B] (`tracks_fed`
    engines, else None): the committed tokens whose KV the target has cached.

    The loop's bookkeeping: `passes` planned, `fresh` (the slots whose image has its first pass in
    the next: every slot at first, a running batch's new images later), `holds` (each slot's image;
    None for an open source's spare) and `start_pass` (the passes planned before it started)."""

    def __init__(
        self,
        request: Request,
        *,
        window: int,
        spare: int,
        keyed: bool,
        first_draws: int = 0,
        block: int = 1,
        tracks_fed: bool = False,
    ):
        model, batch = request.model, request.batch_size
        self.device, self.num_tokens = model.device, model.num_image_tokens
        self.vocab_size, self.grid_size, self.window = model.vocab_size, tuple(model.grid_size), window
        self.vocab_range: Tensor | None = None
        self.tokens = torch.zeros(batch, self.num_tokens + spare, dtype=torch.long, device=self.device)
        self.committed = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.fed = torch.zeros_like(self.committed) if tracks_fed else None
        self.keyed, self.first_draws = keyed, first_draws
        generators = request.slot_generators()
        self.keys = image_keys(generators, self.device) if keyed else torch.zeros_like(self.committed)
        self.first_uniforms = drawn = None
        if first_draws:  # with the stream's first block, in one draw
            drawn = to_device(draw_uniforms(generators, first_draws + block), self.device)
            self.first_uniforms, drawn = drawn[:, :first_draws], drawn[:, first_draws:]
        self.uniforms = UniformStream(generators, self.device, block=block, drawn=drawn)
        # admitted images' generators: an open source's, which grows as images join and forgets past ones
        self.image_generators = (
            (lambda images: [request.generators[image] for image in images])
            if request.source is None
            else request.source.image_generators
        )
        self.passes = 0
        self.fresh: tuple[int, ...] = tuple(range(batch))
        self.start_pass = [0] * batch
        started = min(batch, request.cond.shape[0])  # the slots past an open source's images hold spares
        self.holds: list[int | None] = [*range(started), *[None] * (batch - started)]
        self.record: Record | None = None  # the engine's, with its parts (`SlotPart`)
        self.parts: list[SlotPart] = []
        self.starts: list[tuple[object, object, tuple[str, ...]]] = []  # (start, holder, names): `per_slot`
        self.counts: dict[str, tuple[object, str]] = {}  # statistic -> (holder, name): `count_per_image`

    def per_slot(self, start, holder, *names: str):
        """Tensors an engine keeps per slot, `holder.<name>` [B, ...], that a new image starts at `start`
        (read at each admit: a holder may replace one between passes; None: not made yet)."""
        self.starts.append((start, holder, names))

    def count_per_image(self, name: str, holder, attribute: str):
        """A statistic `holder.<attribute>` [B] an engine counts per slot: each image starts it at 0 and
        hands its count over as `name` (`release`)."""
        self.per_slot(0, holder, attribute)
        self.counts[name] = (holder, attribute)

    def vocab_ids(self) -> Tensor:
        """[V] the token ids, made at the first call of a decode and kept."""
        if self.vocab_range is None:
            self.vocab_range = torch.arange(self.vocab_size, device=self.device)
        return self.vocab_range

    def next_pass(self) -> tuple[int, ...]:
        """Count the pass being planned -> the slots whose image has its first pass in it."""
        fresh, self.fresh = self.fresh, ()
        self.passes += 1
        return fresh

    def done(self) -> Tensor:
        """[B] bool: the slot's image has all its tokens."""
        return self.committed >= self.num_tokens

    def release(self, rows: list[int]) -> tuple[Tensor, Tensor, Tensor, dict[str, list[int]]]:
        """The finished images in slots `rows` -> (tokens [R, N], their passes [R], commit_pass [R, N]
        counted from each image's own first pass, each `count_per_image` statistic's counts [R]),
        before the slots are reused."""
        passes, commit_pass = self.record.image_commits(rows, [self.start_pass[row] for row in rows], self.passes)
        return self.tokens[rows, : self.num_tokens], passes, commit_pass, self.image_counts(rows)

    def image_counts(self, rows: list[int] | slice = slice(None)) -> dict[str, list[int]]:
        """Each `count_per_image` statistic's counts of the images in slots `rows` (default: every slot)."""
        return {name: getattr(holder, attribute)[rows].tolist() for name, (holder, attribute) in self.counts.items()}

    def admit(self, rows: list[int], images: list[int]):
        """Slots `rows` start queue images `images`: every state of the slot made as a decode of that
        image alone starts it (its randomness drawn in the same order), its first pass the next (no
        model call here: an engine whose first step is a plain AR step takes it in its plan)."""
        for row, image in zip(rows, images, strict=True):
            self.start_pass[row], self.holds[row] = self.passes, image
        # with the slots still before their first pass (an image added before a decode's first pass)
        self.fresh = tuple(sorted({*self.fresh, *rows}))
        index, image_index = (torch.tensor(x, device=self.device) for x in (rows, images))
        generators = self.image_generators(images)
        # nothing committed (what lies past `committed` is never read: the old image's tokens stay)
        self.committed[index] = 0
        if self.fed is not None:
            self.fed[index] = 0
        if self.keyed:
            self.keys[index] = image_keys(generators, self.device)
        if self.first_draws:
            self.first_uniforms[index] = to_device(draw_uniforms(generators, self.first_draws), self.device)
        self.uniforms.replace(rows, generators)
        for start, holder, names in self.starts:
            for name in names:
                if (held := getattr(holder, name)) is not None:
                    held[index] = start
        for part in self.parts:
            part.admit(index, image_index)
