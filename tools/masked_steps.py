"""Quality against steps for every masked schedule: detector accuracy and a Frechet distance to one
token per step, on a class-conditional shapes-world masked model (docs/MASKED.md's table and plot).

    python tools/masked_steps.py --model visar-tiny-maskgit-c2i --steps 8,12,16,20,32 --n 200 \
        --n-at 16=500 --reference-n 100 --out docs/masked_steps

With --latency-n N it times instead, in one process at batch 1 on the same N classes and seeds
(`visar.eval.bench.speed_row`, after a warm-up batch): each schedule at --latency-steps, and the
raster default (--raster) with plain AR and its fastest methods (--raster-runs); writes
OUT_latency.json and OUT_latency.md (latency per image and against the raster model's AR).

Image i of every row has class i mod 40 and seed i (`visar.eval.bench.quality_images`), so rows
differ only by their schedule and step count. The reference (`maskgit` at one token per step, N
passes an image) costs N / steps times a row, hence its own, smaller image count. Writes OUT.json,
OUT.md and OUT.png (`--plot-only` redraws the PNG from OUT.json). Not run by CI.
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


COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def plot(rows: list[dict], schedules: list[str], model: str, path: Path):
    """Two panels (detector accuracy, Frechet vs one token per step) against steps, a line per schedule."""
    from PIL import Image, ImageDraw

    from visar.eval.plots import _font, nice_ticks

    image = Image.new("RGB", (1040, 470), "white")
    draw = ImageDraw.Draw(image)
    font, small = _font(16), _font(12)
    draw.text((520, 8), f"{model}: quality against steps", fill="black", font=font, anchor="ma")
    mine = [r for r in rows[1:] if r["schedule"] in schedules]
    for panel, (key, title) in enumerate(
        [("detector_accuracy", "detector accuracy"), ("frechet_vs_one_per_step", "Frechet vs 1 token / step")]
    ):
        left = 520 * panel
        box = (left + 70, 60, left + 500, 410)
        values = [r[key] for r in mine] + ([rows[0][key]] if key == "detector_accuracy" else [])
        xt, yt = nice_ticks(min(r["steps"] for r in mine), max(r["steps"] for r in mine)), nice_ticks(0, max(values))

        def at(x, y, xt=xt, yt=yt, box=box):
            return (
                box[0] + (x - xt[0]) / (xt[-1] - xt[0]) * (box[2] - box[0]),
                box[3] - (y - yt[0]) / (yt[-1] - yt[0]) * (box[3] - box[1]),
            )

        draw.text((left + 285, 36), title, fill="black", font=font, anchor="ma")
        draw.rectangle(box, outline="black")
        for x in xt:
            draw.text((at(x, yt[0])[0], box[3] + 8), f"{x:g}", fill="black", font=small, anchor="ma")
        for y in yt:
            draw.line([(box[0], at(xt[0], y)[1]), (box[2], at(xt[0], y)[1])], fill="#e6e6e6")
            draw.text((box[0] - 8, at(xt[0], y)[1]), f"{y:g}", fill="black", font=small, anchor="rm")
        draw.text((left + 285, box[3] + 28), "steps (forward passes)", fill="black", font=small, anchor="ma")
        if key == "detector_accuracy":  # the one-token-per-step reference, dashed
            _, py = at(xt[0], rows[0][key])
            for x0 in range(int(box[0]), int(box[2]), 12):
                draw.line([(x0, py), (min(x0 + 6, box[2]), py)], fill="#888888")
            draw.text((box[0] + 4, py - 3), "1 token / step", fill="#666666", font=small, anchor="ld")
        for n, schedule in enumerate(schedules):
            points = [at(r["steps"], r[key]) for r in mine if r["schedule"] == schedule]
            colour = COLOURS[n % len(COLOURS)]
            draw.line(points, fill=colour, width=2)
            for px, py in points:
                draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
            draw.text((box[2] - 6, box[1] + 6 + 16 * n), schedule, fill=colour, font=small, anchor="ra")
    image.save(path)


def parse_runs(text: str) -> list[tuple[str, dict]]:
    """Parse "ar;zipar:s=3;mc-sjd" -> [("ar", {}), ("zipar", {"s": 3}), ("mc-sjd", {})]."""
    runs = []
    for item in text.split(";"):
        method, _, opts = item.partition(":")
        runs.append((method, {k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)}))
    return runs


def latency(args, pipe):
    """Per-image latency of the masked schedules and of the raster default's methods, one run."""
    from visar.eval.bench import speed_row

    raster = visar.load(args.raster)
    labels = conditions(pipe, args.latency_n)
    plan = [(pipe, schedule, {"steps": step}) for schedule in args.schedules.split(",") for step in args.latency_steps]
    plan += [(raster, method, options) for method, options in parse_runs(args.raster_runs)]
    rows = []
    for model, method, options in plan:
        row = speed_row(model, method, options, labels, batch_size=1)
        rows.append(
            {
                "model": model.name,
                "method": method,
                "options": options,
                "forward_passes": row["forward_passes"],
                "ms_per_image": 1000 * row["latency_s"] / len(labels),
            }
        )
        print(rows[-1], flush=True)
    ar_ms = next(r["ms_per_image"] for r in rows if r["model"] == raster.name and r["method"] == "ar")
    lines = ["| model | method | forward passes | ms / image | latency / raster AR |", "|---|---|---|---|---|"]
    for r in rows:
        name = r["method"] + "".join(f", {k} {v}" for k, v in r["options"].items())
        lines.append(
            f"| {r['model']} | {name} | {r['forward_passes']:.1f} | {r['ms_per_image']:.1f} "
            f"| {r['ms_per_image'] / ar_ms:.2f} |"
        )
    out = Path(f"{args.out}_latency")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"n": args.latency_n, "batch_size": 1, "threads": torch.get_num_threads()}
    out.with_suffix(".json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="visar-tiny-maskgit-c2i")
    parser.add_argument("--steps", default="8,12,16,20,32")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--n", type=int, default=200, help="images per row")
    parser.add_argument("--n-at", action="append", default=[], help="STEPS=N: more images at one step count")
    parser.add_argument("--reference-n", type=int, default=100, help="images of the one-token-per-step reference")
    parser.add_argument("--out", default="masked_steps")
    parser.add_argument("--plot-only", action="store_true", help="redraw OUT.png from OUT.json")
    parser.add_argument("--latency-n", type=int, help="time N images per row at batch 1 instead (see above)")
    parser.add_argument("--latency-steps", type=lambda t: [int(x) for x in t.split(",")], default=[16])
    parser.add_argument("--raster", default="visar-tiny-c2i", help="the raster model timed beside (default)")
    parser.add_argument("--raster-runs", default="ar;zipar:s=3;mc-sjd", help="its methods, ';'-separated")
    args = parser.parse_args()
    if args.latency_n:
        latency(args, visar.load(args.model))
        return
    if args.plot_only:
        report = json.loads(Path(args.out).with_suffix(".json").read_text())
        plot(report["rows"], args.schedules.split(","), report["model"], Path(args.out).with_suffix(".png"))
        return
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
    plot(rows, args.schedules.split(","), pipe.name, out.with_suffix(".png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
