"""Where a pass's aten ops come from: each op dispatched in a decode, charged to the visar function
that dispatched it (docs/SPEED.md, "Where the ops of a pass come from").

python tools/op_sites.py --model visar-tiny-c2i --methods mc-sjd,tree-mc-sjd --n 4

`visar bench`'s ops column says how many ops a pass dispatches; this says which code does. Per
method (the bench's images: image i is condition i, seed i; batch 1; one untimed image first),
every aten op (views included, as the bench counts them) is charged to the innermost frame of the
call stack that lies in visar/accel (or visar/pipeline), named file:function, and ops dispatched
inside the model (visar/models: its forward, and its KV cache's set-up and truncation) to "the
model". Divided by the forward passes, a site's count is what it adds to every pass: on a GPU
each is a kernel launch or a dispatch unless the pass is captured whole.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

import visar
from visar.eval.bench import conditions, generate_batches

MODEL = "the model"  # its forward and its KV cache's upkeep (visar/models)
# The package's own folder, so that a site is named from inside it ("accel/raster/chain.py:commit") wherever
# the checkout lies, a folder that is itself called visar (what `git clone` makes) included.
PACKAGE = os.path.dirname(os.path.abspath(visar.__file__))


class OpSites(TorchDispatchMode):
    """Counts every aten op by the visar function that dispatched it."""

    def __init__(self):
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sites[site(sys._getframe(1))] += 1
        return func(*args, **(kwargs or {}))


def site(frame, package: str = PACKAGE) -> str:
    """The innermost frame's site in the package at `package`: the model, file:function, or elsewhere."""
    root = package.replace("\\", "/").rstrip("/") + "/"
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        inner = path[len(root) :] if path.startswith(root) else None
        if inner is not None and inner.startswith("models/"):
            return MODEL
        if inner is not None and (inner.startswith(("accel/", "pipeline/"))):
            return f"{inner}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"


def count_sites(pipe, method: str, conds: list) -> dict:
    generate_batches(pipe, method, conds[:1], 1, {}, "tokens", seed=10**6)  # pass costs, first-call allocations
    with OpSites() as counter:
        outs = generate_batches(pipe, method, conds, 1, {}, "tokens")
    passes = sum(o.stats["forward_passes"] for o in outs)
    per_pass = {name: count / passes for name, count in counter.sites.most_common()}
    return {"method": method, "passes": passes, "ops_per_pass": sum(per_pass.values()), "sites": per_pass}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="visar-tiny-c2i")
    parser.add_argument("--methods", default="ar,mc-sjd,tree-mc-sjd")
    parser.add_argument("--n", type=int, default=4, help="images per method")
    parser.add_argument("--top", type=int, default=12, help="sites listed per method")
    parser.add_argument("--json", help="write every site of every method as JSON")
    args = parser.parse_args()
    pipe = visar.load(args.model)
    conds = conditions(pipe, args.n)
    rows = [count_sites(pipe, method, conds) for method in args.methods.split(",")]
    for row in rows:
        model = row["sites"].get(MODEL, 0.0)
        print(f"\n{row['method']}: {row['ops_per_pass']:.1f} ops a pass, {model:.1f} in the model\n")
        print("| site | ops / pass |\n|---|---|")
        for name, count in [(n, c) for n, c in row["sites"].items() if n != MODEL][: args.top]:
            print(f"| {name} | {count:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "n": args.n, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
