"""The inference worker of `visar serve`: a LitServe `LitAPI` whose continuous-batching step is one pass
of the running batch (`Pipeline.open_batch`, paced), so a request's images take free slots between
passes and each image is answered as soon as its request is done.

LitServe's `ContinuousBatchingLoop` calls `add_request` as requests arrive (its scheduling task) and
`step` in a loop while `has_active_requests`; each `step` lets the running batch run one pass
(`OpenBatch.step`) and returns what came of it: a request's acceptance (or its one-sentence 400),
each finished image, the end of a finished request.

One thread owns the device: it loads the model, then runs one batch after another, each waiting
between passes for the next step. A batch is one method and guidance scale (one scale a pass), and
a model holds one batch's KV cache: requests for other settings wait until the running batch has
no image left, which it reaches because, while they wait, its own later requests wait too (oldest
settings first).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import threading
import time
from dataclasses import dataclass, field

import litserve as ls
import torch
from fastapi import HTTPException
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop, Output
from litserve.utils import LitAPIStatus

from ...errors import VisarError
from . import metrics


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
    """One request: its settings, its images' `add` arguments and, once in a batch, their indices there."""

    uid: str
    key: tuple  # (method label, guidance scale)
    add: dict
    started: float
    indices: list[int] = field(default_factory=list)  # once in a batch
    done: int = 0


def served_methods(model) -> list[str]:
    """The methods a request may name: lossless on this model, refilling a running batch, no draft model."""
    from ...accel import METHODS

    return sorted(
        name
        for name, m in METHODS.items()
        if m.refills and m.model_kind == "raster" and name != "auto" and m.is_lossless({}, model) and not m.needs_draft
    )


def png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class ImagesAPI(ls.LitAPI):
    """The model's running batch behind LitServe's continuous batching (`visar serve`)."""

    def __init__(self, load, model_arg: str, *, method: str, slots: int, options: dict, max_images: int, spec):
        super().__init__(stream=True, loop=PassLoop(), spec=spec, max_batch_size=slots)
        self.load, self.model_arg, self.method, self.slots = load, model_arg, method, slots
        self.options, self.max_images = options, max_images

    def setup(self, device):
        # LitServe warns on each step that finished no image, which is most passes
        logging.getLogger("litserve.loops.continuous_batching_loop").setLevel(logging.ERROR)
        self.changed = threading.Condition()  # guards what follows; the device thread waits on it
        self.batch, self.key = None, None  # the running batch and its settings
        self.owners: dict[int, Admitted] = {}  # the running batch's images in flight -> their request
        self.waiting: list[Admitted] = []  # requests for a batch of their settings, oldest first
        self.admitted: dict[str, Admitted] = {}
        self.outbox: list[Output] = []
        ready, failed = threading.Event(), []
        thread = threading.Thread(
            target=self.run_device, args=(device, ready, failed), name="visar-device", daemon=True
        )
        thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def run_device(self, device, ready: threading.Event, failed: list):
        """Load the model, settle the default method, then run batches, all in this one thread: once a
        second thread runs torch's parallel CPU work, libgomp manages more threads than there are cores
        and throttles its spin-wait, which made a decode in a thread other than the loading one 1.6x
        slower at two CPU threads (visar-tiny-c2i)."""
        try:
            self.settle(self.load(device))
        except Exception as err:  # the worker's setup fails with it
            failed.append(err)
            ready.set()
            return
        ready.set()
        while True:
            with self.changed:  # the oldest waiting request's settings; the default's when none waits
                key = self.waiting[0].key if self.waiting else self.default_key
            method, options = (self.default[0], self.default[1]) if key == self.default_key else (key[0], {})
            opened = self.pipe.open_batch(method, slots=self.slots, paced=True, guidance_scale=key[1], **options)
            with self.changed:
                self.batch, self.key = opened, key
                self.start_waiting()
                self.switch_if_idle()  # its requests were cancelled meanwhile, and others wait
            try:
                opened.run(on_image=self.hand_over)
            except Exception as err:  # every request of the batch learns of it; the server goes on
                logging.getLogger("visar.serve").exception("a running batch (%s) failed", key[0])
                with self.changed:
                    for admitted in {id(a): a for a in self.owners.values()}.values():
                        self.fail(admitted, HTTPException(500, f"the decode failed: {err}"))
            with self.changed:
                self.batch, self.owners = None, {}

    def settle(self, pipe):
        """The pipeline, and the default method: --method, or the candidate auto settles on for batches of
        --slots (AR's law as mc-sjd at one token a pass, where it settles on ar, which does not refill)."""
        from ...accel.policy.auto import parse_candidates

        self.pipe = pipe
        self.default = (self.method, dict(self.options), self.method)  # (method, options, its name in answers)
        if self.method == "auto":
            kind = "class_labels" if pipe.is_class_conditional else "prompts"
            first = [0] if kind == "class_labels" else ["a photo"]
            spec, why = pipe.settle_auto(**{kind: first * self.slots}, batch_size=self.slots, **self.options)
            candidate = parse_candidates(spec)[0]
            if candidate.method == "ar":
                candidate = parse_candidates("mc-sjd:1")[0]
            self.default = (candidate.method, dict(candidate.options), candidate.spec)
            print(f"visar serve: auto settled on {spec}, served as {candidate.spec} ({why})", flush=True)
        pipe.open_batch(self.default[0], slots=self.slots, **self.default[1]).close()  # a bad option: now
        self.default_key = (self.default[2], pipe.sampling_params().guidance_scale)
        self.served = served_methods(pipe.model)
        # the model's images as OpenAI's `size` writes them (WIDTHxHEIGHT), read off one decoded image
        height, width = pipe.decode(torch.zeros(1, *pipe.model.grid_size, dtype=torch.long, device=pipe.device)).shape[
            -2:
        ]
        self.size = f"{width}x{height}"

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
            self.waiting.append(admitted)
            if self.batch is not None and admitted.key == self.key:
                self.start_waiting()
            self.switch_if_idle()
            self.changed.notify_all()

    def step(self, prev_outputs) -> list[Output]:
        with self.changed:
            batch = self.batch if self.owners else None
            if batch is None:  # nothing decoding: a switch of settings under way, or only waiting requests
                self.changed.wait(0.01)
        if batch is not None:
            metrics.PASSES.inc(batch.step(timeout=1.0))
        with self.changed:
            outputs, self.outbox = self.outbox, []
            metrics.SLOTS.set(min(len(self.owners), self.slots))
            queued = sum(a.add["num_images_per_prompt"] for a in self.waiting) + max(len(self.owners) - self.slots, 0)
            metrics.WAITING.set(queued)
        return outputs

    def encode_response(self, output):
        return output  # LitServe writes a dict as one JSON line

    # --- the requests ---

    def send(self, uid: str, output, status):
        with self.changed:
            self.outbox.append(Output(uid, output, status))

    def fail(self, admitted: Admitted, error: HTTPException):
        """In the lock: answer a request with an error, and forget it."""
        self.admitted.pop(admitted.uid, None)
        for index in admitted.indices:
            self.owners.pop(index, None)
        self.outbox.append(Output(admitted.uid, error, LitAPIStatus.ERROR))

    def checked(self, uid: str, request: dict) -> Admitted:
        """A request's settings and `add` arguments, or one VisarError sentence (a 400)."""
        method, label = (request["method"], request["method"]) if request.get("method") else self.default[::2]
        if method not in self.served:
            raise VisarError(
                f"method must be one of {', '.join(self.served)} (lossless methods a running batch "
                f"decodes), or left out for the server's {self.default[2]}; got {method!r}"
            )
        guidance = self.pipe.sampling_params(guidance_scale=request.get("guidance_scale")).guidance_scale
        add = self.add_kwargs(request)
        return Admitted(uid, (label, guidance), add, time.monotonic())

    def start_waiting(self):
        """In the lock: the waiting requests of the running batch's settings join it, up to the first
        request of other settings (those after it wait, so that the batch runs dry and the others get theirs)."""
        while self.waiting and self.waiting[0].key == self.key:
            admitted = self.waiting.pop(0)
            try:
                admitted.indices = self.batch.add(**admitted.add)
            except VisarError as err:
                self.fail(admitted, HTTPException(400, str(err)))
                continue
            self.owners.update(dict.fromkeys(admitted.indices, admitted))
            self.outbox.append(Output(admitted.uid, {"accepted": len(admitted.indices)}, LitAPIStatus.OK))

    def switch_if_idle(self):
        """In the lock: close the running batch once it has no image left and other settings wait (the
        device thread then opens theirs)."""
        if self.batch is not None and not self.owners and self.waiting:
            self.batch.close()

    def add_kwargs(self, request: dict) -> dict:
        pipe, n = self.pipe, request.get("n", 1)
        if request.get("model") not in (None, pipe.name, self.model_arg):
            raise VisarError(f"this server serves {pipe.name}, not {request['model']!r}")
        if n > self.max_images:
            raise VisarError(f"n must be at most {self.max_images} images a request on this server, got {n}")
        prompt, label = request.get("prompt"), request.get("class_label")
        if pipe.is_class_conditional:
            if prompt is not None or label is None:
                raise VisarError(
                    f"{pipe.name} draws a class: give class_label (0..{pipe.num_classes - 1}), not a prompt"
                )
            condition = {"class_labels": [label]}
        else:
            if label is not None or not prompt:
                raise VisarError(f"{pipe.name} draws a text prompt: give prompt, not a class_label")
            condition = {"prompts": [prompt]}
        size = request.get("size")
        if size is not None and size != self.size:
            raise VisarError(f"size must be {self.size} for {pipe.name} (or left out), got {size!r}")
        return dict(
            **condition, negative_prompt=request.get("negative_prompt"), num_images_per_prompt=n, seed=request["seed"]
        )

    def hand_over(self, index: int, image, info: dict):
        encoded = png_base64(image)  # in the device thread, as the image is done
        with self.changed:
            admitted = self.owners.pop(index, None)
            if admitted is None:  # cancelled as it finished
                return
            admitted.done += 1
            passes = int(info["forward_passes"])
            seconds = round(time.monotonic() - admitted.started, 4)
            image = {"index": admitted.indices.index(index), "b64_json": encoded}
            image["visar"] = {"method": admitted.key[0], "forward_passes": passes, "seconds": seconds}
            if admitted.key == self.default_key and self.default[1]:  # --opt, or auto's size
                image["visar"]["options"] = self.default[1]
            self.outbox.append(Output(admitted.uid, image, LitAPIStatus.OK))
            metrics.IMAGES.inc()
            metrics.TOKENS_PER_PASS.observe(self.pipe.model.num_image_tokens / max(passes, 1))
            if admitted.done == len(admitted.indices):
                self.admitted.pop(admitted.uid, None)
                self.outbox.append(Output(admitted.uid, "", LitAPIStatus.FINISH_STREAMING))
                self.switch_if_idle()

    def cancel(self, uid: str):
        with self.changed:
            admitted = self.admitted.pop(uid, None)
            if admitted is None:
                return
            if admitted in self.waiting:
                self.waiting.remove(admitted)
            else:
                left = [index for index in admitted.indices if self.owners.pop(index, None) is admitted]
                if left:
                    self.batch.cancel(left)
            self.outbox.append(Output(uid, "", LitAPIStatus.FINISH_STREAMING))
            self.switch_if_idle()
