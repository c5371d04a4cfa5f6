"""CSpD (visar/accel/continuous/cspd.py): exactness by two-sample tests with a negative control (the official inner
temperature), on a toy diffusion head and on a tiny MAR with CFG; the model head's chain samples as its
transitions do; a draft equal to the target is accepted and reproduces plain sampling.

Drafts that do not fit (token width, order, tokenizer) are refused in tests/accel/continuous/test_mar.py's
bad-input test.
"""

import copy

import numpy as np
import pytest
import torch
from laws import tiny_mar
from scipy.stats import ks_2samp

import visar
from visar.accel.continuous.cspd import TokenHead, speculate
from visar.families import FAMILIES
from visar.loading import seeded_init
from visar.models.diffusion import DiffusionSchedule, cosine_betas, diffusion_step
from visar.models.mar import MAR, MARConfig

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


@pytest.mark.slow  # a two-sample test over SAMPLES draws of each
@pytest.mark.parametrize("channels", [1, 2])
def test_exact_accept_plus_residual_samples_the_target(channels):
    tokens, reference, accepted = toy_samples(channels, "exact")
    assert 0.05 < accepted.float().mean() < 0.95  # both branches are exercised
    assert torch.isfinite(tokens).all() and not (tokens == 0).all(1).any()  # nothing left unfilled
    assert min_pvalue(tokens, reference) > 1e-3


@pytest.mark.slow  # the negative control of the test above
@pytest.mark.parametrize("channels", [1, 2])
def test_the_two_sample_test_catches_the_official_inner_temperature(channels):
    tokens, reference, accepted = toy_samples(channels, "relaxed", 42.0)
    assert accepted.float().mean() > 0.9
    assert min_pvalue(tokens, reference) < 1e-3


ALPHA_BAR = torch.from_numpy(np.cumprod(1 - cosine_betas(1000))).float()


class TrainedLikeMAR(MAR):
    """A MAR whose random diffusion head is read the way a trained one behaves (eps near x at high
    noise): eps = sqrt(1 - abar)(x - sqrt(abar) tanh(out)), v = tanh(out_v). Random heads otherwise
    multiply their eps error by sqrt(1/abar_999) ~ 2e4 and no two models ever agree."""

    def diffusion_head(self, x, timesteps, z):
        return self.read_as_trained(super().diffusion_head(x, timesteps, z), x, timesteps)

    def diffusion_chain(self, z, timesteps):
        head = super().diffusion_chain(z, timesteps)
        return lambda x, i: self.read_as_trained(head(x, i), x, timesteps[i].expand(len(x)))

    @staticmethod
    def read_as_trained(out, x, timesteps):
        channels = x.shape[-1]
        a = ALPHA_BAR.to(x.device)[timesteps][:, None]
        eps = (1 - a).sqrt() * (x - a.sqrt() * 2 * torch.tanh(out[:, :channels]))
        return torch.cat([eps, torch.tanh(out[:, channels:])], dim=-1)


def trained_like_pair(perturbation):
    family = FAMILIES["mar"]
    target = TrainedLikeMAR(MARConfig.from_dict(family.tiny_model_args))
    seeded_init(target, 0, std=0.3)
    draft = copy.deepcopy(target)
    shift = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(perturbation * torch.randn(param.shape, generator=shift))
    return target, draft


def test_a_draft_identical_to_the_target_is_accepted():
    model = tiny_mar(0)
    pipe = visar.Pipeline(model, None, name="tiny-mar")
    out = pipe.generate(class_labels=[0, 1], method="cspd", draft=model, num_iter=4, output_type="tokens", seed=1)
    assert out.stats["acceptance_rate"] > 0.95


def test_a_model_heads_chain_samples_as_its_transitions_do():
    """cspd's residual chains run through diffusion_chain (conditions embedded once per chain); with
    guidance, the path and token equal those of the transition called step by step, row by row."""
    from visar.accel.continuous.cspd import model_head

    model = tiny_mar(0, num_sampling_steps="ddim4")
    constants = model.diffusion_schedule().constants("cpu")
    gen = torch.Generator().manual_seed(0)
    width, steps = model.diffloss.net.cond_embed.in_features, len(constants["timestep_map"])
    z, z_null = torch.randn(6, width, generator=gen), torch.randn(6, width, generator=gen)
    head = model_head(model, constants, z, z_null, torch.tensor([1.0, 1.5, 2.0, 3.0, 4.0, 5.0]))
    rows = torch.tensor([4, 1, 1, 0])  # a chain may repeat a row (several residual proposals)
    start, noise = torch.randn(4, model.token_dim, generator=gen), torch.randn(steps, 4, model.token_dim, generator=gen)
    with torch.no_grad():
        path, x0 = head.sample(start, rows, 1.0, noise)
        plain = TokenHead(head.transition)
        plain_path, plain_x0 = plain.sample(start, rows, 1.0, noise)
        other_path, _ = plain.sample(start, rows.flip(0), 1.0, noise)  # the rows matter: the check can fail
    torch.testing.assert_close(path, plain_path, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x0, plain_x0, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(path[0], other_path[0], atol=1e-3)


def test_a_self_draft_reproduces_plain_sampling_at_the_models_respacing():
    """cspd runs draft and target on the target's own schedule ("ddim4" here, not an even 4)."""
    model = tiny_mar(0, num_sampling_steps="ddim4")
    pipe = visar.Pipeline(model, None, name="tiny-mar")
    run = dict(class_labels=[0, 1], num_iter=4, output_type="tokens", seed=1)
    plain = pipe.generate(method="mar", **run)
    spec = pipe.generate(method="cspd", draft=model, prefill=0.0, **run)
    assert spec.stats["acceptance_rate"] > 0.95
    torch.testing.assert_close(spec.tokens, plain.tokens, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_cspd_marginals_match_plain_target_sampling():
    """Per-token marginals (every position and channel) of cspd against plain target sampling, on a
    tiny MAR with CFG; the same comparison catches the relaxed mode (negative control)."""
    target, draft = trained_like_pair(0.02)
    pipe = visar.Pipeline(target, None, name="tiny-mar", defaults={"guidance_scale": 1.5})
    n, run = 600, dict(class_labels=[1] * 600, num_iter=3, output_type="tokens")
    plain = pipe.generate(method="mar", seed=0, **run).tokens.reshape(n, -1)
    spec = pipe.generate(method="cspd", draft=draft, num_draft=2, prefill=0.0, seed=10_000, **run)
    assert 0.1 < spec.stats["acceptance_rate"] < 0.9

    def pvalues(tokens):
        tokens = tokens.reshape(n, -1)
        return [ks_2samp(plain[:, k].numpy(), tokens[:, k].numpy()).pvalue for k in range(tokens.shape[1])]

    exact = pvalues(spec.tokens)
    assert min(exact) > 1e-3 / len(exact)  # Bonferroni over the 32 marginals
    relaxed = pipe.generate(method="cspd", draft=draft, num_draft=2, prefill=0.0, mode="relaxed", seed=10_000, **run)
    assert min(pvalues(relaxed.tokens)) < 1e-3 / len(exact)
