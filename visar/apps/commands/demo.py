"""`visar demo`: the Gradio page comparing a model's reference decoding with a method (`visar.apps.demo`)."""

from __future__ import annotations

import argparse

from ...errors import VisarError


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "demo",
        help='a Gradio page: the reference decoding and a method side by side (pip install -e ".[demo]")',
        description="Serve a Gradio page that samples one class or prompt with the reference decoding of the "
        "model's kind (plain AR for raster models) and with a chosen method "
        "on the same seed and shows both images, forward passes, step compression, sampling time, speed-up, "
        "whether the method is lossless, and when each token was committed. Binds 127.0.0.1 unless --host "
        "says otherwise; --share (a public Gradio link) is off by default.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, help="port (default: 7860, or the next free one)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link (default off)")
    parser.add_argument("--model", default="default", help="model shown first (default: the embedded default)")
    parser.add_argument(
        "--method",
        default="auto",
        help="method shown first (default auto: the fastest lossless one on this device; on a model of another "
        "kind than raster, the kind's fastest method)",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", default="fp32", help="generator dtype: fp32, bf16 or fp16 (default fp32)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="clicks served at once (default 4; the rest queue): their method sides share one running batch "
        "of this many slots where the method refills, and the reference runs take turns",
    )
    parser.add_argument("--max-queue", type=int, default=32, help="requests waiting at most (default 32)")
    parser.add_argument(
        "--allow-folders",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the page load model folders typed in (default: yes on a loopback host without --share, else no)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from ..demo import launch

    if not 0 <= (args.port or 0) <= 65535:
        raise VisarError(f"--port must be in 0..65535, got {args.port}")
    if args.concurrency < 1 or args.max_queue < 1:
        raise VisarError("--concurrency and --max-queue must be >= 1")
    launch(
        host=args.host,
        port=args.port,
        share=args.share,
        allow_folders=args.allow_folders,
        model=args.model,
        method=args.method,
        device=args.device,
        dtype=args.dtype,
        concurrency=args.concurrency,
        max_queue=args.max_queue,
    )
    return 0
