"""visar: faster sampling for image autoregressive models, behind one interface.

import visar
pipe = visar.load("default")
out = pipe.generate(class_labels=[0, 1], method="ar", seed=0)
out.images[0].save("0.png"); print(out.stats)
"""

import importlib

from .errors import VisarError

__all__ = ["GenerationOutput", "Pipeline", "VisarError", "list_methods", "list_models", "load"]
__version__ = "0.1.0"

# The API is imported on first use (PEP 562): torch and the model code take seconds to import, which
# `visar --help` and a script that only reads `visar.__version__` should not wait for.
_LAZY = {
    "GenerationOutput": ".pipeline",
    "Pipeline": ".pipeline",
    "list_methods": ".accel",
    "list_models": ".registry",
    "load": ".loading",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'visar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
