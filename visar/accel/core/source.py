"""The images a running batch decodes (`ImageSource`): a call's fixed list, or an open queue that grows
while the batch decodes (a service's), from any thread, until it is closed; a service may also cancel
its images and step the batch a pass at a time (`paced`).

An open source keeps each `add`'s images only until the batch is past them (`forget`: every one has
taken a slot or was cancelled waiting), so a service's batch that runs for days holds the images
waiting and in its slots, not every image it was given.

While an open source holds fewer images than the batch has slots, each slot without an image decodes
a spare (the last image's condition under a generator of its own, never handed over) until an image
takes it: a slot is one row of every pass whether it holds an image or not."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Added:
    """The images of one `add` (or the source's first ones): indices first .. first + count - 1."""

    first: int
    cond: Tensor  # [R, ...]
    cond_mask: Tensor | None  # [R, T]
    null: Tensor | None  # [R, ...]: the caller's null conditions, where it made them
    null_mask: Tensor | None
    generators: list

    @property
    def end(self) -> int:
        return self.first + len(self.generators)


FIELDS = ("cond", "cond_mask", "null", "null_mask")


def layout(x: Tensor | None) -> tuple | None:
    return None if x is None else (tuple(x.shape[1:]), x.dtype)


class ImageSource:
    """The images a running batch decodes, in order: each one's condition (a row of `cond` [Q, ...] and of
    `cond_mask` [Q, T] or None), generator and, where the caller makes them (a negative prompt per
    image), null condition (rows of `null` and `null_mask`; None: the model's). A call's fixed list
    is a source closed from the start; an open one grows by `add` (from any thread) while the batch
    decodes, and `close` says that no more will come. An image's tokens are those of its decode alone
    whenever it joins.

    A source open from the start (a service's) may `cancel` images: a waiting one never takes a
    slot, one in a slot leaves it before the next pass, unfinished and not handed over; the other
    images' tokens are unchanged (each image's are those of its decode alone). A `paced` one's batch
    runs a pass only when `allow_pass` lets it (a serving loop's step is one pass), until it is closed.
    """

    def __init__(
        self,
        cond: Tensor,
        cond_mask: Tensor | None,
        generators: list,
        closed: bool = True,
        null=None,
        paced: bool = False,
    ):
        if cond.shape[0] == 0 or cond.shape[0] != len(generators):
            raise ValueError(
                f"a source starts with one image or more, one generator each: got {cond.shape[0]} "
                f"conditions and {len(generators)} generators"
            )
        first = Added(0, cond, cond_mask, *((None, None) if null is None else null), list(generators))
        self.added = [first]  # the adds not yet forgotten, in order
        # what every add is checked against: each field's (shape past the batch, dtype), or None
        self.layout = {name: layout(getattr(first, name)) for name in FIELDS}
        self.device, self.images = cond.device, len(generators)
        self.closed, self.fixed = closed, closed  # fixed: a call's list, closed from the start
        self.cancelled: set[int] = set()  # images cancelled that may still be waiting or in a slot
        self.changed = threading.Condition()
        # pacing: passes let run (0 or 1), and the times the decode came back for more or went idle
        self.paced, self.permits, self.returns = paced, 0, 0

    def count(self) -> int:
        """The images added so far (the loop asks once before each pass)."""
        return self.images

    def add(self, cond: Tensor, cond_mask: Tensor | None, generators: list, null=None) -> range:
        """Queue more images (cond [R, ...] laid out as the source's; null: (null [R, ...], null_mask
        [R, T]) exactly when the source was given them) -> their indices."""
        if cond.shape[0] == 0 or cond.shape[0] != len(generators):
            raise ValueError("add one image or more, one generator per condition")
        fields = dict(zip(FIELDS, (cond, cond_mask, *((None, None) if null is None else null)), strict=True))
        check_layout(self.layout, fields)
        moved = {name: None if x is None else x.to(self.device) for name, x in fields.items()}
        with self.changed:
            if self.closed:
                raise ValueError("this source is closed: it takes no more images")
            first = self.images
            self.added.append(Added(first, **moved, generators=list(generators)))
            self.images += len(generators)  # last: an image counts once its rows are in place
            self.changed.notify_all()
        return range(first, first + len(generators))

    def forget(self, before: int, held) -> None:
        """The batch is past images [0, before) (each took a slot, its rows and generator read then, or was
        cancelled waiting) and holds `held` of them in its slots: an open source drops the adds whose
        images are all past, and the cancellations it no longer needs. A fixed list keeps everything."""
        if self.fixed:
            return
        with self.changed:
            self.added = [added for added in self.added if added.end > before]
            if self.cancelled:
                self.cancelled = {image for image in self.cancelled if image >= before or image in held}

    def close(self):
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def cancel(self, images) -> None:
        """Images that are no longer wanted (a service's caller left or ran out of time)."""
        if self.fixed:
            raise ValueError("a call's fixed list of images cannot be cancelled: only an open source's")
        with self.changed:
            self.cancelled.update(images)

    def wait_past(self, images: int) -> bool:
        """Block until the source holds more than `images` images (-> True) or is closed (-> False)."""
        with self.changed:
            self.came_back()
            self.changed.wait_for(lambda: self.count() > images or self.closed)
            return self.count() > images

    def before_pass(self) -> None:
        """Called by the loop before each pass: a paced source's decode waits here until `allow_pass`
        (or the close: a closed batch finishes its images unpaced)."""
        if not self.paced:
            return
        with self.changed:
            self.came_back()
            self.changed.wait_for(lambda: self.permits > 0 or self.closed)
            self.permits = 0

    def came_back(self):
        if self.paced:
            self.returns += 1
            self.changed.notify_all()

    def allow_pass(self, timeout: float) -> bool:
        """Let a paced batch run one pass and wait until it has (its finished images handed over) and is
        back for the next, or idle -> False after `timeout` s (nothing to decode, or a long pass). A
        batch that is idle when let takes its pass as soon as an image comes."""
        with self.changed:
            returns, self.permits = self.returns, 1
            self.changed.notify_all()
            return self.changed.wait_for(lambda: self.returns > returns, timeout)

    def snapshot(self) -> tuple[Tensor, Tensor | None, list]:
        """The conditions [Q, ...], masks and generators of the images so far (none forgotten yet: a
        batch's start), taken together."""
        with self.changed:
            if not self.added or self.added[0].first != 0:
                raise ValueError("a snapshot is of a source's images before its batch has forgotten any")
            masks = [added.cond_mask for added in self.added]
            return (
                torch.cat([added.cond for added in self.added]),
                None if masks[0] is None else torch.cat(masks),
                [g for added in self.added for g in added.generators],
            )

    def image_generators(self, images: list[int]) -> list:
        """The generators of images `images` (not yet forgotten)."""
        with self.changed:
            owners = [(owner(self.added, image), image) for image in images]
            return [added.generators[image - added.first] for added, image in owners]

    def rows(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        """The conditions [R, ...] and masks of images [R] (not yet forgotten)."""
        return self.gather(images, "cond", "cond_mask")

    def null_rows(self, images: Tensor) -> tuple[Tensor, Tensor] | None:
        """The null conditions and masks of images [R] the caller made, or None (the model's)."""
        if self.layout["null"] is None:
            return None
        return self.gather(images, "null", "null_mask")

    def gather(self, images: Tensor, rows: str, masks: str) -> tuple[Tensor, Tensor | None]:
        with self.changed:
            owners = [(owner(self.added, image), image) for image in images.tolist()]
            picked = torch.stack([getattr(added, rows)[image - added.first] for added, image in owners])
            if self.layout[masks] is None:
                return picked, None
            return picked, torch.stack([getattr(added, masks)[image - added.first] for added, image in owners])


def owner(added: list[Added], image: int) -> Added:
    """The add (not yet forgotten) that holds `image`."""
    for images in added:
        if images.first <= image < images.end:
            return images
    raise IndexError(f"image {image} of this source is past and forgotten, or was never added")


def check_layout(expected: dict, fields: dict):
    """An add's fields (cond, cond_mask, null, null_mask) laid out as the source's first ones, or ValueError."""
    for name, x in fields.items():
        if (x is None) != (expected[name] is None):
            raise ValueError(f"add {name} exactly when the source was given them")
        if x is not None and layout(x) != expected[name]:
            raise ValueError(f"{name} laid out as {layout(x)} cannot join a batch of {expected[name]}")
