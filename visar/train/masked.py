"""`visar train masked`: MaskGIT-style generators (visar.models.maskgit) on the shapes world.

The loss is MaskGIT's: the cross-entropy of the masked positions' tokens given the rest and the
class, with cosine-distributed mask ratios; class dropout trains the unconditional half of
classifier-free guidance. The loop, checkpoints and export are visar.train.loop's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models.maskgit import MaskGIT, MaskGITConfig, init_maskgit, masking_ratio
from .loop import build_token_dataset, export_averaged, export_generator, fit, load_tokenizer_export, prepare_out_dir
from .recipes import MASKED_RECIPES, resolve_recipe


def masked_inputs(tokens: torch.Tensor, mask_id: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MaskGIT's training corruption: per sequence a ratio r = cos(pi/2 u), u ~ U[0, 1), and ceil(r N)
    positions (at least one) chosen uniformly set to the mask id -> (inputs [B, N], masked [B, N] bool).
    Drawn from the step's generator, so a resumed run corrupts as an uninterrupted one."""
    batch, num_tokens = tokens.shape
    count = torch.ceil(masking_ratio(torch.rand(batch, generator=gen)) * num_tokens).clamp(1, num_tokens)
    rank = torch.rand(batch, num_tokens, generator=gen).argsort(1).argsort(1)  # a random rank per position
    masked = rank < count[:, None].to(rank.device)
    return torch.where(masked.to(tokens.device), mask_id, tokens), masked.to(tokens.device)


def train_masked(
    recipe_name: str,
    out: str | os.PathLike,
    tokenizer: str | os.PathLike,
    device: str | torch.device = "cpu",
    compile: bool = False,
    **overrides,
) -> Path:
    """Train a MaskGIT-style generator by recipe on tokens of `tokenizer`; returns the export folder.

    The loss is the cross-entropy of the masked positions' tokens given the rest and the class
    (MaskGIT's objective), with cosine-distributed mask ratios; class dropout (the null class)
    trains the unconditional half of classifier-free guidance. Checkpoints, resume, the weight
    average and the export follow `train_ar`; the export's config.json names family "maskgit"."""
    recipe = resolve_recipe(MASKED_RECIPES, recipe_name, overrides)
    out = prepare_out_dir(out)
    device = torch.device(device)
    vq, vq_config = load_tokenizer_export(tokenizer)
    data = build_token_dataset(recipe, vq.to(device), out / "dataset.npz", device)
    tokens = torch.from_numpy(data["tokens"].astype(np.int64))
    labels = torch.from_numpy(data["labels"])
    torch.manual_seed(recipe["seed"])
    model = MaskGIT(MaskGITConfig.from_dict(recipe["model_args"]))
    init_maskgit(model)
    model.to(device)

    def masked_loss(inputs: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, cond: torch.Tensor):
        logits = model(inputs, cond)  # [B, N, V]
        return F.cross_entropy(logits[masked], targets[masked])

    loss_of = torch.compile(masked_loss) if compile else masked_loss

    def batch_loss(gen: torch.Generator) -> torch.Tensor:
        index = torch.randint(0, tokens.shape[0], (recipe["batch_size"],), generator=gen)
        targets = tokens[index].to(device)
        inputs, masked = masked_inputs(targets, model.mask_token_id, gen)
        return loss_of(inputs, targets, masked, labels[index].to(device))

    params, ema = fit(recipe_name, recipe, out, {"model": model}, device, batch_loss)
    return export_averaged(
        lambda **folder: export_generator(
            recipe_name, recipe, model, None, tokenizer, vq_config, out, family="maskgit", **folder
        ),
        ema,
        params,
    )
