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
        dict(entropy_temperature=0),
        dict(entropy_temperature=-1.0),
        dict(entropy_temperature=math.inf),
        dict(entropy_temperature=True),
        dict(entropy_temperature="1.4"),
        dict(entropy_temperature=1.4, temperature=0.7),
    ],
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(VisarError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


# -- the entropy temperature against its official code -----------------------------------------------------


def official_filtering(logits, top_k: int, top_p: float):
    """Written here from krennic999/ARsample's LlamaGen `top_k_top_p_filtering` (transformers' v3.2 one):
    below the k-th logit -> -inf; then, in descending order, a token goes when the cumulative softmax up to
    the token before it is past top_p (the top token always stays)."""
    logits = logits.clone()
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1, None]
        logits[logits < kth] = -math.inf
    if top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        past = torch.cumsum(sorted_logits.softmax(-1), -1) > top_p
        past[..., 1:] = past[..., :-1].clone()  # shifted: the token that crosses top_p stays
        past[..., 0] = False
        logits[past.scatter(1, sorted_indices, past)] = -math.inf
    return logits


def official_entropy_sample_probs(logits, t0: float, top_k: int, top_p: float):
    """The probabilities its `sample` draws from with enable_entropy_filtering: filter, H of the filtered
    softmax (`entropy_filtering`: sorted, -p log(p + 1e-12), summed), T = T0 (2.5 exp(-H/3) + 0.6), softmax(l/T)."""
    if top_k > 0 or top_p < 1.0:
        logits = official_filtering(logits, top_k, top_p)
    sorted_probs = torch.sort(logits, descending=True)[0].softmax(-1)
    entropy = torch.cumsum(-sorted_probs * torch.log(sorted_probs + 1e-12), -1)[:, -1, None]
    return (logits / (t0 * (2.5 * torch.exp(-entropy / 3) + 0.6))).softmax(-1)


@pytest.mark.parametrize("t0", [1.0, 1.4, 0.5])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (100, 1.0), (0, 0.8), (100, 0.8), (5, 0.5)])
def test_entropy_temperature_matches_the_official_sample(t0, top_k, top_p):
    logits = torch.randn(16, 512, generator=torch.Generator().manual_seed(3)) * 3  # [B, V], guided logits
    logits[:4] *= 4  # a few confident positions (small H: hotter) beside flat ones (large H: cooler)
    params = SamplingParams(top_k=top_k or None, top_p=top_p, entropy_temperature=t0)
    ours = logits_to_probs(logits, params)
    official = official_entropy_sample_probs(logits, t0, top_k, top_p)
    assert torch.equal(ours > 0, official > 0)  # the same tokens kept
    torch.testing.assert_close(ours, official, rtol=1e-5, atol=1e-7)


def row_temperatures(logits, t0: float) -> list[float]:
    """Each row's T0 (2.5 exp(-H/3) + 0.6), H the entropy of softmax(logits) as upstream sums it."""
    probs = logits.softmax(-1)
    entropy = -(probs * torch.log(probs + 1e-12)).sum(-1)
    return (t0 * (2.5 * torch.exp(-entropy / 3) + 0.6)).tolist()


def tempered_then_filtered(logits, temperatures: list[float], top_p: float):
    """Each row at its own temperature through plain sampling's order: temperature first, then top-p."""
    pairs = zip(logits, temperatures, strict=True)
    return torch.cat([logits_to_probs(row[None], SamplingParams(temperature=t, top_p=top_p)) for row, t in pairs])


def test_entropy_temperature_filters_before_it_tempers():
    """With top_p < 1 the order decides the nucleus: each row's own T applied before the filter (plain
    `temperature`'s order, LlamaGen's `logits_to_probs`) keeps other tokens and gives another law; with
    nothing to filter the two orders agree."""
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(5)) * 2  # [B, V]
    unfiltered = logits_to_probs(logits, SamplingParams(entropy_temperature=1.4))
    torch.testing.assert_close(unfiltered, tempered_then_filtered(logits, row_temperatures(logits, 1.4), 1.0))

    ours = logits_to_probs(logits, SamplingParams(top_p=0.8, entropy_temperature=1.4))
    # the same T per row (H of the filtered law), applied before the filter: T0 1.4 makes every T > 1, and
    # a hotter law needs more tokens to reach 0.8
    swapped = tempered_then_filtered(logits, row_temperatures(official_filtering(logits, 0, 0.8), 1.4), 0.8)
    assert ((ours > 0).sum(-1) < (swapped > 0).sum(-1)).all()
    assert (0.5 * (ours - swapped).abs().sum(-1)).min() > 0.3


def test_entropy_temperature_leaves_plain_sampling_alone():
    """None (the default) is today's law bit for bit: temperature, then top-k, then top-p."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(guidance_scale=2.0, temperature=0.8, top_k=50, top_p=0.9)
    scaled = logits / 0.8
    kept = official_filtering(scaled, 50, 0.9)
    assert params.entropy_temperature is None
    assert torch.equal(logits_to_probs(logits, params), kept.softmax(-1))


def test_uniform_stream_hands_out_what_a_draw_per_pass_would():
    # a CPU generator's uniforms do not depend on how the draws are split: blocks drawn ahead give
    # every take the numbers a draw of its own would have (counts that cross block ends included)
    counts = [3, 16, 1, 40, 7, 7, 64, 2]
    stream = UniformStream(make_generators(3, 9), "cpu", block=20)
    taken = [stream.take(count) for count in counts]
    reference = make_generators(3, 9)
    for count, got in zip(counts, taken, strict=True):
        assert torch.equal(got, draw_uniforms(reference, count))
