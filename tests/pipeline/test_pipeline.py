"""Public API on the embedded random model: determinism, batch invariance, outputs, bad input."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from laws import greedy_under_guidance
from PIL import Image

import visar
from visar.accel import METHODS
from visar.accel.core.sampling import SamplingParams
from visar.errors import VisarError
from visar.models.outputs import OUTPUT_MAPS
from visar.pipeline.conditions import sampling_params


@pytest.fixture(scope="module")
def pipe():
    return visar.load("visar-tiny-random", device="cpu")


def test_registry_and_methods():
    assert "default" in visar.list_models() and "visar-tiny-random" in visar.list_models()
    assert "llamagen-gpt-b-c2i-256" in visar.list_models()
    assert "ar" in visar.list_methods()


def test_every_kind_a_method_decodes_has_its_output_maps():
    """generate shapes a method's tokens and commit passes by the model's kind (OUTPUT_MAPS): a kind
    missing there would fail only once a model of it generates."""
    assert {method.model_kind for method in METHODS.values()} <= set(OUTPUT_MAPS)


def test_generate_outputs(pipe):
    out = pipe.generate(class_labels=[0, 5], seed=3)
    assert len(out.images) == 2 and isinstance(out.images[0], Image.Image) and out.images[0].size == (64, 64)
    assert out.tokens.shape == (2, 16, 16) and out.tokens.dtype == torch.long
    for key in ("forward_passes", "tokens_per_forward", "latency_s"):
        assert key in out.stats
    assert out.stats["forward_passes"] == 256 and out.stats["tokens_per_forward"] == 1.0
    pt = pipe.generate(class_labels=[0], output_type="pt").images
    assert pt.shape == (1, 3, 64, 64) and 0 <= pt.min() and pt.max() <= 1
    arr = pipe.generate(class_labels=[0], output_type="np").images
    assert arr.shape == (1, 64, 64, 3) and arr.dtype == np.uint8
    assert pipe.generate(class_labels=[0], output_type="tokens").images is None


@pytest.mark.one_thread  # tokens of a batch against each image alone
def test_greedy_is_deterministic_and_batch_invariant(pipe):
    alone = pipe.generate(class_labels=[7], top_k=1, output_type="tokens", seed=0).tokens
    again = pipe.generate(class_labels=[7], top_k=1, output_type="tokens", seed=9).tokens
    batched = pipe.generate(class_labels=[7, 1, 2], top_k=1, output_type="tokens").tokens
    assert torch.equal(alone, again) and torch.equal(alone[0], batched[0])


@pytest.mark.one_thread  # tokens of a batch against each image alone
def test_sampled_image_does_not_change_when_others_join_its_batch(pipe):
    alone = pipe.generate(class_labels=[4], seed=11, output_type="tokens").tokens
    batched = pipe.generate(class_labels=[4, 9, 4], seed=11, output_type="tokens").tokens
    assert torch.equal(alone[0], batched[0])
    assert not torch.equal(batched[0], batched[2])  # image 2 has its own generator (seed 13)
    third = pipe.generate(class_labels=[4], seed=13, output_type="tokens").tokens
    assert torch.equal(third[0], batched[2])


def test_cfg_and_explicit_generators(pipe):
    gens = [torch.Generator().manual_seed(100), torch.Generator().manual_seed(101)]
    a = pipe.generate(
        class_labels=[1, 2],
        generator=gens,
        guidance_scale=3.0,
        top_k=50,
        top_p=0.9,
        temperature=0.8,
        output_type="tokens",
    ).tokens
    b = pipe.generate(
        class_labels=[1, 2], seed=100, guidance_scale=3.0, top_k=50, top_p=0.9, temperature=0.8, output_type="tokens"
    ).tokens
    assert torch.equal(a, b)


def test_entropy_temperature_takes_the_temperature_s_place(pipe):
    """entropy_temperature=T0 replaces the temperature (its default too), a temperature given alone turns a
    default entropy temperature off, and generate, open_batch and the CLI's settings carry it."""
    defaults = {"guidance_scale": 2.0, "temperature": 0.7, "top_k": None, "top_p": 1.0}
    given = sampling_params(defaults, None, None, None, None, 1.4)
    assert given == SamplingParams(guidance_scale=2.0, temperature=1.0, entropy_temperature=1.4)
    by_default = {**defaults, "entropy_temperature": 1.0}
    assert sampling_params(by_default, None, None, None, None) == replace(given, entropy_temperature=1.0)
    assert sampling_params(by_default, None, 0.8, None, None) == SamplingParams(guidance_scale=2.0, temperature=0.8)
    assert sampling_params(defaults, None, 1.0, None, None, 1.4) == given  # both given: temperature 1
    kwargs = dict(class_labels=[1, 2], seed=5, method="mc-sjd", output_type="tokens")
    hot = pipe.generate(**kwargs, entropy_temperature=1.4)
    assert torch.equal(hot.tokens, pipe.generate(**kwargs, entropy_temperature=1.4).tokens)
    assert not torch.equal(hot.tokens, pipe.generate(**kwargs).tokens) and hot.stats["lossless"]
    batch = pipe.open_batch("mc-sjd", slots=2, entropy_temperature=1.4, top_k=50)
    guidance = pipe.defaults["guidance_scale"]
    assert batch.params == SamplingParams(guidance_scale=guidance, top_k=50, entropy_temperature=1.4)
    batch.close()


def test_logits_rows_are_teacher_forced_predictions(pipe):
    tokens = pipe.generate(class_labels=[3], top_k=1, output_type="tokens").tokens
    logits = pipe.logits(tokens, class_labels=[3])
    assert logits.shape == (1, 256, 512)
    assert torch.equal(logits.argmax(-1).reshape(1, 16, 16), tokens)


def test_tokenizer_roundtrip_shapes(pipe):
    images = torch.rand(2, 3, 64, 64) * 2 - 1
    codes = pipe.tokenizer.encode(images)
    assert codes.shape == (2, 16, 16)
    assert pipe.tokenizer.decode(codes).shape == (2, 3, 64, 64)


def test_load_default_alias_and_dtype():
    pipe16 = visar.load("default", device="cpu", dtype="bf16")
    assert pipe16.name == visar.registry.DEFAULT_MODEL and pipe16.dtype == torch.bfloat16
    out = pipe16.generate(class_labels=[0], output_type="tokens")
    assert out.tokens.shape == (1, 16, 16)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(class_labels=[40]), "out of range"),
        (dict(class_labels=[-1]), "out of range"),
        (dict(class_labels=[0], method="nope"), "unknown method"),
        (dict(class_labels=[0], top_k=-2), "top_k"),
        (dict(class_labels=[0], top_p=0.0), "top_p"),
        (dict(class_labels=[0], temperature=0.0), "temperature"),
        (dict(class_labels=[0], entropy_temperature=0.0), "entropy_temperature must be a number"),
        (dict(class_labels=[0], entropy_temperature=1.4, temperature=0.7), "two temperatures"),
        (dict(class_labels=[0], guidance_scale=-1.0), "guidance_scale"),
        (dict(class_labels=[0], window=4), "unknown option"),
        (dict(prompts=["a photo of a cat"]), "class-conditional"),
        (dict(), "nothing to condition"),
        (dict(class_labels=[0], output_type="jpg"), "output_type"),
        (dict(class_labels=[0], negative_prompt="blurry"), "class-conditional: a negative prompt replaces"),
        (dict(class_labels=[0], num_images_per_prompt=0), "num_images_per_prompt must be at least 1, got 0"),
        (dict(class_labels=[0], num_images_per_prompt=1.5), "num_images_per_prompt must be a whole number"),
        (dict(class_labels=[0, 1], num_images_per_prompt=10**9), "one call generates at most 1,048,576 images"),
        (dict(class_labels=[0, 1], num_images_per_prompt=2, generator=[torch.Generator()]), "1 generators for 4"),
    ],
)
def test_bad_input(pipe, kwargs, match):
    with pytest.raises(VisarError, match=match):
        pipe.generate(**kwargs)


@pytest.fixture(scope="module")
def t2i():
    return visar.load("visar-tiny-t2i", device="cpu")


T2I_PROMPTS = ["a red circle", "two blue squares above a green triangle"]


@pytest.mark.slow  # teacher-forced references of a whole decode, twice
@pytest.mark.parametrize("negative", ["green triangle", ["green triangle", "a photo of four pink crosses"]])
def test_a_negative_caption_replaces_the_null_caption(t2i, negative):
    """LlamaGen t2i: under guidance the unconditional branch is the negative caption (its embeddings and
    own padding), for every method; the null caption otherwise."""
    negatives = [negative] * 2 if isinstance(negative, str) else negative
    kwargs = dict(guidance_scale=3.0, top_k=1, output_type="tokens")
    out = t2i.generate(prompts=T2I_PROMPTS, negative_prompt=negative, **kwargs)
    assert greedy_under_guidance(t2i, out.tokens, T2I_PROMPTS, negatives, 3.0)
    for method in ("sjd", "mc-sjd"):  # lossless: the same greedy tokens
        fast = t2i.generate(prompts=T2I_PROMPTS, negative_prompt=negative, method=method, **kwargs)
        assert torch.equal(fast.tokens, out.tokens), method
    default = t2i.generate(prompts=T2I_PROMPTS, **kwargs)  # negative control: the null caption
    assert not torch.equal(default.tokens, out.tokens) and t2i.model.negative is None
    assert not greedy_under_guidance(t2i, default.tokens, T2I_PROMPTS, negatives, 3.0)


@pytest.mark.one_thread  # generate's batch against the batch tool's
@pytest.mark.slow  # whole CLI or eval runs: the quick tier keeps to 90 s
def test_num_images_per_prompt_is_item_major_with_the_batch_tool_s_seeds(t2i):
    out = t2i.generate(prompts=T2I_PROMPTS, num_images_per_prompt=3, seed=4, output_type="tokens")
    assert out.tokens.shape[0] == 6 and out.stats["batch_size"] == 6
    for i, prompt in enumerate(T2I_PROMPTS):
        for j in range(3):  # image j of prompt i: seed 4 + j * 2 + i, as `visar generate` seeds image j * 2 + i
            alone = t2i.generate(prompts=[prompt], seed=4 + j * 2 + i, output_type="tokens")
            assert torch.equal(out.tokens[i * 3 + j], alone.tokens[0]), (i, j)
    once = t2i.generate(prompts=T2I_PROMPTS, seed=4, output_type="tokens")  # 1 per prompt: seed + i, as before
    assert torch.equal(once.tokens, out.tokens[::3])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(negative_prompt=["a", "b", "c"]), "got 3 negative prompts for 2 prompts: give one for every prompt"),
        (dict(negative_prompt=[]), "got 0 negative prompts for 2 prompts"),
        (dict(negative_prompt=3), "negative_prompt must be a string or a list of strings, got int"),
        (dict(negative_prompt=" "), "an empty negative prompt cannot be encoded by this model's caption encoder"),
        (dict(num_images_per_prompt=-1), "num_images_per_prompt must be at least 1, got -1"),
        (dict(num_images_per_prompt=True), "num_images_per_prompt must be a whole number"),
    ],
)
def test_bad_negative_prompts_and_image_counts(t2i, kwargs, match):
    with pytest.raises(VisarError, match=match):
        t2i.generate(prompts=T2I_PROMPTS, output_type="tokens", **kwargs)
    assert t2i.model.negative is None


def test_unknown_model_and_missing_paths():
    with pytest.raises(VisarError, match="unknown model"):
        visar.load("no-such-model")
    with pytest.raises(VisarError, match="no GPT-XL model at 256 px; llamagen-gpt-xl-c2i-256 needs the checkpoint"):
        visar.load("llamagen-gpt-xl-c2i-256")  # (released presets fetch their files: tests/models/test_hub.py)
    with pytest.raises(VisarError, match="not found"):
        visar.load("llamagen-gpt-b-c2i-256", checkpoint="/nonexistent/c2i_B_256.pt", device="cpu")
    with pytest.raises(VisarError, match="dtype"):
        visar.load("default", dtype="fp8")
