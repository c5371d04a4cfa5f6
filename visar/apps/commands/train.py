"""`visar train tokenizer | ar | masked | next-scale | continuous | ship`: the command line of visar.train
(its recipes: visar/train/recipes.py), and `ship`, which copies an export into the package's weights."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from ...errors import VisarError


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "train",
        help="train an embedded model by its recipe (resumable)",
        description="Train visar's embedded models on the offline shapes world by their fixed recipes. A run "
        "checkpoints to OUT/checkpoint.pt and resumes from it when started again with the same --out; the "
        "result is exported as fp16 safetensors in OUT/export/. Recipes: tokenizer: visar-tiny-vq "
        "(LlamaGen's VQ), visar-tiny-msvq (VAR's multi-scale VQVAE), visar-tiny-kl (MAR's KL VAE); ar: "
        "visar-tiny-c2i (the default, with ZipAR-aware training), visar-tiny-c2i-causal (the same without it), "
        "visar-tiny-c2i-draft, visar-tiny-t2i; masked: visar-tiny-maskgit-c2i (a MaskGIT-style masked model); "
        "next-scale: visar-tiny-var-c2i (VAR, CoDe's drafter), visar-tiny-var-c2i-refiner (CoDe's refiner), "
        "visar-tiny-var-c2i-refiner-s6 (the refiner fine-tuned on scales 6-8), on a visar-tiny-msvq tokenizer; "
        "continuous: visar-tiny-mar-c2i (MAR, cspd's target), visar-tiny-mar-c2i-draft (its draft), on a "
        "visar-tiny-kl tokenizer. `ship` copies an ar, masked, next-scale or continuous export into "
        "visar/weights/ as a self-contained folder (its tokenizer with it, and again in the folder named after the "
        "tokenizer's recipe, which --tokenizer reads).",
    )
    parser.add_argument(
        "what",
        choices=["tokenizer", "ar", "masked", "next-scale", "continuous", "ship"],
        help="tokenizer, ar, masked, next-scale or continuous: train by recipe; ship: copy such an export into the "
        "package",
    )
    parser.add_argument(
        "--recipe",
        help="recipe name (default visar-tiny-vq / visar-tiny-c2i / visar-tiny-maskgit-c2i / visar-tiny-var-c2i / "
        "visar-tiny-mar-c2i)",
    )
    parser.add_argument("--out", help="run folder (checkpoints, dataset cache, export/)")
    parser.add_argument(
        "--tokenizer",
        help="for ar, masked, next-scale and continuous: the tokenizer export folder (OUT/export of a tokenizer run, "
        "or the shipped visar/weights/visar-tiny-vq; visar-tiny-msvq for next-scale, visar-tiny-kl for continuous)",
    )
    parser.add_argument("--steps", type=int, help="override the recipe's step count (for quick trials)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="for the generators: where the arithmetic runs (cpu, cuda, cuda:1; default cpu)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="for the generators: torch.compile the training step (faster on a CPU; needs a C++ compiler); "
        "default --no-compile",
    )
    parser.add_argument("--export", help="for ship: the export/ folder of an ar, masked, next-scale or continuous run")
    parser.add_argument("--name", help="for ship: the registered name (e.g. visar-tiny-c2i)")
    parser.add_argument("--description", help="for ship: the one-line description shown by `visar models`")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ...train import continuous, masked, next_scale, raster, recipes

    if args.what == "ship":
        if not (args.export and args.name):
            raise VisarError("visar train ship needs --export (an AR run's export/ folder) and --name")
        target = ship(args.export, args.name, args.description or "")
        print(f"shipped {args.name} to {target}")
        return 0
    if not args.out:
        raise VisarError(f"visar train {args.what} needs --out (the run folder)")
    if args.what == "tokenizer":
        recipe = args.recipe or "visar-tiny-vq"
        train_fn = raster.train_tokenizer
        if recipe in recipes.MSVQ_RECIPES:
            train_fn = next_scale.train_msvq
        elif recipe in recipes.KL_RECIPES:
            train_fn = continuous.train_kl
        export = train_fn(recipe, args.out, steps=args.steps)
    else:
        if not args.tokenizer:
            raise VisarError(
                f"visar train {args.what} needs --tokenizer (a folder made by `visar train tokenizer`, its export/)"
            )
        train_fn, default = (raster.train_ar, "visar-tiny-c2i")
        if args.what == "masked":
            train_fn, default = (masked.train_masked, "visar-tiny-maskgit-c2i")
        elif args.what == "next-scale":
            train_fn, default = (next_scale.train_next_scale, "visar-tiny-var-c2i")
        elif args.what == "continuous":
            train_fn, default = (continuous.train_continuous, "visar-tiny-mar-c2i")
        export = train_fn(
            args.recipe or default,
            args.out,
            args.tokenizer,
            device=args.device,
            compile=args.compile,
            steps=args.steps,
        )
    print(f"exported to {export}")
    return 0


def ship(export: str | os.PathLike, name: str, description: str, weights_dir: Path | None = None) -> Path:
    """Copy an export (ar, masked, next-scale or continuous) into the package as embedded model `name`.

    The folder is self-contained, as the export is: its tokenizer.safetensors travels with it, so that
    the folder loads wherever it is copied or published (a Hub repository has no sibling folders).
    The tokenizer also goes to `weights/<tokenizer recipe>/` with its tokenizer.json: the folder that
    `visar train ... --tokenizer` and the shapes-world features read (git stores the copies once).
    Copying into the package is an app's step, not training's: the trainers write their exports anywhere.
    """
    from ...registry import WEIGHTS_DIR, weights_file
    from ...train.loop import prepare_out_dir

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
