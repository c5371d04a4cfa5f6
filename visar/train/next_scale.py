"""`visar train tokenizer --recipe visar-tiny-msvq` and `visar train next-scale`: VAR on the shapes world.

The embedded next-scale pair: one multi-scale VQVAE (VAR's tokenizer, visar/tokenizers/msvq.py)
and two VAR transformers of different depths trained on its tokens, a larger drafter and a smaller
refiner for `code` (collaborative decoding). The VQVAE's objective is the one VAR's quantizer
implements (its training is not released upstream): residual quantisation with a codebook and a
commitment loss and the straight-through estimator, plus visar-tiny-vq's reconstruction loss. The
loops, checkpoints and exports are visar.train.loop's; the exports name family "var". In full:
docs/TRAINING.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import VisarError
from ..models.var import VAR, VARConfig
from ..tokenizers.msvq import MSVQConfig, MultiScaleVQVAE
from .loop import (
    build_token_dataset,
    export_averaged,
    export_generator,
    fit,
    fit_tokenizer,
    load_tokenizer_export,
    prepare_out_dir,
    shipped_model_weights,
)
from .recipes import MSVQ_RECIPES, NEXT_SCALE_RECIPES, resolve_recipe

# -- the multi-scale VQVAE -----------------------------------------------------------------------


def quantize_for_training(msvq: MultiScaleVQVAE, f: torch.Tensor, beta: float):
    """VAR's residual quantisation in training -> (straight-through latents, tokens per scale, VQ loss).

    Codes are chosen on the detached encoder output; the codebook and the Phi convs learn from
    ||f_hat - sg(f)||^2, the encoder from beta ||sg(f_hat) - f||^2 summed over scales (upstream's
    mean_vq_loss), and the decoder's gradient reaches the encoder through f_hat's straight-through."""
    quantizer, sides = msvq.quantize, msvq.scale_sizes
    target = f.detach().float()
    f_rest, f_hat = target.clone(), torch.zeros_like(target)
    loss, scale_tokens = f.new_zeros(()), []
    for k, side in enumerate(sides):
        latents = f_rest if k == len(sides) - 1 else F.interpolate(f_rest, size=(side, side), mode="area")
        flat = latents.permute(0, 2, 3, 1).reshape(-1, msvq.latent_dim)
        tokens = quantizer.nearest_codes(flat).reshape(f.shape[0], side, side)
        h = quantizer.residual(tokens, k)
        f_hat = f_hat + h
        f_rest = f_rest - h.detach()
        loss = loss + F.mse_loss(f_hat, target) + beta * F.mse_loss(f_hat.detach(), f)
        scale_tokens.append(tokens)
    straight_through = f_hat.detach() - f.detach() + f
    return straight_through, scale_tokens, loss / len(sides)


def train_msvq(recipe_name: str, out: str | os.PathLike, **overrides) -> Path:
    """Train VAR's multi-scale VQVAE by recipe; returns the export folder (tokenizer.json + safetensors)."""
    recipe = resolve_recipe(MSVQ_RECIPES, recipe_name, overrides)
    torch.manual_seed(recipe["seed"])
    config = MSVQConfig.from_dict(recipe["vq_args"])
    msvq = MultiScaleVQVAE(config)

    def forward(images: torch.Tensor, gen: torch.Generator):
        f = msvq.pre_quant(images)
        f_hat, scale_tokens, vq_loss = quantize_for_training(msvq, f, config.beta)
        recon = msvq.decoder(msvq.post_quant_conv(f_hat))
        loss = F.mse_loss(recon, images) + 0.5 * F.l1_loss(recon, images) + vq_loss
        return loss, recon, torch.cat([tokens.flatten() for tokens in scale_tokens]), f

    return fit_tokenizer(recipe_name, recipe, out, msvq, config.to_dict(), forward)


# -- the VAR transformers ------------------------------------------------------------------------


def split_scales(flat: torch.Tensor, sides: tuple[int, ...]) -> list[torch.Tensor]:
    """[B, L] tokens of every scale in order -> one [B, side, side] map per scale."""
    maps = flat.split([side * side for side in sides], dim=1)
    return [m.reshape(len(flat), side, side) for m, side in zip(maps, sides, strict=True)]


def init_var(model: VAR, std: float | None = None):
    """VAR's init in short (upstream `init_weights`): truncated normal sqrt(1/(3 C)) for linear layers,
    embeddings and positions; a zero head; AdaLN projections scaled down so that every block starts
    near the identity (gamma ~ 0) and the modulation near (scale 0, shift 0)."""
    std = std or (1 / model.config.embed_dim / 3) ** 0.5
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.trunc_normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)
    for parameter in (model.pos_start, model.pos_1LC):
        torch.nn.init.trunc_normal_(parameter, std=std)
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)
    with torch.no_grad():
        for block in model.blocks:
            if hasattr(block, "ada_lin"):
                block.ada_lin[1].weight.mul_(0.5)
                block.ada_lin[1].bias.zero_()
        model.head_nm.ada_lin[1].weight.mul_(0.5)


def scored_cross_entropy(logits: torch.Tensor, tokens: torch.Tensor, first: int) -> torch.Tensor:
    """Mean cross-entropy of positions `first` and later: logits [B, L, V], tokens [B, L]."""
    logits = logits[:, first:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, first:].reshape(-1))


def start_from(model: VAR, name: str):
    """Load a shipped VAR's weights (same architecture) into `model`, for a fine-tuning recipe."""
    config, weights = shipped_model_weights(name)
    if config.get("family") != "var" or VARConfig.from_dict(config["model_args"]) != model.config:
        raise VisarError(f"init model {name!r} has another architecture than the recipe's model_args")
    model.load_state_dict(weights)


def train_next_scale(
    recipe_name: str,
    out: str | os.PathLike,
    tokenizer: str | os.PathLike,
    device: str | torch.device = "cpu",
    compile: bool = False,
    **overrides,
) -> Path:
    """Train a VAR transformer by recipe on the scale tokens of `tokenizer` (an msvq export); returns
    the export folder (family "var").

    The loss is VAR's: the cross-entropy of every scale's tokens given the earlier scales (block-causal
    teacher forcing in one pass), uniform over the 655 positions; class dropout to the null class
    trains the unconditional half of guidance (upstream's cond_drop_rate). A recipe with `init` (a
    registered model of the same architecture) starts from its weights, and `loss_from_scale` k
    scores only scales k and later: CoDe's specialised fine-tuning of a refiner for the scales it
    decodes."""
    recipe = resolve_recipe(NEXT_SCALE_RECIPES, recipe_name, overrides)
    out = prepare_out_dir(out)
    device = torch.device(device)
    msvq, vq_config = load_tokenizer_export(tokenizer, lambda args: MultiScaleVQVAE(MSVQConfig.from_dict(args)))
    msvq.to(device)
    data = build_token_dataset(recipe, msvq, out / "dataset.npz", device)
    tokens = torch.from_numpy(data["tokens"].astype(np.int64))
    labels = torch.from_numpy(data["labels"])
    torch.manual_seed(recipe["seed"])
    model = VAR(VARConfig.from_dict(recipe["model_args"]))
    init_var(model)
    if recipe.get("init"):
        start_from(model, recipe["init"])
    model.to(device)
    sides, null = model.scale_sizes, model.config.num_classes
    first = model.scale_starts[recipe.get("loss_from_scale", 0)]

    def next_scale_loss(batch_tokens: torch.Tensor, inputs: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return scored_cross_entropy(model(cond, inputs), batch_tokens, first)

    loss_of = torch.compile(next_scale_loss) if compile else next_scale_loss

    def batch_loss(gen: torch.Generator) -> torch.Tensor:
        index = torch.randint(0, tokens.shape[0], (recipe["batch_size"],), generator=gen)
        dropped = torch.rand(len(index), generator=gen) < recipe["class_dropout_prob"]
        cond = torch.where(dropped, null, labels[index]).to(device)
        batch_tokens = tokens[index].to(device)
        with torch.no_grad():
            inputs = msvq.teacher_forcing_inputs(split_scales(batch_tokens, sides))
        return loss_of(batch_tokens, inputs, cond)

    params, ema = fit(recipe_name, recipe, out, {"model": model}, device, batch_loss)
    return export_averaged(
        lambda **folder: export_generator(
            recipe_name, recipe, model, None, tokenizer, vq_config, out, family="var", **folder
        ),
        ema,
        params,
    )
