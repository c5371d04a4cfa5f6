"""Count the host read-backs of a decode: operations after which the host must wait for the device.

On a GPU a decoding loop stalls the launch queue each time the host needs a value the device has
not finished computing: `.item()`, `int(t)`, `bool(t)` (`if t.any():`), `.tolist()`, `.cpu()`,
`nonzero` and what is built on it (`torch.where(mask)`, boolean-mask indexing and assignment),
`masked_select`, `unique`, `torch.equal`, `repeat_interleave` without an output size (any
operation whose output shape depends on the data), and blocking copies between host and device.
`ReadBackCounter` counts them with a `TorchDispatchMode`, so it sees them on a CPU too, where
they cost little, and a loop can be freed of them before it ever meets a GPU.

What a CPU run cannot see: copies between host and device (on a CPU there is no such copy; on a
GPU the counter counts device-to-host copies and blocking host-to-device ones) and `.numpy()`
(which shares a CPU tensor's memory; on a GPU it needs a `.cpu()` first, which is counted).
`.tolist()` does not pass through the dispatcher on a CPU tensor, so the counter wraps it while
active. Compiled code is not looked into: under an active dispatch mode torch.compile runs the
function eagerly, so a decode is counted as its eager twin.

The counter also counts every operation dispatched (`ops`): in eager mode each one is a Python
dispatch and, on a GPU, a kernel launch, so ops per forward pass is what a decode's bookkeeping
costs beside its model call on any device (`visar bench`'s ops/pass column).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operations that return host values or data-dependent shapes: each one waits for the device.
SYNCING = {
    aten._local_scalar_dense.default: "item",  # .item(), int(t), float(t), bool(t)
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.equal.default: "equal",
    aten.allclose.default: "allclose",
}


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)


def _classify(func, args, kwargs) -> str | None:
    """The read-back kind of one dispatched call, or None if the host does not wait on it."""
    if func in SYNCING:
        return SYNCING[func]
    packet = func.overloadpacket
    if packet in (aten.index, aten.index_put_, aten.index_put, aten._index_put_impl_) and _bool_index(args[1]):
        return "bool index"
    if packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor) and len(args) == 1:
        if kwargs.get("output_size") is None:  # repeats as a tensor: the output length is their sum
            return "repeat_interleave"
    if packet in (aten._to_copy, aten.copy_):
        src = args[1] if packet is aten.copy_ else args[0]
        if not isinstance(src, torch.Tensor):
            return None
        dst_device = args[0].device if packet is aten.copy_ else kwargs.get("device") or src.device
        dst_device = torch.device(dst_device)
        if src.device.type != "cpu" and dst_device.type == "cpu":
            return "device to host copy"
        if src.device.type == "cpu" and dst_device.type != "cpu" and not kwargs.get("non_blocking", False):
            if packet is aten._to_copy or not (len(args) > 2 and args[2]):
                return "blocking host to device copy"
    return None


class ReadBackCounter(TorchDispatchMode):
    """`with ReadBackCounter() as counter: ...` -> `counter.total` read-backs, `counter.by_kind`, and
    `counter.ops`, every aten operation dispatched (views included)."""

    def __init__(self):
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self.ops = 0
        self.quiet = 0  # > 0 inside a counted .tolist(), whose own copy to the host is not counted again

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        kind = None if self.quiet else _classify(func, args, kwargs)
        if kind is not None:
            self.by_kind[kind] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted_tolist(tensor):
            counter.by_kind["tolist"] += 1
            counter.quiet += 1
            try:
                return tolist(tensor)
            finally:
                counter.quiet -= 1

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def count_read_backs(fn, *args, **kwargs):
    """Run fn(*args, **kwargs) under a `ReadBackCounter` -> (its result, the counter)."""
    with ReadBackCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter
