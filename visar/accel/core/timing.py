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


class StepTimer:
    """Times a loop's steps, then stops it: each `tick()` (one a step, before it) records the
    seconds since the last, and answers False once `steps` of them are timed. `auto` times AR steps
    with it (`auto.ar_step_seconds`: the reference its tuning is kept against)."""

    def __init__(self, steps: int, device: torch.device):
        self.steps, self.device = steps, device
        self.times: list[float] = []
        self.clock: float | None = None

    def tick(self) -> bool:
        now = synchronized_clock(self.device)
        if self.clock is not None:
            self.times.append(now - self.clock)
        self.clock = now
        return len(self.times) < self.steps
