"""The `visar` command line: generate images, list models and methods.

User errors (unknown names, bad options, missing files) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import VisarError


def parse_option(text: str) -> tuple[str, object]:
    """`key=value` -> (key, value) with value read as JSON when it parses (numbers, true, null)."""
    if "=" not in text:
        raise VisarError(f"--opt takes key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.replace("-", "_"), value


def add_model_args(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default="default",
        help="registered name (see `visar models`) or a model folder "
        "with config.json; default: the embedded default model",
    )
    group.add_argument("--checkpoint", help="official checkpoint file, for official presets (e.g. c2i_B_256.pt)")
    group.add_argument("--vq-checkpoint", help="official VQ checkpoint file (e.g. vq_ds16_c2i.pt)")
    group.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu)")
    group.add_argument("--dtype", default="fp32", help="generator dtype: fp32, bf16 or fp16 (default fp32)")
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile the generator (each new input shape compiles on first use; on CPU this needs a C++ "
        "compiler); default --no-compile",
    )


def load_pipeline(args):
    """The model of --model/--checkpoint/--vq-checkpoint on --device in --dtype, compiled with --compile."""
    from .. import load

    pipe = load(
        args.model, device=args.device, dtype=args.dtype, checkpoint=args.checkpoint, vq_checkpoint=args.vq_checkpoint
    )
    return pipe.compile() if args.compile else pipe


def add_sampling_args(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("sampling (unset values take the model's defaults, see `visar models -v`)")
    group.add_argument("--method", default="ar", help="decoding method (see `visar methods`); default ar")
    group.add_argument("--seed", type=int, default=0, help="image i uses seed + i (default 0)")
    group.add_argument("--guidance-scale", "--cfg", type=float, help="classifier-free guidance scale (1 = off)")
    group.add_argument("--temperature", type=float, help="softmax temperature (> 0)")
    group.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    group.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    group.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a method option, repeatable (e.g. --opt window=16); see `visar methods`",
    )


def cmd_generate(args) -> int:
    pipe = load_pipeline(args)
    options = dict(parse_option(o) for o in args.opt)
    if pipe.is_class_conditional:
        if args.prompt:
            raise VisarError(f"{pipe.name} is class-conditional: use --class, not --prompt")
        classes = args.class_ids if args.class_ids else list(range(pipe.num_classes))
        n = args.n or len(args.class_ids or [0])
        conditions = [classes[i % len(classes)] for i in range(n)]
    else:
        if not args.prompt:
            raise VisarError(f"{pipe.name} is text-conditional: give --prompt TEXT (repeatable)")
        n = args.n or len(args.prompt)
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


def cmd_models(args) -> int:
    from ..registry import describe_models, embedded_models, read_config

    for name, description in describe_models():
        print(f"{name:28s} {description}")
        if args.verbose and name in embedded_models():
            config = read_config(embedded_models()[name])
            print(f"{'':28s} defaults: {config.get('defaults', {})}")
    return 0


def cmd_methods(args) -> int:
    from ..accel import METHODS

    for method in METHODS.values():
        flag = "lossless" if method.lossless else "lossy"
        options = ", ".join(method.options) or "-"
        print(f"{method.name:12s} {flag:9s} {method.description}  [options: {options}]")
    return 0


def cmd_eval_shapes(args) -> int:
    from ..eval.shapes_eval import evaluate_shapes, ground_truth_scores

    pipe = load_pipeline(args)
    options = dict(parse_option(o) for o in args.opt)
    if args.batch_size < 1:
        raise VisarError("--batch-size must be >= 1")
    if args.n < 1:
        raise VisarError("--n must be >= 1")
    if args.ground_truth:
        scores = ground_truth_scores(args.n, pipe.is_class_conditional, pipe.class_render)
        record = {"model": "ground-truth renders", "method": "-", **scores}
    else:
        record = evaluate_shapes(
            pipe,
            n=args.n,
            method=args.method,
            seed=args.seed,
            batch_size=args.batch_size,
            guidance_scale=args.guidance_scale,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            **options,
        )
    if "accuracy" in record:
        print(f"{record['model']} / {record['method']}: detector accuracy {record['accuracy']:.1%} on {args.n} images")
    else:
        tasks = ", ".join(f"{k} {v:.1%}" for k, v in record["tasks"].items())
        print(f"{record['model']} / {record['method']}: overall {record['overall']:.1%} ({tasks}) on {args.n} images")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


def run_settings(pipe, args) -> dict:
    """What of the command line decides a run's pixels besides model, method and seed (recorded for resuming):
    checkpoint files, method options and the resolved sampling settings (unset: the model's defaults)."""
    params = pipe.sampling_params(args.guidance_scale, args.temperature, args.top_k, args.top_p)
    return {
        "checkpoint": args.checkpoint,
        "vq_checkpoint": args.vq_checkpoint,
        "options": dict(parse_option(o) for o in args.opt),
        "sampling": {k: getattr(params, k) for k in ("guidance_scale", "temperature", "top_k", "top_p")},
    }


def generate_kwargs(args) -> dict:
    return dict(
        guidance_scale=args.guidance_scale,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        **dict(parse_option(o) for o in args.opt),
    )


def cmd_eval_fid(args) -> int:
    from ..eval.fid import evaluate_fid, format_metrics, parse_shard, read_prompts

    shard = parse_shard(args.shard)
    if args.ref is None and shard == (0, 1) and args.images is None:
        print("no --ref given: the sample set and its .npz are written, no metrics", file=sys.stderr)
    metric_kwargs = dict(
        feature_extractor=args.feature_extractor,
        weights=args.inception_weights,
        isc=args.isc,
        prc=args.prc,
        batch_size=args.fidelity_batch_size,
    )
    if args.images is not None:
        from ..pipeline import resolve_device

        metric_kwargs["device"] = resolve_device(args.device)
        record = evaluate_fid(args.out, images=args.images, ref=args.ref, metric_kwargs=metric_kwargs)
    else:
        if args.n is None:
            raise VisarError("eval fid needs --n (the number of images), or --images DIR|NPZ")
        pipe = load_pipeline(args)
        metric_kwargs["device"] = pipe.device
        prompts = None if pipe.is_class_conditional else read_prompts(args.metadata)
        record = evaluate_fid(
            args.out,
            pipe=pipe,
            n=args.n,
            ref=args.ref,
            method=args.method,
            seed=args.seed,
            shard=shard,
            batch_size=args.batch_size,
            prompts=prompts,
            identity=run_settings(pipe, args),
            generate_kwargs=generate_kwargs(args),
            metric_kwargs=metric_kwargs,
        )
        print(
            f"{record['model']} / {record['method']}: shard {record['shard']}: {record['generated']} images generated, "
            f"{record['reused']} already there ({record['generation_s']:.1f} s)"
        )
        if shard != (0, 1):
            print(f"shard done: run again without --shard to pack {args.out}/samples.npz and compute metrics")
            return 0
    if "npz" in record:
        print(f"ADM sample pack: {record['npz']}")
    if "metrics" in record:
        print(format_metrics(record))
        for note in record["notes"]:
            print(f"note: {note}")
        print(f"wrote {Path(args.out) / 'metrics.json'}")
    return 0


def cmd_eval_renders(args) -> int:
    from ..eval.fid import render_options_of, write_renders

    class_render = render_options_of(args.model) if args.model else None
    written = write_renders(
        args.out, args.n, text=args.text, metadata=args.metadata, seed=args.seed, class_render=class_render
    )
    print(f"{args.out}: {written} renders written, {args.n - written} already there")
    return 0


def cmd_eval_geneval(args) -> int:
    from ..eval.geneval import evaluate_geneval, format_summary
    from ..registry import embedded_models

    pipe = load_pipeline(args)
    score = args.score if args.score is not None else pipe.name in embedded_models()
    record = evaluate_geneval(
        pipe,
        args.out,
        metadata=args.metadata,
        n_samples=args.n_samples,
        method=args.method,
        seed=args.seed,
        batch_size=args.batch_size,
        score=score,
        identity=run_settings(pipe, args),
        generate_kwargs=generate_kwargs(args),
    )
    print(
        f"{record['model']} / {record['method']}: {record['n_prompts']} prompts x {record['n_samples']} images in "
        f"{args.out} ({record['generated']} generated, {record['reused']} already there)"
    )
    if score:
        print(format_summary(record["summary"]))
        print(f"wrote {Path(args.out) / 'results.jsonl'} and summary.json (shapes-world detector, GenEval's rules)")
    else:
        print(
            "not scored here: run GenEval's evaluator on the folder, e.g. `python evaluation/evaluate_images.py "
            f"{args.out} --outfile results.jsonl --model-path <DETECTOR_DIR>` (docs/EVALUATION.md)"
        )
    return 0


def cmd_bench(args) -> int:
    from ..eval.bench import bench, markdown_table, write_bench_report, write_report

    pipe = load_pipeline(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    options: dict[str, dict] = {}
    for text in args.opt:
        if "." not in text.split("=", 1)[0]:
            raise VisarError(f"bench options are METHOD.KEY=VALUE (e.g. sjd.window=16), got {text!r}")
        method, rest = text.split(".", 1)  # the method keeps its dashes (zipar-mc-sjd); the key is normalised
        option, value = parse_option(rest)
        if method not in ["ar", *methods]:
            raise VisarError(f"--opt {text!r} names method {method!r}, which --methods does not run")
        options.setdefault(method, {})[option] = value
    if args.sweep:
        from ..eval.sweep import parse_sweep, plot_sweep, sweep

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
            method_options={"ar": options.get("ar", {})},
        )
        print(markdown_table(report))
        print(f"plot: {plot_sweep(report, args.plot)}")
        write_report(report, args.json, args.md)
        if args.report:
            files = write_bench_report(report, args.report)
            print(f"report: {files['md']}, {files['json']}, {files['png']}")
        return 0
    report = bench(
        pipe, methods, n=args.n, batch_size=args.batch_size, quality_n=args.quality_n, method_options=options
    )
    print(markdown_table(report))
    write_report(report, args.json, args.md)
    if args.report:
        files = write_bench_report(report, args.report)
        print(f"report: {files['md']}, {files['json']}, {files['png']}")
    return 0


def cmd_train(args) -> int:
    from . import train

    if args.what == "ship":
        if not (args.export and args.name):
            raise VisarError("visar train ship needs --export (an AR run's export/ folder) and --name")
        target = train.ship(args.export, args.name, args.description or "")
        print(f"shipped {args.name} to {target}")
        return 0
    if not args.out:
        raise VisarError(f"visar train {args.what} needs --out (the run folder)")
    if args.what == "tokenizer":
        export = train.train_tokenizer(args.recipe or "visar-tiny-vq", args.out, steps=args.steps)
    else:
        if not args.tokenizer:
            raise VisarError("visar train ar needs --tokenizer (a folder made by `visar train tokenizer`, its export/)")
        export = train.train_ar(
            args.recipe or "visar-tiny-c2i",
            args.out,
            args.tokenizer,
            device=args.device,
            compile=args.compile,
            steps=args.steps,
        )
    print(f"exported to {export}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="visar",
        description="Faster sampling for image autoregressive models. Every command runs on the embedded "
        "default model when no --model is given.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate images to a folder (PNG files + stats.json)",
        description="Generate images with a model and decoding method; writes OUT/00000.png ... "
        "and OUT/stats.json (settings, forward passes, timings, per-image seed and condition).",
    )
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument(
        "--class",
        dest="class_ids",
        type=int,
        nargs="+",
        metavar="ID",
        help="class ids for class-conditional models (cycled over --n images; default: all classes in turn)",
    )
    gen.add_argument("--prompt", action="append", help="prompt for text-conditional models (repeatable, cycled)")
    gen.add_argument("--n", type=int, help="number of images (default: one per --class / --prompt)")
    gen.add_argument("--batch-size", type=int, default=8, help="images per forward batch (default 8)")
    gen.add_argument("--out", default="visar_out", help="output folder (default ./visar_out)")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list registered models")
    models.add_argument("-v", "--verbose", action="store_true", help="also show default sampling settings")
    models.set_defaults(func=cmd_models)

    evaluate = sub.add_parser("eval", help="evaluate a model: shapes-world score, FID, GenEval")
    eval_sub = evaluate.add_subparsers(dest="eval_command", required=True)
    shapes = eval_sub.add_parser(
        "shapes",
        help="generate N images and score them with the shapes-world detector",
        description="Generate N images with a shapes-world model (classes or GenEval-style captions spread "
        "evenly, image i with seed SEED + i) and print the detector's score: accuracy (shape and colour "
        "right) for class-conditional models, per-task and overall GenEval-style scores for text-conditional "
        "ones. --json writes {model, method, n, accuracy | overall and tasks}.",
    )
    add_model_args(shapes)
    add_sampling_args(shapes)
    shapes.add_argument("--n", type=int, default=200, help="number of images (default 200)")
    shapes.add_argument("--batch-size", type=int, default=16, help="images per batch (default 16)")
    shapes.add_argument("--json", help="write the scores to this JSON file")
    shapes.add_argument(
        "--ground-truth",
        action="store_true",
        help="score N ground-truth renders laid out as the model's images would be (the ceiling)",
    )
    shapes.set_defaults(func=cmd_eval_shapes)

    fid = eval_sub.add_parser(
        "fid",
        help="generate (resumable) or read N images, pack the ADM .npz, and compute FID / IS / precision-recall",
        description="Image g of N has class g mod C (N a multiple of the C classes) or prompt g mod P, and seed "
        "SEED + g, so the set is the same for any batch size, any --shard split and any interruption (complete "
        "files are kept). Writes OUT/samples/000000.png ..., OUT/config.json, OUT/samples.npz (arr_0, uint8 "
        "[N, H, W, 3], the ADM evaluator's format) and, with --ref, OUT/metrics.json, using torch-fidelity "
        "(pip install 'visar-ar[eval]').",
    )
    add_model_args(fid)
    add_sampling_args(fid)
    fid.add_argument("--n", type=int, help="number of images (e.g. 50000)")
    fid.add_argument("--out", required=True, help="output folder (samples/, samples.npz, config.json, metrics.json)")
    fid.add_argument(
        "--ref",
        help="reference: a folder of images, a torch-fidelity registered input (e.g. cifar10-train), or an .npz "
        "with mu/sigma statistics (ADM's VIRTUAL_imagenet256_labeled.npz) or with arr_0 images",
    )
    fid.add_argument(
        "--feature-extractor",
        default="inception-v3-compat",
        choices=["inception-v3-compat", "visar-shapes-vq"],
        help="inception-v3-compat (Inception FID/IS, needs its weights file) or visar-shapes-vq (offline "
        "shapes-world features; NOT Inception, named so in the output); default inception-v3-compat",
    )
    fid.add_argument(
        "--inception-weights",
        metavar="FILE",
        help="weights-inception-2015-12-05-6726825d.pth (torch-fidelity's feature_extractor_weights_path); "
        "default: torch hub's cache, $TORCH_HOME/hub/checkpoints/",
    )
    fid.add_argument("--isc", action=argparse.BooleanOptionalAction, default=True, help="Inception Score (default on)")
    fid.add_argument(
        "--prc", action=argparse.BooleanOptionalAction, default=True, help="precision/recall, k = 3 (default on)"
    )
    fid.add_argument("--shard", metavar="I/K", help="generate only the images g with g mod K = I (no metrics)")
    fid.add_argument("--batch-size", type=int, default=16, help="images per generation batch (default 16)")
    fid.add_argument("--fidelity-batch-size", type=int, default=64, help="images per feature batch (default 64)")
    fid.add_argument(
        "--metadata", help="text-conditional models: GenEval-format prompts (default: the shipped shapes-world set)"
    )
    fid.add_argument("--images", metavar="DIR|NPZ", help="score these images instead of generating (no model used)")
    fid.set_defaults(func=cmd_eval_fid)

    renders = eval_sub.add_parser(
        "renders",
        help="write N ground-truth shapes-world renders, a reference folder for eval fid",
        description="Write OUT/000000.png ...: image g is a render of class g mod 40 (or, with --text, of prompt "
        "g mod P of --metadata) with render seed SEED + g, in the world --model was trained on. Complete files "
        "are kept.",
    )
    renders.add_argument("--n", type=int, required=True, help="number of renders")
    renders.add_argument("--out", required=True, help="output folder")
    renders.add_argument("--seed", type=int, default=0, help="render g uses seed SEED + g (default 0)")
    renders.add_argument(
        "--text", action="store_true", help="render prompts (the text-conditional layout) instead of classes"
    )
    renders.add_argument("--metadata", help="with --text: GenEval-format prompts (default: the shipped set)")
    renders.add_argument(
        "--model",
        help="draw class renders as this shapes-world model's training data (its recipe's render options, e.g. "
        "larger objects on calmer backgrounds); default: the full world",
    )
    renders.set_defaults(func=cmd_eval_renders)

    geneval = eval_sub.add_parser(
        "geneval",
        help="write GenEval's image layout for a prompt file; score it on shapes-world models",
        description="From GenEval-format metadata (one JSON object a line), write OUT/00000/metadata.jsonl and "
        "OUT/00000/samples/00000.png ... (--n-samples per prompt; image j of prompt i with seed SEED + i * "
        "N_SAMPLES + j), resuming an interrupted run. Shapes-world models (the embedded ones) are scored with the "
        "shapes detector and GenEval's rules: OUT/results.jsonl, OUT/summary.json and GenEval's summary "
        "(overall = mean of the six task accuracies). Other models: run GenEval's evaluator on OUT.",
    )
    add_model_args(geneval)
    add_sampling_args(geneval)
    geneval.add_argument("--metadata", help="evaluation_metadata.jsonl (default: the shipped shapes-world prompts)")
    geneval.add_argument("--out", required=True, help="output folder (GenEval's layout)")
    geneval.add_argument("--n-samples", type=int, default=4, help="images per prompt (default 4, GenEval's)")
    geneval.add_argument("--batch-size", type=int, default=16, help="images per generation batch (default 16)")
    geneval.add_argument(
        "--score",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="score with the shapes detector (default: on for embedded shapes-world models, off otherwise)",
    )
    geneval.set_defaults(func=cmd_eval_geneval)

    bench_parser = sub.add_parser(
        "bench",
        help="benchmark methods against plain AR in one run (speed and quality table)",
        description="Run plain AR and each requested method in one process on the same images (image i: "
        "condition i, seed i) and print a table: lossless flag, forward passes per image, step compression "
        "(image tokens / forward passes), tokens per forward, latency / AR (< 1 is faster), images per second, "
        "peak memory (CUDA: allocated; CPU: process peak RSS) and, with --quality-n, the shapes-world detector "
        "accuracy and a Frechet distance to AR's images in the tokenizer-latent feature space (see "
        "visar.eval.bench). --report DIR also writes the run's report.md, report.json and frontier.png.",
    )
    add_model_args(bench_parser)
    bench_parser.add_argument("--methods", default="", help="comma-separated methods besides ar (default: none)")
    bench_parser.add_argument("--n", type=int, default=16, help="images for the speed columns (default 16)")
    bench_parser.add_argument("--batch-size", type=int, default=1, help="batch size of the speed run (default 1)")
    bench_parser.add_argument(
        "--quality-n",
        type=int,
        default=0,
        help="images per method for the quality columns (default 0 = skip; >= 500 for reported figures)",
    )
    bench_parser.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="a method option, repeatable (e.g. --opt sjd.window=16)",
    )
    bench_parser.add_argument(
        "--sweep",
        metavar="OPTION=V1,V2,...",
        help="run the one method of --methods once per value of OPTION (e.g. delta=0,0.05,0.1) and plot "
        "step compression against quality (needs --quality-n)",
    )
    bench_parser.add_argument("--plot", default="bench-sweep.png", help="the sweep's PNG (default bench-sweep.png)")
    bench_parser.add_argument("--json", help="write the report as JSON")
    bench_parser.add_argument("--md", help="write the markdown table")
    bench_parser.add_argument(
        "--report",
        metavar="DIR",
        help="write the run's report to DIR: report.md (table, lossless flags, notes), report.json and "
        "frontier.png (speed against each quality column; lossless filled, lossy open)",
    )
    bench_parser.set_defaults(func=cmd_bench)

    train = sub.add_parser(
        "train",
        help="train an embedded model by its recipe (resumable)",
        description="Train visar's embedded models on the offline shapes world by their fixed recipes. A run "
        "checkpoints to OUT/checkpoint.pt and resumes from it when started again with the same --out; the "
        "result is exported as fp16 safetensors in OUT/export/. Recipes: tokenizer: visar-tiny-vq; ar: "
        "visar-tiny-c2i (the default, with ZipAR-aware training), visar-tiny-c2i-causal (the same without it), "
        "visar-tiny-c2i-draft, visar-tiny-t2i. `ship` copies an ar export into visar/weights/ "
        "(the tokenizer into a shared folder named after its recipe).",
    )
    train.add_argument(
        "what",
        choices=["tokenizer", "ar", "ship"],
        help="tokenizer or ar: train by recipe; ship: copy an ar export into the package",
    )
    train.add_argument("--recipe", help="recipe name (default visar-tiny-vq / visar-tiny-c2i)")
    train.add_argument("--out", help="run folder (checkpoints, dataset cache, export/)")
    train.add_argument("--tokenizer", help="for ar: the tokenizer export folder (OUT/export of a tokenizer run)")
    train.add_argument("--steps", type=int, help="override the recipe's step count (for quick trials)")
    train.add_argument(
        "--device", default="cpu", help="for ar: where the arithmetic runs (cpu, cuda, cuda:1; default cpu)"
    )
    train.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="for ar: torch.compile the training step (visar-tiny-c2i: 2.04 against 1.74 steps/s on 2 CPU "
        "threads; needs a C++ compiler); default --no-compile",
    )
    train.add_argument("--export", help="for ship: the export/ folder of an ar run")
    train.add_argument("--name", help="for ship: the registered name (e.g. visar-tiny-c2i)")
    train.add_argument("--description", help="for ship: the one-line description shown by `visar models`")
    train.set_defaults(func=cmd_train)

    methods = sub.add_parser("methods", help="list decoding methods, whether each is lossless, and their options")
    methods.set_defaults(func=cmd_methods)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except VisarError as err:
        print(f"visar: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("visar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
