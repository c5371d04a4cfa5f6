"""`pipeline.SharedDevice`: one thread runs open batches and calls for many callers, in arrival order.

Jobs are queued while a call holds the device, so what waits together is known: images of one setting
that wait together share a batch; a call (or another setting) queued between them is not jumped; a
bad option fails every waiting job of its setting and the device goes on; a cancelled job never starts.
"""

import threading
import time

import numpy as np
import pytest

import visar
from visar.errors import VisarError
from visar.pipeline.shared_device import BatchImages, SharedDevice


@pytest.fixture(scope="module")
def pipe():
    return visar.load("visar-tiny-c2i", device="cpu")


class Recorder:
    """A job's callbacks, noted in order with the job's name."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def job(self, pipe, name: str, method="mc-sjd", images=1, seed=0, **settings) -> BatchImages:
        add = dict(class_labels=[3], num_images_per_prompt=images, seed=seed)
        job = BatchImages(pipe, method, settings, add)
        job.on_accepted = lambda n: self.events.append((name, "joined", n))
        job.on_image = lambda position, image, info: self.events.append((name, "image", position, image))
        job.on_done = lambda: self.events.append((name, "done"))
        job.on_error = lambda err: self.events.append((name, "error", err))
        return job

    def order(self) -> list[tuple]:
        return [event[:2] for event in self.events]


def held(device: SharedDevice) -> threading.Event:
    """Hold the device with a call until the event is set."""
    release = threading.Event()
    device.call(release.wait, 30)
    return release


def wait_for(condition, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.one_thread  # images against generate alone, bit for bit
def test_jobs_of_one_setting_that_wait_together_share_a_batch_and_a_call_between_is_not_jumped(pipe):
    device, notes = SharedDevice(slots=4), Recorder()
    release = held(device)
    a, b = notes.job(pipe, "a", images=2, seed=1), notes.job(pipe, "b", seed=5)
    device.submit(a)
    device.submit(b)
    ran = device.call(lambda: notes.events.append(("call", "ran")))
    c = notes.job(pipe, "c", seed=9)  # the same setting as a and b, queued after the call
    device.submit(c)
    assert device.in_flight() == (0, 4)
    release.set()
    ran.result(60)
    wait_for(lambda: ("c", "done") in notes.order())
    order = notes.order()
    assert order[:2] == [("a", "joined"), ("b", "joined")]  # one batch, both at once
    assert order.index(("call", "ran")) > max(order.index(("a", "done")), order.index(("b", "done")))
    assert order.index(("c", "joined")) > order.index(("call", "ran"))  # not ahead of the call
    images = {(e[0], e[2]): e[3] for e in notes.events if e[1] == "image"}
    for (name, position), seed in {("a", 0): 1, ("a", 1): 1, ("b", 0): 5, ("c", 0): 9}.items():
        count = 2 if name == "a" else 1
        expected = pipe.generate(class_labels=[3], method="mc-sjd", num_images_per_prompt=count, seed=seed)
        assert np.array_equal(np.asarray(images[name, position]), np.asarray(expected.images[position]))


def test_a_bad_option_fails_every_waiting_job_of_its_setting_and_the_device_goes_on(pipe):
    device, notes = SharedDevice(slots=2), Recorder()
    release = held(device)
    device.submit(notes.job(pipe, "bad1", window=0))
    device.submit(notes.job(pipe, "bad2", window=0))
    good, gone = notes.job(pipe, "good"), notes.job(pipe, "gone", seed=3)
    device.submit(good)
    device.submit(gone)
    device.cancel(gone)  # waiting: it never starts
    release.set()
    wait_for(lambda: ("good", "done") in notes.order())
    errors = [e for e in notes.events if e[1] == "error"]
    assert [e[0] for e in errors] == ["bad1", "bad2"] and all(isinstance(e[2], VisarError) for e in errors)
    assert "window" in str(errors[0][2])
    assert not [e for e in notes.events if e[0] == "gone"]
    assert device.call(lambda: 7).result(30) == 7  # calls still run
    with pytest.raises(ZeroDivisionError):  # a call's error is its caller's
        device.call(lambda: 1 / 0).result(30)


def test_a_fitted_batch_seats_the_images_that_wait_for_it_and_no_more(pipe):
    """fit (the demo's): two jobs waiting together get a batch of two slots; a job that comes while it
    decodes waits for the next batch rather than for a slot of this one."""
    device, notes = SharedDevice(slots=4, fit=True), Recorder()
    release = held(device)
    device.submit(notes.job(pipe, "a", seed=1))
    device.submit(notes.job(pipe, "b", seed=2))
    release.set()
    wait_for(lambda: ("a", "joined") in notes.order())
    assert device.batch.slots == 2
    device.submit(notes.job(pipe, "c", seed=3))
    wait_for(lambda: ("c", "done") in notes.order())
    order = notes.order()
    assert order.index(("c", "joined")) > max(order.index(("a", "done")), order.index(("b", "done")))
