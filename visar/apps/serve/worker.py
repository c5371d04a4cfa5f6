"""The inference worker of `visar serve`: a LitServe `LitAPI` whose continuous-batching step is one pass
of the running batch (`Pipeline.open_batch`, paced), so a request's images take free slots between
passes and each image is answered as soon as its request is done.

LitServe's `ContinuousBatchingLoop` calls `add_request` as requests arrive (its scheduling task) and
`step` in a loop while `has_active_requests`; each `step` lets the running batch run one pass
(`OpenBatch.step`) and returns what came of it: a request's acceptance (or its one-sentence 400),
each finished image, the end of a finished request.

One thread owns the device (`pipeline.SharedDevice`): it loads the model, then runs one batch after
another, each waiting between passes for the next step. A batch is one method and guidance scale (one
scale a pass), and a model holds one batch's KV cache: requests for other settings wait until the
running batch has no image left, which it reaches because, while they wait, its own later requests
wait too (oldest settings first).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass

import litserve as ls
from fastapi import HTTPException
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop, Output
from litserve.utils import LitAPIStatus

from ...errors import VisarError
from ...pipeline.shared_device import BatchImages, SharedDevice
from . import metrics
from .api import ServedModel


class PassLoop(ContinuousBatchingLoop):
    """LitServe's continuous-batching loop with two changes of pace: it rests while no request is active
    (its own loop calls `run` again at once, which would keep a core busy on an idle server), and a
    step that finished no image is followed by the next pass at once, not after the 10 ms LitServe
    sleeps on an empty step (most passes finish no image; a small model's pass takes less)."""

    async def run(self, lit_api, *args, **kwargs):
        if not lit_api.has_active_requests():
            await asyncio.sleep(0.002)
            return
        await super().run(lit_api, *args, **kwargs)

    async def step(self, prev_outputs, lit_api, lit_spec):
        return await asyncio.to_thread(self.passes_until_output, lit_api, prev_outputs)

    @staticmethod
    def passes_until_output(lit_api, prev_outputs) -> list[Output]:
        """`lit_api.step` (a pass) until one has something to send; requests still join between passes,
        as add_request runs in the loop's thread meanwhile."""
        while lit_api.has_active_requests():
            if outputs := lit_api.step(prev_outputs):
                return outputs
        return []


@dataclass
class Admitted:
    """One request: its method's name in answers, its images' job, and when it came."""

    uid: str
    label: str
    job: BatchImages
    started: float


class ImagesAPI(ls.LitAPI):
    """The model's running batch behind LitServe's continuous batching (`visar serve`)."""

    def __init__(self, load, model_arg: str, *, method: str, slots: int, options: dict, max_images: int, spec):
        super().__init__(stream=True, loop=PassLoop(), spec=spec, max_batch_size=slots)
        self.load, self.model_arg, self.method, self.slots = load, model_arg, method, slots
        self.options, self.max_images = options, max_images

    def setup(self, device):
        # LitServe warns on each step that finished no image, which is most passes
        logging.getLogger("litserve.loops.continuous_batching_loop").setLevel(logging.ERROR)
        self.changed = threading.Condition()  # guards what follows
        self.admitted: dict[str, Admitted] = {}  # the requests not yet answered in full
        self.outbox: list[Output] = []
        # one thread loads the model and runs every batch (`SharedDevice`: a model holds one batch's KV
        # cache; on a CPU, torch in a second thread made a decode 1.6x slower at two threads)
        self.shared = SharedDevice(self.slots, paced=True)
        settings = (self.model_arg, self.method, self.options, self.slots, self.max_images)
        # loaded (auto settled) in the device thread; a failure fails the worker's setup
        self.model = self.shared.call(lambda: ServedModel(self.load(device), *settings)).result()

    # --- LitServe's continuous-batching contract ---

    def has_capacity(self) -> bool:
        return True  # a batch queues what it cannot seat; the HTTP side bounds the requests in flight

    def has_active_requests(self) -> bool:
        with self.changed:
            return bool(self.admitted or self.outbox)

    def add_request(self, uid: str, request) -> None:
        if "cancel" in request:  # the HTTP side's word that a caller left or ran out of time
            self.cancel(request["cancel"])
            self.send(uid, "", LitAPIStatus.FINISH_STREAMING)
            return
        try:
            admitted = self.checked(uid, request)
        except VisarError as err:
            self.send(uid, HTTPException(400, str(err)), LitAPIStatus.ERROR)
            return
        except Exception as err:  # a bug must not stop LitServe's scheduling task, which calls this
            logging.getLogger("visar.serve").exception("a request could not be read")
            self.send(uid, HTTPException(500, f"the server could not read this request: {err}"), LitAPIStatus.ERROR)
            return
        with self.changed:
            self.admitted[uid] = admitted
        self.shared.submit(admitted.job)  # not in this lock: the device calls back into it

    def step(self, prev_outputs) -> list[Output]:
        metrics.PASSES.inc(self.shared.step(timeout=1.0))
        in_slots, waiting = self.shared.in_flight()
        metrics.SLOTS.set(min(in_slots, self.slots))
        metrics.WAITING.set(waiting + max(in_slots - self.slots, 0))
        with self.changed:
            outputs, self.outbox = self.outbox, []
        return outputs

    def encode_response(self, output):
        return output  # LitServe writes a dict as one JSON line

    # --- the requests ---

    def send(self, uid: str, output, status):
        with self.changed:
            self.outbox.append(Output(uid, output, status))

    def checked(self, uid: str, request: dict) -> Admitted:
        """A request's method and images' job, or one VisarError sentence (a 400)."""
        label, job = self.model.job(request)
        admitted = Admitted(uid, label, job, time.monotonic())
        job.on_accepted = lambda n: self.send(uid, {"accepted": n}, LitAPIStatus.OK)
        job.on_image = functools.partial(self.hand_over, admitted)
        job.on_done = lambda: self.finish(uid)
        job.on_error = functools.partial(self.fail, uid)
        return admitted

    def fail(self, uid: str, err: Exception):
        """A request's images could not join (400) or their batch failed (500): answered with the error."""
        error = (
            HTTPException(400, str(err))
            if isinstance(err, VisarError)
            else HTTPException(500, f"the decode failed: {err}")
        )
        with self.changed:
            if self.admitted.pop(uid, None) is not None:
                self.outbox.append(Output(uid, error, LitAPIStatus.ERROR))

    def finish(self, uid: str):
        with self.changed:
            if self.admitted.pop(uid, None) is not None:
                self.outbox.append(Output(uid, "", LitAPIStatus.FINISH_STREAMING))

    def hand_over(self, admitted: Admitted, position: int, image, info: dict):
        answer = self.model.image(admitted.label, position, image, info, admitted.started)  # PNG: in the device thread
        with self.changed:
            if admitted.uid not in self.admitted:  # cancelled as it finished
                return
            self.outbox.append(Output(admitted.uid, answer, LitAPIStatus.OK))
        metrics.IMAGES.inc()
        passes = answer["visar"]["forward_passes"]
        metrics.TOKENS_PER_PASS.observe(self.model.pipe.model.num_image_tokens / max(passes, 1))

    def cancel(self, uid: str):
        with self.changed:
            admitted = self.admitted.pop(uid, None)
            if admitted is not None:
                self.outbox.append(Output(uid, "", LitAPIStatus.FINISH_STREAMING))
        if admitted is not None:
            self.shared.cancel(admitted.job)
