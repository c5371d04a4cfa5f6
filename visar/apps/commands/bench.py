"""`visar bench`: plain AR and other methods in one run, a speed and quality table; --sweep one option."""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import VisarError, require
from .common import add_model_args, compile_kwargs, load_pipeline, parse_option

DESCRIPTION = " ".join(
    (
        "Run the reference decoding of the model's kind (plain AR; var for VAR; mar for MAR; maskgit at one",
        "token per step for a masked model) and each requested method in one process on the same images",
        "(image i: condition i, seed i) and print a table: lossless flag, forward passes per image, step",
        "compression (image tokens / forward passes), tokens per forward, latency / AR (< 1 is faster),",
        "images per second, peak memory per method (what one batch's decode allocates above the weights:",
        "CUDA's allocator peak, on CPU the tensors counted in an extra untimed batch), host read-backs per",
        "forward pass (operations that make the host wait for the device, counted in that extra batch), aten",
        "operations dispatched per forward pass (the model's and the method's bookkeeping, counted in the",
        "same batch) and, with --quality-n, the shapes-world detector accuracy (for a text-conditional shapes",
        "model: GenEval-style overall and per-task scores on the shipped world's prompts) and a Frechet",
        "distance to AR's images in the tokenizer-latent feature space (see visar.eval.bench). --report DIR",
        "also writes the run's report.md, report.json and frontier.png.",
    )
)


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "bench",
        help="benchmark methods against the model's reference decoding in one run (speed and quality table)",
        description=DESCRIPTION,
    )
    add_model_args(parser)
    parser.add_argument(
        "--methods",
        default="",
        help="comma-separated methods besides the reference (ar for raster models; default: none); METHOD:N "
        "runs a method at a fixed budget of N rows per pass beside its other rows (e.g. mc-sjd,mc-sjd:8,mc-sjd:32, "
        "as auto's candidates are written); auto's rows under --throughput are its first "
        "call (tuning on its own images where nothing is kept: set VISAR_CACHE to an empty folder to see it) "
        "and its second, with a table of what it ran and timed",
    )
    parser.add_argument("--n", type=int, default=16, help="images for the speed columns (default 16)")
    parser.add_argument("--batch-size", type=int, default=1, help="batch size of the speed run (default 1)")
    parser.add_argument(
        "--quality-n",
        type=int,
        default=0,
        help="images per method for the quality columns (default 0 = skip; >= 500 for reported figures)",
    )
    parser.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="a method option, repeatable (e.g. --opt sjd.window=16)",
    )
    parser.add_argument(
        "--sweep",
        metavar="OPTION=V1,V2,...",
        help="run the one method of --methods once per value of OPTION (e.g. delta=0,0.05,0.1) and plot "
        "step compression against quality (needs --quality-n)",
    )
    parser.add_argument(
        "--compiled-rows",
        action="store_true",
        help="after the eager rows, compile the generator and run every method again (rows marked compiled, "
        "their warm-up, compilation included, reported apart from the latency)",
    )
    parser.add_argument(
        "--throughput",
        action="store_true",
        help="instead of the table above: images per second, passes fed per image and peak memory of the "
        "reference and each method at each --batch-sizes, decoding consecutive fixed batches and (methods that "
        "refill) a running batch whose finished images' slots take the next ones (see visar.eval.throughput)",
    )
    parser.add_argument(
        "--batch-sizes",
        default="1,8,32,64",
        help="with --throughput: comma-separated batch sizes (default 1,8,32,64)",
    )
    parser.add_argument(
        "--images-per-slot",
        type=int,
        default=8,
        help="with --throughput: images per batch slot at each batch size (default 8: 64 images at batch 8)",
    )
    parser.add_argument(
        "--kv-keep",
        default="",
        help="with --throughput: comma-separated KV-cache fractions kept (e.g. 0.5,0.25), each a set of rows "
        "beside the full cache's",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="with --throughput: also rows that decode each image alone (generate's deterministic=True: "
        "the same bits at any batch size) at each batch size, beside the batched rows, to price it",
    )
    parser.add_argument("--plot", default="bench-sweep.png", help="the sweep's PNG (default bench-sweep.png)")
    parser.add_argument("--json", help="write the report as JSON")
    parser.add_argument("--md", help="write the markdown table")
    parser.add_argument(
        "--report",
        metavar="DIR",
        help="write the run's report to DIR: report.md (table, lossless flags, notes), report.json and "
        "frontier.png (speed against each quality column; lossless filled, lossy open)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from ...accel import reference_method
    from ...eval.bench import bench, markdown_table, write_bench_report, write_report
    from ...eval.throughput import method_size

    if args.quality_n:  # the detector's and the Frechet distance's, said before anything is timed
        require("scipy", "eval")
    pipe = load_pipeline(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    options: dict[str, dict] = {}
    for text in args.opt:
        if "." not in text.split("=", 1)[0]:
            raise VisarError(f"bench options are METHOD.KEY=VALUE (e.g. sjd.window=16), got {text!r}")
        method, rest = text.split(".", 1)  # the method keeps its dashes (zipar-mc-sjd); the key is normalised
        option, value = parse_option(rest)
        if method not in [reference_method(pipe.model), *(m.partition(":")[0] for m in methods)]:
            raise VisarError(f"--opt {text!r} names method {method!r}, which --methods does not run")
        options.setdefault(method, {})[option] = value
    if args.throughput:
        return run_throughput(args, pipe, methods, options)
    if args.sweep:
        from ...eval.plots import plot_sweep
        from ...eval.sweep import parse_sweep, sweep

        if len(methods) != 1:
            raise VisarError("--sweep runs exactly one method: give it with --methods (e.g. --methods lantern)")
        option, values = parse_sweep(args.sweep)
        report = sweep(
            pipe,
            methods[0],
            option,
            values,
            options=options.get(methods[0], {}),
            n=args.n,
            batch_size=args.batch_size,
            quality_n=args.quality_n,
            method_options={reference_method(pipe.model): options.get(reference_method(pipe.model), {})},
        )
        print(markdown_table(report))
        print(f"plot: {plot_sweep(report, args.plot)}")
        write_report(report, args.json, args.md)
        if args.report:
            files = write_bench_report(report, args.report)
            print(f"report: {files['md']}, {files['json']}, {files['png']}")
        return 0
    # METHOD:N (e.g. mc-sjd:8) runs the method at that fixed budget, beside its other rows
    runs = None
    if any(":" in m for m in methods):
        runs = [(name, {**options.get(name, {}), **size}) for name, size in map(method_size, methods)]
    report = bench(
        pipe,
        [m.partition(":")[0] for m in methods],
        runs=runs,
        n=args.n,
        batch_size=args.batch_size,
        quality_n=args.quality_n,
        method_options=options,
        compiled_rows=args.compiled_rows,
        compile_kwargs=compile_kwargs(args),
    )
    print(markdown_table(report))
    write_report(report, args.json, args.md)
    if args.report:
        files = write_bench_report(report, args.report)
        print(f"report: {files['md']}, {files['json']}, {files['png']}")
    return 0


def number_list(text: str, name: str, kind=int) -> tuple:
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise VisarError(f"{name} takes comma-separated numbers, got {text!r}") from None


def run_throughput(args, pipe, methods: list[str], options: dict) -> int:
    from ...eval.bench import write_text_atomic
    from ...eval.throughput import throughput, throughput_table

    report = throughput(
        pipe,
        methods,
        batch_sizes=number_list(args.batch_sizes, "--batch-sizes"),
        images_per_slot=args.images_per_slot,
        kv_keeps=number_list(args.kv_keep, "--kv-keep", float),
        method_options=options,
        deterministic=args.deterministic,
    )
    table = throughput_table(report)
    print(table)
    if args.json:
        write_text_atomic(Path(args.json), json.dumps(report, indent=1))
    if args.md:
        write_text_atomic(Path(args.md), table + "\n")
    return 0
