"""The bench part of tools/device_check.sh: one model's decodes timed per (batch, mode, method), each row
appended to a JSONL file as soon as it is measured, so a run cut off by its deadline keeps what it measured.

    python3 tools/device_bench.py --model visar-proxy-gpt-b --device cuda --dtype bf16 --whole-passes \
        --modes reduce-overhead,eager --batches 1,8 --running 32 --methods mc-sjd,tree-mc-sjd,sjd-pac,auto \
        --rows OUT/rows.jsonl --deadline EPOCH_S

--model: a registered name or folder (`visar-proxy-gpt-b`, `-gpt-l`, `-gpt-xl`: visar-tiny-c2i's trained
law at a full-size LlamaGen's cost, visar/models/proxy.py), `default` (the embedded visar-tiny-c2i),
`gpt-b`, `gpt-l`, `gpt-xl`, `tiny`: a folder of random weights (docs/SPEED.md's recipe: LlamaGen's c2i 256
arguments, `init.random_seed` 0, cfg 4; `tiny` a 4 x 4-token model of 0.04 M parameters; pass cost only: a
random law's drafts pass far more often than a trained one's), or `tiny-proxy`: a proxy of a random 4 x
4-token law at a tiny cost (1.2 M parameters, most of them the official head), for --dry-run.

Cells, in order: each fixed batch of --batches (one batch of that many images), then a running batch of
--running slots (--images-per-slot images a slot, so slots refill; a method that does not refill, AR,
decodes them as consecutive batches), and in each cell every mode of --modes: `eager`, or a
torch.compile mode of the generator (`reduce-overhead`: CUDA graphs on a GPU; `default`), with
--whole-passes each pass of the drafting engines too (`Pipeline.compile(whole_passes=True)`). A mode is
compiled once and switched in and out between cells, its compiled code kept. In a cell, AR (the
reference) and then each method: a warm-up decode (in a compiled mode the timed call itself, so that
every shape of pass it meets is compiled, and with CUDA graphs recorded, before it is timed; eager, one
batch), the timed decode, and in eager mode one more, untimed, counting host read-backs (a compiled
row's count would be its eager twin's: counting runs compiled code eagerly); a row notes the graphs
its timed call still compiled. No row starts after --deadline (seconds since the epoch), and one
is stopped after --row-limit seconds or 15 s past the deadline (a row compiling shape after shape
costs its limit, not the rows after it); rows not run are written as skipped, or with their error.

    python3 tools/device_bench.py --report OUT_DIR --meta JSON

writes OUT_DIR/device_check.json and OUT_DIR/device_check.md from OUT_DIR/rows.jsonl (the rows) and
OUT_DIR/suite.jsonl (the test runs, one line each, written by device_check.sh): the proxies' compiled
rows first, then their eager rows, the test runs, the other models' rows (random weights: pass cost
only), and what was not run.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

import visar
from visar.accel import get_method, reference_method
from visar.accel.core.timing import synchronized_clock
from visar.checkpoints import seeded_init
from visar.eval.bench import auto_columns, conditions
from visar.eval.memory import PeakMemory
from visar.eval.readbacks import ReadBackCounter
from visar.eval.throughput import method_size, run_queue
from visar.families.llamagen import build_model
from visar.models.llamagen import preset_config

TINY_ARGS = dict(dim=32, n_layer=2, n_head=2, multiple_of=32, vocab_size=256, num_classes=10, block_size=16)
# the dry run's cost model: the proxy adds the official 16,384-code head and 1,000 classes
TINY_PROXY_COST = dict(dim=32, n_layer=2, n_head=2, multiple_of=32)
RANDOM_SIZES = {"gpt-b": "GPT-B", "gpt-l": "GPT-L", "gpt-xl": "GPT-XL"}


def random_folder(size: str, root: Path) -> Path:
    """A model folder of seeded random weights: {"family": "llamagen", "model_args", "init"} (docs/SPEED.md)."""
    args = TINY_ARGS if size == "tiny" else preset_config(RANDOM_SIZES[size]).to_dict()
    folder = root / f"random-{size}"
    folder.mkdir(parents=True, exist_ok=True)
    config = {"family": "llamagen", "model_args": args, "init": {"random_seed": 0}, "defaults": {"guidance_scale": 4.0}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tiny_proxy_folder(root: Path) -> Path:
    """The dry run's proxy: a 4 x 4-token random LlamaGen as its law (its weights written, as a proxy's law
    needs) at a tiny cost model's price. With visar-tiny-c2i's 16 x 16 tokens as the law, the dry run's
    proxy table alone took four minutes on a busy 2-core CPU."""
    law = root / "tiny-law"
    law.mkdir(parents=True, exist_ok=True)
    model = build_model(TINY_ARGS)
    seeded_init(model, 0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, law / "model.safetensors")
    config = {"family": "llamagen", "model_args": TINY_ARGS, "weights": {"model": "model.safetensors"}}
    (law / "config.json").write_text(json.dumps(config))
    proxy = root / "tiny-proxy"
    proxy.mkdir(exist_ok=True)
    config = {"family": "proxy", "law": str(law), "cost": TINY_PROXY_COST, "init": {"random_seed": 0}}
    (proxy / "config.json").write_text(json.dumps({"name": "tiny-proxy", **config}))
    return proxy


def model_source(name: str, root: Path) -> str | Path:
    """--model -> what visar.load takes."""
    if name == "tiny-proxy":
        return tiny_proxy_folder(root)
    if name == "tiny" or name in RANDOM_SIZES:
        return random_folder(name, root)
    return "visar-tiny-c2i" if name == "default" else name


def table_of(name: str) -> str:
    """Which of the report's tables a model's rows go to: a proxy's passes are a trained model's, a
    random-weight model's only measure what a pass costs."""
    if "proxy" in Path(name).name:
        return "proxy"
    return "pass cost only" if name == "tiny" or name in RANDOM_SIZES else "embedded"


def dynamo_counter(group: str, name: str) -> int:
    from torch._dynamo.utils import counters

    return counters[group][name]


class CudaGraphNotes(logging.Handler):
    """Inductor's messages about CUDA graphs (e.g. 'skipping cudagraphs due to mutated inputs') and its
    count of skipped graphs. The messages come from torch's `cudagraphs` log artifact, off by default
    (and then not passed up to the `torch` logger), so `attach` turns it on first."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.skips_before = 0

    def attach(self):
        torch._logging.set_logs(cudagraphs=True)  # resets torch's log handlers: ours comes after
        logging.getLogger("torch").addHandler(self)

    def emit(self, record):
        message = record.getMessage()
        if "cudagraph" in message.lower():
            self.messages.append(message[:300])

    @staticmethod
    def skips() -> int:
        return dynamo_counter("inductor", "cudagraph_skips")

    def start(self):
        self.messages.clear()
        self.skips_before = self.skips()

    def read(self) -> dict:
        return {"cudagraph_skips": self.skips() - self.skips_before, "cudagraph_notes": sorted(set(self.messages))[:5]}


class Modes:
    """The generator in each mode: a compiled mode is compiled once (`Pipeline.compile`) and switched in
    and out, so that its compiled code (the forward's, and the whole passes' kept by options in
    visar.accel.raster.pass_loop) outlives the eager cells run between its cells."""

    def __init__(self, pipe, whole_passes: bool, backend: str | None):
        self.pipe, self.whole_passes, self.backend = pipe, whole_passes, backend
        self.compiled: dict[str, tuple] = {}  # mode -> (the model's compiled forward or None, compile_options)

    def use(self, mode: str):
        model = self.pipe.model
        model.__dict__.pop("forward", None)  # the class's eager forward again
        self.pipe.compile_options = None
        if mode == "eager":
            return
        if mode not in self.compiled:
            kwargs = ({} if mode == "default" else {"mode": mode}) | ({"backend": self.backend} if self.backend else {})
            self.pipe.compile(whole_passes=self.whole_passes, **kwargs)
            self.compiled[mode] = (model.__dict__.get("forward"), self.pipe.compile_options)
        forward, self.pipe.compile_options = self.compiled[mode]
        if forward is not None:  # None: torch.compile refused at once (warned); the cell runs eagerly
            model.forward = forward


@dataclass(frozen=True)
class Cell:
    mode: str
    slots: int  # a fixed batch's images, or a running batch's slots
    running: bool
    images: int  # what the timed call decodes

    @property
    def batch(self) -> str:
        return f"{self.slots} running" if self.running else str(self.slots)


def plan_cells(batches: list[int], running: int, images_per_slot: int, modes: list[str]) -> list[Cell]:
    """Each fixed batch, then the running batch, in every mode (so a cut-off run has both modes of its first cells)."""
    cells = [Cell(mode, b, False, b) for b in batches for mode in modes]
    return cells + ([Cell(mode, running, True, running * images_per_slot) for mode in modes] if running else [])


class RowTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: int):
    """Raise RowTimeout in this thread after `seconds` (at the next Python line: a kernel or a compiler call
    in flight ends first), so that a row stuck compiling shape after shape costs its limit, not the rows after it."""

    def stop(signum, frame):
        raise RowTimeout(f"stopped after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def decode(pipe, name: str, options: dict, conds: list, slots: int, running: bool) -> list:
    """The images of `conds` at `slots`: one running-batch call for a method that refills, else consecutive batches."""
    return run_queue(pipe, name, conds, slots, running and get_method(name).refills, options)


def batch_passes(out) -> int:
    """The passes a call ran, each over all its slots (a running batch's `batch_passes`)."""
    return out.stats.get("batch_passes", out.stats["forward_passes"])


def measure(pipe, name: str, options: dict, cell: Cell, notes: CudaGraphNotes) -> dict:
    """One method's row in one cell: warm-up, the timed call, and (eager) the read-back count."""
    conds = conditions(pipe, cell.images)
    compiled = cell.mode != "eager"
    notes.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = synchronized_clock(pipe.device)
        # compiled: the timed call itself, so that no shape of pass is compiled in the timed run
        warm = decode(pipe, name, options, conds if compiled else conds[: cell.slots], cell.slots, cell.running)
        warmup_s = synchronized_clock(pipe.device) - start
        graphs_before = dynamo_counter("stats", "unique_graphs")
        start = synchronized_clock(pipe.device)
        with PeakMemory(pipe.device, count_tensors=False) as memory:  # CUDA: the allocator's peak; CPU: None
            outs = decode(pipe, name, options, conds, cell.slots, cell.running)
        wall = synchronized_clock(pipe.device) - start
        # graphs the timed call compiled after all: its time is then mostly compiling (a shape the warm-up
        # did not meet, a guard on a Python value that changes from call to call)
        graphs_timed = dynamo_counter("stats", "unique_graphs") - graphs_before
    latency = sum(o.stats["latency_s"] for o in outs)
    passes = sum(batch_passes(o) for o in outs)
    row = {
        "method": name if options.get("budget") is None else f"{name}, budget {options['budget']}",
        "images": cell.images,
        # passes per image, each over the call's slots (a fixed batch: its passes; running: passes fed per image)
        "forward_passes": passes * cell.slots / cell.images,
        "passes_alone": sum(p for o in outs for p in o.stats["forward_passes_per_image"]) / cell.images,
        "ms_per_pass": 1000 * latency / passes,
        "latency_s": latency,
        "images_per_s": cell.images / wall,
        "peak_mem_mb": memory.peak_mb,
        "warmup_s": warmup_s,
        "graphs_compiled_in_timed_call": graphs_timed,
        "compile_fell_back_to_eager": any("torch.compile failed" in str(w.message) for w in caught)
        or (compiled and not pipe.is_compiled),
        **notes.read(),
        **{f"{k}_warmup": v for k, v in auto_columns([o.stats for o in warm]).items()},
        **auto_columns([o.stats for o in outs]),
    }
    if not compiled:
        refill = cell.running and get_method(name).refills
        with ReadBackCounter() as read_backs:  # one refill at least, where the method refills
            counted = decode(pipe, name, options, conds[: cell.slots + (1 if refill else 0)], cell.slots, cell.running)
        row["read_backs_per_pass"] = read_backs.total / sum(batch_passes(o) for o in counted)
        row["read_backs_by_kind"] = dict(read_backs.by_kind)
    return row


def run_cells(pipe, model: str, cells: list[Cell], runs: list[tuple[str, dict]], modes: Modes, args) -> None:
    """Each cell's rows, AR's first, appended to --rows as measured; past the deadline, what is left as skipped."""
    notes = CudaGraphNotes()
    notes.attach()
    params_m = sum(p.numel() for p in pipe.model.parameters()) / 1e6
    where = {"model": model, "table": table_of(model), "parameters_m": params_m, "dtype": args.dtype}
    rows_file = Path(args.rows)
    rows_file.parent.mkdir(parents=True, exist_ok=True)

    def write(record: dict):
        with rows_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    reference = reference_method(pipe.model)
    plan = [(reference, {})] + runs
    for cell in cells:
        whole_passes = args.whole_passes and cell.mode != "eager"
        shape = {"mode": cell.mode, "whole_passes": whole_passes, "batch": cell.slots, "running": cell.running}
        if time.time() <= args.deadline:
            modes.use(cell.mode)
        ar_row = None
        for i, (name, options) in enumerate(plan):
            if time.time() > args.deadline:
                left = [name for name, _ in plan[i:]]
                write({**where, **shape, "skipped": "deadline", "methods": left})
                print(f"{model} {cell.mode} batch {cell.batch}: {', '.join(left)} skipped (deadline)", flush=True)
                break
            # a row cut by the deadline ends itself before device_check.sh kills the process 20 s past it
            limit = int(min(args.row_limit, max(1.0, args.deadline + 15 - time.time())))
            try:
                with time_limit(limit):
                    row = measure(pipe, name, options, cell, notes)
            except Exception as err:  # one row's failure (out of memory, a compile error) must not end the check
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                write({**where, **shape, "method": name, "error": f"{type(err).__name__}: {str(err)[:300]}"})
                print(f"{model} {cell.mode} batch {cell.batch} {name}: {type(err).__name__}: {err}", flush=True)
                continue
            if name == reference and not options:
                ar_row = row
            ratios = ar_row and (row["ms_per_pass"] / ar_row["ms_per_pass"], row["latency_s"] / ar_row["latency_s"])
            row["pass_over_ar_pass"], row["latency_over_ar"] = ratios or (None, None)  # None: AR's row failed
            write({**where, **shape, **row})
            print(
                f"{model} {cell.mode} batch {cell.batch} {row['method']}: {row['ms_per_pass']:.2f} ms/pass, "
                f"{row['forward_passes']:.1f} passes, latency/AR {fmt(row['latency_over_ar'], '.2f')}, "
                f"warm-up {row['warmup_s']:.1f} s",
                flush=True,
            )


# -- the report ---------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def twin_key(row: dict, mode: str) -> tuple:
    return row["model"], row["batch"], row["running"], row["method"], mode


def batch_label(row: dict) -> str:
    return f"{row['batch']} running ({row['images']} images)" if row.get("running") else str(row["batch"])


def row_notes(row: dict) -> str:
    notes = ["compile fell back to eager"] if row.get("compile_fell_back_to_eager") else []
    if row.get("graphs_compiled_in_timed_call"):
        notes.append(f"{row['graphs_compiled_in_timed_call']} graphs compiled in the timed call")
    if row.get("cudagraph_skips"):
        notes.append(f"CUDA graphs skipped {row['cudagraph_skips']}x")
    notes += row.get("cudagraph_notes", [])
    if row.get("auto"):
        tuned = f" (warm-up: {' / '.join(row['auto_warmup'])})" if row.get("auto_warmup") else ""
        notes.append(f"auto ran {' / '.join(row['auto'])}{tuned}")
    return "; ".join(notes)


TABLE_HEADER = [
    "| model | M params | mode | batch | method | passes | ms / pass | pass / AR pass | latency / AR | x eager "
    "| images/s | read-backs / pass | peak MB | warm-up s | notes |",
    "|" + "---|" * 15,
]


def table(rows: list[dict], eager: dict) -> list[str]:
    """Rows as a markdown table; x eager and a compiled row's read-backs come from its eager twin (`eager`)."""
    lines = list(TABLE_HEADER)
    for r in rows:
        twin = eager.get(twin_key(r, "eager")) if r["mode"] != "eager" else None
        x_eager = r["latency_s"] / twin["latency_s"] if twin else None
        read_backs = r.get("read_backs_per_pass", twin and twin.get("read_backs_per_pass"))
        lines.append(
            f"| {r['model']} | {r['parameters_m']:.2f} | {r['mode']}{', whole passes' if r['whole_passes'] else ''} "
            f"| {batch_label(r)} | {r['method']} | {r['forward_passes']:.1f} | {r['ms_per_pass']:.2f} "
            f"| {fmt(r['pass_over_ar_pass'], '.2f')} | {fmt(r['latency_over_ar'], '.2f')} | {fmt(x_eager, '.2f')} "
            f"| {r['images_per_s']:.2f} | {fmt(read_backs, '.2f')} | {fmt(r['peak_mem_mb'], '.0f')} "
            f"| {r['warmup_s']:.1f} | {row_notes(r)} |"
        )
    return lines


COLUMNS_NOTE = (
    "passes: per image, each over the call's slots (a running batch: passes fed per image); ms / pass: "
    "token-sampling time over the call's passes; latency / AR and pass / AR pass: against AR's row in the same "
    "cell (model, mode, batch); x eager: a compiled row's latency over its eager twin's; images/s: over the "
    "timed call's wall time; read-backs / pass: counted in an extra eager decode (a compiled row shows its eager "
    "twin's); warm-up s: the first call, compilation and CUDA-graph recording included (a compiled row's "
    "warm-up is the timed call's own images)."
)


def write_report(out_dir: Path, meta: dict) -> dict:
    """device_check.json (everything) and device_check.md (the tables) in out_dir."""
    suite, records = read_jsonl(out_dir / "suite.jsonl"), read_jsonl(out_dir / "rows.jsonl")
    report = {**meta, "suite": suite, "bench": records}
    (out_dir / "device_check.json").write_text(json.dumps(report, indent=1))
    rows = [r for r in records if "ms_per_pass" in r]
    eager = {twin_key(r, r["mode"]): r for r in rows if r["mode"] == "eager"}
    proxy = [r for r in rows if r["table"] == "proxy"]
    lines = [f"# visar device check: {meta.get('device_name', '?')}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "device_name"]
    lines += ["", "## Proxies, compiled (trained law, full-size pass cost)", ""]
    lines += [
        "A proxy's tokens, passes and acceptance are visar-tiny-c2i's (a trained law); every pass also runs a "
        "full-size LlamaGen (random weights, 16,384-code head), so its pass costs a real size's. Compiled: "
        "Pipeline.compile(whole_passes=True) in the mode shown (reduce-overhead: CUDA graphs). auto's tuning is "
        "kept per batch, not per mode: its eager row runs what its compiled row chose. " + COLUMNS_NOTE,
        "",
    ]
    lines += table([r for r in proxy if r["mode"] != "eager"], eager)
    lines += ["", "## Proxies, eager", ""] + table([r for r in proxy if r["mode"] == "eager"], eager)
    lines += ["", "## Tests", "", "| run | exit code | summary | s |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['rc']} | {t['summary']} | {t['seconds']} |" for t in suite]
    lines += [
        "",
        "## Other models: random weights (pass cost only) and the embedded default",
        "",
        "A random-weight model's law is near uniform, so its drafts pass far more often than under a trained "
        "model: its passes and latency / AR are not a method's gain; ms / pass and pass / AR pass are what a "
        "pass costs.",
        "",
    ]
    lines += table([r for r in rows if r["table"] != "proxy"], eager)
    missing = [r for r in records if "ms_per_pass" not in r]
    if missing:
        lines += ["", "## Not run", "", "| model | mode | batch | methods | why |", "|---|---|---|---|---|"]
        for r in missing:
            methods = r.get("methods", r.get("method"))
            methods = ", ".join(methods) if isinstance(methods, list) else methods
            batch = f"{r['batch']} running" if r.get("running") else r["batch"]
            lines.append(f"| {r['model']} | {r['mode']} | {batch} | {methods} | {r.get('skipped') or r['error']} |")
    (out_dir / "device_check.md").write_text("\n".join(lines) + "\n")
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", metavar="OUT_DIR", help="write the report of OUT_DIR's rows and suite runs")
    parser.add_argument("--meta", default="{}", help="JSON object of run facts for the report (device, torch ...)")
    parser.add_argument("--model", help="a name or folder, or default, gpt-b, gpt-l, gpt-xl, tiny, tiny-proxy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16")
    parser.add_argument("--batches", default="1,8", help="comma-separated fixed batch sizes")
    parser.add_argument("--running", type=int, default=0, help="slots of a running batch after them (0: none)")
    parser.add_argument("--images-per-slot", type=int, default=2, help="a running batch's images, per slot")
    parser.add_argument("--modes", default="eager", help="comma-separated: eager, reduce-overhead, default")
    parser.add_argument("--whole-passes", action="store_true", help="compile each pass of the drafting engines too")
    parser.add_argument(
        "--methods",
        default="sjd,mc-sjd",
        help="comma-separated, after AR; METHOD:N runs it at a fixed budget of N rows per pass (e.g. mc-sjd:8)",
    )
    parser.add_argument("--rows", help="JSONL file the rows are appended to")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="start no row after this (epoch s)")
    parser.add_argument("--row-limit", type=int, default=120, help="seconds a row may take (warm-up included)")
    parser.add_argument("--compile-backend", help="torch.compile backend (the dry run: eager, no C++ compiler)")
    args = parser.parse_args()
    if args.report:
        write_report(Path(args.report), json.loads(args.meta))
        return
    if not args.model or not args.rows:
        parser.error("--model and --rows are required (or --report OUT_DIR)")

    start = time.time()
    with tempfile.TemporaryDirectory() as root:
        pipe = visar.load(model_source(args.model, Path(root)), device=args.device, dtype=args.dtype)
    print(f"{args.model}: loaded in {time.time() - start:.1f} s", flush=True)
    runs = [method_size(m) for m in args.methods.split(",") if m]  # "mc-sjd:8": mc-sjd at budget=8
    modes = args.modes.split(",")
    cells = plan_cells([int(b) for b in args.batches.split(",") if b], args.running, args.images_per_slot, modes)
    run_cells(pipe, args.model, cells, runs, Modes(pipe, args.whole_passes, args.compile_backend), args)


if __name__ == "__main__":
    main()
