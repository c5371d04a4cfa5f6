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
import base64
import functools
import io
import logging
import threading
import time
from dataclasses import dataclass

import litserve as ls
import torch
from fastapi import HTTPException
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop, Output
from litserve.utils import LitAPIStatus

from ...errors import VisarError
from ...pipeline.shared_device import BatchImages, SharedDevice
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
    """One request: its settings (method label, guidance scale), its images' job, and when it came."""

    uid: str
    label: str
    guidance: float
    job: BatchImages
    started: float


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
        self.changed = threading.Condition()  # guards what follows
        self.admitted: dict[str, Admitted] = {}  # the requests not yet answered in full
        self.outbox: list[Output] = []
        # one thread loads the model and runs every batch (`SharedDevice`: a model holds one batch's KV
        # cache; on a CPU, torch in a second thread made a decode 1.6x slower at two threads)
        self.shared = SharedDevice(self.slots, paced=True)
        self.shared.call(lambda: self.settle(self.load(device))).result()  # a failure fails the worker's setup

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
        """A request's settings and images' job, or one VisarError sentence (a 400)."""
        method, label = (request["method"], request["method"]) if request.get("method") else self.default[::2]
        if method not in self.served:
            raise VisarError(
                f"method must be one of {', '.join(self.served)} (lossless methods a running batch "
                f"decodes), or left out for the server's {self.default[2]}; got {method!r}"
            )
        guidance = self.pipe.sampling_params(guidance_scale=request.get("guidance_scale")).guidance_scale
        options = self.default[1] if label == self.default[2] else {}
        job = BatchImages(self.pipe, method, {**options, "guidance_scale": guidance}, self.add_kwargs(request))
        admitted = Admitted(uid, label, guidance, job, time.monotonic())
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

    def hand_over(self, admitted: Admitted, position: int, image, info: dict):
        encoded = png_base64(image)  # in the device thread, as the image is done
        passes = int(info["forward_passes"])
        image = {"index": position, "b64_json": encoded}
        image["visar"] = {
            "method": admitted.label,
            "forward_passes": passes,
            "seconds": round(time.monotonic() - admitted.started, 4),
        }
        if admitted.label == self.default[2] and self.default[1]:  # --opt, or auto's size
            image["visar"]["options"] = self.default[1]
        with self.changed:
            if admitted.uid not in self.admitted:  # cancelled as it finished
                return
            self.outbox.append(Output(admitted.uid, image, LitAPIStatus.OK))
        metrics.IMAGES.inc()
        metrics.TOKENS_PER_PASS.observe(self.pipe.model.num_image_tokens / max(passes, 1))

    def cancel(self, uid: str):
        with self.changed:
            admitted = self.admitted.pop(uid, None)
            if admitted is not None:
                self.outbox.append(Output(uid, "", LitAPIStatus.FINISH_STREAMING))
        if admitted is not None:
            self.shared.cancel(admitted.job)
