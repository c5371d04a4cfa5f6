"""`visar train tokenizer --recipe visar-tiny-kl` and `visar train continuous`: MAR on the shapes world.

The embedded continuous-token pair: one KL-regularised VAE (MAR's tokenizer, visar/tokenizers/kl.py)
and two MAR models of different sizes trained on its latents, a target and a draft for `cspd`.
MAR's objective is upstream's (LTH14/mar `MAR.forward`, `DiffLoss`): a random order and a truncated
normal mask ratio, the diffusion head trained with the improved-DDPM loss on the masked tokens. A
draft recipe may name its target (`distill_from`) and also learn the KL of its sampler's reverse
steps to the target's (`transition_kl`), what cspd's acceptance test pays for. The VAE adds a KL to
N(0, I) to visar-tiny-vq's reconstruction loss and records the latent scale it measured. The loops,
checkpoints and exports are visar.train.loop's; the exports name family "mar". In full:
docs/TRAINING.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoints import load_strict
from ..errors import VisarError
from ..models.diffusion import DiffusionSchedule, diffusion_step
from ..models.mar import MAR, MARConfig
from ..tokenizers.kl import AutoencoderKL, KLConfig
from .loop import (
    build_token_dataset,
    export_averaged,
    export_generator,
    fit,
    fit_tokenizer,
    held_out_batches,
    load_tokenizer_export,
    prepare_out_dir,
    shipped_model_weights,
)
from .recipes import KL_RECIPES, MAR_RECIPES, resolve_recipe

# -- the KL tokenizer ----------------------------------------------------------------------------


def kl_to_standard_normal(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, exp(logvar)) || N(0, 1)), averaged over elements."""
    return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()


@torch.no_grad()
def evaluate_kl(vae: AutoencoderKL, n: int = 512, seed: int = 999) -> dict:
    """Held-out PSNR of the posterior mean's reconstruction, the latent std (whose inverse is the
    scale MAR models the latents at) and the mean posterior std relative to it."""
    vae.eval()
    total_mse, means, stds = 0.0, [], []
    for images in held_out_batches(n, seed):
        posterior = vae.encode(images)
        total_mse += F.mse_loss(vae.decode_latent(posterior.mean).clamp(-1, 1), images, reduction="sum").item()
        means.append(posterior.mean)
        stds.append(posterior.std)
    mse = total_mse / (n * 3 * 64 * 64)
    latent_std = torch.cat(means).std().item()
    return {
        "psnr_db": 10 * math.log10(4 / mse),
        "latent_std": latent_std,
        "posterior_std_relative": torch.cat(stds).mean().item() / latent_std,
        "n_images": n,
    }


def train_kl(recipe_name: str, out: str | os.PathLike, **overrides) -> Path:
    """Train a KL VAE by recipe; returns the export folder (tokenizer.json + safetensors)."""
    recipe = resolve_recipe(KL_RECIPES, recipe_name, overrides)
    torch.manual_seed(recipe["seed"])
    vq_args = dict(recipe["vq_args"])
    vae = AutoencoderKL(KLConfig.from_dict(vq_args))

    def forward(images: torch.Tensor, gen: torch.Generator):
        posterior = vae.encode(images)
        latent = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        recon = vae.decode_latent(latent)
        kl = kl_to_standard_normal(posterior.mean, posterior.logvar)
        loss = F.mse_loss(recon, images) + 0.5 * F.l1_loss(recon, images) + recipe["kl_weight"] * kl
        return loss, recon, None, latent

    def evaluate(tokenizer: AutoencoderKL, n: int) -> dict:
        metrics = evaluate_kl(tokenizer, n)
        vq_args["scale_factor"] = 1.0 / metrics["latent_std"]  # MAR models unit-scale latents
        tokenizer.config = dataclasses.replace(tokenizer.config, scale_factor=vq_args["scale_factor"])
        return metrics

    return fit_tokenizer(recipe_name, recipe, out, vae, vq_args, forward, evaluate)


# -- the MAR models ------------------------------------------------------------------------------


def init_mar(model: MAR):
    """Upstream's init: xavier-uniform linear layers with zero bias, N(0, 0.02) embeddings, tokens and
    positions; in the head N(0, 0.02) time embedding and zero modulations and output layer, so that
    every head block starts as the identity and the head predicts eps = 0, v = 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(module.weight)
            torch.nn.init.zeros_(module.bias)
    for parameter in (
        model.class_emb.weight,
        model.fake_latent,
        model.mask_token,
        model.encoder_pos_embed_learned,
        model.decoder_pos_embed_learned,
        model.diffusion_pos_embed_learned,
    ):
        torch.nn.init.normal_(parameter, std=0.02)
    net = model.diffloss.net
    for layer in net.time_embed.mlp:
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=0.02)
    for block in net.res_blocks:
        torch.nn.init.zeros_(block.adaLN_modulation[-1].weight)
        torch.nn.init.zeros_(block.adaLN_modulation[-1].bias)
    for layer in (net.final_layer.adaLN_modulation[-1], net.final_layer.linear):
        torch.nn.init.zeros_(layer.weight)
        torch.nn.init.zeros_(layer.bias)


def training_diffusion(device) -> dict[str, torch.Tensor]:
    """The 1000-step cosine schedule's constants, with the forward process's two coefficients."""
    constants = DiffusionSchedule.cosine(1000).constants(device)
    sqrt_alphas_cumprod = 1.0 / constants["sqrt_recip_alphas_cumprod"]
    constants["sqrt_alphas_cumprod"] = sqrt_alphas_cumprod
    constants["sqrt_one_minus_alphas_cumprod"] = constants["sqrt_recipm1_alphas_cumprod"] * sqrt_alphas_cumprod
    return constants


def noised(constants: dict, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_t ~ q(x_t | x0) at original timesteps t [N], from the given noise [N, C]."""
    return constants["sqrt_alphas_cumprod"][t, None] * x0 + constants["sqrt_one_minus_alphas_cumprod"][t, None] * noise


def diffusion_loss(net, x0: torch.Tensor, z: torch.Tensor, constants: dict, gen: torch.Generator) -> torch.Tensor:
    """The improved-DDPM loss of the head on clean tokens x0 [N, C] given conditions z [N, Dz]: MSE
    on eps at a uniform timestep, plus the variational bound term (KL of the true posterior to the
    model's step, in bits; Gaussian NLL of x0 at t = 0) through the variance channels only."""
    count, device = x0.shape[0], x0.device
    t = torch.randint(0, len(constants["log_betas"]), (count,), generator=gen).to(device)
    noise = torch.randn(x0.shape, generator=gen).to(device)
    x_t = noised(constants, x0, t, noise)
    out = net(x_t, t, z)
    eps, values = out.chunk(2, dim=-1)
    mse = (eps - noise).pow(2).mean(-1)
    # The bound trains the variance only: the mean comes from the detached eps (Nichol & Dhariwal).
    mean, log_var, _ = diffusion_step(constants, t, x_t, torch.cat([eps.detach(), values], dim=-1))
    true_mean = constants["posterior_mean_coef1"][t, None] * x0 + constants["posterior_mean_coef2"][t, None] * x_t
    true_log_var = constants["posterior_log_variance_clipped"][t, None]
    kl = 0.5 * (
        -1.0 + log_var - true_log_var + (true_log_var - log_var).exp() + (true_mean - mean).pow(2) * (-log_var).exp()
    )
    nll = 0.5 * (math.log(2 * math.pi) + log_var + (x0 - mean).pow(2) * (-log_var).exp())
    bound = torch.where(t[:, None] == 0, nll, kl).mean(-1) / math.log(2.0)
    return (mse + bound).mean()


def transition_kl(
    net, teacher, x0: torch.Tensor, z: torch.Tensor, constants: dict, sampling: dict, gen: torch.Generator
) -> torch.Tensor:
    """What cspd pays for a draft, per token: the KL of the draft's reverse step to the target's,
    summed over channels, at a uniform step i >= 1 of the sampler's schedule (`sampling`: the
    respaced constants), from x_t ~ q(x_t | x0) at that step's timestep. E_q[log q - log p] of one
    step is this KL, and a drafted token is accepted with probability min(1, p / q) of the sum of
    such steps (cspd's trajectory ratio). teacher(x_t, t) -> the target head's [eps | v]."""
    count, device = x0.shape[0], x0.device
    step = torch.randint(1, len(sampling["timestep_map"]), (count,), generator=gen).to(device)
    t = sampling["timestep_map"][step]
    noise = torch.randn(x0.shape, generator=gen).to(device)
    x_t = noised(constants, x0, t, noise)
    mean_q, log_var_q, _ = diffusion_step(sampling, step, x_t, net(x_t, t, z))
    with torch.no_grad():
        mean_p, log_var_p, _ = diffusion_step(sampling, step, x_t, teacher(x_t, t))
    kl = 0.5 * (log_var_p - log_var_q + (log_var_q.exp() + (mean_q - mean_p).pow(2)) * (-log_var_p).exp() - 1.0)
    return kl.sum(-1).mean()


def mask_ratio(minimum: float, gen: torch.Generator) -> float:
    """Upstream's truncnorm((minimum - 1) / 0.25, 0, loc=1, scale=0.25): 1 - |N(0, 0.25)| kept in
    [minimum, 1], by rejection."""
    while True:
        ratio = 1.0 - abs(float(torch.randn((), generator=gen))) * 0.25
        if ratio >= minimum:
            return ratio


def conditions(model: MAR, tokens: torch.Tensor, mask: torch.Tensor, cond: torch.Tensor, dropped: torch.Tensor):
    """The diffusion conditions z [B, L, Dz] of a training batch: the encoder over the visible tokens
    with the class (or `fake_latent` where the class is dropped), then the decoder."""
    class_embedding = torch.where(dropped[:, None], model.fake_latent.expand(len(cond), -1), model.class_emb(cond))
    return model.forward_mae_decoder(model.forward_mae_encoder(tokens, mask, class_embedding), mask)


def masked_token_loss(
    model: MAR,
    tokens: torch.Tensor,
    cond: torch.Tensor,
    gen: torch.Generator,
    constants,
    teacher: MAR | None = None,
    weight: float = 0.0,
) -> torch.Tensor:
    """MAR's training loss on a batch of clean tokens [B, L, C] with class labels [B]. With a
    teacher (the target, for a draft): plus `weight` x `transition_kl` of the draft's head to the
    target's on the same masked tokens, each seen through its own model with the same mask and
    class dropout, at the steps of the draft's sampling schedule."""
    batch, length, _ = tokens.shape
    config, device = model.config, tokens.device
    num_masked = int(math.ceil(length * mask_ratio(config.mask_ratio_min, gen)))
    orders = torch.argsort(torch.rand(batch, length, generator=gen), dim=1).to(device)
    mask = torch.zeros(batch, length, device=device).scatter_(1, orders[:, :num_masked], 1.0)
    dropped = (torch.rand(batch, generator=gen) < config.label_drop_prob).to(device)
    z = conditions(model, tokens, mask, cond, dropped)
    masked = mask.bool()
    repeat = config.diffusion_batch_mul
    x0, z_masked = tokens[masked].repeat(repeat, 1), z[masked].repeat(repeat, 1)
    loss = diffusion_loss(model.diffloss.net, x0, z_masked, constants, gen)
    if teacher is None:
        return loss
    with torch.no_grad():
        teacher_z = conditions(teacher, tokens, mask, cond, dropped)
    teacher_z = teacher_z[masked].repeat(repeat, 1)
    sampling = model.diffusion_schedule().constants(device)
    kl = transition_kl(
        model.diffloss.net,
        lambda x_t, t: teacher.diffloss.net(x_t, t, teacher_z),
        x0,
        z_masked,
        constants,
        sampling,
        gen,
    )
    return loss + weight * kl


def distillation_teacher(name: str, student: MARConfig, device) -> MAR:
    """A shipped MAR (name or folder) as a frozen teacher; its tokens must be the student's."""
    config, weights = shipped_model_weights(name)
    teacher = MAR(MARConfig.from_dict(config["model_args"])) if config.get("family") == "mar" else None
    fits = teacher is not None and (
        (teacher.config.seq_side, teacher.config.token_dim, teacher.config.class_num)
        == (student.seq_side, student.token_dim, student.class_num)
    )
    if not fits:
        raise VisarError(f"distill_from {name!r} is not a MAR over the recipe's tokens and classes")
    load_strict(teacher, weights, source=f"distill_from {name}")
    return teacher.to(device).eval().requires_grad_(False)


def latent_encoder(vae: AutoencoderKL):
    """images -> float16 [B, C, h, w] posterior means at MAR's scale (the dataset's tokens)."""

    def encode(images: torch.Tensor) -> np.ndarray:
        latent = vae.encode(images).mean * vae.config.scale_factor
        return latent.cpu().numpy().astype(np.float16)

    return encode


def train_continuous(
    recipe_name: str,
    out: str | os.PathLike,
    tokenizer: str | os.PathLike,
    device: str | torch.device = "cpu",
    compile: bool = False,
    **overrides,
) -> Path:
    """Train a MAR by recipe on the latents of `tokenizer` (a KL export); returns the export folder
    (family "mar"). The dataset holds posterior means (the VAE's posterior std is recorded in its
    metrics); upstream samples the posterior, which matters little at this KL weight."""
    recipe = resolve_recipe(MAR_RECIPES, recipe_name, overrides)
    out = prepare_out_dir(out)
    device = torch.device(device)
    vae, vq_config = load_tokenizer_export(tokenizer, lambda args: AutoencoderKL(KLConfig.from_dict(args)))
    vae.to(device)
    data = build_token_dataset(recipe, vae, out / "dataset.npz", device, encode=latent_encoder(vae))
    latents = torch.from_numpy(data["tokens"].astype(np.float32))
    labels = torch.from_numpy(data["labels"])
    torch.manual_seed(recipe["seed"])
    model = MAR(MARConfig.from_dict(recipe["model_args"]))
    init_mar(model)
    model.to(device)
    constants = training_diffusion(device)
    teacher = None
    if recipe.get("distill_from"):
        teacher = distillation_teacher(recipe["distill_from"], model.config, device)
    loss_of = torch.compile(masked_token_loss) if compile else masked_token_loss

    def batch_loss(gen: torch.Generator) -> torch.Tensor:
        index = torch.randint(0, latents.shape[0], (recipe["batch_size"],), generator=gen)
        tokens = model.patchify(latents[index].to(device))
        return loss_of(
            model, tokens, labels[index].to(device), gen, constants, teacher, recipe.get("distill_weight", 0.0)
        )

    params, ema = fit(recipe_name, recipe, out, {"model": model}, device, batch_loss)
    return export_averaged(
        lambda **folder: export_generator(
            recipe_name, recipe, model, None, tokenizer, vq_config, out, family="mar", **folder
        ),
        ema,
        params,
    )
