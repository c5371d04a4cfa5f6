"""Peak tensor memory of a piece of work, on CPU as on CUDA, for `visar bench`.

CUDA has an allocator that counts (`torch.cuda.max_memory_allocated`). On CPU the process's peak
RSS only grows, so after the first method it says nothing of the next. `TensorMemory` counts
instead what the work allocates, through a dispatch mode: every storage an operation creates is
added when it appears and subtracted when it is freed (a finalizer on the storage), and the peak
of that sum is kept. Storages that existed before (model weights, a view of one) are not counted,
so both devices report the memory of the work above what was held before it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemory(TorchDispatchMode):
    """`with TensorMemory() as memory: ...` -> memory.peak_bytes, the most bytes of tensor storage
    created inside the block and alive at one time (eager operations; a compiled region under
    this mode runs eagerly)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes, for storages created in the block
        self.bytes = 0
        self.peak_bytes = 0

    def freed(self, address: int):
        self.bytes -= self.live.pop(address, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
            # a view or in-place result shares an input's storage; an old storage is not the block's
            if size == 0 or address in inputs or address in self.live:
                continue
            self.live[address] = size
            self.bytes += size
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            weakref.finalize(storage, self.freed, address)
        return out


class PeakMemory:
    """`with PeakMemory(device) as memory: ...` -> memory.peak_mb: the peak memory the block allocated
    above what was allocated before it, in MiB. CUDA: the allocator's peak (reset on entry) less what
    was allocated on entry; other devices: `TensorMemory`, or None with count_tensors=False (counting
    slows the block down)."""

    def __init__(self, device: torch.device, count_tensors: bool = True):
        self.device = torch.device(device)
        self.counter = TensorMemory() if self.device.type != "cuda" and count_tensors else None
        self.peak_mb: float | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        elif self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = (torch.cuda.max_memory_allocated(self.device) - self.before) / 2**20
        elif self.counter is not None:
            self.counter.__exit__(*exc)
            self.peak_mb = self.counter.peak_bytes / 2**20
        return False
