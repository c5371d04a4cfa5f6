"""Wall-clock reads that mean what they say on an asynchronous device.

CUDA kernels run after the Python call that launched them returns, so a clock read without a
synchronisation measures launches, not work. Every latency visar reports (a method's latency_s,
`visar bench`) reads the clock through `synchronized_clock`; on a CPU it is `time.perf_counter`.
"""

from __future__ import annotations

import time

import torch


def synchronized_clock(device: torch.device) -> float:
    """time.perf_counter() after the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
