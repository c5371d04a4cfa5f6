"""`visar train`: the recipes that produce visar's embedded models, on a CPU, resumably.

Recipes are fixed dicts (seed included) recorded in each exported config.json, so that
`visar train tokenizer --recipe visar-tiny-vq`, `visar train ar --recipe visar-tiny-c2i` and
`visar train masked --recipe visar-tiny-maskgit-c2i` reproduce the shipped weights (up to
floating-point differences between machines).

Every run writes `OUT/checkpoint.pt` every `checkpoint_every` steps (atomically: a killed run
never leaves a half-written file) and resumes from it when started again with the same OUT.
Batches are drawn from a generator keyed to (seed, step), so a resumed run sees the same data
as an uninterrupted one. At the end the model is exported as fp16 safetensors in OUT/export/.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..data.shapes import CLASS_RENDER_EASY, class_render_options
from ..errors import VisarError
from ..models.base import condition_validity
from ..models.lag_mask import lag_training_mask
from ..models.llamagen import LlamaGen, LlamaGenConfig
from ..models.maskgit import MaskGIT, MaskGITConfig, init_maskgit, masking_ratio
from ..models.text import PAD, UNK, CaptionEncoder, CaptionEncoderConfig
from ..tokenizers.vq import VQConfig, VQModel

TOKENIZER_RECIPES = {
    "visar-tiny-vq": dict(
        seed=0,
        steps=3000,
        batch_size=16,
        crop=32,  # train on random 32x32 crops: 4x cheaper, and the conv net is size-agnostic
        lr=1e-3,
        warmup=100,
        checkpoint_every=100,
        dead_code_every=100,
        eval_images=512,
        vq_args=dict(
            codebook_size=512,
            codebook_embed_dim=8,
            encoder_ch_mult=[1, 1, 2],
            decoder_ch_mult=[1, 1, 2],
            z_channels=64,
            ch=32,
            num_res_blocks=1,
            codebook_show_usage=False,
        ),
    ),
}

AR_RECIPES = {
    # The default's recipe without zipar-aware training (plain causal); shipped as visar-tiny-c2i-causal.
    "visar-tiny-c2i-causal": dict(
        condition="class",
        seed=1,
        data_seed=1,
        # Small batches, many steps: at this size the step count, not the batch, limits how soon
        # the class is used; 3 layers beat 4 at the same CPU time, and 6,400 compiled steps fit
        # the hour with the tokenizing (the sweep and timings: docs/MODELS.md, tools/recipe_sweep.py).
        steps=6400,
        batch_size=16,
        lr=3e-3,
        warmup=100,
        ema_decay=0.999,  # the lr ends at 10% of its peak: the average smooths the last steps' noise
        checkpoint_every=100,
        dataset_size=20_000,
        render=CLASS_RENDER_EASY,  # one 28-px object on a calm background (visar/data/shapes.py)
        model_args=dict(
            dim=128,
            n_layer=3,
            n_head=4,
            multiple_of=64,
            vocab_size=512,
            num_classes=40,
            block_size=256,
            cls_token_num=1,
            class_dropout_prob=0.1,
            token_dropout_p=0.0,
            resid_dropout_p=0.0,
            ffn_dropout_p=0.0,
        ),
        # cfg 2: the best of the guidance sweep in docs/MODELS.md.
        defaults=dict(guidance_scale=2.0, temperature=1.0, top_k=None, top_p=1.0),
    ),
    "visar-tiny-c2i-draft": dict(
        condition="class",
        seed=2,
        data_seed=1,  # the target's training set (same render settings): the draft learns the same data
        steps=5400,  # the schedule the target had when the draft was trained; a draft step costs under a third
        batch_size=16,
        lr=3e-3,
        warmup=100,
        checkpoint_every=100,
        dataset_size=20_000,
        render=CLASS_RENDER_EASY,
        model_args=dict(
            dim=64,
            n_layer=2,  # 0.17 M parameters: under a quarter of the target's 0.78 M
            n_head=2,
            multiple_of=64,
            vocab_size=512,
            num_classes=40,
            block_size=256,
            cls_token_num=1,
            class_dropout_prob=0.1,
            token_dropout_p=0.0,
            resid_dropout_p=0.0,
            ffn_dropout_p=0.0,
        ),
        defaults=dict(guidance_scale=2.0, temperature=1.0, top_k=None, top_p=1.0),
    ),
    # What the c2i recipe taught, for captions (docs/MODELS.md): batch 16 at lr 3e-3 with the weight
    # average, a compiled step, many steps, and the easy renders (a calm background; objects at the
    # largest size their count allows: 28 px alone, 24 for two, 20 for three, 18 for four).
    # It starts from the causal c2i model's transformer (`init`; the caption encoder and its
    # projection start fresh): a model that already draws each shape in each colour only has to learn
    # to read the caption (the pilot that compared it with a start from scratch: docs/MODELS.md).
    "visar-tiny-t2i": dict(
        condition="caption",
        init="visar-tiny-c2i-causal",
        seed=3,
        data_seed=3,
        steps=10_000,
        batch_size=16,
        lr=3e-3,
        warmup=100,
        ema_decay=0.999,
        checkpoint_every=100,
        dataset_size=30_000,
        render=CLASS_RENDER_EASY,
        model_args=dict(
            dim=128,
            n_layer=3,  # the init model's transformer
            n_head=4,
            multiple_of=64,
            vocab_size=512,
            block_size=256,
            cls_token_num=16,
            caption_dim=64,
            model_type="t2i",
            class_dropout_prob=0.1,
            token_dropout_p=0.0,
            resid_dropout_p=0.0,
            ffn_dropout_p=0.0,
        ),
        text_encoder_args=dict(max_len=16, dim=64, n_layer=2, n_head=4),
        # the best of the held-out guidance and temperature sweep (tools/t2i_settings.py,
        # docs/t2i_settings.json, docs/MODELS.md)
        defaults=dict(guidance_scale=1.5, temperature=1.0, top_k=None, top_p=1.0),
    ),
}

# The default: the causal recipe with ZipAR-aware training (docs/MODELS.md). A quarter of the
# sequences see only what zipar at lag 2 or 3 lets a position see, so next-set decoding asks the
# model for conditionals it was trained on, at a price in plain AR quality; half the sequences
# at lags 2-4 cost more (the comparison: docs/MODELS.md, "ZipAR-aware training").
AR_RECIPES["visar-tiny-c2i"] = dict(AR_RECIPES["visar-tiny-c2i-causal"], zipar_lags=(2, 3), zipar_fraction=0.25)


# Masked (MaskGIT-style) generators: visar.models.maskgit, trained by `train_masked`.
MASKED_RECIPES = {
    # The default raster model's data, size class and budget, for a bidirectional transformer: the
    # visar-tiny-c2i training set (data_seed 1, the easy class renders), 0.76 M parameters (0.78 M
    # raster), batch 16, lr 3e-3 with the weight average. A step costs about what a raster step
    # costs (257 positions, 3 layers of width 128; no causal mask), so it gets the raster budget of
    # 6,400 steps.
    "visar-tiny-maskgit-c2i": dict(
        condition="class",
        seed=4,
        data_seed=1,
        steps=6400,
        batch_size=16,
        lr=3e-3,
        warmup=100,
        ema_decay=0.999,
        checkpoint_every=100,
        dataset_size=20_000,
        render=CLASS_RENDER_EASY,
        model_args=dict(
            dim=128,
            n_layer=3,
            n_head=4,
            mlp_ratio=4.0,
            vocab_size=512,
            num_classes=40,
            grid_size=16,
            class_dropout_prob=0.1,
            dropout_p=0.0,
        ),
        defaults=dict(guidance_scale=2.0, temperature=1.0, top_k=None, top_p=1.0),
    ),
}


# -- shared plumbing -----------------------------------------------------------------------------


def prepare_out_dir(out: str | os.PathLike) -> Path:
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise VisarError(f"output folder {out} cannot be created or written: {err}") from err
    return out


def save_checkpoint(path: Path, state: dict):
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint intact


def load_checkpoint(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise VisarError(
            f"checkpoint {path} is corrupt or truncated ({err}); delete it to restart the run from scratch"
        ) from err


def lr_at(step: int, recipe: dict) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < recipe["warmup"]:
        return recipe["lr"] * (step + 1) / recipe["warmup"]
    progress = (step - recipe["warmup"]) / max(1, recipe["steps"] - recipe["warmup"])
    return recipe["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def resume(out: Path, modules: dict, opt, ema: list | None, device: torch.device) -> tuple[int, list | None]:
    """Load OUT/checkpoint.pt into `modules` (checkpoint key -> module), the optimiser, the weight
    average and the RNGs, if it exists -> (the step to go on from, the weight average)."""
    state = load_checkpoint(out / "checkpoint.pt")
    if state is None:
        return 0, ema
    for key, module in modules.items():
        module.load_state_dict(state[key])
    opt.load_state_dict(state["optimizer"])
    if ema is not None:
        ema = [t.to(device) for t in state["ema"]]
    torch.set_rng_state(state["rng_state"])  # class/caption dropout draws from the global RNG
    if device.type == "cuda" and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"], device)
    return state["step"], ema


def optimizer_step(loss: torch.Tensor, opt, params: list, ema: list | None, step: int, recipe: dict):
    """Backward, gradient clipping at 1, the optimiser's step, then the weight average's update."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    if ema is not None:
        # Warm-up of the average (timm, LlamaGen): early weights are forgotten quickly.
        decay = min(recipe["ema_decay"], (1 + step) / (10 + step))
        with torch.no_grad():
            for average, p in zip(ema, params, strict=True):
                average.lerp_(p, 1 - decay)


def save_training_state(out: Path, modules: dict, opt, ema, step: int, loss, recipe: dict, device: torch.device):
    """OUT/checkpoint.pt every `checkpoint_every` steps and at the last one (what `resume` reads)."""
    if step % recipe["checkpoint_every"] and step != recipe["steps"]:
        return
    state = {
        **{key: module.state_dict() for key, module in modules.items()},
        "optimizer": opt.state_dict(),
        "step": step,
        "loss": loss.item(),
        "rng_state": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda_rng_state"] = torch.cuda.get_rng_state(device)
    if ema is not None:
        state["ema"] = ema
    save_checkpoint(out / "checkpoint.pt", state)


def fit(recipe_name: str, recipe: dict, out: Path, modules: dict, device: torch.device, batch_loss) -> tuple:
    """The generators' training loop (train_ar, train_masked, train_next_scale): AdamW (0.9, 0.95,
    weight decay 0.05) over every module's parameters at the recipe's learning-rate schedule, the
    weight average, checkpoints and resume. batch_loss(gen) -> the loss of the step's batch, drawn
    from `gen`, the generator keyed to (seed, step): a resumed run draws what an uninterrupted one
    does. Returns (the parameters, their average or None) for `export_averaged`."""
    params = [p for module in modules.values() for p in module.parameters()]
    opt = torch.optim.AdamW(params, lr=recipe["lr"], betas=(0.9, 0.95), weight_decay=0.05)
    ema = [p.detach().clone() for p in params] if recipe.get("ema_decay") else None
    step, ema = resume(out, modules, opt, ema, device)
    for module in modules.values():
        module.train()
    bar = tqdm(total=recipe["steps"], initial=step, desc=f"train {recipe_name}", unit="step")
    while step < recipe["steps"]:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        loss = batch_loss(step_generator(recipe["seed"], step))
        optimizer_step(loss, opt, params, ema, step, recipe)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        save_training_state(out, modules, opt, ema, step, loss, recipe, device)
    bar.close()
    return params, ema


def export_averaged(export, ema: list | None, params: list) -> Path:
    """export(folder=...) the trained weights: without an average, as they are; with one, the last
    step's weights to export-last/, then the average (copied into the weights) to export/."""
    if ema is None:
        return export()
    export(folder="export-last")
    with torch.no_grad():
        for average, p in zip(ema, params, strict=True):
            p.copy_(average)
    return export()


def export_fp16(module: torch.nn.Module, path: Path):
    tensors = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, str(path))


def images_to_tensor(images: list[np.ndarray]) -> torch.Tensor:
    """uint8 [H, W, 3] images -> float [B, 3, H, W] in [-1, 1] (the tokenizer's range)."""
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1


def training_renders(seed: int, index: int) -> tuple[np.ndarray, int | None, str]:
    """Render number `index` of a training stream: class renders and caption renders alternate."""
    from ..data.shapes import NUM_CLASSES, render_caption_sample, render_class

    if index % 2 == 0:
        sample = render_class(index // 2 % NUM_CLASSES, seed * 10_000_019 + index)
    else:
        sample = render_caption_sample(seed * 10_000_019 + index)
    return sample.image, sample.class_label, sample.caption


# -- tokenizer ----------------------------------------------------------------------------------


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2)."""
    mse = F.mse_loss(a.clamp(-1, 1), b).item()
    return 10 * math.log10(4 / mse)


def held_out_batches(n: int, seed: int, size: int = 64):
    """n training-stream renders of `seed` (one no recipe trains on) as image batches [<= size, 3, H, W]."""
    for start in range(0, n, size):
        yield images_to_tensor([training_renders(seed, i)[0] for i in range(start, min(n, start + size))])


@torch.no_grad()
def evaluate_tokenizer(tokenizer, n: int = 512, seed: int = 999) -> dict:
    """Held-out reconstruction PSNR and codebook usage (renders from a seed no recipe trains on); a
    multi-scale tokenizer's codes are a list of maps, its usage counts every scale."""
    tokenizer.eval()
    total_mse, used = 0.0, torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
    for images in held_out_batches(n, seed):
        codes = tokenizer.encode(images)
        total_mse += F.mse_loss(tokenizer.decode(codes).clamp(-1, 1), images, reduction="sum").item()
        used[flat_codes(codes, len(images)).unique()] = True
    mse = total_mse / (n * 3 * 64 * 64)
    return {"psnr_db": 10 * math.log10(4 / mse), "codebook_usage": used.float().mean().item(), "n_images": n}


def flat_codes(codes, count: int) -> torch.Tensor:
    """A batch's codes -> [count, L]: a grid [count, h, w], or a multi-scale tokenizer's maps
    [count, pn, pn] one after the other, coarsest first (the next-scale models' token order)."""
    if isinstance(codes, (list, tuple)):
        return torch.cat([c.reshape(count, -1) for c in codes], 1)
    return codes.reshape(count, -1)


def resolve_recipe(recipes: dict, name: str, overrides: dict) -> dict:
    """The named recipe with overrides (quick trials and tests); None values are ignored."""
    if name not in recipes:
        raise VisarError(f"unknown recipe {name!r}; known: {sorted(recipes)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(overrides) - set(recipes[name]))
    if unknown:
        raise VisarError(f"unknown recipe field(s) {unknown} for {name}")
    return {**recipes[name], **overrides}


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


def fit_tokenizer(recipe_name: str, recipe: dict, out, tokenizer, vq_args: dict, forward, evaluate=None) -> Path:
    """The tokenizers' training loop (visar-tiny-vq, visar-tiny-msvq, visar-tiny-kl): Adam (0.5, 0.9) at
    the recipe's schedule on training renders (random crops when the recipe has `crop`), gradient
    clipping, dead-code restarts every `dead_code_every` steps (codebook tokenizers), checkpoints and
    resume; then the held-out metrics and the fp16 export. forward(images, gen) -> (loss,
    reconstruction, the codes used [N] or None without a codebook, the latents restarts draw from). evaluate(tokenizer,
    n) -> the held-out metrics (default `evaluate_tokenizer`); it may complete `vq_args` (the KL
    tokenizer's latent scale is measured there). All randomness is keyed to (seed, step)."""
    out = prepare_out_dir(out)
    opt = torch.optim.Adam(tokenizer.parameters(), lr=recipe["lr"], betas=(0.5, 0.9))
    codebook = recipe.get("dead_code_every") is not None
    # code counts since the last dead-code restart
    step, usage = 0, torch.zeros(tokenizer.vocab_size if codebook else 0)
    state = load_checkpoint(out / "checkpoint.pt")
    if state is not None:
        tokenizer.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, usage = state["step"], state["usage"]
    bar = tqdm(total=recipe["steps"], initial=step, desc=f"train {recipe_name}", unit="step")
    tokenizer.train()
    while step < recipe["steps"]:
        gen = step_generator(recipe["seed"], step)
        first = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        images = images_to_tensor([training_renders(recipe["seed"], first + i)[0] for i in range(recipe["batch_size"])])
        if recipe.get("crop"):
            images = random_crops(images, recipe["crop"], gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        loss, recon, codes, latents = forward(images, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tokenizer.parameters(), 1.0)
        opt.step()
        step += 1
        if codebook:
            usage += torch.bincount(codes, minlength=tokenizer.vocab_size)
            if step % recipe["dead_code_every"] == 0:
                restart_dead_codes(tokenizer, usage, latents.detach(), gen)
                usage.zero_()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}", psnr=f"{psnr(recon.detach(), images):.1f}")
        if step % recipe["checkpoint_every"] == 0 or step == recipe["steps"]:
            state = {"model": tokenizer.state_dict(), "optimizer": opt.state_dict(), "step": step, "usage": usage}
            save_checkpoint(out / "checkpoint.pt", state)
    bar.close()
    metrics = (evaluate or evaluate_tokenizer)(tokenizer, n=recipe["eval_images"])
    export = prepare_out_dir(out / "export")
    export_fp16(tokenizer, export / "tokenizer.safetensors")
    record = {"vq_args": vq_args, "recipe": {"name": recipe_name, **recipe}, "metrics": metrics}
    (export / "tokenizer.json").write_text(json.dumps(record, indent=1))
    usage_note = f", codebook usage {metrics['codebook_usage']:.1%}" if "codebook_usage" in metrics else ""
    print(f"{recipe_name}: held-out PSNR {metrics['psnr_db']:.2f} dB{usage_note}")
    return export


def random_crops(images: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """One random size x size crop per image, aligned to the tokenizer's 4-px grid."""
    cells = (images.shape[-1] - size) // 4 + 1
    offsets = torch.randint(0, cells, (images.shape[0], 2), generator=gen) * 4
    return torch.stack(
        [img[:, y : y + size, x : x + size] for img, (y, x) in zip(images, offsets.tolist(), strict=True)]
    )


@torch.no_grad()
def restart_dead_codes(tokenizer, usage: torch.Tensor, pre_quant: torch.Tensor, gen: torch.Generator):
    """Re-seed codes unused since the last restart with random encoder outputs of this batch.

    Keeps the codebook in use (LlamaGen's recipe relies on long training instead; we have minutes).
    Both tokenizers keep their codebook in `quantize.embedding`; LlamaGen's may L2-normalise it.
    """
    dead = (usage == 0).nonzero().flatten()
    if dead.numel() == 0:
        return
    vectors = pre_quant.permute(0, 2, 3, 1).reshape(-1, pre_quant.shape[1])
    if getattr(tokenizer.config, "codebook_l2_norm", False):
        vectors = F.normalize(vectors, dim=-1)
    picks = torch.randint(0, vectors.shape[0], (dead.numel(),), generator=gen)
    tokenizer.quantize.embedding.weight.data[dead] = vectors[picks] + 0.01 * torch.randn(
        dead.numel(), vectors.shape[1], generator=gen
    )


# -- AR generators ------------------------------------------------------------------------------


def caption_vocabulary() -> tuple[str, ...]:
    """Every word of every prompt the shapes world can produce."""
    from ..data.shapes import TASKS, _task_entries

    words = {w for task in TASKS for entry in _task_entries(task) for w in entry["prompt"].lower().split()}
    return (PAD, UNK, *sorted(words))


def load_tokenizer_export(path: str | os.PathLike, build=None) -> tuple[torch.nn.Module, dict]:
    """A tokenizer export folder (tokenizer.json + tokenizer.safetensors) -> (the tokenizer, its record).
    build(vq_args) makes the module; default LlamaGen's VQ (visar-tiny-vq)."""
    from ..checkpoints import load_strict, read_state_dict

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config = json.loads((folder / "tokenizer.json").read_text())
    vq = build(config["vq_args"]) if build else VQModel(VQConfig.from_dict(config["vq_args"]))
    load_strict(vq, read_state_dict(folder / "tokenizer.safetensors"), source=str(folder))
    return vq.float().eval(), config


@torch.no_grad()
def build_token_dataset(recipe: dict, vq, cache: Path, device: str | torch.device = "cpu", encode=None) -> dict:
    """Render and tokenize the recipe's dataset once; cached in OUT/dataset.npz for later runs.
    tokens [n, L]: the grid in raster order, or a multi-scale tokenizer's maps coarsest first; or
    whatever encode(images [B, 3, H, W]) -> np.ndarray [B, ...] returns (a KL tokenizer's latents)."""
    from ..data.shapes import NUM_CLASSES, render_caption_sample, render_class

    n, seed = recipe["dataset_size"], recipe["data_seed"]
    class_render = class_render_options(recipe)
    if cache.exists():
        return dict(np.load(cache, allow_pickle=False))
    chunks = []
    labels = np.zeros(n, dtype=np.int64)
    captions = []
    for start in tqdm(range(0, n, 256), desc="tokenize dataset", unit="chunk"):
        images = []
        for i in range(start, min(n, start + 256)):
            if recipe["condition"] == "class":
                labels[i] = i % NUM_CLASSES
                images.append(render_class(int(labels[i]), seed * 10_000_019 + i, **class_render).image)
            else:
                sample = render_caption_sample(seed * 10_000_019 + i, **class_render)
                captions.append(sample.caption)
                images.append(sample.image)
        batch = images_to_tensor(images).to(device)
        if encode is not None:
            chunks.append(encode(batch))
            continue
        chunks.append(flat_codes(vq.encode(batch), len(images)).cpu().numpy().astype(np.int16))
    data = {"tokens": np.concatenate(chunks), "labels": labels}
    if captions:
        data["captions"] = np.array(captions)
    np.savez(cache, **data)
    return data


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
        lambda **folder: export_ar(recipe_name, recipe, model, text_encoder, tokenizer, vq_config, out, **folder),
        ema,
        params,
    )


def start_backbone_from(model: LlamaGen, name: str):
    """Load a registered LlamaGen model's transformer into `model`, keeping `model`'s own condition
    embedding: a text-conditional recipe can start from a class-conditional model that already draws
    the shapes (every weight but `cls_embedding.*` must match in name and shape). The weights are
    read from the embedded model's folder (training code does not go through the pipeline)."""
    from ..checkpoints import read_state_dict
    from ..registry import embedded_models

    folder = embedded_models().get(name)
    if folder is None:
        raise VisarError(f"init model {name!r} is not an embedded model; known: {sorted(embedded_models())}")
    weights = json.loads((folder / "config.json").read_text())["weights"]["model"]
    source = {k: v.float() for k, v in read_state_dict(folder / weights).items()}
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


def export_ar(
    name: str,
    recipe: dict,
    model,
    text_encoder,
    tokenizer,
    vq_config: dict,
    out: Path,
    folder: str = "export",
    family: str = "llamagen",
) -> Path:
    """A self-contained model folder (config.json, weights, the tokenizer) that visar.load reads."""
    export = prepare_out_dir(out / folder)
    export_fp16(model, export / "model.safetensors")
    tokenizer = Path(tokenizer)
    shutil.copyfile(
        tokenizer if tokenizer.is_file() else tokenizer / "tokenizer.safetensors", export / "tokenizer.safetensors"
    )
    weights = {"model": "model.safetensors", "tokenizer": "tokenizer.safetensors"}
    config = {
        "name": name,
        "family": family,
        "description": "",
        "model_args": recipe["model_args"],
        "vq_args": vq_config["vq_args"],
        "defaults": recipe["defaults"],
        "weights": weights,
        "recipe": {"name": name, **{k: v for k, v in recipe.items() if k not in ("model_args", "defaults")}},
        "tokenizer_recipe": vq_config.get("recipe"),
    }
    if text_encoder is not None:
        export_fp16(text_encoder, export / "text_encoder.safetensors")
        weights["text_encoder"] = "text_encoder.safetensors"
        config["text_encoder_args"] = text_encoder.config.to_dict()
    else:
        from ..data.shapes import NUM_CLASSES, class_name

        config["class_names"] = [class_name(i) for i in range(NUM_CLASSES)]
    (export / "config.json").write_text(json.dumps(config, indent=1))
    return export


def ship(export: str | os.PathLike, name: str, description: str, weights_dir: Path | None = None) -> Path:
    """Copy an export (ar, masked, next-scale or continuous) into the package as embedded model `name`.

    The folder is self-contained, as the export is: its tokenizer.safetensors travels with it, so that
    the folder loads wherever it is copied or published (a Hub repository has no sibling folders).
    The tokenizer also goes to `weights/<tokenizer recipe>/` with its tokenizer.json: the folder that
    `visar train ... --tokenizer` and the shapes-world features read (git stores the copies once).
    """
    from ..registry import WEIGHTS_DIR, weights_file

    export, weights_dir = Path(export), weights_dir or WEIGHTS_DIR
    config = json.loads((export / "config.json").read_text())
    tokenizer_name = config["tokenizer_recipe"]["name"]
    tokenizer_dir = prepare_out_dir(weights_dir / tokenizer_name)
    shutil.copyfile(weights_file(export, config["weights"], "tokenizer"), tokenizer_dir / "tokenizer.safetensors")
    (tokenizer_dir / "tokenizer.json").write_text(
        json.dumps({"vq_args": config["vq_args"], "recipe": config["tokenizer_recipe"]}, indent=1)
    )
    target = prepare_out_dir(weights_dir / name)
    for key, file in config["weights"].items():
        shutil.copyfile(weights_file(export, config["weights"], key), target / file)
    config.update(name=name, description=description)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


# -- masked generators --------------------------------------------------------------------------


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
        lambda **folder: export_ar(
            recipe_name, recipe, model, None, tokenizer, vq_config, out, family="maskgit", **folder
        ),
        ema,
        params,
    )
