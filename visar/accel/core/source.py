"""The images a running batch decodes (`ImageSource`): a call's fixed list, or an open queue that grows
while the batch decodes (a service's), from any thread, until it is closed."""

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
