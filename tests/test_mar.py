"""MAR methods: CSpD's exactness (two-sample tests with a negative control), mar-cache's no-reuse
equality, and one clear error per bad input."""

import warnings

import pytest
import torch
from scipy.stats import ks_2samp

import visar
from visar.accel.cspd import TokenHead, speculate
from visar.errors import VisarError
from visar.families import FAMILIES
from visar.models.base import DiffusionSchedule, diffusion_step
from visar.pipeline import seeded_init

STEPS, SAMPLES = 8, 4000


def toy_head(channels, constants, perturbation=0.0):
    """A nonlinear toy diffusion head shaped like a trained one: its x0 guess is x / sqrt(abar) at
    low noise and g(x) = 1.5 tanh(W x + b) at high noise, i.e. eps = sqrt(1 - abar)(x - sqrt(abar) g(x));
    v fixed per step. The draft is the target with W and b perturbed."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(STEPS, channels, channels, generator=gen)
    bias = torch.randn(STEPS, channels, generator=gen)
    values = torch.rand(STEPS, channels, generator=gen) * 2 - 1
    shift = torch.Generator().manual_seed(1)
    weight = weight + perturbation * torch.randn(weight.shape, generator=shift)
    bias = bias + perturbation * torch.randn(bias.shape, generator=shift)
    alpha_bar = constants["sqrt_recip_alphas_cumprod"] ** -2

    def transition(x, step, rows):
        guess = 1.5 * torch.tanh(torch.einsum("ncd,nd->nc", weight[step], x) + bias[step])
        a = alpha_bar[step][:, None]
        eps = (1 - a).sqrt() * (x - a.sqrt() * guess)
        mean, log_variance, _ = diffusion_step(constants, step, x, torch.cat([eps, values[step]], dim=-1))
        return mean, log_variance

    return TokenHead(transition)


def toy_samples(channels, mode, inner_temperature=42.0):
    constants = DiffusionSchedule.cosine(STEPS).constants("cpu")
    target, draft = toy_head(channels, constants), toy_head(channels, constants, 0.6)
    gen = torch.Generator().manual_seed(7)
    rows = torch.arange(SAMPLES)
    noise = torch.randn(STEPS + 1, SAMPLES, channels, generator=gen)
    draft_path, draft_x0 = draft.sample(noise[-1], rows, 1.0, noise[:-1])

    def uniform(n, index):
        return torch.rand(len(index), n, generator=gen)

    def normal(n, index):
        return torch.randn(len(index), n, STEPS + 1, channels, generator=gen)

    tokens, accepted, _ = speculate(
        target, draft, rows, draft_path, draft_x0, 1.0, uniform, normal, mode=mode, inner_temperature=inner_temperature
    )
    fresh = torch.randn(STEPS + 1, SAMPLES, channels, generator=gen)
    _, reference = target.sample(fresh[-1], rows, 1.0, fresh[:-1])
    return tokens, reference, accepted


def min_pvalue(tokens, reference):
    directions = [torch.eye(tokens.shape[1])[i] for i in range(tokens.shape[1])]
    if tokens.shape[1] == 2:
        directions += [torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0])]
    return min(ks_2samp((tokens @ d).numpy(), (reference @ d).numpy()).pvalue for d in directions)


@pytest.mark.parametrize("channels", [1, 2])
def test_exact_accept_plus_residual_samples_the_target(channels):
    tokens, reference, accepted = toy_samples(channels, "exact")
    assert 0.05 < accepted.float().mean() < 0.95  # both branches are exercised
    assert torch.isfinite(tokens).all() and not (tokens == 0).all(1).any()  # nothing left unfilled
    assert min_pvalue(tokens, reference) > 1e-3


@pytest.mark.parametrize("channels", [1, 2])
def test_the_two_sample_test_catches_the_official_inner_temperature(channels):
    tokens, reference, accepted = toy_samples(channels, "relaxed", 42.0)
    assert accepted.float().mean() > 0.9
    assert min_pvalue(tokens, reference) < 1e-3


def tiny_mar(seed, std=0.05, **overrides):
    family = FAMILIES["mar"]
    model = family.build_model({**family.tiny_model_args, **overrides})
    seeded_init(model, seed, std=std)
    return model


def test_a_draft_identical_to_the_target_is_accepted():
    model = tiny_mar(0)
    pipe = visar.Pipeline(model, None, name="tiny-mar")
    out = pipe.generate(class_labels=[0, 1], method="cspd", draft=model, num_iter=4, output_type="tokens", seed=1)
    assert out.stats["acceptance_rate"] > 0.95


@pytest.mark.slow
def test_cspd_marginals_match_plain_target_sampling():
    target, draft = tiny_mar(0, std=0.3), tiny_mar(1, std=0.3)
    pipe = visar.Pipeline(target, None, name="tiny-mar", defaults={"guidance_scale": 1.5})
    n, run = 600, dict(num_iter=3, output_type="tokens")
    labels = [1] * n
    plain = pipe.generate(class_labels=labels, method="mar", seed=0, **run).tokens
    spec = pipe.generate(class_labels=labels, method="cspd", draft=draft, num_draft=2, prefill=0.0, seed=10_000, **run)
    assert spec.stats["draft_tokens"] > 0
    # per-token marginals (each position's channels)
    pvalues = [
        ks_2samp(plain[:, c, i // 4, i % 4].numpy(), spec.tokens[:, c, i // 4, i % 4].numpy()).pvalue
        for i in range(16)
        for c in range(2)
    ]
    assert min(pvalues) > 1e-3 / len(pvalues)


def test_mar_cache_reusing_nothing_is_plain_mar():
    pipe = visar.Pipeline(tiny_mar(0), None, name="tiny-mar", defaults={"guidance_scale": 2.0})
    run = dict(class_labels=[0, 3], num_iter=4, output_type="tokens", seed=3)
    plain = pipe.generate(method="mar", **run).tokens
    same = pipe.generate(method="mar-cache", token_threshold=0.0, null_interval=1, **run)
    assert torch.equal(plain, same.tokens) and same.stats["lossless"]
    lossy = pipe.generate(method="mar-cache", token_threshold=0.5, null_interval=2, **run)
    assert not lossy.stats["lossless"] and lossy.stats["reused_token_fraction"] > 0


def test_bad_inputs_give_one_clear_error(tmp_path):
    target = tiny_mar(0)
    pipe = visar.Pipeline(target, None, name="tiny-mar")
    wide = tiny_mar(1, vae_embed_dim=3)
    with pytest.raises(VisarError, match="token width differ"):
        pipe.generate(class_labels=[0], method="cspd", draft=wide, output_type="tokens")
    other_grid = tiny_mar(1, img_size=12)
    with pytest.raises(VisarError, match="order"):
        pipe.generate(class_labels=[0], method="cspd", draft=other_grid, output_type="tokens")
    with pytest.raises(VisarError, match="decodes raster models"):
        pipe.generate(class_labels=[0], method="sjd", output_type="tokens")
    family = FAMILIES["mar"]
    vae = family.build_tokenizer({**family.tiny_tokenizer_args, "embed_dim": 3})
    with pytest.raises(VisarError, match="VAE does not fit"):
        family.check_tokenizer(target, vae)
    # an official file without model_ema loads `model`, and says so
    path = tmp_path / "no_ema.pt"
    torch.save({"model": target.state_dict()}, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = visar.load("mar", checkpoint=path, model_args=family.tiny_model_args, device="cpu")
    assert any("no 'model_ema'" in str(w.message) for w in caught)
    assert torch.equal(loaded.model.fake_latent, target.fake_latent)
