"""The images a running batch decodes (`ImageSource`): a call's fixed list, or an open queue that grows
while the batch decodes (a service's), from any thread, until it is closed; a service may also cancel
its images and step the batch a pass at a time (`paced`)."""

from __future__ import annotations

import threading

import torch
from torch import Tensor


class ImageSource:
    """The images a running batch decodes, in order: each one's condition (a row of `cond` [Q, ...] and of
    `cond_mask` [Q, T] or None), generator and, where the caller makes them (a negative prompt per
    image), null condition (rows of `null` and `null_mask`; None: the model's). A call's fixed list
    is a source closed from the start; an open one grows by `add` (from any thread) while the batch
    decodes, and `close` says that no more will come. An image's tokens are those of its decode alone
    whenever it joins.

    While an open source holds fewer images than the batch has slots, each slot without an image
    decodes a spare (the last image's condition under a generator of its own, never handed over)
    until an image takes it: a slot is one row of every pass whether it holds an image or not.

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
        self.cond, self.cond_mask, self.generators = cond, cond_mask, list(generators)
        self.null, self.null_mask = (None, None) if null is None else null  # null_mask may be None too
        self.closed, self.fixed = closed, closed  # fixed: a call's list, closed from the start
        self.cancelled: set[int] = set()
        self.changed = threading.Condition()
        # pacing: passes let run (0 or 1), and the times the decode came back for more or went idle
        self.paced, self.permits, self.returns = paced, 0, 0

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
