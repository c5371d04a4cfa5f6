"""What a pass costs: the model's call against the rest of the pass, per method (docs/SPEED.md,
"What a pass costs: the floor").

python tools/pass_split.py --model visar-tiny-c2i --methods mc-sjd,sjd,tree-mc-sjd,auto --n 16

Generates `visar bench`'s images (image i: condition i, seed i, batch 1, one warm-up image per
method first) and times every call of the generator's forward inside the decode. Per method: the
passes an image takes, ms a pass in the model's call and in the rest (the engine's bookkeeping:
plan, proposal, the target laws, verification, commit), latency / AR, and the floor: the latency
/ AR the method would have were its bookkeeping free (passes x the model's ms a pass, over AR's
whole decode). A target below a method's floor is out of reach of bookkeeping cuts on this device.
--compile times the compiled model in its steady state: the same images run once untimed first,
so that every pass shape they meet is compiled before the timed run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import visar
from visar.eval.bench import conditions, generate_batches


class ModelTimer:
    """Wraps the generator's forward (eager or `Pipeline.compile`d): its calls and their seconds."""

    def __init__(self, model):
        self.inner, self.cuda = model.forward, model.device.type == "cuda"
        self.calls, self.seconds = 0, 0.0
        model.forward = self

    def __call__(self, *args, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.inner(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        self.calls += 1
        self.seconds += time.perf_counter() - start
        return out


def split(pipe, timer: ModelTimer, method: str, conds: list, compiled: bool) -> dict:
    if compiled:  # every shape the timed images meet, compiled before them
        generate_batches(pipe, method, conds, 1, {}, "tokens")
    else:  # auto's AR-step probe, first-call allocations
        generate_batches(pipe, method, conds[:1], 1, {}, "tokens", seed=10**6)
    timer.calls, timer.seconds = 0, 0.0
    start = time.perf_counter()
    outs = generate_batches(pipe, method, conds, 1, {}, "tokens")
    total = time.perf_counter() - start
    passes = sum(o.stats["forward_passes"] for o in outs)
    return {
        "method": method,
        "passes_per_image": passes / len(conds),
        "ms_per_image": total / len(conds) * 1e3,
        "model_ms_per_pass": timer.seconds / timer.calls * 1e3,
        "rest_ms_per_pass": (total - timer.seconds) / passes * 1e3,
        "ran": sorted({o.stats.get("auto", method) for o in outs}),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="visar-tiny-c2i")
    parser.add_argument("--methods", default="mc-sjd,sjd,tree-mc-sjd,auto")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="time the compiled model (Pipeline.compile())")
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    pipe = visar.load(args.model)
    if args.compile:
        pipe.compile()
    timer = ModelTimer(pipe.model)
    conds = conditions(pipe, args.n)
    rows = [split(pipe, timer, method, conds, args.compile) for method in ["ar", *args.methods.split(",")]]
    ar_ms = rows[0]["ms_per_image"]
    print("| method | passes / image | model ms / pass | rest ms / pass | latency / AR | floor: model only / AR |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        row["latency_over_ar"] = row["ms_per_image"] / ar_ms
        row["floor_over_ar"] = row["passes_per_image"] * row["model_ms_per_pass"] / ar_ms
        name = row["method"] if row["ran"] == [row["method"]] else f"{row['method']} ({', '.join(row['ran'])})"
        columns = ["passes_per_image", "model_ms_per_pass", "rest_ms_per_pass", "latency_over_ar", "floor_over_ar"]
        print(f"| {name} | " + " | ".join(f"{row[c]:.{1 if c == 'passes_per_image' else 2}f}" for c in columns) + " |")
    if args.json:
        with open(args.json, "w") as f:
            run = {"model": args.model, "n": args.n, "compiled": args.compile, "threads": torch.get_num_threads()}
            json.dump({**run, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
