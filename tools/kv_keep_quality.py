"""Distortion of kv_keep < 1 against exact decoding (docs/SPEED.md, "KV-cache compression").

python tools/kv_keep_quality.py MODEL --quality-n 200 --methods ar,mc-sjd --kv-keep 1,0.5,0.25
python tools/kv_keep_quality.py MODEL --methods ar --kv-keep 0.5,0.25 --kv-evict h2o,line   # the two rules

`visar bench`'s rows (`visar.eval.bench.bench`, the reference AR row first) for each method at each
kv_keep (below 1, under each eviction rule of --kv-evict): detector accuracy (class models) or the
GenEval-style overall score (text models) of
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
    parser.add_argument("--kv-evict", default="h2o", help="eviction rules below 1, comma-separated: h2o, line")
    parser.add_argument("--json")
    args = parser.parse_args()
    pipe = visar.load(args.model, device="cpu")
    values = [float(v) for v in args.kv_keep.split(",")]
    rules = args.kv_evict.split(",")
    settings = [{"kv_keep": v} if v == 1 else {"kv_keep": v, "kv_evict": r} for v in values for r in rules]
    settings = [s for i, s in enumerate(settings) if s not in settings[:i]]  # kv_keep 1 once: nothing is evicted
    runs = [(m, s) for m in args.methods.split(",") for s in settings if (m, s["kv_keep"]) != ("ar", 1.0)]
    report = bench(pipe, [], runs=runs, n=args.n, batch_size=args.batch_size, quality_n=args.quality_n, progress=False)
    print(markdown_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, default=str)


if __name__ == "__main__":
    main()
