"""Try variants of an AR recipe side by side on one GPU and score each with the shapes detector.

This is how the c2i recipe's settings were chosen (docs/MODELS.md): each variant is the recipe
with a few fields changed, trained by `visar.train.raster.train_ar` (same seeds, same batches),
then sampled with plain AR at several guidance scales and scored by `visar eval shapes`'s code.
Variants at the same render settings share one tokenized dataset. A variant's compute on a CPU
is what matters for the 60-minute recipe limit, so every variant states its multiple of the
recipe's training FLOPs (`cost`), measured separately on the CPU.

    python tools/recipe_sweep.py --out runs/sweep --device cuda --n 200 --cfgs 2,3,4,6

Writes OUT/results.json (one row per variant and guidance scale) and prints a table. Each
variant runs in its own process (CUDA does not survive fork); a finished variant is skipped
when the sweep is started again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

BASE = "visar-tiny-c2i-causal"  # the sweep predates zipar-aware training
WEIGHTS = Path(__file__).resolve().parents[1] / "visar" / "weights"

# name -> recipe overrides. "render" replaces the recipe's render settings; "model_args" is merged.
EASY28 = {"min_size": 28, "background_amplitude": [2.0, 6.0]}  # one 28-px object on a calm background

VARIANTS = {
    # Round 1: the 4,400-step recipe with lr, render and shape changes, and 2x steps as a yardstick.
    "lr2e-3": {"lr": 2e-3},
    "lr3e-3": {"lr": 3e-3},
    "lr5e-3": {"lr": 5e-3},
    "lr3e-3-size28": {"lr": 3e-3, "render": {"min_size": 28, "background_amplitude": [6.0, 14.0]}},
    "lr3e-3-bg2-6": {"lr": 3e-3, "render": {"min_size": 20, "background_amplitude": [2.0, 6.0]}},
    "lr3e-3-size28-bg2-6": {"lr": 3e-3, "render": EASY28},
    "lr5e-3-size28-bg2-6": {"lr": 5e-3, "render": EASY28},
    "lr3e-3-size24-bg3-8": {"lr": 3e-3, "render": {"min_size": 24, "background_amplitude": [3.0, 8.0]}},
    "lr3e-3-b32-s2200": {"lr": 3e-3, "batch_size": 32, "steps": 2200},
    "lr3e-3-s8800": {"lr": 3e-3, "steps": 8800},
    "lr3e-3-size28-bg2-6-s8800": {"lr": 3e-3, "steps": 8800, "render": EASY28},
    "lr3e-3-d192l3-s2600": {"lr": 3e-3, "steps": 2600, "model_args": {"dim": 192, "n_layer": 3, "n_head": 6}},
    # Round 2: smaller models for more steps at the same CPU time (~3,000 s of training on 2 threads:
    # measured 0.73 / 0.55 / 0.49 / 0.37 / 0.23 s per step for d128l4 / d128l3 / d96l4 / d96l3 / d64l3).
    "size28-bg2-6-d64l3-s13000": {
        "lr": 3e-3,
        "steps": 13000,
        "render": EASY28,
        "model_args": {"dim": 64, "n_layer": 3, "n_head": 2},
    },
    "size28-bg2-6-d96l3-s8000": {
        "lr": 3e-3,
        "steps": 8000,
        "render": EASY28,
        "model_args": {"dim": 96, "n_layer": 3, "n_head": 3},
    },
    "size28-bg2-6-d96l4-s6000": {
        "lr": 3e-3,
        "steps": 6000,
        "render": EASY28,
        "model_args": {"dim": 96, "n_layer": 4, "n_head": 3},
    },
    "size28-bg2-6-d128l3-s5400": {
        "lr": 3e-3,
        "steps": 5400,
        "render": EASY28,
        "model_args": {"dim": 128, "n_layer": 3, "n_head": 4},
    },
    "size28-bg2-6-d64l3-s4400": {  # the draft recipe on this render
        "lr": 3e-3,
        "steps": 4400,
        "render": EASY28,
        "model_args": {"dim": 64, "n_layer": 3, "n_head": 2},
    },
}


def resolved_overrides(name: str) -> dict:
    from visar.train.recipes import AR_RECIPES

    overrides = dict(VARIANTS[name])
    if "model_args" in overrides:
        overrides["model_args"] = {**AR_RECIPES[BASE]["model_args"], **overrides["model_args"]}
    return overrides


def render_key(name: str) -> str:
    from visar.train.recipes import AR_RECIPES

    render = VARIANTS[name].get("render", AR_RECIPES[BASE]["render"])
    return f"size{render['min_size']}-bg{render['background_amplitude'][0]:g}-{render['background_amplitude'][1]:g}"


def run_one(
    name: str,
    out: Path,
    device: str,
    n: int,
    cfgs: list[float],
    dataset_only: bool,
    steps: int | None,
    rows_file: str | None,
):
    import torch

    import visar
    from visar.eval.shapes_eval import evaluate_shapes
    from visar.train.raster import train_ar

    torch.set_num_threads(1)
    folder = out / (f"data-{render_key(name)}" if dataset_only else name)
    shared = out / f"data-{render_key(name)}" / "dataset.npz"
    if not dataset_only and shared.exists() and not (folder / "dataset.npz").exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared, folder / "dataset.npz")
    overrides = resolved_overrides(name)
    if steps is not None:
        overrides["steps"] = steps
    if dataset_only:
        overrides["steps"] = 0  # build and cache the dataset, train nothing
    start = time.perf_counter()
    export = train_ar(BASE, folder, WEIGHTS / "visar-tiny-vq", device=device, **overrides)
    train_s = time.perf_counter() - start
    if dataset_only:
        return
    pipe = visar.load(str(export), device=device)
    rows = []
    for cfg in cfgs:
        record = evaluate_shapes(pipe, n=n, batch_size=n, guidance_scale=cfg, progress=False)
        rows.append({"variant": name, "cfg": cfg, "accuracy": record["accuracy"], "n": n, "train_s": train_s})
        print(f"{name} cfg {cfg:g}: {record['accuracy']:.1%}", flush=True)
        if rows_file:  # appended as each variant ends, so a sweep cut short keeps what finished
            with open(rows_file, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    (folder / "result.json").write_text(json.dumps(rows, indent=1))


def launch(args, names: list[str], dataset_only: bool):
    procs = []
    for name in names:
        cmd = [sys.executable, __file__, "--one", name, "--out", str(args.out), "--device", args.device]
        cmd += ["--n", str(args.n), "--cfgs", ",".join(map(str, args.cfgs))]
        if dataset_only:
            cmd.append("--dataset-only")
        if args.steps is not None:
            cmd += ["--steps", str(args.steps)]
        if args.rows_file:
            cmd += ["--rows-file", args.rows_file]
        log = open(args.out / f"{'data-' if dataset_only else ''}{name}.log", "w")
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
    for name, proc in procs:
        if proc.wait() != 0:
            print(f"{name} failed; see {args.out / (name + '.log')}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=200, help="images per variant and guidance scale")
    parser.add_argument("--cfgs", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 3.0, 4.0, 6.0])
    parser.add_argument("--only", help="comma-separated variant names (default: all)")
    parser.add_argument("--steps", type=int, help="override every variant's step count (smoke tests)")
    parser.add_argument("--rows-file", help="also append each finished row to this JSON-lines file")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--dataset-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return run_one(
            args.one, args.out, args.device, args.n, args.cfgs, args.dataset_only, args.steps, args.rows_file
        )
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    todo = [n for n in names if not (args.out / n / "result.json").exists()]
    first_of_render = {}
    for name in todo:
        first_of_render.setdefault(render_key(name), name)
    launch(args, list(first_of_render.values()), dataset_only=True)
    launch(args, todo, dataset_only=False)
    rows = []
    for name in names:
        path = args.out / name / "result.json"
        if path.exists():
            rows += json.loads(path.read_text())
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(f"{row['variant']:32s} cfg {row['cfg']:<4g} {row['accuracy']:6.1%}  (train {row['train_s']:.0f} s)")


if __name__ == "__main__":
    main()
