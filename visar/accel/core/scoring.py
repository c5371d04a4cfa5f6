"""Guided scoring: the one place where a model is called under classifier-free guidance.

Every engine (ar, jacobi, zipar, tree) and every draft model calls its model through a
`GuidedScorer`. With CFG on, the batch is laid out [cond ; null condition]: inputs, per-sample
positions, masks, cache slots and cache lengths are doubled here, and the two halves of the
logits are mixed here (`sampling.split_cfg`) before `sampling.logits_to_probs`, the function plain
AR samples from, turns them into the target distribution. Nothing else in `visar/accel` knows
about the doubled layout, so a lossless method verifies against exactly what AR samples from.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from ...models.base import MaskedModel, RasterModel
from .sampling import SamplingParams, logits_to_probs, split_cfg


class QueuedConditions:
    """Every queued image's conditions as the model is fed them ([cond ; null condition] under CFG, each
    half in queue order): what a slot takes when it takes an image. The null conditions of the queue
    a call starts with are made at once, as one batch (the caller's `null` rows, one per queued image,
    where it made them: a negative prompt's); an open source's later images are read from it as a
    slot takes one of them (`take`), their null conditions made then."""

    def __init__(
        self, model: RasterModel, guided: bool, cond: Tensor, cond_mask: Tensor | None, source=None, null=None
    ):
        self.model, self.guided, self.source = model, guided, source
        self.count = cond.shape[0]  # Q
        if source is not None:
            null = source.null_rows(torch.arange(self.count))
        self.cond, self.mask = self.model_rows(cond, cond_mask, null)  # [Q(x2), ...]

    def model_rows(self, cond: Tensor, cond_mask: Tensor | None, null=None) -> tuple[Tensor, Tensor | None]:
        """Conditions [R, ...] and their masks -> the model's rows ([cond ; null condition] under CFG);
        null: the null conditions and their mask where the caller made them (an open source's negative
        prompts), else the model's."""
        if not self.guided:
            return cond, cond_mask
        count = cond.shape[0]
        if null is None:
            null_mask = self.model.null_condition_mask(cond_mask)
            null = self.model.null_condition(cond)
        else:
            null, null_mask = null
        cond = torch.cat([cond, null])
        if null_mask is not None:  # a null condition with padding of its own pads a maskless cond too
            if cond_mask is None:
                cond_mask = torch.ones(null_mask.shape[-1], dtype=torch.bool, device=cond.device).expand(count, -1)
            cond_mask = torch.cat([cond_mask, null_mask.expand(count, -1).to(cond_mask.device)])
        return cond, cond_mask

    def halves(self, index: Tensor, size: int) -> Tensor:
        """Indices [R] into a batch of `size` -> their rows in its model layout ([R ; R + size] under CFG)."""
        return torch.cat([index, index + size]) if self.guided else index

    def take(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        """The model rows ([R(x2), ...]) and masks of queued images [R]; an open source's are read from it
        (they may have joined since the start; their null conditions made now), so nothing here grows."""
        if self.source is not None and int(images.max()) >= self.count:
            return self.model_rows(*self.source.rows(images), self.source.null_rows(images))
        queued = self.halves(images, self.count)
        return self.cond[queued], None if self.mask is None else self.mask[queued]


class GuidedScorer:
    """A raster model, a batch of B conditions and the sampling settings: guided logits and target laws [B, ...].

    slots: the model batch holds `slots` images at a time (default: all of them), and cond /
    cond_mask are a queue of Q images' conditions (`QueuedConditions`), of which slot b holds image b
    at first and the image `admit` gives it later (a running batch that refills its finished slots);
    source: an open one's (`core.source.ImageSource`), which may start with fewer images than slots
    (the others decode spares: the last image's condition) and grows; null: the caller's null rows.
    """

    def __init__(
        self, model: RasterModel, cond: Tensor, cond_mask: Tensor | None, params: SamplingParams, slots=None,
        kv_keep=1.0, source=None, null=None, kv_evict="h2o",
    ):  # fmt: skip
        self.model, self.params = model, params
        self.kv_keep = kv_keep  # the fraction of cache slots `open_cache` keeps (1: the whole cache, exact)
        self.kv_evict = kv_evict  # below 1, the rule that chooses what the cache evicts
        self.guided = params.uses_cfg
        queue = cond.shape[0]
        if slots is not None and not 1 <= slots <= (queue if source is None else slots):
            raise ValueError(f"slots must be 1 .. {queue} (the images queued), got {slots}")
        self.batch = queue if slots is None else slots
        self.queued = QueuedConditions(model, self.guided, cond, cond_mask, source, null)
        if slots is None:
            self.cond, self.cond_mask = self.queued.cond, self.queued.mask
        else:
            self.cond, self.cond_mask = self.queued.take(torch.arange(slots, device=cond.device).clamp(max=queue - 1))
        # self.cond, self.cond_mask [B(x2), ...]: what the model is fed
        self.forward_passes = 0

    @classmethod
    def for_request(cls, request, model: RasterModel | None = None) -> GuidedScorer:
        """A request's target scorer, or a draft `model`'s (no kv_keep: a draft keeps its whole cache; the
        caller's null conditions only where it reads the same prompts: a class model's null is its own)."""
        target = model is None
        return cls(
            request.model if target else model,
            request.cond,
            request.cond_mask,
            request.params,
            request.slots,
            request.kv_keep if target else 1.0,
            request.source,
            request.null if target or reads_prompts(model) else None,
            request.kv_evict,
        )

    def halves(self, index: Tensor, size: int) -> Tensor:
        """Indices [R] into a batch of `size` -> their rows in its model layout ([R ; R + size] under CFG)."""
        return self.queued.halves(index, size)

    def admit(self, rows: Tensor, images: Tensor):
        """Slots `rows` [R] now hold queued images `images` [R]: their conditions (both halves under
        CFG) replace the slots' and the model forgets the slots' cache rows, so the next
        `prefill(rows)` starts those images while the other slots keep theirs."""
        model_rows = self.halves(rows, self.batch)
        cond, cond_mask = self.queued.take(images)
        # out of place: self.cond may be the caller's tensor, which is the queue itself
        self.cond = self.cond.index_copy(0, model_rows, cond)
        if self.cond_mask is not None:
            self.cond_mask = self.cond_mask.index_copy(0, model_rows, cond_mask)
        self.model.reset_cache_rows(model_rows, None if self.cond_mask is None else self.cond_mask[model_rows])

    def open_cache(self, length: int):
        """An empty KV cache of `length` slots for this batch (both halves under CFG); with kv_keep < 1,
        a compressed one that keeps ceil(kv_keep * length) of them per row, evicting by the rule kv_evict
        (`RasterModel.setup_cache`)."""
        compressed = {} if self.kv_keep == 1 else {"kv_keep": self.kv_keep, "kv_evict": self.kv_evict}
        self.model.setup_cache(self.cond.shape[0], length, self.cond_mask, **compressed)

    def close_cache(self):
        self.model.clear_cache()

    @contextmanager
    def cache(self, length: int):
        """`open_cache` for the block, cleared on exit (an exception included)."""
        self.open_cache(length)
        try:
            yield self
        finally:
            self.close_cache()

    def doubled(self, x: Tensor | None) -> Tensor | None:
        """A per-sample tensor [B, ...] laid out for the model's batch ([B ; B] under CFG)."""
        return torch.cat([x, x]) if self.guided and x is not None else x

    def logits(
        self,
        tokens: Tensor | None = None,
        input_pos: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        cache_pos: Tensor | None = None,
        with_condition: bool = False,
        rows: Tensor | None = None,
    ) -> Tensor:
        """One forward pass -> guided logits [B, L, V] (float32).

        tokens [B, L']; input_pos and cache_pos [L] (shared) or [B, L] (per image); mask [B, L, S].
        with_condition: feed the condition first (the prefill), so L = T + L'. rows [R]: the pass is
        for these slots only, and every per-image tensor (and the logits) has R rows instead of B.
        """

        def per_image(x):  # shared [L] positions serve both halves as they are
            return self.doubled(x) if x is not None and x.dim() >= 2 else x

        if rows is None:
            cond, model_rows = self.cond, None
        else:
            model_rows = self.halves(rows, self.batch)
            cond = self.cond[model_rows]
        out = self.model(
            self.doubled(tokens),
            cond if with_condition else None,
            input_pos=per_image(input_pos),
            mask=self.doubled(mask),
            cache_pos=per_image(cache_pos),
            rows=model_rows,
        )
        self.forward_passes += 1
        return split_cfg(out, self.params, self.scheduled_scale(input_pos, out.shape[1], with_condition))

    def scheduled_scale(self, input_pos: Tensor | None, length: int, with_condition: bool) -> Tensor | None:
        """The guidance scale of each output ([L, 1] or [B, L, 1]) when the model's own sampler schedules it
        (`guidance_schedule`, e.g. Lumina-mGPT 2.0's), else None (the params' scale everywhere). Output
        at position p predicts image token p + 1 - T, so the schedule is read there."""
        schedule = getattr(self.model, "guidance_schedule", None)
        if schedule is None or not self.guided:
            return None
        num_cond = self.model.num_condition_tokens
        if input_pos is None:  # the model's default: from 0 with the condition, else from T
            input_pos = torch.arange(length, device=self.model.device) + (0 if with_condition else num_cond)
        image_index = (input_pos + 1 - num_cond).clamp(min=0)
        return schedule(self.params.guidance_scale, image_index)[..., None]

    def target_probs(self, logits: Tensor) -> Tensor:
        """Guided logits [..., V] -> the target distribution [..., V] (temperature, top-k, top-p)."""
        return logits_to_probs(logits, self.params)

    def prefill(self, rows: Tensor | None = None) -> Tensor:
        """The condition alone, at positions 0 .. T - 1 -> the target law of image token 0 [B, V];
        rows [R]: of these slots only -> [R, V]."""
        input_pos = torch.arange(self.model.num_condition_tokens, device=self.model.device)
        return self.target_probs(self.logits(input_pos=input_pos, with_condition=True, rows=rows)[:, -1])

    def truncate_cache(self, lengths: Tensor):
        """Keep the first lengths[b] cache slots of image b ([B])."""
        self.model.truncate_cache(self.doubled(lengths))


def reads_prompts(model) -> bool:
    """A model conditioned on text: a negative prompt's null conditions are its too."""
    layout = getattr(model, "condition_layout", None)
    return layout is not None and layout.kind == "text"


class MaskedScorer:
    """A masked model, a batch of B conditions and the sampling settings: one full pass -> target laws [B, N, V].

    The same CFG layout ([cond ; null condition]) and the same `logits_to_probs` as `GuidedScorer`,
    without a cache: every call feeds the whole grid (unknown positions at the mask id).
    """

    def __init__(self, model: MaskedModel, cond: Tensor, cond_mask: Tensor | None, params: SamplingParams, null=None):
        self.model, self.params = model, params
        self.guided = params.uses_cfg
        if self.guided:  # null: the caller's null conditions and masks (a negative prompt's), else the model's
            null, null_mask = (
                (model.null_condition(cond), model.null_condition_mask(cond_mask)) if null is None else null
            )
            cond = torch.cat([cond, null])
            cond_mask = None if cond_mask is None else torch.cat([cond_mask, null_mask])
        self.cond, self.cond_mask = cond, cond_mask  # [B(x2), ...]
        self.forward_passes = 0

    def target_probs(self, tokens: Tensor) -> Tensor:
        """tokens [B, N] (mask id where unknown) -> the target law of every position [B, N, V] (float32)."""
        doubled = torch.cat([tokens, tokens]) if self.guided else tokens
        logits = self.model(doubled, self.cond, self.cond_mask)
        self.forward_passes += 1
        return logits_to_probs(split_cfg(logits, self.params), self.params)
