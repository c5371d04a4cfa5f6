"""Latency / AR at batch 1 on a machine others share: image i (condition i, seed i, as `visar bench`
takes them) decoded by ar and by each method in turn, so that a change of load hits every method
alike, where `visar bench` times all of AR's images before any method's (docs/SPEED.md, "How
to measure").

    OMP_NUM_THREADS=1 python tools/interleaved_latency.py --methods tree-mc-sjd,sjd-pac --n 16

Prints, per method: latency / AR, forward passes per image, ms a pass and ms a pass / AR's.
"""

from __future__ import annotations

import argparse
import time

import torch

import visar


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="visar-tiny-c2i")
    parser.add_argument("--methods", default="tree-mc-sjd")
    parser.add_argument("--n", type=int, default=16, help="images (each decoded by ar and every method)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = visar.load(args.model)
    methods = ["ar", *args.methods.split(",")]
    classes = pipe.model.condition_layout.num_classes
    for method in methods:  # one untimed image each, as the bench runs one
        pipe.generate(class_labels=[0], method=method, seed=0, output_type="tokens")
    seconds, passes = dict.fromkeys(methods, 0.0), dict.fromkeys(methods, 0)
    for i in range(args.n):
        for method in methods:
            start = time.perf_counter()
            out = pipe.generate(class_labels=[i % classes], method=method, seed=i, output_type="tokens")
            seconds[method] += time.perf_counter() - start
            passes[method] += out.stats["forward_passes_per_image"][0]
    ar_pass = seconds["ar"] / passes["ar"]
    print("| method | latency / AR | passes / image | ms a pass | ms a pass / AR's |\n|---|---|---|---|---|")
    for method in methods:
        per_pass = seconds[method] / passes[method]
        row = (seconds[method] / seconds["ar"], passes[method] / args.n, 1000 * per_pass, per_pass / ar_pass)
        print(f"| {method} | {row[0]:.3f} | {row[1]:.1f} | {row[2]:.2f} | {row[3]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
