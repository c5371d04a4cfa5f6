"""`visar eval shapes | fid | renders | geneval`: score a model's images.

Named `evaluate` so that importing it does not shadow the builtin `eval`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...errors import VisarError, require
from .common import (
    add_model_args,
    add_negative_prompt_arg,
    add_sampling_args,
    check_negative_prompt,
    deterministic_kwargs,
    generate_kwargs,
    kv_keep_kwargs,
    load_pipeline,
    parse_option,
    run_settings,
)


def add_parser(subparsers):
    parser = subparsers.add_parser("eval", help="evaluate a model: shapes-world score, FID, GenEval")
    eval_subparsers = parser.add_subparsers(dest="eval_command", required=True)
    add_shapes_parser(eval_subparsers)
    add_fid_parser(eval_subparsers)
    add_renders_parser(eval_subparsers)
    add_geneval_parser(eval_subparsers)


# -- eval shapes -------------------------------------------------------------------------------------


def add_shapes_parser(subparsers):
    parser = subparsers.add_parser(
        "shapes",
        help="generate N images and score them with the shapes-world detector",
        description="Generate N images with a shapes-world model (classes or GenEval-style captions spread "
        "evenly, image i with seed SEED + i) and print the detector's score: accuracy (shape and colour "
        "right) for class-conditional models, per-task and overall GenEval-style scores for text-conditional "
        "ones. --json writes {model, method, n, accuracy | overall and tasks}.",
    )
    add_model_args(parser)
    add_sampling_args(parser)
    parser.add_argument("--n", type=int, default=200, help="number of images (default 200)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="images decoded at once (default 16; a refilling method's running batch of this many slots)",
    )
    parser.add_argument("--json", help="write the scores to this JSON file")
    parser.add_argument(
        "--ground-truth",
        action="store_true",
        help="score N ground-truth renders laid out as the model's images would be (the ceiling)",
    )
    parser.set_defaults(func=run_shapes)


def run_shapes(args) -> int:
    from ...data.shapes import class_render_options
    from ...eval.samples import write_json_atomic
    from ...eval.shapes_eval import evaluate_shapes, ground_truth_scores

    require("scipy", "eval")  # the detector's, said before the model loads
    pipe = load_pipeline(args)
    options = dict(parse_option(o) for o in args.opt)
    if args.batch_size < 1:
        raise VisarError("--batch-size must be >= 1")
    if args.n < 1:
        raise VisarError("--n must be >= 1")
    if args.ground_truth:
        # renders laid out as the model's training data was (its recipe's render options)
        scores = ground_truth_scores(args.n, pipe.is_class_conditional, class_render_options(pipe.recipe))
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
            entropy_temperature=args.entropy_temperature,
            **kv_keep_kwargs(args),
            **deterministic_kwargs(args),
            **options,
        )
    if "accuracy" in record:
        print(f"{record['model']} / {record['method']}: detector accuracy {record['accuracy']:.1%} on {args.n} images")
    else:
        tasks = ", ".join(f"{k} {v:.1%}" for k, v in record["tasks"].items())
        print(f"{record['model']} / {record['method']}: overall {record['overall']:.1%} ({tasks}) on {args.n} images")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(args.json), record)
    return 0


# -- eval fid ----------------------------------------------------------------------------------------


def add_fid_parser(subparsers):
    parser = subparsers.add_parser(
        "fid",
        help="generate (resumable) or read N images, pack the ADM .npz, and compute FID / IS / precision-recall",
        description="Image g of N has class g mod C (N a multiple of the C classes) or prompt g mod P, and seed "
        "SEED + g, so the set is the same for any batch size, any --shard split and any interruption (up to a rare "
        "near-tie that another batch shape's rounding flips; complete "
        "files are kept). Writes OUT/samples/000000.png ..., OUT/config.json, OUT/samples.npz (arr_0, uint8 "
        "[N, H, W, 3], the ADM evaluator's format) and, with --ref, OUT/metrics.json, using torch-fidelity "
        '(pip install -e ".[eval]").',
    )
    add_model_args(parser)
    add_sampling_args(parser)
    parser.add_argument("--n", type=int, help="number of images (e.g. 50000)")
    parser.add_argument("--out", required=True, help="output folder (samples/, samples.npz, config.json, metrics.json)")
    parser.add_argument(
        "--ref",
        help="reference: a folder of images, a torch-fidelity registered input (e.g. cifar10-train), or an .npz "
        "with mu/sigma statistics (ADM's VIRTUAL_imagenet256_labeled.npz) or with arr_0 images",
    )
    parser.add_argument(
        "--feature-extractor",
        default="inception-v3-compat",
        choices=["inception-v3-compat", "visar-shapes-vq"],
        help="inception-v3-compat (Inception FID/IS, needs its weights file) or visar-shapes-vq (offline "
        "shapes-world features; NOT Inception, named so in the output); default inception-v3-compat",
    )
    parser.add_argument(
        "--inception-weights",
        metavar="FILE",
        help="weights-inception-2015-12-05-6726825d.pth (torch-fidelity's feature_extractor_weights_path); "
        "default: torch hub's cache, $TORCH_HOME/hub/checkpoints/",
    )
    parser.add_argument(
        "--isc", action=argparse.BooleanOptionalAction, default=True, help="Inception Score (default on)"
    )
    parser.add_argument(
        "--prc", action=argparse.BooleanOptionalAction, default=True, help="precision/recall, k = 3 (default on)"
    )
    parser.add_argument("--shard", metavar="I/K", help="generate only the images g with g mod K = I (no metrics)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="images decoded at once (default 16; a refilling method's running batch of this many slots)",
    )
    parser.add_argument("--fidelity-batch-size", type=int, default=64, help="images per feature batch (default 64)")
    parser.add_argument(
        "--metadata", help="text-conditional models: GenEval-format prompts (default: the shipped shapes-world set)"
    )
    parser.add_argument("--images", metavar="DIR|NPZ", help="score these images instead of generating (no model used)")
    parser.set_defaults(func=run_fid)


def run_fid(args) -> int:
    from ...eval.fid import SHAPES, evaluate_fid, format_metrics, parse_shard, read_prompts

    shard = parse_shard(args.shard)
    if args.ref is not None and shard == (0, 1):  # the metrics' modules, said before any image is generated
        require("torch_fidelity", "eval")
        if args.feature_extractor == SHAPES:  # its features come with the detector's
            require("scipy", "eval")
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
        from ...loading import resolve_device

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


# -- eval renders ------------------------------------------------------------------------------------


def add_renders_parser(subparsers):
    parser = subparsers.add_parser(
        "renders",
        help="write N ground-truth shapes-world renders, a reference folder for eval fid",
        description="Write OUT/000000.png ...: image g is a render of class g mod 40 (or, with --text, of prompt "
        "g mod P of --metadata) with render seed SEED + g, in the world --model was trained on. Complete files "
        "are kept.",
    )
    parser.add_argument("--n", type=int, required=True, help="number of renders")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="render g uses seed SEED + g (default 0)")
    parser.add_argument(
        "--text", action="store_true", help="render prompts (the text-conditional layout) instead of classes"
    )
    parser.add_argument("--metadata", help="with --text: GenEval-format prompts (default: the shipped set)")
    parser.add_argument(
        "--model",
        help="draw class renders as this shapes-world model's training data (its recipe's render options, e.g. "
        "larger objects on calmer backgrounds); default: the full world",
    )
    parser.set_defaults(func=run_renders)


def run_renders(args) -> int:
    from ...eval.fid import render_options_of, write_renders

    class_render = render_options_of(args.model) if args.model else None
    written = write_renders(
        args.out, args.n, text=args.text, metadata=args.metadata, seed=args.seed, class_render=class_render
    )
    print(f"{args.out}: {written} renders written, {args.n - written} already there")
    return 0


# -- eval geneval ------------------------------------------------------------------------------------


def add_geneval_parser(subparsers):
    parser = subparsers.add_parser(
        "geneval",
        help="write GenEval's image layout for a prompt file; score it on shapes-world models",
        description="From GenEval-format metadata (one JSON object a line), write OUT/00000/metadata.jsonl and "
        "OUT/00000/samples/00000.png ... (--n-samples per prompt; image j of prompt i with seed SEED + i * "
        "N_SAMPLES + j), resuming an interrupted run. Shapes-world models (the embedded ones) are scored with the "
        "shapes detector and GenEval's rules: OUT/results.jsonl, OUT/summary.json and GenEval's summary "
        "(overall = mean of the six task accuracies). Other models: run GenEval's evaluator on OUT.",
    )
    add_model_args(parser)
    add_sampling_args(parser)
    add_negative_prompt_arg(parser)
    parser.add_argument("--metadata", help="evaluation_metadata.jsonl (default: the shipped shapes-world prompts)")
    parser.add_argument("--out", required=True, help="output folder (GenEval's layout)")
    parser.add_argument("--n-samples", type=int, default=4, help="images per prompt (default 4, GenEval's)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="images decoded at once (default 16; a refilling method's running batch of this many slots)",
    )
    parser.add_argument(
        "--score",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="score with the shapes detector (default: on for embedded shapes-world models, off otherwise)",
    )
    parser.set_defaults(func=run_geneval)


def run_geneval(args) -> int:
    from ...eval.geneval import evaluate_geneval, format_summary
    from ...registry import embedded_models

    pipe = load_pipeline(args)
    check_negative_prompt(pipe, args)
    score = args.score if args.score is not None else pipe.name in embedded_models()
    if score:  # the detector's, said before any image is generated
        require("scipy", "eval")
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
