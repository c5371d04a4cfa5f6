"""`visar generate`: images to a folder, resumable, on one process or many (torchrun).

The work is done by `visar.apps.batch`; this module reads the command line into its items.
"""

from __future__ import annotations

from ...errors import VisarError
from .common import (
    add_model_args,
    add_negative_prompt_arg,
    add_sampling_args,
    check_negative_prompt,
    generate_kwargs,
    load_pipeline,
    run_settings,
)

DESCRIPTION = """Generate images with a model and decoding method into OUT: OUT/00000.png ...,
OUT/images.jsonl (one record per image: index, file, class or prompt, seed, method, forward passes),
OUT/settings.json (what decides the pixels) and OUT/stats.json (this run's counts and timings).
Image g has item g mod P of the P items and seed SEED + g, so a set does not depend on the batch
size or the number of processes (image j of item i is Pipeline.generate's image j of item i under
num_images_per_prompt, same seed): in law always, in bits on a CPU at one torch thread or with
--deterministic. Rerunning the same command resumes: finished images are kept, the others
generated; a rerun with other settings into the same folder is refused.
Many processes: torchrun --nproc_per_node K -m visar generate -n N ... (each takes the images g
with g mod K = its rank; NCCL on GPUs, one per process, gloo on CPU)."""


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "generate",
        help="generate images to a folder (PNG files, images.jsonl, stats.json); resumable, torchrun-aware",
        description=DESCRIPTION,
    )
    add_model_args(parser)
    add_sampling_args(parser, default_method="auto")
    items = parser.add_argument_group("items (one of; class models default to all classes in turn)")
    items.add_argument(
        "--class",
        dest="class_ids",
        nargs="+",
        metavar="ID|NAME",
        help="class ids or class names (see `visar models -v`) for class-conditional models, cycled over --n images",
    )
    items.add_argument("--prompt", action="append", help="prompt for text-conditional models (repeatable, cycled)")
    add_negative_prompt_arg(items)
    items.add_argument(
        "--classes-file",
        metavar="FILE",
        help="class ids or names, one a line (.txt), or .jsonl: one JSON value a line, an id, a name, or "
        '{"class": ID|NAME, "folder": SUBFOLDER}; --n images per line',
    )
    items.add_argument(
        "--prompts-file",
        metavar="FILE",
        help='prompts, one a line (.txt), or .jsonl: one JSON string a line or {"prompt": TEXT, "folder": '
        'SUBFOLDER, "negative_prompt": TEXT} (both optional; the line\'s negative prompt before '
        "--negative-prompt); --n images per line",
    )
    parser.add_argument(
        "-n",
        "--n",
        type=int,
        help="with --classes-file / --prompts-file: images per item (default 1); otherwise the total number of "
        "images, cycling over --class / --prompt (default: one per --class / --prompt). Under torchrun write -n: "
        "torchrun's own parser takes --n for an abbreviation of its options",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="images decoded at once (default 8); a method that refills (every drafting raster method) "
        "runs a running batch: a finished image's slot takes the next image at once",
    )
    parser.add_argument("--out", default="visar_out", help="output folder (default ./visar_out)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def read_command_items(pipe, args):
    """The items and the total number of images, from the command line."""
    from ..batch import read_items, resolve_class

    files = [f for f in (args.classes_file, args.prompts_file) if f]
    if len(files) > 1 or (files and (args.class_ids or args.prompt)):
        raise VisarError("give the items one way: --class, --prompt, --classes-file or --prompts-file")
    if args.n is not None and args.n < 1:
        raise VisarError("--n must be >= 1")
    if pipe.is_class_conditional:
        if args.prompt or args.prompts_file:
            raise VisarError(f"{pipe.name} is class-conditional: use --class or --classes-file, not prompts")
        if args.classes_file:
            items = read_items(args.classes_file, "class", pipe)
            return items, len(items) * (args.n or 1)
        if args.class_ids:
            items = [resolve_class(pipe, value, "--class: ") for value in args.class_ids]
        else:
            items = [resolve_class(pipe, c) for c in range(pipe.num_classes)]
        return items, len(args.class_ids or [0]) if args.n is None else args.n
    if args.class_ids or args.classes_file:
        raise VisarError(f"{pipe.name} is text-conditional: use --prompt or --prompts-file, not classes")
    if args.prompts_file:
        items = read_items(args.prompts_file, "prompt", pipe)
        return items, len(items) * (args.n or 1)
    if not args.prompt:
        raise VisarError(f"{pipe.name} is text-conditional: give --prompt TEXT (repeatable) or --prompts-file FILE")
    from ..batch import Item

    if any(not p.strip() for p in args.prompt):
        raise VisarError("--prompt must not be empty")
    return [Item(p.strip()) for p in args.prompt], len(args.prompt) if args.n is None else args.n


def run(args) -> int:
    from ..batch import check_negative_prompts, run_batch, start_processes

    if args.n is not None and args.n < 1:  # before loading anything
        raise VisarError("--n must be >= 1")
    if args.batch_size < 1:
        raise VisarError("--batch-size must be >= 1")
    processes, args.device = start_processes(args.device)
    try:
        pipe = load_pipeline(args)
        items, total = read_command_items(pipe, args)
        check_negative_prompt(pipe, args)
        check_negative_prompts(pipe, items)
        if pipe.tokenizer is None:  # its tokens could not become images: said before any folder is made
            raise VisarError(f"{pipe.name} was loaded without its tokenizer: give it with --vq-checkpoint FILE")
        identity = run_settings(pipe, args)
        stats = run_batch(
            pipe,
            items,
            total=total,
            out=args.out,
            method=args.method,
            seed=args.seed,
            batch_size=args.batch_size,
            identity=identity,
            generate_kwargs=generate_kwargs(args),
            processes=processes,
            progress=not args.quiet,
        )
    finally:
        processes.close()
    if stats is not None:
        ran = ""
        if "auto" in stats:  # what auto ran, and what its choice rests on (candidates timed now or kept)
            ran = f"; auto ran {stats['auto']}: {stats['auto_reason']}"
        print(
            f"{args.out}: {stats['n']} images ({stats['generated']} generated, {stats['reused']} already there), "
            f"images.jsonl and stats.json; {stats['forward_passes_per_image']:.1f} forward passes per image, "
            f"{stats['tokens_per_forward']:.2f} tokens/forward, {stats['wall_s']:.1f} s{ran}"
        )
    return 0
