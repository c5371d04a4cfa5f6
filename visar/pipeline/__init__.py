"""The `Pipeline` every command, benchmark and demo goes through (`visar.load` builds it: `visar.loading`).

Its parts: `pipeline.py` (the `Pipeline` and its `generate`), `conditions.py` (what a call conditions on,
one row per image, and each image's seed), `runs.py` (a decoding method's run over a call's images),
`compiling.py` (torch.compile with an eager fallback) and `drafts.py` (draft models given by name, and
whether a draft's tokenizer is the target's).
"""

from .compiling import EagerFallback
from .drafts import same_tokenizer
from .pipeline import OUTPUT_TYPES, GenerationOutput, Pipeline

__all__ = ["OUTPUT_TYPES", "EagerFallback", "GenerationOutput", "Pipeline", "same_tokenizer"]
