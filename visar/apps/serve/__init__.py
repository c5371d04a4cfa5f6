"""`visar serve`: an HTTP server whose callers share one running batch (LitServe's continuous batching).

    pip install -e ".[serve]"
    visar serve --model visar-tiny-c2i --slots 8 --port 8000
    curl -s localhost:8000/v1/images/generations -d '{"class_label": 3, "n": 2, "seed": 0}'

LitServe runs the HTTP side (FastAPI and uvicorn, `http.py`) in this process and the model in an
inference worker process (`worker.py`), one per device with --devices; every request's images join an
open, paced running batch of --slots slots between passes, each image with the law of its decode
alone (on a CPU at one torch thread, the same bits as `visar generate` with its seed). docs/SERVING.md:
the API, the metrics, the figures, and running one server per GPU or many behind a load balancer.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import threading
import time


def load_for_worker(args, device):
    """The worker's pipeline: --model and its load flags on LitServe's device for this worker."""
    from ..commands.common import load_pipeline

    args.device = str(device)
    return load_pipeline(args)


def build_server(args):
    """The LitServer of `visar serve`'s flags -> (server, spec)."""
    import litserve as ls
    import torch
    from fastapi.exceptions import RequestValidationError

    from ..commands.common import parse_option
    from .http import ImagesSpec, validation_error
    from .worker import ImagesAPI

    spec = ImagesSpec(max_queue=args.max_queue, timeout=args.timeout)
    api = ImagesAPI(
        functools.partial(load_for_worker, args), args.model, method=args.method, slots=args.slots,
        options=dict(parse_option(o) for o in args.opt), max_images=args.max_n, spec=spec,
    )  # fmt: skip
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    server = ls.LitServer(
        api, accelerator="cuda" if cuda else "cpu", devices=args.devices if cuda else 1, timeout=False,
    )  # fmt: skip
    server.app.add_exception_handler(RequestValidationError, validation_error)
    return server, spec


def serve(args) -> int:
    """Run the server of `visar serve`'s flags until Ctrl+C or SIGTERM (PROMETHEUS_MULTIPROC_DIR set)."""
    server, spec = build_server(args)

    main = os.getpid()

    def drain(signum, frame):  # SIGTERM: no new requests; those in flight are answered, then exit 0
        if os.getpid() != main or spec.draining:  # LitServe's forked manager inherits this handler
            return
        spec.draining = True

        def stop_when_answered():
            end = time.monotonic() + args.drain_timeout
            while spec.in_flight > 0 and time.monotonic() < end:
                time.sleep(0.05)
            time.sleep(0.5)  # the last answers leave their sockets
            # LitServe's stop (workers, then its manager) logs errors for a thread-mode HTTP server it
            # cannot terminate and a monitor that outlives the manager: this stop is meant
            logging.getLogger("litserve.server").setLevel(logging.CRITICAL)
            server._shutdown_event.set()  # what LitServe's own /shutdown endpoint sets

        threading.Thread(target=stop_when_answered, daemon=True).start()

    signal.signal(signal.SIGTERM, drain)
    url = f"http://{args.host}:{args.port}"
    print(f"visar serve: {url}/v1/images/generations (GET /health, /metrics); Ctrl+C or SIGTERM stops it", flush=True)
    server.run(
        host=args.host, port=args.port, num_api_servers=1, api_server_worker_type="thread",
        generate_client_file=False, log_level="warning",
    )  # fmt: skip
    # LitServe has stopped its workers (after a drain, every request answered; or at Ctrl+C), but the
    # thread it runs uvicorn in would keep the process alive
    if made_metrics_dir := os.environ.get("VISAR_SERVE_METRICS_DIR"):  # the folder `visar serve` made
        shutil.rmtree(made_metrics_dir, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0 if spec.draining else 130)
