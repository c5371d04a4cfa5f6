"""Public API on the embedded random model: determinism, batch invariance, outputs, bad input."""

import numpy as np
import pytest
import torch
from PIL import Image

import visar
from visar.accel import METHODS
from visar.errors import VisarError
from visar.models.outputs import OUTPUT_MAPS


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


def test_greedy_is_deterministic_and_batch_invariant(pipe):
    alone = pipe.generate(class_labels=[7], top_k=1, output_type="tokens", seed=0).tokens
    again = pipe.generate(class_labels=[7], top_k=1, output_type="tokens", seed=9).tokens
    batched = pipe.generate(class_labels=[7, 1, 2], top_k=1, output_type="tokens").tokens
    assert torch.equal(alone, again) and torch.equal(alone[0], batched[0])


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
        (dict(class_labels=[0], guidance_scale=-1.0), "guidance_scale"),
        (dict(class_labels=[0], window=4), "unknown option"),
        (dict(prompts=["a photo of a cat"]), "class-conditional"),
        (dict(), "nothing to condition"),
        (dict(class_labels=[0], output_type="jpg"), "output_type"),
    ],
)
def test_bad_input(pipe, kwargs, match):
    with pytest.raises(VisarError, match=match):
        pipe.generate(**kwargs)


def test_unknown_model_and_missing_paths():
    with pytest.raises(VisarError, match="unknown model"):
        visar.load("no-such-model")
    with pytest.raises(VisarError, match="no GPT-XL model at 256 px; llamagen-gpt-xl-c2i-256 needs the checkpoint"):
        visar.load("llamagen-gpt-xl-c2i-256")  # (released presets fetch their files: tests/test_hub.py)
    with pytest.raises(VisarError, match="not found"):
        visar.load("llamagen-gpt-b-c2i-256", checkpoint="/nonexistent/c2i_B_256.pt", device="cpu")
    with pytest.raises(VisarError, match="dtype"):
        visar.load("default", dtype="fp8")
