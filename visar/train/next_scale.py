"""`visar train tokenizer --recipe visar-tiny-msvq` and `visar train next-scale`: VAR on the shapes world.

The embedded next-scale pair: one multi-scale VQVAE (VAR's tokenizer, visar/tokenizers/msvq.py)
and two VAR transformers of different depths trained on its tokens, a larger drafter and a smaller
refiner for `code` (collaborative decoding). Checkpoints, resume, the weight average and the fp16
export follow visar.train.raster; the exports name family "var", so `visar.load` and `visar train
ship` read them as they read the raster models.

VAR's tokenizer training is not released upstream; the objective here is the one its quantizer
implements (`VectorQuantizer2.forward`): residual quantisation over the scales of the detached
encoder output, a codebook loss ||f_hat - sg(f)||^2 plus beta ||sg(f_hat) - f||^2, and the
straight-through estimator into the decoder; the reconstruction loss is visar-tiny-vq's (MSE +
0.5 L1), without the perceptual and GAN terms (no pretrained network offline, and minutes).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..data.shapes import CLASS_RENDER_EASY
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
    resolve_recipe,
)

# The scale schedule for 64 px images: 9 scales ending at the 16 x 16 map, 655 tokens per image.
SHAPES_SCALES = (1, 2, 3, 4, 6, 8, 10, 13, 16)

MSVQ_RECIPES = {
    # visar-tiny-vq's size class (ch 32, ch_mult 1-1-2, one res block; 64 px -> 16 x 16) with VAR's
    # quantizer: 512 codes of width 16 shared by the 9 scales, 4 Phi convs. Whole 64 px images
    # (the scales are fixed fractions of the last map, so crops would need another schedule).
    "visar-tiny-msvq": dict(
        seed=0,
        steps=3000,
        batch_size=16,
        lr=1e-3,
        warmup=100,
        checkpoint_every=100,
        dead_code_every=100,
        eval_images=512,
        vq_args=dict(
            vocab_size=512,
            z_channels=16,
            ch=32,
            ch_mult=(1, 1, 2),
            num_res_blocks=1,
            beta=0.25,
            quant_resi=0.5,
            share_quant_resi=4,
            v_patch_nums=SHAPES_SCALES,
            using_sa=False,
            using_mid_sa=True,
        ),
    ),
}


def var_args(depth: int, dim: int, heads: int) -> dict:
    return dict(
        vocab_size=512,
        z_channels=16,
        num_classes=40,
        depth=depth,
        embed_dim=dim,
        num_heads=heads,
        mlp_ratio=4.0,
        attn_l2_norm=True,  # as every release
        patch_nums=SHAPES_SCALES,
    )


NEXT_SCALE_RECIPES = {
    # The drafter (CoDe's large model): the raster default's size class (width 128, 3 layers, batch
    # 16, lr 3e-3 with the weight average). A step holds 655 positions against the raster's 256, so
    # the hour holds fewer steps: 3,000.
    "visar-tiny-var-c2i": dict(
        condition="class",
        seed=5,
        data_seed=1,
        steps=3000,
        batch_size=16,
        lr=3e-3,
        warmup=100,
        ema_decay=0.999,
        checkpoint_every=100,
        dataset_size=20_000,
        class_dropout_prob=0.1,
        render=CLASS_RENDER_EASY,
        model_args=var_args(depth=3, dim=128, heads=4),
        # VAR's convention: guidance 1 + cfg at the last scale (ramped); the raster default's cfg 2
        # is guidance_scale 3 here. No top-k/top-p: the 512-code vocabulary is small. Temperature
        # 0.7: better than 1.0 on held-out images (docs/MODELS.md, docs/VAR.md).
        defaults=dict(guidance_scale=3.0, temperature=0.7, top_k=None, top_p=1.0),
    ),
}
# The refiner (CoDe's small model): half the width, 2 layers (about a fifth of the drafter's
# parameters), trained on the same tokens for the same 3,000 steps.
NEXT_SCALE_RECIPES["visar-tiny-var-c2i-refiner"] = dict(
    NEXT_SCALE_RECIPES["visar-tiny-var-c2i"],
    seed=6,
    model_args=var_args(depth=2, dim=64, heads=2),
    # alone, the refiner samples at temperature 1; inside `code` the drafter's call sets it
    defaults=dict(NEXT_SCALE_RECIPES["visar-tiny-var-c2i"]["defaults"], temperature=1.0),
)
# CoDe's specialised fine-tuning: the refiner, trained on every scale, fine-tuned on the scales it
# decodes after the drafter's 6 (sizes 10, 13, 16: 525 of the 655 tokens); the loss still sees
# every earlier scale as context. No weight average (it lagged on the 3,000-step runs).
NEXT_SCALE_RECIPES["visar-tiny-var-c2i-refiner-s6"] = dict(
    NEXT_SCALE_RECIPES["visar-tiny-var-c2i-refiner"],
    seed=7,
    init="visar-tiny-var-c2i-refiner",
    loss_from_scale=6,
    steps=3000,
    lr=1e-3,
    ema_decay=None,
)


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
    """Load a registered model's weights (same architecture) into `model`, for a fine-tuning recipe."""
    from ..pipeline import load

    source = load(name, device="cpu").model
    if source.config != model.config:
        raise VisarError(f"init model {name!r} has another architecture than the recipe's model_args")
    model.load_state_dict(source.float().state_dict())


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
