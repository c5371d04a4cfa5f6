"""`visar serve`'s Prometheus metrics (prometheus-client), shared by its HTTP process and its inference
worker through prometheus-client's multiprocess mode: `visar serve` points PROMETHEUS_MULTIPROC_DIR at
a folder of its own before either imports this module, and `GET /metrics` collects every process's.

Images/s is `rate(visar_images_total[1m])`; acceptance is visar_tokens_per_pass (an image's tokens over
its forward passes, 1 for plain AR)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

REQUESTS = Counter("visar_requests_total", "Image requests answered, by HTTP status", ["status"])
IN_FLIGHT = Gauge("visar_requests_in_flight", "Requests accepted and not yet answered", multiprocess_mode="livesum")
LATENCY = Histogram(
    "visar_request_seconds",
    "Seconds from a request's arrival to its last image",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
)
IMAGES = Counter("visar_images_total", "Images generated (rate() of it: images/s)")
PASSES = Counter("visar_passes_total", "Forward passes of the running batches")
SLOTS = Gauge("visar_slots_in_use", "Slots of the running batches holding an image", multiprocess_mode="livesum")
WAITING = Gauge("visar_images_waiting", "Images queued for a free slot", multiprocess_mode="livesum")
TOKENS_PER_PASS = Histogram(
    "visar_tokens_per_pass",
    "An image's tokens over its forward passes (acceptance; 1 for plain AR)",
    buckets=(1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32),
)


def exposition() -> tuple[bytes, str]:
    """Every process's metrics in Prometheus' text format, and its content type."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry), CONTENT_TYPE_LATEST
