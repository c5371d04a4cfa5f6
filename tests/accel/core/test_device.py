"""Why an image's tokens do not depend on its batch on any device: the randomness is made the same way
everywhere, then moved to the model's device (CPU here; the device check runs the suite on CUDA).
And the device errors: a device that is not there, an unknown one, a dtype the device lacks, a batch
that does not fit."""

import re

import pytest
import torch
from conftest import TEST_DEVICE

import visar
from visar.accel.core.acceptance import keyed_uniforms
from visar.accel.core.sampling import draw_uniforms, make_generators, sample_from_probs
from visar.accel.raster import slots
from visar.errors import VisarError


def test_per_image_generators_live_on_the_cpu_and_draw_per_image():
    """Each image's uniforms come from its own CPU generator (the same stream on every machine,
    whatever the model's device), so the batch around an image does not change them."""
    generators = make_generators(4, seed=7)
    assert all(g.device.type == "cpu" for g in generators)
    batch = draw_uniforms(generators, 5)
    assert batch.device.type == "cpu"
    for i in range(4):
        assert torch.equal(batch[i], draw_uniforms(make_generators(1, seed=7 + i), 5)[0])


def test_uniforms_meet_the_probabilities_on_their_device():
    """sample_from_probs moves the CPU uniforms to the probabilities' device (the model's)."""
    probs = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0]], device=TEST_DEVICE)
    uniforms = torch.tensor([0.05, 0.99])  # CPU, as draw_uniforms makes them
    tokens = sample_from_probs(probs, uniforms)
    assert tokens.device == probs.device and tokens.tolist() == [0, 1]


def test_image_keys_come_from_the_generators_and_go_to_the_device():
    keys = slots.image_keys(make_generators(3, seed=1), TEST_DEVICE)
    assert keys.device.type == TEST_DEVICE.type
    assert torch.equal(keys[1:2].cpu(), slots.image_keys(make_generators(1, seed=2), "cpu"))


def test_position_keyed_noise_is_integer_arithmetic_then_one_rounding():
    """keyed_uniforms hashes in int64 and ends in (24-bit integer + 0.5) / 2^24 in float32: an exact
    conversion, one correctly rounded addition and an exact division, so no device or batch shape can
    round it differently. A row is the same alone and in a batch, and the same on the test device as on
    the CPU."""
    keys = torch.tensor([3, 2**32 - 1, 12345])
    positions = torch.tensor([[0, 1, 2], [5, 6, 7], [255, 256, 257]])
    noise = keyed_uniforms(keys, positions, 1, 64)
    assert noise.dtype == torch.float32 and bool((noise > 0).all() and (noise <= 1).all())
    for i in range(3):
        assert torch.equal(keyed_uniforms(keys[i : i + 1], positions[i : i + 1], 1, 64)[0], noise[i])
    on_device = keyed_uniforms(keys.to(TEST_DEVICE), positions.to(TEST_DEVICE), 1, 64)
    assert torch.equal(on_device.cpu(), noise)


# -- bad input: one sentence each ----------------------------------------------------------------------


def test_cuda_without_cuda_is_one_clear_error(monkeypatch, capsys):
    from visar.apps.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(VisarError, match="device 'cuda' was asked for but CUDA is not available on this machine"):
        visar.load("visar-tiny-random", device="cuda")
    assert main(["generate", "--model", "visar-tiny-random", "--device", "cuda", "--class", "1"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    "device, message", [("gpu", "unknown device 'gpu': use cpu, cuda or cuda:N"), ("meta", "not supported")]
)
def test_an_unknown_device_is_one_clear_error(device, message):
    with pytest.raises(VisarError, match=re.escape(message)):
        visar.load("visar-tiny-random", device=device)


def test_a_missing_gpu_index_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(VisarError, match=re.escape("device 'cuda:3' does not exist: this machine has 1 GPU(s)")):
        visar.load("visar-tiny-random", device="cuda:3")


def test_bf16_on_a_gpu_without_it_is_one_clear_error(monkeypatch):
    """Checked before anything moves to the device (a T4, compute capability 7.5, has no bf16)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(
        VisarError, match=re.escape("bf16 is not supported on Tesla T4 (cuda): use --dtype fp16 or fp32")
    ):
        visar.load("visar-tiny-random", device="cuda", dtype="bf16")


def test_running_out_of_device_memory_names_what_lowers_it(monkeypatch):
    pipe = visar.load("visar-tiny-random", device="cpu")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(pipe.model, "forward", out_of_memory)
    with pytest.raises(VisarError) as err:
        pipe.generate(class_labels=[1, 2, 3], method="mc-sjd", output_type="tokens")
    message = str(err.value)
    assert message.startswith("out of cpu memory generating 3 images with 'mc-sjd' on cpu: lower the batch size")
    assert "--batch-size" in message and "--opt window=4" in message and "--dtype bf16" in message
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    assert pipe.model.cache_keys is None  # the KV cache was let go
