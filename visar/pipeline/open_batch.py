"""`Pipeline.open_batch`: a running batch that takes images while it decodes.

A device shared by several callers (a service such as `visar serve`, a script that streams prompts in) decodes
their images in one running batch: `add` queues a caller's images from any thread, each taking a
free slot between passes, `run` decodes in the thread that calls it and hands each image to
`on_image` as soon as it is done, and `close` lets `run` return once every image is. An image's
tokens are those of its decode alone, whenever it joined (the law at any batch size on any device;
the same bits on a CPU at one torch thread), as with `generate(batch_size=)`.

    batch = pipe.open_batch("mc-sjd", slots=8)
    worker = threading.Thread(target=batch.run, kwargs={"on_image": save})
    worker.start()
    ids = batch.add(class_labels=[3, 7], seed=0)   # from any thread, at any time before close()
    batch.close()
    worker.join()

One batch has one method, its options and one set of sampling settings (guidance is one scale per
pass); negative prompts, seeds and conditions are per `add`. `cancel` takes images back (a caller
that left): they leave their slots before the next pass, and the others' tokens do not change. A
`paced` batch runs a pass only when `step` lets it, so a serving loop (visar serve, on LitServe's
continuous batching) advances it one pass per loop step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..accel import Request
from ..accel.core.scoring import reads_prompts
from ..accel.core.source import ImageSource
from ..errors import VisarError
from ..models.base import check_kv_evict, model_kind
from .conditions import SAMPLING_SETTINGS, image_conditions, image_generators, null_rows
from .images import check_output_type
from .runs import check_kv_keep, checked_method, image_callback, second_model


class OpenBatch:
    """A running batch of `slots` that images join while it decodes (`Pipeline.open_batch`)."""

    def __init__(
        self, pipe, method: str, slots: int, *, output_type="pil", kv_keep=1.0, kv_evict="h2o", progress=False,
        paced=False, **settings,
    ):  # fmt: skip
        if model_kind(pipe.model) != "raster":
            raise VisarError(f"an open batch decodes a raster model's running batch; {pipe.name} is not one")
        sampling = {k: settings.pop(k) for k in SAMPLING_SETTINGS if k in settings}
        self.name, self.method = checked_method(pipe.model, pipe.name, method, settings)
        if not self.method.refills or self.name == "auto":
            raise VisarError(
                f"an open batch runs one method that refills its slots (sjd, mc-sjd, tree-mc-sjd, the zipar "
                f"fronts, ...), not {self.name!r}: name one, at a fixed size (auto decodes a fixed list)"
            )
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise VisarError(f"slots must be a whole number >= 1, got {slots!r}")
        check_output_type(output_type)
        self.pipe, self.slots, self.options, self.output_type = pipe, slots, settings, output_type
        self.params = pipe.sampling_params(**sampling)
        self.kv_keep, self.progress = check_kv_keep(pipe.model, pipe.name, kv_keep), progress
        self.kv_evict = check_kv_evict(kv_evict)
        self.second = second_model(self.method, self.options, pipe.resolve_draft)
        self.source: ImageSource | None = None  # made by the first add: a source starts with an image
        self.changed = threading.Condition()
        self.closed, self.paced = False, paced

    def add(
        self,
        class_labels=None,
        prompts=None,
        *,
        negative_prompt=None,
        num_images_per_prompt: int = 1,
        seed: int = 0,
        caption_embeds=None,
        caption_mask=None,
    ) -> list[int]:
        """Queue images as `generate` takes them (image j of item i of P seeded seed + j * P + i) -> their
        indices in this batch, the ones `on_image` is called with. Any thread; VisarError once closed."""
        images = image_conditions(
            self.pipe, class_labels, prompts, caption_embeds, caption_mask, negative_prompt, num_images_per_prompt
        )
        if images.negative is not None and self.second is not None and reads_prompts(self.second):
            raise VisarError("an open batch takes no negative prompt with a draft model that reads prompts")
        generators = image_generators(None, seed, images)
        # every image's null conditions (its negative prompt's, else the model's): a batch may mix them
        null = null_rows(self.pipe.model, images, self.params.uses_cfg, own=True)
        with self.changed:
            if self.closed:
                raise VisarError("this open batch is closed: it takes no more images")
            if self.source is None:
                self.source = ImageSource(
                    images.cond, images.cond_mask, generators, closed=False, null=null, paced=self.paced
                )
                self.changed.notify_all()
                return list(range(images.count))
            try:
                return list(self.source.add(images.cond, images.cond_mask, generators, null))
            except (RuntimeError, ValueError) as err:  # a condition of another layout (prompt length, mask)
                raise VisarError(f"these images cannot join this open batch: {err}") from err

    def cancel(self, indices) -> None:
        """Take back images of this batch (indices `add` gave): those waiting never start, those in slots
        leave them before the next pass; none is handed over unless it was done already. Any thread."""
        with self.changed:
            if self.source is not None:
                self.source.cancel(indices)

    def step(self, timeout: float = 0.05) -> bool:
        """A paced batch: let `run` decode one pass, and wait until it has, its finished images handed to
        on_image (-> True), or `timeout` s (-> False: idle, or a pass that takes longer)."""
        if not self.paced:
            raise VisarError("step() paces a batch opened with paced=True; this one runs its passes unpaced")
        with self.changed:
            source = self.source
        return False if source is None else source.allow_pass(timeout)

    def close(self):
        """No more images: `run` returns once every queued image is done."""
        with self.changed:
            self.closed = True
            if self.source is not None:
                self.source.close()
            self.changed.notify_all()

    @torch.no_grad()
    def run(self, on_image: Callable | None = None) -> dict:
        """Decode until the batch is closed and every image is done, in this thread; on_image(index, image
        in the output type, {"forward_passes", "commit_pass" [h, w]}) as each is. -> the batch's stats:
        `images` handed over, tokens_per_forward over them (nothing of an image is kept once it is handed
        over, nor its condition once it took a slot: a service's batch may run for ever)."""
        with self.changed:
            self.changed.wait_for(lambda: self.source is not None or self.closed)
            if self.source is None:
                return {"forward_passes": 0, "forward_passes_per_image": [], "images": 0}
        source, pipe = self.source, self.pipe

        def hand_over(index, tokens, info):  # tokens and commit_pass in the output's shapes (`image_callback`)
            if on_image is None:  # still handed over: an open batch keeps no image
                return
            if self.output_type != "tokens":
                tokens = pipe.to_output(pipe.decode(tokens[None]), self.output_type)[0]
            on_image(index, tokens, info)

        cond, cond_mask, generators = source.snapshot()
        request = Request(
            pipe.model, cond, self.params, generators, cond_mask, self.progress, tokenizer=pipe.tokenizer,
            compile_passes=pipe.compile_options if pipe.is_compiled else None, slots=self.slots,
            on_image=image_callback(pipe.model, hand_over), kv_keep=self.kv_keep, kv_evict=self.kv_evict,
            source=source,
        )  # fmt: skip
        _, stats = self.method.fn(request, **self.options)
        return {**stats, "method": self.name, "lossless": self.method.is_lossless(self.options, pipe.model)}
