"""`visar serve`: an HTTP server whose callers share one running batch (`visar.apps.serve`)."""

from __future__ import annotations

import os
import tempfile

from ...errors import VisarError, require
from .common import add_model_args


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "serve",
        help='an HTTP server whose requests share one running batch (pip install -e ".[serve]")',
        description="Serve POST /v1/images/generations (OpenAI's Images fields and visar's: class_label, "
        "negative_prompt, guidance_scale, seed, method), GET /health and GET /metrics (Prometheus) on LitServe. "
        "Every request's images join one running batch of --slots slots between its passes, each with the law "
        "of its decode alone. docs/SERVING.md has the API and the figures.",
    )
    add_model_args(parser)
    parser.add_argument(
        "--method",
        default="auto",
        help="the method requests that name none decode with: a lossless one that refills its slots (sjd, mc-sjd, "
        "tree-mc-sjd, ...); default auto: the one auto settles on for batches of --slots, chosen at start",
    )
    parser.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="an option of --method")
    parser.add_argument("--slots", type=int, default=8, help="images decoded at once (default 8)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--max-queue", type=int, default=64, help="requests in flight at most; past it 429 (default 64)"
    )
    parser.add_argument("--max-n", type=int, default=8, help="images a request may ask for (default 8)")
    parser.add_argument("--timeout", type=float, default=300, help="a request's deadline in seconds; past it 504")
    parser.add_argument(
        "--drain-timeout", type=float, default=60, help="after SIGTERM, seconds to finish requests in flight"
    )
    parser.add_argument("--devices", type=int, default=1, help="GPUs, one inference worker each (default 1)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ...accel import METHODS

    for flag, value in (("--slots", args.slots), ("--max-queue", args.max_queue), ("--max-n", args.max_n)):
        if value < 1:
            raise VisarError(f"{flag} must be >= 1, got {value}")
    if not 1024 <= args.port <= 65535:
        raise VisarError(f"--port must be in 1024..65535 (LitServe's range), got {args.port}")
    if args.host not in ("127.0.0.1", "0.0.0.0", "::"):
        raise VisarError(f"--host must be 127.0.0.1, 0.0.0.0 or :: (LitServe's), got {args.host}")
    if args.timeout <= 0 or args.drain_timeout < 0:
        raise VisarError("--timeout must be > 0 and --drain-timeout >= 0")
    method = METHODS.get(args.method)
    if args.method != "auto" and (method is None or not method.refills):
        refilling = ", ".join(sorted(name for name, m in METHODS.items() if m.refills and name != "auto"))
        raise VisarError(
            f"--method must be auto or a method that refills a running batch's slots ({refilling}), got "
            f"{args.method!r} (AR's law at one token a pass: --method mc-sjd --opt budget=1)"
        )
    # before prometheus_client is imported, here or in the worker LitServe spawns (serve/metrics.py)
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:  # a folder of this server's, removed at its end
        made = tempfile.mkdtemp(prefix="visar-serve-metrics-")
        os.environ.update(PROMETHEUS_MULTIPROC_DIR=made, VISAR_SERVE_METRICS_DIR=made)
    require("litserve", "serve")
    require("prometheus_client", "serve")
    from ..serve import serve

    return serve(args)
