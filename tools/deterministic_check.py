"""Whether an image's tokens depend on the batch it is decoded in on this device, with and without
`deterministic=True` (docs/GENERATE.md, "What is guaranteed"), and what the option costs.

    python3 tools/deterministic_check.py --model gpt-b --device cuda --json OUT/deterministic.json

For each setting (batched as usual; deterministic=True): N images (image i: condition i, seed i) decoded
as one running batch of --batch-size slots, again (run to run), and each alone (a batch of one), ->
how many of the batch's images differ from their decodes alone, whether the repeat gave the same
tokens, and images per second of the batched call. tools/device_check.sh runs it on a lent GPU, where
kernels are chosen by shape; on a CPU at one thread the batched images equal their decodes alone
anyway. --model: as tools/device_bench.py takes it (`default`, a name or folder, or `tiny`, `gpt-b`:
random weights).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ as a folder of scripts

from device_bench import random_folder  # noqa: E402

import visar  # noqa: E402
from visar.accel.core.timing import synchronized_clock  # noqa: E402
from visar.eval.bench import conditions, generate_batches  # noqa: E402
from visar.eval.throughput import run_queue  # noqa: E402


def check(pipe, method: str, n: int, batch_size: int, deterministic: bool) -> dict:
    conds = conditions(pipe, n)
    run = dict(deterministic=deterministic)
    run_queue(pipe, method, conds[:batch_size], batch_size, True, run)  # warm-up
    start = synchronized_clock(pipe.device)
    batched = run_queue(pipe, method, conds, batch_size, True, run)[0].tokens  # image i: condition i, seed i
    seconds = synchronized_clock(pipe.device) - start
    again = run_queue(pipe, method, conds, batch_size, True, run)[0].tokens
    alone = [out.tokens[0] for out in generate_batches(pipe, method, conds, 1, run, "tokens")]  # batches of one
    return {
        "deterministic": deterministic,
        "images": n,
        "batch_size": batch_size,
        "images_differing_from_alone": sum(not torch.equal(batched[i], alone[i]) for i in range(n)),
        "repeat_equal": bool(torch.equal(batched, again)),
        "images_per_s": n / seconds,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--method", default="mc-sjd")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        source = random_folder(args.model, Path(root)) if args.model in ("tiny", "gpt-b") else args.model
        pipe = visar.load(source, device=args.device, dtype=args.dtype)
        report = {"model": args.model, "device": str(pipe.device), "dtype": str(pipe.dtype), "method": args.method}
        report["rows"] = []
        for deterministic in (False, True):  # each row printed and written as soon as it is measured
            row = check(pipe, args.method, args.n, args.batch_size, deterministic)
            report["rows"].append(row)
            print(
                f"{args.model} {args.method} on {pipe.device}, deterministic={deterministic}: "
                f"{row['images_differing_from_alone']} of {row['images']} images differ from their decodes alone, "
                f"repeat equal {row['repeat_equal']}, {row['images_per_s']:.2f} images/s at batch {row['batch_size']}",
                flush=True,
            )
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
