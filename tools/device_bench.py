"""The bench part of tools/device_check.sh: `visar bench` cells (model x mode x batch) on one model,
each cell's rows appended to a JSONL file as soon as it is done, so a run cut off by its deadline
keeps what it measured.

    python3 tools/device_bench.py --model gpt-b --device cuda --batches 1,8,32 \
        --modes eager,default,reduce-overhead --methods sjd,mc-sjd --rows OUT/rows.jsonl --deadline EPOCH_S

--model: `default` (the embedded visar-tiny-c2i), a registered name or folder, or `gpt-b`, `gpt-xl`,
`tiny`: a folder of random weights (docs/SPEED.md's recipe: LlamaGen's GPT-B / GPT-XL c2i 256
arguments, `init.random_seed` 0, cfg 4; `tiny` a 4 x 4-token model of 0.04 M parameters for
--dry-run). Modes: eager, then `default` (torch.compile's default mode) and `reduce-overhead`
(CUDA graphs on a GPU); the generator is compiled in place and restored to eager between modes. A cell is started only
before the deadline (seconds since the epoch).

    python3 tools/device_bench.py --report OUT_DIR

writes OUT_DIR/device_check.json and OUT_DIR/device_check.md from OUT_DIR/rows.jsonl (the bench
cells) and OUT_DIR/suite.jsonl (the test runs, one line each, written by device_check.sh).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from pathlib import Path

import torch

import visar
from visar.errors import VisarError
from visar.eval.bench import bench, row_name
from visar.eval.throughput import method_size
from visar.models.llamagen import preset_config

TINY_ARGS = dict(dim=32, n_layer=2, n_head=2, multiple_of=32, vocab_size=256, num_classes=10, block_size=16)


def random_folder(size: str, root: Path) -> Path:
    """A model folder of seeded random weights: {"family": "llamagen", "model_args", "init"} (docs/SPEED.md)."""
    if size == "tiny":
        args = TINY_ARGS
    else:
        args = preset_config({"gpt-b": "GPT-B", "gpt-l": "GPT-L", "gpt-xl": "GPT-XL"}[size]).to_dict()
    folder = root / f"random-{size}"
    folder.mkdir(parents=True, exist_ok=True)
    config = {"family": "llamagen", "model_args": args, "init": {"random_seed": 0}, "defaults": {"guidance_scale": 4.0}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class CudaGraphNotes(logging.Handler):
    """Collects inductor's messages about CUDA graphs (e.g. 'skipping cudagraphs due to mutated inputs')."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "cudagraph" in message.lower():
            self.messages.append(message[:300])


def set_mode(pipe, mode: str, backend: str | None):
    """Restore the eager generator, then compile it for `mode` (eager: nothing to compile)."""
    if "forward" in pipe.model.__dict__:
        del pipe.model.forward
    torch._dynamo.reset()
    if mode != "eager":
        kwargs = {} if mode == "default" else {"mode": mode}
        if backend:
            kwargs["backend"] = backend
        pipe.compile(**kwargs)


def cell_rows(report: dict, model: str, params_m: float, mode: str, batch: int, notes: list[str], fell_back: bool):
    rows = {row_name(r): r for r in report["rows"]}
    ar = rows["ar"]
    out = []
    for name, r in rows.items():
        out.append(
            {
                "model": model,
                "parameters_m": params_m,
                "mode": mode,
                "batch": batch,
                "method": name,
                "forward_passes": r["forward_passes"],
                "ms_per_pass": r["ms_per_forward"],
                "pass_over_ar_pass": r["ms_per_forward"] / ar["ms_per_forward"],
                "latency_over_ar": r["latency_ratio_vs_ar"],
                "images_per_s": r["images_per_s"],
                "peak_mem_mb": r["peak_mem_mb"],
                "read_backs_per_pass": r["read_backs_per_pass"],
                "read_backs_by_kind": r["read_backs_by_kind"],
                "warmup_s": r["warmup_s"],
                "compile_fell_back_to_eager": fell_back,
                "cudagraph_notes": sorted(set(notes))[:5],
            }
        )
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def write_report(out_dir: Path, meta: dict) -> dict:
    """device_check.json (everything) and device_check.md (the tables) in out_dir."""
    suite, rows = read_jsonl(out_dir / "suite.jsonl"), read_jsonl(out_dir / "rows.jsonl")
    report = {**meta, "suite": suite, "bench": rows}
    (out_dir / "device_check.json").write_text(json.dumps(report, indent=1))
    lines = [f"# visar device check: {meta.get('device_name', '?')}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "device_name"]
    lines += ["", "## Tests", "", "| run | exit code | summary | s |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['rc']} | {t['summary']} | {t['seconds']} |" for t in suite]
    lines += [
        "",
        "## Bench (`visar bench`, one timed batch of `batch` images after a warm-up batch)",
        "",
        "pass / AR pass: the method's ms per forward pass over AR's in the same cell (a Jacobi window pass "
        "against a one-token pass); latency / AR: token-sampling time against AR's in the same cell (same mode); "
        "read-backs / pass: counted in an extra eager batch.",
        "",
        "| model | M params | mode | batch | method | passes | ms / pass | pass / AR pass | latency / AR "
        "| peak MB | read-backs / pass | warm-up s | notes |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        if "method" not in r:
            why = r.get("skipped") or r.get("error")
            lines.append(f"| {r['model']} | | {r['mode']} | {r['batch']} | | | | | | | | | {why} |")
            continue
        notes = []
        if r["compile_fell_back_to_eager"]:
            notes.append("compile fell back to eager")
        notes += r["cudagraph_notes"]
        lines.append(
            f"| {r['model']} | {r['parameters_m']:.2f} | {r['mode']} | {r['batch']} | {r['method']} "
            f"| {r['forward_passes']:.1f} | {r['ms_per_pass']:.2f} | {r['pass_over_ar_pass']:.2f} "
            f"| {r['latency_over_ar']:.2f} | {fmt(r['peak_mem_mb'], '.0f')} | {r['read_backs_per_pass']:.2f} "
            f"| {r['warmup_s']:.1f} | {'; '.join(notes)} |"
        )
    (out_dir / "device_check.md").write_text("\n".join(lines) + "\n")
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", metavar="OUT_DIR", help="write the report of OUT_DIR's rows and suite runs")
    parser.add_argument("--meta", default="{}", help="JSON object of run facts for the report (device, torch ...)")
    parser.add_argument("--model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--modes", default="eager,default,reduce-overhead")
    parser.add_argument(
        "--methods",
        default="sjd,mc-sjd",
        help="comma-separated; METHOD:N runs it at a fixed budget of N rows per pass (e.g. mc-sjd:8)",
    )
    parser.add_argument("--rows", help="JSONL file the rows are appended to")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="start no cell after this (epoch s)")
    parser.add_argument("--compile-backend", help="torch.compile backend (the dry run: eager, no C++ compiler)")
    args = parser.parse_args()
    if args.report:
        write_report(Path(args.report), json.loads(args.meta))
        return
    if not args.model or not args.rows:
        parser.error("--model and --rows are required (or --report OUT_DIR)")

    with tempfile.TemporaryDirectory() as root:
        name = args.model
        source = random_folder(name, Path(root)) if name in ("tiny", "gpt-b", "gpt-l", "gpt-xl") else name
        start = time.time()
        pipe = visar.load(source, device=args.device, dtype=args.dtype)
        print(f"{name}: loaded in {time.time() - start:.1f} s", flush=True)
    params_m = sum(p.numel() for p in pipe.model.parameters()) / 1e6
    notes = CudaGraphNotes()
    logging.getLogger("torch").addHandler(notes)
    # "mc-sjd:8" runs mc-sjd at budget=8, beside "mc-sjd" at its own window
    runs = [method_size(m) for m in args.methods.split(",") if m]
    rows_file = Path(args.rows)
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        set_mode(pipe, mode, args.compile_backend)
        for batch in [int(b) for b in args.batches.split(",")]:
            if time.time() > args.deadline:
                print(f"{name} {mode} batch {batch}: skipped (deadline)", flush=True)
                with rows_file.open("a") as f:
                    f.write(json.dumps({"model": name, "mode": mode, "batch": batch, "skipped": "deadline"}) + "\n")
                continue
            notes.messages.clear()
            start = time.time()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    report = bench(pipe, [], runs=runs, n=batch, batch_size=batch, progress=False)
                except (torch.OutOfMemoryError, VisarError) as err:  # Pipeline.generate: out of memory as a VisarError
                    torch.cuda.empty_cache()
                    with rows_file.open("a") as f:
                        f.write(json.dumps({"model": name, "mode": mode, "batch": batch, "error": str(err)[:200]}))
                        f.write("\n")
                    continue
            fell_back = any("torch.compile failed" in str(w.message) for w in caught)
            rows = cell_rows(report, name, params_m, mode, batch, notes.messages, fell_back)
            with rows_file.open("a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            summary = ", ".join(f"{r['method']} {r['ms_per_pass']:.2f} ms/pass" for r in rows)
            print(f"{name} {mode} batch {batch}: {time.time() - start:.1f} s; {summary}", flush=True)


if __name__ == "__main__":
    main()
