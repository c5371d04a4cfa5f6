"""`visar generate`: images to a folder, PNG files and stats.json."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ...errors import VisarError
from .common import add_model_args, add_sampling_args, load_pipeline, parse_option


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "generate",
        help="generate images to a folder (PNG files + stats.json)",
        description="Generate images with a model and decoding method; writes OUT/00000.png ... "
        "and OUT/stats.json (settings, forward passes, timings, per-image seed and condition).",
    )
    add_model_args(parser)
    add_sampling_args(parser)
    parser.add_argument(
        "--class",
        dest="class_ids",
        type=int,
        nargs="+",
        metavar="ID",
        help="class ids for class-conditional models (cycled over --n images; default: all classes in turn)",
    )
    parser.add_argument("--prompt", action="append", help="prompt for text-conditional models (repeatable, cycled)")
    parser.add_argument("--n", type=int, help="number of images (default: one per --class / --prompt)")
    parser.add_argument("--batch-size", type=int, default=8, help="images per forward batch (default 8)")
    parser.add_argument("--out", default="visar_out", help="output folder (default ./visar_out)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from tqdm.auto import tqdm

    pipe = load_pipeline(args)
    options = dict(parse_option(o) for o in args.opt)
    if pipe.is_class_conditional:
        if args.prompt:
            raise VisarError(f"{pipe.name} is class-conditional: use --class, not --prompt")
        classes = args.class_ids if args.class_ids else list(range(pipe.num_classes))
        n = len(args.class_ids or [0]) if args.n is None else args.n
        conditions = [classes[i % len(classes)] for i in range(n)]
    else:
        if not args.prompt:
            raise VisarError(f"{pipe.name} is text-conditional: give --prompt TEXT (repeatable)")
        n = len(args.prompt) if args.n is None else args.n
        conditions = [args.prompt[i % len(args.prompt)] for i in range(n)]
    if n < 1:
        raise VisarError("--n must be >= 1")
    if args.batch_size < 1:
        raise VisarError("--batch-size must be >= 1")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise VisarError(f"cannot create output folder {out}: {err}") from err

    records, totals = [], {"forward_passes": 0, "latency_s": 0.0, "decode_s": 0.0}
    image_passes = 0  # forward passes each image went through, summed over images
    start = time.perf_counter()
    with tqdm(total=n, desc=f"{pipe.name} / {args.method}", unit="img") as bar:
        for first in range(0, n, args.batch_size):
            chunk = conditions[first : first + args.batch_size]
            kwargs = {"class_labels": chunk} if pipe.is_class_conditional else {"prompts": chunk}
            result = pipe.generate(
                **kwargs,
                method=args.method,
                seed=args.seed + first,
                guidance_scale=args.guidance_scale,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                **options,
            )
            for i, image in enumerate(result.images):
                index = first + i
                image.save(out / f"{index:05d}.png")
                key = "class_label" if pipe.is_class_conditional else "prompt"
                records.append({"index": index, "file": f"{index:05d}.png", key: chunk[i], "seed": args.seed + index})
            for key in totals:
                totals[key] += result.stats[key]
            image_passes += result.stats["forward_passes"] * len(chunk)
            bar.update(len(chunk))
    wall = time.perf_counter() - start
    params = pipe.sampling_params(args.guidance_scale, args.temperature, args.top_k, args.top_p)
    stats = {
        "model": pipe.name,
        "method": args.method,
        "options": options,
        "sampling": {k: getattr(params, k) for k in ("guidance_scale", "temperature", "top_k", "top_p")},
        "n": n,
        "batch_size": args.batch_size,
        "device": str(pipe.device),
        "dtype": str(pipe.dtype).removeprefix("torch."),
        "forward_passes": totals["forward_passes"],
        "tokens_per_forward": n * pipe.model.num_image_tokens / max(image_passes, 1),
        "sampling_s": totals["latency_s"],
        "decode_s": totals["decode_s"],
        "wall_s": wall,
        "images_per_s": n / wall,
        "images": records,
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    print(
        f"wrote {n} images and stats.json to {out} "
        f"({stats['forward_passes']} forward passes, {stats['tokens_per_forward']:.2f} tokens/forward, "
        f"{wall:.1f} s)"
    )
    return 0
