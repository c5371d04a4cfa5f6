"""`visar train tokenizer --recipe visar-tiny-vq` and `visar train ar`: LlamaGen's VQ tokenizer and
LlamaGen generators (class- and caption-conditional) on the shapes world.

ZipAR-aware training (`zipar_lags`) shows a share of the sequences only what zipar's next-set
decoding lets a position see (visar/models/lag_mask.py); a caption recipe may start from a class
model's transformer (`init`). The loops, checkpoints and exports are visar.train.loop's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import VisarError
from ..models.kv_cache import condition_validity
from ..models.lag_mask import lag_training_mask
from ..models.llamagen import LlamaGen, LlamaGenConfig
from ..models.text import PAD, UNK, CaptionEncoder, CaptionEncoderConfig
from ..tokenizers.vq import VQConfig, VQModel
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
from .recipes import AR_RECIPES, TOKENIZER_RECIPES, resolve_recipe


def train_tokenizer(recipe_name: str, out: str | os.PathLike, **overrides) -> Path:
    """Train a VQ tokenizer by recipe; returns the export folder (tokenizer.json + safetensors)."""
    recipe = resolve_recipe(TOKENIZER_RECIPES, recipe_name, overrides)
    torch.manual_seed(recipe["seed"])
    vq = VQModel(VQConfig.from_dict(recipe["vq_args"]))

    def forward(images: torch.Tensor, gen: torch.Generator):
        pre = vq.pre_quant(images)
        z_q, codes, losses = vq.quantize(pre)
        recon = vq.decode_latents(z_q)
        loss = F.mse_loss(recon, images) + 0.5 * F.l1_loss(recon, images) + losses["codebook"] + losses["commit"]
        return loss, recon, codes.flatten(), pre

    return fit_tokenizer(recipe_name, recipe, out, vq, recipe["vq_args"], forward)


# -- LlamaGen generators ----------------------------------------------------------------------


def caption_vocabulary() -> tuple[str, ...]:
    """Every word of every prompt the shapes world can produce."""
    from ..data.shapes import TASKS, _task_entries

    words = {w for task in TASKS for entry in _task_entries(task) for w in entry["prompt"].lower().split()}
    return (PAD, UNK, *sorted(words))


def train_ar(
    recipe_name: str,
    out: str | os.PathLike,
    tokenizer: str | os.PathLike,
    device: str | torch.device = "cpu",
    compile: bool = False,
    **overrides,
) -> Path:
    """Train a LlamaGen generator by recipe on tokens of `tokenizer`; returns the export folder.

    `device` only changes where the arithmetic runs: batches and init come from the same seeds, so
    a CUDA run follows the recipe too (it differs from a CPU run by floating-point rounding only
    and by the class-dropout draws, which come from the device's generator). `compile` runs the
    loss through torch.compile (the same recipe up to rounding; its speed: docs/MODELS.md).

    A recipe with `ema_decay` keeps an exponential moving average of the weights (in the
    checkpoint, so a resumed run keeps it too) and exports it as OUT/export; the last step's
    weights go to OUT/export-last for comparison."""
    recipe = resolve_recipe(AR_RECIPES, recipe_name, overrides)
    out = prepare_out_dir(out)
    device = torch.device(device)
    vq, vq_config = load_tokenizer_export(tokenizer)
    data = build_token_dataset(recipe, vq.to(device), out / "dataset.npz", device)
    tokens = torch.from_numpy(data["tokens"].astype(np.int64))
    labels = torch.from_numpy(data["labels"])
    torch.manual_seed(recipe["seed"])
    model = LlamaGen(LlamaGenConfig.from_dict(recipe["model_args"]))
    init_llamagen(model)
    if recipe.get("init"):
        start_backbone_from(model, recipe["init"])
    model.to(device)
    text_encoder = None
    if recipe["condition"] == "caption":
        text_encoder = CaptionEncoder(CaptionEncoderConfig(vocab=caption_vocabulary(), **recipe["text_encoder_args"]))
        text_encoder.to(device)
        caption_ids, caption_mask = text_encoder.tokenize([str(c) for c in data["captions"]])
    modules = {"model": model} | ({"text_encoder": text_encoder} if text_encoder is not None else {})
    lag_masks = lag_mask_table(recipe, model, device)

    def next_token_loss(
        batch_tokens: torch.Tensor, cond: torch.Tensor, mask: torch.Tensor | None, cond_mask: torch.Tensor | None
    ) -> torch.Tensor:
        # Captions are left-padded: their padded keys are hidden in training as they are in sampling
        # (the cache's key_valid). Trained with them visible, a t2i model leans on the padding and
        # then samples as if from a wrong caption (loss 2.10 against 2.01 with the null caption).
        if cond_mask is not None and mask is not None:
            pos = torch.arange(mask.shape[-1], device=mask.device)[None].expand(len(mask), -1)
            valid = condition_validity(cond_mask, len(mask), mask.shape[-1], mask.device)
            mask = mask & model.default_mask(pos, pos, valid)
        logits = model(batch_tokens[:, :-1], cond, mask=mask, cond_mask=cond_mask)[:, model.num_condition_tokens - 1 :]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch_tokens.reshape(-1))

    loss_of = torch.compile(next_token_loss) if compile else next_token_loss

    def batch_loss(gen: torch.Generator) -> torch.Tensor:
        index = torch.randint(0, tokens.shape[0], (recipe["batch_size"],), generator=gen)
        batch_tokens = tokens[index].to(device)
        lag_mask = None
        if lag_masks is not None:  # drawn after the batch, from the same generator: a resumed run draws the same
            lagged = torch.rand(len(index), generator=gen) < recipe["zipar_fraction"]
            which = torch.randint(1, lag_masks.shape[0], (len(index),), generator=gen)
            lag_mask = lag_masks[torch.where(lagged, which, 0).to(device)]
        cond_mask = None
        if text_encoder is None:
            cond = labels[index].to(device)
        else:
            ids, cond_mask = caption_ids[index].to(device), caption_mask[index].to(device)
            cond = text_encoder(ids, cond_mask)
        return loss_of(batch_tokens, cond, lag_mask, cond_mask)

    params, ema = fit(recipe_name, recipe, out, modules, device, batch_loss)
    return export_averaged(
        lambda **folder: export_generator(
            recipe_name, recipe, model, text_encoder, tokenizer, vq_config, out, **folder
        ),
        ema,
        params,
    )


def start_backbone_from(model: LlamaGen, name: str):
    """Load a registered LlamaGen model's transformer into `model`, keeping `model`'s own condition
    embedding: a text-conditional recipe can start from a class-conditional model that already draws
    the shapes (every weight but `cls_embedding.*` must match in name and shape)."""
    _, source = shipped_model_weights(name)
    own = model.state_dict()
    backbone = {k for k in own if not k.startswith("cls_embedding.")}
    source_backbone = {k for k in source if not k.startswith("cls_embedding.")}
    misfit = sorted(k for k in backbone if k not in source or source[k].shape != own[k].shape)
    if misfit or source_backbone - backbone:
        raise VisarError(
            f"init model {name!r} has another transformer than the recipe's model_args "
            f"(first mismatched weight: {(misfit or sorted(source_backbone - backbone))[0]})"
        )
    model.load_state_dict({k: source[k] for k in backbone}, strict=False)


def lag_mask_table(recipe: dict, model: LlamaGen, device: torch.device) -> torch.Tensor | None:
    """[1 + len(zipar_lags), L, L] training masks: plain causal, then zipar's at each lag.

    A recipe with `zipar_lags` trains a `zipar_fraction` of its sequences under zipar's
    visibility at one of those lags (models/lag_mask.py, `lag_training_mask`), so the model learns
    the conditionals that next-set decoding asks of it; the rest stay plain causal."""
    lags = recipe.get("zipar_lags")
    if not lags:
        return None
    fraction = recipe.get("zipar_fraction")
    if not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise VisarError(f"zipar_fraction must be in (0, 1] when zipar_lags is set, got {fraction!r}")
    num_cond = model.num_condition_tokens
    masks = [lag_training_mask(model.grid_size, model.grid_size[1], num_cond)]  # s = W: causal
    masks += [lag_training_mask(model.grid_size, s, num_cond) for s in lags]
    return torch.stack(masks).to(device)


def init_llamagen(model: LlamaGen, std: float = 0.02):
    """LlamaGen's init (normal 0.02 for linear and embedding weights, zero output head)."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=std)
    torch.nn.init.zeros_(model.output.weight)
