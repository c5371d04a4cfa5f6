"""The `Pipeline` every command, benchmark and demo goes through (`visar.load` builds it: `visar.loading`).

Its parts: `pipeline.py` (the `Pipeline` and its `generate`), `conditions.py` (what a call conditions on,
one row per image, each image's seed, the sampling settings), `runs.py` (a decoding method's run over a
call's images), `images.py` (what `generate` returns, tokens decoded to images), `compiling.py`
(torch.compile with an eager fallback), `open_batch.py` (a running batch that images join while it
decodes), `shared_device.py` (one thread that runs many callers' open batches and calls on a device)
and `drafts.py` (draft models given by name, and whether a draft's tokenizer is the target's).
"""

from .compiling import EagerFallback
from .drafts import same_tokenizer
from .images import OUTPUT_TYPES, GenerationOutput
from .open_batch import OpenBatch
from .pipeline import Pipeline
from .shared_device import BatchImages, SharedDevice

__all__ = [
    "OUTPUT_TYPES",
    "BatchImages",
    "EagerFallback",
    "GenerationOutput",
    "OpenBatch",
    "Pipeline",
    "SharedDevice",
    "same_tokenizer",
]
