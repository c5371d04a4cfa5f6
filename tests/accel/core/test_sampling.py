"""The shared logits-to-distribution function and the inverse-CDF draw."""

import math

import pytest
import torch
from scipy.stats import chisquare

from visar.accel.core.sampling import (
    SamplingParams,
    UniformStream,
    draw_uniforms,
    logits_to_probs,
    make_generators,
    sample_from_probs,
)
from visar.errors import VisarError


def test_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    plain = logits_to_probs(logits, SamplingParams())
    torch.testing.assert_close(plain, logits.softmax(-1))
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(hot, (logits / 2).softmax(-1))
    top2 = logits_to_probs(logits, SamplingParams(top_k=2))
    assert (top2[0, 2:] == 0).all()
    torch.testing.assert_close(top2[0, :2], logits[0, :2].softmax(-1))
    # top-p keeps the smallest prefix whose mass reaches p (the token that crosses p stays)
    p = plain[0]
    top_p = logits_to_probs(logits, SamplingParams(top_p=float(p[0] + 1e-3)))
    assert (top_p[0, :2] > 0).all() and (top_p[0, 2:] == 0).all()
    only_first = logits_to_probs(logits, SamplingParams(top_p=float(p[0] - 1e-3)))
    assert only_first[0, 0] == 1


def test_top_k_one_is_argmax():
    logits = torch.randn(4, 100)
    probs = logits_to_probs(logits, SamplingParams(top_k=1))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and (probs.max(-1).values == 1).all()


def test_inverse_cdf_draw_follows_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    n = 100_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(1))
    tokens = sample_from_probs(probs.expand(n, -1), uniforms)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[1] == 0 and counts[4] == 0
    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * n
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3


def test_inverse_cdf_edges_never_pick_zero_mass():
    probs = torch.tensor([[0.0, 1.0, 0.0]])
    for u in (0.0, 0.5, 1.0 - 1e-7, 1.0):  # 1.0: a target rounded up to the total falls back to the last bin
        assert sample_from_probs(probs, torch.tensor([u])).item() == 1
    tail = torch.tensor([[0.25, 0.0, 0.75, 0.0, 0.0]])
    assert sample_from_probs(tail.expand(3, -1), torch.tensor([0.2, 0.3, 1.0])).tolist() == [0, 2, 2]


def test_generators_are_per_image():
    a = draw_uniforms(make_generators(3, seed=5), 4)
    b = draw_uniforms(make_generators(1, seed=7), 4)
    torch.testing.assert_close(a[2], b[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(temperature=-1),
        dict(top_k=0),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(guidance_scale=-0.5),
        dict(temperature=math.nan),
    ],
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(VisarError):
        SamplingParams(**kwargs)


def test_uniform_stream_hands_out_what_a_draw_per_pass_would():
    # a CPU generator's uniforms do not depend on how the draws are split: blocks drawn ahead give
    # every take the numbers a draw of its own would have (counts that cross block ends included)
    counts = [3, 16, 1, 40, 7, 7, 64, 2]
    stream = UniformStream(make_generators(3, 9), "cpu", block=20)
    taken = [stream.take(count) for count in counts]
    reference = make_generators(3, 9)
    for count, got in zip(counts, taken, strict=True):
        assert torch.equal(got, draw_uniforms(reference, count))
