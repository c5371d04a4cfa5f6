"""The inference worker of `visar serve`: a LitServe `LitAPI` whose continuous-batching step is one pass
of each open running batch (`Pipeline.open_batch`, paced), so a request's images take free slots
between passes and each image is answered as soon as its request is done.

LitServe's `ContinuousBatchingLoop` calls `add_request` as requests arrive (its scheduling task) and
`step` in a loop while `has_active_requests`; each `step` lets every batch with images in flight run
one pass (`OpenBatch.step`) and returns what came of it: a request's acceptance (or its one-sentence
400), each finished image, the end of a finished request. The decode itself runs in one thread per
batch, which waits between passes for the next step. A batch is one method and guidance scale (one
scale a pass): requests that differ in them decode in separate batches, stepped in turn.
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
from fastapi import HTTPException
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop, Output
from litserve.utils import LitAPIStatus

from ...errors import VisarError
from . import metrics

MAX_BATCHES = 4


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
        while lit_api.has_active_requests():  # requests still join between passes: add_request runs meanwhile
            if outputs := await asyncio.to_thread(lit_api.step, prev_outputs):
                return outputs
        return []  # settings (method, guidance) decoded at once; an idle batch makes room for another


@dataclass
class Admitted:
    """One request's images in a batch: their indices there, and what is done of them."""

    uid: str
    key: tuple
    indices: list[int]
    started: float
    done: int = 0


@dataclass
class Batch:
    """An open, paced running batch and the decode thread that runs it."""

    batch: object
    thread: threading.Thread
    owners: dict[int, Admitted] = field(default_factory=dict)  # batch index -> its request

    def busy(self) -> bool:
        return bool(self.owners)


def png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class ImagesAPI(ls.LitAPI):
    """The model's open running batches behind LitServe's continuous batching (`visar serve`)."""

    def __init__(self, load, model_arg: str, *, method: str, slots: int, options: dict, max_images: int, spec):
        super().__init__(stream=True, loop=PassLoop(), spec=spec, max_batch_size=slots)
        self.load, self.model_arg, self.method, self.slots = load, model_arg, method, slots
        self.options, self.max_images = options, max_images

    def setup(self, device):
        from ...accel.policy.auto import parse_candidates

        # LitServe warns on each step that finished no image, which is most passes
        logging.getLogger("litserve.loops.continuous_batching_loop").setLevel(logging.ERROR)
        self.pipe = self.load(device)
        self.lock = threading.Lock()  # the decode threads hand images over while step and add_request run
        self.batches: dict[tuple, Batch] = {}
        self.admitted: dict[str, Admitted] = {}
        self.outbox: list[Output] = []
        # (method, options, the name a response gives it)
        self.default = (self.method, dict(self.options), self.method)
        if self.method == "auto":  # the candidate auto settles on for batches of `slots`, chosen once here
            kind = "class_labels" if self.pipe.is_class_conditional else "prompts"
            first = [0] if kind == "class_labels" else ["a photo"]
            spec, why = self.pipe.settle_auto(**{kind: first * self.slots}, batch_size=self.slots, **self.options)
            candidate = parse_candidates(spec)[0]
            if candidate.method == "ar":  # AR's law at a token a pass, in a batch that refills its slots
                candidate = parse_candidates("mc-sjd:1")[0]
            self.default = (candidate.method, dict(candidate.options), candidate.spec)
            print(f"visar serve: auto settled on {spec}, served as {candidate.spec} ({why})", flush=True)
        self.pipe.open_batch(self.default[0], slots=self.slots, **self.default[1]).close()  # a bad one: now
        metrics.SLOTS.set(0)

    # --- LitServe's continuous-batching contract ---

    def has_capacity(self) -> bool:
        return True  # an open batch queues what it cannot seat; the HTTP side bounds the requests in flight

    def has_active_requests(self) -> bool:
        with self.lock:
            return bool(self.admitted or self.outbox)

    def add_request(self, uid: str, request) -> None:
        if "cancel" in request:  # the HTTP side's word that a caller left or ran out of time
            self.cancel(request["cancel"])
            self.send(uid, "", LitAPIStatus.FINISH_STREAMING)
            return
        try:
            self.admit(uid, request)
        except VisarError as err:
            self.send(uid, HTTPException(400, str(err)), LitAPIStatus.ERROR)

    def step(self, prev_outputs) -> list[Output]:
        with self.lock:
            running = [b for b in self.batches.values() if b.busy()]
        passes = sum(b.batch.step(timeout=1.0) for b in running)
        metrics.PASSES.inc(passes)
        with self.lock:
            outputs, self.outbox = self.outbox, []
            metrics.SLOTS.set(sum(min(len(b.owners), self.slots) for b in self.batches.values()))
            metrics.WAITING.set(sum(max(len(b.owners) - self.slots, 0) for b in self.batches.values()))
        return outputs

    def encode_response(self, output):
        return output  # LitServe writes a dict as one JSON line

    # --- the batches ---

    def send(self, uid: str, output, status):
        with self.lock:
            self.outbox.append(Output(uid, output, status))

    def admit(self, uid: str, request: dict):
        method, options, label = (request["method"], {}, request["method"]) if request.get("method") else self.default
        self.check_method(method)
        add = self.add_kwargs(request)
        key = (label, request.get("guidance_scale"))
        with self.lock:
            batch = self.batches.get(key) or self.open(key, method, options)
            indices = batch.batch.add(**add)
            admitted = Admitted(uid, key, indices, time.monotonic())
            self.admitted[uid] = admitted
            batch.owners.update(dict.fromkeys(indices, admitted))
            self.outbox.append(Output(uid, {"accepted": len(indices)}, LitAPIStatus.OK))

    def check_method(self, method: str):
        if method not in self.served_methods():
            raise VisarError(
                f"method must be one of {', '.join(self.served_methods())} (lossless methods a running batch "
                f"decodes), or left out for the server's {self.default[2]}; got {method!r}"
            )

    def served_methods(self) -> list[str]:
        from ...accel import METHODS

        return sorted(
            name
            for name, m in METHODS.items()
            if m.refills
            and m.model_kind == "raster"
            and name != "auto"
            and m.is_lossless({}, self.pipe.model)
            and not m.needs_draft
        )

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
        if size is not None and size != self.size():
            raise VisarError(f"size must be {self.size()} for {pipe.name} (or left out), got {size!r}")
        return dict(
            **condition, negative_prompt=request.get("negative_prompt"), num_images_per_prompt=n, seed=request["seed"]
        )

    def size(self) -> str:
        """The model's images as OpenAI's `size` writes them (WIDTHxHEIGHT), read off one decoded image."""
        if not hasattr(self, "pixels"):
            import torch

            tokens = torch.zeros(1, *self.pipe.model.grid_size, dtype=torch.long, device=self.pipe.device)
            height, width = self.pipe.decode(tokens).shape[-2:]
            self.pixels = f"{width}x{height}"
        return self.pixels

    def open(self, key: tuple, method: str, options: dict) -> Batch:
        """A new paced batch for these settings (after closing idle ones past MAX_BATCHES); in the lock."""
        for idle in [k for k, b in self.batches.items() if not b.busy()][: max(len(self.batches) + 1 - MAX_BATCHES, 0)]:
            self.batches.pop(idle).batch.close()
        if len(self.batches) >= MAX_BATCHES:
            raise VisarError(
                f"this server decodes {MAX_BATCHES} settings (method, guidance_scale) at once, all busy: retry later, "
                "or use the server's default method and guidance"
            )
        guidance = {} if key[1] is None else {"guidance_scale": key[1]}
        opened = self.pipe.open_batch(method, slots=self.slots, paced=True, **options, **guidance)
        thread = threading.Thread(target=self.decode, args=(key, opened), name=f"visar-batch-{key[0]}", daemon=True)
        self.batches[key] = Batch(opened, thread)
        thread.start()
        return self.batches[key]

    def decode(self, key: tuple, opened):
        try:
            opened.run(on_image=lambda index, image, info: self.hand_over(key, index, image, info))
        except Exception as err:  # every request of the batch learns of it; the server goes on
            logging.getLogger("visar.serve").exception("a running batch (%s) failed", key[0])
            with self.lock:
                batch = self.batches.pop(key, None)
                for admitted in {id(a): a for a in (batch.owners.values() if batch else [])}.values():
                    self.admitted.pop(admitted.uid, None)
                    self.outbox.append(Output(admitted.uid, HTTPException(500, f"the decode failed: {err}"), "ERROR"))

    def hand_over(self, key: tuple, index: int, image, info: dict):
        encoded = png_base64(image)  # in the decode thread, as the image is done
        with self.lock:
            batch = self.batches.get(key)
            admitted = batch.owners.pop(index, None) if batch else None
            if admitted is None:  # cancelled as it finished
                return
            admitted.done += 1
            seconds = time.monotonic() - admitted.started
            passes = int(info["forward_passes"])
            self.outbox.append(
                Output(
                    admitted.uid,
                    {
                        "index": admitted.indices.index(index),
                        "b64_json": encoded,
                        "visar": {"method": key[0], "forward_passes": passes, "seconds": round(seconds, 4)},
                    },
                    LitAPIStatus.OK,
                )
            )
            metrics.IMAGES.inc()
            metrics.TOKENS_PER_PASS.observe(self.pipe.model.num_image_tokens / max(passes, 1))
            if admitted.done == len(admitted.indices):
                self.admitted.pop(admitted.uid, None)
                self.outbox.append(Output(admitted.uid, "", LitAPIStatus.FINISH_STREAMING))

    def cancel(self, uid: str):
        with self.lock:
            admitted = self.admitted.pop(uid, None)
            if admitted is None:
                return
            batch = self.batches.get(admitted.key)
            if batch is not None:
                waiting = [i for i in admitted.indices if batch.owners.get(i) is admitted]
                for index in waiting:
                    del batch.owners[index]
                batch.batch.cancel(waiting)
            self.outbox.append(Output(uid, "", LitAPIStatus.FINISH_STREAMING))
