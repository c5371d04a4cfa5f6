"""`Pipeline.generate(batch_size=)`: a running batch of that many slots for a method that refills (every
raster engine: tests/accel/raster/test_engine_conformance.py holds what each engine owes one), else
consecutive batches. Either way the images of the call alone (image i seeded seed + i), each handed
to `on_image` once; a bad batch size is one sentence; and a text model's negative prompts follow their
images into whichever batch, or `auto`'s candidate, decodes them.
"""

import pytest
import torch
from laws import tiny_pipeline

import visar
from visar.accel import get_method
from visar.accel.policy import auto
from visar.errors import VisarError


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("llamagen")


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
@pytest.mark.parametrize(
    "method, options",
    [
        ("mc-sjd", {}),  # a chain
        ("tree-mc-sjd", dict(window=8, branch=3)),  # draft trees
        ("zipar-tree", dict(s=2, window=3, branch=3)),  # row fronts
    ],
)
def test_a_refilling_method_runs_batch_size_as_a_running_batch_of_the_images_alone(pipe, method, options):
    labels, run = [0, 1, 2, 0, 1], dict(method=method, seed=5, output_type="tokens", **options)
    assert get_method(method).refills
    seen = []
    on_image = lambda index, tokens, info: seen.append(index)
    out = pipe.generate(class_labels=labels, batch_size=2, on_image=on_image, **run)
    assert out.stats["slots"] == 2 and out.stats["refills"] == 3 and sorted(seen) == list(range(5))
    whole = pipe.generate(class_labels=labels, **run)
    assert torch.equal(out.tokens, whole.tokens)
    assert out.stats["forward_passes_per_image"] == whole.stats["forward_passes_per_image"]
    assert torch.equal(out.stats["commit_pass"], whole.stats["commit_pass"])
    for image, label in enumerate(labels):
        own = pipe.generate(class_labels=[label], **{**run, "seed": 5 + image})
        assert torch.equal(out.tokens[image], own.tokens[0]), image
        assert torch.equal(out.stats["commit_pass"][image], own.stats["commit_pass"][0]), image
        assert out.stats["forward_passes_per_image"][image] == own.stats["forward_passes_per_image"][0], image


@pytest.mark.one_thread  # batches against the whole call, bit for bit
def test_methods_that_do_not_refill_run_consecutive_batches(pipe):
    """ar's slots all free at once (every image takes N passes); other kinds' methods decode consecutive
    batches in the pipeline. The same images either way."""
    labels = [0, 1, 2, 3, 1, 0]
    assert not get_method("ar").refills
    batches = pipe.generate(class_labels=labels, method="ar", seed=3, output_type="tokens", batch_size=2)
    alone = pipe.generate(class_labels=labels, method="ar", seed=3, output_type="tokens")
    assert torch.equal(batches.tokens, alone.tokens)
    assert batches.stats["forward_passes"] == 3 * pipe.model.num_image_tokens
    assert batches.stats["commit_pass"].shape == alone.stats["commit_pass"].shape
    assert batches.stats["refills"] == 4 and batches.stats["batch_passes"] == 3 * pipe.model.num_image_tokens
    handed = {}
    pipe.generate(
        class_labels=labels, method="ar", seed=3, output_type="tokens", batch_size=4,
        on_image=lambda index, tokens, info: handed.setdefault(index, (tokens, info["forward_passes"])),
    )  # fmt: skip
    assert sorted(handed) == list(range(6))
    assert all(torch.equal(handed[i][0], alone.tokens[i]) for i in range(6))
    assert all(handed[i][1] == pipe.model.num_image_tokens for i in range(6))
    # methods of other kinds decode consecutive batches through the pipeline
    maskgit = tiny_pipeline("maskgit")
    assert not get_method("maskgit").refills
    whole = maskgit.generate(class_labels=labels, method="maskgit", seed=3, output_type="tokens")
    batches = maskgit.generate(class_labels=labels, method="maskgit", seed=3, output_type="tokens", batch_size=4)
    assert torch.equal(whole.tokens, batches.tokens)
    assert batches.stats["forward_passes_per_image"] == whole.stats["forward_passes_per_image"]
    assert batches.stats["slots"] == 4 and batches.stats["refills"] == 2
    assert batches.stats["batch_passes"] == 2 * whole.stats["forward_passes"]


@pytest.mark.parametrize(
    "batch_size, message",
    [(0, "batch_size must be a whole number >= 1"), (2.5, "whole number"), (7, "larger than the 6 images")],
)
def test_bad_batch_sizes_are_one_sentence(pipe, batch_size, message):
    with pytest.raises(VisarError, match=message):
        pipe.generate(class_labels=[0, 1, 2, 3, 1, 0], method="mc-sjd", batch_size=batch_size, output_type="tokens")


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
@pytest.mark.slow  # whole decodes of the 256-token text model, seven of them
def test_auto_and_ar_run_a_running_batch_with_a_negative_prompt(tmp_path, monkeypatch):
    """auto (timing its candidates on parts of the queue) and ar take a running batch, on a text model
    with a negative prompt held for the whole call: every batch's null condition is its images'
    negative prompts."""
    t2i = visar.load("visar-tiny-t2i", device="cpu")
    prompts = ["a red circle", "two blue squares", "a green star", "a small yellow triangle", "an orange square"]
    negative = ["blurry", "dark", "noisy", "blurry", "cropped"]
    for method in ("ar", "mc-sjd"):
        whole = t2i.generate(prompts=prompts, negative_prompt=negative, method=method, seed=4, output_type="tokens")
        running = t2i.generate(
            prompts=prompts, negative_prompt=negative, method=method, seed=4, output_type="tokens", batch_size=2
        )
        assert torch.equal(whole.tokens, running.tokens), method
    # auto times its candidates on the queue's first images, each part with its own images' negative
    # prompts: every image is the candidate that decoded it, as that candidate decodes it alone
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path))  # no tuning kept by another test
    auto.forget_tunings()
    # eight images: mc-sjd's two rounds of two (a candidate is timed on four), then mc-sjd:8's
    prompts, negative = prompts + ["a blue circle", "two red stars", "a big green square"], negative + ["dark"] * 3
    ran = {}
    out = t2i.generate(
        prompts=prompts,
        negative_prompt=negative,
        method="auto",
        seed=4,
        output_type="tokens",
        batch_size=2,
        on_image=lambda index, tokens, info: ran.setdefault(index, info["auto"]),
    )
    assert out.tokens.shape[0] == 8 and sorted(ran) == list(range(8)) and len(set(ran.values())) >= 2
    for spec in set(ran.values()):
        name, _, size = spec.partition(":")
        alone = t2i.generate(
            prompts=prompts,
            negative_prompt=negative,
            method=name,
            seed=4,
            output_type="tokens",
            **({"budget": int(size)} if size else {}),
        )
        for image in (i for i, s in ran.items() if s == spec):
            assert torch.equal(out.tokens[image], alone.tokens[image]), (spec, image)
