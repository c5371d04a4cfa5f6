"""Distortion of kv_keep < 1 against exact decoding (docs/SPEED.md, "KV-cache compression").

python tools/kv_keep_quality.py MODEL --quality-n 200 --methods ar,mc-sjd --kv-keep 1,0.5,0.25

`visar bench`'s rows (`visar.eval.bench.bench`, the reference AR row first) for each method at each
kv_keep: detector accuracy (class models) or the GenEval-style overall score (text models) of
quality-n images on seeds 0 .. quality-n - 1, and the Frechet distance of their tokenizer-latent
features to the AR row's (the AR row's own figure is its noise floor: a second AR set, other seeds).
"""

from __future__ import annotations

import argparse
import json

import visar
from visar.eval.bench import bench, markdown_table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--quality-n", type=int, default=200)
    parser.add_argument("--n", type=int, default=16, help="images of the speed columns")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--methods", default="ar,mc-sjd")
    parser.add_argument("--kv-keep", default="1,0.5,0.25")
    parser.add_argument("--json")
    args = parser.parse_args()
    pipe = visar.load(args.model, device="cpu")
    values = [float(v) for v in args.kv_keep.split(",")]
    runs = [(m, {"kv_keep": v}) for m in args.methods.split(",") for v in values if (m, v) != ("ar", 1.0)]
    report = bench(pipe, [], runs=runs, n=args.n, batch_size=args.batch_size, quality_n=args.quality_n, progress=False)
    print(markdown_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, default=str)


if __name__ == "__main__":
    main()
