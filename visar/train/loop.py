"""What every trainer shares: the run folder, checkpoints and resume, the two training loops
(generators', tokenizers'), training renders and token datasets, and the fp16 exports.

Every run writes OUT/checkpoint.pt every `checkpoint_every` steps (atomically: a killed run never
leaves a half-written file) and resumes from it when started again with the same OUT. Batches are
drawn from a generator keyed to (seed, step), so a resumed run sees the same data as an
uninterrupted one. At the end the model is exported as fp16 safetensors in OUT/export/.
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

from ..checkpoints import read_state_dict
from ..data.shapes import class_render_options
from ..errors import VisarError
from ..registry import embedded_models, read_config, weights_file
from ..tokenizers.vq import VQConfig, VQModel

# -- the run folder and the generators' loop ----------------------------------------------------


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


# -- the tokenizers' loop -----------------------------------------------------------------------


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


# -- token datasets and the generators' export ---------------------------------------------------


def shipped_model_weights(name: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the float32 model weights of an embedded model (by name) or a model folder (by
    path): what a recipe's `init` or `distill_from` starts from. Read from the folder itself: training
    code builds its own modules and does not go through the pipeline."""
    folder = embedded_models().get(str(name), Path(name))
    if not (folder / "config.json").is_file():
        raise VisarError(
            f"{str(name)!r} is neither an embedded model ({', '.join(embedded_models())}) nor a folder with config.json"
        )
    config = read_config(folder)
    path = weights_file(folder, config.get("weights", {}), "model")
    return config, {key: value.float() for key, value in read_state_dict(path).items()}


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


def export_generator(
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
