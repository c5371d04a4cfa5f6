"""Quality against steps for every masked schedule: detector accuracy and a Frechet distance to one
token per step, on a class-conditional shapes-world masked model (docs/MASKED.md's table and plot).

    python tools/masked_steps.py --model visar-tiny-maskgit-c2i --steps 8,12,16,20,32 --n 200 \
        --n-at 16=500 --reference-n 100 --out docs/masked_steps

Image i of every row has class i mod 40 and seed i (`visar.eval.bench.quality_images`), so rows
differ only by their schedule and step count. The reference (`maskgit` at one token per step, N
passes an image) costs N / steps times a row, hence its own, smaller image count. Writes OUT.json,
OUT.md and OUT.png. Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import visar
from visar.eval.bench import conditions, frechet_distance, latent_features, quality_images
from visar.eval.detector import detect, score_class

SCHEDULES = ("maskgit", "halton", "lpd-order", "lpd-confidence")


def detector_accuracy(images: torch.Tensor, labels: list[int]) -> float:
    arrays = (images * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    return float(np.mean([score_class(detect(a), c) for a, c in zip(arrays, labels, strict=True)]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="visar-tiny-maskgit-c2i")
    parser.add_argument("--steps", default="8,12,16,20,32")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--n", type=int, default=200, help="images per row")
    parser.add_argument("--n-at", action="append", default=[], help="STEPS=N: more images at one step count")
    parser.add_argument("--reference-n", type=int, default=100, help="images of the one-token-per-step reference")
    parser.add_argument("--out", default="masked_steps")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    pipe = visar.load(args.model)
    steps = [int(s) for s in args.steps.split(",")]
    count_at = {int(k): int(v) for k, v in (text.split("=") for text in args.n_at)}
    reference_n = args.reference_n
    labels = conditions(pipe, max([args.n, reference_n, *count_at.values()]))
    start = time.perf_counter()
    reference = quality_images(pipe, "maskgit", labels[:reference_n], {"steps": pipe.model.num_image_tokens})
    reference_feats = latent_features(pipe, reference)
    rows = [
        {
            "schedule": "maskgit",
            "steps": pipe.model.num_image_tokens,
            "images": reference_n,
            "detector_accuracy": detector_accuracy(reference, labels[:reference_n]),
            "frechet_vs_one_per_step": 0.0,
            "seconds": time.perf_counter() - start,
        }
    ]
    print(rows[-1], flush=True)
    for schedule in args.schedules.split(","):
        for step in steps:
            n = count_at.get(step, args.n)
            start = time.perf_counter()
            images = quality_images(pipe, schedule, labels[:n], {"steps": step})
            rows.append(
                {
                    "schedule": schedule,
                    "steps": step,
                    "images": n,
                    "detector_accuracy": detector_accuracy(images, labels[:n]),
                    "frechet_vs_one_per_step": frechet_distance(latent_features(pipe, images), reference_feats),
                    "seconds": time.perf_counter() - start,
                }
            )
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"model": pipe.name, "rows": rows}, indent=1))
    lines = ["| schedule | steps | images | detector acc. | Frechet vs 1 token/step |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['schedule']} | {r['steps']} | {r['images']} | {r['detector_accuracy']:.1%} "
        f"| {r['frechet_vs_one_per_step']:.3f} |"
        for r in rows
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for schedule in args.schedules.split(","):
        mine = [r for r in rows[1:] if r["schedule"] == schedule]
        xs = [r["steps"] for r in mine]
        axes[0].plot(xs, [r["detector_accuracy"] for r in mine], marker="o", label=schedule)
        axes[1].plot(xs, [r["frechet_vs_one_per_step"] for r in mine], marker="o", label=schedule)
    axes[0].axhline(rows[0]["detector_accuracy"], color="grey", linestyle="--", label="1 token / step")
    axes[0].set(xlabel="steps (forward passes)", ylabel="detector accuracy")
    axes[1].set(xlabel="steps (forward passes)", ylabel="Frechet vs 1 token / step (latent features)")
    axes[0].legend()
    fig.suptitle(f"{pipe.name}: quality against steps")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
