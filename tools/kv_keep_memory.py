"""Peak decode memory of plain AR against kv_keep < 1 (docs/SPEED.md, "KV-cache compression").

python tools/kv_keep_memory.py FOLDER --batch-size 64 --steps 4 --kv-keep 1,0.5,0.25

Runs the first `steps` AR passes (prefill included) of a batch under `visar.eval.memory.PeakMemory`
(CPU: the tensors the decode creates; CUDA: the allocator's peak above the weights). The caches are
preallocated whole when the decode opens them, so a few passes reach the decode's peak; the full
decode only adds passes of the same shapes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import visar
from visar.accel import Request
from visar.accel.raster.methods.ar import sample_tokens
from visar.eval.memory import PeakMemory


class Steps:
    """A probe budget that lets `ar.sample_tokens` run `count` steps."""

    def __init__(self, count: int):
        self.left = count

    def tick(self) -> bool:  # as `StepTimer.tick`: another step?
        self.left -= 1
        return self.left >= 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kv-keep", default="1,0.5,0.25")
    parser.add_argument("--device")
    args = parser.parse_args()
    pipe = visar.load(args.model, device=args.device)
    params = pipe.sampling_params(None, None, None, None)
    labels = torch.arange(args.batch_size) % pipe.num_classes
    cond, cond_mask = pipe.condition(labels.tolist(), None, None, None)
    rows = []
    for kv_keep in (float(v) for v in args.kv_keep.split(",")):
        generators = [torch.Generator().manual_seed(i) for i in range(args.batch_size)]
        request = Request(pipe.model, cond, params, generators, cond_mask, kv_keep=kv_keep)
        start = time.perf_counter()
        with torch.no_grad(), PeakMemory(pipe.device) as memory:
            sample_tokens(request, Steps(args.steps))
        rows.append({"kv_keep": kv_keep, "peak_mb": memory.peak_mb, "s": time.perf_counter() - start})
        rows[-1]["vs_ar"] = rows[-1]["peak_mb"] / rows[0]["peak_mb"]
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
