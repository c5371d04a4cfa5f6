"""`SharedDevice`: one thread that owns a device and runs what several callers hand it, one thing at a time:
open running batches (`Pipeline.open_batch`) that callers' images join, and calls (a load, a `generate`).

A model holds one decode's KV cache, so two decodes on one model at once would clobber it; on a CPU, torch
is also slower once two threads run its parallel work (libgomp throttles its spin-wait when it manages
more threads than cores: a decode outside the loading thread took 1.6x as long at two threads). So one
thread runs everything that touches the device, in arrival order: a caller's images (`BatchImages`) join
the running batch when it has their settings (`BatchImages.key`: model, method, options, sampling), and
a batch takes the waiting images of its settings up to the first job of another kind (other settings,
or a call), then no more: it runs dry, closes, and the thread takes that job. Callers that arrive
together with the same settings share passes; none waits behind a batch for longer than its images.

    device = SharedDevice(slots=8)
    pipe = device.call(visar.load, "visar-tiny-c2i").result()
    device.submit(BatchImages(pipe, "mc-sjd", {}, dict(class_labels=[3], seed=0), on_image=save))

`fit`: each batch opens with as many slots as images wait for it (at most `slots`), seats no more, and
closes once it runs dry, so callers that come one at a time decode at their own batch size: a slot
without an image decodes a spare, which costs a CPU about what an image does. Else a batch keeps its
`slots` while its settings last (on a GPU a pass of many rows costs about what one does).

`visar serve` (one model, a paced batch a LitServe loop steps) and `visar demo` (fitted: every session's
method side; the reference and the methods that do not refill run as calls) share their devices so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import VisarError

log = logging.getLogger("visar.shared_device")


def nothing(*args) -> None:
    return None


@dataclass(eq=False)
class BatchImages:
    """A caller's images for a running batch: `pipe.open_batch(method, **settings)`'s, added with `add`
    (`OpenBatch.add`'s arguments). Told, in the device's thread or the one that submits: `on_accepted(n)`
    when they join a batch, `on_image(position, image, info)` for each as it is done (position: its
    place in this job's images), `on_done()` after the last, or `on_error(err)` once instead (a
    VisarError: the images cannot join; another: the batch failed)."""

    pipe: object
    method: str
    settings: dict
    add: dict
    on_image: Callable = nothing
    on_accepted: Callable = nothing
    on_done: Callable = nothing
    on_error: Callable = nothing
    indices: list[int] = field(default_factory=list)  # in the batch, once joined
    done: int = 0

    @property
    def count(self) -> int:
        """Its images: num_images_per_prompt for each class label or prompt."""
        items = next(
            (self.add[k] for k in ("class_labels", "prompts", "caption_embeds") if self.add.get(k) is not None), [0]
        )
        return self.add.get("num_images_per_prompt", 1) * len(items)

    @property
    def key(self) -> tuple:
        """What a batch is opened with: images of one key share a batch."""
        return id(self.pipe), self.method, repr(sorted(self.settings.items()))


@dataclass(eq=False)
class Call:
    run: Callable
    future: Future

    def __call__(self):
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.run())
            except BaseException as err:  # the caller's to read, in its thread
                self.future.set_exception(err)


def images_at_the_head(waiting: list, key) -> int:
    """The images of the jobs of settings `key` at the head of the queue."""
    count = 0
    for job in waiting:
        if not isinstance(job, BatchImages) or job.key != key:
            break
        count += job.count
    return count


class SharedDevice:
    """One device thread for many callers (module docstring): `call` and `submit` from any thread. Torch's
    CPU thread count is each thread's own from its start: set it before, or with call(torch.set_num_threads, n).
    slots: the running batches' slots; paced: each batch runs a pass only when `step` lets it; fit:
    each batch fitted to the images that wait for it (module docstring)."""

    def __init__(self, slots: int, paced: bool = False, fit: bool = False, name: str = "visar-device"):
        self.slots, self.paced, self.fit = slots, paced, fit
        self.changed = threading.Condition()  # guards what follows
        self.waiting: list[BatchImages | Call] = []  # oldest first
        self.batch, self.key = None, None  # the running batch and its settings
        self.owners: dict[int, BatchImages] = {}  # the running batch's images in flight -> their job
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable, *args, **kwargs) -> Future:
        """Run fn(*args, **kwargs) in the device thread once the jobs before it are done -> its Future."""
        job = Call(lambda: fn(*args, **kwargs), Future())
        with self.changed:
            self.waiting.append(job)
            self.close_if_drained()
            self.changed.notify_all()
        return job.future

    def submit(self, job: BatchImages) -> None:
        """Queue a caller's images: they join the running batch at once where it has their settings and
        nothing of another kind waits before them, else a batch of their own in turn."""
        with self.changed:
            self.waiting.append(job)
            if self.batch is not None and job.key == self.key:
                self.join_waiting()
            self.close_if_drained()
            self.changed.notify_all()

    def cancel(self, job: BatchImages) -> None:
        """Take a job's images back (its caller left): waiting, it never starts; in the batch, its images
        leave their slots before the next pass (the others' tokens unchanged); nothing more is told."""
        with self.changed:
            if job in self.waiting:
                self.waiting.remove(job)
            else:
                left = [index for index in job.indices if self.owners.pop(index, None) is job]
                if left:
                    self.batch.cancel(left)
            self.close_if_drained()

    def step(self, timeout: float) -> int:
        """A paced device: let the running batch decode one pass -> 1, or 0 where none ran (no image in a
        slot: the caller's loop polls again after a short wait here)."""
        with self.changed:
            batch = self.batch if self.owners else None
            if batch is None:
                self.changed.wait(0.01)
                return 0
        return int(batch.step(timeout=timeout))

    def in_flight(self) -> tuple[int, int]:
        """(images in the running batch, images waiting for it or for a batch of their own)."""
        with self.changed:
            waiting = sum(job.count for job in self.waiting if isinstance(job, BatchImages))
            return len(self.owners), waiting

    # --- the device thread ---

    def run(self):
        while True:
            with self.changed:
                self.changed.wait_for(lambda: bool(self.waiting))
                head = self.waiting[0]
                if isinstance(head, Call):
                    self.waiting.pop(0)
            if isinstance(head, Call):
                head()
            else:
                self.run_batch(head)

    def run_batch(self, head: BatchImages):
        """A batch of the head job's settings, until it runs dry and something of another kind waits."""
        slots = self.slots
        if self.fit:
            with self.changed:
                slots = min(slots, images_at_the_head(self.waiting, head.key))
        try:
            opened = head.pipe.open_batch(head.method, slots=max(slots, 1), paced=self.paced, **head.settings)
        except Exception as err:  # a bad method or option: every waiting job of these settings learns of it
            with self.changed:
                failed = [job for job in self.waiting if isinstance(job, BatchImages) and job.key == head.key]
                self.waiting = [job for job in self.waiting if job not in failed]
            for job in failed:
                job.on_error(err if isinstance(err, VisarError) else VisarError(str(err)))
            return
        with self.changed:
            self.batch, self.key = opened, head.key
            self.join_waiting()
            self.close_if_drained()  # its images were cancelled meanwhile, and others wait
        try:
            opened.run(on_image=self.hand_over)
        except Exception as err:  # each job of the batch learns of it; the device goes on
            log.exception("a running batch (%s) failed", head.method)
            with self.changed:
                failed = list({id(job): job for job in self.owners.values()}.values())
                self.owners = {}
            for job in failed:
                job.on_error(err)
        with self.changed:
            self.batch, self.owners = None, {}

    def join_waiting(self):
        """In the lock: the waiting jobs of the running batch's settings join it, up to the first job of
        another kind (those after it wait, so that the batch runs dry and that job gets its turn) or, in
        a fitted batch, up to its slots."""
        if self.batch.closed:  # running dry: later jobs wait for a batch of their own
            return
        while self.waiting and isinstance(self.waiting[0], BatchImages) and self.waiting[0].key == self.key:
            if self.fit and len(self.owners) + self.waiting[0].count > self.batch.slots:
                break  # a fitted batch is full: the job waits for the next, fitted to what waits then
            job = self.waiting.pop(0)
            try:
                job.indices = self.batch.add(**job.add)
            except VisarError as err:
                job.on_error(err)
                continue
            self.owners.update(dict.fromkeys(job.indices, job))
            job.on_accepted(len(job.indices))

    def close_if_drained(self):
        """In the lock: close the running batch once it has no image left and something else waits (or,
        fitting batches to their callers, at once)."""
        if self.batch is not None and not self.owners and (self.waiting or self.fit):
            self.batch.close()

    def hand_over(self, index: int, image, info: dict):
        with self.changed:
            job = self.owners.pop(index, None)
            if job is None:  # cancelled as it finished
                return
            job.done += 1
            last = job.done == len(job.indices)
        job.on_image(job.indices.index(index), image, info)
        if last:
            job.on_done()
            with self.changed:
                self.close_if_drained()
