"""aMUSEd through diffusers: a tiny random `AmusedPipeline` (UVit2DModel, VQModel, CLIP text encoder and tokenizer),
saved with save_pretrained and loaded offline through `visar.load(FOLDER)`, against the deprecated pipeline itself.

(a) visar's `maskgit` gives the pipeline's tokens for the same seed and settings (steps, guidance,
Gumbel annealing as a pair or a scalar), and the same decoded image;
(b) a batch: image i with seed s + i equals the pipeline run on that image alone with seed s + i.
The pipeline draws a whole batch from one generator (multinomial over [B * N, V], then Gumbel
noise over [B, N]), so its batches depend on their composition; visar gives each image its own
generator (the library's rule), which is the pipeline's draw for a batch of one;
bad input: incomplete folders (the missing file named), other diffusers pipelines, a component
folder, unknown loading options, raster methods.
Every masked method on the tiny aMUSEd: tests/accel/test_method_conformance.py (the family registers tiny args).
"""

import json
import re
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

from laws import random_amused  # noqa: E402

import visar  # noqa: E402
from visar.errors import VisarError  # noqa: E402
from visar.families import amused  # noqa: E402

PROMPT = "a red circle"


@pytest.fixture(scope="module")
def amused_folder(tmp_path_factory, offline):
    folder = tmp_path_factory.mktemp("amused")
    random_amused(seed=0).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(amused_folder):
    """diffusers' own (deprecated) pipeline, loaded from the same folder."""
    pipe = diffusers.AmusedPipeline.from_pretrained(amused_folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(amused_folder):
    return visar.load(str(amused_folder), device="cpu")


def reference_tokens(reference, prompt, seed, **settings):
    generator = torch.Generator().manual_seed(seed)
    return reference(prompt, generator=generator, output_type="latent", **settings).images


def test_loads_as_a_masked_text_model_with_the_pipeline_defaults(pipe):
    assert pipe.model.model_kind == "masked" and pipe.model.grid_size == (4, 4)
    assert pipe.model.vocab_size == 8 and pipe.model.mask_token_id == 8
    assert not pipe.is_class_conditional
    assert pipe.defaults["guidance_scale"] == 10.0
    # the empty negative prompt, tokenized as AmusedPipeline pads it, is the tiny family's null condition
    assert pipe.model.negative_ids.tolist() == amused.TINY_MODEL_ARGS["negative_ids"]


@pytest.mark.parametrize(
    "steps, guidance, seed, temperature",
    [(12, 10.0, 0, None), (12, 10.0, 1, None), (4, 1.0, 2, None), (16, 3.0, 3, None), (1, 10.0, 4, None),
     (6, 10.0, 5, 3.0), (6, 10.0, 6, (4.5, 0.5))],
)  # fmt: skip
def test_maskgit_reproduces_the_amused_pipeline(pipe, reference, steps, guidance, seed, temperature):
    settings = dict(num_inference_steps=steps, guidance_scale=guidance)
    options = dict(steps=steps, guidance_scale=guidance)
    if temperature is not None:  # the pipeline's scalar v anneals v -> 0.01; a pair is linspace(start, end)
        settings["temperature"] = temperature
        options["choice_temperature"] = list(temperature) if isinstance(temperature, tuple) else [temperature, 0.01]
    expected = reference_tokens(reference, PROMPT, seed, **settings)
    out = pipe.generate(prompts=[PROMPT], method="maskgit", seed=seed, output_type="tokens", **options)
    assert torch.equal(out.tokens, expected)
    assert out.stats["forward_passes"] == steps


def test_decoded_images_match_the_pipeline(pipe, reference):
    generator = torch.Generator().manual_seed(7)
    expected = reference(PROMPT, num_inference_steps=4, generator=generator, output_type="np").images
    out = pipe.generate(prompts=[PROMPT], method="maskgit", steps=4, seed=7, output_type="pt")
    assert torch.allclose(out.images.permute(0, 2, 3, 1), torch.from_numpy(expected), atol=1e-5)


@pytest.mark.one_thread  # bits of a batch against each image alone
def test_a_batch_is_each_image_alone_with_its_seed(pipe, reference):
    prompts = [PROMPT, "the blue dog"]
    out = pipe.generate(prompts=prompts, method="maskgit", steps=6, seed=10, output_type="tokens")
    for i, prompt in enumerate(prompts):
        assert torch.equal(out.tokens[i], reference_tokens(reference, prompt, 10 + i, num_inference_steps=6)[0])
    # the pipeline's own batch draws from one generator: not the same draws (the documented difference)
    batch = reference(prompts, generator=torch.Generator().manual_seed(10), num_inference_steps=6, output_type="latent")
    assert not torch.equal(batch.images, out.tokens)


NEGATIVE_CASES = [  # prompts, negative_prompt (one for all, one per prompt, AmusedPipeline's own empty one)
    pytest.param([PROMPT, "the blue dog"], "lowres blurry", id="one-for-all"),
    pytest.param([PROMPT, "the blue dog"], ["lowres", "a green square"], id="one-per-prompt"),
    pytest.param([PROMPT], [""], id="empty"),
]


@pytest.mark.parametrize("prompts, negative", NEGATIVE_CASES)
def test_a_negative_prompt_is_amused_pipelines(pipe, reference, prompts, negative):
    """negative_prompt= per call gives AmusedPipeline's tokens for the same negative_prompt, image by image."""
    negatives = [negative] * len(prompts) if isinstance(negative, str) else negative
    out = pipe.generate(
        prompts=prompts, negative_prompt=negative, method="maskgit", steps=6, seed=3, output_type="tokens"
    )
    for i, prompt in enumerate(prompts):
        expected = reference_tokens(reference, prompt, 3 + i, num_inference_steps=6, negative_prompt=negatives[i])
        assert torch.equal(out.tokens[i], expected[0]), prompt
    # the empty negative prompt is the model's own unconditional branch; another one reaches the image
    default = pipe.generate(prompts=prompts, method="maskgit", steps=6, seed=3, output_type="tokens")
    assert torch.equal(default.tokens, out.tokens) == (negatives == [""] * len(prompts))


def test_a_negative_prompt_is_held_for_its_call_only(pipe):
    negative = pipe.generate(prompts=[PROMPT], negative_prompt="lowres", method="maskgit", steps=4, seed=1)
    assert pipe.model.negative is None  # the load-time negative prompt again afterwards
    with pytest.raises(VisarError, match="got 3 negative prompts for 2 prompts"):
        pipe.generate(prompts=[PROMPT, "a dog"], negative_prompt=["a", "b", "c"], output_type="tokens")
    assert pipe.model.negative is None and negative.images


@pytest.mark.parametrize("method", ["halton", "lpd-order", "lpd-confidence"])
def test_other_schedules_run_on_amused(pipe, method):
    out = pipe.generate(prompts=[PROMPT], method=method, steps=5, seed=0, output_type="np")
    assert out.images.shape == (1, 4, 4, 3) and out.stats["forward_passes"] == 5


def test_raster_methods_refuse_amused(pipe):
    message = f"method 'sjd' decodes raster models; {re.escape(pipe.name)} is a masked model"  # the name given
    with pytest.raises(VisarError, match=message):
        pipe.generate(prompts=[PROMPT], method="sjd", output_type="tokens")


def copy_without(folder, tmp_path, relative: str):
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    (target / relative).unlink()
    return target


@pytest.mark.parametrize(
    "missing",
    ["transformer/diffusion_pytorch_model.safetensors", "vqvae/config.json", "text_encoder/model.safetensors",
     "scheduler/scheduler_config.json"],
)  # fmt: skip
def test_an_incomplete_folder_names_the_missing_file(amused_folder, tmp_path, missing):
    folder = copy_without(amused_folder, tmp_path, missing)
    with pytest.raises(VisarError, match=f"not a complete aMUSEd folder: {missing}"):
        visar.load(str(folder), device="cpu")


def test_other_diffusers_folders_are_refused(amused_folder, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(amused_folder, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(VisarError, match="diffusers StableDiffusionPipeline.*pipeline folders of AmusedPipeline"):
        visar.load(str(other), device="cpu")
    with pytest.raises(VisarError, match=r"one diffusers component \(UVit2DModel\), not a pipeline"):
        visar.load(str(amused_folder / "transformer"), device="cpu")
    with pytest.raises(VisarError, match="unknown model_args"):
        visar.load(str(amused_folder), device="cpu", model_args={"aesthetic": 5})
