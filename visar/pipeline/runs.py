"""A decoding method's run over a `generate` call's images: alone, as a running batch or in consecutive
batches, each image handed over as it is done.

The functions take the model they run (and, for messages, the pipeline's name); a second model
given by name is resolved by the pipeline (`second_model` takes its `resolve_draft`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch

from ..accel import Request, get_method, reference_method
from ..accel.core.method_registry import consecutive_batches, decode_queue
from ..accel.core.sampling import SamplingParams
from ..accel.core.stats import batch_of_one, per_image
from ..accel.policy.auto import settled
from ..errors import VisarError
from ..models.base import check_kv_evict, model_kind
from ..models.outputs import output_maps
from .conditions import SAMPLING_SETTINGS, ImageConditions, image_conditions, image_generators, null_rows


def out_of_memory(err: Exception, batch: int, method: str, device: torch.device) -> VisarError:
    """The error for a generation that ran out of device memory, naming what lowers it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return VisarError(
        f"out of {device.type} memory generating {batch} images with {method!r} on {device}: lower the batch size "
        "(--batch-size, or fewer labels / prompts per call), use a smaller window for window methods "
        "(--opt window=4), or a smaller dtype (--dtype bf16)"
    )


class Run(NamedTuple):
    """One method call's arguments: the method, its request (the negative prompt's null conditions in
    it) and its options (a second model among them)."""

    method: Any
    request: Request
    options: dict

    @property
    def name(self) -> str:
        return self.method.name


def resolve_method(model, method: str | None) -> str | None:
    """The method `generate` runs for `method`: None, the model kind's reference; "auto" on a kind
    other than raster, its reference too (no faster lossless method there without a draft)."""
    if method is None or (method == "auto" and model_kind(model) != "raster"):
        return reference_method(model)
    return method


def checked_method(model, model_name: str, method: str | None, options: dict):
    """(name, registered method) for `method` (None: the kind's plain sampling), its options and the
    model checked against it (`model_name`: the pipeline's, for the message)."""
    method = resolve_method(model, method)
    decoding_method = get_method(method)
    decoding_method.check_options(options)
    decoding_method.check_model(model, model_name)
    return method, decoding_method


def check_kv_keep(model, model_name: str, kv_keep) -> float:
    """kv_keep as a float in (0, 1]; a model of another kind than raster takes only 1."""
    if isinstance(kv_keep, bool) or not isinstance(kv_keep, (int, float)) or not 0 < kv_keep <= 1:
        raise VisarError(f"kv_keep must be a number in (0, 1] (the fraction of KV-cache slots kept), not {kv_keep!r}")
    if kv_keep != 1 and model_kind(model) != "raster":
        raise VisarError(f"kv_keep compresses a raster model's KV cache; {model_name} is a {model_kind(model)} model")
    return float(kv_keep)


def second_model(decoding_method, options: dict, resolve_draft: Callable):
    """The method's second model (option `draft`, or code's `refiner`: a registered name, folder, Pipeline or
    model), resolved to a model in `options` (`Pipeline.resolve_draft`); None when it has none."""
    option = decoding_method.draft_option
    if options.get(option) is not None:
        options[option] = resolve_draft(options[option])
    return options.get(option)


def method_request(
    pipe, images: ImageConditions, params: SamplingParams, generators, progress, *, kv_keep, kv_evict
) -> Request:
    """The decoding method's request: every image of the call, with its sampling settings, generator and
    (under a negative prompt) the null conditions guidance pairs it with, for `pipe`'s model (its
    passes compiled where the pipeline is, eager again after a compile failure)."""
    return Request(
        pipe.model,
        images.cond,
        params,
        generators,
        images.cond_mask,
        progress,
        tokenizer=pipe.tokenizer,
        compile_passes=pipe.compile_options if pipe.is_compiled else None,
        kv_keep=kv_keep,
        kv_evict=kv_evict,
        null=null_rows(pipe.model, images, params.uses_cfg),
    )


def decode_images(model, run: Run, slots: int | None, deterministic: bool, on_image):
    """The method over the call's images: each alone (deterministic), as a running batch of `slots`
    (a method that refills), or in consecutive batches of `slots` (the others, ar among them: its
    slots all free at once) -> tokens and stats in the output's shapes; on_image gets each image as
    it is done (a running batch), as its batch is (consecutive batches, one image alone), or all at
    the end, through the one hand-over of `method_registry.decode_queue`."""
    choice = {}  # {"auto", "auto_reason"} where auto settled its candidate first
    if deterministic and run.name == "auto":  # its choice made first: each image's bits then hold
        run, choice = settled_run(model, run, slots, deterministic)
    request = replace(run.request, slots=slots, on_image=image_callback(model, on_image), note=choice)
    try:
        with deterministic_algorithms(model.device, deterministic):
            if deterministic:  # one image a batch: every model call has the shapes of its decode alone
                tokens, stats = consecutive_batches(request, 1, lambda batch: run.method.fn(batch, **run.options))
            else:
                tokens, stats = decode_queue(request, run.method, run.options)
    except torch.OutOfMemoryError as err:
        images = run.request.cond.shape[0]
        raise out_of_memory(err, 1 if deterministic else slots or images, run.name, model.device) from err
    if slots is not None and not run.method.refills and not deterministic:
        images = run.request.cond.shape[0]  # a running batch's counts: its images start `slots` at a time
        stats.update(slots=slots, refills=images - slots, batch_passes=stats["forward_passes"])
    tokens, stats["commit_pass"] = output_maps(model, tokens, stats["commit_pass"])
    return tokens, stats | choice


def settled_run(model, run: Run, slots: int | None, deterministic: bool) -> tuple[Run, dict]:
    """`auto` made the named candidate it chooses for calls like this one before any of their images
    counts (`auto.settled`: the winner kept for the key these calls decode under, each image alone when
    deterministic, else `slots` or all at a time; else one timed on throwaway images of the call's first
    conditions) -> the candidate's run, and stats naming it ({"auto", "auto_reason"})."""
    count = 1 if deterministic else slots or run.request.cond.shape[0]
    probe = replace(run.request.images(0, count), slots=None if deterministic or slots is None else count)
    candidate, why = settled(probe, **run.options)
    choice = run._replace(method=get_method(candidate.method), options=dict(candidate.options))
    return choice, {"auto": candidate.spec, "auto_reason": why}


def settle_auto(pipe, class_labels=None, prompts=None, *, batch_size=None, deterministic=False, **generate_kwargs):
    """`auto`'s choice for a run of `generate` calls like generate(class_labels / prompts, batch_size=,
    deterministic=, **generate_kwargs), made before any of its images (`settled_run`) -> (candidate spec,
    e.g. "mc-sjd:8", and why); None where auto is not what the model runs (a kind other than raster).
    The conditions are the run's first ones (throwaway images of them are timed where nothing is kept)."""
    sampling = {k: generate_kwargs.pop(k, None) for k in SAMPLING_SETTINGS}
    negative_prompt, kv_keep = generate_kwargs.pop("negative_prompt", None), generate_kwargs.pop("kv_keep", 1.0)
    kv_evict = check_kv_evict(generate_kwargs.pop("kv_evict", "h2o"))
    name, method = checked_method(pipe.model, pipe.name, "auto", generate_kwargs)
    if name != "auto":
        return None
    images = image_conditions(pipe, class_labels, prompts, None, None, negative_prompt, 1)
    slots = None if batch_size is None else min(batch_size, images.count)
    request = method_request(
        pipe, images, pipe.sampling_params(**sampling), image_generators(None, 0, images), False,
        kv_keep=check_kv_keep(pipe.model, pipe.name, kv_keep), kv_evict=kv_evict,
    )  # fmt: skip
    _, note = settled_run(pipe.model, Run(method, request, generate_kwargs), slots, deterministic)
    return note["auto"], note["auto_reason"]


def image_callback(model, on_image):
    """The accel layer's hand-over (index, an image's tokens, info with its commit_pass) ->
    on_image(index, the image's output tokens, info with its commit_pass in the output's shape);
    None without on_image."""
    if on_image is None:
        return None

    def hand_over(index, tokens, info):
        tokens, commit_pass = output_maps(model, batch_of_one(tokens), batch_of_one(info["commit_pass"]))
        on_image(index, per_image(tokens)[0], {**info, "commit_pass": per_image(commit_pass)[0]})

    return hand_over


@contextmanager
def deterministic_algorithms(device: torch.device, enabled: bool):
    """torch's deterministic algorithms for a CUDA call made with deterministic=True (the same shapes then
    give the same bits), restored after; cuBLAS's workspace is fixed first, as torch asks. A CPU's
    kernels are deterministic for a given shape and thread count already."""
    if not enabled or device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def check_deterministic(deterministic):
    if not isinstance(deterministic, (bool, np.bool_)):
        raise VisarError(f"deterministic must be True or False, got {deterministic!r}")


def check_batch_size(batch_size, num_images: int) -> int | None:
    """batch_size -> the slots to decode at once, None for all; one sentence for a bad value."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise VisarError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    if batch_size > num_images:
        raise VisarError(
            f"batch_size {batch_size} is larger than the {num_images} images asked for: give at most {num_images}"
        )
    return batch_size
