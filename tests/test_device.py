"""Why an image's tokens do not depend on its batch on any device: the randomness is made the same way
everywhere, then moved to the model's device (CPU here; the device check runs the suite on CUDA)."""

import torch
from conftest import TEST_DEVICE

from visar.accel import jacobi
from visar.accel.acceptance import keyed_uniforms
from visar.accel.sampling import draw_uniforms, make_generators, sample_from_probs


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
    keys = jacobi.image_keys(make_generators(3, seed=1), TEST_DEVICE)
    assert keys.device.type == TEST_DEVICE.type
    assert torch.equal(keys[1:2].cpu(), jacobi.image_keys(make_generators(1, seed=2), "cpu"))


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
